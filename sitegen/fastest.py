"""The fastest PyTorch line per shape, and a pass's speedup over it: the figure beside the headline.

The headline speedup divides by `torch.compile` (its faster mode per shape). On some problems eager
PyTorch or the problem's library line (`torch.topk`, FLA's `chunk_kda`, tinygemm) is faster than the
compiler, and then a speedup over compile overstates the gain over what PyTorch already offers. So the
pages also show the speedup over the **fastest PyTorch line**: per shape, the smallest median among the
lines measured for that shape on that GPU — every `ok` row of the baselines table (eager, each compile
mode, each library line) and the eager and compile times the run itself was compared with
(shapes.parquet; for an imported run, its source's per-shape times) — divided by the solution's median,
then the geomean over the run's shapes. It is never above the headline speedup, and equals it where the
headline's line is the fastest on every shape. The pages mark a run, a shape or a problem only where that
line is beaten: the headline divides by torch.compile on Hard and by the deck's own baseline on Mega
(baseline.py, its `Result.baseline_variant`), which is usually the fastest line there, so a Mega cell
repeating its headline as "vs fastest" would only say the same number twice. A shape without a solution
time or without any line time gives no figure at all (None): nothing is guessed. Pure arithmetic over
loaded records, no I/O.

A time is only ever divided by a time taken the same way: grader 0.4.0 times GPU calls with their
dispatch covered (rows with a `timing_method`), older graders synchronised (rows without one), so a
shape's lines are the baselines of its own method; the problem page shows the newer method's lines
where a shape has both (while a regrade is under way).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kernelboard.eval.roofline import geomean

from .load import COMPILE_LABEL, DECK_BASELINE_LABEL, Baseline, Result, ShapeResult

__all__ = ["FastestLines", "Line", "ShapeLines", "VsFastest"]


#: At equal times the line earlier here is named fastest: a tie with compile never marks a shape (and a
#: deck's own baseline comes before all of them).
_KIND_ORDER = {"compile": 0, "eager": 1, "library": 2}


@dataclass(frozen=True)
class Line:
    """One baseline line's median time on one shape: 'eager', 'compile:<mode>' ('compile' when the run
    names no single mode), or 'library:<name>'."""

    variant: str
    ms: float
    label: str | None = None  # the name the pages print, where it is not read from the variant (the deck's baseline)

    @property
    def kind(self) -> str:
        """'eager', 'compile' or 'library' (older rows spell a mode 'compile(<mode>)'), else the variant."""
        return next((k for k in _KIND_ORDER if self.variant.startswith(k)), self.variant)

    @property
    def detail(self) -> str:
        """The mode or library: 'max-autotune', 'torch.topk'; '' for eager or an unnamed compile mode."""
        return self.variant[len(self.kind):].strip(":()")

    @property
    def name(self) -> str:
        """As the pages print it: 'eager', 'torch.compile (max-autotune)', 'torch.topk', 'baseline.py'."""
        if self.label is not None:
            return self.label
        if self.kind == "compile":
            return f"torch.compile ({self.detail})" if self.detail else "torch.compile"
        return self.detail if self.kind == "library" and self.detail else self.variant


@dataclass(frozen=True)
class ShapeLines:
    """The lines measured for one shape on one GPU: the fastest of all, and the headline's: what the
    headline speedup divides by there (the fastest torch.compile mode, or the deck's own baseline), named
    `over` as the pages print it."""

    shape_idx: int
    shape_label: str
    fastest: Line
    headline: Line | None
    over: str = COMPILE_LABEL

    @property
    def headline_beaten(self) -> bool:
        """The headline's line was measured, and another line is faster (strictly: at equal times the
        headline's line is named fastest)."""
        return self.headline is not None and self.fastest.ms < self.headline.ms


def _shape_lines(shape_idx: int, label: str, lines: Iterable[Line], deck_baseline: str | None) -> ShapeLines | None:
    """`deck_baseline`: the variant a deck's own headline divides by (Mega's 'library:tuned'), else None
    (the headline divides by torch.compile's fastest mode)."""
    lines = [line for line in lines if line.ms > 0]
    if deck_baseline is not None:
        lines = [replace(line, label=DECK_BASELINE_LABEL) if line.variant == deck_baseline else line for line in lines]
    if not lines:
        return None
    ranked = sorted(lines, key=lambda line: (line.ms, line.variant != deck_baseline,
                                              _KIND_ORDER.get(line.kind, 3), line.variant))
    if deck_baseline is None:
        headline, over = next((line for line in ranked if line.kind == "compile"), None), COMPILE_LABEL
    else:
        headline, over = next((line for line in ranked if line.variant == deck_baseline), None), DECK_BASELINE_LABEL
    return ShapeLines(shape_idx, label, ranked[0], headline, over)


def summary(lines: Iterable[ShapeLines]) -> str:
    """Which line is fastest on how many shapes, most first: 'eager on 3 shapes, torch.topk on 2'."""
    counts = sorted(Counter(s.fastest.name for s in lines).items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{name} on {n}" for name, n in counts]
    if parts:
        parts[0] += " shape" if counts[0][1] == 1 else " shapes"
    return ", ".join(parts)


@dataclass(frozen=True)
class VsFastest:
    """A pass's speedup over the fastest PyTorch line: per shape (its lines, the speedup) and the geomean."""

    value: float
    shapes: tuple[tuple[ShapeLines, float], ...]

    @property
    def n(self) -> int:
        return len(self.shapes)

    @property
    def over(self) -> str:
        """What the run's headline divides by, as the pages name it ('torch.compile', 'baseline.py')."""
        return self.shapes[0][0].over if self.shapes else COMPILE_LABEL

    @property
    def beaten(self) -> int:
        """Shapes on which the headline's line is not the fastest."""
        return sum(1 for lines, _ in self.shapes if lines.headline_beaten)

    @property
    def marked(self) -> bool:
        """The headline's line is not the strongest baseline on some shape of this run: the pages say so."""
        return self.beaten > 0

    @property
    def who(self) -> str:
        """Which lines are fastest, over this run's shapes ('eager on 3 shapes, torch.topk on 2')."""
        return summary(lines for lines, _ in self.shapes)

    @property
    def by_shape(self) -> dict[int, tuple[ShapeLines, float]]:
        return {lines.shape_idx: (lines, value) for lines, value in self.shapes}

    @property
    def terms(self) -> tuple[float, ...]:
        return tuple(value for _, value in self.shapes)

    @property
    def note(self) -> str:
        """One line for a tooltip: what the figure is and why it is shown."""
        return (f"{self.over} is not the fastest PyTorch line on {self.beaten} of {self.n} "
                f"shape{'s' if self.n != 1 else ''} ({self.who}); over the fastest line per shape this "
                f"run is {self.value:.2f}× (geomean)")


class FastestLines:
    """The baselines table indexed by (bench, problem, GPU, shape): each shape's fastest line, and each
    pass's speedup over it. Built once per page kind from `SiteData.baselines`, passed to whoever needs it."""

    def __init__(self, baselines: Iterable[Baseline]) -> None:
        # keyed by (bench, problem, GPU, shape, covered): covered is whether the line has a timing_method
        self._lines: dict[tuple[str, str, str, int, bool], list[Line]] = defaultdict(list)
        self._labels: dict[tuple[str, str, str, int], str] = {}
        for b in baselines:
            if b.status == "ok" and b.median_ms is not None and b.median_ms > 0:
                self._lines[(b.bench, b.problem, b.gpu, b.shape_idx, b.timing_method is not None)].append(
                    Line(b.variant, b.median_ms))
                self._labels[(b.bench, b.problem, b.gpu, b.shape_idx)] = b.shape_label

    def problem(self, bench: str, problem: str, gpu: str, deck_baseline: str | None = None) -> tuple[ShapeLines, ...]:
        """Every shape of a problem on a GPU that has a baseline row, by shape index (the problem page),
        each with the lines of the newer timing method it has; `deck_baseline` as its board's results name
        it (`Result.baseline_variant`), else None."""
        shapes = sorted({k[3] for k in self._lines if k[:3] == (bench, problem, gpu)})
        found = (_shape_lines(i, self._labels[(bench, problem, gpu, i)],
                              self._lines.get((bench, problem, gpu, i, True))
                              or self._lines[(bench, problem, gpu, i, False)], deck_baseline) for i in shapes)
        return tuple(s for s in found if s is not None)

    def _own_lines(self, result: Result, shape: ShapeResult) -> list[Line]:
        """The eager, compile and deck-baseline times the run was compared with on this shape."""
        mode = result.compile_variant or ""
        compile_variant = mode if mode.startswith("compile") and "," not in mode else "compile"
        own = [("eager", shape.eager_ms), (compile_variant, shape.compile_ms)]
        if result.baseline_variant is not None:
            own.append((result.baseline_variant, shape.baseline_ms))
        return [Line(v, ms) for v, ms in own if ms is not None and ms > 0]

    def of(self, bench: str, problem: str, result: Result) -> VsFastest | None:
        """A pass's speedup over the fastest line, or None when it is not a pass or some shape lacks a
        solution time or every line time."""
        if not result.is_pass or not result.shapes:
            return None
        rows = []
        for s in result.shapes:
            if s.median_ms is None or s.median_ms <= 0:
                return None
            key = (bench, problem, result.gpu, s.shape_idx, s.timing_method is not None)
            lines = _shape_lines(s.shape_idx, s.shape_label, [*self._lines.get(key, ()), *self._own_lines(result, s)],
                                 result.baseline_variant)
            if lines is None:
                return None
            rows.append((lines, lines.fastest.ms / s.median_ms))
        return VsFastest(geomean([v for _, v in rows]), tuple(rows))

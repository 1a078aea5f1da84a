"""What each page shows: the template context of the home, problem and run pages.

Contexts hold the loaded records themselves (templates read their fields under StrictUndefined)
plus what a template should not compute: charts, rendered Markdown, the source tagged with its language, and the
printed arithmetic behind each headline number. Links are made in the templates with `url()`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlsplit

from markdown_it import MarkdownIt
from markupsafe import Markup

from kernelboard.eval.roofline import geomean

from . import charts
from .board import (
    ORDERING_RULE,
    OUTCOME_LABELS,
    SPEEDUP,
    STATUS_HELP,
    STATUS_LABELS,
    STATUS_TONES,
    Board,
    Metric,
    best_per_model,
    build_boards,
    gpu_label,
    graders,
    metrics_by_board,
    no_speedup_reason,
    off_board_label,
    problem_entries,
    reason_for,
    result_metric,
    status_label,
    tab_order,
    to_regrade,
)
from .fastest import FastestLines, ShapeLines, summary
from .format import model_slug, num, pct, speedup
from .highlight import Code, code, page_gives_back
from .load import CPU_KEY, HOST_BOUND_RATIO, Hardware, Problem, Result, SiteData
from .run_notes import run_times, stale_claim

#: A heading's explicit anchor in Markdown prose: "## Imported boards {#imported}" gets id="imported".
_ANCHOR = re.compile(r"\s*\{#([a-z][a-z0-9-]*)\}\s*$")


@lru_cache(maxsize=256)
def _markdown(text: str) -> Markup:
    """CommonMark plus tables, raw HTML off, headings moved one level down (the page owns h1), table
    headers scoped; a heading ending in `{#name}` gets that id (so a page can link to it), the
    suffix removed from its text.
    Cached per text: the same README or prose renders once per process."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(text)
    for i, token in enumerate(tokens):
        if token.type in ("heading_open", "heading_close"):
            token.tag = f"h{min(int(token.tag[1]) + 1, 6)}"
            inline = tokens[i + 1] if token.type == "heading_open" else None
            anchor = _ANCHOR.search(inline.content) if inline is not None else None
            if anchor and inline is not None and inline.children:
                token.attrSet("id", anchor.group(1))
                inline.content = inline.content[:anchor.start()]
                last = inline.children[-1]
                last.content = _ANCHOR.sub("", last.content)
        elif token.type == "th_open":  # Markdown tables only have column headers: say so to screen readers
            token.attrSet("scope", "col")
    return Markup(md.renderer.render(tokens, md.options, {}))


def _safe_href(url: str | None) -> str | None:
    """An external link only when it is http(s); anything else is shown as text, not linked."""
    return url if url and urlsplit(url).scheme in ("http", "https") else None


#: runs.source of an imported run: every file of a GitHub repository (at one commit) the row was read from,
#: "github:OWNER/NAME@COMMIT:path[;path…]".
_GITHUB_SOURCE = re.compile(r"^github:(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)"
                            r"@(?P<commit>[0-9a-fA-F]{7,40}):(?P<paths>.+)$")


@dataclass(frozen=True)
class SourceFile:
    """One file a run's row was read from, and its address on GitHub at that commit."""

    path: str
    href: str


@dataclass(frozen=True)
class SourceFiles:
    """A parsed `github:OWNER/NAME@COMMIT:path;path` source."""

    repo: str
    commit: str
    files: tuple[SourceFile, ...]

    @property
    def repo_href(self) -> str:
        return f"https://github.com/{self.repo}/tree/{self.commit}"


def source_files(source: str) -> SourceFiles | None:
    """The files of a `github:OWNER/NAME@COMMIT:path[;path…]` source with their blob links
    (https://github.com/OWNER/NAME/blob/COMMIT/path), or None for any other source (shown as text).
    A path that climbs out of the repository ('..') or is absolute makes the whole source text."""
    match = _GITHUB_SOURCE.match(source.strip())
    if match is None:
        return None
    paths = [p.strip() for p in match["paths"].split(";") if p.strip()]
    if not paths or any(p.startswith("/") or ".." in p.split("/") for p in paths):
        return None
    repo, commit = match["repo"], match["commit"]
    return SourceFiles(repo, commit, tuple(
        SourceFile(p, f"https://github.com/{repo}/blob/{commit}/{quote(p, safe='/')}") for p in paths))


@dataclass(frozen=True)
class MeasuredBy:
    """Who measured a board (or a run) and what it ranks on: the pages' "measured by" line."""

    imported: bool  # another grader measured it (KernelBench-Hard), an importer read it
    names: tuple[str, ...]  # the distinct `measured_by` values
    metric: Metric

    @classmethod
    def of_board(cls, board: Board) -> MeasuredBy:
        return cls(board.is_imported, board.measured_by, board.metric)

    @classmethod
    def of_results(cls, results: list[Result], metric: Metric) -> MeasuredBy:
        return cls(metric.imported, graders(results), metric)


def peak_text(problem: Problem, hardware: Hardware | None) -> str:
    """The peak a problem's roofline fraction is measured against on one GPU, in words."""
    if hardware is None:
        return "no datasheet peak (CPU timings)"
    if problem.regime == "memory":
        return f"memory bandwidth ({num(hardware.bandwidth_gb_s, 0)} GB/s)"
    key = problem.peak_tflops_key
    return f"dense {key} compute ({num(hardware.peak_tflop_s.get(key))} TFLOP/s)"


# ------------------------------------------------------------------------------------------ home


@dataclass(frozen=True)
class GpuTab:
    """One GPU's board inside a bench section of the home page: a tab with JavaScript, a section without."""

    bench: str
    gpu: str
    label: str
    is_cpu: bool
    hardware: Hardware | None
    board: Board  # cut to its top HOME_MODEL_ROWS model rows (plus its house rows)
    hidden: int  # model rows left off (they are on the GPU page)

    @property
    def measured(self) -> MeasuredBy:
        return MeasuredBy.of_board(self.board)

    @property
    def id(self) -> str:
        """The tab panel's id and URL hash, e.g. 'hard-h200': unique across benches, stable for deep links."""
        return f"{self.bench}-{self.gpu}"


@dataclass(frozen=True)
class BenchSection:
    """One bench (deck) on the home page, with a tab per GPU it has results on."""

    bench: str
    label: str
    tabs: tuple[GpuTab, ...]


#: Model rows a home board shows: the top ranks (house rows always follow); the GPU page has them all.
#: Keeps the home page light however many models have run: 10 rows × 6 problems × 4 GPUs ≈ 120 KB.
HOME_MODEL_ROWS = 10

#: Benches in home page order: these first, any other after them in name order.
BENCH_ORDER = ("hard", "mega")


def _top(board: Board) -> tuple[Board, int]:
    """The board with its first HOME_MODEL_ROWS model rows (rank order) and every house row; rows left off."""
    models = [r for r in board.rows if not r.is_house]
    if len(models) <= HOME_MODEL_ROWS:
        return board, 0
    return (dataclasses.replace(board, rows=(*models[:HOME_MODEL_ROWS], *(r for r in board.rows if r.is_house))),
            len(models) - HOME_MODEL_ROWS)


def bench_sections(data: SiteData) -> list[BenchSection]:
    """A section per bench that has graded results, each with its GPU tabs: the GPU boards kernelboard
    measured first (the first tab is the one shown), then the imported ones, then CPU test timings, each
    group in `gpu_order` (build_boards already yields boards in that order)."""
    boards = build_boards(data)
    benches = sorted({b.bench for b in boards},
                     key=lambda b: (BENCH_ORDER.index(b) if b in BENCH_ORDER else len(BENCH_ORDER), b))
    sections = []
    for bench in benches:
        ours = tab_order(b for b in boards if b.bench == bench)
        tabs = tuple(GpuTab(bench, b.gpu, b.label, b.is_cpu, data.hardware.get(b.gpu), *_top(b)) for b in ours)
        sections.append(BenchSection(bench, bench.title(), tabs))
    return sections


def home(data: SiteData) -> dict[str, Any]:
    sections = bench_sections(data)
    return {
        "title": "Leaderboards",
        "sections": sections,
        "problems": [data.problems[k] for k in sorted(data.problems)],
        "ordering_rule": ORDERING_RULE,
        "legend": [(s, STATUS_LABELS[s], STATUS_TONES[s], STATUS_HELP[s]) for s in STATUS_LABELS],
        "downloads": sorted(k for k in data.table_files if k.endswith(".parquet")),
        "n_runs": len(data.runs),
        "n_results": len(data.results),
        "charts": False,
    }


# --------------------------------------------------------------------------------------- problem


@dataclass(frozen=True)
class BaselineRow:
    shape_idx: int
    label: str
    cells: tuple[Any, ...]  # one Baseline (or None) per variant
    lines: ShapeLines | None = None  # the shape's fastest line, and the line its headline divides by


def _baseline_rows(data: SiteData, bench: str, name: str, gpu: str,
                   lines: tuple[ShapeLines, ...] = ()) -> tuple[tuple[str, ...], list[BaselineRow]]:
    """Baseline variants measured for a problem on a GPU, and one row per shape of their timings."""
    rows = [b for b in data.baselines if (b.bench, b.problem, b.gpu) == (bench, name, gpu)]
    variants = tuple(sorted({b.variant for b in rows}))
    by_shape: dict[int, dict[str, Any]] = {}
    labels: dict[int, str] = {}
    for b in rows:
        by_shape.setdefault(b.shape_idx, {})[b.variant] = b
        labels[b.shape_idx] = b.shape_label
    fastest = {s.shape_idx: s for s in lines}
    return variants, [BaselineRow(i, labels[i], tuple(by_shape[i].get(v) for v in variants), fastest.get(i))
                      for i in sorted(by_shape)]


#: The per-shape chart draws this many of the fastest passes (plus the house rows): more bars per
#: shape than this cannot be read, and the full per-shape numbers are on each run page.
SHAPE_CHART_PASSES = 10


def _shape_chart(gpu: str, gpu_label: str, passes: list[Any], field: str = "speedup_vs_compile",
                 over: str = "torch.compile") -> Markup | None:
    """The per-shape speedups (`field` of each shape row, over `over`) of the fastest passes on one GPU
    (only when a problem has several shapes); `passes` come best first (board.problem_entries) and all
    carry a speedup."""
    models = [e for e in passes if not e.run.is_house][:SHAPE_CHART_PASSES]
    passes = [e for e in passes if e.run.is_house or e in models]
    shape_labels: dict[int, str] = {}
    for e in passes:
        shape_labels.update({s.shape_idx: s.shape_label for s in e.result.shapes})
    if not passes or len(shape_labels) < 2:
        return None
    order = sorted(shape_labels)
    series = []
    for e in passes:
        by_idx = {s.shape_idx: getattr(s, field) for s in e.result.shapes}
        series.append((e.label, e.run.is_house, [by_idx.get(i) for i in order]))
    return charts.shape_chart(f"chart-shapes-{gpu}", [f"{i}: {shape_labels[i]}" for i in order], series, gpu_label,
                              over=over)


def problem(data: SiteData, bench: str, name: str) -> dict[str, Any]:
    prob = data.problems[(bench, name)]
    readme = prob.folder / "README.md"
    gpus = []
    metrics = metrics_by_board(data)
    lines = FastestLines(data.baselines)
    for gpu, every in problem_entries(data, bench, name, metrics).items():
        label = gpu_label(data, gpu)
        hardware = data.hardware.get(gpu)
        metric = metrics[(gpu, bench)]
        # One row and one bar per model: its best run on the board, the one its board cell shows. At
        # thousands of runs a row per run made megabyte pages and unreadable charts; the rest are on the
        # model pages. Runs kept off the board never stand for a model: they are listed on their own.
        best = best_per_model(every)
        entries = [b.entry for b in best]
        passes = [e for e in entries if e.result.is_pass]
        # The speedup the board ranks on: over the deck's own baseline (Mega), else over torch.compile. An
        # imported pass may carry none (its grader published no baselines): no speedup bar for it.
        speed = metric if metric.key == "speedup" else SPEEDUP  # a roofline board's bars: × torch.compile
        field, over = speed.field, speed.over
        fast = [e for e in passes if getattr(e.result, field) is not None]
        fast.sort(key=lambda e: -getattr(e.result, field))
        # CPU timings have no datasheet peak to be a fraction of: no roofline chart for them.
        roof = [e for e in passes if e.result.peak_fraction is not None and gpu != CPU_KEY]
        roof.sort(key=lambda e: -e.result.peak_fraction)  # type: ignore[operator]
        # the line the headline divides by: the deck's own baseline where the board ranks on it (Mega)
        deck_baseline = next((e.result.baseline_variant for e in every if e.result.baseline_variant is not None),
                             None) if field == "speedup_vs_baseline" else None
        shape_lines = lines.problem(bench, name, gpu, deck_baseline)
        variants, baseline_rows = _baseline_rows(data, bench, name, gpu, shape_lines)
        vs_fastest = {e.run.run_id: lines.of(bench, name, e.result) for e in entries}
        beaten = [s for s in shape_lines if s.headline_beaten]
        marked = [e for e in fast if (v := vs_fastest[e.run.run_id]) is not None and v.marked]
        gpus.append({
            "gpu": gpu,
            "label": label,
            "is_cpu": gpu == CPU_KEY,
            "measured": MeasuredBy.of_results([e.result for e in every], metric),
            "entries": entries,
            "passes": passes,
            "fast": fast,
            "roof": roof,
            "rows": [{"entry": b.entry, "runs": b.runs, "slug": model_slug(b.entry.run.model),
                      "vs_fastest": vs_fastest[b.entry.run.run_id]} for b in best],
            # where another line beats the headline's (torch.compile; Mega: baseline.py): on which shapes, by
            # which line, and the fastest pass's two figures as the example the page gives
            "fastest": {"n_shapes": len(shape_lines), "beaten": len(beaten), "who": summary(beaten), "over": over,
                        "example": marked[0] if marked else None,
                        "example_value": getattr(marked[0].result, field) if marked else None,
                        "example_vs": vs_fastest[marked[0].run.run_id] if marked else None},
            "off_board": [e for e in every if e.result.off_board],
            "n_runs": len(every),
            "peak_text": peak_text(prob, hardware),
            "variants": variants,
            "baseline_rows": baseline_rows,
            "speed_field": field,
            "speed_over": over,
            "speedup_chart": charts.speedup_chart(
                f"chart-speedup-{gpu}", [e.label for e in fast],
                [getattr(e.result, field) for e in fast],
                [e.run.is_house for e in fast], label,
                [(e.label, e.status_label, e.reason) for e in entries if not e.result.is_pass],
                over=over) if fast else None,
            "shape_chart": _shape_chart(gpu, label, fast, field, over),
            "roofline_chart": charts.roofline_chart(
                f"chart-roofline-{gpu}", [e.label for e in roof],
                [e.result.peak_fraction for e in roof],  # type: ignore[misc]
                [e.run.is_house for e in roof], label, peak_text(prob, hardware)) if roof else None,
        })
    return {
        "title": prob.display_name,
        "problem": prob,
        "readme_html": _markdown(readme.read_text(encoding="utf-8")) if readme.is_file() else None,
        "shapes": [
            {"shape": s, "params": ", ".join(f"{k}={v}" for k, v in s.params.items()),
             "gflop": _scaled(prob.flops(s), 1e-9), "mb": _scaled(prob.bytes_moved(s), 1e-6)}
            for s in prob.shapes
        ],
        "gpus": gpus,
        "charts": any(g["speedup_chart"] or g["roofline_chart"] for g in gpus),
        "shape_chart_passes": SHAPE_CHART_PASSES,
    }


# ------------------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class Arithmetic:
    """A geomean written out so it can be checked by hand: (a × b × …)^(1/n) = value."""

    terms: tuple[str, ...]
    value: float
    percent: bool = False  # a roofline fraction (terms and value in %), not a speedup

    @property
    def text(self) -> str:
        value = pct(self.value) if self.percent else speedup(self.value)
        return f"({' × '.join(self.terms)})^(1/{len(self.terms)}) = {value}"


def _arithmetic(values: list[float | None], percent: bool = False) -> Arithmetic | None:
    """A headline written out from its per-shape values (speedups, or roofline fractions in %), so a
    reader can check the geomean by hand; None when a shape has no positive value."""
    if not values or any(v is None or v <= 0 for v in values):
        return None
    terms = tuple(f"{100 * v:.2f}%" if percent else f"{v:.3f}" for v in values)  # type: ignore[operator]
    return Arithmetic(terms, geomean(values), percent)  # type: ignore[arg-type]


def _params(shape_json: str) -> str:
    try:
        params = json.loads(shape_json)
    except json.JSONDecodeError:
        return shape_json
    if not isinstance(params, dict):
        return shape_json
    return ", ".join(f"{k}={v}" for k, v in params.items())


@dataclass(frozen=True)
class Sidecar:
    """A file of the submission folder beside solution.py (a .cu, a header) as the run page shows it."""

    name: str
    size: int
    code: Code | None  # None when it is not shown
    why: str | None  # why it is not shown (too large, not UTF-8 text)


def _sidecars(data: SiteData, run_id: str) -> tuple[Sidecar, ...]:
    """A submission's sidecar files, each tagged with the language its name says (a .cu as C++)."""
    return tuple(Sidecar(f.name, f.size, code(f.text, f.name) if f.text is not None else None, f.why)
                 for f in data.sidecars.get(run_id, ()))


def run(data: SiteData, result: Result, lines: FastestLines | None = None) -> dict[str, Any]:
    """A run page. `lines`: the build's `FastestLines` (made here, for this page alone, when not given)."""
    the_run = data.runs[result.run_id]
    lines = FastestLines(data.baselines) if lines is None else lines
    vs_fastest = lines.of(the_run.bench, the_run.problem, result)
    prob = data.problems[(the_run.bench, the_run.problem)]
    source = data.solutions.get(result.run_id)
    # An imported run is shown the way its grader ranks it, by its fraction of the roofline.
    metric = result_metric(result)
    return {
        "title": f"{prob.display_name} · {the_run.model_display}",
        "run": the_run,
        "result": result,
        "problem": prob,
        "gpu_label": gpu_label(data, result.gpu),
        "hardware": data.hardware.get(result.gpu),
        "status_label": status_label(result),
        "tone": STATUS_TONES[result.status],
        "reason": reason_for(the_run, result),
        "outcome_label": OUTCOME_LABELS[the_run.agent_outcome],
        "cpu_timings": result.timer == "cpu_wall",
        # a pass kernelboard measured under a check the current grader makes stricter: shown, to be graded again
        "to_regrade": to_regrade(the_run, result),
        "arithmetic": _arithmetic([s.speedup_vs_compile for s in result.shapes]) if result.is_pass else None,
        "roofline_arithmetic": _arithmetic([s.peak_fraction for s in result.shapes], percent=True)
        if result.is_pass and result.peak_fraction is not None else None,
        "vs_fastest": vs_fastest,
        "times": run_times(the_run, result),
        "fastest_arithmetic": _arithmetic(list(vs_fastest.terms)) if vs_fastest is not None else None,
        "shape_params": {s.shape_idx: _params(s.shape_json) for s in result.shapes},
        "host_bound_ratio": HOST_BOUND_RATIO,
        "peak_text": peak_text(prob, data.hardware.get(result.gpu)),
        "source_code": code(source) if source is not None else None,
        "stale_claim": stale_claim(source, result),
        "sidecars": _sidecars(data, result.run_id),
        "measured": MeasuredBy.of_results([result], metric),
        "no_speedup": no_speedup_reason(result),
        "off_board": off_board_label(result),
        "source_files": source_files(the_run.source),
        "trace_href": _safe_href(the_run.trace_url),
        "trace_host": urlsplit(the_run.trace_url).hostname if _safe_href(the_run.trace_url) else None,
        # the raw file: made by the browser from the page's text, or published beside the page where the
        # page's text would not give back the same bytes (render._Build writes it then)
        "solution_href": None if source is None else "" if page_gives_back(source) else "solution.py",
        "annotation": data.annotations.get(result.run_id),
        "log_href": f"data/results/{result.log_path}" if f"data/results/{result.log_path}" in data.table_files
        else None,
        "charts": False,
    }


def _scaled(value: float | None, factor: float) -> float | None:
    """A formula's value in display units, or None when the problem has no such formula."""
    return None if value is None else value * factor

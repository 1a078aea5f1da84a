"""The leaderboard model: cells, rows, boards, and the one ordering rule every page uses.

A **cell** is the best graded run of one model on one problem on one GPU; a **board** is every
cell of one bench on one GPU. Which run is "best": a pass beats a failure, a failure beats a
run that was not graded, and that beats a DNF; among passes the higher value of the board's
**metric** wins (a pass without it comes after those with it); among the rest the most recently
graded run (then the smaller run_id). A DNF cell therefore means that every run of that model on
that problem was a DNF. A run whose audit annotation carries a flagging verdict (reward_hack,
rubric_leak, contamination, …) is **flagged**: shown as "flag: <verdict>" with the auditor's
summary, ranked and scored as a failure.

A board's metric is the speedup over torch.compile where kernelboard measured it, and the fraction
of the roofline (`peak_fraction`) where every result is imported from KernelBench-Hard, which
ranks its boards by that (`board_metric`). A result its source keeps off its board (`off_board`)
takes no cell: it is listed on its run page, its problem page and its model page, with the reason.

On a board kernelboard measured (not an imported one) a model row is a **regrade in progress** while some
published run of that model (one whose results were imported from another grader) on a problem of the
board has no result on the board's GPU: kernelboard regrades the published kernels a few at a time,
and a problem not graded yet is no failure. Such a row is shown with its graded cells and its counts
(`Regrade`), but has no score, no rank, and never sets the best. Imported boards have a result for
every run of their folder by construction.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kernelboard.eval.schema import AGENT_OUTCOMES, STATUSES, UNSCORED_STATUSES
from kernelboard.eval.settings import tightened_since, version_order

from .fastest import FastestLines, VsFastest
from .load import COMPILE_LABEL, CPU_KEY, DECK_BASELINE_LABEL, Annotation, Problem, Result, Run, SiteData


@dataclass(frozen=True)
class Metric:
    """What a board ranks on: one headline number of a pass (a field of `Result`), higher is better."""

    key: str  # "speedup" or "peak_fraction": the CSS class and the templates' switch
    name: str  # in words, as the pages print it
    field: str  # the Result attribute it reads
    imported: bool = False  # the metric of boards another grader measured (an importer read them)
    over: str = COMPILE_LABEL  # what a speedup metric divides by, as charts name their 1× line

    def of(self, result: Result) -> float | None:
        """The result's value of this metric (None when it has none, e.g. an imported pass without
        speedups on a speedup board)."""
        value = getattr(result, self.field)
        return value if result.is_pass else None


#: Boards kernelboard measured rank on the speedup over torch.compile.
SPEEDUP = Metric("speedup", "speedup over torch.compile", "speedup_vs_compile")
#: Boards imported from KernelBench-Hard rank on the fraction of the roofline, as kernelbench.com does.
PEAK_FRACTION = Metric("peak_fraction", "% of roofline", "peak_fraction", imported=True)
#: Boards of a deck that names its own headline baseline (Mega: its tuned PyTorch step, baseline.py) rank
#: on the speedup over it, as KernelBench-Mega does; the imported ones on the source's own figure.
DECK_BASELINE = Metric("speedup", f"speedup over the deck's own baseline ({DECK_BASELINE_LABEL})",
                       "speedup_vs_baseline", over=DECK_BASELINE_LABEL)
DECK_BASELINE_IMPORTED = replace(DECK_BASELINE, imported=True)


def result_metric(result: Result) -> Metric:
    """How one result is shown alone (its run page): as its board would rank it."""
    return board_metric([result])


def board_metric(results: Iterable[Result]) -> Metric:
    """A board is ranked the way the grader that measured it ranks it: on the deck's own baseline where
    its results name one (Mega), else on the fraction of the roofline when every result of a board is
    imported (`Result.is_imported`; KernelBench-Hard), else on the speedup over torch.compile."""
    results = list(results)
    imported = bool(results) and all(r.is_imported for r in results)
    if any(r.baseline_variant is not None for r in results):
        return DECK_BASELINE_IMPORTED if imported else DECK_BASELINE
    return PEAK_FRACTION if imported else SPEEDUP


#: The ordering rule, as the pages print it. `rank_rows` implements exactly this.
ORDERING_RULE = (
    "Rows are ordered by score: the mean, over the problems on this board, of each cell's share of "
    "the best — a pass scores its value of the board's metric divided by the best AI-model value on "
    "that problem on this GPU (so the best scores 1). The metric is the speedup over torch.compile on "
    "a Hard board kernelboard measured, and the fraction of the roofline (% of the GPU's peak for the "
    "problem's regime) on a board imported from KernelBench-Hard, which is how kernelbench.com ranks "
    "its Hard boards; on a Mega board, measured or imported, it is the speedup over the deck's own "
    "tuned PyTorch step (baseline.py), as KernelBench-Mega ranks. A failure, a pass an audit flagged "
    "(reward hack, rubric leak, contamination), a pass without the board's metric, or a problem the "
    "model has no run on, scores 0; a DNF is left "
    "out of the mean (it shrinks the denominator), because the infrastructure, not the model, ended "
    "that run, and so is a kernel that needs a newer GPU architecture than the board's or cannot be "
    "rebuilt from its published files: neither says how the model does here. A run its source keeps "
    "off its board takes no cell. Ties go to more passes, then to the name. House rows (the house "
    "kernel and calibration rows, harness 'house') are reference points: shown, never ranked, and never the best. "
    "On a board kernelboard measured, a model whose published runs on the board's problems are not all graded "
    "on this GPU yet is listed, unranked and unscored (regrade in progress), until they are: a problem not "
    "graded yet is not a failure, and such a row never sets the best. A published run whose agent left no "
    "kernel has nothing to regrade and holds no rank back."
)

#: The tooltip of a row whose regrade is in progress.
REGRADE_HELP = (
    "kernelboard is regrading this model's published kernels on this GPU a few at a time: the problems "
    "not graded here yet are not failures, so the row is shown without a rank or a score (and never sets "
    "the best) until every published run on this board's problems is graded."
)

#: How each grading status is named on the pages.
STATUS_LABELS: dict[str, str] = {
    "pass": "pass",
    "wrong": "wrong",
    "build_error": "build error",
    "runtime_error": "runtime error",
    "timeout": "timeout",
    "oom": "OOM",
    "forbidden": "forbidden",
    "integrity_violation": "integrity violation",
    "not_graded": "not graded",
    "dnf": "DNF",
    "needs_other_arch": "needs sm_100",  # the cell says which: `status_label` reads it from the message
    "not_reproducible": "not reproducible from the published files",
}

#: What each status means, for the legend.
STATUS_HELP: dict[str, str] = {
    "pass": "correct on every shape and seed; the number is the geomean speedup over torch.compile "
            "(on a board imported from KernelBench-Hard, the geomean % of roofline)",
    "wrong": "ran, but the answers do not match the reference",
    "build_error": "could not compile or import",
    "runtime_error": "crashed while running",
    "timeout": "ran past the time limit",
    "oom": "ran out of GPU memory with at least half of the GPU to itself, or took more than half and left the "
           "grader short (a kernel is promised half: short of that the run is not graded, the grader's fault)",
    "forbidden": "used something the problem forbids (e.g. the library that does the whole job)",
    "integrity_violation": "tampered with the grader or its inputs",
    "not_graded": "no verdict: the run left nothing to grade, or the grader failed to give one and grades it "
                  "again (see the reason); not counted against the model",
    "dnf": "did not finish: the infrastructure ended the run (rate limit, provider, credits, harness); "
           "not counted against the model",
    "needs_other_arch": "the kernel targets a newer GPU architecture than this one (e.g. B200-only tcgen05 "
                        "code on an H200): it cannot run here; not a score, not counted against the model",
    "not_reproducible": "the published submission lacks a file its build needs (a vendored header, a sidecar "
                        "module, a hard-coded tool path): it cannot be rebuilt here; not a score",
}

#: CSS tone of each status: one colour family per kind of outcome; a DNF is never red.
STATUS_TONES: dict[str, str] = {
    "pass": "pass",
    "wrong": "bad",
    "forbidden": "bad",
    "integrity_violation": "bad",
    "build_error": "warn",
    "runtime_error": "warn",
    "timeout": "warn",
    "oom": "warn",
    "not_graded": "none",
    "dnf": "dnf",
    "needs_other_arch": "none",
    "not_reproducible": "none",
}

#: How each agent outcome is named on the pages (a DNF's reason is its outcome).
OUTCOME_LABELS: dict[str, str] = {
    "completed": "completed",
    "rate_limited": "rate limited",
    "provider_error": "provider error",
    "credits_exhausted": "credits exhausted",
    "agent_timeout": "agent timed out",
    "early_stop": "stopped early",
    "no_solution": "no solution",
    "harness_error": "harness error",
    "provider_unavailable": "provider unavailable",
    "solution_unrecoverable": "solution not recoverable from the trace",
}

for _table, _known in ((STATUS_LABELS, STATUSES), (STATUS_HELP, STATUSES), (STATUS_TONES, STATUSES),
                       (OUTCOME_LABELS, AGENT_OUTCOMES)):
    if set(_table) != set(_known):  # the schema grew a value: name it here before building
        raise RuntimeError(f"sitegen.board labels out of date with eval.schema: "
                           f"{sorted(set(_known) ^ set(_table))}")

CPU_LABEL = "CPU (test timings)"

_NEEDS = re.compile(r"^needs (sm_\d+[af]?)\b")


def status_label(result: Result) -> str:
    """How a result's status is named: STATUS_LABELS, except that `needs_other_arch` names the
    architecture its message found ('needs sm_100a')."""
    if result.status == "needs_other_arch" and (m := _NEEDS.match(result.message or "")):
        return f"needs {m.group(1)}"
    return STATUS_LABELS[result.status]


def reason_for(run: Run, result: Result) -> str:
    """Why a run did not pass, in a few words: a DNF's outcome, or else the grader's message."""
    if result.status == "dnf" or (result.status == "not_graded" and run.agent_outcome != "completed"):
        return OUTCOME_LABELS[run.agent_outcome]
    return result.message


def to_regrade(run: Run, result: Result) -> tuple[str, str] | None:
    """(the grader, what it checks more strictly) for a pass kernelboard measured under a check the current
    grader tightened (settings.TIGHTENED_PASSES): shown as measured, marked, until `--resume` grades it
    again; None otherwise (an imported pass is its source's verdict). Its cell and its run page say so."""
    if result.is_imported:
        return None
    return tightened_since(result.grader_version, run.problem, result.status, run.run_id)


def no_speedup_reason(result: Result) -> str | None:
    """Why a pass carries no speedup — over torch.compile, or over its deck's own baseline (Mega) —
    in words (the importer's message), or None when it has one or is not a pass. Only an imported
    pass can lack both (eval.tables' contract)."""
    if not result.is_pass or result.speedup_vs_compile is not None or result.speedup_vs_baseline is not None:
        return None
    return result.message or "its grader published no baselines to derive a speedup from"


def off_board_label(result: Result) -> str | None:
    """'off board: <reason>' for a result its source keeps off its board, else None."""
    return f"off board: {result.off_board}" if result.off_board else None


def flag_of(annotation: Annotation | None) -> str | None:
    """'flag: <verdict>' when an audit verdict invalidates the run, else None."""
    return f"flag: {annotation.verdict}" if annotation is not None and annotation.flags else None


#: A step is a "megakernel" where one call launches at most this many kernels on every shape (each node of
#: a CUDA-graph replay counted: eval/launches.py). Measured, never a model's claim; the methodology says so.
MEGAKERNEL_MAX_LAUNCHES = 1


@dataclass(frozen=True)
class Cell:
    """The best graded run of one model on one problem on one GPU."""

    run: Run
    result: Result
    share: float | None  # pass: its metric value / the board's best AI-model value on this problem
    is_best: bool
    annotation: Annotation | None = None  # the run's audit verdict, if audited
    metric: Metric = SPEEDUP  # what its board ranks on
    vs_fastest: VsFastest | None = None  # a pass's speedup over the fastest PyTorch line (fastest.py)

    @property
    def value(self) -> float | None:
        """The pass's value of the board's metric (None for anything else, or a pass without it)."""
        return self.metric.of(self.result)

    @property
    def no_speedup(self) -> str | None:
        """Why a pass shows no speedup (its grader published no baselines to derive one from), else None."""
        return no_speedup_reason(self.result)

    @property
    def launches(self) -> int | None:
        """The most kernel launches one call made on any of its shapes; None where a shape was not counted
        (imported rows, CPU timings, graders before 0.3.6)."""
        counts = [s.launches for s in self.result.shapes]
        return max(counts) if counts and None not in counts else None  # type: ignore[type-var]

    @property
    def is_megakernel(self) -> bool:
        """Measured: every shape's call launched at most MEGAKERNEL_MAX_LAUNCHES kernels."""
        return self.launches is not None and self.launches <= MEGAKERNEL_MAX_LAUNCHES

    @property
    def to_regrade(self) -> tuple[str, str] | None:
        return to_regrade(self.run, self.result)

    @property
    def flag(self) -> str | None:
        return flag_of(self.annotation)

    @property
    def state(self) -> str:
        """'pass', 'dnf', 'flag' (an audit invalidated it) or 'fail' (anything else the model produced)."""
        if self.flag:
            return "flag"
        return self.result.status if self.result.status in ("pass", "dnf") else "fail"

    @property
    def label(self) -> str:
        return self.flag or status_label(self.result)

    @property
    def tone(self) -> str:
        return "bad" if self.flag else STATUS_TONES[self.result.status]

    @property
    def unscored(self) -> bool:
        """A verdict that is no score (UNSCORED_STATUSES): left out of the row's mean, like a DNF."""
        return not self.flag and self.result.status in UNSCORED_STATUSES

    @property
    def reason(self) -> str:
        return self.annotation.summary if self.flag else reason_for(self.run, self.result)  # type: ignore[union-attr]

    @property
    def note(self) -> str | None:
        """An audit note that qualifies the cell without invalidating it ('harness limited': the
        grading, not the kernel, stopped it), or None; a 'clean' verdict needs no mention."""
        if self.annotation is None or self.flag or self.annotation.verdict == "clean":
            return None
        return self.annotation.verdict.replace("_", " ")


@dataclass(frozen=True)
class Regrade:
    """How far the regrade of one model on one board has got: of its published runs on the board's
    problems (`published`), how many have a result on the board's GPU (`graded`, fewer than all)."""

    graded: int
    published: int

    @property
    def text(self) -> str:
        return (f"regrade in progress: {self.graded} of {self.published} published "
                f"run{'s' if self.published != 1 else ''} graded on this GPU")

    @property
    def help(self) -> str:
        return REGRADE_HELP


@dataclass(frozen=True)
class Row:
    """One model's cells on a board (aligned with `Board.problems`) and its score."""

    model: str
    display: str
    tag: str | None  # 'house kernel' or 'calibration' for house rows; None for AI models
    harnesses: tuple[str, ...]
    cells: tuple[Cell | None, ...]
    score: float | None  # None for house rows, and when every cell is a DNF
    passes: int
    counted: int  # the score's denominator: problems on the board minus this row's DNF cells
    rank: int | None
    regrade: Regrade | None = None  # set while the model's published runs are not all graded here: unranked

    @property
    def is_house(self) -> bool:
        return self.tag is not None

    @property
    def dnfs(self) -> int:
        return sum(1 for c in self.cells if c is not None and c.state == "dnf")


@dataclass(frozen=True)
class Board:
    """Every cell of one bench on one GPU: ranked model rows first, then house rows."""

    bench: str
    gpu: str
    label: str
    problems: tuple[Problem, ...]
    rows: tuple[Row, ...]
    metric: Metric = SPEEDUP
    measured_by: tuple[str, ...] = ()  # the distinct `measured_by` of its results, sorted

    @property
    def is_cpu(self) -> bool:
        return self.gpu == CPU_KEY

    @property
    def is_imported(self) -> bool:
        """Every result on it was measured by another grader and imported (ranked on its metric)."""
        return self.metric.imported


def graders(results: Iterable[Result]) -> tuple[str, ...]:
    """Who measured these results, each once, grader versions in release order (settings.version_order)."""
    return tuple(sorted({r.measured_by for r in results}, key=version_order))


def gpu_label(data: SiteData, gpu: str) -> str:
    """The display name of a GPU key: the hardware table's name, or the CPU label."""
    return CPU_LABEL if gpu == CPU_KEY else data.hardware[gpu].name


def gpu_order(gpus: Iterable[str]) -> list[str]:
    """GPU keys in page order: sorted, with CPU test timings last."""
    return sorted(set(gpus), key=lambda g: (g == CPU_KEY, g))


def tab_order(boards: Iterable[Board]) -> list[Board]:
    """Boards as the home page's tabs run: those kernelboard measured first, then the imported ones, then CPU
    test timings, each group in the order given (build_boards': `gpu_order`; the sort is stable)."""
    return sorted(boards, key=lambda b: (b.is_cpu, b.is_imported))


def measured_gpus(results: Iterable[Result]) -> set[str]:
    """The GPU keys of the boards kernelboard graded itself (a result on them is not imported)."""
    return {r.gpu for r in results if not r.is_imported}


def tab_gpu_order(gpus: Iterable[str], measured: set[str]) -> list[str]:
    """GPU keys as `tab_order` runs their boards: those in `measured` (a board kernelboard graded) first,
    then the imported boards' GPUs, then CPU test timings, `gpu_order` within each."""
    return sorted(gpu_order(gpus), key=lambda g: (g == CPU_KEY, g not in measured))


def _preference(run: Run, result: Result, flagged: bool = False, metric: Metric = SPEEDUP) -> tuple:
    """Sort key: the smallest is the run a cell shows (see the module docstring). A pass is tier 0
    whatever it carries, so a pass without the board's metric still beats any failure; among passes,
    those with the metric come first, highest value first."""
    tier = 1 if flagged else {"pass": 0, "not_graded": 2, "needs_other_arch": 2, "not_reproducible": 2,
                              "dnf": 3}.get(result.status, 1)
    value = metric.of(result)
    return (tier, value is None, -(value or 0.0), -result.graded_at.timestamp(), run.run_id)


def metrics_by_board(data: SiteData) -> dict[tuple[str, str], Metric]:
    """(GPU, bench) -> the metric its board ranks on (`board_metric` of every result there)."""
    graded: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for result in data.results:
        graded[(result.gpu, data.runs[result.run_id].bench)].append(result)
    return {key: board_metric(results) for key, results in graded.items()}


def build_boards(data: SiteData) -> tuple[Board, ...]:
    """One board per (GPU, bench) that has results on the board (not `off_board`), GPUs in `gpu_order`,
    benches sorted."""
    graded: dict[tuple[str, str], list[Result]] = defaultdict(list)
    metrics = metrics_by_board(data)
    lines = FastestLines(data.baselines)
    for result in data.results:
        if not result.off_board:
            graded[(result.gpu, data.runs[result.run_id].bench)].append(result)
    order = gpu_order(g for g, _ in graded)
    boards = []
    for gpu, bench in sorted(graded, key=lambda k: (order.index(k[0]), k[1])):
        boards.append(_board(data, gpu, bench, graded[(gpu, bench)], metrics[(gpu, bench)], lines))
    return tuple(boards)


def regrades(data: SiteData, gpu: str, bench: str, problems: Iterable[str]) -> dict[str, Regrade]:
    """model -> its `Regrade`, for each AI model (not house) with a published run of `bench` on one of
    `problems` that has no result on `gpu`: its regrade is in progress. A published run is one another
    grader's results were imported for, with its kernel (what kernelboard regrades): a run whose agent
    left no kernel (timed out, stopped early, no solution or none recoverable: 8 of KernelBench-Hard's) has
    nothing to regrade on any GPU, so it never holds a rank back. Runs kernelboard itself graded on some
    GPUs and not others are a choice of where to grade, not a regrade."""
    names = set(problems)
    graded_here = {r.run_id for r in data.results if r.gpu == gpu}
    imported = {r.run_id for r in data.results if r.is_imported}
    published: dict[str, list[bool]] = defaultdict(list)
    for run in data.runs.values():
        if (run.bench == bench and run.problem in names and not run.is_house and run.run_id in imported
                and run.solution_sha256 is not None):
            published[run.model].append(run.run_id in graded_here)
    return {model: Regrade(sum(flags), len(flags)) for model, flags in published.items() if not all(flags)}


def _board(data: SiteData, gpu: str, bench: str, results: list[Result], metric: Metric,
           lines: FastestLines) -> Board:
    names = sorted({data.runs[r.run_id].problem for r in results})
    problems = tuple(data.problems[(bench, n)] for n in names)
    notes = data.annotations
    # An imported board has a result for every run of its folder; other folders' runs are not its to grade.
    pending = {} if metric.imported else regrades(data, gpu, bench, names)
    picked: dict[tuple[str, str], tuple[Run, Result]] = {}

    def rank(run: Run, result: Result) -> tuple:
        return _preference(run, result, flag_of(notes.get(run.run_id)) is not None, metric)

    for result in results:
        run = data.runs[result.run_id]
        key = (run.model, run.problem)
        if key not in picked or rank(run, result) < rank(*picked[key]):
            picked[key] = (run, result)
    valid = {key: res.is_pass and not flag_of(notes.get(run.run_id)) for key, (run, res) in picked.items()}
    best = {  # the best AI model that is ranked: not a house row, not a regrade in progress
        name: max((v for (m, p), (run, res) in picked.items()
                   if p == name and valid[(m, p)] and not run.is_house and m not in pending
                   and (v := metric.of(res)) is not None),
                  default=None)
        for name in names
    }
    rows = []
    for model in sorted({m for m, _ in picked}):
        runs = [data.runs[r.run_id] for r in results if data.runs[r.run_id].model == model]
        cells = []
        for name in names:
            if (model, name) not in picked:
                cells.append(None)
                continue
            run, res = picked[(model, name)]
            ok = valid[(model, name)]
            value = metric.of(res)
            share = value / best[name] if ok and best[name] and value is not None else None
            cells.append(Cell(run, res, share, ok and not run.is_house and model not in pending and share == 1.0,
                              notes.get(run.run_id), metric, lines.of(run.bench, run.problem, res)))
        rows.append(_row(model, runs, tuple(cells), pending.get(model)))
    return Board(bench, gpu, gpu_label(data, gpu), problems, rank_rows(rows), metric,
                 graders(results))


def score(cells: Iterable[Cell | None]) -> tuple[float | None, int, int]:
    """(score, passes, counted) of one row under ORDERING_RULE.

    `counted` is the denominator: every problem on the board except this row's DNF cells and
    unscored cells (`Cell.unscored`: needs another architecture, not reproducible). A pass adds its
    share of the best, a failure or an empty cell (None) adds 0. The score is None when nothing is
    counted (every cell a DNF or unscored): no evidence either way, and the row is not ranked.
    """
    cells = list(cells)
    passes = [c for c in cells if c is not None and c.state == "pass"]
    counted = sum(1 for c in cells if c is None or (c.state != "dnf" and not c.unscored))
    total = sum(c.share or 0.0 for c in passes)
    return (total / counted if counted else None), len(passes), counted


def _row(model: str, runs: list[Run], cells: tuple[Cell | None, ...], regrade: Regrade | None = None) -> Row:
    """A model's row, named after its latest run (by run_id); a row with any house run is a house row,
    shown with its tag and not scored; a row whose regrade is in progress (`regrade`) is not scored either."""
    latest = max(runs, key=lambda r: r.run_id)
    house = next((r for r in sorted(runs, key=lambda r: r.run_id, reverse=True) if r.is_house), None)
    tag = house.house_tag if house else None
    regrade = None if tag else regrade
    value, passes, counted = score(cells)
    return Row(model, latest.model_display, tag, tuple(sorted({r.harness for r in runs})), cells,
               None if tag or regrade else value, passes, counted, None, regrade)


def rank_rows(rows: Iterable[Row]) -> tuple[Row, ...]:
    """Apply ORDERING_RULE: scored model rows by (score, passes) descending, then name; equal
    (score, passes) share a rank. Rows whose regrade is in progress follow, then the other unscored model
    rows, then house rows, all unranked."""
    rows = list(rows)
    scored = sorted((r for r in rows if r.score is not None and r.regrade is None and not r.is_house),
                    key=lambda r: (-r.score, -r.passes, r.display, r.model))  # type: ignore[operator]
    in_progress = sorted((r for r in rows if r.regrade is not None and not r.is_house),
                         key=lambda r: (r.display, r.model))
    unscored = sorted((r for r in rows if r.score is None and r.regrade is None and not r.is_house),
                      key=lambda r: (r.display, r.model))
    house = sorted((r for r in rows if r.is_house),
                   key=lambda r: (r.tag != "house kernel", r.display, r.model))
    ranked = []
    for r in scored:
        rank = 1 + sum(1 for o in scored if (o.score, o.passes) > (r.score, r.passes))
        ranked.append(replace(r, rank=rank))
    return (*ranked, *in_progress, *unscored, *house)


@dataclass(frozen=True)
class Entry:
    """One graded submission of a problem on a GPU, as the problem page lists it."""

    run: Run
    result: Result
    label: str  # unique on the page: the model's name, numbered when it has several runs
    annotation: Annotation | None = None

    @property
    def off_board(self) -> str | None:
        """'off board: <reason>' when its source keeps this run off its board (it takes no cell), else None."""
        return off_board_label(self.result)

    @property
    def no_speedup(self) -> str | None:
        """Why a pass shows no speedup (see `no_speedup_reason`), else None."""
        return no_speedup_reason(self.result)

    @property
    def tone(self) -> str:
        return "bad" if flag_of(self.annotation) else STATUS_TONES[self.result.status]

    @property
    def reason(self) -> str:
        return self.annotation.summary if flag_of(self.annotation) else reason_for(self.run, self.result)  # type: ignore[union-attr]

    @property
    def status_label(self) -> str:
        return flag_of(self.annotation) or status_label(self.result)


def problem_entries(data: SiteData, bench: str, problem: str,
                    metrics: dict[tuple[str, str], Metric] | None = None) -> dict[str, tuple[Entry, ...]]:
    """Per GPU (in `gpu_order`), every graded run of a problem in cell order: the runs on the board first
    (passes by the board's metric, then the rest, as `_preference` orders them), then those kept off it.
    `metrics`: `metrics_by_board(data)`, when the caller has it already."""
    metrics = metrics_by_board(data) if metrics is None else metrics
    by_gpu: dict[str, list[tuple[Run, Result]]] = defaultdict(list)
    for result in data.results:
        run = data.runs[result.run_id]
        if (run.bench, run.problem) == (bench, problem):
            by_gpu[result.gpu].append((run, result))
    out = {}
    for gpu in gpu_order(by_gpu):
        notes = data.annotations
        metric = metrics[(gpu, bench)]
        pairs = sorted(by_gpu[gpu], key=lambda p: (bool(p[1].off_board), *_preference(
            *p, flag_of(notes.get(p[0].run_id)) is not None, metric)))
        seen: dict[str, int] = defaultdict(int)
        numbered = {}
        for run, _ in sorted(by_gpu[gpu], key=lambda p: p[0].run_id):
            seen[run.model_display] += 1
            n = seen[run.model_display]
            numbered[run.run_id] = run.model_display if n == 1 else f"{run.model_display} #{n}"
        out[gpu] = tuple(Entry(run, res, numbered[run.run_id], notes.get(run.run_id)) for run, res in pairs)
    return out


@dataclass(frozen=True)
class ModelBest:
    """A model's best graded run of a problem on one GPU (the run its board cell shows) and how many
    graded runs it has there: a problem page lists these, and each model's page lists every run."""

    entry: Entry
    runs: int


def best_per_model(entries: Iterable[Entry]) -> tuple[ModelBest, ...]:
    """The first entry of each model in `entries` (in `problem_entries` order, so the best by the cell
    rule), labelled with the model's display name (plus its key where two models share a name). Entries
    kept off the board are left out: they never stand for a model's best."""
    entries = [e for e in entries if not e.result.off_board]
    counts: dict[str, int] = defaultdict(int)
    firsts: dict[str, Entry] = {}
    for e in entries:
        counts[e.run.model] += 1
        firsts.setdefault(e.run.model, e)
    names: dict[str, int] = defaultdict(int)
    for e in firsts.values():
        names[e.run.model_display] += 1
    return tuple(ModelBest(replace(e, label=e.run.model_display if names[e.run.model_display] == 1
                                   else f"{e.run.model_display} ({e.run.model})"), counts[model])
                 for model, e in firsts.items())

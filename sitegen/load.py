"""Load everything the site shows: validated tables, decks and solution files, as typed records.

`load_site` is the one gate. It reads every parquet table through `eval.tables.load_all` (which
checks the data contract), loads the deck of every problem the runs name through `eval.deck`,
reads each run's `solution.py`, and applies the cross-checks the pages depend on (a pass has its
shape rows and their geomean is the headline; a graded GPU has a hardware row; keys are safe as
URL path parts). Audit annotations (`DATA/annotations/<run_id>.yaml`) are validated by
`ingest.annotations`. Every problem found is reported in one error; code past this module trusts
the types.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from kernelboard.errors import DataError, DeckError
from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.regrades import read_regrades
from kernelboard.eval.roofline import geomean
from kernelboard.eval.schema import (
    CPU_KEY,
    HOUSE_HARNESS,
    HOUSE_MODEL,
    IMPORTED_SUFFIX,
    PRECISIONS,
    TABLES,
    peak_column,
    record_mismatches,
)
from kernelboard.eval.settings import held_back, rebaselines
from kernelboard.eval.submission import RUN_ID_PATTERN
from kernelboard.eval.tables import load_all

from .ingest.annotations import Annotation, load_annotations

#: A covered shape's timed median this many times its GPU time (ShapeResult.gpu_ms) or more is labelled host-bound
#: on its run page: on the H200, honest GPU-bound shapes sit at 0.8-1.0 (the graph replays its launches
#: back to back, a timed call from a flushed L2), gpt-5.5's 03 kernel at 1.5 and 2.1 on the shapes where
#: its 0.053 ms dispatch outlasts its GPU work.
HOST_BOUND_RATIO = 1.25

#: A sidecar file larger than this is listed on its run page but not shown (a generated header, a blob).
SIDECAR_MAX_BYTES = 256 * 1024

#: Relative tolerance between a pass's headline speedup and the geomean of its shape rows.
_GEOMEAN_RTOL = 1e-6

__all__ = [
    "COMPILE_LABEL",
    "CPU_KEY",
    "DECK_BASELINE_LABEL",
    "HOUSE_HARNESS",
    "HOUSE_MODEL",
    "IMPORTED_SUFFIX",
    "Annotation",
    "Baseline",
    "Hardware",
    "Problem",
    "Result",
    "Run",
    "ShapeResult",
    "SidecarFile",
    "SiteData",
    "load_site",
]


#: How the pages name what a speedup divides by: torch.compile, or a deck's own headline baseline (Mega's
#: tuned PyTorch step).
COMPILE_LABEL = "torch.compile"
DECK_BASELINE_LABEL = "baseline.py"


@dataclass(frozen=True)
class Run:
    """One agent attempt (a row of runs.parquet)."""

    run_id: str
    bench: str
    problem: str
    gpu: str | None
    model: str
    model_display: str
    lab: str | None
    harness: str
    effort: str | None
    started_at: datetime | None
    agent_seconds: float | None
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None
    cost_usd: float | None
    agent_outcome: str
    outcome_note: str | None
    trace_url: str | None
    solution_sha256: str | None
    source: str

    @property
    def is_house(self) -> bool:
        """Made by the kernelboard maintainers, not by an AI model: never ranked, never the best."""
        return self.harness == HOUSE_HARNESS or self.model == HOUSE_MODEL

    @property
    def house_tag(self) -> str | None:
        """How the pages label a house run: 'house kernel', or 'calibration' for the other house rows."""
        if not self.is_house:
            return None
        return "house kernel" if self.model == HOUSE_MODEL else "calibration"


@dataclass(frozen=True)
class ShapeResult:
    """One shape of one graded run (a row of shapes.parquet); times in ms."""

    run_id: str
    gpu: str
    shape_idx: int
    shape_label: str
    shape_json: str
    median_ms: float | None
    p10_ms: float | None
    p90_ms: float | None
    min_ms: float | None
    iterations: int | None
    tflop_s: float | None
    gb_s: float | None
    compute_fraction: float | None
    memory_fraction: float | None
    bound: str | None
    peak_fraction: float | None
    eager_ms: float | None
    compile_ms: float | None
    speedup_vs_eager: float | None
    speedup_vs_compile: float | None
    max_rel_err: float | None
    measured_fraction: float | None
    host_ms: float | None
    graph_ms: float | None
    kernels: list[str] | None
    note: str | None
    launches: int | None = None  # kernel launches per profiled call (eval/launches.py)
    top_kernel_share: float | None = None  # the largest launch's share of their time
    timing_method: str | None = None  # "covered" or "synchronised" (eval/timing.py); None before 0.4.0
    gpu_span_ms: float | None = None  # a covered loop's median GPU span of a call; None before 0.4.8
    baseline_ms: float | None = None  # the deck's own headline baseline on this shape (Result.baseline_variant)
    speedup_vs_baseline: float | None = None

    @property
    def gpu_ms(self) -> float | None:
        """The call's own GPU time: its CUDA-graph replay (launch-bound shapes), else its covered loop's
        median GPU span (since 0.4.8; a Mega step of ms), else None."""
        return self.graph_ms or self.gpu_span_ms or None

    @property
    def host_bound(self) -> float | None:
        """The timed median over the call's GPU time (`gpu_ms`), where it is HOST_BOUND_RATIO or more: the
        host's dispatch, not the GPU, set this figure (a covered sample is never below the loop's least
        dispatch), so it moves with the grading host's CPU. None where it is less, or not measured."""
        gpu_ms = self.gpu_ms
        if self.median_ms is None or not gpu_ms or self.timing_method != "covered":
            return None
        ratio = self.median_ms / gpu_ms
        return ratio if ratio >= HOST_BOUND_RATIO else None


@dataclass(frozen=True)
class Result:
    """One graded (run, GPU) pair (a row of results.parquet) with its shape rows, by shape_idx."""

    run_id: str
    gpu: str
    status: str
    message: str
    speedup_vs_compile: float | None
    speedup_vs_eager: float | None
    peak_fraction: float | None
    peak_fraction_measured: float | None
    compile_variant: str | None
    n_shapes: int
    timer: str
    device_name: str
    driver_version: str | None
    cuda_version: str | None
    torch_version: str | None
    triton_version: str | None
    python_version: str | None
    graded_at: datetime
    grader_version: str
    measured_by: str
    seeds: list[int] | None
    grade_seconds: float | None
    log_path: str | None
    off_board: str | None = None  # why it takes no board cell (an imported grader's curation)
    sandbox: str | None = None  # what confined the candidate while it was graded (eval/jail.py)
    speedup_vs_baseline: float | None = None  # over the deck's own headline baseline (Mega's baseline.py)
    baseline_variant: str | None = None  # which line that is ('library:tuned'; 'kbm:baseline.py' imported)
    shapes: tuple[ShapeResult, ...] = ()

    @property
    def is_pass(self) -> bool:
        return self.status == "pass"

    @property
    def is_imported(self) -> bool:
        """Measured by another grader and read by an importer, not measured by kernelboard."""
        return self.measured_by.endswith(IMPORTED_SUFFIX)

    @property
    def headline_speedup(self) -> float | None:
        """The speedup its board ranks on: over the deck's own baseline where the result names one
        (Mega's baseline.py), else over torch.compile."""
        return self.speedup_vs_baseline if self.baseline_variant is not None else self.speedup_vs_compile

    @property
    def speedup_over(self) -> str:
        """What `headline_speedup` divides by, as the pages name it."""
        return DECK_BASELINE_LABEL if self.baseline_variant is not None else COMPILE_LABEL


@dataclass(frozen=True)
class Baseline:
    """One baseline timing (eager, a torch.compile mode, a library) of one shape on one GPU."""

    bench: str
    problem: str
    gpu: str
    shape_idx: int
    shape_label: str
    shape_json: str
    variant: str
    status: str
    message: str
    median_ms: float | None
    p10_ms: float | None
    p90_ms: float | None
    min_ms: float | None
    iterations: int | None
    timer: str
    device_name: str
    torch_version: str | None
    triton_version: str | None
    cuda_version: str | None
    grader_version: str
    measured_at: datetime
    timing_method: str | None = None  # as in ShapeResult


@dataclass(frozen=True)
class Hardware:
    """A GPU as the hardware table records it; GB/s is 10^9 B/s, TFLOP/s 10^12 FLOP/s (dense)."""

    gpu: str
    name: str
    sm: str | None
    memory_gb: float | None
    l2_mb: float | None
    bandwidth_gb_s: float | None
    peak_tflop_s: dict[str, float]
    source: str
    measured_copy_gb_s: float | None
    measured_bf16_tflop_s: float | None
    measured_fp8_tflop_s: float | None
    measured_at: datetime | None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Hardware:
        peaks = {p: row[peak_column(p)] for p in PRECISIONS if row.get(peak_column(p)) is not None}
        rest = {f.name: row[f.name] for f in fields(cls) if f.name != "peak_tflop_s"}
        return cls(peak_tflop_s=peaks, **rest)


@dataclass(frozen=True)
class SidecarFile:
    """A file of a submission folder besides solution.py and run.yaml (a .cu, .cpp or .h that solution.py
    loads): its path in the folder, its size, and its text when it is shown."""

    name: str  # relative to the submission folder, '/'-separated
    size: int  # bytes
    text: str | None  # None when too large (SIDECAR_MAX_BYTES) or not UTF-8 text
    why: str | None  # why the text is not shown


@dataclass(frozen=True)
class SiteData:
    """Everything a build reads, validated and joined. Collections are sorted by their keys."""

    runs: dict[str, Run]
    results: tuple[Result, ...]  # sorted by (gpu, run_id)
    baselines: tuple[Baseline, ...]  # sorted by (bench, problem, gpu, shape_idx, variant)
    hardware: dict[str, Hardware]
    problems: dict[tuple[str, str], Problem]  # (bench, problem name) -> deck problem
    solutions: dict[str, str]  # run_id -> solution.py text, for runs that have one
    #: "data/results/<gpu>/<table>.parquet" (and "data/regrades.parquet", every GPU's) -> the file, offered for download
    table_files: dict[str, Path]
    #: run_id -> audit verdict, from DATA/annotations (only runs that are in the tables)
    annotations: dict[str, Annotation] = dataclasses.field(default_factory=dict)
    #: run_id -> the other files of its submission folder, by name (only runs with a solution.py)
    sidecars: dict[str, tuple[SidecarFile, ...]] = dataclasses.field(default_factory=dict)
    #: DATA/README.md, the tables' contract in words (the site's data page), when the data folder has one
    readme: str | None = None
    #: results held back from every board and page (`superseded`): timed by an older method than their
    #: problem's baselines on their GPU, so to be regraded before their speed is shown
    superseded: tuple[Result, ...] = ()
    #: DATA/regrades.parquet's rows (`eval/regrades.py`): the shapes of passes graded again, before and after
    regrades: tuple[dict[str, Any], ...] = ()

    @property
    def last_updated(self) -> datetime | None:
        """The newest `graded_at` in the data: the site's date, never the wall clock."""
        return max((r.graded_at for r in self.results), default=None)


def _check_records() -> None:
    """Each record above is a typed view of one table of `eval/schema.py`, the contract's one source:
    a column added, dropped or retyped there and not here stops the import, naming the column."""
    bad = [
        *record_mismatches("runs", Run.__annotations__),
        *record_mismatches("shapes", ShapeResult.__annotations__),
        *record_mismatches("results", Result.__annotations__, extra=("shapes",)),
        *record_mismatches("baselines", Baseline.__annotations__),
        *record_mismatches("hardware", Hardware.__annotations__, extra=("peak_tflop_s",),
                           folded=[peak_column(p) for p in PRECISIONS]),
    ]
    if bad:
        raise TypeError("sitegen/load.py's records disagree with eval/schema.py: " + "; ".join(bad))


_check_records()

_R = TypeVar("_R")


def _records(cls: type[_R]) -> Callable[..., _R]:
    """A maker of `cls` records from table rows (plus `extra` fields given by the caller); the field
    names are looked up once, not per row (`dataclasses.fields` per row was a fifth of loading ten
    thousand runs)."""
    names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def make(row: dict[str, Any], **extra: Any) -> _R:
        return cls(**{k: row[k] for k in names if k not in extra}, **extra)
    return make


def load_site(data_dir: Path, decks_dir: Path) -> SiteData:
    """Read `DATA/results`, `DATA/submissions` and the decks of every problem the runs name.

    Raises `DataError` (one line per problem, naming file, row and field) for bad tables and
    `DeckError` for a missing or malformed deck folder.
    """
    results_dir = data_dir / "results"
    tables = load_all(results_dir)
    rows = {name: table.to_pylist() for name, table in tables.items()}
    run, shape, result, baseline = _records(Run), _records(ShapeResult), _records(Result), _records(Baseline)
    runs = {r["run_id"]: run(r) for r in sorted(rows["runs"], key=lambda r: r["run_id"])}
    hardware = {r["gpu"]: Hardware.from_row(r) for r in sorted(rows["hardware"], key=lambda r: r["gpu"])}

    shapes_by_result: dict[tuple[str, str], list[ShapeResult]] = defaultdict(list)
    for r in rows["shapes"]:
        shapes_by_result[(r["run_id"], r["gpu"])].append(shape(r))
    results = tuple(
        result(r, shapes=tuple(sorted(shapes_by_result.get((r["run_id"], r["gpu"]), ()),
                                      key=lambda s: s.shape_idx)))
        for r in sorted(rows["results"], key=lambda r: (r["gpu"], r["run_id"]))
    )
    baselines = tuple(sorted(
        (baseline(r) for r in rows["baselines"]),
        key=lambda b: (b.bench, b.problem, b.gpu, b.shape_idx, b.variant),
    ))

    problems = [
        *_check_keys(results_dir, runs, results, baselines),
        *_check_results(results_dir, runs, results, hardware, shapes_by_result),
    ]
    if problems:
        raise DataError(problems)
    results, superseded = split_superseded(runs, results, baselines)
    return SiteData(
        runs=runs,
        results=results,
        superseded=superseded,
        baselines=baselines,
        hardware=hardware,
        problems=_load_decks(decks_dir, runs),
        solutions=(solutions := _read_solutions(data_dir / "submissions", runs)),
        sidecars=_read_sidecars(data_dir / "submissions", runs, solutions),
        table_files={**{f"data/results/{p.parent.name}/{p.name}": p
                        for p in sorted(results_dir.glob("*/*.parquet")) if p.stem in TABLES},
                     **{f"data/{p.name}": p for p in [data_dir / "regrades.parquet"] if p.is_file()},
                     **_log_files(results_dir, results)},
        annotations={k: v for k, v in load_annotations(data_dir / "annotations").items() if k in runs},
        readme=_read_readme(data_dir / "README.md"),
        regrades=_read_regrades(data_dir / "regrades.parquet", runs, hardware),
    )


def _read_regrades(path: Path, runs: dict[str, Run], hardware: dict[str, Hardware]) -> tuple[dict[str, Any], ...]:
    """DATA/regrades.parquet's rows, each naming a run of the runs table and a GPU of the hardware table (one
    `DataError` line per field that does not)."""
    rows = read_regrades(path)
    unknown = [f"{path}: row {i} (run_id={row['run_id']!r}, gpu={row['gpu']!r}): field {field!r}: expected "
               f"{what}" for i, row in enumerate(rows)
               for field, known, what in (("run_id", runs, "a run of the runs table"),
                                          ("gpu", hardware, "a GPU of the hardware table"))
               if row[field] not in known]
    if unknown:
        raise DataError(unknown)
    return tuple(rows)


def split_superseded(runs: dict[str, Run], results: tuple[Result, ...],
                     baselines: tuple[Baseline, ...]) -> tuple[tuple[Result, ...], tuple[Result, ...]]:
    """(shown, superseded): a pass kernelboard measured is superseded where its grader timed by a method
    older than its problem's torch.compile baselines on its GPU were measured by (`settings.BASELINE_METHOD_SINCE`).

    A regrade under a new timing method replaces a problem's baselines first, then its runs a few at a
    time. Each row's speedup divides its own times by the baselines of its own grading, but two methods'
    speedups do not rank against each other (0.4.2 stopped flooring compile lines at their own dispatch,
    which moved every 03 speedup by up to 29%), so until such a pass is regraded it takes no cell, no
    place on a problem page and no run page: its model's row is a regrade in progress. A failure carries
    no speed, so its verdict stays; imported results are another grader's and never superseded; a problem
    whose baselines are all older keeps its rows. A verdict a later rule changed (`settings.SUPERSEDED_VERDICTS`:
    a Mega step refused for state keys of its own, or for a timed call that may be another expert choice) is
    held back the same way, pass or not."""
    rebaselined = {(b.bench, b.problem, b.gpu) for b in baselines if rebaselines(b.variant, b.grader_version)}
    shown, held = [], []
    for r in results:
        run = runs[r.run_id]
        stale = not r.is_imported and held_back(r.grader_version, r.status, r.message, run.problem,
                                                  (run.bench, run.problem, r.gpu) in rebaselined)
        (held if stale else shown).append(r)
    return tuple(shown), tuple(held)


def _read_readme(path: Path) -> str | None:
    """DATA/README.md as text, or None when there is none; a README that is not UTF-8 is a data error."""
    if path.is_symlink():  # never followed, like a submission's files
        raise DataError([f"{path}: a symbolic link; the data README must be a plain file"])
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError([f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None


def _log_files(results_dir: Path, results: tuple[Result, ...]) -> dict[str, Path]:
    """The grading logs the results name (published beside the tables so a reader can check them)."""
    logs = {}
    for r in results:
        path = results_dir / r.log_path if r.log_path else None
        if path is not None and path.is_file() and path.resolve().is_relative_to(results_dir.resolve()):
            logs[f"data/results/{r.log_path}"] = path
    return logs


def _check_keys(results_dir: Path, runs: dict[str, Run], results: tuple[Result, ...],
                baselines: tuple[Baseline, ...]) -> list[str]:
    """Keys become URL path parts (runs/<gpu>/<run_id>/): letters, digits, '.', '_', '-' only."""
    bad = []
    values = [("runs", "run_id", r.run_id) for r in runs.values()]
    values += [("runs", f, getattr(r, f)) for r in runs.values() for f in ("bench", "problem")]
    values += [("results", "gpu", r.gpu) for r in results]
    values += [("baselines", "gpu", b.gpu) for b in baselines]
    values += [("results folder", "name", p.name) for p in results_dir.iterdir() if p.is_dir()]
    for table, field, value in sorted(set(values)):
        if not RUN_ID_PATTERN.match(value):
            bad.append(f"{results_dir}: {table}.parquet: field '{field}': {value!r} is not usable in a URL "
                       "(letters, digits, '.', '_' or '-', not starting with a punctuation mark)")
    return bad


def _check_results(results_dir: Path, runs: dict[str, Run], results: tuple[Result, ...],
                   hardware: dict[str, Hardware],
                   shapes_by_result: dict[tuple[str, str], list[ShapeResult]]) -> list[str]:
    """What the pages need beyond the contract: hardware rows, and shape rows that add up."""
    bad = []
    graded = {(r.run_id, r.gpu) for r in results}
    for run_id, gpu in sorted(set(shapes_by_result) - graded):
        bad.append(f"{results_dir / gpu / 'shapes.parquet'}: run_id={run_id!r}: shape rows for a run "
                   f"with no row in {results_dir / gpu / 'results.parquet'}")
    for i, r in enumerate(results):
        where = f"{results_dir / r.gpu / 'results.parquet'}: row {i} (run_id={r.run_id!r}, gpu={r.gpu!r})"
        if r.gpu != CPU_KEY and r.gpu not in hardware:
            bad.append(f"{where}: field 'gpu': no row for {r.gpu!r} in "
                       f"{results_dir / r.gpu / 'hardware.parquet'}"
                       " (the site needs the GPU's name and peaks)")
        if not r.is_pass:
            continue
        speedups = [s.speedup_vs_compile for s in r.shapes]
        imported_geomean_only = r.is_imported and all(v is None for v in speedups)
        if r.is_imported and r.speedup_vs_compile is None:
            continue  # its grader's score only (the contract checked it): shape rows are what it published
        if len(r.shapes) != r.n_shapes:
            bad.append(f"{where}: field 'n_shapes': a pass over {r.n_shapes} shapes has {len(r.shapes)} "
                       f"rows in shapes.parquet")
        elif imported_geomean_only:
            continue
        elif any(v is None or not (math.isfinite(v) and v > 0) for v in speedups):
            bad.append(f"{where}: shapes.parquet: a pass needs a positive 'speedup_vs_compile' "
                       "on every shape")
        elif not math.isclose(geomean(speedups), r.speedup_vs_compile, rel_tol=_GEOMEAN_RTOL):  # type: ignore[arg-type]
            bad.append(f"{where}: field 'speedup_vs_compile': {r.speedup_vs_compile!r} is not the geomean of "
                       f"its shapes' speedups ({geomean(speedups)!r})")  # type: ignore[arg-type]
    return bad


def _load_decks(decks_dir: Path, runs: dict[str, Run]) -> dict[tuple[str, str], Problem]:
    """The deck problem of every (bench, problem) the runs name; missing folders in one error."""
    wanted = sorted({(r.bench, r.problem) for r in runs.values()})
    missing = [f"{decks_dir / b / p}: no deck folder for problem {b}/{p}, which runs.parquet names"
               for b, p in wanted if not (decks_dir / b / p).is_dir()]
    if missing:
        head = missing[0] if len(missing) == 1 else f"{len(missing)} problems have no deck:"
        raise DeckError(head if len(missing) == 1 else head + "\n" + "\n".join(f"  {m}" for m in missing))
    problems = {}
    for bench, name in wanted:
        problem = load_problem(decks_dir / bench / name)
        if problem.bench != bench:
            raise DeckError(f"{problem.folder / 'problem.yaml'}: key 'bench': expected {bench!r} "
                            f"(the folder's deck), got {problem.bench!r}")
        problems[(bench, name)] = problem
    return problems


def _read_solutions(submissions_dir: Path, runs: dict[str, Run]) -> dict[str, str]:
    """`solution.py` of each run that has one, as text (absent files are simply not shown). Paths as
    strings and os calls: pathlib's objects cost more than the reading at ten thousand runs."""
    out, bad = {}, []
    root = str(submissions_dir)
    for run in runs.values():
        folder = os.path.join(root, run.bench, run.run_id)
        path = os.path.join(folder, "solution.py")
        if os.path.islink(path) or os.path.islink(folder):  # never followed: it could point at /etc/passwd
            bad.append(f"{path if os.path.islink(path) else folder}: a symbolic link; a submission's files "
                       "must be plain files in its folder (links are never followed or published)")
        elif os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    out[run.run_id] = f.read()
            except UnicodeDecodeError as exc:
                bad.append(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})")
    if bad:
        raise DataError(bad)
    return out


def _folder_files(folder: str) -> list[tuple[str, str]]:
    """(path relative to `folder`, '/'-separated; full path) of every plain file below `folder`, in
    `sorted(Path.rglob)` order; links and __pycache__ folders are left out and never followed."""
    out, stack = [], [("", folder)]
    while stack:
        rel, path = stack.pop()
        with os.scandir(path) as entries:
            for e in entries:
                name = f"{rel}/{e.name}" if rel else e.name
                if e.is_symlink():
                    continue
                if e.is_dir():
                    if e.name != "__pycache__":
                        stack.append((name, e.path))
                elif e.is_file():
                    out.append((name, e.path))
    return sorted(out, key=lambda f: f[0].split("/"))


def _read_sidecars(submissions_dir: Path, runs: dict[str, Run],
                   solutions: dict[str, str]) -> dict[str, tuple[SidecarFile, ...]]:
    """Every other file of each submission folder that has a solution.py (what the grader hashes with it:
    all but run.yaml and __pycache__), by name. A file over SIDECAR_MAX_BYTES, or not UTF-8 text, is
    listed with its size and why it is not shown, never dropped."""
    out = {}
    for run_id in solutions:
        files = []
        for rel, path in _folder_files(os.path.join(submissions_dir, runs[run_id].bench, run_id)):
            if rel in ("solution.py", "run.yaml"):
                continue
            size = os.stat(path).st_size
            text, why = None, None
            if size > SIDECAR_MAX_BYTES:
                why = f"{size:,} bytes, over the {SIDECAR_MAX_BYTES // 1024} KB shown on a page"
            else:
                try:
                    with open(path, encoding="utf-8") as f:
                        text = f.read()
                except UnicodeDecodeError:
                    why = "not UTF-8 text"
            files.append(SidecarFile(rel, size, text, why))
        if files:
            out[run_id] = tuple(files)
    return out


# ------------------------------------------------------------------------- remembered between builds


def remember(path: Path, key: str, data: SiteData, extra: object = None) -> None:
    """Keep `data`, as validated, in `path` under `key` (the digests of every input it was read from and
    of the code that read it), less the submissions' files, which are read again each time; `extra`: what
    else was computed from the same inputs (the run pages' row digests). At 10,000 runs loading and
    validating took ~2 s of a rebuild after one edited solution; reading this back 0.4 s. Compressed
    (zlib, fastest level): 20 MB of pickle at 10,000 runs is 6% of the site, against a budget of 20%
    for everything kept beside it. The file is this build's own output, beside the site, like the site
    itself."""
    blob = pickle.dumps((dataclasses.replace(data, solutions={}, sidecars={}), extra), protocol=5)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(key.encode() + b"\n" + zlib.compress(blob, 1))
    os.replace(tmp, path)


def remembered(path: Path, key: str, data_dir: Path) -> tuple[SiteData, Any] | None:
    """The data (and `extra`) `remember` kept under this very `key`, with the submissions' files read
    afresh; None when there is none (or another key: an input or the loading code changed)."""
    try:
        with open(path, "rb") as f:
            if f.readline() != key.encode() + b"\n":
                return None
            data, extra = pickle.loads(zlib.decompress(f.read()))
    except (OSError, EOFError, zlib.error, pickle.UnpicklingError, AttributeError, ImportError, TypeError,
            ValueError):
        return None
    if not isinstance(data, SiteData):
        return None
    solutions = _read_solutions(data_dir / "submissions", data.runs)
    return dataclasses.replace(data, solutions=solutions,
                               sidecars=_read_sidecars(data_dir / "submissions", data.runs, solutions)), extra

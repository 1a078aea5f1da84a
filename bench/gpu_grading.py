"""Grade time and timing fidelity on the GPU, both from one run of the real `kernelboard eval`.

Fidelity (issue 14): the same submission (`--fidelity-run`, default the house 03 kernel) is graded
`--gradings` times (default 3) on the first GPU of `--gpus`, one grading after another, while the
second GPU grades other submissions (`--load-only`): the load, as during a regrade with
`--gpus 0,1`. Printed per shape: each grading's median time and their spread (max/min − 1), a
shape of ≥ 20 µs over 3% flagged; then each grading's headline (speedup over torch.compile) and
its spread against 2%. A grading that is not `pass` is a finding, printed with its message.

Grade time: the median `grade_seconds` per problem over the same gradings and the load's, beside
KernelBench-Hard's harness on an H200 (FP8 01: 39 s, top-k 05: 79 s, paged attention 03: 106 s);
the target is half of those, and 150 s for 06 (MoE).

Method. Every grading is a `kernelboard eval --out DIR --only RUN_ID` subprocess with
`CUDA_VISIBLE_DEVICES` set, exactly what a user runs. First, one `--baselines-only` call on the
first GPU fills a seed folder, a copy of `--results` (default data/results, never written to),
so cached baselines are reused and nothing is measured twice. Each fidelity grading then writes
into its own fresh copy of the seed, the fidelity runs interleaved round by round; the load grades
its submissions one call each into one more copy, in a cycle while the fidelity gradings run and
at least once each. The tables come from each folder's results and shapes parquet files. A
`--device cpu` run grades the fidelity runs on the CPU shapes without a load (unless
`--load-only` asks for one, on the CPU too): a smoke test, not a measurement. On a host with one GPU,
`--gpus 0 --cpu-load N` keeps N busy-looping processes running instead of the second GPU's load.
An interrupt (Ctrl-C, SIGINT, or SIGTERM as a device's time limit sends) stops the gradings still
running and reports those that finished (`"interrupted": true` in the JSON; exit 130).

    python3 bench/gpu_grading.py --gpus 0,1 --json fidelity.json
    python3 bench/gpu_grading.py --gpus 0 --cpu-load 4 --json fidelity.json    # one GPU
    python3 bench/gpu_grading.py --device cpu --fidelity-run '*house_07*' --gradings 2
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fnmatch
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kernelboard.errors import UsageError
from kernelboard.eval.tables import read_table

REPO = Path(__file__).resolve().parents[1]
FIDELITY_RUNS = ("20261129_190000_house_kernelboard-house_03_paged_attention",)
#: The load on the second GPU: the house kernels of the problems with a grade-time target besides 03.
LOAD_RUNS = ("20261129_190000_house_kernelboard-house_01_fp8_gemm",
             "20261129_190000_house_kernelboard-house_05_topk_bitonic",
             "20261130_120000_house_kernelboard-house_06_sonic_moe_swiglu")
#: KernelBench-Hard's harness (check + benchmark) per submission on an H200, in seconds (bench/README.md).
ORIGINAL_S = {"01_fp8_gemm": 39.0, "05_topk_bitonic": 79.0, "03_paged_attention": 106.0}
#: Issue 14's grade-time targets: half the original harness's time; 06 (MoE, no original figure) 150 s.
TARGET_S = {**{p: s / 2 for p, s in ORIGINAL_S.items()}, "06_sonic_moe_swiglu": 150.0}
SHAPE_SPREAD_MAX = 0.03  # per-shape spread of the median, for shapes of at least SHAPE_FLOOR_MS
SHAPE_FLOOR_MS = 0.020
HEADLINE_SPREAD_MAX = 0.02


@dataclass(frozen=True)
class Grading:
    """One `kernelboard eval` call and the row it wrote (status "no row" when it wrote none)."""

    lane: str  # "fidelity" or "load"
    device: str  # the CUDA device index, or "cpu"
    run_id: str
    problem: str | None
    round: int  # the n-th grading of this run in its lane, from 1
    status: str
    message: str
    speedup_vs_compile: float | None
    grade_seconds: float | None
    shape_ms: dict[int, float]  # shape index -> median_ms
    shape_labels: dict[int, str]
    wall_s: float  # the whole call, start-up included
    exit_code: int
    log: str


@dataclass(frozen=True)
class ShapeFigure:
    shape_idx: int
    label: str
    median_ms: list[float | None]  # one per grading, None where that grading has no time
    spread: float | None
    judged: bool  # the shape's median is at least SHAPE_FLOOR_MS, so the spread target applies
    ok: bool | None  # None: fewer than two times, or not judged


@dataclass(frozen=True)
class RunFidelity:
    run_id: str
    problem: str | None
    statuses: list[str]
    messages: list[str]
    shapes: list[ShapeFigure]
    headline: list[float | None]
    headline_spread: float | None
    headline_ok: bool | None


@dataclass(frozen=True)
class ProblemTime:
    problem: str
    gradings: int
    passed: int
    submissions: int
    median_s: float  # every grading with a time (a refused grading often ends early)
    median_pass_s: float | None  # the gradings that passed: what the target is held to
    original_s: float | None
    target_s: float | None
    met: bool | None  # None: no target, no grading passed, or not a GPU run


# ------------------------------------------------------------------------------ figures (pure)


def spread(values: Sequence[float]) -> float | None:
    """max/min − 1 of positive values (0.03: the largest is 3% above the smallest); None for fewer than two."""
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"spread needs positive finite values, got {bad}")
    return max(values) / min(values) - 1 if len(values) >= 2 else None


def fidelity_figures(gradings: Sequence[Grading]) -> list[RunFidelity]:
    """Per fidelity run (in order of first grading): each shape's medians and spread, the headline's."""
    runs: dict[str, list[Grading]] = {}
    for g in gradings:
        if g.lane == "fidelity":
            runs.setdefault(g.run_id, []).append(g)
    figures = []
    for run_id, gs in runs.items():
        gs = sorted(gs, key=lambda g: g.round)
        shapes = []
        for idx in sorted({i for g in gs for i in g.shape_ms}):
            times = [g.shape_ms.get(idx) for g in gs]
            present = [t for t in times if t is not None]
            s = spread(present)
            judged = statistics.median(present) >= SHAPE_FLOOR_MS
            label = next(g.shape_labels[idx] for g in gs if idx in g.shape_labels)
            shapes.append(ShapeFigure(idx, label, times, s, judged,
                                      None if s is None or not judged else s <= SHAPE_SPREAD_MAX))
        headline = [g.speedup_vs_compile for g in gs]
        hs = spread([h for h in headline if h is not None])
        figures.append(RunFidelity(run_id, gs[0].problem, [g.status for g in gs], [g.message for g in gs], shapes,
                                   headline, hs, None if hs is None else hs <= HEADLINE_SPREAD_MAX))
    return figures


def grade_time_figures(gradings: Sequence[Grading], device: str) -> list[ProblemTime]:
    """Per problem, the median grade_seconds of every grading that has one and of those that passed; the
    latter against its target (on a GPU)."""
    by_problem: dict[str, list[Grading]] = {}
    for g in gradings:
        if g.problem is not None and g.grade_seconds is not None:
            by_problem.setdefault(g.problem, []).append(g)
    figures = []
    for problem, gs in sorted(by_problem.items()):
        passed = [g.grade_seconds for g in gs if g.status == "pass"]
        median_pass = statistics.median(passed) if passed else None  # type: ignore[type-var]
        target = TARGET_S.get(problem)
        met = None if target is None or median_pass is None or device != "cuda" else median_pass <= target
        figures.append(ProblemTime(problem, len(gs), len(passed), len({g.run_id for g in gs}),
                                   statistics.median(g.grade_seconds for g in gs),  # type: ignore[type-var]
                                   median_pass, ORIGINAL_S.get(problem), target, met))
    return figures


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _verdict(ok: bool | None, limit: float, judged: bool = True) -> str:
    if not judged:
        return f"< {SHAPE_FLOOR_MS * 1000:.0f} µs: not judged"
    if ok is None:
        return "—"
    return f"ok (≤ {limit:.0%})" if ok else f"[red]over {limit:.0%}[/]"


def fidelity_table(fig: RunFidelity, title: str) -> Table:
    """One row per shape (median µs of each grading, spread, verdict), then status and headline rows."""
    table = Table(title=title, title_justify="left", min_width=len(title))
    table.add_column("shape", justify="right")
    table.add_column("label")
    for i in range(len(fig.statuses)):
        table.add_column(f"#{i + 1}", justify="right")
    table.add_column("spread", justify="right")
    table.add_column("verdict")
    table.add_row("", "status", *(s if s == "pass" else f"[red]{s}[/]" for s in fig.statuses), "", "")
    for s in fig.shapes:
        times = ["—" if t is None else f"{t * 1000:.2f} µs" for t in s.median_ms]
        table.add_row(str(s.shape_idx), s.label, *times, _pct(s.spread),
                      _verdict(s.ok, SHAPE_SPREAD_MAX, s.judged))
    heads = ["—" if h is None else f"{h:.2f}×" for h in fig.headline]
    table.add_row("", "headline × compile", *heads, _pct(fig.headline_spread),
                  _verdict(fig.headline_ok, HEADLINE_SPREAD_MAX), end_section=True)
    return table


def grade_time_table(figures: Sequence[ProblemTime], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name, justify in (("problem", "left"), ("gradings", "right"), ("passed", "right"), ("median s", "right"),
                          ("passed: median s", "right"), ("original s", "right"), ("target s", "right"),
                          ("verdict", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for f in figures:
        verdict = "—" if f.met is None else ("met" if f.met else "[red]missed[/]")
        table.add_row(f.problem, str(f.gradings), str(f.passed), f"{f.median_s:.1f}",
                      "—" if f.median_pass_s is None else f"{f.median_pass_s:.1f}",
                      "—" if f.original_s is None else f"{f.original_s:.0f}",
                      "—" if f.target_s is None else f"≤ {f.target_s:.1f}", verdict)
    return table


def findings(gradings: Sequence[Grading]) -> list[str]:
    """One line per grading that is not `pass` (a failed call included)."""
    return [f"{g.lane} #{g.round} {g.run_id} on {_where(g.device)}: {g.status} — {g.message}"
            for g in gradings if g.status != "pass"]


def summary(device: str, gpus: Sequence[str], gradings: Sequence[Grading], cpu_load: int = 0,
            interrupted: bool = False) -> dict[str, Any]:
    """Everything printed, as JSON-ready data (`interrupted`: only the gradings that finished)."""
    return {"device": device, "gpus": list(gpus), "cpu_load": cpu_load, "interrupted": interrupted,
            "targets": {"shape_spread_max": SHAPE_SPREAD_MAX, "shape_floor_ms": SHAPE_FLOOR_MS,
                        "headline_spread_max": HEADLINE_SPREAD_MAX, "grade_seconds": TARGET_S,
                        "original_harness_seconds": ORIGINAL_S},
            "fidelity": [asdict(f) for f in fidelity_figures(gradings)],
            "grade_time": [asdict(f) for f in grade_time_figures(gradings, device)],
            "findings": findings(gradings),
            "gradings": [asdict(g) for g in gradings]}


@contextlib.contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """SIGTERM (`timeout`'s default, a device's time limit) interrupts like Ctrl-C, so the gradings
    that finished are still reported."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def busy_host(n: int) -> Iterator[None]:
    """`n` busy-looping processes while the gradings run: a host's load where no second GPU grades
    (a one-GPU machine), in place of the load lane's (bench/timing_methods.py's `--cpu-load` too)."""
    # their own session: an interrupt of the bench (Ctrl-C, `timeout -s INT`) reaches the bench, which
    # kills them, not them directly (four KeyboardInterrupt tracebacks in its log)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def _where(device: str) -> str:
    return "the CPU" if device == "cpu" else f"GPU {device}"


# ------------------------------------------------------------------------------ gradings (subprocesses)


@dataclass(frozen=True)
class _Config:
    device: str
    gpus: tuple[str, ...]  # (fidelity GPU, load GPU) or one; ("cpu",) on the CPU
    deck: Path
    submissions: Path
    work: Path
    keep: bool  # --work was given: the logs outlive the run
    unsandboxed: bool


@dataclass
class _Call:
    lane: str
    device: str
    run_id: str
    round: int
    out: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    log: IO[str]
    started: float
    started_at: dt.datetime


def _eval_args(cfg: _Config, out: Path, run_ids: Sequence[str], *extra: str) -> list[str]:
    args = [sys.executable, "-m", "kernelboard.cli", "eval", "--device", cfg.device, "--deck", str(cfg.deck),
            "--submissions", str(cfg.submissions), "--out", str(out), *extra]
    args += ["--unsandboxed"] if cfg.unsandboxed else []
    for run_id in run_ids:
        args += ["--only", run_id]
    return args


def _env(device: str) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "" if device == "cpu" else device}


def _start(cfg: _Config, lane: str, device: str, run_id: str, round_: int, out: Path) -> _Call:
    if not out.exists():
        shutil.copytree(cfg.work / "seed", out)
    log_path = cfg.work / "logs" / f"{lane}-{round_}-{run_id}.log"
    log = log_path.open("w")
    started_at = dt.datetime.now(dt.UTC).replace(microsecond=0)
    proc = subprocess.Popen(_eval_args(cfg, out, [run_id]), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=_env(device), cwd=REPO)
    return _Call(lane, device, run_id, round_, out, log_path, proc, log, time.perf_counter(), started_at)


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def _collect(call: _Call) -> Grading:
    """The row this call wrote for its run (graded after it started), read from its results folder."""
    rc = call.proc.wait()
    call.log.close()
    wall = time.perf_counter() - call.started
    for results in sorted(call.out.glob("*/results.parquet")):
        rows = [r for r in read_table(results, "results").to_pylist()
                if r["run_id"] == call.run_id and r["graded_at"] >= call.started_at]
        if not rows:
            continue
        row, folder = rows[0], results.parent
        runs = read_table(folder / "runs.parquet", "runs").to_pylist()
        shapes_path = folder / "shapes.parquet"
        shapes = [s for s in read_table(shapes_path, "shapes").to_pylist()
                  if s["run_id"] == call.run_id] if shapes_path.exists() else []
        return Grading(call.lane, call.device, call.run_id,
                       next((r["problem"] for r in runs if r["run_id"] == call.run_id), None), call.round,
                       row["status"], row["message"], row["speedup_vs_compile"], row["grade_seconds"],
                       {s["shape_idx"]: s["median_ms"] for s in shapes if s["median_ms"] is not None},
                       {s["shape_idx"]: s["shape_label"] for s in shapes}, wall, rc, str(call.log_path))
    return Grading(call.lane, call.device, call.run_id, None, call.round, "no row",
                   f"kernelboard eval exited {rc} without a row for it: {_last_line(call.log_path)}",
                   None, None, {}, {}, wall, rc, str(call.log_path))


def _stop(call: _Call) -> None:
    """Interrupt a call as Ctrl-C would (its grader then kills its worker's group), then kill it."""
    with contextlib.suppress(ProcessLookupError):
        call.proc.send_signal(signal.SIGINT)
    try:
        call.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        call.proc.kill()
        call.proc.wait()
    call.log.close()


def _seed(cfg: _Config, results: Path, run_ids: Sequence[str], console: Console) -> None:
    """A copy of --results (logs left out) with every baseline the runs need: measured once, here."""
    seed = cfg.work / "seed"
    if results.is_dir():
        shutil.copytree(results, seed, ignore=shutil.ignore_patterns("logs"))
    seed.mkdir(exist_ok=True)
    log_path = cfg.work / "logs" / "seed-baselines.log"
    started = time.perf_counter()
    with log_path.open("w") as log, console.status(
            f"measuring the baselines the runs lack on {_where(cfg.gpus[0])} (cached ones reused) …"):
        rc = subprocess.run(_eval_args(cfg, seed, run_ids, "--baselines-only"), stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(cfg.gpus[0]),
                            cwd=REPO).returncode
    if rc != 0:
        where = f"log: {log_path}" if cfg.keep else "pass --work DIR to keep its log"
        raise click.ClickException(f"the baselines call exited {rc}: {_last_line(log_path)} ({where})")
    console.print(f"baselines ready in {time.perf_counter() - started:.0f} s: {_last_line(log_path)}")


def _short(run_id: str) -> str:
    """A run id without its leading date and time."""
    parts = run_id.split("_", 2)
    return parts[2] if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() else run_id


def grade_all(cfg: _Config, fidelity_runs: Sequence[str], n: int, load_runs: Sequence[str],
              console: Console) -> tuple[list[Grading], bool]:
    """The fidelity gradings on the first device, one after another, rounds interleaved; meanwhile the
    load on the last device, one call per submission, cycling while they run and at least once each.
    Returns the gradings that finished and whether an interrupt (Ctrl-C, SIGINT or SIGTERM, as a
    device's time limit sends) cut the rest short: the calls then running are stopped, and what
    finished is still reported."""
    fidelity = [(run_id, r) for r in range(1, n + 1) for run_id in fidelity_runs]
    load_device = cfg.gpus[-1]
    running: dict[str, _Call | None] = {"load": None, "fidelity": None}
    started = {"load": 0, "fidelity": 0}
    gradings: list[Grading] = []

    def next_call(lane: str) -> _Call | None:
        k = started[lane]
        if lane == "fidelity":
            if k >= len(fidelity):
                return None
            run_id, round_ = fidelity[k]
            out = cfg.work / f"fidelity-{round_}-{run_id}"
            call = _start(cfg, lane, cfg.gpus[0], run_id, round_, out)
        else:
            busy = started["fidelity"] < len(fidelity) or running["fidelity"] is not None
            if not load_runs or not (busy or k < len(load_runs)):
                return None
            run_id = load_runs[k % len(load_runs)]
            call = _start(cfg, lane, load_device, run_id, k // len(load_runs) + 1, cfg.work / "load")
        started[lane] += 1
        return call

    def waiting() -> str:
        parts = []
        for lane, call in running.items():
            if call is not None:
                total = f"/{n}" if lane == "fidelity" else ""
                parts.append(f"{lane}: grading {_short(call.run_id)} #{call.round}{total} on {_where(call.device)} "
                             f"({time.perf_counter() - call.started:.0f} s)")
        return " · ".join(parts) + " …"

    try:
        with console.status("starting …") as status:
            while True:
                for lane in ("load", "fidelity"):
                    call = running[lane]
                    if call is not None and call.proc.poll() is not None:
                        g = _collect(call)
                        gradings.append(g)
                        running[lane] = None
                        score = f" {g.speedup_vs_compile:.2f}×" if g.speedup_vs_compile else ""
                        seconds = "—" if g.grade_seconds is None else f"{g.grade_seconds:.1f} s"
                        verdict = g.status if g.status == "pass" else f"[red]{g.status}[/]"
                        console.print(f"  {lane} #{g.round} {_short(g.run_id)} on {_where(g.device)}: {verdict}"
                                      f"{score}, grade {seconds} (call {g.wall_s:.0f} s)", highlight=False)
                    if running[lane] is None:
                        running[lane] = next_call(lane)
                        started_call = running[lane]
                        if started_call is not None and not console.is_terminal:  # no status line to read
                            total = f"/{n}" if lane == "fidelity" else ""
                            console.print(f"  {lane}: grading {_short(started_call.run_id)} #{started_call.round}"
                                          f"{total} on {_where(started_call.device)} …", highlight=False)
                if all(c is None for c in running.values()):
                    return gradings, False
                status.update(waiting())
                time.sleep(0.5)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: the calls still running are stopped; the {len(gradings)} "
                      "that finished are reported[/]")
        return gradings, True
    finally:
        for call in running.values():
            if call is not None and call.proc.poll() is None:
                _stop(call)


# ------------------------------------------------------------------------------ command line


def _matching(submissions: Path, globs: Sequence[str], option: str) -> list[str]:
    """Run ids (folder names with a run.yaml) each glob matches, in order, each once; a glob matching none is
    a usage error."""
    names = sorted(p.name for p in submissions.iterdir() if (p / "run.yaml").is_file())
    found: list[str] = []
    for glob in globs:
        hits = [name for name in names if fnmatch.fnmatch(name, glob)]
        if not hits:
            raise UsageError(f"{option} {glob!r}: no submission under {submissions} matches")
        found += [h for h in hits if h not in found]
    return found


def _devices(device: str, gpus: str | None, load: tuple[str, ...]) -> tuple[str, ...]:
    if device == "cpu":
        if gpus is not None:
            raise UsageError("--gpus is for --device cuda; --device cpu grades on the CPU")
        return ("cpu",)
    listed = tuple(d.strip() for d in (gpus or "0,1").split(","))
    if not 1 <= len(listed) <= 2 or not all(d.isdigit() for d in listed) or len(set(listed)) != len(listed):
        raise UsageError(f"--gpus: expected one or two distinct device indices like 0,1, got {gpus!r}")
    if load and len(listed) == 1:
        raise UsageError("--load-only needs a second GPU in --gpus (e.g. --gpus 0,1)")
    return listed


@contextlib.contextmanager
def _work_folder(work: Path | None) -> Iterator[Path]:
    if work is None:
        with tempfile.TemporaryDirectory(prefix="kb-gpu-grading-") as tmp:
            yield Path(tmp)
        return
    if work.exists() and (not work.is_dir() or any(work.iterdir())):
        raise UsageError(f"--work {work}: expected a new or empty folder")
    work.mkdir(parents=True, exist_ok=True)
    yield work


_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@click.command(context_settings={"help_option_names": ["-h", "--help"]}, help=__doc__.split("\n\n")[0])
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--gpus", default=None, metavar="LIST",
              help="The GPU of the fidelity gradings, then the GPU of the load  [default: 0,1; cuda only].")
@click.option("--fidelity-run", "fidelity_globs", multiple=True, metavar="GLOB",
              help=f"Run(s) graded --gradings times (repeatable)  [default: {FIDELITY_RUNS[0]}].")
@click.option("-n", "--gradings", type=click.IntRange(min=2), default=3, show_default=True,
              help="How many times each fidelity run is graded.")
@click.option("--load-only", "load_globs", multiple=True, metavar="GLOB",
              help="Runs the second GPU grades meanwhile (repeatable)  [default on cuda with two GPUs: the "
                   "house kernels of 01, 05 and 06; none on the CPU].")
@click.option("--results", type=_DIR, default=REPO / "data" / "results",
              help="Results whose cached baselines are reused (copied; never written to)  [default: data/results].")
@click.option("--deck", type=_DIR, default=REPO / "eval" / "decks" / "hard")
@click.option("--submissions", type=_DIR, default=REPO / "data" / "submissions" / "hard")
@click.option("--work", type=click.Path(path_type=Path), default=None,
              help="Keep every grading's results folder and log here  [default: a temporary folder].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the figures and every grading as JSON here.")
@click.option("--unsandboxed", is_flag=True, help="Pass --unsandboxed to kernelboard eval.")
@click.option("--cpu-load", type=click.IntRange(0, 256), default=0, show_default=True,
              help="Busy-looping processes kept running while the gradings run (a one-GPU host's load).")
def cli(device: str, gpus: str | None, fidelity_globs: tuple[str, ...], gradings: int, load_globs: tuple[str, ...],
        results: Path, deck: Path, submissions: Path, work: Path | None, json_path: Path | None,
        unsandboxed: bool, cpu_load: int) -> None:
    devices = _devices(device, gpus, load_globs)
    fidelity_runs = _matching(submissions, fidelity_globs or FIDELITY_RUNS, "--fidelity-run")
    default_load = LOAD_RUNS if device == "cuda" and len(devices) == 2 else ()
    load_runs = _matching(submissions, load_globs or default_load, "--load-only")
    if json_path is not None and not json_path.parent.is_dir():
        raise UsageError(f"--json {json_path}: folder {json_path.parent} does not exist")
    console = Console(stderr=True, soft_wrap=True)  # progress lines a log keeps whole
    out = Console(width=None if sys.stdout.isatty() else 120)
    if device == "cuda" and not load_runs and not cpu_load:
        console.print("[yellow]no load: the fidelity gradings run with the other GPU idle[/]")
    with _work_folder(work) as folder:
        (folder / "logs").mkdir()
        cfg = _Config(device, devices, deck.resolve(), submissions.resolve(), folder.resolve(), work is not None,
                      unsandboxed)
        _seed(cfg, results.resolve(), [*fidelity_runs, *(r for r in load_runs if r not in fidelity_runs)], console)
        load = f"; load on {_where(devices[-1])}: {_plural(len(load_runs), 'run')}" if load_runs else ""
        load += f"; {_plural(cpu_load, 'busy-looping process')} on the host" if cpu_load else ""
        console.print(f"grading {_plural(len(fidelity_runs), 'fidelity run')} {gradings}× on {_where(devices[0])}"
                      f"{load}")
        with busy_host(cpu_load), _interrupt_on_sigterm():
            graded, interrupted = grade_all(cfg, fidelity_runs, gradings, load_runs, console)
    where = "CPU shapes, CPU timings: a smoke test" if device == "cpu" else f"GPU {devices[0]}"
    with_load = f", load on GPU {devices[-1]}" if load_runs and device == "cuda" else ""
    with_load += f", {_plural(cpu_load, 'busy process')} on the host" if cpu_load else ""
    for fig in fidelity_figures(graded):
        title = f"fidelity: {_short(fig.run_id)}, {_plural(len(fig.statuses), 'grading')} on {where}{with_load}"
        out.print(fidelity_table(fig, title))
    out.print(grade_time_table(grade_time_figures(graded, device),
                               f"grade time per submission ({len(graded)} gradings; targets on the GPU only)"))
    for line in findings(graded):
        out.print(f"[red]finding:[/] {escape(line)}", highlight=False)
    if json_path is not None:
        tmp = json_path.with_name(f".{json_path.name}.tmp")
        figures = summary(device, devices, graded, cpu_load, interrupted)
        tmp.write_text(json.dumps(figures, sort_keys=True, indent=1, default=str) + "\n")
        os.replace(tmp, json_path)
        out.print(f"summary written to {json_path}")
    if interrupted:
        raise click.Abort  # after the figures: `main` says "interrupted" and exits 130
    if any(g.status == "no row" for g in graded):
        raise click.ClickException("a kernelboard eval call wrote no row (see the findings above)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; a bad argument or a failed call is one line on stderr and a non-zero exit."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="gpu_grading.py", standalone_mode=False)
    except click.ClickException as exc:
        print(f"gpu_grading.py: error: {exc.format_message()}", file=sys.stderr)
        return exc.exit_code
    except click.Abort:
        print("gpu_grading.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

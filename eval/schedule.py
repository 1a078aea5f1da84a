"""`kernelboard eval`: find submissions, measure baselines once, grade each in its own worker.

The parent never imports torch or candidate code. Each worker is `kernelboard.eval.worker` in its
own session and process group, working directory (a scratch copy of the submission) and
torch-extension / Triton caches keyed by the solution's hash, forked from a zygote process that
imported torch once (zygote.py; a fresh `python -m kernelboard.eval.worker` where there is none);
on timeout the whole group is killed. Results are written after every submission, atomically, so an
interrupted batch keeps everything graded before the interruption: a run's shapes, runs and
results rows go through one journal entry (`tables.upsert_together`), finished by the next batch
when the process was killed half-way.

Bad input never stops the batch: a malformed submission folder, a stray file beside them or a run
whose problem is not in the deck is skipped with one line saying why (no row is written for it,
so nothing reaches the site that it cannot show). Grading on a GPU holds that device's lock;
grading on the CPU holds none.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fnmatch
import json
import math
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kernelboard.errors import KernelboardError, SubmissionError, UsageError

from .cutlass_headers import Cutlass, find_cutlass
from .deck import Problem, load_deck
from .hardware import GPUS, GpuSpec, gpu_key
from .interrupted import (
    Interruption,
    add_interruption,
    graded_last,
    read_records,
    record_of,
    without_graded,
    write_records,
)
from .jail import Jail, make_jail
from .job import Job
from .prebuild import GRADING_GPU_KEYS
from .reproducible import classify, cutlass_stood_in
from .sandbox import Prebuild, driver_version, finish_prebuild, gpu_lock, probe_device, run_worker, start_prebuild
from .schema import CPU_KEY, DNF_OUTCOMES, PRECISIONS, TIME_STATS, peak_column
from .scoring import best_compile, beyond_hardware, result_row, shape_rows
from .settings import (
    BASELINE_VARIANTS,
    CUTLASS_STAND_IN_SINCE,
    GRADER_VERSION,
    HOLD_BACK_AFTER_S,
    PREBUILD_AHEAD,
    PREBUILD_CPUS_EACH,
    PREBUILD_WARM_CALL_S,
    baseline_reusable,
    graded_before,
    result_current,
)
from .submission import Submission, discover
from .tables import finish_pending, read_table, table_path, table_rows, upsert, upsert_together

_console = Console(stderr=True, soft_wrap=True)  # lines a program may read never break mid-word


@dataclass(frozen=True)
class EvalOptions:
    deck: Path
    submissions: Path
    out: Path
    device: str = "cuda"
    only: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()  # run_id globs left out, after `only`
    resume: bool = False
    regrade: bool = False  # grade even what --resume would skip, and measure baselines again
    prebuild: bool | None = None  # compile the next solution on the CPU meanwhile; None = on for CUDA
    build_ahead: int | None = None  # how many build at once; None = prebuild_depth(this host's cores)
    timeout_s: float = 900.0
    build_timeout_s: float = 600.0
    check_timeout_s: float = 600.0
    timing_timeout_s: float = 600.0
    baseline_timeout_s: float = 1800.0
    skip_baselines: tuple[str, ...] = ()  # variants not measured in this run (e.g. compile:max-autotune)
    rep_ms: float | None = None  # timing budget per shape; None = the timer's default
    unsandboxed: bool = False  # run candidate code without bubblewrap (rows say so)
    baselines_only: bool = False  # measure the baselines of the selected runs' problems, grade nothing
    #   (`--gpus` measures them so, once per GPU model, before spreading the runs over the GPUs)
    stop_at: float | None = None  # when the batch will be cut (epoch seconds: a GPU call's deadline): a run
    #   held back is not started where its earlier attempts each ran longer than what is left (`too_late`),
    #   nor any run where its problem's quickest pass (here, else on another GPU) took longer (`no_time_for`)

    @property
    def phase_timeouts(self) -> dict[str, float]:
        return {"build": self.build_timeout_s, "correctness": self.check_timeout_s, "timing": self.timing_timeout_s}


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


# ------------------------------------------------------------------------------ baselines


def _cached_baselines(out: Path, gpu: str, problem: Problem, env: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """Baseline rows of this problem measured with this device and software (any, for `env` None: read with
    no GPU, the host taken to be the one that measured them); {} if none."""
    path = table_path(out, gpu, "baselines")
    if not path.exists():
        return {}
    found: dict[int, dict[str, Any]] = {}
    for row in read_table(path, "baselines").to_pylist():
        same = (row["problem"] == problem.name and row["bench"] == problem.bench
                and (env is None or (row["device_name"] == env["device_name"]
                                     and row["torch_version"] == env["torch_version"]
                                     and row["triton_version"] == env.get("triton_version")))
                and baseline_reusable(row["variant"], row["grader_version"]))
        if same and not _transient(row):
            found.setdefault(row["shape_idx"], {})[row["variant"]] = row
    return found


def _transient(row: dict[str, Any]) -> bool:
    """An error that says nothing about the variant (the GPU's memory was full): measured again
    next time instead of being reused. Other errors (cuBLASLt refusing K = 4127) are final."""
    return row["status"] == "error" and "out of memory" in (row["message"] or "").lower()


def baseline_variants(opts: EvalOptions, problem: Problem) -> tuple[str, ...]:
    """The baselines measured for a problem: the device's eager and compile variants and the problem's
    library lines, less those --skip-baseline or the problem's `skip_baselines` names."""
    skipped = {*opts.skip_baselines, *problem.skip_baselines}
    return tuple(v for v in (*BASELINE_VARIANTS[opts.device], *(f"library:{name}" for name in problem.library))
                 if v not in skipped)


def baselines_todo(opts: EvalOptions, problem: Problem, cached: dict[int, dict[str, Any]]) -> dict[str, list[str]]:
    """shape index -> the variants `cached` lacks (an empty list where it has them all)."""
    variants = baseline_variants(opts, problem)
    return {str(s.idx): [v for v in variants if v not in cached.get(s.idx, {})]
            for s in problem.shapes_for(opts.device)}


def ensure_baselines(opts: EvalOptions, gpu: str, problem: Problem, env: dict[str, Any],
                     scratch: Path) -> dict[int, dict[str, Any]]:
    """Eager and torch.compile times for every shape, measured once per device and software (a batch
    measures them before it starts any build: `run_eval`)."""
    variants = baseline_variants(opts, problem)
    cached = {} if opts.regrade else _cached_baselines(opts.out, gpu, problem, env)
    todo = baselines_todo(opts, problem, cached)
    if not any(todo.values()):
        return cached
    _console.print(f"measuring baselines for {problem.name} on {env['device_name']} …")
    workdir = scratch / f"baselines-{problem.name}"
    workdir.mkdir()
    checkpoint = scratch / f"baselines-{problem.name}.checkpoint.json"
    job = Job(kind="baseline", problem_path=problem.folder.resolve(), device=opts.device, base_seed=2026,
              variants=tuple(variants), todo={k: tuple(v) for k, v in todo.items()}, checkpoint_path=checkpoint,
              rep_ms=opts.rep_ms)
    log = opts.out / gpu / "logs" / f"baselines-{problem.bench}-{problem.name}.log"
    header = (f"=== {_now():%Y-%m-%d %H:%M:%S} UTC, kernelboard {GRADER_VERSION} on {env['device_name']}: "
              f"measuring {sum(map(len, todo.values()))} baseline rows ===")
    try:
        outcome = run_worker(job, workdir, log, opts.baseline_timeout_s, f"baselines-{problem.name}",
                             arch=env.get("capability"), log_header=header)
    except KeyboardInterrupt:  # a GPU call's deadline: the rows measured so far are kept, the next batch
        # measures the rest (an H100 call of 2026-12-06 began 01's baselines 86 s before its end and kept none)
        _keep_interrupted(opts, gpu, problem, env, _checkpointed(checkpoint), sum(map(len, todo.values())), log)
        raise
    measured = outcome.result.get("baselines") if outcome.result.get("status") == "ok" else None
    if measured is None:
        measured = _checkpointed(checkpoint)
        _console.print(f"[red]baselines for {problem.name} failed: {outcome.result.get('message')}[/]"
                       + (f" (keeping the {len(measured)} measured before it stopped)" if measured else ""))
    _write_baselines(opts, gpu, problem, env, measured)
    return _cached_baselines(opts.out, gpu, problem, env)


def _keep_interrupted(opts: EvalOptions, gpu: str, problem: Problem, env: dict[str, Any],
                      kept: list[dict[str, Any]], wanted: int, log: Path) -> None:
    """Write the rows an interrupted baseline worker finished, and say so in its log; never raises, so
    that the interrupt goes on."""
    try:
        _write_baselines(opts, gpu, problem, env, kept)
    except KernelboardError as exc:
        _console.print(f"[red]baselines for {problem.name} interrupted; its {len(kept)} rows not kept: {exc}[/]")
        return
    with contextlib.suppress(OSError), open(log, "a") as fh:
        fh.write(f"[grader] interrupted: {len(kept)} of the {wanted} rows measured are kept; the next batch "
                 "measures the rest\n")
    _console.print(f"[yellow]baselines for {problem.name} interrupted: {len(kept)} rows measured are kept[/]")


def _write_baselines(opts: EvalOptions, gpu: str, problem: Problem, env: dict[str, Any],
                     measured: list[dict[str, Any]]) -> None:
    """Add a baseline worker's rows (shape, variant, times) to the GPU's baselines table."""
    shape_by_idx = {s.idx: s for s in problem.shapes_for(opts.device)}
    rows = []
    for b in measured:
        shape = shape_by_idx[b["shape_idx"]]
        stats = {k: b.get(k) for k in TIME_STATS}
        rows.append({"bench": problem.bench, "problem": problem.name, "gpu": gpu, "shape_idx": shape.idx,
                     "shape_label": shape.label, "shape_json": shape.params_json, "variant": b["variant"],
                     "status": b["status"], "message": b["message"], **stats, "timer": _timer(opts.device),
                     "timing_method": b.get("timing_method"),
                     "device_name": env["device_name"], "torch_version": env["torch_version"],
                     "triton_version": env.get("triton_version"), "cuda_version": env.get("cuda_version"),
                     "grader_version": GRADER_VERSION, "measured_at": _now()})
    if rows:
        upsert(table_path(opts.out, gpu, "baselines"), "baselines", rows)


def _checkpointed(path: Path) -> list[dict[str, Any]]:
    """The rows a killed baseline worker had checkpointed, or none (the file is written atomically)."""
    try:
        rows = json.loads(path.read_text())["baselines"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return rows if isinstance(rows, list) else []


def _timer(device: str) -> str:
    return "cuda_event" if device == "cuda" else "cpu_wall"


# ------------------------------------------------------------------------------ grading


def _graded_solutions(opts: EvalOptions, gpu: str) -> dict[str, str | None]:
    """run_id -> solution hash of every run already graded on this GPU by a grader whose results this one
    reproduces (`settings.result_current`; read once per batch, for --resume), less the rows that give no
    verdict (`gives_verdict`) and the failures this grader would label `not_reproducible` for the CUTLASS it
    stood in with (`_relabelled_now`)."""
    results, runs = table_path(opts.out, gpu, "results"), table_path(opts.out, gpu, "runs")
    if not (results.exists() and runs.exists()):
        return {}
    run_rows = {r["run_id"]: r for r in read_table(runs, "runs").to_pylist()}
    graded = {}
    cutlass = find_cutlass()
    for row in read_table(results, "results").to_pylist():
        run = run_rows.get(row["run_id"], {})
        if (gives_verdict(row["status"], row["message"])
                and result_current(row["grader_version"], row["message"], run.get("problem"), row["status"],
                                   row["run_id"])
                and not _relabelled_now(row, opts.submissions / row["run_id"], cutlass)):
            graded[row["run_id"]] = run.get("solution_sha256")
    return graded


#: How the two `not_graded` rows that come from the submission itself begin or end: grading it again gives
#: the same row (`grade_submission`). Every other `not_graded` is the grader's or the machine's failure.
NO_SOLUTION, NO_SHAPES = "no solution.py", " has no shapes for --device "


def gives_verdict(status: str, message: str | None) -> bool:
    """Whether a results row stands as the grading of its run (`--resume` skips the run). A `not_graded`
    row stands only where the submission left nothing to grade (no solution.py; no shapes for the
    device). Any other is the grader's own failure to give a verdict (its error, its sandbox, its share of
    the GPU, a missing baseline) and the run is graded again: LongCat-2.0 06 082519's judge ran out of the
    H100's memory on 2026-12-06, and --resume counted that row as graded."""
    text = message or ""
    return status != "not_graded" or text.startswith(NO_SOLUTION) or NO_SHAPES in text


def _relabelled_now(row: dict[str, Any], folder: Path, cutlass: Cutlass | None) -> bool:
    """Whether a failure graded before CUTLASS_STAND_IN_SINCE is one that grader labels `not_reproducible`
    (its build stood the grader's CUTLASS in for a vendored one the published files lack): gpt-5.6-sol 07
    150450's 0.5.9 `wrong`. Read from its message and published files; the error text is not kept."""
    return (row["status"] in ("wrong", "build_error", "runtime_error") and folder.is_dir()
            and graded_before(row["grader_version"], CUTLASS_STAND_IN_SINCE)
            and cutlass_stood_in(row["status"], row["message"] or "", folder, cutlass) is not None)


def grade_submission(opts: EvalOptions, gpu: str, spec: GpuSpec | None, problem: Problem | None,
                     sub: Submission, env: dict[str, Any], baselines: dict[int, dict[str, Any]],
                     scratch: Path, driver: str | None,
                     on_phase: Callable[[str], None] | None = None, cell: Jail | None = None,
                     prebuild_s: float = 0.0, built_in: Path | None = None) -> dict[str, Any]:
    """Grade (or classify without grading) one submission and write its rows; returns its result row.
    `built_in`: the scratch copy its prebuild ran in, whose builds beside solution.py the grading keeps
    (`graded_copy`).

    `graded_at` is stamped when grading ends (after the worker returns); `grade_seconds` is the worker's
    wall time plus `prebuild_s`, the wall time of this solution's own prebuild (the CPU compile of
    its extensions, which usually overlaps the previous grading): what grading it costs, compile
    included, whether or not the batch had to wait for it. A failed build or run is relabelled
    `needs_other_arch` or `not_reproducible` where `reproducible.classify` finds the cause outside the
    kernel's reach on this GPU."""
    common = {"run_id": sub.run_id, "gpu": gpu, "env": env, "timer": _timer(opts.device),
              "grader_version": GRADER_VERSION, "driver_version": driver, "graded_at": _now()}
    outcome = sub.meta["agent_outcome"]
    shapes: list[dict[str, Any]] = []
    if outcome in DNF_OUTCOMES:
        note = sub.meta.get("outcome_note") or outcome.replace("_", " ")
        row = result_row(status="dnf", message=f"did not finish: {note}", shapes=[], seeds=None,
                         grade_seconds=None, log_path=None, **common)
    elif problem is None:
        raise UsageError(f"{sub.folder / 'run.yaml'}: key 'problem': {sub.problem!r} is not in the deck")
    elif not problem.shapes_for(opts.device):
        row = result_row(status="not_graded", message=f"{problem.name}{NO_SHAPES}{opts.device}",
                         shapes=[], seeds=None, grade_seconds=None, log_path=None, **common)
    elif not sub.has_solution:
        row = result_row(status="not_graded", message=f"{NO_SOLUTION} (agent outcome: {outcome})",
                         shapes=[], seeds=None, grade_seconds=None, log_path=None, **common)
    elif sub.solution_is_empty:
        row = result_row(status="build_error", message="solution.py is empty: there is no Model to build",
                         shapes=[], seeds=None, grade_seconds=None, log_path=None, **common)
    else:
        workdir, kept = graded_copy(sub, scratch, built_in)
        job = Job(kind="grade", problem_path=problem.folder.resolve(), device=opts.device, solution_dir=workdir,
                  base_seed=secrets.randbits(31), rep_ms=opts.rep_ms, jail=cell or jail_for(opts))
        log = opts.out / gpu / "logs" / f"{sub.run_id}.log"
        res = run_worker(job, workdir, log, opts.timeout_s, sub.cache_key(),
                         opts.phase_timeouts, env.get("capability"), on_phase)
        result = res.result
        common["graded_at"] = _now()  # the end of grading, not its start
        status, message = result.get("status", "runtime_error"), result.get("message", "?")
        if kept:
            with contextlib.suppress(OSError), log.open("a") as fh:
                fh.write(f"[grader] graded in the copy its prebuild built in, keeping what its builds left "
                         f"there: {kept}\n")
        relabelled = classify(status, message, str(result.get("error_text") or ""), sub.folder,
                              (result.get("env") or env).get("capability"), ran_in=workdir, cutlass=find_cutlass())
        if relabelled is not None:
            with contextlib.suppress(OSError), log.open("a") as fh:  # the log says why, after the worker's lines
                fh.write(f"[grader] {status} relabelled {relabelled[0]}: {relabelled[1]}\n")
            status, message = relabelled
        shapes = shape_rows(problem, spec, sub.run_id, gpu, result.get("shapes", []), baselines,
                            _hardware(opts.out, gpu)) if status == "pass" else []
        beyond = beyond_hardware(problem, spec, shapes)  # None without shape rows: a pass only
        if beyond is not None:
            with contextlib.suppress(OSError), log.open("a") as fh:
                fh.write(f"[grader] pass refused integrity_violation: {beyond}\n")
            status, message, shapes = "integrity_violation", beyond, []
        row = result_row(status=status, message=message, shapes=shapes, seeds=result.get("seeds"),
                         grade_seconds=round(res.seconds + prebuild_s, 2), log_path=str(log.relative_to(opts.out)),
                         **{**common, "env": result.get("env") or env})
        row["sandbox"] = result.get("sandbox")
        if row["status"] == "pass":
            variants = {v for idx in baselines if (b := best_compile(baselines[idx])) for v in [b[0]]}
            row["compile_variant"] = ",".join(sorted(variants))
            if row.get("speedup_vs_baseline") is not None:
                row["baseline_variant"] = problem.headline_baseline
    upsert_together(opts.out, gpu, sub.run_id, [
        ("shapes", shapes, {"run_id": sub.run_id, "gpu": gpu}),
        ("runs", [sub.run_row(problem.bench)], None),
        ("results", [row], None),
    ])
    return row


#: What a scratch copy of a submission leaves out: its metadata and Python's bytecode caches.
NOT_COPIED = ("run.yaml", "__pycache__")


def graded_copy(sub: Submission, scratch: Path, built_in: Path | None) -> tuple[Path, str]:
    """The scratch copy a grading runs in, and what of its prebuild's it keeps ("" for nothing). Without a
    prebuild: a fresh copy of the published files. With one: the prebuild's own copy, at the path its
    builds ran at, since a build beside solution.py (`load(..., build_directory=<its folder>/build)`:
    deepseek-v4-flash-0731 07 021705's CUTLASS extension, 340 s on the H100's time) is rebuilt wherever a
    compile command's paths differ. There only builds stay: folders holding a `build.ninja`, and shared
    objects. Every other file the prebuild's calls left goes (a config its fake-timed autotuner saved,
    say), and so does every link and a build lock torch left (a killed build's: torch would wait for it
    forever); then the published files are written back as published, each after removing what is at
    its path, so that nothing is ever written through a link the candidate made."""
    fresh = scratch / sub.run_id
    if built_in is None or not built_in.is_dir():
        shutil.copytree(sub.folder, fresh, ignore=shutil.ignore_patterns(*NOT_COPIED))
        return fresh, ""
    builds: set[Path] = set()
    entries: list[Path] = []
    for folder, dirs, files in os.walk(built_in, followlinks=False):  # never into a linked folder
        here = Path(folder)
        if "build.ninja" in files and not (here / "build.ninja").is_symlink():
            builds.add(here)
        entries += [here / name for name in (*dirs, *files)]
    kept = 0
    for path in sorted(entries, reverse=True):  # what is in a folder before the folder
        in_build = any(d == path or d in path.parents for d in builds)
        if path.is_symlink() or (path.name == "lock" and path.parent in builds):
            path.unlink()
        elif path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()  # where it is left empty
        elif in_build or path.suffix == ".so":
            kept += 1
        else:
            path.unlink()
    for source in sorted(sub.folder.rglob("*")):
        rel = source.relative_to(sub.folder)
        if any(part in NOT_COPIED for part in rel.parts) or not source.is_file():
            continue
        target = built_in / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        shutil.copy2(source, target)
    folders = f"{len(builds)} build folder{'s' if len(builds) != 1 else ''}"
    return built_in, f"{kept} built file{'s' if kept != 1 else ''} ({folders})" if kept else ""


_MEASURED = ("measured_copy_gb_s", "measured_bf16_tflop_s", "measured_fp8_tflop_s", "measured_at")


def _hardware(out: Path, gpu: str) -> dict[str, Any] | None:
    rows = table_rows(out, gpu, "hardware")
    return rows[0] if rows else None


def _hardware_row(out: Path, gpu: str, spec: GpuSpec | None, env: dict[str, Any]) -> dict[str, Any]:
    """The datasheet row for this GPU, keeping any peaks already measured on the machine."""
    existing = _hardware(out, gpu)
    measured = {k: existing[k] for k in _MEASURED} if existing else dict.fromkeys(_MEASURED)
    if spec is not None:
        return {**spec.hardware_row(), **measured}
    return {**measured, **{"gpu": gpu, "name": env["device_name"], "sm": None, "memory_gb": None, "l2_mb": None,
            "bandwidth_gb_s": None, **{peak_column(p): None for p in PRECISIONS},
            "source": "no datasheet peaks for this device: timings only, no roofline fractions"}}


def _gradeable(opts: EvalOptions, problem: Problem | None, sub: Submission) -> bool:
    return (problem is not None and sub.has_solution and not sub.solution_is_empty
            and sub.meta["agent_outcome"] not in DNF_OUTCOMES and bool(problem.shapes_for(opts.device)))


def _prebuild(opts: EvalOptions, gpu: str, problem: Problem, sub: Submission, env: dict[str, Any],
              scratch: Path, cell: Jail) -> Prebuild:
    identity = {key: env[key] for key in GRADING_GPU_KEYS if key in env}  # none on the CPU
    return prebuild_copy(sub, problem.folder.resolve(), scratch, opts.out / gpu / "logs", env.get("capability"),
                         cell, PREBUILD_WARM_CALL_S, gpu=identity if "sm_count" in identity else None)


def prebuild_copy(sub: Submission, problem_dir: Path, scratch: Path, logs: Path, arch: str | None, cell: Jail,
                  warm_call_s: float, extensions: bool = True, gpu: dict[str, Any] | None = None) -> Prebuild:
    """Start the prebuild of a scratch copy of `sub` (its run.yaml and caches left out), into its own
    compile caches (`Submission.cache_key`), logged to `logs/<run_id>.prebuild.log`; `gpu` is the
    grading GPU's identity, for the prebuild's `torch.cuda.get_device_properties`."""
    folder = scratch / f"{sub.run_id}.prebuild"
    shutil.copytree(sub.folder, folder, ignore=shutil.ignore_patterns(*NOT_COPIED))
    return start_prebuild(problem_dir, folder, logs / f"{sub.run_id}.prebuild.log", sub.cache_key(), arch, cell,
                          warm_call_s, extensions, gpu)


def jail_for(opts: EvalOptions) -> Jail:
    """The sandbox candidate code runs in for this batch: bubblewrap, hiding every folder of ours;
    without a usable bubblewrap, a usage error unless --unsandboxed."""
    try:
        return make_jail(sandboxed=not opts.unsandboxed, device=opts.device,
                         hide=[opts.deck, opts.out, opts.submissions, opts.deck.parent])
    except RuntimeError:
        raise UsageError("candidate code runs in a bubblewrap sandbox, and no usable bubblewrap was found "
                         "(install it, e.g. `apt-get install bubblewrap`; it needs user namespaces) — or pass "
                         "--unsandboxed to grade code you trust without one") from None


def select_submissions(opts: EvalOptions, deck_problems: set[str] | None = None) -> list[Submission]:
    """The submissions `--only` selects (all without it) less those `--exclude` names, in the order of the
    `--only` globs (the runs an earlier one matches first: a queue from `eval todo`), each glob's runs by
    run_id. A folder that cannot be read, or (given the deck's problem names) names a problem the deck
    lacks, is skipped with one line on stderr; when every selected folder is refused that is one error
    listing them, and when none is selected a usage error."""
    def first_match(name: str) -> int | None:
        """The index of the first `--only` glob `name` matches (0 without any), None if left out."""
        if any(fnmatch.fnmatch(name, g) for g in opts.exclude):
            return None
        if not opts.only:
            return 0
        return next((i for i, g in enumerate(opts.only) if fnmatch.fnmatch(name, g)), None)

    def chosen(name: str) -> bool:
        return first_match(name) is not None

    found, refused = discover(opts.submissions)
    refused = [line for line in refused if chosen(_entry_name(opts.submissions, line))]
    subs = []
    for sub in found:
        if not chosen(sub.run_id):
            continue
        if deck_problems is not None and sub.problem not in deck_problems:
            refused.append(f"{sub.folder / 'run.yaml'}: key 'problem': {sub.problem!r} is not in the deck "
                           f"{opts.deck} (known: {', '.join(sorted(deck_problems))})")
        else:
            subs.append(sub)
    for line in refused:
        _console.print(f"[yellow]skipped[/] {line}", markup=True, highlight=False, soft_wrap=True)
    if not subs and refused:
        raise SubmissionError(refused[0] if len(refused) == 1 else
                              f"every selected submission was refused ({len(refused)}):\n  " + "\n  ".join(refused))
    if not subs:
        left_out = f" less {list(opts.exclude)}" if opts.exclude else ""
        raise UsageError(f"no submissions under {opts.submissions} match {list(opts.only) or 'anything'}{left_out}")
    return sorted(subs, key=lambda sub: (first_match(sub.run_id), sub.run_id))


def _entry_name(folder: Path, line: str) -> str:
    """The entry of `folder` a refusal line is about (its first path part below the folder)."""
    head = line.split(": ", 1)[0]
    try:
        return Path(head).relative_to(folder).parts[0]
    except (ValueError, IndexError):
        return head


def run_eval(opts: EvalOptions) -> list[dict[str, Any]]:
    """Grade every selected submission; returns the result rows written.

    Every problem's baselines are measured first, on a quiet host. Then, while the GPU grades one
    submission, the next ones' extensions compile on the CPU (`--prebuild`, on by default for CUDA;
    `prebuild_depth` of them at once, the first submission's too): their workers then find them in the
    shared cache. A CUDA extension's build (torch's headers through nvcc) took 50–60 s on the H200's
    host against 14 s of grading, so with one build ahead the GPU waited out most of each build. The
    GPU takes the first submission in queue order whose build has ended (`next_to_grade`), so a slow
    build delays only its own submission.
    """
    batch_started = time.time()  # a held run longer than the whole batch is told apart (`too_late`)
    deck = load_deck(opts.deck)
    subs = select_submissions(opts, set(deck))
    env = probe_device(opts.device)
    gpu = CPU_KEY if opts.device == "cpu" else gpu_key(env["device_name"])
    spec = GPUS.get(gpu)
    driver = driver_version() if opts.device == "cuda" else None
    doing = "measuring the baselines for" if opts.baselines_only else "grading"
    _console.print(f"{doing} {len(subs)} submissions on {env['device_name']} → {opts.out / gpu}")
    for run_id in finish_pending(opts.out):
        _console.print(f"  {run_id}: rows a killed batch had not finished writing, written")
    upsert(table_path(opts.out, gpu, "hardware"), "hardware", [_hardware_row(opts.out, gpu, spec, env)])
    if opts.baselines_only:  # each problem with a run to grade, measured unless cached; nothing graded
        needed = dict.fromkeys(s.problem for s in subs if _gradeable(opts, deck.get(s.problem), s))
        device_lock = gpu_lock(gpu) if opts.device == "cuda" else contextlib.nullcontext()
        with device_lock, tempfile.TemporaryDirectory(prefix="kernelboard-") as tmp:
            for name in needed:
                ensure_baselines(opts, gpu, deck[name], env, Path(tmp))
        _console.print(f"baselines of {len(needed)} problem{'' if len(needed) == 1 else 's'} in {opts.out / gpu}")
        return []
    prebuild = opts.device == "cuda" if opts.prebuild is None else opts.prebuild
    depth = (opts.build_ahead or prebuild_depth(os.cpu_count())) if prebuild else 0
    cell = jail_for(opts)
    if cell.bwrap is None:
        _console.print("[yellow]--unsandboxed: candidate code runs without bubblewrap; rows say so[/]")
    rows = []
    device_lock = gpu_lock(gpu) if opts.device == "cuda" else contextlib.nullcontext()
    with device_lock, tempfile.TemporaryDirectory(prefix="kernelboard-") as tmp, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=_console,
    ) as progress:
        scratch = Path(tmp)
        task = progress.add_task("grading", total=len(subs))
        graded = _graded_solutions(opts, gpu) if opts.resume and not opts.regrade else {}
        queue = []
        for sub in subs:
            if sub.run_id in graded and graded[sub.run_id] == sub.solution_sha256():
                progress.console.print(f"  {sub.run_id}: already graded, skipped (--resume)")
                progress.advance(task)
            else:
                queue.append((sub, deck.get(sub.problem)))
        quickest = quickest_passes(opts.out, gpu) if opts.stop_at is not None else {}
        interruptions = _interruptions(opts.out, gpu, progress.console)
        recorded = {sub.run_id: record for sub, _ in queue
                    if (record := record_of(interruptions, sub.run_id, sub.solution_sha256())) is not None}
        held = {run_id: record for run_id, record in recorded.items() if record.outlasts_a_call}
        queue = graded_last(queue, lambda item: held.get(item[0].run_id))
        for run_id, record in recorded.items():
            where = "graded last" if run_id in held else (
                f"graded in its place (cut within {HOLD_BACK_AFTER_S:.0f} s: where a deadline fell)")
            progress.console.print(f"  {run_id}: {record.summary()} in earlier batches: {where}")
        gradeable = {sub.run_id for sub, problem in queue if _gradeable(opts, problem, sub)}
        baselines: dict[str, dict[int, dict[str, Any]]] = {}  # every problem's, before any build loads the
        # host: eager lines are host-bound
        for sub, problem in queue:
            if sub.run_id in gradeable and problem is not None and problem.name not in baselines:
                progress.update(task, description=f"baselines of {problem.name}")
                baselines[problem.name] = ensure_baselines(opts, gpu, problem, env, scratch)
        builds = BuildQueue(queue, gradeable, held, depth,
                            lambda nsub, nproblem: _prebuild(opts, gpu, nproblem, nsub, env, scratch, cell))
        def why_late(sub: Submission) -> str | None:
            return (too_late(held.get(sub.run_id), opts.stop_at, started=batch_started)
                    or no_time_for(sub.problem, quickest.get(sub.problem), opts.stop_at, gpu))

        try:
            while builds.pending:
                for sub, late in builds.drop_late(why_late):  # before their builds end: none is waited for
                    progress.console.print(f"  {sub.run_id}: not started: {late}")
                    progress.advance(task)
                if not builds.pending:
                    break
                taken = builds.take(opts.build_timeout_s)
                if taken is None:  # every run that may go next is still building
                    progress.update(task, description=f"waiting for the builds of {', '.join(builds.running())}")
                    time.sleep(0.25)
                    continue
                sub, problem, ahead_of, build = taken
                if ahead_of:
                    progress.console.print(f"  {sub.run_id}: graded ahead of {ahead_of}, whose build is still "
                                           f"running")
                phases = ["its prebuild"]  # the phases it reached, for the record of an interruption
                started = time.monotonic()

                def phase_seen(phase: str, run_id: str = sub.run_id, seen: list[str] = phases) -> None:
                    _show_phase(progress, task, run_id, seen, phase)
                    builds.quiet(timing=phase == "timing")

                with _recorded_if_cut_off(opts.out, gpu, sub, started, phases, build):
                    prebuild_s = 0.0 if build is None else finish_prebuild(  # at once, unless a held run's
                        build, max(0.0, opts.build_timeout_s - build.active_s()))
                    paused_before = builds.quiet_s
                    try:
                        row = grade_submission(opts, gpu, spec, problem, sub, env, baselines.get(sub.problem, {}),
                                               scratch, driver, phase_seen, cell, prebuild_s,
                                               None if build is None else build.folder)
                    finally:
                        builds.quiet(timing=False)
                    _note_paused_builds(opts.out / gpu / "logs" / f"{sub.run_id}.log", builds, paused_before)
                if sub.run_id in recorded:  # graded whole now
                    write_records(opts.out, gpu, without_graded(_interruptions(opts.out, gpu),
                                                                {sub.run_id: sub.solution_sha256()}))
                score = f" {row['speedup_vs_compile']:.2f}× vs compile" if row["speedup_vs_compile"] else ""
                progress.console.print(f"  {sub.run_id}: {row['status']}{score} — {row['message']}")
                if row["status"] == "pass" and row["grade_seconds"] is not None:
                    quickest[sub.problem] = with_pass(quickest.get(sub.problem), row["grade_seconds"], gpu)
                rows.append(row)
                progress.advance(task)
        finally:
            builds.stop()
    if rows:
        _console.print(summary_table(rows))
    return rows


def _note_paused_builds(log: Path, builds: BuildQueue, paused_before: float) -> None:
    """The grading's log says how long the builds beside it were paused while it was timed (none: no line)."""
    paused = builds.quiet_s - paused_before
    if paused > 0 and log.is_file():
        with contextlib.suppress(OSError), log.open("a") as fh:
            fh.write(f"[grader] the builds beside it were paused while it was timed: {paused:.1f} s\n")


def too_late(record: Interruption | None, stop_at: float | None, now: float | None = None,
             started: float | None = None) -> str | None:
    """Why a run held back is not started (None: it is), where the batch will be cut at `stop_at`: each of
    its earlier attempts ran longer, on average, than what is left, so this one would be cut again, its GPU
    time spent for nothing (deepseek-v4-pro 02 125550, a max-autotune torch.compile, ran 348 s into its first
    shape's checks before an H100 call's deadline). It waits for a call that starts with it: graded last, it
    goes first once nothing else is left, with the whole call before it. Where even the whole batch (from
    `started`, its start) is shorter than an attempt, no call of that length grades it, and the reason says
    what would: MiniMax-M3 02 064019's one attempt ran 520.7 s, and three H100 calls of 2026-12-07, each
    with 495 s after its setup, said it would be graded by a call that starts with it, as each of them did."""
    if record is None or stop_at is None:
        return None
    left = stop_at - (time.time() if now is None else now)
    each = record.seconds / max(record.times, 1)
    if left >= each:
        return None
    if started is not None and stop_at - started < each:
        return (f"{record.summary()}, {each:.0f} s an attempt, more than this whole batch had "
                f"({stop_at - started:.0f} s from its start to --stop-at): a batch given {math.ceil(each)} s or more "
                f"grades it (bench/gpu_session.sh: IDS naming it alone, and a DEADLINE that leaves that much after "
                f"the setup)")
    return (f"{record.summary()}, {each:.0f} s an attempt, and this batch ends in {max(left, 0):.0f} s "
            f"(--stop-at): a call that starts with it grades it")


class QuickestPass(NamedTuple):
    seconds: float  # its grade time, its compile included
    gpu: str  # the GPU folder it was graded in


def quickest_passes(out: Path, gpu: str) -> dict[str, QuickestPass]:
    """problem -> its quickest pass on this GPU in `out`, or, for a problem with none here yet, its quickest
    on another GPU there: a problem new to a GPU would otherwise be started with seconds left (on the H100
    SXM and the H200 each problem's quickest passes were within 1.6× of each other: 06's 75 s and 121 s)."""
    quickest = {problem: QuickestPass(seconds, gpu) for problem, seconds in _quickest_in(out, gpu).items()}
    for folder in sorted(p.name for p in out.glob("*") if p.is_dir() and p.name != gpu and not p.name.startswith(".")):
        for problem, seconds in _quickest_in(out, folder).items():
            known = quickest.get(problem)
            if known is None or (known.gpu != gpu and seconds < known.seconds):
                quickest[problem] = QuickestPass(seconds, folder)
    return quickest


def with_pass(known: QuickestPass | None, seconds: float, gpu: str) -> QuickestPass:
    """The quickest pass once this batch has graded a pass of `seconds` on `gpu`: it replaces another GPU's
    stand-in, or a slower pass here. An H100 call of 2026-12-07 still timed 01 by the H200's 27 s after four
    passes of 45–101 s there, so it would have started a run with 30 s left."""
    if known is None or known.gpu != gpu or seconds < known.seconds:
        return QuickestPass(seconds, gpu)
    return known


def _quickest_in(out: Path, gpu: str) -> dict[str, float]:
    """problem -> the least grade time (seconds, its compile included) of a pass of it in `out`'s `gpu` folder."""
    results, runs = table_path(out, gpu, "results"), table_path(out, gpu, "runs")
    if not (results.exists() and runs.exists()):
        return {}
    problem_of = {r["run_id"]: r["problem"] for r in read_table(runs, "runs").to_pylist()}
    quickest: dict[str, float] = {}
    for row in read_table(results, "results").to_pylist():
        problem, seconds = problem_of.get(row["run_id"]), row["grade_seconds"]
        if row["status"] == "pass" and problem is not None and seconds is not None:
            quickest[problem] = min(seconds, quickest.get(problem, seconds))
    return quickest


def no_time_for(problem: str, quickest: QuickestPass | None, stop_at: float | None, gpu: str,
                now: float | None = None) -> str | None:
    """Why a run is not started (None: it is), where the batch will be cut at `stop_at` before even the
    quickest pass of its problem (on this GPU, else on another) would have finished: only an early failure
    could end in time, and otherwise the GPU time would be spent for nothing (an H100 call of 2026-12-06
    started LongCat-2.0 06 082519 with 31 s left, where 06's passes there took 85 s and more, and cut it in
    its first shape's checks). The next call grades it; the batch goes on to runs of quicker problems."""
    if quickest is None or stop_at is None:
        return None
    left = stop_at - (time.time() if now is None else now)
    if left >= quickest.seconds:
        return None
    where = "here" if quickest.gpu == gpu else f"on {quickest.gpu} (none here yet)"
    return (f"the quickest pass of {problem} {where} took {quickest.seconds:.0f} s, and this batch ends in "
            f"{max(left, 0):.0f} s (--stop-at): a later call grades it")


@contextlib.contextmanager
def _recorded_if_cut_off(out: Path, gpu: str, sub: Submission, started: float, phases: list[str],
                         build: Prebuild | None) -> Iterator[None]:
    """A grading cut off (a GPU call's deadline, Ctrl-C) is recorded in the folder's interrupted runs,
    with the phase it reached and its seconds, its build's before the GPU took it (`started`) included,
    so that the next batch grades a long one last; the interrupt goes on."""
    try:
        yield
    except KeyboardInterrupt:
        built_s = 0.0 if build is None else max(0.0, build.active_s(started))
        write_records(out, gpu, add_interruption(_interruptions(out, gpu), sub.run_id, sub.solution_sha256(),
                                                 time.monotonic() - started + built_s, phases[-1],
                                                 _now().isoformat()))
        raise


class BuildQueue:
    """The runs still to grade, in queue order, and their prebuilds: which build now (`build_window`)
    and which the GPU grades next (`next_to_grade`). Taking a run starts the builds behind it, so
    that the next ones compile while it grades."""

    def __init__(self, queue: list[tuple[Submission, Problem | None]], gradeable: Container[str],
                 held: Container[str], depth: int, start: Callable[[Submission, Problem], Prebuild]) -> None:
        self.pending = list(queue)
        self.gradeable, self.held, self.depth, self._start = gradeable, held, depth, start
        self.prebuilds: dict[str, Prebuild] = {}
        self._by_id = {sub.run_id: (sub, problem) for sub, problem in queue}
        self.quiet_s = 0.0  # seconds the builds were paused while the GPU timed (`quiet`)
        self._quiet_since: float | None = None

    def start_builds(self) -> None:
        """Start the builds of the window that are not running yet (`depth` at most)."""
        built = {run_id for run_id, build in self.prebuilds.items() if build.proc.poll() is not None}
        for run_id in build_window(self._ids(), self.gradeable, self.held, self.depth, built):
            if run_id not in self.prebuilds:
                sub, problem = self._by_id[run_id]
                assert problem is not None  # gradeable runs have their problem
                self.prebuilds[run_id] = self._start(sub, problem)

    def take(self, build_timeout_s: float) -> tuple[Submission, Problem | None, str | None, Prebuild | None] | None:
        """The run the GPU grades next, with the run it goes ahead of (None when it was first) and its
        prebuild (None without one); None while every run that may go next is still building."""
        self.start_builds()
        at = next_to_grade(self._ids(), self.prebuilds, self.held, build_timeout_s,
                           needs_build=lambda run_id: self.depth > 0 and run_id in self.gradeable)
        if at is None:
            return None
        sub, problem = self.pending.pop(at)
        ahead_of = self.pending[0][0].run_id if at else None
        build = self.prebuilds.pop(sub.run_id, None)
        self.start_builds()  # the next one's, while this one grades
        return sub, problem, ahead_of, build

    def drop_late(self, why_late: Callable[[Submission], str | None]) -> list[tuple[Submission, str]]:
        """Take out of the queue every run `why_late` gives a reason not to start, ending its build: the batch
        neither waits for a build nor grades a run whose end it would cut. An H100 call of 2026-12-07 said
        "not started" of 17 runs one by one as their builds ended, and was still waiting for builds when its
        deadline's interrupt came ("Aborted!")."""
        dropped, kept = [], []
        for sub, problem in self.pending:
            why = why_late(sub)
            if why is None:
                kept.append((sub, problem))
                continue
            build = self.prebuilds.pop(sub.run_id, None)
            if build is not None:
                finish_prebuild(build, 0)
            dropped.append((sub, why))
        self.pending = kept
        return dropped

    def running(self) -> list[str]:
        return [run_id for run_id, build in self.prebuilds.items() if build.proc.poll() is None]

    def quiet(self, timing: bool) -> None:
        """Pause every running build while the GPU times a shape (`timing`), and let them go on after
        (`Prebuild.pause`): a shape the host's dispatch bounds is timed at the host's floor, which moved 2×
        between a busy host and a quieter one. `quiet_s` counts the seconds builds were held so."""
        now = time.monotonic()
        if timing and self._quiet_since is None and self.running():
            self._quiet_since = now
        for build in self.prebuilds.values():
            if timing:
                build.pause()
            else:
                build.resume()
        if not timing and self._quiet_since is not None:
            self.quiet_s += now - self._quiet_since
            self._quiet_since = None

    def stop(self) -> None:
        """End every build still running (a batch that stops early leaves no compiler behind)."""
        for build in self.prebuilds.values():
            finish_prebuild(build, 0)

    def _ids(self) -> list[str]:
        return [sub.run_id for sub, _ in self.pending]


def _interruptions(out: Path, gpu: str, console: Console | None = None) -> dict[str, Interruption]:
    """The folder's records of interrupted runs (`interrupted.py`); a file that cannot be read is said
    once on `console` and counts as none."""
    records, warning = read_records(out, gpu)
    if warning and console is not None:
        console.print(f"[yellow]{warning}[/]", markup=True, highlight=False, soft_wrap=True)
    return records


def build_window(pending: list[str], gradeable: Container[str], held: Container[str], depth: int,
                 built: Container[str] = frozenset()) -> list[str]:
    """The runs whose builds run now: `depth` of the gradeable ones in `pending` (queue order) whose builds
    have not ended (`built`: those wait for the GPU and take no core). One run held back (interrupted in
    earlier batches after a long build or grading) builds first where `depth` leaves another place, so that
    its compile runs beside the grading of the others instead of after it, and what it compiles carries to
    the next call when this one ends first (`eval keep-ahead`); never more, or the held runs' builds take
    the places of the runs this call will grade (on an H100's host two of three places went to held runs'
    builds of 280–430 s in each of three calls). Once built, a held run waits to be graded last without
    keeping the builds behind it from starting (two held runs' ended builds and a slow one had kept that
    GPU idle for about 290 s)."""
    todo = [run_id for run_id in pending if run_id in gradeable and run_id not in built]
    early = [run_id for run_id in todo if run_id in held][:min(1, max(depth - 1, 0))]
    return (early + [run_id for run_id in todo if run_id not in early])[:depth]


def next_to_grade(pending: list[str], prebuilds: dict[str, Prebuild], held: Container[str], build_timeout_s: float,
                  needs_build: Callable[[str], bool]) -> int | None:
    """Where in `pending` (queue order) the run the GPU grades next is: the first whose prebuild has
    ended (or outlived `build_timeout_s`, to be cut off) or that needs none; None while every run that
    may go next is still building. A run with a slow build (CUTLASS: minutes) so waits behind the
    ones whose builds ended, never the GPU behind it. Runs held back (interrupted in earlier batches)
    go only once they are first: they are the ones that may fill a call."""
    for at, run_id in enumerate(pending):
        if run_id in held:
            return 0 if at == 0 else None
        build = prebuilds.get(run_id)
        if build is not None:
            if build.proc.poll() is not None or build.active_s() > build_timeout_s:
                return at
        elif not needs_build(run_id):
            return at
    return None


def prebuild_depth(cpus: int | None) -> int:
    """How many submissions compile ahead of the one the GPU grades: PREBUILD_AHEAD, but no more than
    one per PREBUILD_CPUS_EACH cores (each build runs a few compilers; the timed process keeps a core)."""
    return max(1, min(PREBUILD_AHEAD, (cpus or 1) // PREBUILD_CPUS_EACH))


def _show_phase(progress: Progress, task: TaskID, run_id: str, seen: list[str], phase: str) -> None:
    seen.append(phase)
    progress.update(task, description=f"{run_id} · {phase}")


def summary_table(rows: list[dict[str, Any]]) -> Table:
    """One line per graded run: status, speedups, roofline fraction and grading time."""
    table = Table(title="graded", title_justify="left")
    for name, justify in (("run", "left"), ("status", "left"), ("× compile", "right"), ("× eager", "right"),
                          ("% of peak", "right"), ("seconds", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        def fmt(value: float | None, pattern: str) -> str:
            return "—" if value is None else pattern.format(value)

        table.add_row(r["run_id"], r["status"], fmt(r["speedup_vs_compile"], "{:.2f}×"),
                      fmt(r["speedup_vs_eager"], "{:.2f}×"), fmt(r["peak_fraction"], "{:.1%}"),
                      fmt(r["grade_seconds"], "{:.1f}"))
    return table


def run_calibrate(out: Path, timeout_s: float = 600.0) -> dict[str, Any]:
    """Measure the GPU's achievable peaks and store them beside the datasheet ones."""
    import sys

    proc = subprocess.run([sys.executable, "-m", "kernelboard.eval.calibrate"], capture_output=True, text=True,
                          timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    measured = json.loads(lines[-1]) if lines else {"error": proc.stderr.strip()[-300:]}
    if proc.returncode != 0 or "error" in measured:
        raise UsageError(f"calibration failed: {measured.get('error') or proc.stderr.strip()[-300:]}")
    env = measured.pop("env")
    gpu = gpu_key(env["device_name"])
    row = {**_hardware_row(out, gpu, GPUS.get(gpu), env), **measured, "measured_at": _now()}
    upsert(table_path(out, gpu, "hardware"), "hardware", [row])
    return row

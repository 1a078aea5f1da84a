"""`kernelboard eval`: find submissions, measure baselines once, grade each in its own worker.

The parent never imports torch or candidate code. Each worker is a fresh `python -m
kernelboard.eval.worker` in its own process group, working directory (a scratch copy of the
submission) and torch-extension / Triton caches keyed by the solution's hash; on timeout the
whole group is killed. Results are written after every submission, atomically, so an
interrupted batch keeps everything graded before the interruption.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import fnmatch
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kernelboard import __version__
from kernelboard.errors import UsageError

from .deck import Problem, load_deck
from .hardware import GPUS, GpuSpec, gpu_key
from .schema import DNF_OUTCOMES
from .scoring import best_compile, result_row, shape_rows
from .submission import Submission, discover
from .tables import read_table, table_path, upsert

GRADER_VERSION = __version__
BASELINE_VARIANTS = ("eager", "compile:default")
_console = Console(stderr=True)


@dataclass(frozen=True)
class EvalOptions:
    deck: Path
    submissions: Path
    out: Path
    device: str = "cuda"
    only: tuple[str, ...] = ()
    resume: bool = False
    timeout_s: float = 900.0
    baseline_timeout_s: float = 1800.0
    rep_ms: float | None = None  # timing budget per shape; None = the timer's default


@dataclass(frozen=True)
class WorkerOutcome:
    result: dict[str, Any]
    seconds: float
    log_path: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


# ------------------------------------------------------------------------------ workers


def _worker_env(cache_key: str) -> dict[str, str]:
    cache = Path(os.environ.get("KERNELBOARD_CACHE", Path.home() / ".cache" / "kernelboard")) / cache_key
    env = dict(os.environ)
    env.update(
        TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"),
        TRITON_CACHE_DIR=str(cache / "triton"),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_worker(job: dict[str, Any], workdir: Path, log_path: Path, timeout_s: float,
               cache_key: str) -> WorkerOutcome:
    """Run one worker job; a crash, a hang or a missing result becomes a status, never a raise."""
    result_path = workdir / ".kernelboard-result.json"
    job = {**job, "result_path": str(result_path)}
    job_path = workdir.parent / f"{workdir.name}.job.json"
    job_path.write_text(json.dumps(job, sort_keys=True))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kernelboard.eval.worker", str(job_path)],
            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=_worker_env(cache_key), start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            seconds = time.perf_counter() - start
            return WorkerOutcome({"status": "timeout", "message": f"killed after {timeout_s:.0f} s"},
                                 seconds, log_path)
        finally:
            _kill_group(proc)  # children it left behind (compilers, forked helpers) go too
    seconds = time.perf_counter() - start
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        return WorkerOutcome({"status": "runtime_error", "message": f"the worker died from {name}"},
                             seconds, log_path)
    try:
        result = json.loads(result_path.read_text())
    except (OSError, json.JSONDecodeError):
        msg = f"the worker exited with code {rc} without writing a result (a hard exit in candidate code?)"
        return WorkerOutcome({"status": "runtime_error", "message": msg}, seconds, log_path)
    return WorkerOutcome(result, seconds, log_path)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def gpu_lock(gpu: str) -> Iterator[None]:
    """One grader per device at a time: two `kernelboard eval` processes queue, never overlap."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    path = Path(tempfile.gettempdir()) / f"kernelboard-{gpu}-{visible}.lock"
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _console.print(f"[yellow]waiting for another kernelboard eval on {gpu} ({path})[/]")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def probe_device(device: str) -> dict[str, Any]:
    """Device identity from a short-lived process, so the parent stays free of torch."""
    code = ("import json,sys;from kernelboard.eval.worker import probe_environment as p;"
            "import torch;d=sys.argv[1];"
            "print(json.dumps(p(d) if d=='cpu' or torch.cuda.is_available() else {'error':'no CUDA device'}))")
    out = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise UsageError(f"cannot start a worker (is the 'eval' extra, i.e. torch, installed?): "
                         f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    env = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in env:
        raise UsageError(f"--device {device}: {env['error']}; use --device cpu to grade on the CPU")
    return env


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


# ------------------------------------------------------------------------------ baselines


def _cached_baselines(out: Path, gpu: str, problem: Problem, env: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Baseline rows of this problem measured with this device and software; {} if none."""
    path = table_path(out, gpu, "baselines")
    if not path.exists():
        return {}
    found: dict[int, dict[str, Any]] = {}
    for row in read_table(path, "baselines").to_pylist():
        same = (row["problem"] == problem.name and row["bench"] == problem.bench
                and row["device_name"] == env["device_name"] and row["torch_version"] == env["torch_version"]
                and row["triton_version"] == env.get("triton_version")
                and row["grader_version"] == GRADER_VERSION)
        if same:
            found.setdefault(row["shape_idx"], {})[row["variant"]] = row
    return found


def ensure_baselines(opts: EvalOptions, gpu: str, problem: Problem, env: dict[str, Any],
                     scratch: Path) -> dict[int, dict[str, Any]]:
    """Eager and torch.compile times for every shape, measured once per device and software."""
    shapes = problem.shapes_for(opts.device)
    cached = _cached_baselines(opts.out, gpu, problem, env)
    if all(v in cached.get(s.idx, {}) for s in shapes for v in BASELINE_VARIANTS):
        return cached
    _console.print(f"measuring baselines for {problem.name} on {env['device_name']} …")
    workdir = scratch / f"baselines-{problem.name}"
    workdir.mkdir()
    job = {"kind": "baseline", "problem_dir": str(problem.folder.resolve()), "device": opts.device,
           "base_seed": 2026, "variants": list(BASELINE_VARIANTS), "rep_ms": opts.rep_ms}
    log = opts.out / gpu / "logs" / f"baselines-{problem.bench}-{problem.name}.log"
    outcome = run_worker(job, workdir, log, opts.baseline_timeout_s, f"baselines-{problem.name}")
    if outcome.result.get("status") != "ok":
        _console.print(f"[red]baselines for {problem.name} failed: {outcome.result.get('message')}[/]")
        return cached
    shape_by_idx = {s.idx: s for s in shapes}
    rows = []
    for b in outcome.result["baselines"]:
        shape = shape_by_idx[b["shape_idx"]]
        stats = {k: b.get(k) for k in ("median_ms", "p10_ms", "p90_ms", "min_ms", "iterations")}
        rows.append({"bench": problem.bench, "problem": problem.name, "gpu": gpu, "shape_idx": shape.idx,
                     "shape_label": shape.label, "shape_json": shape.params_json, "variant": b["variant"],
                     "status": b["status"], "message": b["message"], **stats, "timer": _timer(opts.device),
                     "device_name": env["device_name"], "torch_version": env["torch_version"],
                     "triton_version": env.get("triton_version"), "cuda_version": env.get("cuda_version"),
                     "grader_version": GRADER_VERSION, "measured_at": _now()})
    upsert(table_path(opts.out, gpu, "baselines"), "baselines", rows)
    return _cached_baselines(opts.out, gpu, problem, env)


def _timer(device: str) -> str:
    return "cuda_event" if device == "cuda" else "cpu_wall"


# ------------------------------------------------------------------------------ grading


def _already_graded(opts: EvalOptions, gpu: str, sub: Submission) -> bool:
    results, runs = table_path(opts.out, gpu, "results"), table_path(opts.out, gpu, "runs")
    if not (results.exists() and runs.exists()):
        return False
    sha = {r["run_id"]: r["solution_sha256"] for r in read_table(runs, "runs").to_pylist()}
    for row in read_table(results, "results").to_pylist():
        if row["run_id"] == sub.run_id and row["grader_version"] == GRADER_VERSION:
            return sha.get(sub.run_id) == sub.solution_sha256()
    return False


def grade_submission(opts: EvalOptions, gpu: str, spec: GpuSpec | None, problem: Problem | None,
                     sub: Submission, env: dict[str, Any], baselines: dict[int, dict[str, Any]],
                     scratch: Path, driver: str | None) -> dict[str, Any]:
    """Grade (or classify without grading) one submission and write its rows; returns its result row."""
    common = {"run_id": sub.run_id, "gpu": gpu, "env": env, "timer": _timer(opts.device),
              "grader_version": GRADER_VERSION, "driver_version": driver, "graded_at": _now()}
    outcome = sub.meta["agent_outcome"]
    if outcome in DNF_OUTCOMES:
        note = sub.meta.get("outcome_note") or outcome.replace("_", " ")
        row = result_row(status="dnf", message=f"did not finish: {note}", shapes=[], seeds=None,
                         grade_seconds=None, log_path=None, **common)
    elif problem is None:
        row = result_row(status="not_graded", message=f"problem {sub.problem!r} is not in the deck",
                         shapes=[], seeds=None, grade_seconds=None, log_path=None, **common)
    elif not problem.shapes_for(opts.device):
        row = result_row(status="not_graded", message=f"{problem.name} has no shapes for --device {opts.device}",
                         shapes=[], seeds=None, grade_seconds=None, log_path=None, **common)
    elif not sub.has_solution:
        row = result_row(status="not_graded", message=f"no solution.py (agent outcome: {outcome})",
                         shapes=[], seeds=None, grade_seconds=None, log_path=None, **common)
    else:
        workdir = scratch / sub.run_id
        shutil.copytree(sub.folder, workdir, ignore=shutil.ignore_patterns("run.yaml", "__pycache__"))
        job = {"kind": "grade", "problem_dir": str(problem.folder.resolve()), "device": opts.device,
               "solution_dir": str(workdir), "base_seed": secrets.randbits(31), "rep_ms": opts.rep_ms}
        log = opts.out / gpu / "logs" / f"{sub.run_id}.log"
        res = run_worker(job, workdir, log, opts.timeout_s, sub.solution_sha256() or sub.run_id)
        result = res.result
        shapes = shape_rows(problem, spec, sub.run_id, gpu, result.get("shapes", []), baselines) \
            if result.get("status") == "pass" else []
        row = result_row(status=result.get("status", "runtime_error"), message=result.get("message", "?"),
                         shapes=shapes, seeds=result.get("seeds"), grade_seconds=round(res.seconds, 2),
                         log_path=str(log.relative_to(opts.out)), **{**common, "env": result.get("env") or env})
        if row["status"] == "pass":
            variants = {v for idx in baselines if (b := best_compile(baselines[idx])) for v in [b[0]]}
            row["compile_variant"] = ",".join(sorted(variants))
        upsert(table_path(opts.out, gpu, "shapes"), "shapes", shapes,
               replace_matching={"run_id": sub.run_id, "gpu": gpu})
    upsert(table_path(opts.out, gpu, "runs"), "runs", [sub.run_row(problem.bench if problem else "unknown")])
    upsert(table_path(opts.out, gpu, "results"), "results", [row])
    return row


def _hardware_row(gpu: str, spec: GpuSpec | None, env: dict[str, Any]) -> dict[str, Any]:
    if spec is not None:
        return {**spec.hardware_row(), "measured_copy_gb_s": None, "measured_bf16_tflop_s": None,
                "measured_fp8_tflop_s": None, "measured_at": None}
    return {"gpu": gpu, "name": env["device_name"], "sm": None, "memory_gb": None, "l2_mb": None,
            "bandwidth_gb_s": None, "peak_tflop_s_fp8": None, "peak_tflop_s_bf16": None,
            "peak_tflop_s_fp16": None, "peak_tflop_s_tf32": None, "peak_tflop_s_fp32": None,
            "source": "no datasheet peaks for this device: timings only, no roofline fractions",
            "measured_copy_gb_s": None, "measured_bf16_tflop_s": None, "measured_fp8_tflop_s": None,
            "measured_at": None}


def run_eval(opts: EvalOptions) -> list[dict[str, Any]]:
    """Grade every selected submission; returns the result rows written."""
    deck = load_deck(opts.deck)
    subs = [s for s in discover(opts.submissions)
            if not opts.only or any(fnmatch.fnmatch(s.run_id, g) for g in opts.only)]
    if not subs:
        raise UsageError(f"no submissions under {opts.submissions} match {list(opts.only) or 'anything'}")
    env = probe_device(opts.device)
    gpu = "cpu" if opts.device == "cpu" else gpu_key(env["device_name"])
    spec = GPUS.get(gpu)
    driver = _driver_version() if opts.device == "cuda" else None
    _console.print(f"grading {len(subs)} submissions on {env['device_name']} → {opts.out / gpu}")
    upsert(table_path(opts.out, gpu, "hardware"), "hardware", [_hardware_row(gpu, spec, env)])
    rows = []
    with gpu_lock(gpu), tempfile.TemporaryDirectory(prefix="kernelboard-") as tmp, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=_console,
    ) as progress:
        scratch = Path(tmp)
        task = progress.add_task("grading", total=len(subs))
        baselines: dict[str, dict[int, dict[str, Any]]] = {}
        for sub in subs:
            progress.update(task, description=f"grading {sub.run_id}")
            if opts.resume and _already_graded(opts, gpu, sub):
                progress.console.print(f"  {sub.run_id}: already graded, skipped (--resume)")
                progress.advance(task)
                continue
            problem = deck.get(sub.problem)
            needs_grading = problem is not None and sub.has_solution and \
                sub.meta["agent_outcome"] not in DNF_OUTCOMES and bool(problem.shapes_for(opts.device))
            if needs_grading and problem.name not in baselines:
                baselines[problem.name] = ensure_baselines(opts, gpu, problem, env, scratch)
            row = grade_submission(opts, gpu, spec, problem, sub, env,
                                   baselines.get(sub.problem, {}), scratch, driver)
            score = f" {row['speedup_vs_compile']:.2f}× vs compile" if row["speedup_vs_compile"] else ""
            progress.console.print(f"  {sub.run_id}: {row['status']}{score} — {row['message']}")
            rows.append(row)
            progress.advance(task)
    return rows

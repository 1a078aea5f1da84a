"""Grading on several GPUs of one host: one `kernelboard eval` process per GPU, merged at the end.

Work is spread by problem, never splitting one: a problem's baselines are measured once, on the
GPU that grades its runs. Each child sees one device (`CUDA_VISIBLE_DEVICES`) and writes to its
own folder beside `--out` (`.<out>.gpu<N>`), seeded with a copy of `--out` so `--resume` and
cached baselines work as in one process. At the end every child folder is merged into `--out`
(`eval/merge.py`: the later measurement wins) and removed. A folder left by an interrupted run is
merged first, so nothing a child finished is lost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console

from kernelboard.errors import KernelboardError, UsageError

from .merge import has_tables, merge_results
from .schedule import EvalOptions, select_submissions

_console = Console(stderr=True, soft_wrap=True)  # lines a program may read never break mid-word


def spread(runs_per_problem: Counter[str], n: int) -> list[list[str]]:
    """Problems onto `n` devices, largest first onto the least loaded (by run count)."""
    bins: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for problem, count in sorted(runs_per_problem.items(), key=lambda kv: (-kv[1], kv[0])):
        i = min(range(n), key=lambda j: (load[j], j))
        bins[i].append(problem)
        load[i] += count
    return bins


def child_folder(out: Path, device: str) -> Path:
    return out.parent / f".{out.name}.gpu{device}"


def _child_args(opts: EvalOptions, out: Path, run_ids: list[str]) -> list[str]:
    args = [sys.executable, "-m", "kernelboard.cli", "eval", "--deck", str(opts.deck), "--submissions",
            str(opts.submissions), "--out", str(out), "--device", opts.device,
            "--timeout", str(opts.timeout_s), "--build-timeout", str(opts.build_timeout_s),
            "--check-timeout", str(opts.check_timeout_s), "--timing-timeout", str(opts.timing_timeout_s),
            "--baseline-timeout", str(opts.baseline_timeout_s)]
    args += ["--resume"] if opts.resume else []
    args += ["--unsandboxed"] if opts.unsandboxed else []
    args += ["--regrade"] if opts.regrade else []
    args += [] if opts.prebuild is None else ["--prebuild" if opts.prebuild else "--no-prebuild"]
    for variant in opts.skip_baselines:
        args += ["--skip-baseline", variant]
    for run_id in run_ids:
        args += ["--only", run_id]
    return args


def _recover(opts: EvalOptions) -> None:
    """Merge what an interrupted parallel run (on any devices) left beside --out, then start clean."""
    for left in sorted(opts.out.parent.glob(f".{opts.out.name}.gpu*")):
        if left.is_dir():
            if has_tables(left):
                merge_results(left, opts.out)
                _console.print(f"merged {left}, left by an interrupted run, into {opts.out}")
            shutil.rmtree(left)


def run_parallel(opts: EvalOptions, devices: list[str]) -> None:
    """Grade the selected submissions on `devices`, one child process each; merge into --out."""
    if len(set(devices)) != len(devices) or not all(devices):
        raise UsageError(f"--gpus: expected distinct device indices like 0,1, got {','.join(devices)!r}")
    _recover(opts)
    subs = select_submissions(opts)
    runs = Counter(s.problem for s in subs)
    plan = [(d, ps) for d, ps in zip(devices, spread(runs, len(devices)), strict=True) if ps]
    children = []
    for device, problems in plan:
        out = child_folder(opts.out, device)
        if opts.out.is_dir():
            shutil.copytree(opts.out, out)
        out.mkdir(parents=True, exist_ok=True)
        run_ids = [s.run_id for s in subs if s.problem in problems]
        log = (out / "eval.log").open("w")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": device}
        proc = subprocess.Popen(_child_args(opts, out, run_ids), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        children.append((device, problems, out, proc, log))
        runs_of = f"{len(run_ids)} run{'' if len(run_ids) == 1 else 's'} of {', '.join(problems)}"
        _console.print(f"GPU {device}: {runs_of} → {out / 'eval.log'}")
    failed = []
    with _console.status(f"grading on {len(children)} GPUs …"):
        while any(proc.poll() is None for *_, proc, _ in children):
            time.sleep(1.0)
    for device, problems, out, proc, log in children:
        log.close()
        if has_tables(out):  # what a failed child finished counts too
            r = merge_results(out, opts.out)["results"]
            _console.print(f"GPU {device}: merged into {opts.out}: {r['added']} added, {r['replaced']} regraded")
        if proc.returncode == 0:
            shutil.rmtree(out)
        else:
            tail = (out / "eval.log").read_text(errors="replace").strip().splitlines()[-1:]
            failed.append(f"GPU {device} ({', '.join(problems)}) exited {proc.returncode}: {' '.join(tail)} "
                          f"(log: {out / 'eval.log'})")
    if failed:
        raise KernelboardError("; ".join(failed))

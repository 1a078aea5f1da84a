"""Grading on several GPUs of one host: `kernelboard eval` child processes, one per GPU, merged into --out.

Each child sees one device (`CUDA_VISIBLE_DEVICES`) and writes to its own folder beside `--out`,
seeded with a copy of `--out` so `--resume` and cached baselines work as in one process; when the
children of a phase have ended, each folder is merged into `--out` (`eval/merge.py`: the later
measurement wins) and removed.
What a failed child finished is merged too, and its folder kept for its log (`eval.log`). Interrupted
(SIGINT: a GPU call's deadline, Ctrl-C), the parent interrupts each child once (children run in
sessions of their own, so a terminal's Ctrl-C reaches them only so), waits for them to record the run
each was cut off in (`interrupted.py`), and merges their folders before it stops: a GPU session packs
--out, not the children's folders. A folder left by a run killed outright is merged by the next one.
Two phases:

1. Baselines, once per GPU model. The parent probes every device (a short torch process each, as
   `kernelboard eval` does) and, per model, lists the problems of the runs to grade whose baselines
   are not cached for it (all of them with `--regrade`). These are spread by problem over that
   model's GPUs (a problem's baselines on one GPU; weighed by shape count), measured by children run
   with `--baselines-only` (`.<out>.gpu<N>.baselines`), and merged into `--out`.
2. Grading. The runs themselves are spread over all the GPUs (`.<out>.gpu<N>`), so the runs of one
   problem are graded on several GPUs at once; every child is seeded with `--out`, now holding the
   baselines, and reuses them (same device model, same software) instead of measuring them again.
   Runs are balanced by an estimated cost (`problem_costs`): the median `grade_seconds` of the
   problem's earlier gradings in `--out`; a problem never graded costs the median of the others
   (1 each when nothing was graded yet). Each run, costliest first, goes to the least loaded GPU.
   A problem whose baselines are still incomplete after phase 1 (its child failed, or its baseline
   worker did) is graded whole on one GPU, which measures what is missing: at most once more, as a
   console line says. With `--regrade` the children of phase 2 grade every selected run (no
   `--resume`) without `--regrade`, so the baselines phase 1 measured afresh are reused, not measured
   again on every GPU (where phase 1 failed, the rows cached before are kept and used).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from kernelboard.errors import KernelboardError, UsageError

from .deck import Problem, load_deck
from .hardware import gpu_key
from .merge import has_tables, merge_results
from .schedule import EvalOptions, _cached_baselines, _gradeable, _graded_solutions, baselines_todo, select_submissions
from .schema import CPU_KEY
from .submission import Submission
from .tables import read_table

_console = Console(stderr=True, soft_wrap=True)  # lines a program may read never break mid-word

_PROBE = ("import json,sys,torch;from kernelboard.eval.probe import probe_environment as p;d=sys.argv[1];"
          "print(json.dumps(p(d) if d=='cpu' or torch.cuda.is_available() else {'error':'no CUDA device'}))")

# A child: (device, what it does, its folder, its process, its open log).
Child = tuple[str, str, Path, "subprocess.Popen[bytes]", Any]


def spread(weights: Mapping[str, float], n: int) -> list[list[str]]:
    """Problems onto `n` devices, heaviest first onto the least loaded (by weight)."""
    bins: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for problem, weight in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])):
        i = min(range(n), key=lambda j: (load[j], j))
        bins[i].append(problem)
        load[i] += weight
    return bins


def spread_runs(runs: list[tuple[str, str, float]], n: int, whole: frozenset[str] = frozenset()) -> list[list[str]]:
    """Runs `(run_id, problem, cost)` onto `n` devices: each problem in `whole` all onto one device
    (costliest problem first), then every other run, costliest first, onto the least loaded device
    (by cost, then by run count), so the runs of one problem are spread over the devices."""
    bins: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n

    def least() -> int:
        return min(range(n), key=lambda j: (load[j], len(bins[j]), j))

    kept = [r for r in runs if r[1] in whole]
    totals: dict[str, float] = {}
    for _, problem, cost in kept:
        totals[problem] = totals.get(problem, 0.0) + cost
    for problem in sorted(totals, key=lambda p: (-totals[p], p)):
        i = least()
        bins[i] += [run_id for run_id, p, _ in kept if p == problem]
        load[i] += totals[problem]
    for run_id, _, cost in sorted((r for r in runs if r[1] not in whole), key=lambda r: (-r[2], r[1], r[0])):
        i = least()
        bins[i].append(run_id)
        load[i] += cost
    return bins


def problem_costs(out: Path, problems: set[str], gpus: set[str]) -> dict[str, float]:
    """Estimated seconds to grade one run of each problem: the median `grade_seconds` of its earlier
    gradings in `out` (those on these GPU models when there are any); a problem never graded gets
    the median of the others, and every problem 1 when nothing was graded yet."""
    rows = []
    for path in sorted(out.glob("*/results.parquet")):
        runs = path.with_name("runs.parquet")
        problem = {r["run_id"]: r["problem"] for r in read_table(runs, "runs").to_pylist()} if runs.exists() else {}
        rows += [{**r, "problem": problem[r["run_id"]]} for r in read_table(path, "results").to_pylist()
                 if problem.get(r["run_id"]) in problems and r["grade_seconds"] is not None]
    if any(r["gpu"] in gpus for r in rows):
        rows = [r for r in rows if r["gpu"] in gpus]
    seconds: dict[str, list[float]] = {}
    for r in rows:
        seconds.setdefault(r["problem"], []).append(r["grade_seconds"])
    known = {p: max(statistics.median(s), 0.1) for p, s in seconds.items()}
    default = statistics.median(known.values()) if known else 1.0
    return {p: known.get(p, default) for p in problems}


def child_folder(out: Path, device: str, phase: str = "") -> Path:
    """The folder a child on `device` writes to: `.<out>.gpu<N>`, `.<out>.gpu<N>.baselines` in phase 1."""
    return out.parent / f".{out.name}.gpu{device}{'.' + phase if phase else ''}"


def _child_args(opts: EvalOptions, out: Path, run_ids: list[str]) -> list[str]:
    args = [sys.executable, "-m", "kernelboard.cli", "eval", "--deck", str(opts.deck), "--submissions",
            str(opts.submissions), "--out", str(out), "--device", opts.device,
            "--timeout", str(opts.timeout_s), "--build-timeout", str(opts.build_timeout_s),
            "--check-timeout", str(opts.check_timeout_s), "--timing-timeout", str(opts.timing_timeout_s),
            "--baseline-timeout", str(opts.baseline_timeout_s)]
    args += ["--baselines-only"] if opts.baselines_only else []
    args += ["--resume"] if opts.resume else []
    args += ["--unsandboxed"] if opts.unsandboxed else []
    args += ["--regrade"] if opts.regrade else []
    args += [] if opts.prebuild is None else ["--prebuild" if opts.prebuild else "--no-prebuild"]
    args += [] if opts.build_ahead is None else ["--build-ahead", str(opts.build_ahead)]
    args += [] if opts.stop_at is None else ["--stop-at", repr(opts.stop_at)]
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


def _probe(opts: EvalOptions, devices: list[str]) -> dict[str, dict[str, Any]]:
    """Each device's identity (as the child on it will see it), probed at once in short processes."""
    procs = {d: subprocess.Popen([sys.executable, "-c", _PROBE, opts.device], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                 env={**os.environ, "CUDA_VISIBLE_DEVICES": d}) for d in devices}
    envs = {}
    for device, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            last = err.strip().splitlines()[-1] if err.strip() else f"exited {proc.returncode}"
            raise UsageError(f"GPU {device}: cannot start a worker (is the 'eval' extra, i.e. torch, installed?): "
                             f"{last}")
        env = json.loads(lines[-1])
        if "error" in env:
            raise UsageError(f"--gpus: GPU {device}: {env['error']}")
        envs[device] = env
    return envs


def _lacks_baselines(opts: EvalOptions, gpu: str, problem: Problem, env: dict[str, Any]) -> bool:
    """Would `schedule.ensure_baselines` measure anything of this problem (same variants, same cache)?"""
    return any(baselines_todo(opts, problem, _cached_baselines(opts.out, gpu, problem, env)).values())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _start(opts: EvalOptions, device: str, out: Path, run_ids: list[str], what: str) -> Child:
    if opts.out.is_dir():
        shutil.copytree(opts.out, out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "eval.log").open("w")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": device}
    proc = subprocess.Popen(_child_args(opts, out, run_ids), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)  # an interrupt reaches it once, from us (`_interrupt`)
    return device, what, out, proc, log


def _finish(opts: EvalOptions, children: list[Child], waiting: str) -> list[str]:
    """Wait for the children, merge what each finished into --out; one line per failed child. Interrupted
    (a GPU call's deadline, Ctrl-C), it interrupts them, merges what they finished and their records of
    the runs they were cut off in (`interrupted.py`), then raises: nothing graded is left behind."""
    try:
        with _console.status(waiting):
            while any(proc.poll() is None for *_, proc, _ in children):
                time.sleep(1.0)
    except KeyboardInterrupt:
        _interrupt(children)
        _merge_children(opts, children)
        raise
    return _merge_children(opts, children)


def _interrupt(children: list[Child], grace_s: float = 60.0) -> None:
    """SIGINT each running child (it records the run it grades and stops it), then wait for them up to
    `grace_s` in all; one still running after that is killed."""
    running = [proc for *_, proc, _ in children if proc.poll() is None]
    _console.print(f"interrupted: stopping {_plural(len(running), 'grader')} and merging what they finished …")
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _merge_children(opts: EvalOptions, children: list[Child]) -> list[str]:
    failed = []
    for device, what, out, proc, log in children:
        log.close()
        if has_tables(out):  # what a failed child finished counts too
            report = merge_results(out, opts.out)
            r, b = report["results"], report["baselines"]
            _console.print(f"GPU {device}: merged into {opts.out}: {r['added']} added, {r['replaced']} regraded, "
                           f"{b['added'] + b['replaced']} baseline rows")
        if proc.returncode == 0:
            shutil.rmtree(out)
        else:
            tail = (out / "eval.log").read_text(errors="replace").strip().splitlines()[-1:]
            failed.append(f"GPU {device} ({what}) exited {proc.returncode}: {' '.join(tail)} "
                          f"(log: {out / 'eval.log'})")
            _console.print(failed[-1], style="red", markup=False, highlight=False)
    return failed


def _measure_baselines(opts: EvalOptions, models: dict[tuple[str, str], list[str]], key: dict[str, str],
                       envs: dict[str, dict[str, Any]], deck: dict[str, Problem],
                       todo: dict[tuple[str, str], list[Submission]]) -> list[str]:
    """Phase 1: per GPU model (`models`: its devices), the baselines it lacks for the problems of its
    runs to grade (`todo`), spread by problem over its GPUs; merged into --out. Returns the failed
    children's lines."""
    children, measured = [], 0
    for model, devices in models.items():
        gpu, env = key[devices[0]], envs[devices[0]]
        problems = dict.fromkeys(s.problem for s in todo[model])
        lacking = [p for p in problems if opts.regrade or _lacks_baselines(opts, gpu, deck[p], env)]
        if problems and not lacking:
            _console.print(f"baselines of {_plural(len(problems), 'problem')} cached for {env['device_name']}: "
                           f"measuring none")
        weights = {p: float(len(deck[p].shapes_for(opts.device))) for p in lacking}
        for device, ps in zip(devices, spread(weights, len(devices)), strict=True):
            if ps:
                run_ids = [s.run_id for s in todo[model] if s.problem in ps]
                out = child_folder(opts.out, device, "baselines")
                child = _start(replace(opts, baselines_only=True, resume=False), device, out, run_ids,
                               f"baselines of {', '.join(ps)}")
                children.append(child)
                measured += len(ps)
                _console.print(f"measuring baselines for {', '.join(ps)} on GPU {device} ({env['device_name']}) "
                               f"→ {out / 'eval.log'}")
    if not children:
        return []
    return _finish(opts, children, f"measuring the baselines of {_plural(measured, 'problem')} on "
                                   f"{_plural(len(children), 'GPU')} …")


def run_parallel(opts: EvalOptions, devices: list[str]) -> None:
    """Grade the selected submissions on `devices`, one child process each; merge into --out."""
    if len(set(devices)) != len(devices) or not all(devices):
        raise UsageError(f"--gpus: expected distinct device indices like 0,1, got {','.join(devices)!r}")
    _recover(opts)
    deck = load_deck(opts.deck)
    subs = select_submissions(opts, set(deck))
    envs = _probe(opts, devices)
    # A GPU model: (table key, device name), both of which cached baselines must match.
    key = {d: CPU_KEY if opts.device == "cpu" else gpu_key(envs[d]["device_name"]) for d in devices}
    models: dict[tuple[str, str], list[str]] = {}
    for d in devices:
        models.setdefault((key[d], envs[d]["device_name"]), []).append(d)
    skip = opts.resume and not opts.regrade and not opts.baselines_only
    graded = {key[d]: _graded_solutions(opts, key[d]) if skip else {} for d in devices}
    todo = {m: [s for s in subs if _gradeable(opts, deck[s.problem], s) and not (
                s.run_id in graded[key[ds[0]]] and graded[key[ds[0]]][s.run_id] == s.solution_sha256())]
            for m, ds in models.items()}
    failed = _measure_baselines(opts, models, key, envs, deck, todo)
    lacking = sorted({s.problem for m, ds in models.items() for s in todo[m]
                      if _lacks_baselines(opts, key[ds[0]], deck[s.problem], envs[ds[0]])})
    if opts.baselines_only:
        if lacking:
            failed.append(f"baselines still incomplete for {', '.join(lacking)}")
        if failed:
            raise KernelboardError("; ".join(failed))
        return
    for problem in lacking:
        _console.print(f"[yellow]baselines of {problem} are incomplete after measuring them: its runs are graded "
                       f"on one GPU, which measures them again[/]")
    to_grade = {s.run_id for ss in todo.values() for s in ss}
    costs = problem_costs(opts.out, {s.problem for s in subs}, set(key.values()))
    runs = [(s.run_id, s.problem, costs[s.problem] if s.run_id in to_grade else 0.0) for s in subs]
    grading = replace(opts, regrade=False, resume=opts.resume and not opts.regrade)  # baselines reused
    problem_of = {s.run_id: s.problem for s in subs}
    queued = {s.run_id: i for i, s in enumerate(subs)}  # the selection's order: a queue from `eval todo`
    children = []
    for device, spread_ids in zip(devices, spread_runs(runs, len(devices), frozenset(lacking)), strict=True):
        run_ids = sorted(spread_ids, key=queued.__getitem__)  # each device grades its share in queue order
        if run_ids:
            out = child_folder(opts.out, device)
            per = Counter(problem_of[r] for r in run_ids)
            what = ", ".join(f"{n} of {p}" for p, n in sorted(per.items(), key=lambda kv: (-kv[1], kv[0])))
            children.append(_start(grading, device, out, run_ids, f"{_plural(len(run_ids), 'run')}: {what}"))
            _console.print(f"GPU {device}: {_plural(len(run_ids), 'run')} ({what}) → {out / 'eval.log'}")
    failed += _finish(opts, children, f"grading {_plural(len(subs), 'run')} on {_plural(len(children), 'GPU')} …")
    if failed:
        raise KernelboardError("; ".join(failed))

"""Grading on a Ray cluster: `kernelboard eval --ray [ADDRESS]`, each submission a Ray task on one GPU.

Ray (the `ray` extra) places the work; grading itself is unchanged. A task runs the same
`kernelboard eval` child a `--gpus` run starts (the trusted judge and the sandboxed runner, every
check and audit), on one GPU of one model, in a fresh folder of its node seeded with that model's
cached baselines; it returns the folder's tables and logs, and the driver merges them into `--out`
(`eval/merge.py`: the later measurement wins) as each arrives. So a killed driver loses only what
had not arrived, and `--resume` skips what had.

**Which GPUs.** A node advertises each GPU model it holds as a custom resource `gpu_<key>` (the
hardware table's key: `gpu_h200`, `gpu_b200`, …; `gpu_cpu` for `--device cpu`), beside Ray's own
GPU count: `ray start --address HEAD --num-gpus 2 --resources '{"gpu_h200": 2}'`. A task asks for
one of each (`num_gpus=1`, so Ray sets its CUDA_VISIBLE_DEVICES, and `gpu_<key>: 1`). Every selected
run is graded once per GPU model the cluster advertises (a board per GPU). Without an address a local
Ray instance is started with this host's GPUs advertised so.

**Two phases, as `--gpus`.** First the baselines: one task per (GPU model, problem) of the runs to
grade, which measures what that model's cache lacks (`--baselines-only`), all merged before any run
is graded — so each problem's baselines are measured once cluster-wide. Then one task per (GPU model,
run), costliest problems first.

**Failures.** A child killed by a signal (its node's OOM killer, a person) raises `ChildKilled` and
Ray runs the task again, up to TASK_RETRIES times; a node that dies takes its tasks with it and Ray
reruns them elsewhere. A task that still fails, or whose child exited non-zero (a bad submission is a
row, not an exit), is one line on the console; the batch goes on and the command exits non-zero.

**Nodes need the checkout.** The deck and submissions folders are read at the driver's paths on the
node (a shared filesystem, or the same clone at the same path), and `kernelboard` installed with the
`eval` extra, as for a local run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kernelboard.errors import KernelboardError, UsageError

from .deck import load_deck
from .merge import has_tables, merge_results
from .parallel import _child_args, _probe, problem_costs
from .schedule import EvalOptions, _gradeable, _graded_solutions, select_submissions
from .schema import CPU_KEY

_console = Console(stderr=True, soft_wrap=True)

#: A node advertises each GPU model it holds as this prefix + the hardware table's key.
RESOURCE_PREFIX = "gpu_"
#: Times Ray runs a task again after its child was killed by a signal or its node died.
TASK_RETRIES = 2
#: Where a task's child writes; the task replaces it with its own folder on the node.
_OUT = "{out}"


class ChildKilled(RuntimeError):
    """A task's `kernelboard eval` child died of a signal: Ray runs the task again (TASK_RETRIES)."""


def resource(gpu: str) -> str:
    """The custom resource that stands for one GPU of the model `gpu` (a hardware-table key)."""
    return f"{RESOURCE_PREFIX}{gpu}"


def gpu_models(resources: Mapping[str, float], device: str) -> dict[str, int]:
    """{GPU key: how many} that a cluster's resources advertise, for `device` ('cpu' takes only the
    `gpu_cpu` resource, 'cuda' every other `gpu_<key>`)."""
    found = {name.removeprefix(RESOURCE_PREFIX): int(n) for name, n in resources.items()
             if name.startswith(RESOURCE_PREFIX) and n >= 1}
    return {k: n for k, n in sorted(found.items()) if (k == CPU_KEY) == (device == "cpu")}


def _pack(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _unpack(files: Mapping[str, bytes], folder: Path) -> None:
    for rel, data in files.items():
        path = folder / rel
        if path.resolve().is_relative_to(folder.resolve()):  # a task's own names, never outside its folder
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def grade_task(args: list[str], seed: Mapping[str, bytes], needs: list[str]) -> dict[str, Any]:
    """On a Ray worker: `kernelboard eval ARGS` in a fresh folder seeded with `seed` (relative path ->
    bytes: the GPU model's cached tables), the folder's files returned with the child's exit code and
    output. `needs`: folders the child reads, checked first (a node without the checkout says so)."""
    missing = [p for p in needs if not Path(p).is_dir()]
    if missing:
        return {"rc": 2, "files": {}, "output": f"this node ({os.uname().nodename}) has no {', '.join(missing)}: "
                                                 "every node needs the checkout at the driver's paths"}
    root = Path(tempfile.mkdtemp(prefix="kernelboard-ray-"))
    try:
        out = root / "out"
        _unpack(seed, out)
        command = [sys.executable, *[str(out) if a == _OUT else a for a in args]]
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
        if done.returncode < 0:
            raise ChildKilled(f"kernelboard eval was killed by {signal.Signals(-done.returncode).name} on "
                              f"{os.uname().nodename}")
        return {"rc": done.returncode, "files": _pack(out) if out.is_dir() else {},
                "output": (done.stdout + done.stderr)[-4000:]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _seed(out: Path, gpu: str) -> dict[str, bytes]:
    """What a task on `gpu` starts from: that model's baselines and hardware rows in --out."""
    return {f"{gpu}/{name}": (out / gpu / name).read_bytes() for name in ("baselines.parquet", "hardware.parquet")
            if (out / gpu / name).is_file()}


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'kernelboard[ray]' (or pip install ray)") from None
    return ray


def _start(ray: Any, opts: EvalOptions, address: str | None) -> None:
    """Join the cluster at `address`, or start a local Ray instance advertising this host's devices."""
    if address is not None:
        ray.init(address=address, log_to_driver=False)
        return
    if opts.device == "cpu":
        ray.init(resources={resource(CPU_KEY): max(1, (os.cpu_count() or 2) // 2)}, include_dashboard=False,
                 log_to_driver=False)
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else _cuda_devices()
    from .hardware import gpu_key

    keys = Counter(gpu_key(env["device_name"]) for env in _probe(opts, devices).values())
    ray.init(num_gpus=len(devices), resources={resource(k): n for k, n in keys.items()}, include_dashboard=False,
             log_to_driver=False)


def _cuda_devices() -> list[str]:
    """This host's CUDA device indices, counted by a short torch process (the driver imports no torch)."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          capture_output=True, text=True, check=False)
    count = int(done.stdout.strip() or 0) if done.returncode == 0 else 0
    if count == 0:
        raise UsageError("--ray without an address starts a local instance of this host's GPUs, and torch sees none")
    return [str(i) for i in range(count)]


def run_ray(opts: EvalOptions, address: str | None) -> None:
    """Grade the selected submissions as Ray tasks (the module docstring) and merge into --out;
    `address` None starts a local instance."""
    ray = _ray()
    _start(ray, opts, address)
    try:
        failed = _grade(ray, opts)
    finally:
        ray.shutdown()
    if failed:
        raise KernelboardError(f"{len(failed)} task(s) failed: {'; '.join(failed)}")


def _grade(ray: Any, opts: EvalOptions) -> list[str]:
    models = gpu_models(ray.cluster_resources(), opts.device)
    if not models:
        raise UsageError(f"no node of the Ray cluster advertises a {RESOURCE_PREFIX}<gpu> resource for --device "
                         f"{opts.device} (start nodes with --resources '{{\"{resource('h200')}\": 2}}')")
    _console.print("Ray cluster: " + ", ".join(f"{n} × {k}" for k, n in models.items()))
    deck = load_deck(opts.deck)
    subs = select_submissions(opts, set(deck))
    skip = opts.resume and not opts.regrade
    todo: dict[str, list[Any]] = {}
    for gpu in models:
        graded = _graded_solutions(opts, gpu) if skip else {}
        todo[gpu] = [s for s in subs if _gradeable(opts, deck[s.problem], s)
                     and graded.get(s.run_id) != s.solution_sha256()]
    remote = ray.remote(grade_task)
    needs = [str(opts.deck.resolve()), str(opts.submissions.resolve())]
    absolute = replace(opts, deck=opts.deck.resolve(), submissions=opts.submissions.resolve())

    def submit(gpu: str, phase_opts: EvalOptions, run_ids: list[str]) -> Any:
        args = _child_args(phase_opts, Path(_OUT), run_ids)[1:]
        return remote.options(num_gpus=0 if gpu == CPU_KEY else 1, resources={resource(gpu): 1},
                              max_retries=TASK_RETRIES, retry_exceptions=[ChildKilled]).remote(
            args, _seed(opts.out, gpu), needs)

    measuring = replace(absolute, baselines_only=True, resume=False)
    tasks = {submit(gpu, measuring, [s.run_id for s in ss if s.problem == p]): (gpu, f"baselines of {p}")
             for gpu, ss in todo.items() for p in dict.fromkeys(s.problem for s in ss)}
    failed = _collect(ray, opts, tasks, "measuring baselines")
    grading = replace(absolute, baselines_only=False, resume=False, regrade=False)  # phase 1's baselines reused
    costs = problem_costs(opts.out, {s.problem for s in subs}, set(models))
    order = [(gpu, s) for gpu, ss in todo.items() for s in ss]
    order.sort(key=lambda gs: (-costs[gs[1].problem], gs[1].run_id, gs[0]))  # costliest first
    tasks = {submit(gpu, grading, [s.run_id]): (gpu, s.run_id) for gpu, s in order}
    return failed + _collect(ray, opts, tasks, "grading")


def _collect(ray: Any, opts: EvalOptions, tasks: dict[Any, tuple[str, str]], what: str) -> list[str]:
    """Merge each task's folder into --out as it arrives, a progress bar per GPU model; returns one
    line per task that failed."""
    failed: list[str] = []
    if not tasks:
        return failed
    per_gpu = Counter(gpu for gpu, _ in tasks.values())
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=_console) as progress:
        bars = {gpu: progress.add_task(f"{what} on {gpu}", total=n) for gpu, n in per_gpu.items()}
        pending = list(tasks)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            gpu, name = tasks[ready[0]]
            progress.advance(bars[gpu])
            try:
                reply = ray.get(ready[0])
            except Exception as exc:  # the task died TASK_RETRIES + 1 times, or its node went away
                failed.append(f"{name} on {gpu}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")
                progress.console.print(failed[-1], style="red", markup=False, highlight=False)
                continue
            if reply["files"]:
                with tempfile.TemporaryDirectory(prefix="kernelboard-ray-") as tmp:
                    _unpack(reply["files"], Path(tmp))
                    if has_tables(Path(tmp)):
                        merge_results(Path(tmp), opts.out)
            if reply["rc"] != 0:
                tail = reply["output"].strip().splitlines()[-1:] or [f"exit {reply['rc']}"]
                failed.append(f"{name} on {gpu}: exited {reply['rc']}: {tail[0][:300]}")
                progress.console.print(failed[-1], style="red", markup=False, highlight=False)
    return failed

"""Which CPU cores a GPU's grader measures on, and which cores compile (Linux CPU affinity).

A launch-bound call's time is mostly host work — Python dispatch, the launch itself — so whatever
else runs on the host shifts it. On an H200 host grading on both GPUs (nvcc building the next
solution, the other GPU's judge computing references and copying GBs of inputs), the honest house
03 kernel's per-shape medians moved by up to 20% between three gradings of one kernel. So the
judge and runner of each GPU get cores of their own, and the prebuild compiles of every GPU share
the rest: started under util-linux `taskset`, so every process they start (the sandboxed runner,
nvcc) inherits the cores.

The plan is a pure function of the cores this process may use, the number of GPUs on the host and
the GPU this grader uses (`CUDA_VISIBLE_DEVICES`' first index), so graders started separately on
one host — by `--gpus`, or by hand — agree on it without talking. GPU `slot` measures on the
MEASURE_CORES cores counted from the top (slot 0: the last two), so the low cores, where the
kernel tends to place interrupts and housekeeping, compile. Hosts with too few cores to spare
(fewer than MIN_SPARE build cores after every GPU's measure cores: CI's 2-core machine) are not
pinned.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MEASURE_CORES", "MIN_SPARE", "CpuPlan", "cpu_plan", "describe", "host_plan", "pinned"]

#: Cores for one GPU's judge and runner (the judge's reference work and the runner's dispatch).
MEASURE_CORES = 2
#: Cores left for compiling, at least, before a host is pinned at all.
MIN_SPARE = 4
_GPU_NODE = re.compile(r"nvidia(\d+)")


@dataclass(frozen=True)
class CpuPlan:
    """The cores one GPU's grader measures on and the cores every GPU's compiles share."""

    measure: frozenset[int]
    build: frozenset[int]


def cpu_plan(cores: Iterable[int], slot: int, slots: int) -> CpuPlan | None:
    """The plan for GPU `slot` of `slots` on a host whose usable cores are `cores`, or None where
    the host has too few (see the module docstring)."""
    ordered = sorted(set(cores))
    slots = max(1, slots)
    if not 0 <= slot < slots or len(ordered) < slots * MEASURE_CORES + MIN_SPARE:
        return None
    top = len(ordered) - MEASURE_CORES * slot
    measure = frozenset(ordered[top - MEASURE_CORES:top])
    build = frozenset(ordered[:len(ordered) - MEASURE_CORES * slots])
    return CpuPlan(measure, build)


def _host_gpus(dev: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in dev.glob("nvidia*") if (m := _GPU_NODE.fullmatch(p.name)))


def host_plan(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> CpuPlan | None:
    """This grader's plan: its usable cores, the host's GPUs (`/dev/nvidiaN` nodes) and the first
    device of `CUDA_VISIBLE_DEVICES` (a UUID or an unset variable counts as GPU 0). None off Linux,
    without GPU nodes, or on a host with too few cores."""
    env = os.environ if env is None else env
    if not hasattr(os, "sched_getaffinity"):
        return None
    gpus = _host_gpus(dev)
    if not gpus:
        return None
    first = (env.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    slot = gpus.index(int(first)) if first.isdigit() and int(first) in gpus else 0
    return cpu_plan(os.sched_getaffinity(0), slot, len(gpus))


def pinned(command: list[str], cores: frozenset[int] | None) -> list[str]:
    """`command` started on `cores` from its first instruction (util-linux `taskset`, so every
    process it starts inherits them, a sandbox's too); unchanged with None or without taskset."""
    taskset = shutil.which("taskset")
    return [taskset, "-c", _ranges(cores), *command] if cores and taskset else command


def _ranges(cores: frozenset[int]) -> str:
    out: list[str] = []
    for c in sorted(cores):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def describe(plan: CpuPlan | None) -> str:
    """One log line: where this grader measures and compiles."""
    if plan is None:
        return "[grader] CPUs: not pinned (too few cores, or no GPU nodes)"
    return f"[grader] CPUs: judge and runner on cores {_ranges(plan.measure)}, compiles on {_ranges(plan.build)}"

"""How many kernels one call launches, and how much of its GPU time the largest one holds (no torch).

Issue 16's "megakernel" is a measured property, never a model's claim: a decode step that runs as
one kernel launches one; a CUDA-graph replay of forty kernels launches forty (the profiler records
every node a graph replay runs as its own kernel). Counted from the device events of one profiled,
warm call (`audit.timed_kernels`): every kernel counts, copies and memsets do not (a step's own
`torch.empty` + `copy_` are not kernels of its work, and the runtime's copies are not launches
of the candidate's). `top_share` is the largest single launch's share of the call's kernel time:
near 1 for a megakernel, small for a step spread over many kernels.

The profile is taken in the runner, the candidate's process, like the kernel list that the origin
audit reads: code that patches torch's profiler could report another count. Like that audit's,
this figure is evidence for readers, not a defence (the methodology page's threat model).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: Device events that are not kernel launches: the runtime's copies and fills (CUPTI's names).
_NOT_A_LAUNCH = re.compile(r"^(?:Memcpy|Memset|memcpy|memset)\b")


@dataclass(frozen=True)
class LaunchCount:
    launches: int  # kernels launched by one call (each node of a graph replay counted)
    top_share: float | None  # the largest launch's share of their summed time; None without kernels


def count_launches(events: Iterable[tuple[str, float]]) -> LaunchCount:
    """From (name, duration in µs) of every device event of one call, in any order."""
    durations = [max(float(us), 0.0) for name, us in events if not _NOT_A_LAUNCH.match(name)]
    total = sum(durations)
    return LaunchCount(len(durations), (max(durations) / total) if durations and total > 0 else None)

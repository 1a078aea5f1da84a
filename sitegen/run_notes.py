"""Where a run page's records disagree with each other, and what the page says: clocks, and stale claims.

**Clocks.** A run page shows two times that come from different machines: `runs.started_at` (when the agent run
started, as its source recorded it) and `results.graded_at` (when grading finished). Where they come from:

- a house row's start is hand-written in its run.yaml by the kernelboard team: a label, not a clock
  reading (`20261130_120000_…` house kernels were "started" at 12:00 on a day they were graded at 02:27);
- an imported run's start is the source's runner clock (KernelBench-Hard's `started_at`, else its run
  id read at the runner's UTC offset, `ingest/naming.RUNNER_UTC_OFFSET`); a trace's start is its first
  record's time;
- kernelboard's `graded_at` is the grading machine's clock when the worker returned; an imported
  result's is the source's record (its finish time, or its start plus its total time).

All are shown in UTC. A start after the grading is shown as recorded, never hidden or corrected, with a
line naming both clocks: the data disagrees, and the page says so.

**Stale claims.** A kernel's source is shown as submitted (its SHA-256 covers it), so words written before
grading stay in it: two house kernels say "NOT YET TIMED ON A GPU" above their H200 timings. Where the
source says it was never timed on a GPU and the result holds GPU timings, the page says which is current.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .format import duration, when
from .load import Result, Run


@dataclass(frozen=True)
class RunTimes:
    started_clock: str  # where `started_at` comes from, in a few words
    graded_clock: str  # where `graded_at` comes from
    disagreement: str | None  # set when the run "started" after it was graded


def _started_clock(run: Run) -> str:
    if run.is_house:
        return "hand-written in the submission's run.yaml (a label, not a clock reading)"
    if run.source.startswith("github:"):
        return "the source's runner clock, as its published files record it"
    if run.source.startswith("hf:"):
        return "the agent trace's first record (else its run id, read at the runner's UTC offset)"
    return "the submission's run.yaml"


def run_times(run: Run, result: Result) -> RunTimes:
    """The clocks of a run page's two times, and a sentence when the start is after the grading."""
    started = _started_clock(run)
    graded = ("the source grader's record" if result.is_imported
              else "the grading machine's clock, when the worker returned")
    disagreement = None
    if run.started_at is not None and run.started_at > result.graded_at:
        gap = (run.started_at - result.graded_at).total_seconds()
        disagreement = (f"This start is {duration(gap)} after the run was graded ({when(result.graded_at)}): the two "
                        "times come from different clocks, so they cannot both be right; both are shown as recorded.")
    return RunTimes(started, graded, disagreement)


#: A kernel's own words saying it was never timed on a GPU ("NOT YET TIMED ON A GPU: written on a machine
#: without one"): true when written, stale once the grader has timed it.
_UNTIMED_CLAIM = re.compile(r"(?:not|never)\s+(?:yet\s+)?(?:been\s+)?timed\s+on\s+a\s+GPU", re.IGNORECASE)


@dataclass(frozen=True)
class StaleClaim:
    """A line of a kernel's source that says it was not timed on a GPU, beside GPU timings that say it was."""

    line: int  # 1-based
    text: str  # from the claim to the end of its line


def stale_claim(source: str | None, result: Result) -> StaleClaim | None:
    """The first claim in `source` that the kernel was never timed on a GPU, when `result` holds GPU
    timings (a CUDA-event timer and shape rows); None otherwise."""
    if source is None or result.timer != "cuda_event" or not result.shapes:
        return None
    match = _UNTIMED_CLAIM.search(source)
    if match is None:
        return None
    end = source.find("\n", match.end())
    text = source[match.start():end if end >= 0 else None].strip()
    return StaleClaim(source.count("\n", 0, match.start()) + 1, text)

"""Grading phases (judge side, no torch): the file the parent watches, the deadlines the judge keeps.

The parent (sandbox.py) kills a worker whose phase runs past its budget, or that runs past the
whole job's budget; it learns the phase from a file the judge rewrites. The job names the same
budgets, so the judge holds every request it makes of the runner to them, one second early: it
then kills the runner and writes the timeout itself, with the parent's own wording. A runner that
rewrites the phase file fools the parent's clock, not the judge's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .atomic import write_text_atomic
from .job import Job

#: The judge's deadlines fall this long before the parent's, so it can kill the runner and write.
DEADLINE_MARGIN_S = 1.0


class Phases:
    """Names the running phase to the parent and in the result; gives its deadline."""

    def __init__(self, result: dict[str, Any], path: Path | None = None, budgets: dict[str, float] | None = None,
                 timeout_s: float | None = None, started_unix: float | None = None) -> None:
        """`budgets` (phase -> s) and `timeout_s` (the whole job's, counted from `started_unix`) are the
        parent's; with none, there is no deadline."""
        self.path, self.result = path, result
        self.budgets: dict[str, float] = budgets or {}
        self.timeout_s = timeout_s
        self.end = None if timeout_s is None or started_unix is None else \
            time.monotonic() + started_unix + timeout_s - time.time()
        self.phase: str | None = None
        self.since = time.monotonic()

    @classmethod
    def for_job(cls, job: Job, result: dict[str, Any]) -> Phases:
        """The phases of a worker's job, with the budgets the parent named in it."""
        return cls(result, job.phase_path, job.phase_timeouts_s, job.timeout_s, job.started_unix)

    def enter(self, phase: str) -> None:
        """Start `phase` (its clock restarts only when it differs from the current one, as the
        parent's does)."""
        if phase != self.phase:
            self.phase, self.since = phase, time.monotonic()
        self.result["phase"] = phase
        if self.path:
            write_text_atomic(self.path, phase)

    def deadline(self) -> tuple[float | None, str]:
        """(`time.monotonic()` deadline, or None when the job names no budget; the message the
        parent writes when that budget runs out)."""
        found: list[tuple[float, str]] = []
        limit = self.budgets.get(self.phase or "")
        if limit is not None:
            found.append((self.since + limit, f"phase '{self.phase}' ran past its {limit:.0f} s budget"))
        if self.end is not None:
            found.append((self.end, f"killed after {self.timeout_s:.0f} s (in phase '{self.phase}')"))
        if not found:
            return None, ""
        at, message = min(found)
        return at - DEADLINE_MARGIN_S, message

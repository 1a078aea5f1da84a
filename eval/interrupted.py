"""Runs a batch was interrupted in, remembered so the next batch grades them last.

A GPU is lent in calls of a few minutes, and a batch is cut off at the call's deadline (SIGINT; the
rows it finished stay). A run still grading then has no row, so `--resume` would grade it first in the
next call, and a kernel whose first call compiles for ten minutes (MiniMax-M3's 07 of 2026-06-18:
Triton took 158 s and 368 s on two shapes) would fill every call whole. So an interrupted run is
written to `<out>/<gpu>/interrupted.json` with how long it ran (its build and its grading) and the phase
it was in; the batch queue puts the runs that had run `HOLD_BACK_AFTER_S` or more after every other,
least-run first (a run cut sooner is where the deadline fell and keeps its place), and a finished
grading of the same solution removes the record. `eval merge` carries the records, so the next session
knows them too. Given the batch's end (`--stop-at`), a held run is not started where each of its attempts
ran longer than what is left (`schedule.too_late`): it would be cut again, its GPU time spent for nothing.

The file is scheduling state, not a measurement: nothing on the site reads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from .atomic import write_text_atomic
from .settings import HOLD_BACK_AFTER_S

FILE_NAME = "interrupted.json"

T = TypeVar("T")


@dataclass(frozen=True)
class Interruption:
    """One run's interrupted gradings: how many, their seconds summed, the last one's phase and time."""

    solution_sha256: str
    times: int
    seconds: float
    phase: str
    last_at: str

    @property
    def outlasts_a_call(self) -> bool:
        """Whether it ran long enough (HOLD_BACK_AFTER_S, build and grading) to be graded last: a run cut
        sooner was where the call's deadline fell."""
        return self.seconds >= HOLD_BACK_AFTER_S

    def summary(self) -> str:
        times = "once" if self.times == 1 else f"{self.times} times"
        return f"interrupted {times} ({self.seconds:.0f} s in all; last in '{self.phase}')"


def records_path(out: Path, gpu: str) -> Path:
    return out / gpu / FILE_NAME


def read_records(out: Path, gpu: str) -> tuple[dict[str, Interruption], str | None]:
    """The records of one GPU's folder, and a one-line warning when the file cannot be read (then none:
    it only orders the queue, so a bad file must not stop a batch)."""
    path = records_path(out, gpu)
    if not path.exists():
        return {}, None
    try:
        raw = json.loads(path.read_text())
        return {str(run_id): Interruption(**fields) for run_id, fields in raw.items()}, None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return {}, f"{path}: not a record of interrupted runs ({type(exc).__name__}: {exc}); ignored"


def write_records(out: Path, gpu: str, records: dict[str, Interruption]) -> None:
    """Write the records whole (or remove the file when none is left)."""
    path = records_path(out, gpu)
    if not records:
        if path.exists():
            os.remove(path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {run_id: asdict(records[run_id]) for run_id in sorted(records)}
    write_text_atomic(path, json.dumps(body, indent=1) + "\n")


def add_interruption(records: dict[str, Interruption], run_id: str, solution_sha256: str, seconds: float,
                     phase: str, at: str) -> dict[str, Interruption]:
    """`records` with one more interruption of `run_id` (a changed solution starts its count again)."""
    before = records.get(run_id)
    if before is not None and before.solution_sha256 == solution_sha256:
        entry = Interruption(solution_sha256, before.times + 1, round(before.seconds + seconds, 1), phase, at)
    else:
        entry = Interruption(solution_sha256, 1, round(seconds, 1), phase, at)
    return {**records, run_id: entry}


def without_graded(records: dict[str, Interruption], graded: dict[str, str]) -> dict[str, Interruption]:
    """`records` less the runs graded since, with the same solution (`graded`: run_id -> solution_sha256)."""
    return {run_id: r for run_id, r in records.items() if graded.get(run_id) != r.solution_sha256}


def merged_records(ours: dict[str, Interruption], theirs: dict[str, Interruption]) -> dict[str, Interruption]:
    """Both folders' records; where both hold a run, the one that saw more interruptions (a folder seeded
    from another carries its records forward and adds to them, so summing would count twice)."""
    out = dict(ours)
    for run_id, r in theirs.items():
        mine = out.get(run_id)
        if mine is None or mine.solution_sha256 != r.solution_sha256 or r.times > mine.times:
            out[run_id] = r
    return out


def record_of(records: dict[str, Interruption], run_id: str, solution_sha256: str | None) -> Interruption | None:
    """The record of `run_id`'s interruptions, if it is of this solution (a changed one starts afresh)."""
    record = records.get(run_id)
    return record if record is not None and record.solution_sha256 == solution_sha256 else None


def graded_last(items: Sequence[T], held: Callable[[T], Interruption | None]) -> list[T]:
    """`items` with those `held` finds a record for moved behind the rest, least seconds run first; the
    others keep their order."""
    return sorted(items, key=lambda item: (False, 0.0) if (r := held(item)) is None else (True, r.seconds))

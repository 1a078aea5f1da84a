"""The scheduler → worker message: one `Job`, written as `<workdir>.job.json` by sandbox.py and read
by worker.py (no torch).

A typed record instead of a dict of strings, so both sides name the same fields and the worker
refuses a job file it cannot trust with one line (`JobError`) instead of a `KeyError` half-way
through grading. The file is JSON with one key per field (paths as strings, tuples as lists,
`jail` as `Jail.to_job()`), keys sorted; keys an older job file lacks read as their defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .jail import Jail

#: What a worker does: grade one submission, or time one problem's baselines.
KINDS = ("grade", "baseline")

#: Where a job runs (`--device`).
DEVICES = ("cuda", "cpu")


class JobError(ValueError):
    """A job file the worker cannot use; its message is one line naming the key and what was expected."""


@dataclass(frozen=True)
class Job:
    """One worker's orders. The scheduler fills what to do; `sandbox.run_worker` adds where to write
    and the budgets it enforces (`result_path` and below) before writing the file."""

    kind: str  # one of KINDS
    problem_path: Path  # the deck problem (a folder, or a KernelBench level file), resolved
    device: str  # one of DEVICES
    #: This grading's own seed: added to the deck's seeds, and it draws the timing inputs (baselines
    #: draw theirs from it too, so every run of a shape's baselines times the same inputs).
    base_seed: int
    rep_ms: float | None = None  # the timer's repetition budget per timing set; None: timing.py's default
    # grade jobs
    solution_dir: Path | None = None  # the scratch copy of the submission the runner imports from
    #: How the runner is confined (jail.py). None — a job written without one — also starts the runner
    #: unsandboxed, and the runner then watches the worker's pid itself (no bwrap --die-with-parent).
    jail: Jail | None = None
    # baseline jobs
    variants: tuple[str, ...] = ()  # every variant to time on every shape, when `todo` is None
    #: shape index (as a string, JSON's object keys) -> the variants still to time on it (the rest are cached)
    todo: dict[str, tuple[str, ...]] | None = None
    checkpoint_path: Path | None = None  # rewritten after each shape, so a timeout keeps the shapes done
    # added by sandbox.run_worker
    result_path: Path | None = None  # where the worker writes its one result, atomically
    phase_path: Path | None = None  # the file the judge names its phase in, which the parent watches
    phase_timeouts_s: dict[str, float] = field(default_factory=dict)  # phase -> its budget (s)
    timeout_s: float | None = None  # the whole job's budget (s), from `started_unix`
    started_unix: float | None = None  # when the parent started its clock (time.time())
    caches: tuple[str, ...] = ()  # folders the runner may write besides its solution_dir (compile caches)

    def to_json(self) -> str:
        """The job file's text: one key per field, keys sorted."""
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, Jail):
                value = value.to_job()
            elif isinstance(value, tuple):
                value = list(value)
            elif f.name == "todo" and value is not None:
                value = {k: list(v) for k, v in value.items()}
            data[f.name] = value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Job:
        """Read and check a job file's text; raise `JobError` naming the first key that is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JobError(f"not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise JobError(f"expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise JobError(f"unknown keys {unknown}")
        r = _Reader(data)
        kind = r.choice("kind", KINDS)
        job = cls(
            kind=kind,
            problem_path=r.required_path("problem_path"),
            device=r.choice("device", DEVICES),
            base_seed=r.get("base_seed", int, required=True),
            rep_ms=r.number("rep_ms"),
            solution_dir=r.required_path("solution_dir") if kind == "grade" else r.path("solution_dir"),
            jail=r.jail("jail"),
            variants=r.strings("variants"),
            todo=r.todo("todo"),
            checkpoint_path=r.path("checkpoint_path"),
            result_path=r.required_path("result_path"),
            phase_path=r.path("phase_path"),
            phase_timeouts_s=r.budgets("phase_timeouts_s"),
            timeout_s=r.number("timeout_s"),
            started_unix=r.number("started_unix"),
            caches=r.strings("caches"),
        )
        if kind == "baseline" and job.todo is None and not job.variants:
            raise JobError("key 'variants': a baseline job names the variants to time, or a 'todo'")
        return job


class _Reader:
    """Typed access to a job file's keys; each mistake is one `JobError` naming the key."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def get(self, key: str, kind: type | tuple[type, ...], required: bool = False) -> Any:
        value = self.data.get(key)
        if value is None:
            if required:
                raise JobError(f"key '{key}': a value is required")
            return None
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise JobError(f"key '{key}': expected {names}, got {value!r}")
        return value

    def choice(self, key: str, allowed: tuple[str, ...]) -> str:
        value = self.get(key, str, required=True)
        if value not in allowed:
            raise JobError(f"key '{key}': expected one of {', '.join(allowed)}, got {value!r}")
        return value

    def number(self, key: str) -> float | None:
        """A number as written (an int stays an int: the worker uses it as the scheduler gave it)."""
        return self.get(key, (int, float))

    def path(self, key: str) -> Path | None:
        value = self.get(key, str)
        if value == "":
            raise JobError(f"key '{key}': expected a path, got ''")
        return None if value is None else Path(value)

    def required_path(self, key: str) -> Path:
        path = self.path(key)
        if path is None:
            raise JobError(f"key '{key}': a value is required")
        return path

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.get(key, list) or []
        if not all(isinstance(v, str) for v in value):
            raise JobError(f"key '{key}': expected a list of strings, got {value!r}")
        return tuple(value)

    def todo(self, key: str) -> dict[str, tuple[str, ...]] | None:
        value = self.get(key, dict)
        if value is None:
            return None
        if not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in value.values()):
            raise JobError(f"key '{key}': expected shape index -> a list of variant names, got {value!r}")
        return {str(k): tuple(v) for k, v in value.items()}

    def budgets(self, key: str) -> dict[str, float]:
        value = self.get(key, dict) or {}
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
            raise JobError(f"key '{key}': expected phase -> seconds, got {value!r}")
        return dict(value)

    def jail(self, key: str) -> Jail | None:
        value = self.get(key, dict)
        if not value:  # absent or {}: no jail named, as `job.get("jail")` read it
            return None
        try:
            return Jail.from_job(value)
        except TypeError as exc:
            raise JobError(f"key '{key}': {exc}") from None

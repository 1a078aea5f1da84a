"""Submissions: `data/submissions/<bench>/<run_id>/` = solution.py (+ sidecars) + run.yaml (no torch).

`run.yaml` says who wrote the kernel and how the agent run ended; it becomes one row of the runs
table. The solution's hash covers every file of the folder but run.yaml, so a changed sidecar
(a .cu file, a header) makes the run ungraded again under `--resume`.

A folder is refused, with one line naming the file and the field, when run.yaml is not UTF-8
text or not a mapping, a field has the wrong type or an impossible value (a date that does not
exist, a NaN, negative or infinite cost, time or token count), solution.py is not UTF-8 text, or
anything in the folder is a symbolic link (never followed: a link to /etc/passwd would otherwise
be hashed, copied into the scratch copy and published). `discover` refuses such folders one by
one, and stray files beside them, so the rest of the batch goes on.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import SubmissionError

from .schema import AGENT_OUTCOMES

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

_OPTIONAL: dict[str, tuple[type, ...]] = {
    "model_display": (str,),
    "lab": (str,),
    "effort": (str,),
    "gpu": (str,),
    "outcome_note": (str,),
    "trace_url": (str,),
    "started_at": (str, dt.datetime, dt.date),
    "agent_seconds": (int, float),
    "input_tokens": (int,),
    "output_tokens": (int,),
    "cache_read_tokens": (int,),
    "cost_usd": (int, float),
    "source": (str,),
}
#: Fields that count what the agent spent: finite and not negative. Counts must fit the table's int64.
_SPENT = ("agent_seconds", "cost_usd", "input_tokens", "output_tokens", "cache_read_tokens")
_INT64_MAX = 2**63 - 1
_REQUIRED: dict[str, tuple[type, ...]] = {
    "problem": (str,),
    "model": (str,),
    "harness": (str,),
    "agent_outcome": (str,),
}


@dataclass(frozen=True)
class Submission:
    run_id: str
    folder: Path
    meta: dict[str, Any]

    @property
    def solution(self) -> Path:
        return self.folder / "solution.py"

    @property
    def problem(self) -> str:
        return self.meta["problem"]

    @property
    def has_solution(self) -> bool:
        return self.solution.is_file()

    def files(self) -> list[Path]:
        """The solution's files (all but run.yaml and caches), sorted, for hashing and scanning;
        symbolic links are never followed (`load_submission` refuses a folder that has one)."""
        return sorted(
            p for p in self.folder.rglob("*")
            if p.is_file() and not p.is_symlink() and p.name != "run.yaml" and "__pycache__" not in p.parts
        )

    @property
    def solution_is_empty(self) -> bool:
        """solution.py holds nothing but whitespace: nothing to build, no worker needed."""
        return self.has_solution and not self.solution.read_bytes().strip()

    def solution_sha256(self) -> str | None:
        if not self.has_solution:
            return None
        digest = hashlib.sha256()
        for path in self.files():
            digest.update(path.relative_to(self.folder).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        return digest.hexdigest()

    def cache_key(self) -> str:
        """The name of its compile caches (`sandbox.cache_dir`): its solution's hash, so every grading and
        prebuild of the same files, on any host, shares them."""
        return self.solution_sha256() or self.run_id

    def run_row(self, bench: str) -> dict[str, Any]:
        """This submission as a row of the runs table."""
        m = self.meta
        started = m.get("started_at")
        if isinstance(started, str):
            started = dt.datetime.fromisoformat(started.replace("Z", "+00:00"))
        elif isinstance(started, dt.date) and not isinstance(started, dt.datetime):
            started = dt.datetime(started.year, started.month, started.day, tzinfo=dt.UTC)
        if isinstance(started, dt.datetime) and started.tzinfo is None:
            started = started.replace(tzinfo=dt.UTC)
        return {
            "run_id": self.run_id,
            "bench": bench,
            "problem": m["problem"],
            "gpu": m.get("gpu"),
            "model": m["model"],
            "model_display": m.get("model_display") or m["model"],
            "lab": m.get("lab"),
            "harness": m["harness"],
            "effort": m.get("effort"),
            "started_at": started,
            "agent_seconds": _float(m.get("agent_seconds")),
            "input_tokens": m.get("input_tokens"),
            "output_tokens": m.get("output_tokens"),
            "cache_read_tokens": m.get("cache_read_tokens"),
            "cost_usd": _float(m.get("cost_usd")),
            "agent_outcome": m["agent_outcome"],
            "outcome_note": m.get("outcome_note"),
            "trace_url": m.get("trace_url"),
            "solution_sha256": self.solution_sha256(),
            "source": m.get("source") or "local",
        }


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _symlink_in(folder: Path) -> Path | None:
    """The first symbolic link in `folder` (itself included), looking without following any."""
    if folder.is_symlink():
        return folder
    for root, dirs, names in os.walk(folder):  # os.walk never descends into a linked folder
        for name in sorted(dirs + names):
            if os.path.islink(os.path.join(root, name)):
                return Path(root, name)
    return None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(exc, "problem", None) or exc).split())


def load_submission(folder: Path) -> Submission:
    """Read and check one submission folder; raise `SubmissionError` naming the file and key."""
    path = folder / "run.yaml"
    if not RUN_ID_PATTERN.match(folder.name):
        raise SubmissionError(f"{folder}: a run folder name must be letters, digits, '.', '_' or '-'")
    link = _symlink_in(folder)
    if link is not None:
        raise SubmissionError(f"{link}: a symbolic link; a submission's files must be plain files in its folder "
                              "(links are never followed)")
    if not path.is_file():
        raise SubmissionError(f"{folder}: no run.yaml (who wrote this kernel, and how did the run end?)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SubmissionError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if "\0" in text:
        raise SubmissionError(f"{path}: a binary file (NUL bytes), expected YAML text")
    try:
        meta = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SubmissionError(f"{path}: not valid YAML ({_yaml_problem(exc)})") from None
    except (ValueError, OverflowError, RecursionError) as exc:  # a date YAML recognises that does not exist
        raise SubmissionError(f"{path}: a value YAML cannot read ({' '.join(str(exc).split())})") from None
    if not isinstance(meta, dict):
        raise SubmissionError(f"{path}: expected a mapping of keys, got {type(meta).__name__}")
    if not all(isinstance(k, str) for k in meta):
        raise SubmissionError(f"{path}: every key must be text, got {sorted(map(repr, meta))}")
    if meta.get("run_id", folder.name) != folder.name:
        raise SubmissionError(f"{path}: key 'run_id': expected the folder name {folder.name!r}")
    unknown = set(meta) - set(_REQUIRED) - set(_OPTIONAL) - {"run_id"}
    if unknown:
        raise SubmissionError(f"{path}: unknown keys {sorted(unknown)}")
    for key in _REQUIRED:
        if key not in meta:
            raise SubmissionError(f"{path}: missing key '{key}'")
    for key, kinds in {**_REQUIRED, **_OPTIONAL}.items():
        value = meta.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            raise SubmissionError(f"{path}: key '{key}': expected {kinds[0].__name__}, got {value!r}")
    if meta["agent_outcome"] not in AGENT_OUTCOMES:
        raise SubmissionError(
            f"{path}: key 'agent_outcome': expected one of {', '.join(AGENT_OUTCOMES)}, "
            f"got {meta['agent_outcome']!r}"
        )
    for key in _REQUIRED:
        if not meta[key].strip():
            raise SubmissionError(f"{path}: key '{key}': expected text, got an empty string")
    if isinstance(meta.get("started_at"), str):
        try:
            dt.datetime.fromisoformat(meta["started_at"].replace("Z", "+00:00"))
        except ValueError:
            raise SubmissionError(f"{path}: key 'started_at': expected an ISO-8601 time, "
                                  f"got {meta['started_at']!r}") from None
    for key in _SPENT:
        value = meta.get(key)
        if value is not None and not (math.isfinite(value) and 0 <= value <= _INT64_MAX):
            raise SubmissionError(f"{path}: key '{key}': expected a finite number that is not negative, "
                                  f"got {value!r}")
    _check_solution(folder / "solution.py")
    return Submission(folder.name, folder, meta)


def _check_solution(path: Path) -> None:
    if path.exists() and not path.is_file():
        raise SubmissionError(f"{path}: expected a file")
    if path.is_file():
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SubmissionError(f"{path}: not UTF-8 text (byte {exc.start}); a solution is Python source") from None


def discover(submissions_dir: Path) -> tuple[list[Submission], list[str]]:
    """Every run folder under `submissions_dir`, sorted by run_id, and one line for each entry
    refused (a malformed folder, a stray file): the rest of the batch goes on without them."""
    found, refused = [], []
    for p in sorted(submissions_dir.iterdir()):
        if p.is_symlink() or not p.is_dir():
            refused.append(f"{p}: not a run folder ({'a symbolic link' if p.is_symlink() else 'a file'}), skipped")
            continue
        try:
            found.append(load_submission(p))
        except SubmissionError as exc:
            refused.append(exc.message)
        except OSError as exc:
            refused.append(f"{exc.filename or p}: cannot read ({exc.strerror or exc})")
    return found, refused

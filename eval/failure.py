"""Graded outcomes other than pass, and how a reported error becomes one (judge side, no torch).

The runner reports a candidate's exception as data — its type name, its text, whether it was a
`torch.OutOfMemoryError` — never as a pickled object, and the judge picks the status from that
data here. A runner that lies about an error can only choose between failing statuses.
"""

from __future__ import annotations

from typing import Any


class Failure(Exception):
    """A graded outcome other than pass, raised to stop grading: carries the status, and in `detail`
    the whole error text the runner reported (a compiler's output, say), which the one-line message
    cuts: `reproducible.classify` reads it after the failure."""

    def __init__(self, status: str, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.detail = status, message, detail


def one_line(kind: str, text: str, limit: int = 400) -> str:
    """'TypeName: first line of the text', cut to `limit` characters."""
    lines = text.strip().splitlines()
    return f"{kind}: {lines[0] if lines else ''}"[:limit]


def status_of(error: dict[str, Any], importing: bool = False) -> str:
    """oom for an out-of-memory error; build_error for a failed import, a compilation error or a
    failed extension build; wrong for a step's output of another layout; runtime_error for anything
    else. (The type name is the runner's word; every one of these is a failure.)"""
    if error["oom"]:
        return "oom"
    if error["type"] == "StepOutputError":  # a stateful step returned a state of another layout (stateful.py)
        return "wrong"
    if importing or "Compilation" in error["type"] or "Error building extension" in error["text"]:
        return "build_error"
    return "runtime_error"

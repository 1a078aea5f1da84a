"""A process and everything it started, found, killed and waited for through /proc (Linux; no torch).

The runner runs inside bubblewrap, in a session and a pid namespace of its own, so killing bwrap's
process group does not reach it: it dies a moment later, of bwrap's `--die-with-parent`, while the
judge has already written its result and the next grading begun. On an 80 GB H100 the next judge drew
its plan beside a runner still holding 13.6 GB and ran out of memory (06, 2026-12-06). The runner's
whole tree is found while its parent links still stand, killed, and waited for until each process has
exited: by then the kernel has closed its files, the GPU's among them, and its GPU memory is free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone. The command name, in parentheses, may hold
    spaces and parentheses of its own: the fields are read after its last ')'."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every living process below `pid`, children first."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def exited(pid: int) -> bool:
    """Gone, or a zombie: it has exited and released what it held; only its exit status is left."""
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X")


def wait_exited(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every one of `pids` has exited; returns those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left = [pid for pid in pids if not exited(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [pid for pid in left if not exited(pid)]
    return left

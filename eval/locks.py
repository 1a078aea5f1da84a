"""Advisory file locks (fcntl) that say who holds them: the per-GPU grader lock and the per-results-folder
write lock.

A holder writes one line describing itself (what, pid, command) into the lock file once it has the
lock; a process that has to wait prints "waiting for <that line> holding <lock file>" on stderr —
and, under pytest, which hides stderr, also as a `LockWaitWarning`, so a test run that stalls on
another checkout's grader says why. The lock is released when its file is closed, so a holder killed
with -9 never leaves a stale lock behind. Re-entering a lock this thread already holds does not wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from kernelboard.errors import KernelboardError

__all__ = ["LockWaitWarning", "hold", "lock_dir", "open_lock_file"]

_HELD = threading.local()


class LockWaitWarning(UserWarning):
    """A kernelboard process waits for a lock another process holds."""


def lock_dir() -> Path:
    """Where machine-wide locks (one per GPU) live: `KERNELBOARD_LOCK_DIR`, else the temp folder."""
    chosen = os.environ.get("KERNELBOARD_LOCK_DIR")
    if chosen:
        return Path(chosen)
    import tempfile

    return Path(tempfile.gettempdir())


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    if "PYTEST_CURRENT_TEST" in os.environ:  # pytest captures stderr; its warnings summary is always shown
        with warnings.catch_warnings():
            warnings.simplefilter("always", LockWaitWarning)
            warnings.warn(message, LockWaitWarning, stacklevel=3)


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 500, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"


def open_lock_file(path: Path) -> int:
    """A descriptor of the lock file `path` (created, with its folder, when missing), to `flock`; a file
    that cannot be created is a `KernelboardError` naming it (a read-only or full disk)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise KernelboardError(f"{path}: cannot create the lock file ({exc.strerror or exc})") from None


@contextlib.contextmanager
def hold(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created, with its folder, when missing) for the block.

    `what` describes this holder to anyone who waits ("kernelboard eval writing results.parquet").
    A lock file that cannot be created is a `KernelboardError` naming it (a read-only or full disk).
    """
    held: dict[str, int] = _HELD.__dict__.setdefault("counts", {})
    key = os.path.abspath(path)
    if held.get(key):
        held[key] += 1
        try:
            yield
        finally:
            held[key] -= 1
        return
    fd = open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for {_holder(fd)} holding {path}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        line = f"{what} (pid {os.getpid()}: {' '.join(sys.argv[:3])})\n".encode()
        with contextlib.suppress(OSError):  # a full disk: the lock still holds, only its label is lost
            os.ftruncate(fd, 0)
            os.pwrite(fd, line, 0)
        held[key] = 1
        try:
            yield
        finally:
            held.pop(key, None)
    finally:
        os.close(fd)

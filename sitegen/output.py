"""The output tree: pages rendered and written by a pool of forked workers, then swapped in whole.

At ten thousand runs a build is mostly per-page work that does not depend on other pages: build a
run page's context, render its template, create its folder and files.
On this filesystem creating a folder or a file costs tens to hundreds of microseconds of kernel
time, so writing is CPU work too. `Workers` forks after the data is loaded and every shared object
(tables, Jinja environment) is built, so each worker inherits them without pickling
and only page indices travel; each worker writes the files of its own pages. Nothing is written
outside the fresh folder `new_folder` makes beside the output, and `swap_in` replaces the previous
site with one atomic exchange of the two folders (Linux `renameat2(RENAME_EXCHANGE)`), so a build
killed at any point — even with -9, even mid-swap — leaves the previous site or the new one at the
output path, never none and never half of one. Where the filesystem cannot exchange, two renames
are used and a kill between them leaves the previous site beside the output (`.<out>.old.*`).

A large site's previous copy is not deleted but kept beside the output as a spare (`.<out>.spare`),
made hard links to the published files once the swap is done (`mirror_spare`): folders, no second
copy of the bytes. The next build takes it over as its fresh folder (`adopt_spare`), removes what the
new site lacks and replaces only the files whose bytes change (never writing into a linked file), so
a rebuild creates and deletes almost no files; a page whose inputs did not change is not rendered at
all while its file there is the published one (`render._Build.plan_writes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["Spare", "Workers", "adopt_spare", "clear_stale", "default_jobs", "discard", "mirror_spare", "new_folder",
           "swap_in", "sweep", "write_files"]

_T = TypeVar("_T")
_R = TypeVar("_R")

#: Below this many pages a build stays in one process: forking and collecting cost more than they save
#: (a 200-run site builds in well under a second), and small builds stay easy to debug.
PARALLEL_MIN_PAGES = 1_000

#: Pages per task handed to a worker: small enough to balance two workers whose pages differ in size,
#: large enough that task overhead (one pickled range, one result) stays negligible.
_CHUNK_PAGES = 64

#: The task of the current build, set in the parent before `Workers` forks; workers read it.
_TASK: Callable[[int], Any] | None = None


def default_jobs() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def write_files(root: Path, files: Iterable[tuple[str, bytes]], made: set[str] | None = None,
                recycled: Spare | None = None) -> list[str]:
    """Write each (relative path, bytes) under `root`, making folders as needed; returns the paths written.
    `made` remembers the folders this process already made, so each is created (or checked) once. A
    file that `recycled` lists is left alone when its bytes are the same, and otherwise replaced by a new
    file (written aside, renamed over it): it may be a hard link to the published site, which a build
    never changes."""
    made = set() if made is None else made
    written = []
    for rel, content in files:
        if recycled is not None and rel in recycled.files:
            with open(root / rel, "rb") as f:
                if f.read() == content:
                    continue
            tmp = root / f"{rel}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(content)
            os.replace(tmp, root / rel)
            written.append(rel)
            continue
        folder = os.path.dirname(rel)
        if folder not in made and (recycled is None or folder not in recycled.folders):
            os.makedirs(root / folder, exist_ok=True)  # exist_ok: another worker may make it first
            made.add(folder)
        with open(root / rel, "wb") as f:
            f.write(content)
        written.append(rel)
    return written


def _run_span(span: tuple[int, int]) -> list[Any]:
    """Worker side: run the build's task on every index of one span."""
    if _TASK is None:  # only if a worker was started some other way than by `Workers`
        raise RuntimeError("no site build task in this worker")
    return [_TASK(i) for i in range(*span)]


def _spans(n: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, n)) for start in range(0, n, size)]


class Workers:
    """`jobs` forked processes (or this one process when `jobs` is 1) that run a task per index.

    Use as a context manager: `map_indices` returns the task's results in index order, so a build is
    deterministic however the work was spread; `map` runs a picklable function over picklable items
    (used to remove the previous site in parallel). The pool forks once, on first use, after the
    caller set everything the workers read."""

    def __init__(self, jobs: int) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be at least 1, not {jobs}")
        self.jobs = jobs
        self._pool: Any = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            if exc[0] is None:
                self._pool.close()
            else:
                self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _started(self) -> Any:
        if self._pool is None:
            self._pool = multiprocessing.get_context("fork").Pool(self.jobs)
        return self._pool

    def map_indices(self, task: Callable[[int], _R], n: int) -> list[_R]:
        """`[task(i) for i in range(n)]`, spread over the workers in spans of `_CHUNK_PAGES`."""
        global _TASK
        if self.jobs == 1:
            return [task(i) for i in range(n)]
        if self._pool is not None:  # its workers were forked before this task existed
            raise RuntimeError("Workers.map_indices runs once per pool")
        _TASK = task
        try:
            # The pool forks here, so the task (and all it closes over) is what the workers inherit.
            chunks = self._started().map(_run_span, _spans(n, _CHUNK_PAGES), chunksize=1)
        finally:
            _TASK = None
        return [r for chunk in chunks for r in chunk]

    def map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        if self.jobs == 1 or self._pool is None:  # never fork just for this: run it here
            return [fn(item) for item in items]
        return self._started().map(fn, items, chunksize=max(1, len(items) // (4 * self.jobs)))


def new_folder(out_dir: Path) -> Path:
    """A fresh, world-readable folder beside `out_dir` to build the next site in (same filesystem, so
    `swap_in` is a rename)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.new.", dir=out_dir.parent))
    new.chmod(0o755)  # mkdtemp makes 0700; a published site must be world-readable
    return new


@dataclass(frozen=True)
class Spare:
    """The spare copy of the published site, taken over as the next build's folder: the build replaces
    only the files whose bytes change, instead of creating thirty thousand new files and deleting as many.

    The spare's files are hard links to the published site's (`mirror_spare`), so it costs folders, not a
    second copy of the site; a page whose inputs did not change is not even rendered when its file here
    is the published file itself (`files` maps each path to its inode). On ext4 without a journal (this
    machine's disk) creating a file right after many were deleted is slow: the inode allocator skips every
    inode freed in the last minutes, one by one, so a build that followed the previous build's removal
    spent most of its time in the kernel. Paths are relative, '/'-separated; `folders` includes '' (the
    root)."""

    files: Mapping[str, int]
    folders: frozenset[str]


def _spare_path(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.spare"


def adopt_spare(out_dir: Path, marker: str) -> tuple[Path, Spare] | None:
    """Rename the spare copy `swap_in(keep_spare=True)` left beside `out_dir` into a fresh build folder and
    list what it holds; None when there is none. Only a previous site (it holds `marker`) is taken; any
    other spare is removed. Entries that are neither files nor folders (links) are removed."""
    spare = _spare_path(out_dir)
    if spare.is_symlink() or not spare.is_dir():
        return None
    if not (spare / marker).is_file():
        shutil.rmtree(spare, ignore_errors=True)
        return None
    new = new_folder(out_dir)
    os.rename(spare, new)  # replaces the empty fresh folder: its unique name, the spare's inodes
    files: dict[str, int] = {}
    folders = {""}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(new / rel) as entries:
            for e in entries:
                name = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    folders.add(name)
                    stack.append(name)
                elif e.is_file(follow_symlinks=False):
                    files[name] = e.inode()
                else:
                    os.unlink(e.path)
    return new, Spare(files, frozenset(folders))


def clear_stale(root: Path, spare: Spare, wanted: Iterable[str]) -> tuple[Spare, list[str]]:
    """Remove what the adopted spare holds that the next site does not (files it will not write, folders
    nothing lands in); returns what stays, for `write_files` to rewrite, and what was removed."""
    wanted = set(wanted)
    needed = {""}
    for rel in wanted:
        while (rel := os.path.dirname(rel)) not in needed:
            needed.add(rel)
    removed = []
    for rel in sorted(spare.folders - needed, key=len):
        if os.path.isdir(root / rel):  # not removed with a folder above it
            shutil.rmtree(root / rel)
            removed.append(rel)
    kept = {rel: ino for rel, ino in spare.files.items() if rel in wanted}
    for rel in spare.files.keys() - wanted:
        if os.path.dirname(rel) in needed:
            os.unlink(root / rel)
            removed.append(rel)
    return Spare(kept, frozenset(spare.folders & needed)), removed


def mirror_spare(out_dir: Path, written: Iterable[str] | None, removed: Iterable[str] = ()) -> None:
    """Make the spare beside `out_dir` hold the published site as hard links, after `swap_in` made the
    previous site the spare: each file of `written` (this build's new files; None: every file) is linked
    in over the old one, and what `removed` names goes. With no spare (a first build) the spare is made,
    folders and links. Links cost no file data, so the site and its spare take one copy of the bytes.

    Best effort: the next build trusts a spare file only where it is the published file itself (the
    same inode, `_Build.plan_writes`), so a mirror left half done costs renders, never a wrong page; on an
    error the spare is dropped."""
    spare = _spare_path(out_dir)
    try:
        if not spare.is_dir() or spare.is_symlink():
            tmp = new_folder(out_dir)
            _link_files(out_dir, tmp, _walk_files(out_dir))
            os.rename(tmp, spare)
            return
        for rel in removed:
            target = spare / rel
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()
        _link_files(out_dir, spare, _walk_files(out_dir) if written is None else written)
    except OSError:
        shutil.rmtree(spare, ignore_errors=True)


def _walk_files(root: Path) -> list[str]:
    files, stack = [], [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel) as entries:
            for e in entries:
                name = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    stack.append(name)
                elif e.is_file(follow_symlinks=False):
                    files.append(name)
    return files


def _link_files(src: Path, dst: Path, files: Iterable[str]) -> None:
    """Hard-link each file of `src` into `dst`, over whatever is there (a folder in the way goes)."""
    made: set[str] = set()
    for rel in files:
        folder = os.path.dirname(rel)
        if folder not in made:
            os.makedirs(dst / folder, exist_ok=True)
            made.add(folder)
        tmp = dst / f"{rel}.{os.getpid()}.link"
        os.link(src / rel, tmp)
        try:
            os.replace(tmp, dst / rel)
        except IsADirectoryError:
            shutil.rmtree(dst / rel)
            os.replace(tmp, dst / rel)


def _subfolders(root: Path, depth: int) -> Iterator[str]:
    """Folders exactly `depth` levels below `root` (the run folders sit at depth 2: runs/<gpu>/<run>)."""
    level = [str(root)]
    for _ in range(depth):
        level = [e.path for folder in level for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    yield from level


def _remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the platform or
    the filesystem cannot, so the caller falls back to two renames."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(new: Path, out_dir: Path, workers: Workers, *, keep_spare: bool = False) -> None:
    """Move the finished site to `out_dir` in one rename; the previous one is renamed aside first. With
    `keep_spare` (large sites) it stays beside `out_dir` as the spare the next build rewrites in place
    (`adopt_spare`). Otherwise it is removed once the new one is in place, its run folders split over
    `workers`; `sweep` removes what an interrupted removal left."""
    if not out_dir.exists():
        os.rename(new, out_dir)
        return
    spare = _spare_path(out_dir)
    if keep_spare:
        if os.path.lexists(spare):  # not taken over by this build (adopt_spare found none or another)
            shutil.rmtree(spare, ignore_errors=True)
        if _exchange(new, out_dir):  # `new` now holds the previous site
            os.rename(new, spare)
            return
        os.rename(out_dir, spare)
        try:
            os.rename(new, out_dir)
        except BaseException:
            os.rename(spare, out_dir)
            raise
        return
    old = Path(tempfile.mkdtemp(prefix=_old_prefix(out_dir), dir=out_dir.parent))
    if _exchange(new, out_dir):  # `new` now holds the previous site; a kill here leaves it for `sweep`
        os.rename(new, old / "site")
    else:
        os.rename(out_dir, old / "site")
        try:
            os.rename(new, out_dir)
        except BaseException:
            os.rename(old / "site", out_dir)
            shutil.rmtree(old, ignore_errors=True)
            raise
    try:
        workers.map(_remove, sorted(_subfolders(old / "site", 2)))
    finally:
        shutil.rmtree(old, ignore_errors=True)


def discard(new: Path, out_dir: Path, marker: str, *, keep_spare: bool = False) -> None:
    """After a failed build: with `keep_spare`, a folder that holds `marker` (an adopted spare) becomes the
    spare again, so the next build still rewrites it in place; any other is removed."""
    spare = _spare_path(out_dir)
    if keep_spare and (new / marker).is_file() and not os.path.lexists(spare):
        os.rename(new, spare)
    else:
        shutil.rmtree(new, ignore_errors=True)


def _old_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.old."


#: A build folder (`new_folder`) untouched this long was left by a killed build, not one still running.
_NEW_MAX_AGE_S = 3600


def sweep(out_dir: Path, min_age_s: float = 600) -> None:
    """Remove previous sites beside `out_dir` whose removal did not finish (the machine stopped, the
    process was killed). One renamed aside less than `min_age_s` ago is left alone: another build's
    removal of it is most likely still running. Build folders a killed build left (`.<out>.new.*`,
    untouched for an hour) go too."""
    if not out_dir.parent.is_dir():
        return
    now = time.time()
    for prefix, age in ((_old_prefix(out_dir), min_age_s), (f".{out_dir.name}.new.", max(min_age_s, _NEW_MAX_AGE_S))):
        for leftover in out_dir.parent.glob(prefix + "*"):
            try:
                stale = leftover.stat().st_mtime < now - age
            except FileNotFoundError:  # its removal just finished
                continue
            if stale and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)

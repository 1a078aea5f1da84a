"""Compile submissions' Triton kernels for the grading GPU on any CPU host, ahead of the GPU.

A GPU is lent in calls of minutes, and some kernels compile for longer than that: MiniMax-M3's 07 of
2026-06-18 unrolls 32 `tl.dot` groups, and Triton took 158 s and 368 s for two of its shapes on the
H200's host, past the prebuild's warm call (240 s then; `settings.PREBUILD_WARM_CALL_S`) and the call. Triton
compiles for a target it is told, with no GPU (`triton_compile_only.py`), so those kernels can compile
here, for as long as they take, into the per-solution caches the grader uses (`sandbox.cache_dir`,
keyed by the solution's hash), and be carried to the GPU host as one archive of their `triton/`
folders: `kernelboard eval compile-ahead … --out triton-ahead.tgz` here, then on the GPU host
`tar -C ~/.cache/kernelboard -xzf triton-ahead.tgz` before `kernelboard eval` (`bench/gpu_session.sh`
does it with `TRITON_AHEAD=`). Each grading's log then counts those variants among the ones "found
built before", and 0 "built while grading" where the cache keys matched.

Only Triton's cache travels: a torch extension built here would be built against this host's torch,
which need not be the grader's, so the prebuild here refuses torch's JIT builds (`prebuild.py`
`no-extensions`) and an import that builds one stops there. The prebuild is the grader's own, in the
grader's sandbox: the same import, the same warm call on meta tensors, only a longer limit. A
grading's `grade_seconds` counts the prebuild it ran on the GPU host, so a kernel compiled here is
graded faster than its compile: the session that carries an archive says which runs it covered.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kernelboard.errors import UsageError

from .deck import load_deck
from .jail import Jail, make_jail
from .sandbox import built_kernels, cache_dir, finish_prebuild
from .schedule import EvalOptions, prebuild_copy, select_submissions
from .submission import Submission
from .triton_compile_only import Compiled


@dataclass(frozen=True)
class Ahead:
    """What compiling one submission ahead gave: the variants in its cache, and its prebuild's own words."""

    run_id: str
    cache_key: str
    variants: int
    seconds: float  # its prebuild's wall time
    said: str


def has_triton(sub: Submission) -> bool:
    """Does any Python file of the submission define a Triton kernel?"""
    return any(re.search(r"triton\.(jit|autotune)", p.read_text(errors="replace")) for p in sub.folder.rglob("*.py"))


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """These environment variables for the block, restored after: the grader's helpers read them
    (`sandbox.cache_dir` KERNELBOARD_CACHE; `worker_env` keeps a TORCH_CUDA_ARCH_LIST already set)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_ahead(deck: Path, submissions: Path, out: Path, only: tuple[str, ...] = (),
                  exclude: tuple[str, ...] = (), arch: str = "9.0", jobs: int = 2, limit_s: float = 1800.0,
                  console: Console | None = None) -> list[Ahead]:
    """Compile the Triton kernels of the selected submissions (those with any) for `arch`, `jobs` at a
    time, each prebuild's warm call given `limit_s`, and write their `triton/` caches to the archive
    `out` (written whole, or not at all); returns one `Ahead` per submission compiled."""
    console = console or Console(stderr=True)
    opts = EvalOptions(deck=deck, submissions=submissions, out=out.parent, only=only, exclude=exclude)
    problems = load_deck(deck)
    chosen = [s for s in select_submissions(opts, set(problems)) if s.has_solution and not s.solution_is_empty]
    subs = [s for s in chosen if has_triton(s)]
    console.print(f"{len(subs)} of {len(chosen)} selected submissions define Triton kernels; compiling them for "
                  f"sm_{arch.replace('.', '')}, {jobs} at a time, up to {limit_s:.0f} s each …")
    try:
        cell = make_jail(sandboxed=True, device="cpu", hide=[deck.resolve(), submissions.resolve()])
    except RuntimeError:
        raise UsageError("compile-ahead runs candidate code in the grader's bubblewrap sandbox, and no usable "
                         "bubblewrap was found (install it, e.g. `apt-get install bubblewrap`)") from None
    done: list[Ahead] = []
    with tempfile.TemporaryDirectory(prefix="kernelboard-ahead-") as tmp, \
            _environment(KERNELBOARD_CACHE=str(Path(tmp) / "cache"), TORCH_CUDA_ARCH_LIST=arch):
        scratch = Path(tmp)
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(_compile_one, s, problems[s.problem].folder.resolve(), scratch, arch, limit_s,
                                   cell): s for s in subs}
            for future in concurrent.futures.as_completed(futures):
                ahead = future.result()
                done.append(ahead)
                console.print(f"  {ahead.run_id}: {ahead.variants} variants in its cache after {ahead.seconds:.0f} s "
                              f"— {ahead.said}", markup=False, highlight=False)
        _write_archive(out, [cache_dir(a.cache_key) for a in sorted(done, key=lambda a: a.run_id) if a.variants])
    total = sum(a.variants for a in done)
    console.print(f"{total} Triton kernel variants of {sum(1 for a in done if a.variants)} submissions → {out}")
    return sorted(done, key=lambda a: a.run_id)


def _compile_one(sub: Submission, problem_dir: Path, scratch: Path, arch: str, limit_s: float, cell: Jail) -> Ahead:
    logs, key = scratch / "logs", sub.cache_key()
    seconds = finish_prebuild(prebuild_copy(sub, problem_dir, scratch, logs, arch, cell, limit_s, extensions=False),
                              limit_s + 60)
    said = [line for line in (logs / f"{sub.run_id}.prebuild.log").read_text(errors="replace").splitlines()
            if line.startswith("[prebuild]")]
    summary = next((line for line in said if Compiled.SUMMARY.search(line)), None)
    for other in ("torch_extensions", "cuda"):  # never carried: built against this host's torch, if at all
        shutil.rmtree(cache_dir(key) / other, ignore_errors=True)
    cubins, _ = built_kernels(key)
    return Ahead(sub.run_id, key, len(cubins), round(seconds, 1), summary or (said[-1] if said else "no prebuild line"))


def _write_archive(out: Path, caches: list[Path]) -> None:
    """A .tgz of each cache's `triton/` folder, under its key (`<sha>/triton/…`), as the grader's
    cache root holds it; written beside `out` and renamed over it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.part")
    with tarfile.open(part, "w:gz") as tar:
        for cache in caches:
            triton = cache / "triton"
            if triton.is_dir():
                tar.add(triton, arcname=f"{cache.name}/triton")
    os.replace(part, out)

"""Compile submissions' Triton kernels for the grading GPU on any CPU host, ahead of the GPU.

A GPU is lent in calls of minutes, and some kernels compile for longer than that: MiniMax-M3's 07 of
2026-06-18 unrolls 32 `tl.dot` groups, and Triton took 158 s and 368 s for two of its shapes on the
H200's host, past the prebuild's warm call (240 s then; `settings.PREBUILD_WARM_CALL_S`) and the call. Triton
compiles for a target it is told, with no GPU (`triton_compile_only.py`), so those kernels can compile
here, for as long as they take, into the per-solution caches the grader uses (`sandbox.cache_dir`,
keyed by the solution's hash), and be carried to the GPU host as one archive of their `triton/`
folders: `kernelboard eval compile-ahead … --out triton-ahead.tgz` here, then on the GPU host
`kernelboard eval unpack-ahead triton-ahead.tgz` before `kernelboard eval` (`bench/gpu_session.sh`
does it with `TRITON_AHEAD=`). Each grading's log then counts those variants among the ones "found
built before", and 0 "built while grading" where the cache keys matched.

Triton finds a variant only under its cache key, and the key hashes Triton's own files, its compiled
`libtriton` included: a CPython 3.11 build of the same Triton release keys differently from the 3.12 one
(an archive made here with Python 3.11 was found by none of the H100 host's 3.12 gradings). The archive
therefore carries `triton-ahead.json`, the fingerprint of the Triton that compiled it (`fingerprint`), and
`kernelboard eval check-ahead ARCHIVE` on the GPU host says whether its keys can match there, and if not,
which part differs; compile-ahead must run under the grading host's Python ABI and Triton build
(`bench/ahead_env.sh` makes one: pyenv's CPython 3.12 with PyPI's triton 3.6.0 fingerprinted exactly as the
H200 image's Triton did on 2026-12-07).

An archive is unpacked with `kernelboard eval unpack-ahead` (`unpack_archive`), never with tar alone: Triton
finds a cached variant through its group file, whose paths are absolute, the folder it was compiled in, so
every archive made here before 2026-12-07 was found by no grading (its variants compiled again on the GPU
host, for MiniMax-M3 07 215424 through three whole H100 calls); unpack-ahead points them at their new folder,
and the same prebuild here then found all 5 of that kernel's variants in 0.4 s where compiling them took 594 s.

Only Triton's cache travels: a torch extension built here would be built against this host's torch,
which need not be the grader's, so the prebuild here refuses torch's JIT builds (`prebuild.py`
`no-extensions`) and an import that builds one stops there. The prebuild is the grader's own, in the
grader's sandbox: the same import, the same warm call on meta tensors, only a longer limit. A
grading's `grade_seconds` counts the prebuild it ran on the GPU host, so a kernel compiled here is
graded faster than its compile: the session that carries an archive says which runs it covered.

Compiled ahead on the GPU host itself: a call cut off in a long compile leaves the variants Triton finished in
that host's cache, and the next call starts on a fresh host. `kernelboard eval keep-ahead` archives them, the
Triton caches of the runs a results folder records as interrupted (`interrupted.json`), in the same form
with the same manifest, so the next call unpacks them and its compile goes on where the last one stopped
(`bench/gpu_session.sh` writes `triton-kept.tgz` beside its results). Its fingerprint is the GPU image's own,
so it matches there whatever Python this host runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kernelboard.errors import UsageError

from .deck import load_deck
from .interrupted import read_records
from .jail import Jail, make_jail
from .prebuild import grading_capability
from .sandbox import built_kernels, cache_dir, finish_prebuild
from .schedule import EvalOptions, prebuild_copy, select_submissions
from .submission import Submission, discover
from .triton_compile_only import Compiled


@dataclass(frozen=True)
class Ahead:
    """What compiling one submission ahead gave: the variants in its cache, and its prebuild's own words."""

    run_id: str
    cache_key: str
    variants: int
    seconds: float  # its prebuild's wall time
    said: str


MANIFEST = "triton-ahead.json"  # at the archive's root, beside the `<sha>/triton/` folders

# What Triton's cache key is made of, on this host, for a target (`compiler.compile`, `runtime/cache.py`): the
# hash of its own files and libtriton (`triton_key`), the backend's (ptxas' version and the arch) and the
# environment variables that invalidate its cache. Run in a child so this process imports no Triton.
_FINGERPRINT = """
import hashlib, json, sys
import triton
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.cache import triton_key
def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()
backend = CUDABackend(GPUTarget("cuda", int(sys.argv[1]), 32)).hash()
print(json.dumps({"triton": triton.__version__, "python": "cp%d%d" % sys.version_info[:2],
                  "triton_key": sha(triton_key()), "backend": sha(backend),
                  "env": sha(str(sorted(get_cache_invalidating_env_vars().items())))}))
"""


def fingerprint(arch: str, python: str = sys.executable) -> dict[str, str]:
    """The parts of Triton's cache key that do not depend on the kernel, as `python`'s Triton makes them for
    `arch` (TORCH_CUDA_ARCH_LIST form): two hosts whose fingerprints are equal key a kernel alike."""
    capability = grading_capability(arch)
    if capability is None:
        raise UsageError(f"--arch {arch!r}: expected one arch in TORCH_CUDA_ARCH_LIST form, e.g. 9.0")
    proc = subprocess.run([python, "-c", _FINGERPRINT, f"{capability[0]}{capability[1]}"], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"Triton's cache-key fingerprint could not be taken with {python}: {said}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fingerprint_differences(theirs: dict[str, str], ours: dict[str, str]) -> list[str]:
    """What makes an archive's cache keys differ from this host's, in words (none: they can match)."""
    names = {"triton": "Triton release", "python": "Python ABI", "triton_key": "Triton's own files (libtriton)",
             "backend": "ptxas or arch", "env": "cache-invalidating TRITON_* variables"}
    return [f"{label}: {theirs.get(part, '?')[:16]} there, {ours.get(part, '?')[:16]} here"
            for part, label in names.items() if theirs.get(part) != ours.get(part)]


def check_archive(archive: Path, python: str = sys.executable) -> tuple[int, list[str]]:
    """(variants in `archive`, what keeps its cache keys from matching this host's Triton: [] if nothing)."""
    try:
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            variants = sum(1 for name in names if name.endswith(".cubin"))
            member = tar.extractfile(MANIFEST) if MANIFEST in names else None
            manifest = json.load(member) if member is not None else None
    except (OSError, tarfile.TarError, json.JSONDecodeError) as exc:
        raise UsageError(f"{archive}: not a compile-ahead archive ({exc})") from None
    if manifest is None:
        return variants, [f"no {MANIFEST}: made before archives said which Triton compiled them"]
    if not (isinstance(manifest, dict) and isinstance(manifest.get("fingerprint"), dict)
            and isinstance(manifest.get("arch"), str)):
        raise UsageError(f"{archive}: its {MANIFEST} has no 'arch' and 'fingerprint' (expected compile-ahead's)")
    return variants, fingerprint_differences(manifest["fingerprint"], fingerprint(manifest["arch"], python))


GROUP_PREFIX = "__grp__"  # Triton's cache: a variant's group file, naming its files by absolute path


def unpack_archive(archive: Path, cache_root: Path) -> tuple[int, int]:
    """Unpack a compile-ahead or keep-ahead `archive` into the grader's cache root and point each variant's
    group file at the files beside it; returns (variants, solutions).

    Why the second step: Triton finds a cached variant through its group file (`__grp__<kernel>.json`), whose
    `child_paths` are the absolute paths the files had where they were compiled, and it takes a variant as
    cached only where its metadata file exists at that path (`FileCacheManager.get_group`). An archive made
    here under a temporary cache root (`compile-ahead`) so named folders that exist on no GPU host, and no
    grading found its variants, however well their keys matched: MiniMax-M3 07 215424's prebuild compiled
    its prefill kernels again beside three H100 calls on 2026-12-07 with the archive unpacked, and did so
    here too until the group files were pointed at their folder."""
    cache_root.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name != MANIFEST]
            tar.extractall(cache_root, members=members, filter="data")
    except (OSError, tarfile.TarError) as exc:
        raise UsageError(f"{archive}: cannot unpack into {cache_root} ({exc})") from None
    folders = {Path(m.name).parent for m in members if m.isfile() and Path(m.name).name.startswith(GROUP_PREFIX)}
    for folder in sorted(folders):
        for group in (cache_root / folder).glob(f"{GROUP_PREFIX}*.json"):
            data = json.loads(group.read_text())
            data["child_paths"] = {name: str(group.parent / name) for name in data.get("child_paths", {})}
            group.write_text(json.dumps(data))
    return len(folders), len({Path(m.name).parts[0] for m in members if len(Path(m.name).parts) > 1})


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
        manifest = {"arch": arch, "fingerprint": fingerprint(arch),
                    "runs": {a.run_id: a.cache_key for a in sorted(done, key=lambda a: a.run_id) if a.variants}}
        parts = _write_archive(out, [cache_dir(key) for key in manifest["runs"].values()], manifest)
    total = sum(a.variants for a in done)
    console.print(f"{total} Triton kernel variants of {sum(1 for a in done if a.variants)} submissions → "
                  f"{describe_parts(parts)}")
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


def interrupted_runs(results: Path) -> set[str]:
    """The runs a results folder records as cut off by a call (every GPU's `interrupted.json`): the ones whose
    compile may outlast a call. A file that cannot be read is no record."""
    return {run_id for gpu in (p.name for p in results.iterdir() if p.is_dir())
            for run_id in read_records(results, gpu)[0]}


def keep_ahead(results: Path, submissions: Path, out: Path, arch: str,
               run_ids: tuple[str, ...] = ()) -> tuple[int, int, list[Path]]:
    """Archive this host's Triton caches of the runs `results` records as interrupted (every GPU's
    `interrupted.json`) and of `run_ids`, as compile-ahead's archive for `arch`, to `out` and the parts beside
    it (`_write_archive`: written whole, or not at all when no variant is cached); returns (variants, runs,
    parts) archived."""
    wanted = set(run_ids) | interrupted_runs(results)
    found, _ = discover(submissions)
    cubins = {sub.run_id: (sub.cache_key(), len(built_kernels(sub.cache_key())[0]))
              for sub in sorted(found, key=lambda sub: sub.run_id) if sub.run_id in wanted}
    cached = {run_id: key for run_id, (key, count) in cubins.items() if count}
    parts = _write_archive(out, [cache_dir(key) for key in cached.values()],
                           {"arch": arch, "fingerprint": fingerprint(arch), "runs": cached}) if cached else []
    return sum(count for _, count in cubins.values()), len(cached), parts


#: What a cache hit needs of a Triton variant (`compiler.compile` → `CompiledKernel`): its metadata `.json`, the
#: group file naming its files, and the binary it launches (`.cubin`); the IRs it was lowered through are read
#: by nobody once it is compiled. They are most of a variant's bytes, so the archives leave them out.
INTERMEDIATE_SUFFIXES = frozenset({".source", ".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn"})
#: The most bytes one archive part holds (a GPU call returns files of at most 16 MiB: deepseek-v4-pro 02 125550's
#: 1,081 variants kept whole did not come back).
ARCHIVE_PART_BYTES = 14 << 20


def archive_parts(out: Path) -> list[Path]:
    """`out` and the further parts `_write_archive` wrote beside it (`triton-kept.2.tgz`, …), as far as they go
    on without a gap."""
    parts, n = [], 1
    while (part := out if n == 1 else out.with_name(f"{out.name.removesuffix('.tgz')}.{n}.tgz")).exists():
        parts.append(part)
        n += 1
    return parts


def _write_archive(out: Path, caches: list[Path], manifest: dict[str, object],
                   part_bytes: int = ARCHIVE_PART_BYTES) -> list[Path]:
    """.tgz archives of each cache's `triton/` variants, under its key (`<sha>/triton/<variant>/…`) as the
    grader's cache root holds them, without their intermediate IRs (INTERMEDIATE_SUFFIXES), each beginning
    with the manifest (MANIFEST): `out`, then `<stem>.2.tgz`, … wherever one would pass `part_bytes`
    (a variant is never split). Each is written beside its name and renamed over it once all are written;
    parts an earlier, larger archive left are removed. Returns the parts written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(manifest, indent=1).encode()
    stem = out.name.removesuffix(".tgz")
    names: list[Path] = []
    tar: tarfile.TarFile | None = None

    def begin() -> tarfile.TarFile:
        names.append(out if not names else out.with_name(f"{stem}.{len(names) + 1}.tgz"))
        opened = tarfile.open(names[-1].with_name(f".{names[-1].name}.part"), "w:gz")  # noqa: SIM115 (closed below)
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(text)
        opened.addfile(info, io.BytesIO(text))
        return opened

    def kept(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if info.isfile() and Path(info.name).suffix in INTERMEDIATE_SUFFIXES else info

    try:
        tar = begin()
        for cache in caches:
            triton = cache / "triton"
            for variant in sorted(triton.iterdir()) if triton.is_dir() else []:
                if _written(names[-1]) >= part_bytes:
                    tar.close()
                    tar = begin()
                tar.add(variant, arcname=f"{cache.name}/triton/{variant.name}", filter=kept)
        tar.close()
        tar = None
        for name in names:
            os.replace(name.with_name(f".{name.name}.part"), name)
    finally:
        if tar is not None:
            tar.close()
        for name in names:
            name.with_name(f".{name.name}.part").unlink(missing_ok=True)
    for stale in archive_parts(out)[len(names):]:
        stale.unlink()
    return names


def describe_parts(parts: list[Path]) -> str:
    """The archive's name, and its further parts' where it has some."""
    more = f" (+ {', '.join(p.name for p in parts[1:])}, each a part to unpack)" if len(parts) > 1 else ""
    return f"{parts[0]}{more}"


def _written(name: Path) -> int:
    """Bytes of the part being written (its compressed stream, as far as it has reached the disk)."""
    try:
        return name.with_name(f".{name.name}.part").stat().st_size
    except OSError:
        return 0

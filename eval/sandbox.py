"""Running worker processes (parent side, no torch): isolation, caches, timeouts, the GPU lock.

Each worker is `kernelboard.eval.worker JOB` in its own session and process group and working
directory (a scratch copy of the submission), with torch-extension and Triton caches keyed by the
solution's hash: forked from this process's zygote (zygote.py: a process that imported torch and the
judge once), or, where there is none, a fresh `python -m kernelboard.eval.worker JOB`. The worker
names its phase in a file beside its job; a phase that runs past its budget, or a worker past the
total budget, has its whole process group killed. The job names the budgets too, so the worker (the
judge) enforces them first on the runner it drives.

`PYTHONSAFEPATH` keeps the working directory off `sys.path` (the zygote runs with it, and drops the
working directory from a forked judge's path besides): without it, a submission that ships `yaml.py`
or a `kernelboard/` folder would replace the judge's own modules before it starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from kernelboard.errors import KernelboardError, UsageError

from . import jail, proctree, zygote
from .cutlass_headers import find_cutlass
from .jail import Jail
from .job import Job
from .locks import hold, lock_dir, open_lock_file
from .prebuild import GRADING_GPU_ENV, NO_EXTENSIONS
from .sandbox_output import OutputPump

_console = Console(stderr=True, soft_wrap=True)  # lines a program may read never break mid-word


@dataclass(frozen=True)
class WorkerOutcome:
    result: dict[str, Any]
    seconds: float
    log_path: Path


def cutlass_line() -> str:
    """What the worker's log says about CUTLASS: which one builds see, or that there is none."""
    found = find_cutlass()
    if found is None:
        return ("[grader] CUTLASS: none (no $KERNELBOARD_CUTLASS / $CUTLASS_PATH, no nvidia-cutlass package): "
                "#include <cutlass/...> only resolves against the submission's own files")
    return f"[grader] CUTLASS: {found.describe()} (on CPATH and CPLUS_INCLUDE_PATH)"


def cache_root() -> Path:
    """Where every solution's compile caches live: $KERNELBOARD_CACHE, else ~/.cache/kernelboard."""
    return Path(os.environ.get("KERNELBOARD_CACHE", Path.home() / ".cache" / "kernelboard"))


def cache_dir(cache_key: str) -> Path:
    """The compile caches of one solution (keyed by its hash): the one folder outside its scratch
    copy that its sandbox may write."""
    return cache_root() / cache_key


def built_kernels(cache_key: str, folder: Path | None = None) -> tuple[frozenset[Path], frozenset[Path]]:
    """The Triton kernel variants (cubins) and torch extensions (shared objects) in one solution's compile
    caches, and in its scratch copy `folder` (a build beside solution.py: `build_directory=` a folder of
    its own): what its worker finds built, and, taken again after it, what the worker built on GPU time."""
    root = cache_dir(cache_key)
    beside = frozenset(folder.rglob("*.so")) if folder is not None else frozenset()
    return (frozenset((root / "triton").rglob("*.cubin")),
            frozenset((root / "torch_extensions").rglob("*.so")) | beside)


def built_line(before: tuple[frozenset[Path], frozenset[Path]], after: tuple[frozenset[Path], frozenset[Path]]) -> str:
    """The log's account of where a grading's builds happened (the prebuild's aim: none during grading)."""
    new = [len(a - b) for a, b in zip(after, before, strict=True)]
    return (f"[grader] built while grading: {new[0]} Triton kernel variants, {new[1]} extensions "
            f"(found built before: {len(before[0])} and {len(before[1])})")


def found_line(cache_key: str) -> str:
    """The prebuild log's first account of its solution's compile caches: what an archive compiled ahead or an
    earlier call left there (an H100 call of 2026-12-07 could not tell whether MiniMax-M3 07 215424's prebuild,
    in a warm call for the whole call, had found the archive it was carried)."""
    triton, extensions = built_kernels(cache_key)
    return (f"[grader] in its compile caches before this prebuild: {len(triton)} Triton kernel variants, "
            f"{len(extensions)} extensions")


def hold_cache(cache_key: str, log: IO[str]) -> int:
    """Join the builders of one solution's compile caches, for as long as the returned descriptor is open
    (a prebuild's life, or a worker's): a shared `flock` on `<cache>.lock` beside the cache folder, where
    the sandbox cannot write. The first to join, with nobody else holding it, first removes torch's
    build batons (`torch_extensions/*/lock`): such a baton was left by a build that was killed (a
    timeout, an interrupt, a device call's end), since every builder holds the lock until it is gone,
    and torch's `FileBaton.wait` would wait for it forever: a 03 kernel's prebuild sat for 6 minutes
    on the H200 behind the baton of its prebuild killed at the end of the call before. Builders that
    overlap (two gradings of one solution) keep torch's own batons between them."""
    cache = cache_dir(cache_key)
    fd = open_lock_file(cache.parent / f"{cache.name}.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # another build of this solution is running: its baton is live
    else:
        for baton in sorted(cache.glob("torch_extensions/*/lock")):
            with contextlib.suppress(OSError):
                baton.unlink()
                log.write(f"[grader] removed {baton}: torch's build lock, left by a build that was killed "
                          "(torch would wait for it forever)\n")
        log.flush()
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


@contextlib.contextmanager
def _holding_cache(cache_key: str, log: IO[str]) -> Iterator[None]:
    fd = hold_cache(cache_key, log)
    try:
        yield
    finally:
        os.close(fd)  # after the build's processes were killed: a baton they left is stale from here


def worker_env(cache_key: str, arch: str | None = None, interpret: bool = False) -> dict[str, str]:
    """The worker's environment: private compile caches, the GPU's arch, CUTLASS headers; with
    `interpret` (grading on the CPU) Triton kernels run in Triton's interpreter, the only way they
    run without a GPU."""
    cache = cache_dir(cache_key)
    env = dict(os.environ)
    env.update(
        TORCH_EXTENSIONS_DIR=str(cache / "torch_extensions"),
        TRITON_CACHE_DIR=str(cache / "triton"),
        CUDA_CACHE_PATH=str(cache / "cuda"),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        PYTHONSAFEPATH="1",
    )
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if arch and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    cutlass = find_cutlass()
    if cutlass is not None:  # first on the include path of gcc, and so of nvcc and load_inline / load
        env["CUTLASS_PATH"] = str(cutlass.root)
        for var in ("CPATH", "CPLUS_INCLUDE_PATH"):
            env[var] = os.pathsep.join([*map(str, cutlass.includes), *filter(None, [os.environ.get(var)])])
    return env


def _kill_group(proc: subprocess.Popen[bytes] | zygote.Forked) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    if isinstance(proc, zygote.Forked):
        proc.close()


def _read_phase(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A file the grader cannot write (a full disk, a read-only folder) is one line naming it."""
    try:
        yield
    except OSError as exc:
        raise KernelboardError(f"{path}: cannot write ({exc.strerror or exc})") from None


#: How often `run_worker` reads the worker's phase: the builds beside a grading pause once it reads "timing"
#: (schedule.BuildQueue.quiet), so this bounds how far into a timing phase (its warm-up: 100 ms on a GPU) they run.
PHASE_POLL_S = 0.05


def run_worker(job: Job, workdir: Path, log_path: Path, timeout_s: float, cache_key: str,
               phase_timeouts: Mapping[str, float] | None = None, arch: str | None = None,
               on_phase: Callable[[str], None] | None = None, log_header: str | None = None) -> WorkerOutcome:
    """Run one worker job; a crash, a hang or a missing result becomes a status, never a raise.

    With `log_header` the log is appended to, after that line, instead of replaced: a table whose
    rows accumulate over several runs (baselines) keeps the log of every run that wrote one.
    """
    result_path = workdir.parent / f"{workdir.name}.result.json"
    phase_path = workdir.parent / f"{workdir.name}.phase"
    limits = dict(phase_timeouts or {})
    job = replace(job, result_path=result_path, phase_path=phase_path, phase_timeouts_s=limits,
                  timeout_s=timeout_s, started_unix=time.time(), caches=(str(cache_dir(cache_key)),))
    job_path = workdir.parent / f"{workdir.name}.job.json"
    with _writing(job_path):
        job_path.write_text(job.to_json())
    with _writing(log_path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a" if log_header else "w")  # noqa: SIM115 (closed by the with below)
        if log_header:
            log.write(f"{log_header}\n")
        if job.kind == "grade":
            log.write(f"{cutlass_line()}\n")
        log.flush()
    start = time.perf_counter()
    phase, phase_start = None, start
    built = built_kernels(cache_key, workdir) if job.kind == "grade" else None
    with log, _holding_cache(cache_key, log):
        env = worker_env(cache_key, arch, interpret=job.device == "cpu")
        proc: subprocess.Popen[bytes] | zygote.Forked | None = zygote.fork_worker([str(job_path)], workdir, env, log)
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-m", "kernelboard.eval.worker", str(job_path)], cwd=workdir,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=PHASE_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.perf_counter()
                seen = _read_phase(phase_path)
                if seen != phase:
                    phase, phase_start = seen, now
                    if on_phase is not None and phase:
                        on_phase(phase)
                limit = limits.get(phase or "")
                if limit is not None and now - phase_start > limit:
                    return WorkerOutcome({"status": "timeout", "phase": phase,
                                          "message": f"phase '{phase}' ran past its {limit:.0f} s budget"},
                                         now - start, log_path)
                if now - start > timeout_s:
                    return WorkerOutcome({"status": "timeout", "phase": phase,
                                          "message": f"killed after {timeout_s:.0f} s (in phase '{phase}')"},
                                         now - start, log_path)
        finally:
            _kill_group(proc)  # on every path: children it left behind (compilers, helpers) go too
            if built is not None:
                log.write(f"{built_line(built, built_kernels(cache_key, workdir))}\n")
    seconds = time.perf_counter() - start
    if rc is None and not result_path.exists():  # a forked worker whose zygote died before it reported the exit
        msg = f"the zygote that forked the worker died (in phase '{phase}'); the worker was killed"
        return WorkerOutcome({"status": "not_graded", "message": msg}, seconds, log_path)
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        return WorkerOutcome({"status": "runtime_error", "message": f"the worker died from {name} "
                                                                   f"(in phase '{phase}')"}, seconds, log_path)
    try:
        result = json.loads(result_path.read_text())
    except (OSError, json.JSONDecodeError):
        msg = f"the worker exited with code {rc} without writing a result (a hard exit in candidate code?)"
        return WorkerOutcome({"status": "runtime_error", "message": msg}, seconds, log_path)
    return WorkerOutcome(result, seconds, log_path)


#: How long `finish_prebuild` waits, once the prebuild's group is killed, for its output to end (at once in the
#: sandbox, whose pid namespace dies with it; unsandboxed, a process it left behind may hold the pipe).
PREBUILD_OUTPUT_WAIT_S = 10.0


@dataclass
class Prebuild:
    """A running prebuild and when it started and ended (`time.monotonic`): a watcher thread
    stamps the end as the process exits, so its duration is known even when it finished long
    before the batch reached its submission."""

    proc: subprocess.Popen[bytes]
    started: float
    cache_fd: int  # its share of the solution's compile caches (`hold_cache`), closed by `finish_prebuild`
    ended: float | None = None
    folder: Path | None = None  # the scratch copy it built in (builds beside solution.py stay there)
    output: OutputPump | None = None  # what it prints, on its way into its log (finished by `finish_prebuild`)
    paused_s: float = 0.0  # how long `pause` held it stopped, in all
    paused_at: float | None = None  # when the pause it is in began (None: running)
    stopped: list[int] = field(default_factory=list)  # the processes that pause stopped

    def watch(self) -> Prebuild:
        def stamp() -> None:
            self.proc.wait()
            self.ended = time.monotonic()

        threading.Thread(target=stamp, daemon=True, name="prebuild-watch").start()
        return self

    def pause(self) -> None:
        """Stop the build's whole process tree (SIGSTOP) while the GPU times another submission: a shape
        the host bounds is timed at the host's least dispatch, and that moved 2× between a busy host and a
        quieter one (LongCat-2.0 07 012529's shape 0 floor 0.1126 ms under 0.5.7 in a batch of 07 builds,
        0.0509 ms beside short Triton prebuilds on 2026-12-07). The tree is walked twice, top down, so a process
        forked between the passes is stopped too. Nothing is lost: `resume` lets it go on where it was."""
        if self.paused_at is not None or self.proc.poll() is not None:
            return
        self.paused_at = time.monotonic()
        for _ in range(2):
            for pid in [self.proc.pid, *proctree.descendants(self.proc.pid)]:
                if pid not in self.stopped:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGSTOP)
                        self.stopped.append(pid)

    def resume(self) -> None:
        """Let a paused build go on (SIGCONT to every process `pause` stopped, children first)."""
        if self.paused_at is None:
            return
        for pid in reversed(self.stopped):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()
        self.paused_s += time.monotonic() - self.paused_at
        self.paused_at = None

    def active_s(self, now: float | None = None) -> float:
        """Seconds it had run by `now` (default: now, or its end), less the time it was paused: what its build
        timeout, its grade time and an interrupted run's record count."""
        now = time.monotonic() if now is None else now
        held = self.paused_s + (0.0 if self.paused_at is None else now - self.paused_at)
        return min(self.ended or now, now) - self.started - held


def start_prebuild(problem_path: Path, solution_dir: Path, log_path: Path, cache_key: str,
                   arch: str | None, cell: Jail, warm_call_s: float = 0.0, extensions: bool = True,
                   gpu: dict[str, Any] | None = None) -> Prebuild:
    """Start compiling a solution's extensions on the CPU (see prebuild.py), in the batch's sandbox
    with a private copy of the problem, with a warm call of up to `warm_call_s` (0: none); returns the
    running prebuild. Without `extensions` torch's JIT builds raise and only Triton kernels compile
    (`ahead.py`, on a host other than the grading one). `gpu`, the grading GPU's identity as the probe
    gave it, is what the prebuild's `torch.cuda.get_device_properties` answers. What it prints reaches its
    log through this process's `OutputPump` (sandbox_output.py), as the runner's reaches the judge's log."""
    env = {**worker_env(cache_key, arch), "CUDA_VISIBLE_DEVICES": ""}
    if gpu:
        env[GRADING_GPU_ENV] = json.dumps(gpu)
    problem = jail.problem_copy(problem_path, solution_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(f"{cutlass_line()}\n{found_line(cache_key)}\n")
        log.flush()
        cache_fd = hold_cache(cache_key, log)
        started = time.monotonic()
        try:
            output = OutputPump(log.fileno(), "prebuild", "grader")
            proc = output.launch(jail.start, cell, [sys.executable, "-m", "kernelboard.eval.prebuild", str(problem),
                                                    str(solution_dir), f"{warm_call_s:g}",
                                                    *([] if extensions else [NO_EXTENSIONS])],
                                 writable=[solution_dir, cache_dir(cache_key)],
                                 readable=[jail.problem_root(solution_dir)], cwd=solution_dir, env=env, device="cpu",
                                 owner=cache_key, stdin=subprocess.DEVNULL).proc
        except BaseException:
            os.close(cache_fd)
            raise
    return Prebuild(proc, started, cache_fd, folder=solution_dir, output=output).watch()


def finish_prebuild(prebuild: Prebuild, timeout_s: float) -> float:
    """Let a prebuild finish (up to `timeout_s`), then make sure its whole group is gone and its output is
    in its log; returns its wall time in seconds (start to exit, or to now when it was cut off), less the
    time it was paused while the GPU timed another submission."""
    prebuild.resume()
    with contextlib.suppress(subprocess.TimeoutExpired):
        prebuild.proc.wait(timeout=timeout_s)
    _kill_group(prebuild.proc)
    if prebuild.output is not None:
        prebuild.output.finish(PREBUILD_OUTPUT_WAIT_S)
    with contextlib.suppress(OSError):
        os.close(prebuild.cache_fd)  # after the kill: a baton it left is stale from here
    for _ in range(100):  # the watcher stamps the exit a moment after wait() returns here
        if prebuild.ended is not None:
            break
        time.sleep(0.001)
    return prebuild.active_s()


@contextlib.contextmanager
def gpu_lock(gpu: str) -> Iterator[None]:
    """One grader per device at a time: two `kernelboard eval --device cuda` processes on one GPU queue,
    never overlap. The lock file is `kernelboard-<gpu>-<first visible device>.lock` in `locks.lock_dir()`
    (`KERNELBOARD_LOCK_DIR`, else the temp folder), and a grader that waits says which process it waits
    for. Grading on the CPU takes no such lock: nothing it measures is shared machine-wide."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    path = lock_dir() / f"kernelboard-{gpu}-{visible}.lock"
    with hold(path, f"kernelboard eval grading on {gpu} (device {visible})"):
        yield


def probe_device(device: str) -> dict[str, Any]:
    """Device identity from a short-lived process (`python -m kernelboard.eval.probe`, forked from the
    zygote where there is one), so the parent stays free of torch."""
    with tempfile.TemporaryFile() as said, tempfile.TemporaryDirectory(prefix="kernelboard-probe-") as cwd:
        forked = zygote.fork_worker([device], Path(cwd), worker_env("probe"), None, said, main="probe")
        if forked is None:
            rc = subprocess.run([sys.executable, "-m", "kernelboard.eval.probe", device], stdout=said,
                                stderr=subprocess.STDOUT, timeout=300).returncode
        else:
            try:
                rc = forked.wait(timeout=300)
            finally:
                _kill_group(forked)
        said.seek(0)
        lines = said.read().decode(errors="replace").strip().splitlines()
    if rc != 0:
        last = lines[-1] if lines else rc
        raise UsageError(f"cannot start a worker (is the 'eval' extra, i.e. torch, installed?): {last}")
    env = json.loads(next((line for line in reversed(lines) if line.startswith("{")), lines[-1] if lines else ""))
    if "error" in env:
        raise UsageError(f"--device {device}: {env['error']}; use --device cpu to grade on the CPU")
    return env


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None

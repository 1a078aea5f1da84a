"""The judges' zygote: one process that has imported torch and the judge's modules, and forks a judge per grading.

A judge (`kernelboard.eval.worker`) started as a fresh interpreter spends about 1.8 s of CPU importing torch,
its own modules and pyarrow before it does anything; forked from a process that already imported them it
starts in a few milliseconds. The device probe each batch starts first (`sandbox.probe_device`, torch and
triton imported to name the device) is forked the same way.

The zygote is `python -m kernelboard.eval.zygote FD MODULE…`, started by the grader with the judges'
environment (`sandbox.worker_env` without the variables of `LAZY_ENV`, see below), in `/`, with its stdin on
/dev/null. It imports the modules named, never initialises CUDA and never runs candidate code; the grading
process that starts it imports neither torch nor this module's server half (everything below `serve` imports
lazily), so `kernelboard eval` itself stays free of torch. The sandboxed runner that a judge starts is
unchanged: a separately exec'd `python -m kernelboard.eval.runner` in bubblewrap.

A forked judge is made to look like the fresh one it replaces (`_become_judge`), before any of its code runs:

- its own session and process group (`setsid`), in place before the grader learns its pid, so that
  `sandbox._kill_group` kills it and everything it started;
- stdin on /dev/null, fds 1 and 2 on the grader's own open log file (received over the control socket, so
  appending works exactly as with `Popen(stdout=log, stderr=STDOUT)`; C-level output and subprocesses too);
- its working directory the scratch copy; `os.environ` cleared and replaced by the job's environment;
- SIGINT as an exec from the grader would leave it: ignored where the grader ignores it (a shell without job
  control starts background commands so), else Python's `default_int_handler` (the zygote itself ignores it:
  a Ctrl-C is the grader's to handle);
- `sys.path` without '' or any relative or candidate-controlled folder (the zygote runs with
  `PYTHONSAFEPATH=1` from `/`, and the child drops anything under its working directory besides), so that
  a submission's `numpy.py` or `triton.py` never replaces a module the judge imports later;
- its exit code or death by a signal reported as `Popen.returncode` reports it (the zygote reaps it and
  sends `os.waitstatus_to_exitcode` to the grader); a judge that segfaults or is SIGKILLed is one child of
  the zygote gone, nothing more.

What a fresh interpreter reads of its environment only at start is the zygote's: `PYTHONSAFEPATH`,
`PYTHONDONTWRITEBYTECODE` and `PYTHONUNBUFFERED` (set by `worker_env`), and what torch reads as it loads
(`OMP_NUM_THREADS`, `MKL_NUM_THREADS`: the OpenMP and BLAS thread counts). A zygote therefore serves only
judges whose environment equals its own outside `LAZY_ENV`; the grader starts another when it differs.
`LAZY_ENV` are the variables that differ per job or that torch, Triton, the CUDA driver and the compilers read
when they are used, never at import: they are kept out of the zygote's environment, set in each child, and
the zygote refuses to serve (the grader then starts judges as before) where its imports read one of them or
imported `triton` (whose import reads `TRITON_INTERPRET`). On a GPU the zygote never touches CUDA and checks
before every fork that torch has not initialised it; each judge initialises CUDA itself, after the fork,
with its own `CUDA_VISIBLE_DEVICES`.

Why not `multiprocessing`'s forkserver: each of its children first runs `spawn.prepare`, which re-imports the
grader's `__main__` (the `kernelboard` script, or pytest's), restores the grader's `sys.path` (with '' or the
current folder on it) and working directory; it starts a resource tracker process, and its `Process` gives
neither a session of its own nor fds 1 and 2 on a given file. All of that would have to be undone in the
child; a fork loop of our own (`serve`, one `selectors` loop over the control socket and a pidfd per child)
is shorter than the undoing, and does only what is listed above.

Native threads that numpy's OpenBLAS and pyarrow's jemalloc may start at import live on in the zygote; both
libraries are fork-safe (`pthread_atfork` handlers), as torch's own forked DataLoader workers rely on. The
zygote refuses to fork while a Python thread other than its own runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: What the zygote imports: what a judge imports before it grades (worker.py, then torch, judge.py, link.py).
PRELOAD = ("torch", "kernelboard.eval.worker", "kernelboard.eval.judge", "kernelboard.eval.link")

#: What a forked child may run, by the name the grader sends: the module whose `main(argv)` it calls, as
#: `python -m MODULE ARGV` would. Only these; the judge, and the device probe of `sandbox.probe_device`.
MAINS = {"worker": "kernelboard.eval.worker", "probe": "kernelboard.eval.probe"}

#: Variables read lazily (when a kernel is compiled, Triton runs, CUDA initialises) or set per job by
#: `worker_env`: kept out of the zygote's environment, never read by its imports, set in each judge. Every
#: `TRITON_*` variable counts as one of them. (`TORCHINDUCTOR_CACHE_DIR`: set in the grader's own environment
#: by torch.compile where the grader's process compiles, e.g. a test's; read when a judge compiles a baseline.
#: `PYTEST_CURRENT_TEST`: pytest sets it around every test, and the grader passes its environment on.)
LAZY_ENV = ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "TRITON_INTERPRET", "TORCH_CUDA_ARCH_LIST",
            "CUTLASS_PATH", "CPATH", "CPLUS_INCLUDE_PATH", "CUDA_VISIBLE_DEVICES", "TORCHINDUCTOR_CACHE_DIR",
            "PYTEST_CURRENT_TEST")

#: Modules the zygote must not have imported (their import reads a `LAZY_ENV` variable from C).
UNPRELOADABLE = ("triton",)

START_TIMEOUT_S = 120.0  # importing torch on a cold disk; past it the judges start as fresh interpreters
REPLY_TIMEOUT_S = 30.0  # the zygote answers a fork request at once; past it, it is taken for dead
_MAX_MESSAGE = 1 << 20  # bytes of one request (the environment is most of it)


class ZygoteError(Exception):
    """The zygote could not start, or stopped answering."""


def lazy(name: str) -> bool:
    return name in LAZY_ENV or name.startswith("TRITON_")


def zygote_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a zygote serving judges of environment `env` runs with (and is matched by)."""
    return {k: v for k, v in env.items() if not lazy(k)}


# ------------------------------------------------------------------------------ the grader's side


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether `sock` has something to read (or was closed) within `timeout` seconds (None: wait)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


class Forked:
    """A judge the zygote forked, with what `sandbox.run_worker` uses of a `Popen`: `pid`, `wait` and
    `returncode` (negative: the signal that ended it). `returncode` stays None where the zygote died before
    it could report the exit (`lost`)."""

    def __init__(self, pid: int, status: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.lost = False
        self._status: socket.socket | None = status

    def wait(self, timeout: float | None = None) -> int | None:
        if self._status is not None:
            if not _readable(self._status, timeout):
                raise subprocess.TimeoutExpired(f"judge {self.pid} (forked)", timeout or 0.0)
            try:
                reply = self._status.recv(64).decode()
            except OSError:
                reply = ""
            if reply.startswith("rc "):
                self.returncode = int(reply[3:])
            else:
                self.lost = True
            self.close()
        return self.returncode

    def close(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None


class Zygote:
    """A running zygote (the grader's handle): `fork` starts a judge. Each request carries the job's
    environment, working directory and log file; the zygote answers with the judge's pid on a socket
    of the request's own, and later with its exit code."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.env = zygote_env(env)
        preload = PRELOAD if preload is None else preload
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._said = tempfile.TemporaryFile()  # noqa: SIM115 (the zygote's stdout and stderr: why it did not start)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernelboard.eval.zygote", str(theirs.fileno()), *preload],
                cwd="/", env=self.env, stdin=subprocess.DEVNULL, stdout=self._said, stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),))
        except OSError as exc:
            control.close()
            self._said.close()
            raise ZygoteError(f"cannot start it: {exc}") from None
        finally:
            theirs.close()
        self._control = control
        self._lock = threading.Lock()
        try:
            ready = _readable(control, start_timeout_s)
            reply = json.loads(control.recv(_MAX_MESSAGE) or "{}") if ready else {"error": "no answer in time"}
        except (OSError, ValueError) as exc:
            reply = {"error": str(exc)}
        if "pid" not in reply:
            self._said.seek(0)
            said = self._said.read().decode(errors="replace").strip().splitlines()
            self.close()
            raise ZygoteError(reply.get("error") or (said[-1] if said else f"it exited with {self.proc.returncode}"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], out: int, main: str = "worker") -> Forked:
        """A judge `kernelboard.eval.worker ARGV` (or another of `MAINS`), in `cwd`, with `env` (which must
        match this zygote's outside `LAZY_ENV`) and fds 1 and 2 on the open file `out`."""
        if zygote_env(env) != self.env or main not in MAINS:
            raise ValueError("this zygote was started for another environment, or runs no such main")
        # SIGINT as an exec would leave it: ignored where the grader ignores it (started in the background
        # by a shell without job control), else Python's default handler
        sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        request = json.dumps({"main": main, "argv": list(argv), "cwd": str(cwd), "env": dict(env),
                              "sigint_ignored": sigint_ignored}).encode()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:
                socket.send_fds(self._control, [request], [out, theirs.fileno()])
            theirs.close()
            if not _readable(mine, REPLY_TIMEOUT_S):
                raise ZygoteError("it did not answer a fork request in time")
            reply = mine.recv(256).decode()
        except OSError as exc:
            mine.close()
            raise ZygoteError(f"it stopped answering ({exc})") from None
        finally:
            theirs.close()
        if not reply.startswith("pid "):
            mine.close()
            raise ZygoteError(reply.removeprefix("error ") or "it ended")
        return Forked(int(reply[4:]), mine)

    def close(self) -> None:
        """End the zygote: it exits once the judges it forked have exited (a judge is never cut short)."""
        self._control.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._said.close()


class _Shared:
    """The zygote this process forks its judges from, and why there is none.

    Process-global because a zygote pays for itself only over many gradings: `kernelboard eval` grades
    through several batches and helpers (`schedule.run_eval`, baselines, tests' batches) that share no
    object to hang it on, and one per `run_worker` would import torch once per judge as before. One per
    process, under a lock; replaced when a job's environment no longer matches it, started again when it
    died; ended at exit (it would also end on its own: the closed control socket tells it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.zygote: Zygote | None = None
        self.failed: tuple[dict[str, str], str] | None = None  # (environment, why): not tried again for it
        self.said = False  # the fallback was written into a log once
        self.registered = False  # shutdown is an atexit function

    def get(self, env: Mapping[str, str]) -> Zygote | None:
        wanted = zygote_env(env)
        if self.zygote is not None and (self.zygote.env != wanted or not self.zygote.alive()):
            self.drop()
        if self.zygote is None and (self.failed is None or self.failed[0] != wanted):
            try:
                self.zygote = Zygote(env)
            except ZygoteError as exc:
                self.failed = (wanted, str(exc))
            else:
                self.failed = None
                if not self.registered:
                    import atexit

                    atexit.register(self.shutdown)
                    self.registered = True
        return self.zygote

    def drop(self) -> None:
        if self.zygote is not None:
            zygote, self.zygote = self.zygote, None
            zygote.close()

    def shutdown(self) -> None:
        with self.lock:
            self.drop()


#: The one zygote of this process (see `_Shared`).
SHARED = _Shared()


def fork_worker(argv: Sequence[str], cwd: Path, env: Mapping[str, str], log: IO[str] | None, out: IO[Any] | None = None,
                main: str = "worker") -> Forked | None:
    """Fork the judge `kernelboard.eval.worker ARGV` (or another of `MAINS`) from this process's zygote, started or
    restarted as needed, with fds 1 and 2 on `out` (by default `log`); None where there is none (the caller
    starts a fresh interpreter), said once in the first `log` given. `KERNELBOARD_ZYGOTE=0` in the grader's
    environment turns the zygote off."""
    out = log if out is None else out
    assert out is not None
    if os.environ.get("KERNELBOARD_ZYGOTE") == "0":
        return None
    with SHARED.lock:
        for attempt in range(2):  # a zygote that died since the last judge is started again, once
            zygote = SHARED.get(env)
            if zygote is None:
                break
            try:
                return zygote.fork(argv, cwd, env, out.fileno(), main)
            except ZygoteError as exc:
                SHARED.drop()
                if attempt:  # and it failed again: judges of this environment start fresh from now on
                    SHARED.failed = (zygote.env, f"it failed twice: {exc}")
        if log is not None and not SHARED.said:
            why = SHARED.failed[1] if SHARED.failed else "unknown"
            log.write(f"[grader] no zygote to fork judges from ({why}): each judge starts as a fresh interpreter\n")
            log.flush()
            SHARED.said = True
    return None


# ------------------------------------------------------------------------------ the zygote's side


@contextlib.contextmanager
def _watching_environ(seen: set[str]) -> Iterator[None]:
    """Note every `LAZY_ENV` variable read through `os.environ` (and so `os.getenv`) meanwhile."""
    original = os._Environ.__getitem__  # type: ignore[attr-defined]

    def getitem(self: Any, key: Any) -> Any:
        if isinstance(key, str) and lazy(key):
            seen.add(key)
        return original(self, key)

    os._Environ.__getitem__ = getitem  # type: ignore[attr-defined]
    try:
        yield
    finally:
        os._Environ.__getitem__ = original  # type: ignore[attr-defined]


def _preload(modules: Sequence[str]) -> tuple[dict[str, Any], bytes]:
    """Import `modules` with fds 1 and 2 on a temporary file; the reply for the grader ({"pid": …} or
    {"error": …}) and what the imports printed (each judge's log starts with it, as a fresh one's would)."""
    import importlib
    import traceback

    seen: set[str] = set()
    problems: list[str] = []
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 1)
        os.dup2(said.fileno(), 2)
        try:
            with _watching_environ(seen):
                for name in modules:
                    importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            problems.append(f"importing {name} failed")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        said.seek(0)
        printed = said.read()
    if seen:
        problems.append(f"its imports read {', '.join(sorted(seen))}, which each judge sets itself")
    problems += [f"its imports imported {name}" for name in UNPRELOADABLE if name in sys.modules]
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        problems.append(f"no pidfd_open here ({exc})")
    if problems:
        tail = printed.decode(errors="replace").strip().splitlines()[-1:]
        return {"error": "; ".join(problems + tail)}, printed
    return {"pid": os.getpid()}, printed


def _unforkable() -> str | None:
    """Why forking now would give a judge other than a fresh one, or None."""
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads are running in the zygote"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in the zygote"
    return None


def child_path(path: Sequence[str], cwd: str) -> list[str]:
    """`sys.path` for a judge working in `cwd`: no '' (the working directory), no relative folder, nothing
    inside `cwd` (a scratch copy of the candidate's submission)."""
    inside = os.path.realpath(cwd).rstrip("/") + "/"
    return [p for p in path
            if p and os.path.isabs(p) and not (os.path.realpath(p).rstrip("/") + "/").startswith(inside)]


def _exit_code(code: object) -> int:
    """What the interpreter would exit with after `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _become_judge(request: dict[str, Any], out: int, printed: bytes, inherited: Sequence[int]) -> int:
    """In the forked child: become a judge (see the module docstring) and run it; its exit code."""
    import atexit
    import importlib
    import traceback

    for fd in inherited:  # the zygote's own sockets and pidfds, the other judges' status sockets
        with contextlib.suppress(OSError):
            os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[:] = child_path(sys.path, request["cwd"])
    name = MAINS[request["main"]]
    module = importlib.import_module(name)
    sys.argv = [str(module.__file__), *request["argv"]]
    sys.orig_argv = [sys.executable, "-m", name, *request["argv"]]
    signal.signal(signal.SIGINT, signal.SIG_IGN if request.get("sigint_ignored") else signal.default_int_handler)
    if printed:
        os.write(1, printed)
    interrupted = False
    try:
        code = _exit_code(module.main(request["argv"]))
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does at exit: wait for threads, run atexit functions, flush
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if interrupted:  # as a fresh interpreter does on an uncaught KeyboardInterrupt: die from SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _fork(request: dict[str, Any], out: int, printed: bytes, inherited: Sequence[int]) -> int:
    """Fork a judge; returns its pid once it leads its own session."""
    reason = _unforkable()
    if reason is not None:
        raise ZygoteError(reason)
    started, leads = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            os.close(leads)  # the zygote reads end-of-file: the session exists
            os.close(started)
            code = _become_judge(request, out, printed, inherited)
        finally:
            os._exit(code)
    os.close(leads)
    os.read(started, 1)
    os.close(started)
    return pid


def serve(control: socket.socket, printed: bytes) -> None:
    """Fork a judge for each request until the grader closes the control socket, then wait for the
    judges still running; report each one's pid, then its exit code, on the request's status socket."""
    import selectors

    children: dict[int, tuple[int, int]] = {}  # pidfd -> (pid, status socket fd)
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        accepting = True
        while accepting or children:
            for key, _ in selector.select():
                if key.fileobj is not control:  # a judge exited
                    pid, status = children.pop(key.fd)
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    _, wait_status = os.waitpid(pid, 0)
                    with contextlib.suppress(OSError):
                        os.write(status, f"rc {os.waitstatus_to_exitcode(wait_status)}".encode())
                    os.close(status)
                    continue
                message, fds, flags, _ = socket.recv_fds(control, _MAX_MESSAGE, 2)
                if not message and not fds:  # the grader closed it
                    selector.unregister(control)
                    accepting = False
                    continue
                if len(fds) != 2 or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    for fd in fds:
                        os.close(fd)
                    continue
                out, status = fds
                inherited = [control.fileno(), selector.fileno(), *children, *(s for _, s in children.values()),
                             status]
                try:
                    pid = _fork(json.loads(message), out, printed, inherited)
                except Exception as exc:  # said to the grader, which starts a fresh judge instead
                    with contextlib.suppress(OSError):
                        os.write(status, f"error {type(exc).__name__}: {exc}".encode()[:250])
                    os.close(status)
                    continue
                finally:
                    os.close(out)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, status)
                selector.register(pidfd, selectors.EVENT_READ)
                try:
                    os.write(status, f"pid {pid}".encode())
                except OSError:  # the grader gave up on this request: nobody would kill this judge
                    with contextlib.suppress(OSError):
                        os.killpg(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle; judges restore it
    control = socket.socket(fileno=int(argv[0]))
    reply, printed = _preload(argv[1:])
    control.send(json.dumps(reply).encode())
    if "error" in reply:
        return 1
    serve(control, printed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

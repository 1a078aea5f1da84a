"""The sandbox around every process that runs candidate code: bubblewrap, plus resource limits.

The runner (and the prebuild that imports a solution early) starts as
`bwrap … python -m kernelboard.eval.runner …` with its own mount, PID, network, IPC, UTS, user and
cgroup namespaces (`--unshare-all`; no user namespace where root drops root, below), a new session,
and `--die-with-parent` (when the judge dies, the namespace's init dies and the kernel kills everything
left in it, `setsid` escapees included).
Inside it sees:

- read-only: the system (`/usr`, `/etc`, `/opt`, `/sys`), the Python installation and the grader's
  own package folders — with the decks folder inside them replaced by an empty tmpfs — and the
  CUTLASS headers builds are given (`cutlass_headers.py`) where they lie elsewhere;
- read-write: its scratch copy of the submission and that solution's compile caches, nothing else;
- its own `/proc` (no other process of ours is visible), a minimal `/dev` plus, on a GPU, the
  `/dev/nvidia*` device nodes; a private `/tmp`; no network interface but loopback;
- a scrubbed environment (`JAIL_ENV`): no secret of the grader's environment reaches it.

Run by root (a GPU host's grader often is), the tree drops root before candidate code starts: bwrap keeps
only CAP_SETUID/CAP_SETGID (no user namespace, where only root's id would be mapped), and `setpriv` turns it
into a user id of its own, one per solution (`sandbox_uid`), with no capabilities and no-new-privs. The kernel
exempts root from RLIMIT_NPROC, so without this a fork bomb had no limit where no cgroup can be made; with a
uid per solution, the limit counts that solution's processes alone, and one submission's fork bomb cannot
starve another's build running beside it. The folders it may write are handed to that uid first.

Not visible: `--out`, `data/`, the deck folders (the runner gets a private copy of its problem),
other submissions, the judge's job file, result file and `/proc` entries. Limits, applied before
`bwrap` starts so that everything inside inherits them: file size, open files, core dumps; process
count and memory through a cgroup (v2, or v1's `pids` and `memory` controllers) where this machine
lets us make one, else `RLIMIT_NPROC` (not enforced for root) and `RLIMIT_DATA` on the CPU. What was
in force is written into each result row (`sandbox`), so a reader sees how a number was obtained.

Where bubblewrap is missing or namespaces are not allowed, `kernelboard eval` refuses to grade
unless `--unsandboxed` is given; such rows say "unsandboxed".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import resource
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .cutlass_headers import find_cutlass

#: The `sandbox` column of a row graded without one.
UNSANDBOXED = "unsandboxed (--unsandboxed): candidate code ran as the grader's user, with its view of the machine"

#: Environment variables a sandboxed process may see (everything else is dropped, secrets included).
JAIL_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH",
            "PYTHONPATH", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "PYTHONDONTWRITEBYTECODE",
            "PYTHONUNBUFFERED", "PYTHONSAFEPATH", "TRITON_INTERPRET", "TORCH_CUDA_ARCH_LIST", "CUTLASS_PATH",
            "CPATH", "CPLUS_INCLUDE_PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "KERNELBOARD_GRADING_GPU")  # the last: the grading GPU for the prebuild (prebuild.py)

#: System folders shown read-only (those that exist; a symlink such as /bin -> usr/bin is recreated).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc", "/opt", "/sys")

#: Limits of one sandboxed process tree.
MAX_PROCESSES = 1024  # compilers (nvcc, ninja -j) start many; a fork bomb stops here
MAX_FILE_BYTES = 8 << 30  # one file the candidate writes (compiled extensions are MBs)
MAX_OPEN_FILES = 8192
MEMORY_SHARE = 0.5  # of this machine's RAM, for the whole tree (inputs live in the judge's memfd)

#: The user ids sandboxed trees run as when the grader is root (`sandbox_uid`): [BASE, BASE + COUNT), ids no
#: account of a usual system has, so no file outside the tree's own folders is theirs.
SANDBOX_UID_BASE = 200_000
SANDBOX_UID_COUNT = 100_000


@dataclass(frozen=True)
class Jail:
    """How one sandboxed process is confined: decided by the trusted parent, JSON in the job."""

    bwrap: str | None  # the bwrap binary; None = unsandboxed (--unsandboxed)
    version: str = ""
    readonly: tuple[str, ...] = ()  # host folders shown read-only at the same path
    hidden: tuple[str, ...] = ()  # folders inside those replaced by an empty tmpfs
    devices: tuple[str, ...] = ()  # device nodes bound in (GPU)
    memory_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    setpriv: str | None = None  # the setpriv that drops root to `sandbox_uid` (None: the tree keeps our uid)

    def to_job(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_job(cls, data: Mapping[str, Any] | None) -> Jail:
        if not data:
            return cls(None)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

@functools.cache
def find_bwrap() -> tuple[str, str] | None:
    """(path, version) of a bubblewrap that can make the namespaces here, or None."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.split()
        probe = subprocess.run([path, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                                "--dev", "/dev", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (path, version[-1] if version else "?") if probe.returncode == 0 else None


def sandbox_uid(owner: str) -> int:
    """The user id a root grader's sandboxed tree runs as: one per solution (`owner`, its cache key), so that
    the prebuild and the runner of one solution share their compile caches and RLIMIT_NPROC counts one
    solution's processes."""
    return SANDBOX_UID_BASE + int(hashlib.sha256(owner.encode()).hexdigest(), 16) % SANDBOX_UID_COUNT


def _root_drop(readonly: tuple[str, ...], hidden: tuple[str, ...], devices: tuple[str, ...]) -> str | None:
    """The setpriv that lets a root grader's sandbox drop to `sandbox_uid`, or None where it cannot (not root,
    no setpriv, a device node closed to other users, or a trial run of Python as that uid in that sandbox
    failing): the tree then keeps our uid, as its row's `sandbox` says."""
    if os.getuid() != 0:
        return None
    setpriv = shutil.which("setpriv")
    closed = [dev for dev in devices if _is_char_device(dev) and os.stat(dev).st_mode & 0o006 != 0o006]
    why = ("no setpriv (util-linux) on PATH" if setpriv is None else
           f"{', '.join(closed)} not open to other users" if closed else "")
    if why:
        print(f"[grader] the sandbox keeps root's uid: {why}", file=sys.stderr, flush=True)
        return None
    return setpriv if _python_runs_as(str(setpriv), readonly, hidden, devices) else None


def _is_char_device(path: str) -> bool:
    """A device node (/dev/nvidia-caps, which `/dev/nvidia*` also names, is a folder of them)."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


@functools.cache
def _python_runs_as(setpriv: str, readonly: tuple[str, ...], hidden: tuple[str, ...], devices: tuple[str, ...]) -> bool:
    """Whether this Python imports the runner as an unprivileged uid in the sandbox (folders it must read,
    such as a virtualenv under a private home, may be closed to other users)."""
    found = find_bwrap()
    if found is None:
        return False
    trial = Jail(found[0], found[1], readonly, hidden, devices, setpriv=setpriv)
    argv = bwrap_argv(trial, writable=(), cwd=Path("/"), uid=sandbox_uid("trial"))
    try:
        done = subprocess.run([*argv, sys.executable, "-c", "import kernelboard.eval.runner"], capture_output=True,
                              timeout=120, env=scrubbed_env(os.environ, unprivileged=True))
    except (OSError, subprocess.TimeoutExpired):
        return False
    if done.returncode != 0:
        print(f"[grader] the sandbox keeps root's uid: Python as uid {sandbox_uid('trial')} failed there "
              f"({' '.join(done.stderr.decode(errors='replace').split())[-300:]})", file=sys.stderr, flush=True)
    return done.returncode == 0


def _package_folders() -> list[str]:
    """The grader's own code (the kernelboard packages) and the Python installation running it."""
    import kernelboard
    import kernelboard.eval

    folders = {str(Path(p).resolve()) for mod in (kernelboard, kernelboard.eval) for p in mod.__path__}
    folders |= {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    folders.add(str(Path(sys.executable).resolve().parent.parent))
    folders |= {str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    folders |= {str(Path(p).resolve()) for p in sys.path if p and Path(p).is_dir() and "site-packages" in p}
    return sorted(folders)


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def make_jail(*, sandboxed: bool, device: str, hide: Iterable[Path]) -> Jail:
    """The jail for this grading run (parent side): what is shown, hidden and bound; `hide` are the
    folders of ours that must stay invisible (decks, --out, data, submissions) where they fall under
    a folder that is shown."""
    if not sandboxed:
        return Jail(None)
    found = find_bwrap()
    if found is None:
        raise RuntimeError("no usable bubblewrap")
    import kernelboard.eval

    shown = [p for p in SYSTEM_PATHS if os.path.lexists(p)] + _package_folders()
    cutlass = find_cutlass()  # the CUTLASS headers builds see (on CPATH): shown read-only where not already
    if cutlass is not None:
        root = str(cutlass.root.resolve())
        if not any(root == s.rstrip("/") or root.startswith(s.rstrip("/") + "/") for s in shown):
            shown.append(root)
    hide = [*hide, *(Path(p) / "decks" for p in kernelboard.eval.__path__)]  # the grader's own decks, always
    hidden = sorted({str(Path(h).resolve()) for h in hide if Path(h).is_dir()
                     if any(str(Path(h).resolve()).startswith(s.rstrip("/") + "/") for s in shown)})
    devices = tuple(sorted(str(p) for p in Path("/dev").glob("nvidia*"))) if device == "cuda" else ()
    memory = int(_total_memory() * MEMORY_SHARE)
    readonly = tuple(dict.fromkeys(shown))
    return Jail(found[0], found[1], readonly, tuple(hidden), devices, memory,
                setpriv=_root_drop(readonly, tuple(hidden), devices))


def problem_root(solution_dir: Path) -> Path:
    """The folder holding a scratch copy's private problem copy (`problem_copy`), bound read-only."""
    return solution_dir.parent / f"{solution_dir.name}.problem"


def problem_copy(problem_path: Path, solution_dir: Path) -> Path:
    """A private copy of a problem (a folder, or a single file in a foreign format) beside the
    scratch copy, for the sandbox to read: the decks themselves stay hidden from the candidate."""
    root = problem_root(solution_dir)
    if problem_path.is_dir():
        copy = root / problem_path.name
        if not copy.exists():
            shutil.copytree(problem_path, copy, ignore=shutil.ignore_patterns("__pycache__"))
        return copy
    copy = root / problem_path.parent.name / problem_path.name  # a level file: its folder names the bench
    copy.parent.mkdir(parents=True, exist_ok=True)
    for sibling in problem_path.parent.glob(f"{problem_path.stem}.*"):  # the file and its overlay
        if sibling.is_file() and not (copy.parent / sibling.name).exists():
            shutil.copy2(sibling, copy.parent / sibling.name)
    return copy


#: The namespaces of a tree that drops root itself: all of `--unshare-all`'s but the user namespace, where
#: only root's own id would be mapped and `setpriv` could not change to another.
OWN_NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try")


def bwrap_argv(jail: Jail, *, writable: Iterable[Path], readable: Iterable[Path] = (), cwd: Path,
               uid: int | None = None) -> list[str]:
    """The bwrap command line for `jail`: the candidate's `writable` folders bound read-write, and
    `readable` ones (its private copy of the problem) read-only; with `jail.setpriv`, ending in the
    `setpriv` that makes the command run as `uid` with no capabilities."""
    assert jail.bwrap is not None
    drop = jail.setpriv is not None and uid is not None
    namespaces = [*OWN_NAMESPACES, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if drop else ["--unshare-all"]
    argv = [jail.bwrap, *namespaces, "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev",
            "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs", "/dev/shm"]
    if drop:  # folders bwrap would make on the way to a bind are root's alone (0700) outside a user namespace
        for folder in _ways_in([*jail.readonly, *map(str, writable), *map(str, readable)]):
            argv += ["--perms", "0755", "--dir", folder]
    for path in jail.readonly:
        if os.path.islink(path) and path.count("/") == 1:  # /bin -> usr/bin on merged-/usr systems
            argv += ["--symlink", os.readlink(path), path]
        else:
            argv += ["--ro-bind-try", path, path]
    for path in jail.hidden:
        argv += ["--tmpfs", path]
    for path in writable:
        argv += ["--bind", str(path), str(path)]
    for path in readable:
        argv += ["--ro-bind", str(path), str(path)]
    for dev in jail.devices:
        argv += ["--dev-bind-try", dev, dev]
    argv += ["--chdir", str(cwd), "--"]
    if drop:
        argv += [str(jail.setpriv), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                 "--no-new-privs", "--"]
    return argv


def _ways_in(binds: list[str]) -> list[str]:
    """The folders above `binds` that no bind shows (bwrap makes them in the sandbox's own root or /tmp),
    parents first."""
    def shown(folder: str) -> bool:
        return any(folder == b or folder.startswith(b.rstrip("/") + "/") for b in binds)

    ways = {str(parent) for b in binds for parent in Path(b).parents if str(parent) not in ("/", "/tmp")}
    return sorted((w for w in ways if not shown(w)), key=lambda w: (w.count("/"), w))


def scrubbed_env(env: Mapping[str, str], *, unprivileged: bool = False) -> dict[str, str]:
    """Only the variables in JAIL_ENV, and a HOME that is the sandbox's private /tmp; for a uid that no
    account names, a USER (Python's `getpass.getuser`, which torch's caches ask, reads it first)."""
    user = {"USER": "kernelboard-sandbox", "LOGNAME": "kernelboard-sandbox"} if unprivileged else {}
    return {**{k: v for k, v in env.items() if k in JAIL_ENV}, "HOME": "/tmp", **user}


def hand_over(folder: Path, uid: int) -> None:
    """Make `folder` and what it holds `uid`'s, for a tree that drops root: never through a link (a symbolic
    link is changed itself, not what it points to) and never a file with another name elsewhere (a hard link
    a candidate made to a file of ours must not become its own)."""
    for here, dirs, files in os.walk(folder, followlinks=False):
        for name in [*dirs, *files]:
            path = os.path.join(here, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if st.st_uid != uid and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
                    os.chown(path, uid, uid, follow_symlinks=False)
    os.chown(folder, uid, uid)


@dataclass
class Cgroup:
    """A cgroup of our own for one sandboxed tree (v2, or v1's pids and memory controllers)."""

    procs: list[Path]  # the cgroup.procs files a process joins
    folders: list[Path]
    notes: list[str]

    def remove(self) -> None:
        for folder in reversed(self.folders):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path for a v1 controller ('' for v2), from /proc/self/cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if names.split(",") == [controller] or (controller == "" and names == ""):
            return path
    return None


def make_cgroup(memory_bytes: int) -> Cgroup | None:
    """A fresh cgroup limiting process count and memory, or None where we may not make one."""
    name = f"kernelboard-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    root = Path("/sys/fs/cgroup")
    made = Cgroup([], [], [])
    try:
        if (root / "cgroup.controllers").is_file():  # v2, unified
            folder = root / (_own_cgroup("") or "/").lstrip("/") / name
            folder.mkdir()
            made.folders.append(folder)
            (folder / "pids.max").write_text(str(MAX_PROCESSES))
            (folder / "memory.max").write_text(str(memory_bytes))
            made.procs.append(folder / "cgroup.procs")
            made.notes.append(f"processes ≤ {MAX_PROCESSES}, memory ≤ {memory_bytes >> 30} GiB (cgroup v2)")
            return made
        for controller, limit_file, value in (("pids", "pids.max", MAX_PROCESSES),
                                              ("memory", "memory.limit_in_bytes", memory_bytes)):
            own = _own_cgroup(controller)
            if own is None or not (root / controller).is_dir():
                continue
            folder = root / controller / own.lstrip("/") / name
            folder.mkdir()
            made.folders.append(folder)
            (folder / limit_file).write_text(str(value))
            made.procs.append(folder / "cgroup.procs")
        if not made.procs:
            return None
        made.notes.append(f"processes ≤ {MAX_PROCESSES}, memory ≤ {memory_bytes >> 30} GiB (cgroup v1)")
        return made
    except OSError:
        made.remove()
        return None


def rlimits(jail: Jail, cgroup: Cgroup | None, device: str,
            uid: int | None = None) -> list[tuple[int | None, int, str | None]]:
    """The rlimits a sandboxed tree gets, decided in the parent, as (resource or None for a note alone,
    value, what the result row says of it): process count and memory only where no cgroup holds them.
    `uid`: the user id the tree runs as (None: ours), whose processes RLIMIT_NPROC counts."""
    uid = os.getuid() if uid is None else uid
    limits: list[tuple[int | None, int, str | None]] = [
        (resource.RLIMIT_NOFILE, MAX_OPEN_FILES, None), (resource.RLIMIT_CORE, 0, None)]
    if cgroup is None:
        limits.append((resource.RLIMIT_NPROC, MAX_PROCESSES + _processes_of_user(uid),
                       "processes ≤ " + (f"{MAX_PROCESSES} more (RLIMIT_NPROC)" if uid != 0 else
                                         "unlimited (root: RLIMIT_NPROC is not enforced and no cgroup could be made)")))
        limits.append((resource.RLIMIT_DATA, jail.memory_bytes, f"memory ≤ {jail.memory_bytes >> 30} GiB (RLIMIT_DATA)")
                      if device == "cpu" and jail.memory_bytes else (None, 0, "memory unlimited (GPU)"))
    limits.append((resource.RLIMIT_FSIZE, MAX_FILE_BYTES, f"files ≤ {MAX_FILE_BYTES >> 30} GiB each"))
    return limits


def confine(cgroup: Cgroup | None, limits: list[tuple[int | None, int, str | None]]) -> None:
    """In the child, before exec (a `preexec_fn`): join the cgroup and set the rlimits."""
    for procs in cgroup.procs if cgroup else ():
        procs.write_text(str(os.getpid()))
    for which, value, _ in limits:
        if which is None:
            continue
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (value, value))


def _processes_of_user(uid: int) -> int:
    """Processes `uid` runs now (RLIMIT_NPROC counts them all, not only the sandbox's)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += entry.stat().st_uid == uid
    return count


def limit_notes(cgroup: Cgroup | None, limits: list[tuple[int | None, int, str | None]]) -> list[str]:
    """What `confine` puts in force, for the result row: the cgroup's limits, then the rlimits'."""
    return [*(cgroup.notes if cgroup else []), *(note for _, _, note in limits if note), "no network"]


@dataclass
class Confined:
    """A sandboxed process tree as started: its Popen, its cgroup (removed by `release`)."""

    proc: subprocess.Popen[bytes]
    cgroup: Cgroup | None
    description: str

    def release(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()


def start(jail: Jail, command: list[str], *, writable: Iterable[Path], cwd: Path, env: Mapping[str, str],
          device: str, owner: str, readable: Iterable[Path] = (), pass_fds: tuple[int, ...] = (),
          **popen: Any) -> Confined:
    """Start `command` in `jail` (or plainly, unsandboxed), in a new process group; `owner` names the
    solution it runs (its cache key), whose user id it gets where the jail drops root."""
    writable = [Path(w) for w in writable]
    for folder in writable:
        folder.mkdir(parents=True, exist_ok=True)
    if jail.bwrap is None:
        proc = subprocess.Popen(command, cwd=cwd, env=dict(env), pass_fds=pass_fds, start_new_session=True,
                                **popen)
        return Confined(proc, None, UNSANDBOXED)
    uid = sandbox_uid(owner) if jail.setpriv is not None else None
    for folder in writable if uid is not None else ():
        hand_over(folder, uid)
    cgroup = make_cgroup(jail.memory_bytes)
    limits = rlimits(jail, cgroup, device, uid)
    argv = bwrap_argv(jail, writable=writable, readable=readable, cwd=cwd, uid=uid) + command
    proc = subprocess.Popen(argv, cwd=cwd, env=scrubbed_env(env, unprivileged=uid is not None), pass_fds=pass_fds,
                            start_new_session=True, preexec_fn=functools.partial(confine, cgroup, limits), **popen)
    notes = limit_notes(cgroup, limits)
    user = f"runs as uid {uid}, not root, with no capabilities; " if uid is not None else ""
    return Confined(proc, cgroup, f"bubblewrap {jail.version}: own mount, pid, net, ipc, uts namespaces; {user}"
                                  f"read-only system, sees only its scratch copy; {'; '.join(notes)}")

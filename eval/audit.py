"""Run-time audits of candidate code. Each function names the attack it stops.

A text search of solution.py alone is dodged by an alias (`getattr(F, "scaled_" + …)`), a sidecar
file or a `.cu` source; these checks look at what actually ran instead. What ran can only be seen
inside the process that ran it, so the audits come in two halves:

- *collectors* run in the runner, beside candidate code, and return raw data (the aten ops a call
  reached, the kernels it launched and which of them came from the candidate's own code,
  host-synchronised samples, graph replay samples): `op_log`, `timed_kernels`, `own_kernels`,
  `host_synced_samples_ms`, `graph_replay_samples_ms`, `reset_persisting_l2`;
- *rules* run in the judge on that data: `forbidden_text_hits`, `forbidden_ops`,
  `kernel_problems`, `escaped_work`. A candidate that patches a rule patches its own copy only.

A hostile runner can still report false raw data; the rules stop what an honest runner sees.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import glob
import mmap
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .deck import Problem
from .settings import ESCAPE_FRACTION, ESCAPE_SLACK_MS, LIBRARY_KERNEL


def forbidden_text_hits(problem: Problem, solution_dir: Path) -> list[str]:
    """Stops the plain call of a forbidden library: its name in any text file of the submission
    (sidecars and .cu files included, not only solution.py)."""
    hits = []
    for path in sorted(solution_dir.rglob("*")):
        if not path.is_file() or path.name == "run.yaml":
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{needle!r} in {path.name}" for needle in problem.forbidden if needle in text]
    return hits


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


class _FunctionLog(TorchFunctionMode):
    """The torch functions a call makes, before any decomposition: an op that is
    CompositeImplicitAutograd (SDPA's math path on the CPU) reaches the dispatch mode only as
    the matmuls and softmax it decomposes into, but this mode sees the call itself."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None) or type(func).__name__
        self.names.append(f"torch:{name}")
        return func(*args, **(kwargs or {}))


def op_log(fn: Callable[..., Any], inputs: list[Any]) -> tuple[list[str], Any]:
    """Collector: the distinct torch functions (`torch:<name>`, from a TorchFunctionMode) and aten
    ops (from a dispatch mode) one call reaches, in first-seen order, and the call's output (which
    the judge checks like any other call's)."""
    functions, log = _FunctionLog(), _OpLog()
    with torch.no_grad(), functions, log:
        out = fn(*inputs)
    return list(dict.fromkeys(functions.names + log.ops)), out


def _forbidden(needle: str, op: str) -> bool:
    """An aten op matches a needle as a substring; a torch function (`torch:<name>`) matches an
    `aten::NAME` needle by exact name, any other needle without a namespace as a substring."""
    if not op.startswith("torch:"):
        return needle in op
    name = op.removeprefix("torch:")
    if needle.startswith("aten::"):
        return name == needle.removeprefix("aten::")
    return "::" not in needle and needle in name


def forbidden_ops(problem: Problem, ops: list[str]) -> list[str]:
    """Rule: stops an aliased call of a forbidden op (e.g. SDPA reached through getattr), whether
    the dispatch mode saw the aten op or only the torch function mode saw the call."""
    return sorted({op for op in ops for needle in problem.forbidden_ops if _forbidden(needle, op)})


def timed_kernels(fn: Callable[..., Any], inputs: list[Any]) -> list[str]:
    """Collector: the distinct CUDA kernels one call launches, in first-launch order (torch
    profiler/CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    names: list[str] = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name not in names:
            names.append(event.name)
    return names


# ------------------------------------------------------------------ which kernels are its own
#
# A kernel is the candidate's own by where it comes from, not by what it is called: a Triton
# function defined in a file the candidate wrote, a symbol of a shared object built from its code
# (its folder, the torch-extension and Triton build caches, the private temp folder), a `__global__`
# name or identifier of its sources. A name such as `gemv_w4_kernel` or `cutlass::device_kernel<…>`
# says nothing either way; PyTorch's and the vendor libraries' kernels live in files under torch's
# and site-packages' folders, which never count.

#: Mangled C++ names as they sit in a binary (host stubs, `__cudaRegisterFunction` strings, cubins).
_MANGLED = re.compile(rb"_Z[0-9A-Za-z_$.]{2,}")
_GLOBAL = re.compile(r"__global__\b[^;{}()]*?([A-Za-z_]\w*)\s*\(")
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w{2,}")
_SOURCE_SUFFIXES = frozenset({".py", ".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hh", ".hpp", ".inc", ".ptx"})
_BINARY_SUFFIXES = frozenset({".cubin", ".fatbin", ".ptx"})  # kernels loaded from a file, not mapped
_MAX_SOURCE_BYTES, _MAX_FILES = 4 << 20, 5000
#: Python packages that compile kernels in memory from Python code: their kernels come from no file
#: this collector can read, so with one loaded and nothing traced, origins are left undecided.
_UNTRACEABLE = ("cutlass.cute", "numba.cuda", "tilelang", "cupy", "cuda.core", "warp", "helion")


@dataclass
class OwnCode:
    """What the candidate's code defines, in the forms launched kernels are matched against."""

    signatures: set[str] = field(default_factory=set)  # demangled `name<targs>(params)`, spaces removed
    heads: set[str] = field(default_factory=set)  # the same without the parameter list
    plain: set[str] = field(default_factory=set)  # qualified names of its non-template kernels
    identifiers: set[str] = field(default_factory=set)  # Triton functions and `__global__` names
    tokens: set[str] = field(default_factory=set)  # every identifier of its sources
    notes: list[str] = field(default_factory=list)  # how each part was found, for the origin line


def _norm(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _split_signature(name: str) -> tuple[str, str, str, bool]:
    """A kernel name as the profiler or a demangler writes it (`void ns::k<4>(float*)`,
    `k(float*)`, `k`) -> (whole, head, base, is_template), spaces removed: head drops a trailing
    parameter list, base the template arguments after it."""
    text = name.strip()
    if text.startswith("void ") and len(text) > 5:
        text = text[5:]
    whole = _norm(text)
    head = whole
    if whole.endswith(")"):
        depth = 0
        for i in range(len(whole) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(whole[i], 0)
            if depth == 0:
                head = whole[:i] if i > 0 else whole
                break
    cut = head.find("<")
    return whole, head, head if cut <= 0 else head[:cut], cut > 0


def is_own(kernel: str, code: OwnCode) -> bool:
    """Whether a launched kernel's name is one the candidate's code defines: its full demangled
    text, its name and template arguments, the qualified name of a non-template kernel, a Triton
    or `__global__` name (unqualified), or a plain identifier its sources spell out."""
    whole, head, base, template = _split_signature(kernel)
    if whole in code.signatures or head in code.heads:
        return True
    if not template and base in code.plain:
        return True
    unqualified = base.removeprefix("(anonymousnamespace)::")
    if unqualified in code.identifiers:
        return True
    return whole.isidentifier() and whole in code.tokens


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.path.expanduser(str(path)))


def _under(path: str, folders: Iterable[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip(os.sep) + os.sep) for f in folders)


def candidate_folders(solution_dir: Path) -> tuple[list[str], list[str]]:
    """(folders whose files the candidate's code made, folders that never count): its folder, the
    torch-extension and Triton build caches (TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR or their
    defaults; sandbox.worker_env gives each solution its own) and the temp folder (private in the
    jail); never torch's own folder, site-packages, or torch.compile's cache in the temp folder."""
    try:
        from torch.utils.cpp_extension import get_default_build_root
        extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    except Exception:  # an old torch: its default
        extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or "~/.cache/torch_extensions"
    triton_cache = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache"
    temp = tempfile.gettempdir()
    ours = [_real(p) for p in (solution_dir, extensions, triton_cache, temp)]
    library = [os.path.dirname(torch.__file__), *site.getsitepackages(), site.getusersitepackages(),
               *(sysconfig.get_paths().get(k, "") for k in ("purelib", "platlib", "stdlib", "platstdlib"))]
    library += glob.glob(os.path.join(temp, "torchinductor_*"))
    return ours, [_real(p) for p in library if p]


def _binary_symbols(path: str, cache: dict[tuple[Any, ...], frozenset[str]]) -> frozenset[str]:
    """The mangled names in one binary file, read once per (file, version)."""
    try:
        st = os.stat(path)
    except OSError:
        return frozenset()
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in cache:
        found: set[str] = set()
        try:
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                found = {m.decode("ascii") for m in _MANGLED.findall(data)}  # type: ignore[arg-type]
        except (OSError, ValueError):  # empty or unreadable: nothing of its own there
            pass
        cache[key] = frozenset(found)
    return cache[key]


def _cxa_demangle() -> Callable[[str], str | None] | None:
    """libstdc++'s demangler (the one the profiler uses), through ctypes."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(None)
        fn = lib.__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    libc.free.argtypes = [ctypes.c_void_p]

    def demangle(symbol: str) -> str | None:
        status = ctypes.c_int(1)
        ptr = fn(symbol.encode(), None, None, ctypes.byref(status))
        if not ptr:
            return None
        try:
            return ctypes.string_at(ptr).decode("utf-8", "replace") if status.value == 0 else None
        finally:
            libc.free(ptr)

    return demangle


def demangle_all(symbols: list[str]) -> tuple[dict[str, str], str]:
    """{mangled: demangled} for those that demangle, and the tool used: `c++filt` in one batched
    call, else libstdc++'s `__cxa_demangle`, else none (an empty map)."""
    if not symbols:
        return {}, "nothing to demangle"
    tool = shutil.which("c++filt")
    if tool:
        try:
            done = subprocess.run([tool], input="\n".join(symbols) + "\n", capture_output=True, text=True,
                                  timeout=300, check=True)
            lines = done.stdout.splitlines()
            if len(lines) == len(symbols):
                return {s: d for s, d in zip(symbols, lines, strict=True) if d != s}, "c++filt"
        except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
            pass
    demangle = _cxa_demangle()
    if demangle is not None:
        out = {}
        for s in symbols:
            d = demangle(s)
            if d and d != s:
                out[s] = d
        return out, "__cxa_demangle"
    return {}, "no demangler"


def mangled_base(symbol: str) -> tuple[str, bool] | None:
    """Without a demangler: the qualified name a mangled symbol starts with and whether template
    arguments follow it (`_ZN2ns6kernelILi4EEvPf` -> ("ns::kernel", True))."""
    s, i, parts = symbol[2:], 0, []
    nested = s.startswith("N")
    if nested:
        i = 1
        while i < len(s) and s[i] in "rVKRO":
            i += 1
        if s.startswith("St", i):
            parts.append("std")
            i += 2
    while i < len(s) and s[i].isdigit():
        j = i
        while j < len(s) and s[j].isdigit():
            j += 1
        n = int(s[i:j])
        name = s[j:j + n]
        if len(name) < n:
            return None
        parts.append("(anonymous namespace)" if name.startswith("_GLOBAL__N") else name)
        i = j + n
        if not nested:
            break
    if not parts:
        return None
    return "::".join(parts), s[i:i + 1] == "I"


def _add_symbols(code: OwnCode, symbols: list[str], demangled: dict[str, str]) -> None:
    for sym in symbols:
        text = demangled.get(sym)
        if text is not None:
            whole, head, base, template = _split_signature(text)
            code.signatures.add(whole)
            code.heads.add(head)
            if not template:
                code.plain.add(base)
        elif (parsed := mangled_base(sym)) is not None:  # no demangler: the name alone, coarser
            code.plain.add(_norm(parsed[0]))


def _triton_names(ours: list[str], library: list[str]) -> set[str]:
    """Triton functions (JIT, autotuned, heuristics, interpreted: unwrapped through `.fn`) whose
    Python function was defined in a file under the candidate's folders; Triton 3 names the
    compiled kernel after the function's `__name__`."""
    if "triton" not in sys.modules:
        return set()
    try:
        from triton.runtime.jit import KernelInterface
    except Exception:  # a broken or foreign triton: no Triton kernels to trace
        return set()
    names: set[str] = set()
    for obj in gc.get_objects():
        if not issubclass(type(obj), KernelInterface):
            continue
        fn: Any = obj
        for _ in range(8):
            if isinstance(fn, types.FunctionType):
                break
            fn = getattr(fn, "fn", None)
        if not isinstance(fn, types.FunctionType):
            continue
        files = [fn.__code__.co_filename, getattr(sys.modules.get(fn.__module__), "__file__", None) or ""]
        if any(f and _under(_real(f), ours) and not _under(_real(f), library) for f in files if os.path.isabs(f)):
            names.add(fn.__name__)
    return names


def _source_files(folders: list[str], library: list[str]) -> list[Path]:
    files: list[Path] = []
    for folder in folders:
        for root, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if not _under(_real(os.path.join(root, d)), library)]
            files += [Path(root, n) for n in names if Path(n).suffix in _SOURCE_SUFFIXES | _BINARY_SUFFIXES]
            if len(files) > _MAX_FILES:
                return files[:_MAX_FILES]
    return files


def _scan_sources(code: OwnCode, files: list[Path], cache: dict[tuple[Any, ...], frozenset[str]]) -> list[str]:
    """`__global__` names and identifiers of the candidate's sources (its .py files hold its
    `load_inline` and NVRTC sources as strings); the mangled names in its loose cubins and PTX.
    Returns those mangled names."""
    mangled: set[str] = set()
    for path in files:
        if path.suffix in _BINARY_SUFFIXES:
            mangled |= _binary_symbols(str(path), cache)
            if path.suffix != ".ptx":
                continue
        try:
            if path.stat().st_size > _MAX_SOURCE_BYTES:
                continue
            text = path.read_text(errors="replace")
        except OSError:
            continue
        code.identifiers |= set(_GLOBAL.findall(_LAUNCH_BOUNDS.sub(" ", text)))
        code.tokens |= set(_IDENTIFIER.findall(text))
    return sorted(mangled)


def _mapped_files() -> list[str] | None:
    """The shared objects mapped into this process, or None where /proc/self/maps cannot be read."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {line.split(None, 5)[5].removesuffix(" (deleted)") for line in lines if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if p.startswith("/") and ".so" in os.path.basename(p))


class KernelOrigins:
    """Collector: which launched kernels came from the candidate's code. One per runner: each
    binary is read once (per version) and each symbol demangled once."""

    def __init__(self, solution_dir: Path) -> None:
        self.solution_dir = solution_dir
        self._binaries: dict[tuple[Any, ...], frozenset[str]] = {}
        self._demangled: dict[str, str] = {}
        self._tried: set[str] = set()
        self._tool = "none"

    def _demangle(self, symbols: list[str]) -> None:
        todo = [s for s in symbols if s not in self._tried]
        if todo:
            done, self._tool = demangle_all(todo)
            self._demangled.update(done)
            self._tried.update(todo)

    def code(self) -> OwnCode | None:
        """What the candidate's code defines now, or None where it cannot be told (no
        /proc/self/maps to find its compiled libraries in)."""
        mapped = _mapped_files()
        if mapped is None:
            return None
        ours, library = candidate_folders(self.solution_dir)
        code = OwnCode()
        triton_names = _triton_names(ours, library)
        code.identifiers |= triton_names
        built = [p for p in mapped if _under(_real(p), ours) and not _under(_real(p), library)]
        symbols: set[str] = set()
        for path in built:
            symbols |= _binary_symbols(path, self._binaries)
        source_folders = [_real(self.solution_dir)]
        extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
        if extensions and os.path.isdir(extensions):
            source_folders.append(_real(extensions))  # load_inline's generated sources
        files = _source_files(source_folders, library)
        symbols |= set(_scan_sources(code, files, self._binaries))
        ordered = sorted(symbols)
        self._demangle(ordered)
        _add_symbols(code, ordered, self._demangled)
        code.notes = [f"{len(triton_names)} Triton functions defined in its files",
                      f"{len(built)} libraries built from its code mapped"
                      + (f" ({', '.join(os.path.basename(p) for p in built[:3])}{', …' if len(built) > 3 else ''})"
                         if built else ""),
                      f"{len(ordered)} mangled names (demangled: {self._tool if ordered else 'n/a'})",
                      f"{len(files)} source files read"]
        return code


def own_kernels(kernels: list[str], origins: KernelOrigins) -> tuple[list[str] | None, str]:
    """Collector: (the launched kernels that came from the candidate's code, one line on how that
    was decided); None instead of the list where it cannot be decided — no /proc/self/maps, an
    error, or nothing traced while a package that compiles kernels in memory from Python (CuTe
    DSL, Numba, …) is loaded — and the judge then falls back to kernel names."""
    try:
        code = origins.code()
    except Exception as exc:  # an audit that breaks leaves the decision to the names
        return None, f"origins undecided: {type(exc).__name__}: {exc}"[:500]
    if code is None:
        return None, "origins undecided: /proc/self/maps cannot be read"
    own = [k for k in kernels if is_own(k, code)]
    how = "by origin: " + "; ".join(code.notes)
    if not own:
        dsl = [m for m in _UNTRACEABLE if m in sys.modules]
        if dsl:
            return None, (f"origins undecided: none traced, and {', '.join(dsl)} (kernels compiled in memory) "
                          f"is loaded; {how}")
    return own, how


def kernel_problems(problem: Problem, kernels: list[str], own: list[str] | None = None,
                    origin: str = "") -> list[str]:
    """Rule: stops a library doing the whole job inside the timed call (cuBLAS behind `load_inline`, a
    flash-attention kernel, the reference resubmitted): forbidden kernel names, and — where the
    problem requires it — a call that launched no kernel of the candidate's own. Which kernels are
    its own is the runner's `own` (decided by where they come from, `own_kernels`); where the runner
    could not decide (`own` None), the names decide: any kernel LIBRARY_KERNEL does not match."""
    found = [f"forbidden kernel {k!r}" for k in kernels for pattern in problem.forbidden_kernels
             if re.search(pattern, k)]
    if not problem.require_own_kernel:
        return found
    shown = ", ".join(k[:60] for k in kernels[:4]) or "none"
    shown += ", …" if len(kernels) > 4 else ""
    by_name = [k for k in kernels if not LIBRARY_KERNEL.search(k)]
    if own is not None:
        if not set(own) & set(kernels):
            hint = (f"; by name alone {len(by_name)} would pass ({', '.join(k[:60] for k in by_name[:3])})"
                    if by_name else "")
            found.append(f"no kernel of its own ran: none of the {len(kernels)} kernels it launched comes from "
                         f"its code ({shown}){hint} [{origin or 'by origin'}]")
    elif not by_name:
        found.append(f"no kernel of its own ran: all {len(kernels)} kernels are PyTorch or library kernels "
                     f"({shown}) [by name: the runner could not tell where they came from"
                     f"{': ' + origin if origin else ''}]")
    return found


def _cudart() -> ctypes.CDLL | None:
    candidates = [ctypes.util.find_library("cudart")]
    for root in {os.path.dirname(torch.__file__), *(os.path.dirname(p) for p in torch.__path__)}:
        candidates += glob.glob(os.path.join(root, "..", "nvidia", "*", "lib", "libcudart.so*"))
        candidates += glob.glob(os.path.join(root, "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        candidates += glob.glob(os.path.join(root, "lib", "libcudart*.so*"))
    for path in filter(None, candidates):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def reset_persisting_l2() -> str:
    """Stops L2 residency tricks (persisting access-policy windows that survive the flush): the
    persisting-L2 limit is set to 0 and persisting lines are reset. Returns what was done."""
    lib = _cudart()
    if lib is None:
        return "persisting-L2 reset unavailable (libcudart not found)"
    limit_rc = lib.cudaDeviceSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(0))  # cudaLimitPersistingL2CacheSize
    reset_rc = lib.cudaCtxResetPersistingL2Cache()
    return f"persisting-L2 limit 0 (rc {limit_rc}), reset (rc {reset_rc})"


def host_synced_samples_ms(fn: Callable[..., Any], input_sets: list[list[Any]], flush: torch.Tensor,
                           calls: int = 10) -> dict[str, list[float]]:
    """Collector for `escaped_work`, `calls` calls from a cold L2 as in the event timing, each
    timed by the host three ways: `host_ms`, the call until a device-wide synchronise (which
    waits for every stream); `stream_ms`, the call until an event recorded after it on the
    calling stream has completed; `residue_ms`, host_ms − stream_ms: what the device still had to
    do after the calling stream was done — work that outlived the call on another stream.

    The residue, not host_ms against the event median, is what `escaped_work` judges: a kernel
    that synchronises inside its call (`.item()`, a host-side loop) waits in both host_ms and
    stream_ms alike, so an in-call synchronise never reads as escaped work."""
    host, stream, residue = [], [], []
    with torch.no_grad():
        for i in range(calls):
            flush.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(*input_sets[i % len(input_sets)])
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t2 - t0) * 1e3)
            stream.append((t1 - t0) * 1e3)
            residue.append((t2 - t1) * 1e3)
    return {"host_ms": host, "stream_ms": stream, "residue_ms": residue}


def escaped_work(residue_ms: float, median_ms: float) -> str | None:
    """Rule: stops work hidden on another stream (which the timed stream's events miss): the
    median call leaves the device busy for more than ESCAPE_SLACK_MS + ESCAPE_FRACTION × the event
    median after its own stream is done (`host_synced_samples_ms`). In-call synchronises and host
    work inside the call do not count; an honest call leaves only the synchronise's own latency."""
    if residue_ms > ESCAPE_SLACK_MS + ESCAPE_FRACTION * median_ms:
        return (f"work escaped the timed stream — the device was still busy {residue_ms:.4f} ms after the "
                f"calling stream finished a call timed at {median_ms:.4f} ms between its events (allowed: "
                f"{ESCAPE_SLACK_MS:g} ms + {ESCAPE_FRACTION:g} × the median)")
    return None


def graph_replay_samples_ms(fn: Callable[..., Any], inputs: list[Any], flush: torch.Tensor,
                            replays: int = 20) -> tuple[list[float], Any]:
    """Collector: GPU time of one call with launch overhead removed: the call captured in a CUDA
    graph and replayed after the L2 flush. Reported beside the latency for launch-bound shapes,
    never instead of it. Returns (per-replay ms, the graph's output for the judge to verify)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*inputs)
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, out

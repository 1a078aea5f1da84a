"""Which launched CUDA kernels are the candidate's own, told by where they come from (collector side).

A kernel is the candidate's own by where it comes from, not by what it is called: a Triton
function defined in a file the candidate wrote, a symbol of a shared object built from its code
(its folder, the torch-extension and Triton build caches, the private temp folder), a `__global__`
name or identifier of its sources. A name such as `gemv_w4_kernel` or `cutlass::device_kernel<…>`
says nothing either way; PyTorch's and the vendor libraries' kernels live in files under torch's
and site-packages' folders, which never count. The runner collects (`KernelOrigins`,
`own_kernels`); the judge's rule (`audit.kernel_problems`) uses the answer, and falls back to
kernel names where none could be given. A hostile runner can lie about it, as about every
collector's data.
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
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


def _depth(path: str, folders: Iterable[str]) -> int:
    """Length of the longest of `folders` that holds `path` (-1 if none does)."""
    return max((len(f) for f in folders if path == f or path.startswith(f.rstrip(os.sep) + os.sep)), default=-1)


def _ours(path: str, ours: Iterable[str], library: Iterable[str]) -> bool:
    """Whether `path` is the candidate's: the innermost folder holding it decides, so the solution's
    scratch copy counts even inside a folder that never counts, and torch.compile's cache in the
    temp folder never does."""
    mine = _depth(path, ours)
    return mine >= 0 and mine > _depth(path, library)


def candidate_folders(solution_dir: Path) -> tuple[list[str], list[str]]:
    """(folders whose files the candidate's code made, folders that never count): its folder, the
    torch-extension and Triton build caches (TORCH_EXTENSIONS_DIR, TRITON_CACHE_DIR or their
    defaults; sandbox.worker_env gives each solution its own) and the temp folder (private in the
    jail); never torch's own folder, site-packages, torch.compile's cache in the temp folder, or the
    grader's own code. The innermost folder holding a file decides (`_ours`)."""
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
    checkout = Path(__file__).resolve().parents[1]  # the grader's own code (a checkout may sit in /tmp)
    library.append(str(Path(__file__).resolve().parent))
    if (checkout / "pyproject.toml").exists():
        library.append(str(checkout))
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
    """Each symbol in every form a launched kernel's name can take: mangled as it sits in the binary
    (the profiler leaves a long CUTLASS 3 instantiation mangled where c++filt demangles it: two 01
    kernels on the H100 SXM were refused as running no kernel of their own, grader 0.5.25), and
    demangled, whole, without its parameters, or (a plain kernel) by its qualified name."""
    for sym in symbols:
        code.signatures.add(sym)
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
        if any(f and _ours(_real(f), ours, library) for f in files if os.path.isabs(f)):
            names.add(fn.__name__)
    return names


def _source_files(folders: list[str], library: list[str]) -> list[Path]:
    files: list[Path] = []
    for folder in folders:
        for root, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if _ours(_real(os.path.join(root, d)), [folder], library)]
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
        built = [p for p in mapped if _ours(_real(p), ours, library)]
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



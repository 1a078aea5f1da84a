"""Failures that say nothing about a kernel on this GPU, told apart after the fact (judge side, no torch).

A kernel that fails to build or run here is a `build_error` or `runtime_error`, a score of 0 — unless
the failure is not the kernel's doing on this GPU. Two such cases are common among published runs
regraded on another GPU, and each gets a status that is never scored (never a 0, never ranked):

- `needs_other_arch`: the kernel targets a newer architecture than the GPU grading it (tcgen05, TMEM
  and `cta_group::` exist from sm_100a on; `-arch=sm_100a`, `compute_100`, `__CUDA_ARCH__ >= 1000`…).
  Decided from the error text (ptxas' "not supported on .target 'sm_90a'", "requires .target
  sm_100a", nvcc's "Unsupported gpu architecture 'compute_100a'", "no kernel image is available"…)
  and from a text scan of the submission's files; the message names the evidence and the GPU's
  capability.
- `not_reproducible`: the failure's cause is a file the published submission does not contain — a
  header no file of it or of the system provides (`fatal error: X: No such file or directory`),
  a module or file it expects beside itself, a tool at a hard-coded absolute path this machine
  does not have (`/usr/bin/nvcc`), a helper of the original grader's reference.py that the deck's
  rewritten reference lacks (`reference._rmsnorm`). The message names what is missing. A kernel
  whose build adds a CUTLASS folder beside itself as an include folder, a folder the published files
  lack, is built against the grader's own CUTLASS instead (it is on CPATH), which need not be the one
  it was written for: its failure is `not_reproducible` too where the evidence ties it to CUTLASS (a
  build or run error naming CUTLASS; for a `wrong` output, its files calling their CUTLASS changed:
  gpt-5.6-sol's 07 of 2026-07-21 says "customized", and stock CUTLASS's zero-point mode computes
  `scale * q + zero` where its comment says `(q - zero) * scale`).

Why after the failure and from text: the grader must never refuse a kernel for what it merely
mentions (a comment about sm_100 on a kernel that works), and the evidence sits in compiler output
and source text, which the judge can read without running anything. Why cautious: the error text
and the files are the candidate's, so each rule asks for evidence a working kernel would not give
(the toolchain's own words, or newer-arch code outside comments with no target for this GPU
beside it); a comment alone never turns a failure into a non-score. Everything else stays
`build_error` / `runtime_error`, as before.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .cutlass_headers import Cutlass

NEEDS_OTHER_ARCH = "needs_other_arch"
NOT_REPRODUCIBLE = "not_reproducible"

_MAX_FILE_BYTES = 4 << 20  # a larger file is not source anyone reads
_MAX_FILES = 400
_MAX_MESSAGE = 600
_SKIP = {"run.yaml"}
_C_SUFFIXES = {".cu", ".cuh", ".h", ".hh", ".hpp", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".inl", ".ptx", ".ipp"}
_PROSE_SUFFIXES = {".md", ".txt", ".rst"}

# ------------------------------------------------------------------------------ architectures

#: Newer-architecture markers in source text (one alternative per kind; see `_arch_of`).
_NEWER = re.compile(
    r"(?P<tc>\btcgen05(?:\.[A-Za-z_0-9:]+)*)"
    r"|(?P<cg>\bcta_group::[12]\b)"
    r"|(?P<tmem>\btmem_(?:alloc|dealloc|load|store)\b|\bUMMA\b)"
    r"|(?P<sm>(?<![A-Za-z0-9])(?:[sS][mM]|compute)_?(?P<num>1[0-2][0-9])(?P<suf>[af]?)(?![0-9]))"
    r"|(?P<gate>__CUDA_ARCH__\s*>=?\s*(?P<gnum>1[0-2][0-9])0\b)"
    r"|(?P<list>TORCH_CUDA_ARCH_LIST\W{1,8}(?P<lmaj>1[0-2])\.(?P<lmin>[0-9])(?P<lsuf>a?))"
)

#: The toolchain refusing newer-architecture code, in its own words (enough on their own).
_TOOLCHAIN = (
    re.compile(r"(?:Instruction|Feature|Modifier) '(?P<what>[^']{1,80})'[^\n]{0,40}?requires\s+\.?target\s+'?"
               r"(?P<arch>sm_[0-9]+[af]?)"),
    re.compile(r"requires\s+\.target\s+'?(?P<arch>sm_[0-9]+[af]?)"),
    re.compile(r"(?:Instruction|Feature|Modifier) '(?P<what>[^']{1,80})' not supported on \.target '?sm_[0-9]+"),
    re.compile(r"Unsupported gpu architecture '(?:compute|sm)_(?P<num>[0-9]+[af]?)'"),
)

#: Errors that point at an architecture mismatch but could come from anywhere: they count only with a
#: newer-architecture marker in the submission's files.
_GENERIC = re.compile(
    r"no kernel image is available for execution on the device|invalid device function"
    r"|(?<![A-Za-z0-9])(?:sm|compute)_?1[0-2][0-9][af]?(?![0-9])|\btcgen05\b|\bBlackwell\b",
    re.IGNORECASE,
)
_FAMILY = re.compile(r"tcgen05|cta_group|tmem", re.IGNORECASE)


@dataclass(frozen=True)
class Hit:
    """A newer-architecture marker in one of the submission's files."""

    file: str  # relative to the submission
    line: int
    token: str
    arch: str  # the architecture it needs: sm_100a, sm_100, sm_120…
    code: bool  # outside comments, docstrings and prose (and not a bare name like `sm100`)

    def where(self) -> str:
        return f"{self.file}:{self.line} has {self.token!r}{'' if self.code else ' (not in code)'}"


def own_arch(capability: str | None) -> int | None:
    """The grading GPU's architecture number (9.0 → 90), or None when unknown (the CPU)."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", capability or "")
    return int(m.group(1)) * 10 + int(m.group(2)) if m else None


def _arch_of(m: re.Match[str]) -> str:
    if m.group("sm"):
        return f"sm_{m.group('num')}{m.group('suf')}"
    if m.group("gate"):
        return f"sm_{m.group('gnum')}"
    if m.group("list"):
        return f"sm_{m.group('lmaj')}{m.group('lmin')}{m.group('lsuf')}"
    return "sm_100a"  # tcgen05, cta_group::, TMEM: the sm_100a family's


def _family(m: re.Match[str]) -> bool:
    return bool(m.group("tc") or m.group("cg") or m.group("tmem"))


def runs_on(arch: str, own: int, family: bool = False) -> bool:
    """Whether code built for `arch` can run on a GPU of architecture `own`: a plain target runs on
    its architecture and later ones, an `a` target on that architecture only, an `f` target on that
    family; the tcgen05 family (sm_100a, sm_101a, sm_103a, sm_110a) on 10.x and 11.x only."""
    if family:
        return own // 10 in (10, 11)
    m = re.fullmatch(r"sm_(\d+)([af]?)", arch)
    if m is None:
        return True
    num, suffix = int(m.group(1)), m.group(2)
    if suffix == "a":
        return num == own
    if suffix == "f":
        return num // 10 == own // 10 and num <= own
    return num <= own


# ------------------------------------------------------------------------------ reading the files


def text_files(folder: Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every text file of a submission (run.yaml, caches and binaries left out)."""
    if not folder.is_dir():
        return
    count = 0
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if rel in _SKIP or "__pycache__" in path.parts or any(p.startswith(".git") for p in path.parts):
            continue
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_FILE_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:8192]:
            continue
        count += 1
        if count > _MAX_FILES:
            return
        yield rel, data.decode("utf-8", errors="replace")


def _blank(text: str) -> str:
    return re.sub(r"[^\n]", " ", text)


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def _c_code(text: str) -> str:
    """C/C++/CUDA/PTX text with its comments blanked (same length, same lines)."""
    return _C_COMMENT.sub(lambda m: _blank(m.group()), text)


def _py_code(text: str) -> str:
    """Python text with comments and docstrings blanked, and the comments inside its other strings
    (CUDA sources for load_inline) blanked too; unparsable text loses only its `#` comments."""
    try:
        tree = ast.parse(text)
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, ValueError, tokenize.TokenError):
        return re.sub(r"#[^\n]*", lambda m: _blank(m.group()), text)
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.add((first.lineno, first.col_offset))
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out = list(text)
    for tok in tokens:
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        a = starts[tok.start[0] - 1] + tok.start[1]
        b = starts[tok.end[0] - 1] + tok.end[1]
        piece = text[a:b]
        if tok.type == tokenize.COMMENT or tok.start in docs:
            out[a:b] = _blank(piece)
        else:
            out[a:b] = _c_code(piece)
    return "".join(out)


def code_view(name: str, text: str) -> str:
    """The text with everything that is not code blanked: comments, docstrings, prose files."""
    suffix = Path(name).suffix.lower()
    if suffix == ".py":
        return _py_code(text)
    if suffix in _C_SUFFIXES:
        return _c_code(text)
    if suffix in _PROSE_SUFFIXES:
        return _blank(text)
    return text


def newer_arch_hits(folder: Path, own: int) -> tuple[list[Hit], bool]:
    """The markers in the submission's files of an architecture a GPU of `own` cannot run, and
    whether its code (outside comments) also targets `own` itself (then it is a multi-target kernel,
    and its files alone prove nothing)."""
    hits: list[Hit] = []
    targets_own = False
    own_re = re.compile(rf"(?<![A-Za-z0-9])(?:sm|compute)_?{own}a?(?![0-9])|TORCH_CUDA_ARCH_LIST\W{{1,8}}"
                        rf"{own // 10}\.{own % 10}", re.IGNORECASE)
    for rel, text in text_files(folder):
        code = code_view(rel, text)
        targets_own = targets_own or own_re.search(code) is not None
        for m in _NEWER.finditer(text):
            arch, family = _arch_of(m), _family(m)
            if runs_on(arch, own, family):
                continue
            line = text.count("\n", 0, m.start()) + 1
            # `sm100` without its underscore is mostly a name (an extension's, a module's): never decisive
            named = re.fullmatch(r"[sS][mM]1[0-2][0-9][af]?", m.group()) is not None
            hits.append(Hit(rel, line, m.group()[:60], arch, code[m.start():m.end()] == m.group() and not named))
    return hits, targets_own


# ------------------------------------------------------------------------------ the verdicts


def _cut(text: str, limit: int = _MAX_MESSAGE) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _arch_label(arch: str) -> str:
    return f"sm_{arch[3:]}" if arch.startswith("sm_") else arch


def needs_other_arch(text: str, folder: Path, capability: str | None, status: str) -> str | None:
    """The `needs_other_arch` message for a failure (`text`: its message and error text), or None."""
    own = own_arch(capability)
    if own is None:
        return None
    hits, targets_own = newer_arch_hits(folder, own)
    best = next((h for h in hits if h.code), hits[0] if hits else None)
    gpu = f"the GPU grading it is sm_{own} (capability {capability})"
    for pattern in _TOOLCHAIN:
        m = pattern.search(text)
        if m is None:
            continue
        groups = m.groupdict()
        what = groups.get("what") or ""
        family = _FAMILY.search(what) is not None
        if groups.get("arch"):
            arch = groups["arch"]
        elif groups.get("num"):
            arch = f"sm_{groups['num']}"
        elif family:
            arch = "sm_100a"
        elif best is not None:  # "not supported on .target": which target it needs, the files say
            arch = best.arch
        else:  # an sm_90 instruction built for an older target: the build's own mistake
            continue
        if runs_on(arch, own, family):
            continue
        also = f"; {best.where()}" if best else ""
        return f"needs {_arch_label(arch)}: the toolchain says {m.group().strip()!r}{also}; {gpu}"
    if not hits:
        return None
    generic = _GENERIC.search(text)
    if generic is not None:
        return f"needs {best.arch}: the error says {generic.group().strip()[:100]!r}; {best.where()}; {gpu}"
    code = [h for h in hits if h.code]
    if code and not targets_own and status in ("build_error", "runtime_error"):
        more = f" (and {len(code) - 1} more)" if len(code) > 1 else ""
        return f"needs {code[0].arch}: {code[0].where()}{more}, with no target for this GPU; {gpu}"
    return None


# headers any CUDA / torch build may include from the system, never from the submission
_SYSTEM_PREFIXES = (
    "cuda", "cub/", "thrust/", "nv/", "crt/", "cutensor", "cublas", "cudnn", "cusparse", "curand", "cufft",
    "cusolver", "nvrtc", "nvtx", "nvToolsExt", "nvml", "npp", "mma.h", "sm_", "math_constants", "cooperative_groups",
    "vector_types", "vector_functions", "device_", "driver_types", "host_", "texture_", "surface_", "library_types",
    "builtin_types", "channel_descriptor", "common_functions", "math_functions", "nvfunctional", "torch/", "ATen/",
    "c10/", "caffe2/", "pybind11/", "Python.h", "sys/", "bits/", "linux/", "asm/", "c++/", "ext/", "gnu/",
)


def _system_include_dirs() -> list[Path]:
    dirs = [Path("/usr/include"), Path("/usr/local/include")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            dirs += [Path(home) / "include", *Path(home).glob("targets/*/include")]
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        dirs += [Path(root) / "include", Path(root) / "include" / "torch" / "csrc" / "api" / "include"]
    return dirs


def _system_header(header: str) -> bool:
    if "." not in header and "/" not in header:  # <vector>, <cstdint>
        return True
    if header.startswith(_SYSTEM_PREFIXES):
        return True
    return any((d / header).is_file() for d in _system_include_dirs())


def _in_submission(name: str, folder: Path) -> bool:
    """Whether the submission has a file at `name` or ending with it (an include path problem, then)."""
    name = name.lstrip("./")
    if not name or ".." in name.split("/"):
        return False
    if (folder / name).exists():
        return True
    tail = "/" + name
    return any(("/" + rel).endswith(tail) for rel, _ in text_files(folder))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


#: Libraries a kernel may import that a grading machine may lack: their absence is the grader's
#: environment, not a file missing from the submission (the failure stays a build_error).
_LIBRARIES = frozenset({
    "flashinfer", "flash_attn", "flash_attn_interface", "cutlass", "cuda", "cupy", "tilelang", "thunderkittens",
    "deep_gemm", "sgl_kernel", "vllm", "xformers", "apex", "transformer_engine", "triton", "numba", "pycuda", "fla",
    "liger_kernel", "quack", "tvm", "hidet", "jax", "cudnn", "nvmath", "cuda_bindings", "torchao", "bitsandbytes",
    "marlin", "cutlass_library", "pycute", "tensorrt", "tk", "helion", "mojo", "warp", "ninja", "pybind11", "numpy",
    "scipy", "einops", "safetensors", "nvidia",
})

_HEADER_MISSING = (
    re.compile(r"fatal error: (?P<h>[^\s:'\"]+): No such file or directory"),
    re.compile(r"fatal error: '(?P<h>[^']+)' file not found"),
    re.compile(r"cannot open source file \"(?P<h>[^\"]+)\""),
)
_PATH_MISSING = (
    re.compile(r"No such file or directory: '(?P<p>[^']+)'"),
    re.compile(r"(?P<p>/[\w.+\-/]+): (?:not found|No such file or directory)"),
    re.compile(r"can't open file '(?P<p>[^']+)'"),
)
#: A solution that reads a helper of the original grader's reference.py (a private `_rmsnorm`, say): the
#: decks' references are rewritten from each problem's definition, so their public interface
#: (Model, get_inputs, …) matches and their helpers need not.
_REFERENCE_NAME = re.compile(r"module 'reference' has no attribute '(?P<a>[A-Za-z_]\w*)'")
_TOOL_VARS = ("PYTORCH_NVCC", "CUDA_HOME", "CUDA_PATH", "CUDACXX", "NVCC", "CXX", "CC")


def _hard_coded(path: str, folder: Path) -> str | None:
    """The literal in the submission's files that names `path` or a missing folder above it, or None."""
    parts = Path(path).parts
    literals = [str(Path(*parts[:i])) for i in range(len(parts), 2, -1)]
    literals = [lit for lit in literals if not os.path.exists(lit)]
    for _, text in text_files(folder):
        for lit in literals:
            if lit in text:
                return lit
    return None


def _missing(text: str, folder: Path, ran_in: Path | None, cutlass: Cutlass | None) -> tuple[str, str] | None:
    """(status, message) when the failure's cause is a file the submission does not contain, else None."""
    for pattern in _HEADER_MISSING:
        for m in pattern.finditer(text):
            header = m.group("h")
            if _in_submission(header, folder) or _system_header(header):
                continue
            if header.startswith(("cutlass/", "cute/")):
                if cutlass is None:
                    return "not_graded", (f"{header}: the kernel includes CUTLASS headers and this grader has none "
                                          f"(install the nvidia-cutlass package, or set KERNELBOARD_CUTLASS)")
                return NOT_REPRODUCIBLE, (f"{header} is neither in the published files nor in the grader's "
                                          f"CUTLASS {cutlass.version or ''} ({cutlass.includes[0]})")
            return NOT_REPRODUCIBLE, (f"it includes {header}, which is neither in the published files nor a "
                                      f"system header")
    m = _REFERENCE_NAME.search(text)
    if m is not None and any(re.search(rf"\b{m.group('a')}\b", code_view(rel, source))
                             for rel, source in text_files(folder) if rel.endswith(".py")):
        return NOT_REPRODUCIBLE, (f"it uses reference.{m.group('a')}, a name of the original harness's "
                                  f"reference.py that this deck's reference (written from the problem's "
                                  f"definition, not copied) does not define")
    m = re.search(r"No module named '(?P<m>[\w.]+)'", text)
    if m is not None:
        top = m.group("m").split(".")[0]
        if (not _installed(top) and top not in _LIBRARIES and not (folder / f"{top}.py").exists()
                and not (folder / top).is_dir()):
            return NOT_REPRODUCIBLE, f"it imports module {m.group('m')!r}, which the published files do not contain"
    for pattern in _PATH_MISSING:
        for m in pattern.finditer(text):
            path = m.group("p")
            inside = None
            if not os.path.isabs(path):
                inside = path
            elif ran_in is not None and (path + "/").startswith(str(ran_in).rstrip("/") + "/"):
                inside = os.path.relpath(path, ran_in)
            if inside is not None:
                if inside not in (".", "") and not _in_submission(inside, folder):
                    return NOT_REPRODUCIBLE, f"it expects {inside} beside solution.py, and the published files lack it"
                continue
            if not os.path.exists(path) and (lit := _hard_coded(path, folder)) is not None:
                return NOT_REPRODUCIBLE, f"it hard-codes {lit}, which this machine does not have ({path} is missing)"
    if re.search(r"Error building extension|nvcc|ninja", text):  # the tool's own complaint may be cut off
        for rel, source in text_files(folder):
            code = code_view(rel, source)
            for m in re.finditer(rf"^(?:os\.environ\[[\"'](?P<var>{'|'.join(_TOOL_VARS)})[\"']\]\s*=\s*|"
                                 rf"os\.environ\.setdefault\([\"'](?P<var2>{'|'.join(_TOOL_VARS)})[\"'],\s*)"
                                 r"[rRbB]?[\"'](?P<p>/[^\"']+)[\"']", code, re.MULTILINE):
                if m.group("var2") and m.group("var2") in os.environ:
                    continue  # setdefault of a variable the grader sets: it changes nothing
                if not os.path.exists(m.group("p")):
                    var = m.group("var") or m.group("var2")
                    return NOT_REPRODUCIBLE, (f"{rel} sets {var} to {m.group('p')}, which this machine does not "
                                              f"have")
    return None


#: Include folders in a torch/setuptools build call: keyword lists of paths, and "-I…" flags.
_INCLUDE_KEYWORDS = ("extra_include_paths", "include_dirs")
_FLAG_KEYWORDS = ("extra_cuda_cflags", "extra_cflags", "nvcc_flags", "extra_compile_args")
_CUTLASS_INCLUDE = re.compile(r"#\s*include\s*[<\"](?:cutlass|cute)/")
_CUTLASS_PART = re.compile(r"cutlass|cute", re.IGNORECASE)
#: An error line that names CUTLASS (a header of it, or its namespace), not the build's command line, which
#: carries the kernel's own `-I…/cutlass/include` whatever failed.
_CUTLASS_ERROR = re.compile(r"^[^\n]*(?:\berror\b|\bfailed\b)[^\n]*(?:\bcutlass\b|\bcute\b)"
                            r"|^[^\n]*(?:\bcutlass\b|\bcute\b)[^\n]*(?:\berror\b|\bfailed\b)",
                            re.IGNORECASE | re.MULTILINE)
_CHANGED_CUTLASS = re.compile(r"\b(?:customi[sz]ed|modified|patched|forked|hacked)\s+CUTLASS\b[^\n.;]{0,60}",
                              re.IGNORECASE)


def _names_file(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node))


def _own_folders(tree: ast.AST) -> dict[str, list[str]]:
    """Names bound to the solution's own folder or a folder under it, each with its parts under it:
    `root = Path(__file__).resolve().parent` → [], then `inc = os.path.join(root, "cutlass", "include")`
    → ["cutlass", "include"]. A name bound to anything else is left out."""
    folders: dict[str, list[str]] = {}
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    for _ in range(3):  # names bound from names bound later in the file
        for node in assigns:
            parts = _beside(node.value, folders)
            if parts is not None:
                folders.update({t.id: parts for t in node.targets if isinstance(t, ast.Name)})
    return folders


def _beside(node: ast.AST, own: dict[str, list[str]]) -> list[str] | None:
    """The path parts an expression adds under the solution's own folder (`root / "cutlass" / "include"`,
    `os.path.join(HERE, "cutlass/include")`, `f"{root}/cutlass/include"`), or None where it names no
    folder of the solution's (an absolute path, a variable of the environment, anything unread)."""
    def const_parts(n: ast.AST) -> list[str] | None:
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            return [p for p in n.value.split("/") if p not in ("", ".")]
        return None

    def under(base: ast.AST, rest: list[ast.expr]) -> list[str] | None:  # base / "a" / "b", every piece read
        parts = [_beside(base, own), *map(const_parts, rest)]
        return None if any(p is None for p in parts) else [q for p in parts for q in p or []]

    if isinstance(node, ast.Name):
        return list(own[node.id]) if node.id in own else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Add)):
        return under(node.left, [node.right])
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.FormattedValue):
        return under(node.values[0].value, node.values[1:])
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "join" and node.args:
            return under(node.args[0], node.args[1:])
        if name in ("str", "fspath", "Path", "abspath", "realpath", "normpath") and len(node.args) == 1:
            return _beside(node.args[0], own)
        if name in ("resolve", "absolute") and isinstance(func, ast.Attribute):
            return _beside(func.value, own)
    # the solution's folder itself, one level up from __file__ (`Path(__file__).resolve().parent`,
    # `os.path.dirname(os.path.abspath(__file__))`); two levels up is outside the submission
    return [] if _names_file(node) and sum(map(_one_level_up, ast.walk(node))) == 1 else None


def _one_level_up(node: ast.AST) -> bool:
    """`x.parent` or `os.path.dirname(x)`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "parent"
    if isinstance(node, ast.Call):
        func = node.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) == "dirname"
    return False


def _include_folders(tree: ast.AST, own: dict[str, list[str]]) -> Iterator[tuple[int, list[str]]]:
    """(line, parts under the solution's folder) of each include folder its build calls name."""
    lists = {t.id: n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, (ast.List, ast.Tuple))}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        for kw in call.keywords:
            value = lists.get(kw.value.id, kw.value) if isinstance(kw.value, ast.Name) else kw.value
            if kw.arg not in _INCLUDE_KEYWORDS + _FLAG_KEYWORDS or not isinstance(value, (ast.List, ast.Tuple)):
                continue
            for element in value.elts:
                if kw.arg in _FLAG_KEYWORDS:  # f"-I{root}/cutlass/include"
                    if not (isinstance(element, ast.JoinedStr) and len(element.values) >= 2
                            and isinstance(element.values[0], ast.Constant) and element.values[0].value == "-I"):
                        continue
                    element = ast.JoinedStr(values=element.values[1:])
                parts = _beside(element, own)
                if parts:
                    yield element.lineno if hasattr(element, "lineno") else call.lineno, parts


@dataclass(frozen=True)
class Vendored:
    """A CUTLASS folder a kernel's build names beside itself, which the published files lack."""

    folder: str  # relative to the submission
    where: str  # file:line of the build call
    changed: str | None  # the kernel's files' own words for a changed CUTLASS ("customized CUTLASS …")

    def why(self, cutlass: Cutlass) -> str:
        said = f"; its files speak of a {self.changed!r}" if self.changed else ""
        return (f"its build adds {self.folder} beside solution.py as an include folder ({self.where}), which the "
                f"published files lack, so it was built against the grader's CUTLASS {cutlass.version or ''}"
                f"{said}")


def vendored_cutlass_missing(folder: Path) -> Vendored | None:
    """The CUTLASS folder the kernel's build adds beside itself as an include folder (`root / "cutlass" /
    "include"`) that the published files lack, where its sources include `cutlass/` or `cute/` headers:
    those came from the grader's CUTLASS, a stand-in for a copy the agent may have changed. None when
    there is none."""
    files = list(text_files(folder))
    if not any(_CUTLASS_INCLUDE.search(code_view(rel, text)) for rel, text in files):
        return None
    for rel, text in files:
        if not rel.endswith(".py"):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for line, parts in _include_folders(tree, _own_folders(tree)):
            vendored = "/".join(parts)
            if ".." in parts or not any(_CUTLASS_PART.search(p) for p in parts) or (folder / vendored).exists():
                continue
            changed = next((m.group().strip() for _, t in files if (m := _CHANGED_CUTLASS.search(t))), None)
            return Vendored(vendored, f"{rel}:{line}", changed)
    return None


def cutlass_stood_in(status: str, text: str, folder: Path, cutlass: Cutlass | None) -> str | None:
    """Why a failure is the stand-in CUTLASS's rather than the kernel's, or None. The missing folder alone
    does not say so (claude-fable-5's 07 of 2026-07-03 fails at M = 1, on its own mma.sync path, with
    CUTLASS only for large M): a build or run failure must name CUTLASS in its error text, and a `wrong`
    output needs the kernel's files to call their CUTLASS changed (gpt-5.6-sol's 07 of 2026-07-21:
    "customized CUTLASS register transform")."""
    if cutlass is None or (vendored := vendored_cutlass_missing(folder)) is None:
        return None
    named = _CUTLASS_ERROR.search(text) is not None
    if vendored.changed or (status in ("build_error", "runtime_error") and named):
        return vendored.why(cutlass)
    return None


def classify(status: str, message: str, error_text: str, folder: Path, capability: str | None,
             ran_in: Path | None = None, cutlass: Cutlass | None = None) -> tuple[str, str] | None:
    """A better (status, message) for a failed grading, or None to keep it: `needs_other_arch` or
    `not_reproducible` (or `not_graded` for CUTLASS headers the grader lacks) for a `build_error` or
    `runtime_error`, `not_reproducible` for a `wrong` built against the grader's CUTLASS in place of a
    vendored one the published files lack; anything else is kept. `folder`: the submission as published
    (never the scratch copy its code ran in, `ran_in`, whose paths appear in error texts); `capability`:
    the GPU's."""
    if status not in ("build_error", "runtime_error", "wrong"):
        return None
    text = f"{message}\n{error_text}"
    if status != "wrong":  # built and ran: only a stand-in for files it lacks can excuse a wrong output
        arch = needs_other_arch(text, folder, capability, status)
        if arch is not None:
            return NEEDS_OTHER_ARCH, _cut(f"{arch} — {message}")
        found = _missing(text, folder, ran_in, cutlass)
        if found is not None:
            new_status, why = found
            prefix = "not reproducible from the published files: " if new_status == NOT_REPRODUCIBLE else ""
            return new_status, _cut(f"{prefix}{why} — {message}")
    stood_in = cutlass_stood_in(status, text, folder, cutlass)
    if stood_in is None:
        return None
    return NOT_REPRODUCIBLE, _cut(f"not reproducible from the published files: {stood_in} — {message}")

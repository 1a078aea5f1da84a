"""Foreign deck formats read into deck.py's `Problem`, so the grader never sees the difference (no torch).

`detect_format` tells three formats apart; `load_problem_any` and `load_deck_any` (behind deck.py's
`load_problem` and `load_deck`) load any of them. Nothing here imports a problem's code: Python
files are read with `ast`, so a deck loads without torch and without running anything.

- **kernelboard**: a folder whose `problem.yaml` has `shapes:` and `shape_globals:` (deck.py).
- **KernelBench-Hard** (`kernelbench-hard`): a folder with `reference.py`, `shapes.py` and
  `problem.yaml` (hard-deck-interface.md §A.1). `SHAPES` must be a literal list of dicts; each
  key sets the reference global `KEY.upper()` if reference.py assigns it at top level, else the
  global spelled like the key (§B.x.1). A dict's trailing comment becomes its label. Tolerances
  follow §A.7: a scalar or `{atol, rtol}` (missing = 0, numeric strings coerced), and a
  `torch.<dtype>` key beats `<dtype>`, for stress cases too. Seeds 42, 123, 456. `check.py`,
  `benchmark.py`, `sota.py` and `PROMPT.txt` are ignored, as are the yaml's informational keys
  (`hardware`, `peak_bandwidth_key`, `num_perf_trials`, `sota`, …). The problem is the folder's
  name; its bench is the deck folder's name, or `hard` for `problems` and `problems-<gpu>`.
  Three kernelboard keys may be added to its problem.yaml: `cpu_shapes` (none otherwise, so
  `--device cpu` reports it not graded), `numeric_stress` (none otherwise: KernelBench-Hard keeps
  its cases in check.py) and `shape_globals` (instead of the inference).
- **ScalingIntelligence KernelBench** (`kernelbench`): one level file per problem in the deck
  folder, e.g. `19_ReLU.py` with `class Model`, top-level size constants, `get_inputs()` and
  `get_init_inputs()`; the candidate defines `ModelNew` with the same constructor and both models
  are built right after the same `torch.manual_seed`. One shape, "default", the file's own
  constants; deck.py's `DEFAULT_TOLERANCE` (fp32 1e-4, fp16 and bf16 1e-2); no roofline; regime
  `compute`, precision and peak key `fp32`; name the stem, display name the stem without its
  number, underscores as spaces; bench the deck folder's name. A sibling `<stem>.yaml` in
  kernelboard's format may add the keys in `SI_KB_OVERLAY_KEYS`: notably `cpu_shapes` (none
  otherwise), and `shape_globals` naming constants of the file, whose literal values then make
  the default shape. Such a problem's `folder` is its file (see `Problem.reference_path`), so a
  grading worker can reload it from `folder` alone; `deck/<stem>` also names it.

Refused, each with a `DeckError` naming the file: a `SHAPES` that is not a literal; a shape key
that sets no reference global (a key only check.py reads, like 04_kahan_softmax's `extreme`); a
non-integer or non-positive size; kernelboard keys a KernelBench-Hard folder cannot honour
(`seeds`, `structural_stress`, …); an overlay key outside `SI_KB_OVERLAY_KEYS`; a folder or file
that matches no format. Not modelled: KernelBench-Hard's state scaling (01's `small_weight`), its
property stress and tuple outputs (05) — they live in its check.py, not in the folder.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import DeckError

from .deck import (  # the types, and its parsers shared with these formats
    Problem,
    Shape,
    StressCase,
    _check_formulas,
    _Fields,
    _numeric_stress,
    _shapes,
    _tolerances,
    evaluate_formula,
    load_native_problem,
)
from .hardware import PRECISIONS
from .schema import REGIMES

NATIVE, KB_HARD, SI_KB = "kernelboard", "kernelbench-hard", "kernelbench"
FORMATS = (NATIVE, KB_HARD, SI_KB)

#: KernelBench-Hard's check.py seeds (§A.4), used for KernelBench files too. (Its benchmark seed 2026
#: draws timing inputs; kernelboard adds a fresh seed per grading run anyway.)
SEEDS = (42, 123, 456)
#: kernelboard keys a KernelBench-Hard problem.yaml may add.
KB_HARD_OVERLAY_KEYS = ("cpu_shapes", "numeric_stress", "shape_globals")
#: kernelboard keys it may not: they would be silently meaningless there.
KB_HARD_REFUSED_KEYS = ("bench", "seeds", "structural_stress", "solution_class", "weight_transfer",
                        "forbidden_ops", "forbidden_kernels", "require_own_kernel")
#: Keys a ScalingIntelligence KernelBench `<stem>.yaml` may hold, in kernelboard's format.
SI_KB_OVERLAY_KEYS = ("display_name", "regime", "precision", "peak_tflops_key", "flops_formula",
                      "bytes_formula", "shape_globals", "shapes", "cpu_shapes", "seeds", "tolerance",
                      "numeric_stress", "forbidden")
_SI_KB_NAMES = ("Model", "get_inputs", "get_init_inputs")


# ------------------------------------------------------------------------------ detection


def detect_format(path: Path) -> str:
    """Which of `FORMATS` the problem at `path` is in (a folder, a `.py` file, or `deck/<stem>`)."""
    if path.is_file():
        if path.suffix == ".py":
            return SI_KB
        raise DeckError(f"{path}: a problem is a folder or a KernelBench level file (.py), not this file")
    if not path.exists():
        if _si_kb_file(path).is_file():
            return SI_KB
        raise DeckError(f"{path}: no such problem folder or file")
    yaml_path = path / "problem.yaml"
    data = _read_yaml(yaml_path) if yaml_path.is_file() else {}
    if not isinstance(data, dict):
        raise DeckError(f"{yaml_path}: expected a mapping, got {type(data).__name__}")
    has_ref, has_shapes = (path / "reference.py").is_file(), (path / "shapes.py").is_file()
    native = [k for k in ("shapes", "shape_globals") if k in data]
    if len(native) == 2:
        return NATIVE
    if has_ref and has_shapes:
        if "shapes" in data:
            raise DeckError(f"{yaml_path}: key 'shapes' is kernelboard's format but shapes.py is KernelBench-Hard's: "
                            "add 'shape_globals' (kernelboard) or remove 'shapes' (KernelBench-Hard)")
        return KB_HARD
    lacks = " or ".join(f"'{k}'" for k in ("shapes", "shape_globals") if k not in data) + " in problem.yaml" \
        if yaml_path.is_file() else "problem.yaml"
    raise DeckError(
        f"{path}: matches no deck format: not kernelboard's (no {lacks}), not KernelBench-Hard's "
        f"(no {' and '.join(n for n, ok in (('reference.py', has_ref), ('shapes.py', has_shapes)) if not ok)}), "
        "and not a KernelBench level file (N_Name.py)")


def load_problem_any(path: Path) -> Problem:
    """Load one problem in whichever format `detect_format` finds."""
    fmt = detect_format(path)
    if fmt == NATIVE:
        return load_native_problem(path)
    if fmt == KB_HARD:
        return load_kb_hard_problem(path)
    return load_si_kb_problem(_si_kb_file(path))


def load_deck_any(deck_dir: Path) -> dict[str, Problem]:
    """Every problem of a deck by name, in natural order: problem folders (kernelboard or
    KernelBench-Hard) and KernelBench level files may mix. Every bad problem is listed in one error."""
    if not deck_dir.is_dir():
        raise DeckError(f"{deck_dir}: no such deck folder")
    if (deck_dir / "reference.py").is_file():
        raise DeckError(f"{deck_dir}: this is a problem folder, not a deck: pass the folder that holds it")
    entries = sorted((p for p in deck_dir.iterdir() if not p.name.startswith((".", "_"))), key=_natural)
    files = [p for p in entries if p.is_file() and p.suffix == ".py"]
    folders = [p for p in entries if p.is_dir() and any((p / n).is_file() for n in
                                                         ("problem.yaml", "reference.py", "shapes.py"))]
    errors = [f"{p}: an overlay for {p.stem}.py, which is not in the deck" for p in entries
              if files and p.suffix == ".yaml" and p.is_file() and not p.with_suffix(".py").is_file()]
    problems: dict[str, Problem] = {}
    for path in sorted(folders + files, key=_natural):
        try:
            problem = load_problem_any(path)
        except DeckError as exc:
            errors.append(exc.message)
            continue
        if problem.name in problems:
            errors.append(f"{path}: problem {problem.name!r} is also {problems[problem.name].folder}")
        problems[problem.name] = problem
    if errors:
        head = errors[0] if len(errors) == 1 else f"{len(errors)} problems in the deck {deck_dir}:"
        raise DeckError(head if len(errors) == 1 else head + "\n" + "\n".join(f"  {e}" for e in errors))
    if not problems:
        raise DeckError(f"{deck_dir}: no problem folders (kernelboard or KernelBench-Hard) "
                        "and no KernelBench level files (N_Name.py)")
    return problems


def _natural(path: Path) -> tuple[float, str]:
    """'2_x' before '10_x': KernelBench's level files are not zero-padded."""
    m = re.match(r"\d+", path.name)
    return (int(m.group()) if m else math.inf, path.name)


def _si_kb_file(path: Path) -> Path:
    return path if path.suffix == ".py" else path.with_name(path.name + ".py")


# ------------------------------------------------------------------------------ KernelBench-Hard


def load_kb_hard_problem(folder: Path) -> Problem:
    """A KernelBench-Hard problem folder (see the module docstring for what is read and refused)."""
    yaml_path, ref_path, shapes_path = folder / "problem.yaml", folder / "reference.py", folder / "shapes.py"
    if not yaml_path.is_file():
        raise DeckError(f"{folder}: no problem.yaml (a KernelBench-Hard folder has one beside shapes.py)")
    data = _read_yaml(yaml_path)
    f = _Fields(data, str(yaml_path))
    refused = [k for k in KB_HARD_REFUSED_KEYS if k in data]
    if refused:
        raise DeckError(f"{yaml_path}: key '{refused[0]}' is kernelboard's and means nothing in a KernelBench-Hard "
                        f"folder, which takes only {', '.join(KB_HARD_OVERLAY_KEYS)} from kernelboard")
    name = f.get("name", str, folder.name)
    if name != folder.name:
        raise DeckError(f"{yaml_path}: key 'name': expected the folder name {folder.name!r}, got {name!r}")
    listed = _read_shapes_py(shapes_path)
    keys = list(listed[0][1])
    assigned = _assignments(_parse(ref_path))
    if "shape_globals" in data:
        globals_ = {str(k): str(v) for k, v in f.get("shape_globals", dict).items()}
        if set(globals_) != set(keys):
            raise DeckError(f"{yaml_path}: key 'shape_globals': expected the shapes.py keys {sorted(keys)}, "
                            f"got {sorted(globals_)}")
        for key, name_ in globals_.items():
            if name_ not in assigned:
                raise DeckError(f"{yaml_path}: shape_globals.{key}: reference.py assigns no top-level {name_!r}")
    else:
        globals_ = {key: _infer_global(key, assigned, ref_path, shapes_path) for key in keys}
    _check_sizes(shapes_path, listed)
    shapes = tuple(Shape(i, label, params) for i, (label, params) in enumerate(listed))
    tolerance = _kb_hard_tolerances(data.get("tolerance"), f"{yaml_path}: tolerance")
    stress = tuple(StressCase(c.name, c.scale, _torch_prefix_wins({**tolerance, **c.tolerance}))
                   for c in _numeric_stress(f.get("numeric_stress", list, []), f"{yaml_path}: numeric_stress"))
    problem = Problem(
        bench=_kb_hard_bench(folder.parent.name),
        name=name,
        display_name=f.get("display_name", str, name),
        folder=folder,
        regime=_regime(f),
        precision=f.get("precision", str),
        peak_tflops_key=_peak_key(f),
        flops_formula=f.get("flops_formula", str, None),
        bytes_formula=f.get("bytes_formula", str, None),
        shape_globals=globals_,
        shapes=shapes,
        cpu_shapes=_shapes(data["cpu_shapes"], f"{yaml_path}: cpu_shapes", globals_) if "cpu_shapes" in data else (),
        seeds=SEEDS,
        tolerance=_torch_prefix_wins(tolerance),
        numeric_stress=stress,
        forbidden=_strings(f, "forbidden"),
        structural_stress=None,
        raw=data,
    )
    _check_formulas(problem, yaml_path)
    return problem


def _kb_hard_bench(deck_name: str) -> str:
    """KernelBench-Hard's decks are `problems` (graded runs) and `problems-<gpu>`: all one bench."""
    return "hard" if deck_name == "problems" or deck_name.startswith("problems-") else deck_name


def _read_shapes_py(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(label, shape dict) per `SHAPES` entry, read with `ast.literal_eval`: shapes.py never runs.
    The sizes are checked after the keys have found their globals (`_check_sizes`)."""
    tree, text = _parse(path), path.read_text()
    binds = [n for n in tree.body if "SHAPES" in _bound_names(n)]
    if not binds:
        raise DeckError(f"{path}: no top-level `SHAPES = [...]`")
    if len(binds) > 1:
        raise DeckError(f"{path}: SHAPES is bound {len(binds)} times (lines {', '.join(str(n.lineno) for n in binds)});"
                        " kernelboard reads one literal list")
    node = binds[0]
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    computed = node if value is None else next((n for n in ast.walk(value) if not isinstance(n, _LITERAL)), None)
    if computed is not None:
        raise DeckError(f"{path}: line {node.lineno}: SHAPES is not a literal (it uses "
                        f"`{ast.unparse(computed)[:60]}`); kernelboard reads shapes.py without running it, "
                        "so SHAPES must be a list of dict literals")
    shapes = ast.literal_eval(value)  # type: ignore[arg-type]
    if not isinstance(shapes, list | tuple) or not shapes:
        raise DeckError(f"{path}: SHAPES: expected a non-empty list of dicts, got {shapes!r}")
    keys = list(shapes[0]) if isinstance(shapes[0], dict) else []
    out = []
    for i, shape in enumerate(shapes):
        if not isinstance(shape, dict) or not shape or not all(isinstance(k, str) for k in shape):
            raise DeckError(f"{path}: SHAPES[{i}]: expected a dict with string keys, got {shape!r}")
        if set(shape) != set(keys):
            raise DeckError(f"{path}: SHAPES[{i}]: expected the keys of SHAPES[0] {sorted(keys)}, got {sorted(shape)}")
        label = _trailing_comment(text, value.elts[i]) if isinstance(value, ast.List | ast.Tuple) else None
        out.append((label or ", ".join(f"{k}={v}" for k, v in shape.items()), dict(shape)))
    return out


def _check_sizes(path: Path, listed: list[tuple[str, dict[str, Any]]]) -> None:
    for i, (_, shape) in enumerate(listed):
        for key, v in shape.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise DeckError(f"{path}: SHAPES[{i}][{key!r}]: expected a positive integer, got {v!r}")


_LITERAL = (ast.List, ast.Tuple, ast.Dict, ast.Constant, ast.Load, ast.UnaryOp, ast.USub, ast.UAdd)


def _trailing_comment(text: str, node: ast.expr) -> str | None:
    """The `# comment` after a SHAPES entry on its last line (KernelBench-Hard's shape labels)."""
    if node.end_lineno is None or node.end_col_offset is None:
        return None
    line = text.splitlines()[node.end_lineno - 1].encode()[node.end_col_offset:].decode(errors="replace")
    m = re.match(r"\s*,?\s*#\s*(.*\S)", line)
    return m.group(1) if m else None


def _infer_global(key: str, assigned: dict[str, ast.expr | None], ref_path: Path, shapes_path: Path) -> str:
    for name in (key.upper(), key):
        if name in assigned:
            return name
    spelled = f"{key.upper()} nor {key}" if key.upper() != key else key
    raise DeckError(f"{shapes_path}: shape key {key!r}: {ref_path.name} assigns no top-level {spelled}, so the key "
                    "cannot size the reference (a key only check.py reads is not supported; "
                    "problem.yaml's shape_globals can name the global)")


def _kb_hard_tolerances(data: Any, where: str) -> dict[str, tuple[float, float]]:
    """`tolerance` as KernelBench-Hard reads it (§A.7), keys as spelled: dtype -> scalar or
    {atol, rtol}, a missing entry 0, numeric strings (PyYAML's '5e-2') coerced."""
    if data is None:
        return {}
    out = {}
    for dtype, spec in _Fields(data, where).data.items():
        if isinstance(spec, dict):
            unknown = set(spec) - {"atol", "rtol"}
            if unknown:
                raise DeckError(f"{where}.{dtype}: expected atol and rtol, got {sorted(unknown)}")
            out[str(dtype)] = (_number(spec.get("atol", 0), f"{where}.{dtype}.atol"),
                               _number(spec.get("rtol", 0), f"{where}.{dtype}.rtol"))
        else:
            value = _number(spec, f"{where}.{dtype}")
            out[str(dtype)] = (value, value)
    return out


def _torch_prefix_wins(table: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Spellings folded to 'bfloat16'; KernelBench-Hard looks 'torch.bfloat16' up first, so it wins."""
    out = {k: v for k, v in table.items() if not k.startswith("torch.")}
    out.update({k.removeprefix("torch."): v for k, v in table.items() if k.startswith("torch.")})
    return out


def _number(value: Any, where: str) -> float:
    try:
        number = float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else math.nan
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise DeckError(f"{where}: expected a non-negative number, got {value!r}")
    return number


# ------------------------------------------------------------------------------ ScalingIntelligence KernelBench


def load_si_kb_problem(path: Path) -> Problem:
    """One KernelBench level file, with its optional `<stem>.yaml` overlay (see the module docstring)."""
    tree = _parse(path)
    assigned = _assignments(tree)
    defined = assigned | {n.name: None for n in tree.body
                          if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}
    missing = [n for n in _SI_KB_NAMES if n not in defined]
    if missing:
        raise DeckError(f"{path}: not a KernelBench problem: no top-level {', '.join(missing)} "
                        f"(a level file defines {', '.join(_SI_KB_NAMES)})")
    overlay = path.with_suffix(".yaml")
    data = _read_yaml(overlay) if overlay.is_file() else {}
    f = _Fields({} if data is None else data, str(overlay))
    unknown = sorted(set(f.data) - set(SI_KB_OVERLAY_KEYS))
    if unknown:
        raise DeckError(f"{overlay}: unknown keys {unknown}; a KernelBench overlay may hold "
                        f"{', '.join(SI_KB_OVERLAY_KEYS)}")
    globals_ = {str(k): str(v) for k, v in f.get("shape_globals", dict, {}).items()}
    constants = _module_constants(tree)
    for key, name in globals_.items():
        if name not in assigned:
            raise DeckError(f"{overlay}: shape_globals.{key}: {path.name} assigns no top-level {name!r}")
    if "shapes" in f.data:
        shapes = _shapes(f.data["shapes"], f"{overlay}: shapes", globals_)
    else:
        params = {}
        for key, name in globals_.items():
            if name not in constants:
                raise DeckError(f"{overlay}: shape_globals.{key}: {path.name}'s {name} is not a positive integer "
                                "constant; give 'shapes' in the overlay")
            params[key] = constants[name]
        shapes = (Shape(0, "default", params),)
    stem = path.stem
    problem = Problem(
        bench=path.parent.name,
        name=stem,
        display_name=f.get("display_name", str, re.sub(r"^\d+_", "", stem).replace("_", " ").strip() or stem),
        folder=path,
        regime=_regime(f, "compute"),
        precision=f.get("precision", str, "fp32"),
        peak_tflops_key=_peak_key(f, "fp32"),
        flops_formula=f.get("flops_formula", str, None),
        bytes_formula=f.get("bytes_formula", str, None),
        shape_globals=globals_,
        shapes=shapes,
        cpu_shapes=_shapes(f.data["cpu_shapes"], f"{overlay}: cpu_shapes", globals_) if "cpu_shapes" in f.data else (),
        seeds=tuple(_seed_list(f, "seeds")) if "seeds" in f.data else SEEDS,
        tolerance=_tolerances(f.get("tolerance", dict, {}), f"{overlay}: tolerance"),
        numeric_stress=_numeric_stress(f.get("numeric_stress", list, []), f"{overlay}: numeric_stress"),
        forbidden=_strings(f, "forbidden"),
        structural_stress=None,
        solution_class="ModelNew",
        weight_transfer="seed",
        raw=dict(f.data),
    )
    _check_formulas(problem, overlay if overlay.is_file() else path)
    return problem


def _module_constants(tree: ast.Module) -> dict[str, int]:
    """Top-level `name = <integer arithmetic>` of a module, in statement order (`dim = 1024 * 4`,
    `n = batch * 2` included); a name later bound to anything else is dropped."""
    out: dict[str, int] = {}
    for node in tree.body:
        for name, value in _assigned_by(node):
            out.pop(name, None)
            if value is None:
                continue
            try:
                number = evaluate_formula(ast.unparse(value), out)
            except (ValueError, SyntaxError, ZeroDivisionError, TypeError, OverflowError):
                continue
            if number.is_integer():
                out[name] = int(number)
    return out


# ------------------------------------------------------------------------------ shared


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DeckError(f"{path}: not valid YAML ({exc})") from None


def _parse(path: Path) -> ast.Module:
    if not path.is_file():
        raise DeckError(f"{path}: no such file")
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise DeckError(f"{path}: line {exc.lineno}: not valid Python ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DeckError(f"{path}: cannot read ({exc})") from None


def _targets(node: ast.stmt) -> list[tuple[ast.expr, ast.expr | None]]:
    """(target, value) of a top-level assignment; value None for `x += 1` and a bare `x: int`."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, ast.AnnAssign):
        return [(node.target, node.value)]
    if isinstance(node, ast.AugAssign):
        return [(node.target, None)]
    return []


def _assigned_by(node: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    """Names one statement assigns, each with its value when it can be told (`M, N = 1, 2` can)."""
    out: list[tuple[str, ast.expr | None]] = []
    for target, value in _targets(node):
        if isinstance(target, ast.Name):
            out.append((target.id, value))
        elif isinstance(target, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) and \
                len(value.elts) == len(target.elts) else [None] * len(target.elts)
            out += [(e.id, v) for e, v in zip(target.elts, values, strict=True) if isinstance(e, ast.Name)]
    return out


def _bound_names(node: ast.stmt) -> list[str]:
    return [name for name, _ in _assigned_by(node)]


def _assignments(tree: ast.Module) -> dict[str, ast.expr | None]:
    """Names a module's own top-level statements assign -> the value last assigned (or None)."""
    return {name: value for node in tree.body for name, value in _assigned_by(node)}


def _regime(f: _Fields, default: Any = ...) -> str:
    regime = f.get("regime", str, default)
    if regime not in REGIMES:
        raise DeckError(f"{f.where}: key 'regime': expected one of {', '.join(REGIMES)}, got {regime!r}")
    return regime


def _peak_key(f: _Fields, default: Any = ...) -> str:
    key = f.get("peak_tflops_key", str, default)
    if key not in PRECISIONS:
        raise DeckError(f"{f.where}: key 'peak_tflops_key': expected one of {', '.join(PRECISIONS)}, got {key!r}")
    return key


def _strings(f: _Fields, key: str) -> tuple[str, ...]:
    items = f.get(key, list, [])
    bad = [x for x in items if not isinstance(x, str) or not x]
    if bad:
        raise DeckError(f"{f.where}: key '{key}': expected non-empty strings, got {bad[0]!r}")
    return tuple(items)


def _seed_list(f: _Fields, key: str) -> list[int]:
    items = f.get(key, list)
    bad = [x for x in items if not isinstance(x, int) or isinstance(x, bool) or x < 0]
    if bad or not items:
        raise DeckError(f"{f.where}: key '{key}': expected a non-empty list of non-negative integers, got {items!r}")
    return items

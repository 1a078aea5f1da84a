"""KernelBench-Hard's problem folders (reference.py + shapes.py + problem.yaml) read into a `Problem`
(no torch, nothing imported: see formats.py for the rules)."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

from kernelboard.errors import DeckError

from .format_native import Fields, read_numeric_stress, read_shapes
from .format_source import SEEDS, assignments, bound_names, parse, peak_key, read_yaml, regime, strings
from .problem import Problem, Shape, StressCase, check_formulas

#: kernelboard keys a KernelBench-Hard problem.yaml may add.
KB_HARD_OVERLAY_KEYS = ("cpu_shapes", "numeric_stress", "shape_globals")
#: kernelboard keys it may not: they would be silently meaningless there.
KB_HARD_REFUSED_KEYS = ("bench", "seeds", "structural_stress", "solution_class", "weight_transfer",
                        "forbidden_ops", "forbidden_kernels", "require_own_kernel", "draw_on_device",
                        "skip_baselines", "headline_baseline")

# ------------------------------------------------------------------------------ KernelBench-Hard


def load_kb_hard_problem(folder: Path) -> Problem:
    """A KernelBench-Hard problem folder (see the module docstring for what is read and refused)."""
    yaml_path, ref_path, shapes_path = folder / "problem.yaml", folder / "reference.py", folder / "shapes.py"
    if not yaml_path.is_file():
        raise DeckError(f"{folder}: no problem.yaml (a KernelBench-Hard folder has one beside shapes.py)")
    data = read_yaml(yaml_path)
    f = Fields(data, str(yaml_path))
    refused = [k for k in KB_HARD_REFUSED_KEYS if k in data]
    if refused:
        raise DeckError(f"{yaml_path}: key '{refused[0]}' is kernelboard's and means nothing in a KernelBench-Hard "
                        f"folder, which takes only {', '.join(KB_HARD_OVERLAY_KEYS)} from kernelboard")
    name = f.get("name", str, folder.name)
    if name != folder.name:
        raise DeckError(f"{yaml_path}: key 'name': expected the folder name {folder.name!r}, got {name!r}")
    listed = _read_shapes_py(shapes_path)
    keys = list(listed[0][1])
    assigned = assignments(parse(ref_path))
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
                   for c in read_numeric_stress(f.get("numeric_stress", list, []), f"{yaml_path}: numeric_stress"))
    problem = Problem(
        bench=_kb_hard_bench(folder.parent.name),
        name=name,
        display_name=f.get("display_name", str, name),
        folder=folder,
        regime=regime(f),
        precision=f.get("precision", str),
        peak_tflops_key=peak_key(f),
        flops_formula=f.get("flops_formula", str, None),
        bytes_formula=f.get("bytes_formula", str, None),
        shape_globals=globals_,
        shapes=shapes,
        cpu_shapes=(read_shapes(data["cpu_shapes"], f"{yaml_path}: cpu_shapes", globals_)
                    if "cpu_shapes" in data else ()),
        seeds=SEEDS,
        tolerance=_torch_prefix_wins(tolerance),
        numeric_stress=stress,
        forbidden=strings(f, "forbidden"),
        structural_stress=None,
        raw=data,
    )
    check_formulas(problem, yaml_path)
    return problem


def _kb_hard_bench(deck_name: str) -> str:
    """KernelBench-Hard's decks are `problems` (graded runs) and `problems-<gpu>`: all one bench."""
    return "hard" if deck_name == "problems" or deck_name.startswith("problems-") else deck_name


def _read_shapes_py(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(label, shape dict) per `SHAPES` entry, read with `ast.literal_eval`: shapes.py never runs.
    The sizes are checked after the keys have found their globals (`_check_sizes`)."""
    tree, text = parse(path), path.read_text()
    binds = [n for n in tree.body if "SHAPES" in bound_names(n)]
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
    for dtype, spec in Fields(data, where).data.items():
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



"""ScalingIntelligence KernelBench level files (`N_Name.py`, plus an optional `N_Name.yaml` overlay)
read into a `Problem` (no torch, nothing imported: see formats.py for the rules)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kernelboard.errors import DeckError

from .format_native import Fields, read_numeric_stress, read_shapes, read_tolerances
from .format_source import (
    SEEDS,
    assigned_by,
    assignments,
    parse,
    peak_key,
    read_yaml,
    regime,
    seed_list,
    strings,
)
from .problem import Problem, Shape, check_formulas, evaluate_formula

#: Keys a ScalingIntelligence KernelBench `<stem>.yaml` may hold, in kernelboard's format.
SI_KB_OVERLAY_KEYS = ("display_name", "regime", "precision", "peak_tflops_key", "flops_formula",
                      "bytes_formula", "shape_globals", "shapes", "cpu_shapes", "seeds", "tolerance",
                      "numeric_stress", "forbidden")
_SI_KB_NAMES = ("Model", "get_inputs", "get_init_inputs")


# ------------------------------------------------------------------------------ ScalingIntelligence KernelBench


def load_si_kb_problem(path: Path) -> Problem:
    """One KernelBench level file, with its optional `<stem>.yaml` overlay (see the module docstring)."""
    tree = parse(path)
    assigned = assignments(tree)
    defined = assigned | {n.name: None for n in tree.body
                          if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}
    missing = [n for n in _SI_KB_NAMES if n not in defined]
    if missing:
        raise DeckError(f"{path}: not a KernelBench problem: no top-level {', '.join(missing)} "
                        f"(a level file defines {', '.join(_SI_KB_NAMES)})")
    overlay = path.with_suffix(".yaml")
    data = read_yaml(overlay) if overlay.is_file() else {}
    f = Fields({} if data is None else data, str(overlay))
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
        shapes = read_shapes(f.data["shapes"], f"{overlay}: shapes", globals_)
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
        regime=regime(f, "compute"),
        precision=f.get("precision", str, "fp32"),
        peak_tflops_key=peak_key(f, "fp32"),
        flops_formula=f.get("flops_formula", str, None),
        bytes_formula=f.get("bytes_formula", str, None),
        shape_globals=globals_,
        shapes=shapes,
        cpu_shapes=(read_shapes(f.data["cpu_shapes"], f"{overlay}: cpu_shapes", globals_)
                    if "cpu_shapes" in f.data else ()),
        seeds=tuple(seed_list(f, "seeds")) if "seeds" in f.data else SEEDS,
        tolerance=read_tolerances(f.get("tolerance", dict, {}), f"{overlay}: tolerance"),
        numeric_stress=read_numeric_stress(f.get("numeric_stress", list, []), f"{overlay}: numeric_stress"),
        forbidden=strings(f, "forbidden"),
        structural_stress=None,
        solution_class="ModelNew",
        weight_transfer="seed",
        raw=dict(f.data),
    )
    check_formulas(problem, overlay if overlay.is_file() else path)
    return problem


def _module_constants(tree: ast.Module) -> dict[str, int]:
    """Top-level `name = <integer arithmetic>` of a module, in statement order (`dim = 1024 * 4`,
    `n = batch * 2` included); a name later bound to anything else is dropped."""
    out: dict[str, int] = {}
    for node in tree.body:
        for name, value in assigned_by(node):
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



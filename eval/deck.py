"""Problem decks: `eval/decks/<bench>/<NN_problem>/problem.yaml` loaded and validated (no torch).

A problem folder holds `problem.yaml` (shapes, regime, formulas, tolerances, stress cases,
forbidden substrings), `reference.py` (the oracle, KernelBench-Hard's module interface) and
`README.md` (rendered by the site). Every malformed field is reported with the file and key.
"""

from __future__ import annotations

import ast
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import DeckError

from .schema import REGIMES

#: Default tolerances per output dtype (atol, rtol), KernelBench-Hard's table; ints are exact.
DEFAULT_TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (1e-2, 1e-2),
    "float8_e4m3fn": (0.1, 0.1),
    "float8_e5m2": (0.1, 0.1),
    "int8": (0.0, 0.0),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
}


@dataclass(frozen=True)
class Shape:
    """One size of a problem: `params` are the shape keys the formulas and globals use."""

    idx: int
    label: str
    params: dict[str, int]

    @property
    def params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)


#: How an output is compared with the reference's (correctness.py): every element within
#: tolerance, or a top-k's (values, indices) with any valid tie-break.
OUTPUT_RULES = ("allclose", "topk")


@dataclass(frozen=True)
class StressCase:
    """Inputs at `scale[position]` × their nominal values — and state buffers at `state_scale[name]` ×
    theirs, in both models for that call only — graded with `tolerance` overrides."""

    name: str
    scale: dict[int, float]
    tolerance: dict[str, tuple[float, float]]
    state_scale: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StructuralCase:
    """Inputs rewritten by `reference.<function>(inputs, **params)`: ragged lengths, ties, …"""

    function: str
    params: dict[str, int]

    @property
    def name(self) -> str:
        return f"{self.function}({', '.join(f'{k}={v}' for k, v in sorted(self.params.items()))})"


@dataclass(frozen=True)
class StructuralStress:
    function: str
    canonical: tuple[dict[str, int], ...]
    random_count: int
    random_ranges: dict[str, tuple[int, int]]
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)  # overrides for these cases

    def as_stress(self) -> StressCase:
        """The structural cases' tolerance overrides, in the shape numeric cases carry them."""
        return StressCase(self.function, {}, self.tolerance)

    def cases(self, seed: int) -> list[StructuralCase]:
        """The canonical cases, then `random_count` drawn from `seed` (so a run can be replayed)."""
        rng = random.Random(seed)
        drawn = [
            {k: rng.randint(lo, hi) for k, (lo, hi) in sorted(self.random_ranges.items())}
            for _ in range(self.random_count)
        ]
        return [StructuralCase(self.function, dict(p)) for p in (*self.canonical, *drawn)]


@dataclass(frozen=True)
class Problem:
    bench: str
    name: str
    display_name: str
    folder: Path
    regime: str
    precision: str
    peak_tflops_key: str
    flops_formula: str | None  # None: no roofline (e.g. a KernelBench single-file problem)
    bytes_formula: str | None
    shape_globals: dict[str, str]
    shapes: tuple[Shape, ...]
    cpu_shapes: tuple[Shape, ...]
    seeds: tuple[int, ...]
    tolerance: dict[str, tuple[float, float]]
    numeric_stress: tuple[StressCase, ...]
    forbidden: tuple[str, ...]
    structural_stress: StructuralStress | None
    forbidden_ops: tuple[str, ...] = ()  # substrings of aten op names refused at run time
    forbidden_kernels: tuple[str, ...] = ()  # regexes of CUDA kernel names refused in the timed call
    require_own_kernel: bool = False  # the timed call must launch a kernel no library ships
    #: The judge draws the reference Model's parameters and the inputs on the grading device instead
    #: of on the CPU (06: 1.6 G bf16 weights and 1 G-element hidden states per input set, drawn on
    #: the CPU, took most of each shape's minute). The values differ from a CPU draw, and are the same
    #: on every grading on that device; the solution's Model is still built as KernelBench builds it.
    draw_on_device: bool = False
    library: dict[str, str] = field(default_factory=dict)  # library line name -> reference.py function
    solution_class: str = "Model"  # ScalingIntelligence KernelBench candidates define ModelNew
    weight_transfer: str = "state_dict"  # or "seed": both models built after the same manual_seed
    output_rule: str = "allclose"  # or "topk": (values, indices), any valid tie-break (correctness.py)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def reference_path(self) -> Path:
        """`folder/reference.py`; a single-file problem (ScalingIntelligence KernelBench, see
        formats.py) has the file itself as its `folder`, so a worker can reload it from there."""
        return self.folder if self.folder.suffix == ".py" else self.folder / "reference.py"

    def shapes_for(self, device: str) -> tuple[Shape, ...]:
        return self.cpu_shapes if device == "cpu" else self.shapes

    def flops(self, shape: Shape) -> float | None:
        return evaluate_formula(self.flops_formula, shape.params) if self.flops_formula else None

    def bytes_moved(self, shape: Shape) -> float | None:
        return evaluate_formula(self.bytes_formula, shape.params) if self.bytes_formula else None

    def tolerance_for(self, dtype: str, case: StressCase | None = None) -> tuple[float, float]:
        """(atol, rtol) for an output dtype name such as 'bfloat16', a stress case's first."""
        for table in ((case.tolerance if case else {}), self.tolerance, DEFAULT_TOLERANCE):
            if dtype in table:
                return table[dtype]
        return DEFAULT_TOLERANCE["float32"]


_FORMULA_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Name, ast.Load, ast.Constant, ast.Add,
                  ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)


def evaluate_formula(formula: str, params: dict[str, int]) -> float:
    """Evaluate an arithmetic formula over shape keys; names and operators only, no calls."""
    tree = ast.parse(formula, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _FORMULA_NODES):
            raise ValueError(f"formula {formula!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Name) and node.id not in params:
            raise ValueError(f"formula {formula!r}: unknown name {node.id!r}; shape keys: {sorted(params)}")
    value = eval(compile(tree, "<formula>", "eval"), {"__builtins__": {}}, dict(params))
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"formula {formula!r} gave {value!r}, expected a positive number")
    return float(value)


class _Fields:
    """Typed access to one YAML mapping that reports bad keys as 'file: key: expected …'."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise DeckError(f"{where}: expected a mapping, got {type(data).__name__}")
        self.data, self.where = data, where

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise DeckError(f"{self.where}: missing key '{key}'")
            return default
        value = self.data[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise DeckError(f"{self.where}: key '{key}': expected {names}, got {value!r}")
        return value


def _library(data: dict[Any, Any], where: str) -> dict[str, str]:
    """Library line name -> reference.py function; both strings (YAML reads `off:` as False)."""
    for name, function in data.items():
        if not isinstance(name, str) or not isinstance(function, str) or not function.isidentifier():
            raise DeckError(f"{where}: expected 'name: function_in_reference_py' strings, got {name!r}: {function!r}")
    return dict(data)


def _tolerances(data: Any, where: str) -> dict[str, tuple[float, float]]:
    out = {}
    for dtype, spec in _Fields(data, where).data.items():
        if isinstance(spec, int | float):
            out[str(dtype)] = (float(spec), float(spec))
            continue
        f = _Fields(spec, f"{where}.{dtype}")
        out[str(dtype)] = (float(f.get("atol", (int, float))), float(f.get("rtol", (int, float))))
    return out


def _shapes(items: Any, where: str, globals_: dict[str, str]) -> tuple[Shape, ...]:
    if not isinstance(items, list) or not items:
        raise DeckError(f"{where}: expected a non-empty list of shapes")
    shapes = []
    for i, item in enumerate(items):
        f = _Fields(item, f"{where}[{i}]")
        params = f.get("params", dict)
        if set(params) != set(globals_):
            raise DeckError(f"{where}[{i}].params: expected keys {sorted(globals_)}, got {sorted(params)}")
        for key, value in params.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise DeckError(f"{where}[{i}].params.{key}: expected a positive integer, got {value!r}")
        shapes.append(Shape(i, f.get("label", str), dict(params)))
    return tuple(shapes)


def _choice(f: _Fields, key: str, allowed: tuple[str, ...], default: str) -> str:
    value = f.get(key, str, default)
    if value not in allowed:
        raise DeckError(f"{f.where}: key '{key}': expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _structural(data: Any, where: str) -> StructuralStress | None:
    if data is None:
        return None
    f = _Fields(data, where)
    ranges = {}
    for key, bounds in f.get("random_ranges", dict, {}).items():
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int) for b in bounds)):
            raise DeckError(f"{where}.random_ranges.{key}: expected [low, high] integers, got {bounds!r}")
        ranges[str(key)] = (bounds[0], bounds[1])
    canonical = tuple(dict(_Fields(c, f"{where}.canonical").data) for c in f.get("canonical", list, []))
    tolerance = _tolerances(f.get("tolerance", dict, {}), f"{where}.tolerance")
    return StructuralStress(f.get("function", str), canonical, f.get("random_count", int, 0), ranges, tolerance)


def load_native_problem(folder: Path) -> Problem:
    """Load one kernelboard problem folder; raise `DeckError` naming the file and key on any mistake."""
    path = folder / "problem.yaml"
    if not path.is_file():
        raise DeckError(f"{folder}: no problem.yaml")
    if not (folder / "reference.py").is_file():
        raise DeckError(f"{folder}: no reference.py")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DeckError(f"{path}: not valid YAML ({exc})") from None
    f = _Fields(data, str(path))
    name = f.get("name", str)
    if name != folder.name:
        raise DeckError(f"{path}: key 'name': expected the folder name {folder.name!r}, got {name!r}")
    regime = f.get("regime", str)
    if regime not in REGIMES:
        raise DeckError(f"{path}: key 'regime': expected one of {', '.join(REGIMES)}, got {regime!r}")
    globals_ = {str(k): str(v) for k, v in f.get("shape_globals", dict).items()}
    problem = Problem(
        bench=f.get("bench", str),
        name=name,
        display_name=f.get("display_name", str),
        folder=folder,
        regime=regime,
        precision=f.get("precision", str),
        peak_tflops_key=f.get("peak_tflops_key", str),
        flops_formula=f.get("flops_formula", str),
        bytes_formula=f.get("bytes_formula", str),
        shape_globals=globals_,
        shapes=_shapes(f.get("shapes", list), f"{path}: shapes", globals_),
        cpu_shapes=_shapes(f.get("cpu_shapes", list), f"{path}: cpu_shapes", globals_),
        seeds=tuple(int(s) for s in f.get("seeds", list)),
        tolerance=_tolerances(f.get("tolerance", dict, {}), f"{path}: tolerance"),
        numeric_stress=_numeric_stress(f.get("numeric_stress", list, []), f"{path}: numeric_stress"),
        forbidden=tuple(str(s) for s in f.get("forbidden", list, [])),
        structural_stress=_structural(data.get("structural_stress"), f"{path}: structural_stress"),
        forbidden_ops=tuple(str(x) for x in f.get("forbidden_ops", list, [])),
        forbidden_kernels=tuple(str(x) for x in f.get("forbidden_kernels", list, [])),
        require_own_kernel=f.get("require_own_kernel", bool, False),
        draw_on_device=f.get("draw_on_device", bool, False),
        library=_library(f.get("library", dict, {}), f"{path}: library"),
        solution_class=f.get("solution_class", str, "Model"),
        weight_transfer=_choice(f, "weight_transfer", ("state_dict", "seed"), "state_dict"),
        output_rule=_choice(f, "output_rule", OUTPUT_RULES, "allclose"),
        raw=data,
    )
    _check_formulas(problem, path)
    return problem


def _numeric_stress(items: list[Any], where: str) -> tuple[StressCase, ...]:
    stress = []
    for i, item in enumerate(items):
        s = _Fields(item, f"{where}[{i}]")
        scale = {int(k): float(v) for k, v in s.get("scale", dict, {}).items()}
        state_scale = {str(k): float(v) for k, v in s.get("state_scale", dict, {}).items()}
        if not scale and not state_scale:
            raise DeckError(f"{s.where}: expected 'scale' (input positions) or 'state_scale' (buffer names)")
        stress.append(StressCase(s.get("name", str), scale,
                                 _tolerances(s.get("tolerance", dict, {}), s.where), state_scale))
    return tuple(stress)


def _check_formulas(problem: Problem, where: Path | str) -> None:
    """Every formula must evaluate to a positive number on every shape, GPU and CPU."""
    for shape in problem.shapes + problem.cpu_shapes:
        for formula in (problem.flops_formula, problem.bytes_formula):
            if formula is None:
                continue
            try:
                evaluate_formula(formula, shape.params)
            except (ValueError, SyntaxError, ZeroDivisionError) as exc:
                raise DeckError(f"{where}: shape {shape.label!r}: {exc}") from None


def load_problem(path: Path) -> Problem:
    """Load one problem in any format formats.py reads (a kernelboard or KernelBench-Hard folder,
    a ScalingIntelligence KernelBench file); raise `DeckError` naming the file and key."""
    from .formats import load_problem_any  # formats.py builds on this module: imported late

    return load_problem_any(path)


def load_deck(deck_dir: Path) -> dict[str, Problem]:
    """Every problem of a deck, in any format formats.py reads, by name, in natural order (2_ before 10_)."""
    from .formats import load_deck_any

    return load_deck_any(deck_dir)

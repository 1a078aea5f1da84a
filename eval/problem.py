"""A problem as the grader sees it, whatever deck format it was read from (no torch, no I/O).

The types every deck format builds (`Problem`, its `Shape`s and stress cases) and the arithmetic
the roofline needs of them (`evaluate_formula`). The formats (`format_native.py`, `format_kbh.py`,
`format_sikb.py`) read files into these; formats.py tells them apart behind
`deck.load_problem`; nothing here reads a file.
"""

from __future__ import annotations

import ast
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelboard.errors import DeckError

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
class Stateful:
    """A problem whose call is one step of a stateful model (problem.yaml `stateful`, the Mega deck):
    `Model.<entry>(hidden, state) -> (hidden, state)`, checked teacher-forced over `check_steps`
    consecutive steps per seed (each step gets the reference's hidden and state of that position),
    every state tensor judged beside the output (eval/stateful.py flattens them), each also under
    the cosine rule (`cos_sim`), and the element-wise bound excused at a step where a router's margin
    is under `router_margin_ulps` (a rounding may then choose another expert; the cosine rule stays).
    A deck that sets `router_margin_ulps` promises a reference whose `<entry>(hidden, state, margins,
    flip=None)` appends each router's margin to `margins` and, given `flip=r`, has router r choose its
    runner-up expert in place of its last chosen one (the judge's `_RunnerUps`)."""

    entry: str = "step"
    check_steps: int = 4
    cos_sim: float | None = None
    router_margin_ulps: float | None = None


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
    #: on every grading on that device. With `weight_transfer` "state_dict" the solution's Model is
    #: built there too (runner._build_solution: its constructor's draws are overwritten anyway).
    draw_on_device: bool = False
    library: dict[str, str] = field(default_factory=dict)  # library line name -> reference.py function
    #: Compile baselines this problem never measures, as `--skip-baseline` names them for one run
    #: (02: max-autotune's autotuning ran past 100 s on its first shape); the headline is then the
    #: compile variant that remains, so a plain `make eval` grades as the committed rows were.
    skip_baselines: tuple[str, ...] = ()
    #: The line a deck names as its own headline baseline (Mega: `library:tuned`, its tuned PyTorch step
    #: `baseline.py`): every pass also gets a speedup over it (scoring: speedup_vs_baseline), which the
    #: site's boards of that deck rank on. None: the headline is torch.compile (Hard).
    headline_baseline: str | None = None
    solution_class: str = "Model"  # ScalingIntelligence KernelBench candidates define ModelNew
    weight_transfer: str = "state_dict"  # or "seed": both models built after the same manual_seed
    output_rule: str = "allclose"  # or "topk": (values, indices), any valid tie-break (correctness.py)
    stateful: Stateful | None = None  # a step of a stateful model (Mega): see Stateful
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def reference_path(self) -> Path:
        """`folder/reference.py`; a single-file problem (ScalingIntelligence KernelBench, see
        formats.py) has the file itself as its `folder`, so a worker can reload it from there."""
        return self.folder if self.folder.suffix == ".py" else self.folder / "reference.py"

    @property
    def rule_reads_inputs(self) -> bool:
        """Whether judging an output reads the call's inputs (top-k gathers them), not only the reference's."""
        return self.output_rule != "allclose"

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


def check_formulas(problem: Problem, where: Path | str) -> None:
    """Every formula must evaluate to a positive number on every shape, GPU and CPU."""
    for shape in problem.shapes + problem.cpu_shapes:
        for formula in (problem.flops_formula, problem.bytes_formula):
            if formula is None:
                continue
            try:
                evaluate_formula(formula, shape.params)
            except (ValueError, SyntaxError, ZeroDivisionError) as exc:
                raise DeckError(f"{where}: shape {shape.label!r}: {exc}") from None


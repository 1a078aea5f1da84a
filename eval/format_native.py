"""kernelboard's own deck format: `<bench>/<NN_problem>/problem.yaml` beside `reference.py` (no torch).

`load_native_problem` reads one folder into a `Problem`, reporting every malformed field with the
file and key. Its field readers (`Fields`, `read_shapes`, `read_tolerances`, `read_numeric_stress`)
are public: the foreign formats (formats.py) read the kernelboard keys their overlays may add
through them, so a key means the same in every format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import DeckError

from .problem import OUTPUT_RULES, Problem, Shape, Stateful, StressCase, StructuralStress, check_formulas
from .schema import REGIMES
from .settings import HEADLINE_COMPILE_VARIANTS


class Fields:
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


def read_tolerances(data: Any, where: str) -> dict[str, tuple[float, float]]:
    """dtype -> (atol, rtol), from `{dtype: value}` (both the same) or `{dtype: {atol, rtol}}`."""
    out = {}
    for dtype, spec in Fields(data, where).data.items():
        if isinstance(spec, int | float):
            out[str(dtype)] = (float(spec), float(spec))
            continue
        f = Fields(spec, f"{where}.{dtype}")
        out[str(dtype)] = (float(f.get("atol", (int, float))), float(f.get("rtol", (int, float))))
    return out


def read_shapes(items: Any, where: str, globals_: dict[str, str]) -> tuple[Shape, ...]:
    """A non-empty list of `{label, params}`, each with exactly the keys of `globals_`, all positive ints."""
    if not isinstance(items, list) or not items:
        raise DeckError(f"{where}: expected a non-empty list of shapes")
    out = []
    for i, item in enumerate(items):
        f = Fields(item, f"{where}[{i}]")
        params = f.get("params", dict)
        if set(params) != set(globals_):
            raise DeckError(f"{where}[{i}].params: expected keys {sorted(globals_)}, got {sorted(params)}")
        for key, value in params.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise DeckError(f"{where}[{i}].params.{key}: expected a positive integer, got {value!r}")
        out.append(Shape(i, f.get("label", str), dict(params)))
    return tuple(out)


def _choice(f: Fields, key: str, allowed: tuple[str, ...], default: str) -> str:
    value = f.get(key, str, default)
    if value not in allowed:
        raise DeckError(f"{f.where}: key '{key}': expected one of {', '.join(allowed)}, got {value!r}")
    return value


def _structural(data: Any, where: str) -> StructuralStress | None:
    if data is None:
        return None
    f = Fields(data, where)
    ranges = {}
    for key, bounds in f.get("random_ranges", dict, {}).items():
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(isinstance(b, int) for b in bounds)):
            raise DeckError(f"{where}.random_ranges.{key}: expected [low, high] integers, got {bounds!r}")
        ranges[str(key)] = (bounds[0], bounds[1])
    canonical = tuple(dict(Fields(c, f"{where}.canonical").data) for c in f.get("canonical", list, []))
    tolerance = read_tolerances(f.get("tolerance", dict, {}), f"{where}.tolerance")
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
    f = Fields(data, str(path))
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
        shapes=read_shapes(f.get("shapes", list), f"{path}: shapes", globals_),
        cpu_shapes=read_shapes(f.get("cpu_shapes", list), f"{path}: cpu_shapes", globals_),
        seeds=tuple(int(s) for s in f.get("seeds", list)),
        tolerance=read_tolerances(f.get("tolerance", dict, {}), f"{path}: tolerance"),
        numeric_stress=read_numeric_stress(f.get("numeric_stress", list, []), f"{path}: numeric_stress"),
        forbidden=tuple(str(s) for s in f.get("forbidden", list, [])),
        structural_stress=_structural(data.get("structural_stress"), f"{path}: structural_stress"),
        forbidden_ops=tuple(str(x) for x in f.get("forbidden_ops", list, [])),
        forbidden_kernels=tuple(str(x) for x in f.get("forbidden_kernels", list, [])),
        require_own_kernel=f.get("require_own_kernel", bool, False),
        draw_on_device=f.get("draw_on_device", bool, False),
        library=_library(f.get("library", dict, {}), f"{path}: library"),
        skip_baselines=_skip_baselines(f.get("skip_baselines", list, []), f"{path}: skip_baselines"),
        headline_baseline=_headline_baseline(f.get("headline_baseline", str, None), data, path),
        solution_class=f.get("solution_class", str, "Model"),
        weight_transfer=_choice(f, "weight_transfer", ("state_dict", "seed"), "state_dict"),
        output_rule=_choice(f, "output_rule", OUTPUT_RULES, "allclose"),
        stateful=_stateful(data.get("stateful"), f"{path}: stateful"),
        raw=data,
    )
    check_formulas(problem, path)
    return problem


def _stateful(data: Any, where: str) -> Stateful | None:
    """The keys of `stateful` the grader reads (the others describe the state for readers)."""
    if data is None:
        return None
    f = Fields(data, where)
    entry = f.get("entry", str, "step")
    if not entry.isidentifier():
        raise DeckError(f"{where}: key 'entry': expected a method name, got {entry!r}")
    steps = f.get("check_steps", int, 4)
    if not 1 <= steps <= 64:
        raise DeckError(f"{where}: key 'check_steps': expected 1 to 64, got {steps}")
    cos = f.get("cos_sim", (int, float), None)
    if cos is not None and not 0 < cos <= 1:
        raise DeckError(f"{where}: key 'cos_sim': expected a cosine in (0, 1], got {cos}")
    margin = f.get("router_margin_ulps", (int, float), None)
    if margin is not None and margin < 0:
        raise DeckError(f"{where}: key 'router_margin_ulps': expected 0 or more, got {margin}")
    return Stateful(entry, steps, None if cos is None else float(cos), None if margin is None else float(margin))


def _headline_baseline(name: str | None, data: dict[str, Any], path: Path) -> str | None:
    """A deck's own headline baseline: a library line it declares (`library:<name>`), or eager."""
    if name is None:
        return None
    lines = {"eager", *(f"library:{k}" for k in (data.get("library") or {}))}
    if name not in lines:
        raise DeckError(f"{path}: key 'headline_baseline': expected one of {', '.join(sorted(lines))}, got {name!r}")
    return name


def _skip_baselines(items: list[Any], where: str) -> tuple[str, ...]:
    """Compile variants not measured: each one of HEADLINE_COMPILE_VARIANTS, one left for the headline."""
    names = tuple(str(x) for x in items)
    for name in names:
        if name not in HEADLINE_COMPILE_VARIANTS:
            raise DeckError(f"{where}: expected one of {', '.join(HEADLINE_COMPILE_VARIANTS)}, got {name!r}")
    if set(HEADLINE_COMPILE_VARIANTS) <= set(names):
        raise DeckError(f"{where}: skips every compile variant; the headline needs one")
    return names


def read_numeric_stress(items: list[Any], where: str) -> tuple[StressCase, ...]:
    """Stress cases, each scaling input positions (`scale`) or state buffers (`state_scale`)."""
    stress = []
    for i, item in enumerate(items):
        s = Fields(item, f"{where}[{i}]")
        scale = {int(k): float(v) for k, v in s.get("scale", dict, {}).items()}
        state_scale = {str(k): float(v) for k, v in s.get("state_scale", dict, {}).items()}
        if not scale and not state_scale:
            raise DeckError(f"{s.where}: expected 'scale' (input positions) or 'state_scale' (buffer names)")
        stress.append(StressCase(s.get("name", str), scale,
                                 read_tolerances(s.get("tolerance", dict, {}), s.where), state_scale))
    return tuple(stress)

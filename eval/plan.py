"""The grading plan: every reference output a submission will be checked against, computed from
the deck's reference before any candidate code is imported (worker side: imports torch)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .correctness import Output
from .deck import Problem, Shape, StressCase
from .problem import Stateful
from .settings import (
    PROOF_MAX_BYTES,
    PROOF_MAX_SETS,
    PROOF_MIN_SETS,
    PROOF_REF_BUDGET_S,
    PROOF_ROUNDS,
    ROUTER_CLEAR_DRAWS,
    ROUTER_CLEAR_FACTOR,
)
from .stateful import StepAdapter, StepLayout, clone_flat


def import_file(name: str, path: Path) -> types.ModuleType:
    """Import `path` as top-level module `name`, registered in sys.modules first (as
    KernelBench-Hard solutions expect `import reference` to return this very object)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def install_shapes_module(shapes: tuple[Shape, ...]) -> None:
    module = types.ModuleType("shapes")
    module.SHAPES = [dict(s.params) for s in shapes]  # type: ignore[attr-defined]
    sys.modules["shapes"] = module


def apply_shape(reference: types.ModuleType, problem: Problem, shape: Shape) -> None:
    for key, global_name in problem.shape_globals.items():
        setattr(reference, global_name, shape.params[key])


def draw_inputs(reference: types.ModuleType, seed: int, device: str, on_device: bool = False,
                fresh: bool = False) -> list[Any]:
    """`get_inputs()` after seeding, moved to `device`; with `on_device` drawn there (its factory
    calls default to it) rather than on the CPU and moved. With `fresh`, the reference's
    `get_fresh_inputs()` where it has one (`draw_fresh`)."""
    torch.manual_seed(seed)
    get = getattr(reference, "get_fresh_inputs", reference.get_inputs) if fresh else reference.get_inputs
    with torch.device(device) if on_device else contextlib.nullcontext():
        drawn = get()
    return [moved(x, device) for x in drawn]


def moved(value: Any, device: str) -> Any:
    """`value` on `device`, into lists, tuples and dicts: a stateful problem's inputs are a hidden
    tensor and a state of per-layer dicts (Mega's `get_inputs()`), all of which must move."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: moved(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(moved(item, device) for item in value)
    return value


def draw_fresh(reference: types.ModuleType, seed: int, device: str, on_device: bool = False) -> list[Any]:
    """Inputs that no fixed seed names (the timing pool, the floor batches: fresh for every run):
    drawn on `device` itself where the reference's `get_inputs()` runs there, since their values
    need not be the original's and the CPU's generator is slow (03's server-batch shape: about 1 s
    of its 0.27 GB a set, a dozen sets a grading); on the CPU as the checked seeds are otherwise.
    A reference whose `get_inputs()` draws on the CPU under any device context (so that a seed
    means the same values everywhere: Mega's) offers `get_fresh_inputs()` for these sets."""
    if on_device or device == "cpu":
        return draw_inputs(reference, seed, device, on_device, fresh=True)
    try:
        return draw_inputs(reference, seed, device, on_device=True, fresh=True)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):  # a CPU-only step in get_inputs()
        return draw_inputs(reference, seed, device)


def scaled(inputs: list[Any], case: StressCase | None) -> list[Any]:
    """A stress case's inputs: listed positions rescaled in fp32 and re-rounded to their dtype."""
    return inputs if case is None else scaled_positions(inputs, case.scale)


def scaled_positions(inputs: list[Any], scale: dict[int, float]) -> list[Any]:
    """`inputs` with each listed position a new tensor, × its factor in fp32, re-rounded to its dtype
    (the same bits on every device: one rounded multiply); the rest the same objects."""
    out = list(inputs)
    for pos, factor in scale.items():
        out[pos] = (inputs[pos].float() * factor).to(inputs[pos].dtype)
    return out


@contextlib.contextmanager
def scaled_state(model: torch.nn.Module, factors: dict[str, float]) -> Iterator[None]:
    """State buffers × their factors (re-rounded to their dtype) for one call, then restored — in the
    reference and in the solution alike: a solution that caches a repacked copy of its weights gives
    the old answer and fails."""
    if not factors:
        yield
        return
    named = dict(model.named_buffers()) | dict(model.named_parameters())
    saved = {}
    with torch.no_grad():
        for name, factor in factors.items():
            if name not in named:
                raise KeyError(f"state scaling: the model has no buffer or parameter {name!r}")
            saved[name] = named[name].detach().clone()
            named[name].copy_((saved[name].float() * factor).to(saved[name].dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, original in saved.items():
                named[name].copy_(original)


def build_model(module: types.ModuleType, init_args: list[Any], device: str,
                class_name: str = "Model", init_on_device: bool = False) -> torch.nn.Module:
    """`class_name(*init_args)` on `device`, in eval mode: built on the CPU and moved, as KernelBench
    builds it, or with `init_on_device` built there directly (its factory calls default to it)."""
    with torch.device(device) if init_on_device else contextlib.nullcontext():
        return getattr(module, class_name)(*init_args).to(torch.device(device)).eval()


@dataclass
class Check:
    """One call to verify: its inputs, and the reference output.

    `pristine` holds the same tensors as `inputs`, not copies: the runner only ever sees the shared
    arena copy, so the judge's own tensors stay as drawn, and once `inputs` is emptied after sharing
    they are the judge's record of what the runner was given (one copy: on 06's headline shape, 16
    input sets of 2.1 GB that a second copy held twice on the GPU). Outside a stateful step they are on
    the host (`to_host`) once the references are computed; the judge moves what it reads to the device.

    A numeric stress case's `inputs` are its seed's nominal tensors (the same objects as the nominal
    check's, so the arena holds them once): the call is made on them × `stress.scale`, which the
    runner applies to its own copy and the judge to its record (`called_with`) — on 06's headline
    shape, 8 of the 16 input sets of 2.1 GB were scaled copies of the other 8.
    """

    label: str
    inputs: list[Any]
    pristine: list[Any]
    ref_out: Output
    stress: StressCase | None
    #: A stateful step at a router near-tie (stress ROUTER_NEAR_TIE): the routers, in step order, whose
    #: reference margin is under the deck's `router_margin_ulps` (the judge's `_near_tie_verdict`).
    tied: tuple[int, ...] = ()

    def called_with(self) -> list[Any]:
        """The inputs the call is judged on, where it is judged (the reference output's device):
        `pristine` × the stress case's scale."""
        first = self.ref_out[0] if isinstance(self.ref_out, tuple) else self.ref_out
        return scaled(self.pristine_on(str(first.device)), self.stress)

    def pristine_on(self, device: str) -> list[Any]:
        """The judge's record of the inputs on `device`: copies where the record is on the host
        (`to_host`), the record itself where it is already there."""
        return [x.to(device) if isinstance(x, torch.Tensor) else x for x in self.pristine]


def to_host(inputs: list[Any]) -> list[Any]:
    """An input set's tensors copied to the host, with their strides: what the judge keeps of a check's
    inputs once its references are computed, so that on 06's headline shape its 8 input sets of 2.1 GB
    (17 GB) are not held on the GPU while the runner places its own sets beside them (on an 80 GB H100
    the two did not fit: 2026-12-06). The arena copies them from here; `_check_inputs` compares them
    here. A tensor whose elements overlap (an expanded one) stays where it is: it cannot be copied
    with its strides, and it holds few bytes."""
    held = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            with contextlib.suppress(RuntimeError):  # overlapping elements: kept where they are
                x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu").copy_(x)
        held.append(x)
    return held


@dataclass
class ShapePlan:
    """Everything computed from the reference for one shape."""

    shape: Shape
    init_args: list[Any]
    state_dict: dict[str, torch.Tensor]
    checks: list[Check] = field(default_factory=list)
    timing_sets: list[list[Any]] = field(default_factory=list)
    timing_refs: list[Output] = field(default_factory=list)
    timing_inputs: list[list[Any]] = field(default_factory=list)  # kept only for rules that read inputs
    witness_sets: list[list[Any]] = field(default_factory=list)  # kept for the GPU witness (gpu_witness.py)
    timing_seeds: list[int] = field(default_factory=list)  # each timing set's draw seed (its projection seed)
    proof_sets: list[list[list[Any]]] = field(default_factory=list)  # per batch, input sets used once each
    proof_refs: list[list[Output]] = field(default_factory=list)
    proof_seeds: list[list[int]] = field(default_factory=list)
    layout: StepLayout | None = None  # a stateful step's (stateful.py): how its flat inputs nest
    proof_inputs: list[list[list[Any]]] = field(default_factory=list)  # kept only for router problems
    # A router problem's reference step (margins on), kept for the judge's other expert choices
    # (judge.py `_RunnerUps`), and how many routers one step has.
    reference_step: StepAdapter | None = None
    routers: int = 0
    # What the runner is given to place on its GPU (judge._share): the state and timing sets it keeps to
    # the grading's end (a CUDA-graph replay), and the floor batches it drops at the next shape.
    kept_bytes: int = 0
    proof_bytes: int = 0


@torch.no_grad()
def make_plan(problem: Problem, reference: types.ModuleType, shapes: tuple[Shape, ...], seeds: list[int],
              timing_seeds: tuple[int, ...], device: str, proof_seed: int | None = None) -> list[ShapePlan]:
    """Reference outputs for every shape × seed × stress case (numeric, then structural, drawn
    from the last seed — the run's fresh one), for the timing input sets and, given `proof_seed`,
    for the judge's floor batches (`_proof_sets`)."""
    structural = problem.structural_stress.cases(seeds[-1]) if problem.structural_stress else []
    structural_tolerance = problem.structural_stress.as_stress() if problem.structural_stress else None
    plans = []
    for shape in shapes:
        apply_shape(reference, problem, shape)
        init_args = list(reference.get_init_inputs())
        torch.manual_seed(seeds[0])
        ref_model = build_model(reference, init_args, device, init_on_device=problem.draw_on_device)
        plan = ShapePlan(shape, init_args, {k: v.detach().clone() for k, v in ref_model.state_dict().items()})
        if problem.stateful is not None:
            _plan_steps(problem, problem.stateful, reference, ref_model, plan, seeds, timing_seeds, device, proof_seed)
            plans.append(plan)
            del ref_model
            continue
        first: list[Any] = []
        for seed in seeds:
            inputs = draw_inputs(reference, seed, device, problem.draw_on_device)
            if structural and not first:
                first = clone_flat(inputs)
            refs = []
            for case in (None, *problem.numeric_stress):
                with scaled_state(ref_model, case.state_scale if case else {}):
                    refs.append(ref_model(*scaled(inputs, case)))
            held = to_host(inputs)  # the seed's drawn tensors, shared once for all its cases: the runner
            for case, ref_out in zip((None, *problem.numeric_stress), refs, strict=True):  # scales its own copy
                label = f"seed {seed} case {case.name if case else 'nominal'}"
                plan.checks.append(Check(label, held, list(held), ref_out, case))
            del inputs
        for sc in structural:  # built from the first seed's inputs (a copy: 06's are GBs to redraw)
            case_inputs = getattr(reference, sc.function)(first, **sc.params)
            ref_out = ref_model(*case_inputs)
            held = to_host(case_inputs)
            plan.checks.append(Check(f"seed {seeds[0]} case {sc.name}", held, list(held), ref_out,
                                     structural_tolerance))
        del first
        for seed in timing_seeds:
            inputs = draw_fresh(reference, seed + 7919 * shape.idx, device, problem.draw_on_device)
            plan.timing_sets.append(inputs)
            plan.timing_refs.append(ref_model(*inputs))
            plan.timing_seeds.append(seed + 7919 * shape.idx)
        if proof_seed is not None:
            _proof_sets(plan, reference, ref_model, proof_seed + 7919 * shape.idx, device, problem.draw_on_device)
        plans.append(plan)
        del ref_model
    return plans


#: The case of a step whose router margin is under the deck's `router_margin_ulps` (a rounding may choose
#: another expert there): the tolerance of the outputs the judge holds to the cosine rule alone, those past
#: the first tied router where two or more are tied (judge.py `_near_tie_verdict`).
ROUTER_NEAR_TIE = StressCase("router near-tie", {},  # (inf, 0): an rtol of inf times a 0 is NaN, failing
                             {d: (math.inf, 0.0) for d in ("bfloat16", "float16", "float32")})


def _plan_steps(problem: Problem, spec: Stateful, reference: types.ModuleType, ref_model: torch.nn.Module,
                plan: ShapePlan, seeds: list[int], timing_seeds: tuple[int, ...], device: str,
                proof_seed: int | None) -> None:
    """A stateful step's checks, teacher-forced: per seed, `check_steps` consecutive steps from the
    drawn (hidden, state), each step's inputs the reference's result of the step before (so one
    wrong step fails that step, and a kernel is judged at several positions: RoPE, cache growth).
    Timing and floor-batch sets are drawn states, one step each. Every set is flat (stateful.py)."""

    def draw(seed: int, fresh: bool = False) -> list[Any]:
        """A seed's flat inputs; `fresh` (timing and floor-batch sets) drawn on the device where the
        reference can (`draw_fresh`): the checked seeds' states are the same on every device."""
        hidden, state = (draw_fresh if fresh else draw_inputs)(reference, seed, device, problem.draw_on_device)
        if plan.layout is None:
            plan.layout = StepLayout.of(state)
        return plan.layout.flatten(hidden, state)

    first = draw(seeds[0])
    assert plan.layout is not None
    step = StepAdapter(ref_model, plan.layout, spec.entry, margins=spec.router_margin_ulps is not None)
    for seed in seeds:
        flat = first if seed == seeds[0] else draw(seed)
        for j in range(spec.check_steps):
            ref_out = step(*clone_flat(flat))
            tied = tuple(r for r, margin in enumerate(step.last_margins)
                         if spec.router_margin_ulps is not None and margin < spec.router_margin_ulps)
            plan.checks.append(Check(f"seed {seed} step {j}", flat, list(flat), ref_out,
                                     ROUTER_NEAR_TIE if tied else None, tied))
            flat = list(ref_out)

    def draw_clear(seed: int) -> tuple[list[Any], Output]:
        """A set for timing or a floor batch, with the reference's output: a drawn state clear of
        router ties (ROUTER_CLEAR_*). The reference is called on a copy (a step may update its state)."""
        if spec.router_margin_ulps is None:
            flat = draw(seed, fresh=True)
            return flat, step(*clone_flat(flat))
        widest, widest_margin = None, -math.inf
        for k in range(ROUTER_CLEAR_DRAWS):
            flat = draw(seed + 1_000_003 * k, fresh=True)
            out = step(*clone_flat(flat))
            margin = min(step.last_margins, default=math.inf)
            if margin >= ROUTER_CLEAR_FACTOR * spec.router_margin_ulps:
                return flat, out
            if margin > widest_margin:
                widest, widest_margin = (flat, out), margin
        assert widest is not None
        return widest

    for seed in timing_seeds:
        flat, out = draw_clear(seed + 7919 * plan.shape.idx)
        plan.timing_sets.append(flat)
        plan.timing_refs.append(out)
        plan.timing_seeds.append(seed + 7919 * plan.shape.idx)
    if proof_seed is not None:
        _proof_sets(plan, reference, step, proof_seed + 7919 * plan.shape.idx, device, draw=draw_clear)
    if spec.router_margin_ulps is not None:
        plan.reference_step, plan.routers = step, len(step.last_margins)


def nbytes(*groups: Iterable[Any]) -> int:
    """The bytes the tensors of these input sets (or any iterables of values) hold."""
    return sum(x.numel() * x.element_size() for group in groups for x in group if isinstance(x, torch.Tensor))


def _proof_sets(plan: ShapePlan, reference: types.ModuleType, ref_model: torch.nn.Module, seed: int,
                device: str, on_device: bool = False,
                draw: Callable[[int], tuple[list[Any], Output]] | None = None) -> None:
    """PROOF_ROUNDS batches of input sets, each used once (timing.floor_ms), with references: as
    many per batch as PROOF_REF_BUDGET_S of reference time and PROOF_MAX_BYTES of inputs allow,
    between PROOF_MIN_SETS and PROOF_MAX_SETS (small, fast shapes get many, GB-sized ones few).
    Past two rounds, none once the references took PROOF_REF_BUDGET_S in all (slow calls end the
    judge's floor after two batches, PROOF_FLOOR_BUDGET_MS, so later rounds would go unused) or once
    the sets hold PROOF_MAX_BYTES: every set is copied to the runner and onto its device, and 06's
    headline draws 2.1 GB a set: five rounds of two would be 21 GB (its shape copied 57 GB on the H200).
    `draw(seed)` draws one set where `draw_inputs` does not (a stateful step's flat inputs), with the
    reference's output for it."""
    budget_s = PROOF_REF_BUDGET_S / PROOF_ROUNDS
    first, held = time.perf_counter(), 0
    for r in range(PROOF_ROUNDS):
        if r >= 2 and (time.perf_counter() - first > PROOF_REF_BUDGET_S or held >= PROOF_MAX_BYTES):
            break
        sets, refs, seeds, started, size = [], [], [], time.perf_counter(), 0
        while len(sets) < PROOF_MIN_SETS or (
                len(sets) < PROOF_MAX_SETS and time.perf_counter() - started < budget_s
                and (size + size // len(sets)) * PROOF_ROUNDS <= PROOF_MAX_BYTES):
            s = seed + 104729 * (r + 1) + len(sets)
            if draw is None:
                inputs = draw_fresh(reference, s, device, on_device)
                ref = ref_model(*inputs)
            else:
                inputs, ref = draw(s)
            sets.append(inputs)
            refs.append(ref)
            seeds.append(s)
            size += nbytes(inputs)
            if device == "cuda":
                torch.cuda.synchronize()  # the budget is the references' time, not their launches'
        held += size
        plan.proof_sets.append(sets)
        plan.proof_refs.append(refs)
        plan.proof_seeds.append(seeds)

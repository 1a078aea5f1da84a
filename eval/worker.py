"""The grading worker: one process per submission (or per problem's baselines), run by schedule.py.

`python -m kernelboard.eval.worker JOB.json` reads a job, grades, and writes one JSON result
atomically to the job's `result_path`. Candidate code is hostile, so the order matters:

1. the reference and every reference output (all shapes × seeds × stress cases, and the timing
   input sets) are computed **before** the solution is imported;
2. forbidden substrings are looked for in every file of the submission, before any of it runs;
3. torch's global numeric state is recorded before the import and checked after every phase;
4. each call gets inputs whose pristine copies are compared afterwards (no in-place writes);
5. timing rotates over two fresh input sets and the timed calls' outputs are checked after.

A crash, hang or `os._exit` ends this process without a result; the parent turns that into a
status. Speedups and roofline fractions are computed by the parent, not here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .correctness import compare, dtype_name
from .deck import Problem, Shape, StressCase, load_problem
from .timing import TimeStats, time_cpu, time_cuda

#: Input sets for baseline timing are fixed so cached baselines stay comparable across runs.
BASELINE_TIMING_SEEDS = (2026, 2027)


class Failure(Exception):
    """A graded outcome other than pass, raised to stop grading: carries the status."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:limit]


def _status_of(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    name, text = type(exc).__name__, str(exc)
    if "Compilation" in name or "Error building extension" in text:
        return "build_error"
    return "runtime_error"


# ------------------------------------------------------------------------------ environment


def torch_global_state() -> dict[str, Any]:
    """The torch switches a solution could flip to change the reference's numerics."""
    cuda_matmul = torch.backends.cuda.matmul
    return {
        "matmul.allow_tf32": cuda_matmul.allow_tf32,
        "matmul.allow_bf16_reduced_precision_reduction": cuda_matmul.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction": cuda_matmul.allow_fp16_reduced_precision_reduction,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
    }


def probe_environment(device: str) -> dict[str, Any]:
    """Device and software identity, recorded with every result."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    env: dict[str, Any] = {
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "python_version": platform.python_version(),
        "cuda_version": torch.version.cuda,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, l2_bytes=int(props.L2_cache_size),
                   sm_count=int(props.multi_processor_count), memory_bytes=int(props.total_memory))
    else:
        env.update(device_name=f"CPU: {_cpu_model()}", l2_bytes=None, sm_count=None, cuda_version=None)
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------ modules


def _import_file(name: str, path: Path) -> types.ModuleType:
    """Import `path` as top-level module `name`, registered in sys.modules first (as
    KernelBench-Hard solutions expect `import reference` to return this very object)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _install_shapes_module(shapes: tuple[Shape, ...]) -> None:
    module = types.ModuleType("shapes")
    module.SHAPES = [dict(s.params) for s in shapes]  # type: ignore[attr-defined]
    sys.modules["shapes"] = module


def _apply_shape(reference: types.ModuleType, problem: Problem, shape: Shape) -> None:
    for key, global_name in problem.shape_globals.items():
        setattr(reference, global_name, shape.params[key])


def _draw_inputs(reference: types.ModuleType, seed: int, device: str) -> list[Any]:
    torch.manual_seed(seed)
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in reference.get_inputs()]


def _scaled(inputs: list[Any], case: StressCase | None) -> list[Any]:
    """A stress case's inputs: listed positions rescaled in fp32 and re-rounded to their dtype."""
    if case is None:
        return inputs
    out = list(inputs)
    for pos, factor in case.scale.items():
        out[pos] = (inputs[pos].float() * factor).to(inputs[pos].dtype)
    return out


def _build_model(module: types.ModuleType, init_args: list[Any], device: str,
                 class_name: str = "Model") -> torch.nn.Module:
    return getattr(module, class_name)(*init_args).to(torch.device(device)).eval()


# ------------------------------------------------------------------------------ the plan


@dataclass
class Check:
    """One call to verify: its inputs, pristine copies of them, and the reference output."""

    label: str
    inputs: list[Any]
    pristine: list[Any]
    ref_out: torch.Tensor
    stress: StressCase | None


@dataclass
class ShapePlan:
    """Everything computed from the reference for one shape, before any candidate code runs."""

    shape: Shape
    init_args: list[Any]
    state_dict: dict[str, torch.Tensor]
    checks: list[Check] = field(default_factory=list)
    timing_sets: list[list[Any]] = field(default_factory=list)
    timing_refs: list[torch.Tensor] = field(default_factory=list)


def _clone_all(inputs: list[Any]) -> list[Any]:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


@torch.no_grad()
def _plan(problem: Problem, reference: types.ModuleType, shapes: tuple[Shape, ...], seeds: list[int],
          timing_seeds: tuple[int, ...], device: str) -> list[ShapePlan]:
    """Reference outputs for every shape × seed × stress case (numeric, then structural, drawn
    from the last seed — the run's fresh one) and for the timing input sets."""
    structural = problem.structural_stress.cases(seeds[-1]) if problem.structural_stress else []
    plans = []
    for shape in shapes:
        _apply_shape(reference, problem, shape)
        init_args = list(reference.get_init_inputs())
        torch.manual_seed(seeds[0])
        ref_model = _build_model(reference, init_args, device)
        plan = ShapePlan(shape, init_args, {k: v.detach().clone() for k, v in ref_model.state_dict().items()})
        for seed in seeds:
            inputs = _draw_inputs(reference, seed, device)
            for case in (None, *problem.numeric_stress):
                case_inputs = _scaled(inputs, case)
                label = f"seed {seed} case {case.name if case else 'nominal'}"
                plan.checks.append(Check(label, case_inputs, _clone_all(case_inputs), ref_model(*case_inputs), case))
        base = _draw_inputs(reference, seeds[0], device)
        for sc in structural:
            case_inputs = getattr(reference, sc.function)(base, **sc.params)
            plan.checks.append(Check(f"seed {seeds[0]} case {sc.name}", case_inputs, _clone_all(case_inputs),
                                     ref_model(*case_inputs), None))
        for seed in timing_seeds:
            inputs = _draw_inputs(reference, seed + 7919 * shape.idx, device)
            plan.timing_sets.append(inputs)
            plan.timing_refs.append(ref_model(*inputs))
        plans.append(plan)
        del ref_model
    return plans


# ------------------------------------------------------------------------------ grading


def _forbidden_hits(problem: Problem, solution_dir: Path) -> list[str]:
    """Forbidden substrings found in any text file of the submission (sidecars included)."""
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


def _check_state(before: dict[str, Any], when: str) -> None:
    after = torch_global_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
        raise Failure("integrity_violation", f"torch global state changed {when}: {detail}")


def _call(model: torch.nn.Module, inputs: list[Any], what: str) -> Any:
    try:
        with torch.no_grad():
            return model(*inputs)
    except Failure:
        raise
    except BaseException as exc:  # SystemExit and friends from candidate code included
        raise Failure(_status_of(exc), f"{what}: {_one_line(exc)}") from exc


def _check_shape(problem: Problem, plan: ShapePlan, model: torch.nn.Module, state: dict[str, Any],
                 device: str) -> float:
    """Every check of one shape; returns the worst normalised error ‖d‖/‖ref‖."""
    worst = 0.0
    for check in plan.checks:
        where = f"shape {plan.shape.idx} ({plan.shape.label}) {check.label}"
        out = _call(model, check.inputs, where)
        if device == "cuda":
            torch.cuda.synchronize()
        _check_state(state, f"during {where}")
        for i, (now, then) in enumerate(zip(check.inputs, check.pristine, strict=True)):
            if isinstance(now, torch.Tensor) and not torch.equal(now, then):
                raise Failure("integrity_violation", f"{where}: the solution wrote into input {i}")
        atol, rtol = problem.tolerance_for(dtype_name(check.ref_out.dtype), check.stress)
        verdict = compare(check.ref_out, out, atol, rtol)
        if not verdict.ok:
            raise Failure("wrong", f"{where}: {verdict.message}")
        worst = max(worst, verdict.rel_err or 0.0)
    return worst


def _time_shape(plan: ShapePlan, fn: Callable[..., Any], device: str, env: dict[str, Any],
                rep_ms: float | None) -> tuple[TimeStats, list[Any]]:
    kwargs = {} if rep_ms is None else {"rep_ms": rep_ms}
    if device == "cuda":
        stats, last = time_cuda(fn, plan.timing_sets, l2_bytes=env["l2_bytes"], **kwargs)
    else:
        stats, last = time_cpu(fn, plan.timing_sets, **kwargs)
    return stats, last


def grade(job: dict[str, Any], result: dict[str, Any]) -> None:
    """Grade one submission, filling `result` as it goes (so a failure keeps env and seeds)."""
    device, base_seed = job["device"], int(job["base_seed"])
    problem = load_problem(Path(job["problem_dir"]))
    solution_dir = Path(job["solution_dir"])
    shapes = problem.shapes_for(device)
    seeds = [*problem.seeds, base_seed]
    env = probe_environment(device)
    result.update(env=env, seeds=seeds, shapes=[], phase="reference")
    reference = _import_file("reference", problem.reference_path)
    _install_shapes_module(shapes)
    print(f"[worker] planning {len(shapes)} shapes × {len(seeds)} seeds on {env['device_name']}", flush=True)
    plans = _plan(problem, reference, shapes, seeds, (base_seed + 1, base_seed + 2), device)
    hits = _forbidden_hits(problem, solution_dir)
    if hits:
        raise Failure("forbidden", f"forbidden op used: {'; '.join(hits)}")
    state = torch_global_state()
    result["phase"] = "candidate"
    sys.path.insert(0, str(solution_dir))
    t0 = time.perf_counter()
    try:
        solution = _import_file("solution", solution_dir / "solution.py")
    except BaseException as exc:
        status = "oom" if isinstance(exc, torch.OutOfMemoryError) else "build_error"
        raise Failure(status, f"importing solution.py: {_one_line(exc)}") from exc
    result["import_seconds"] = time.perf_counter() - t0
    _check_state(state, "when solution.py was imported")
    for plan in plans:
        _apply_shape(reference, problem, plan.shape)
        try:
            if problem.weight_transfer == "seed":
                torch.manual_seed(seeds[0])
            model = _build_model(solution, plan.init_args, device, problem.solution_class)
            if problem.weight_transfer == "state_dict":
                model.load_state_dict(plan.state_dict, strict=True)
        except BaseException as exc:
            raise Failure(_status_of(exc), f"shape {plan.shape.idx}: building Model: {_one_line(exc)}") from exc
        worst = _check_shape(problem, plan, model, state, device)
        print(f"[worker] shape {plan.shape.idx} correct (‖d‖/‖ref‖ ≤ {worst:.3g})", flush=True)
        try:
            stats, last = _time_shape(plan, model, device, env, job.get("rep_ms"))
        except Failure:
            raise
        except BaseException as exc:
            raise Failure(_status_of(exc), f"shape {plan.shape.idx}: timing: {_one_line(exc)}") from exc
        _check_state(state, f"while timing shape {plan.shape.idx}")
        for i, (ref_out, out) in enumerate(zip(plan.timing_refs, last, strict=True)):
            atol, rtol = problem.tolerance_for(dtype_name(ref_out.dtype))
            verdict = compare(ref_out, out, atol, rtol)
            if not verdict.ok:
                raise Failure("wrong", f"shape {plan.shape.idx}: a timed call on input set {i} "
                                       f"returned a wrong output: {verdict.message}")
        print(f"[worker] shape {plan.shape.idx} median {stats.median_ms:.4f} ms × {stats.iterations}", flush=True)
        result["shapes"].append({"idx": plan.shape.idx, **stats.row(), "wall_ms": stats.wall_ms,
                                 "max_rel_err": worst})
    n_checks = sum(len(p.checks) for p in plans)
    result.update(status="pass", message=f"correct on all {n_checks} checks ({len(plans)} shapes × "
                                         f"{len(seeds)} seeds × {1 + len(problem.numeric_stress)} numeric "
                                         f"cases + structural cases) and on every timed call")


def baselines(job: dict[str, Any], result: dict[str, Any]) -> None:
    """Time the reference itself, eager and through torch.compile, on every shape."""
    device = job["device"]
    problem = load_problem(Path(job["problem_dir"]))
    shapes = problem.shapes_for(device)
    env = probe_environment(device)
    result.update(env=env, phase="reference")
    reference = _import_file("reference", problem.reference_path)
    _install_shapes_module(shapes)
    rows = []
    for shape in shapes:
        plans = _plan(problem, reference, (shape,), [int(job["base_seed"])], BASELINE_TIMING_SEEDS, device)
        plan = plans[0]
        torch.manual_seed(int(job["base_seed"]))
        model = _build_model(reference, plan.init_args, device)
        for variant in job["variants"]:
            row: dict[str, Any] = {"shape_idx": shape.idx, "variant": variant}
            try:
                fn = _variant_fn(model, variant)
                stats, _ = _time_shape(plan, fn, device, env, job.get("rep_ms"))
                row.update(status="ok", message="ok", **stats.row())
                print(f"[baseline] shape {shape.idx} {variant}: {stats.median_ms:.4f} ms", flush=True)
            except Exception as exc:  # a baseline that cannot run is recorded, not fatal
                row.update(status="error", message=_one_line(exc))
                print(f"[baseline] shape {shape.idx} {variant}: {row['message']}", flush=True)
            rows.append(row)
        del model, plans, plan
    result.update(status="ok", message="ok", baselines=rows)


def _variant_fn(model: torch.nn.Module, variant: str) -> Callable[..., Any]:
    if variant == "eager":
        return model
    if variant.startswith("compile:"):
        torch._dynamo.reset()
        return torch.compile(model, mode=variant.split(":", 1)[1])
    raise ValueError(f"unknown baseline variant {variant!r}")


# ------------------------------------------------------------------------------ entry point


def _write_result(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, sort_keys=True, default=str))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kernelboard.eval.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    result_path = Path(job["result_path"])
    if job["device"] == "cuda" and not torch.cuda.is_available():
        _write_result(result_path, {"status": "not_graded", "message": "no CUDA device visible to the worker"})
        return 0
    result: dict[str, Any] = {}
    try:
        (grade if job["kind"] == "grade" else baselines)(job, result)
    except Failure as failure:
        result.update(status=failure.status, message=failure.message)
        if failure.__cause__ is not None:
            traceback.print_exception(failure.__cause__)
    except Exception as exc:  # escaped our wrappers: the grader's fault before candidate code ran
        traceback.print_exc()
        status = "runtime_error" if result.get("phase") == "candidate" else "not_graded"
        result.update(status=status, message=f"grader error in phase {result.get('phase')}: {_one_line(exc)}")
    print(f"[worker] {result.get('status')}: {result.get('message')}", flush=True)
    _write_result(result_path, result)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

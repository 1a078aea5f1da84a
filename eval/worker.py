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

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import audit
from .correctness import compare, dtype_name
from .deck import Problem, load_problem
from .plan import ShapePlan, apply_shape, build_model, import_file, install_shapes_module, make_plan
from .probe import probe_environment, torch_global_state
from .timing import TimeStats, time_cpu, time_cuda

#: Input sets for baseline timing are fixed so cached baselines stay comparable across runs.
BASELINE_TIMING_SEEDS = (2026, 2027)
#: Shapes faster than this are launch-bound: their CUDA-graph replay time is reported beside them.
LAUNCH_BOUND_MS = 0.2
#: Host-synchronised time above this multiple of the event median (+ slack) means escaped work.
ESCAPE_FACTOR, ESCAPE_SLACK_MS = 1.5, 0.05


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


class _Phases:
    """Tells the parent which phase runs (it enforces a timeout per phase) and keeps it in the result."""

    def __init__(self, path: str | None, result: dict[str, Any]) -> None:
        self.path, self.result = path, result

    def enter(self, phase: str) -> None:
        self.result["phase"] = phase
        if self.path:
            tmp = f"{self.path}.tmp"
            Path(tmp).write_text(phase)
            os.replace(tmp, self.path)


# ------------------------------------------------------------------------------ grading


def _check_state(before: dict[str, Any], when: str) -> None:
    after = torch_global_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
        raise Failure("integrity_violation", f"torch global state changed {when}: {detail}")


def _guarded(what: str, fn: Callable[[], Any]) -> Any:
    """Run candidate code; any exception (SystemExit included) becomes a graded Failure."""
    try:
        return fn()
    except Failure:
        raise
    except BaseException as exc:
        raise Failure(_status_of(exc), f"{what}: {_one_line(exc)}") from exc


def _call(model: torch.nn.Module, inputs: list[Any], what: str) -> Any:
    def run() -> Any:
        with torch.no_grad():
            return model(*inputs)

    return _guarded(what, run)


def _check_shape(problem: Problem, plan: ShapePlan, model: torch.nn.Module, state: dict[str, Any],
                 device: str) -> float:
    """Every check of one shape; returns the worst normalised error ‖d‖/‖ref‖."""
    worst = 0.0
    for check in plan.checks:
        where = f"shape {plan.shape.idx} ({plan.shape.label}) {check.label}"
        out = _call(model, check.inputs, where)
        if device == "cuda":
            _guarded(where, torch.cuda.synchronize)
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


def _verify_timed(problem: Problem, plan: ShapePlan, outputs: list[Any], what: str) -> None:
    for i, (ref_out, out) in enumerate(zip(plan.timing_refs, outputs, strict=True)):
        if out is None:
            continue
        atol, rtol = problem.tolerance_for(dtype_name(ref_out.dtype))
        verdict = compare(ref_out, out, atol, rtol)
        if not verdict.ok:
            raise Failure("wrong", f"shape {plan.shape.idx}: {what} on input set {i} returned a wrong output: "
                                   f"{verdict.message}")


def _time(fn: Callable[..., Any], sets: list[list[Any]], device: str, env: dict[str, Any],
          rep_ms: float | None) -> tuple[TimeStats, list[Any]]:
    kwargs = {} if rep_ms is None else {"rep_ms": rep_ms}
    if device == "cuda":
        return time_cuda(fn, sets, l2_bytes=env["l2_bytes"], **kwargs)
    return time_cpu(fn, sets, **kwargs)


def _audit_timed_call(problem: Problem, plan: ShapePlan, model: torch.nn.Module, stats: TimeStats,
                      flush: torch.Tensor) -> dict[str, Any]:
    """GPU-only checks of what the timed call really did: work on other streams, the kernels it
    launched. Returns the extra per-shape fields."""
    where = f"shape {plan.shape.idx}"
    host_ms = _guarded(f"{where}: host-timed calls", lambda: audit.host_synced_ms(model, plan.timing_sets, flush))
    if host_ms > ESCAPE_FACTOR * stats.median_ms + ESCAPE_SLACK_MS:
        raise Failure("integrity_violation",
                      f"{where}: work escaped the timed stream — a call takes {host_ms:.4f} ms to a device-wide "
                      f"synchronise but {stats.median_ms:.4f} ms between the stream's events")
    kernels = _guarded(f"{where}: profiled call", lambda: audit.timed_kernels(model, plan.timing_sets[0]))
    problems = audit.kernel_problems(problem, kernels)
    if problems:
        raise Failure("forbidden", f"{where}: {'; '.join(problems)}")
    return {"host_ms": host_ms, "kernels": kernels}


def _graph_times(problem: Problem, plans: list[ShapePlan], models: list[torch.nn.Module],
                 shapes: list[dict[str, Any]], flush: torch.Tensor) -> None:
    """CUDA-graph replay times for launch-bound shapes, last, because a capture that fails can
    leave the stream unusable; a failure only leaves `graph_ms` empty."""
    for plan, model, row in zip(plans, models, shapes, strict=True):
        if row["median_ms"] >= LAUNCH_BOUND_MS:
            continue
        try:
            ms, out = audit.graph_replay_ms(model, plan.timing_sets[0], flush)
            _verify_timed(problem, plan, [out, None], "the CUDA-graph replay")
            row["graph_ms"] = ms
        except Failure:
            raise
        except BaseException as exc:  # not capturable: report, keep the latency as the measure
            row["graph_note"] = f"not capturable in a CUDA graph: {_one_line(exc, 200)}"
            print(f"[worker] shape {plan.shape.idx}: {row['graph_note']}", flush=True)
            return


def _job_problem(job: dict[str, Any]) -> Problem:
    return load_problem(Path(job["problem_path"]))


def grade(job: dict[str, Any], result: dict[str, Any]) -> None:
    """Grade one submission, filling `result` as it goes (so a failure keeps env and seeds)."""
    phases = _Phases(job.get("phase_path"), result)
    device, base_seed = job["device"], int(job["base_seed"])
    problem = _job_problem(job)
    solution_dir = Path(job["solution_dir"])
    shapes = problem.shapes_for(device)
    seeds = [*problem.seeds, base_seed]
    env = probe_environment(device)
    result.update(env=env, seeds=seeds, shapes=[])
    phases.enter("reference")
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    print(f"[worker] planning {len(shapes)} shapes × {len(seeds)} seeds on {env['device_name']}", flush=True)
    plans = make_plan(problem, reference, shapes, seeds, (base_seed + 1, base_seed + 2), device)
    hits = audit.forbidden_text_hits(problem, solution_dir)
    if hits:
        raise Failure("forbidden", f"forbidden op used: {'; '.join(hits)}")
    state = torch_global_state()
    phases.enter("build")
    sys.path.insert(0, str(solution_dir))
    t0 = time.perf_counter()
    try:
        solution = import_file("solution", solution_dir / "solution.py")
    except BaseException as exc:
        status = "oom" if isinstance(exc, torch.OutOfMemoryError) else "build_error"
        raise Failure(status, f"importing solution.py: {_one_line(exc)}") from exc
    result["import_seconds"] = time.perf_counter() - t0
    _check_state(state, "when solution.py was imported")
    flush = None
    if device == "cuda":
        result["l2"] = audit.reset_persisting_l2()
        flush = torch.empty(2 * env["l2_bytes"] // 4, dtype=torch.int32, device="cuda")
    models = []
    for plan in plans:
        phases.enter("correctness")
        apply_shape(reference, problem, plan.shape)

        def construct(plan: ShapePlan = plan) -> torch.nn.Module:
            if problem.weight_transfer == "seed":
                torch.manual_seed(seeds[0])
            model = build_model(solution, plan.init_args, device, problem.solution_class)
            if problem.weight_transfer == "state_dict":
                model.load_state_dict(plan.state_dict, strict=True)
            return model

        model = _guarded(f"shape {plan.shape.idx}: building Model", construct)
        if plan is plans[0]:
            ops = _guarded("dispatch-mode call",
                           functools.partial(audit.forbidden_op_hits, problem, model, plan.checks[0].inputs))
            if ops:
                raise Failure("forbidden", f"forbidden aten ops ran: {', '.join(ops)}")
        worst = _check_shape(problem, plan, model, state, device)
        print(f"[worker] shape {plan.shape.idx} correct (‖d‖/‖ref‖ ≤ {worst:.3g})", flush=True)
        phases.enter("timing")
        stats, last = _guarded(f"shape {plan.shape.idx}: timing",
                               functools.partial(_time, model, plan.timing_sets, device, env, job.get("rep_ms")))
        _check_state(state, f"while timing shape {plan.shape.idx}")
        _verify_timed(problem, plan, last, "a timed call")
        row: dict[str, Any] = {"idx": plan.shape.idx, **stats.row(), "wall_ms": stats.wall_ms, "max_rel_err": worst}
        if flush is not None:
            row.update(_audit_timed_call(problem, plan, model, stats, flush))
        print(f"[worker] shape {plan.shape.idx} median {stats.median_ms:.4f} ms × {stats.iterations}", flush=True)
        result["shapes"].append(row)
        models.append(model)
    if flush is not None:
        _graph_times(problem, plans, models, result["shapes"], flush)
    n_checks = sum(len(p.checks) for p in plans)
    result.update(status="pass", message=f"correct on all {n_checks} checks ({len(plans)} shapes × "
                                         f"{len(seeds)} seeds × {1 + len(problem.numeric_stress)} numeric "
                                         f"cases + structural cases) and on every timed call")


def baselines(job: dict[str, Any], result: dict[str, Any]) -> None:
    """Time the reference itself, eager and through torch.compile, on every shape."""
    device = job["device"]
    problem = _job_problem(job)
    shapes = problem.shapes_for(device)
    env = probe_environment(device)
    result.update(env=env, phase="reference")
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    rows = []
    for shape in shapes:
        plan = make_plan(problem, reference, (shape,), [int(job["base_seed"])], BASELINE_TIMING_SEEDS, device)[0]
        plan.checks.clear()  # only the timing sets are needed here
        torch.manual_seed(int(job["base_seed"]))
        model = build_model(reference, plan.init_args, device)
        for variant in job["variants"]:
            row: dict[str, Any] = {"shape_idx": shape.idx, "variant": variant}
            try:
                stats, _ = _time(_variant_fn(model, variant), plan.timing_sets, device, env, job.get("rep_ms"))
                row.update(status="ok", message="ok", **stats.row())
                print(f"[baseline] shape {shape.idx} {variant}: {stats.median_ms:.4f} ms", flush=True)
            except Exception as exc:  # a baseline that cannot run is recorded, not fatal
                row.update(status="error", message=_one_line(exc))
                print(f"[baseline] shape {shape.idx} {variant}: {row['message']}", flush=True)
            rows.append(row)
        del model, plan
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

"""The judge: grades one submission in the trusted worker process; candidate code never runs here.

It drives a runner (runner.py), the one process that imports and runs candidate code, through
`link.RunnerLink`, and decides everything itself:

1. the reference and every reference output (each shape's seeds × stress cases and timing input
   sets, planned one shape at a time so a problem with GB-sized inputs fits) are computed here,
   in a process that never runs candidate code, and never leave it;
2. forbidden substrings are looked for in every file of the submission, before any of it runs;
3. torch's global numeric state, as the runner reports it before the import, is compared with its
   reports after the import, each call and each timing loop (a tripwire: a runner can lie);
4. each call's inputs are shared with the runner (protocol.Arena) and compared here, after the
   call, with the judge's own pristine copies (no in-place writes);
5. every output is compared here (correctness.compare) with references the runner never sees;
   timing rotates over two fresh input sets, the statistics are recomputed here from the runner's
   raw per-call samples, and the timed calls' last outputs are checked; the audit rules are
   applied here to the raw data the runner collected (forbidden ops and kernels, escaped work).

What this stops that one shared interpreter did not: a candidate that patches the comparison,
the statistics or the rules, or rewrites the reference outputs in memory. What a runner can still
lie about is listed in runner.py. `baselines()` times the reference itself (trusted code) here.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import audit
from .atomic import write_text_atomic
from .correctness import Output, Verdict, check_type, compare, compare_topk, dtype_name
from .deck import Problem, StressCase, load_problem
from .failure import Failure, one_line
from .link import Received, Reply, RunnerLink
from .phases import Phases
from .plan import ShapePlan, build_model, import_file, install_shapes_module, make_plan
from .probe import probe_environment
from .protocol import Arena, TensorRef
from .settings import BASELINE_TIMING_SEEDS, LAUNCH_BOUND_MS
from .timing import TimeStats, summarize, time_cpu, time_cuda

_STARTED = time.monotonic()


def log(tag: str, message: str) -> None:
    """One progress line in the worker's log, stamped with seconds since the worker started (so a
    grading cut off by its timeout shows where the time went)."""
    print(f"[{tag}] {message} (+{time.monotonic() - _STARTED:.1f} s)", flush=True)


def _check_state(before: dict[str, Any], reply: Reply, when: str) -> None:
    after = reply.state(before)
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    if changed:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
        raise Failure("integrity_violation", f"torch global state changed {when}: {detail}")


def _check_inputs(shared: list[torch.Tensor | None], pristine: list[Any], where: str) -> None:
    """Stops in-place writes to inputs: the shared inputs after the call against private copies."""
    for i, (now, then) in enumerate(zip(shared, pristine, strict=True)):
        if now is not None and not torch.equal(now.to(then.device), then):
            raise Failure("integrity_violation", f"{where}: the solution wrote into input {i}")


def _judge(problem: Problem, ref: Output, got: Received, inputs: list[Any], case: StressCase | None) -> Verdict:
    """An output the runner sent against the reference's: its header judged first (link.py), then
    its values here, under the problem's output rule and the case's tolerance."""
    if got.tensor is None:  # not a tensor, or a shape or dtype that cannot stand for `ref`
        return Verdict(False, got.problem or "no output")
    parts = ref if isinstance(ref, tuple) else (ref,)
    device = parts[0].device
    if got.device != str(device):
        return Verdict(False, f"output device {got.device} != expected {device}")
    outs = got.tensor if isinstance(got.tensor, tuple) else (got.tensor,)
    return judge_values(problem, ref, tuple(o.to(device) for o in outs), inputs, case)


def judge_values(problem: Problem, ref: Output, outs: tuple[torch.Tensor, ...], inputs: list[Any],
                 case: StressCase | None) -> Verdict:
    """Output tensors (on the reference's device) against the reference's, under the problem's
    output rule and the case's tolerance: the rule a solution is held to, and a library line too."""
    parts = ref if isinstance(ref, tuple) else (ref,)
    if len(outs) != len(parts):
        return Verdict(False, f"{len(outs)} outputs, expected {len(parts)}")
    for i, (r, o) in enumerate(zip(parts, outs, strict=True)):
        why = check_type(r, o)
        if why is not None:
            return Verdict(False, why if len(parts) == 1 else f"output {i}: {why}")
    if problem.output_rule == "topk" and len(parts) == 2:
        atol, rtol = problem.tolerance_for(dtype_name(parts[0].dtype), case)
        return compare_topk(inputs[0], parts, outs, atol, rtol)
    worst: Verdict | None = None
    for i, (r, o) in enumerate(zip(parts, outs, strict=True)):
        atol, rtol = problem.tolerance_for(dtype_name(r.dtype), case) if r.is_floating_point() else (0.0, 0.0)
        verdict = compare(r, o, atol, rtol)
        if not verdict.ok:
            return verdict if len(parts) == 1 else Verdict(False, f"output {i}: {verdict.message}", verdict.rel_err)
        if worst is None or (verdict.rel_err or 0.0) > (worst.rel_err or 0.0):
            worst = verdict
    assert worst is not None
    return worst


def _share(link: RunnerLink, plan: ShapePlan, k: int, seed: int,
           keep_timing_inputs: bool) -> list[list[torch.Tensor | None]]:
    """Copy the shape's inputs into shared memory, have the runner build its Model; returns the
    judge's views of each check's inputs (None for a non-tensor input)."""
    arena = Arena({"init_args": plan.init_args, "state_dict": plan.state_dict,
                   "checks": [c.inputs for c in plan.checks], "timing": plan.timing_sets})
    log("worker", f"shape {plan.shape.idx}: {arena.size / 1e9:.2f} GB of inputs and state copied to shared memory")
    try:
        link.ask("shape", f"shape {plan.shape.idx}: building Model", fds=(arena.fd,), shape=k, seed=seed,
                 arena_size=arena.size, values=arena.encoded)
    finally:
        arena.close_fd()
    for check in plan.checks:
        check.inputs = []  # the arena holds the runner's copy; `pristine` keeps the judge's
    plan.timing_inputs = plan.timing_sets if keep_timing_inputs else []  # for rules that read the inputs
    plan.timing_sets = []
    return [[arena.view(r) if isinstance(r, TensorRef) else None for r in inputs]
            for inputs in arena.encoded["checks"]]


def _check_shape(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, shared: list[list[Any]],
                 state: dict[str, Any]) -> float:
    """Every check of one shape; returns the worst normalised error ‖d‖/‖ref‖."""
    worst = 0.0
    for j, check in enumerate(plan.checks):
        where = f"shape {plan.shape.idx} ({plan.shape.label}) {check.label}"
        reply = link.ask("call", where, shape=k, check=j, state_scale=check.stress.state_scale if check.stress else {})
        _check_state(state, reply, f"during {where}")
        _check_inputs(shared[j], check.pristine, where)
        verdict = _judge(problem, check.ref_out, reply.outputs([check.ref_out])[0], check.pristine, check.stress)
        if not verdict.ok:
            raise Failure("wrong", f"{where}: {verdict.message}")
        worst = max(worst, verdict.rel_err or 0.0)
    return worst


def _verify_timed(problem: Problem, plan: ShapePlan, outputs: list[Received], what: str) -> None:
    for i, (ref_out, out) in enumerate(zip(plan.timing_refs, outputs, strict=False)):
        inputs = plan.timing_inputs[i] if plan.timing_inputs else []
        verdict = _judge(problem, ref_out, out, inputs, None)
        if not verdict.ok:
            raise Failure("wrong", f"shape {plan.shape.idx}: {what} on input set {i} returned a wrong output: "
                                   f"{verdict.message}")


def _time_shape(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, state: dict[str, Any],
                device: str) -> tuple[TimeStats, dict[str, Any]]:
    """Time one shape in the runner; statistics, output checks and (on a GPU) the audit rules
    here. Returns the stats and the extra per-shape fields of the GPU audits."""
    where = f"shape {plan.shape.idx}"
    reply = link.ask("time", f"{where}: timing", shape=k)
    stats = summarize(reply.samples("samples_ms", at_least=2), reply.number("wall_ms"))
    _check_state(state, reply, f"while timing shape {plan.shape.idx}")
    _verify_timed(problem, plan, reply.outputs(plan.timing_refs), "a timed call")
    if device != "cuda":
        return stats, {}
    host_ms = statistics.median(link.ask("host_sync", f"{where}: host-timed calls", shape=k).samples("samples_ms"))
    escaped = audit.escaped_work(host_ms, stats.median_ms)
    if escaped:
        raise Failure("integrity_violation", f"{where}: {escaped}")
    kernels = link.ask("kernels", f"{where}: profiled call", shape=k).strings("kernels")
    problems = audit.kernel_problems(problem, kernels)
    if problems:
        raise Failure("forbidden", f"{where}: {'; '.join(problems)}")
    return stats, {"host_ms": host_ms, "kernels": kernels}


def _graph_times(link: RunnerLink, problem: Problem, plans: list[ShapePlan], shapes: list[dict[str, Any]]) -> None:
    """CUDA-graph replay times for launch-bound shapes, last, because a capture that fails can
    leave the stream unusable; a failure only leaves `graph_ms` empty."""
    for k, (plan, row) in enumerate(zip(plans, shapes, strict=True)):
        if row["median_ms"] >= LAUNCH_BOUND_MS:
            continue
        reply = link.ask("graph", f"shape {plan.shape.idx}: CUDA-graph replay", shape=k, keep_error=True)
        if reply.error is not None:  # not capturable: report, keep the latency as the measure
            why = one_line(reply.error["type"], reply.error["text"], 200)
            row["graph_note"] = f"not capturable in a CUDA graph: {why}"
            log("worker", f"shape {plan.shape.idx}: {row['graph_note']}")
            return
        samples = reply.samples("samples_ms")
        _verify_timed(problem, plan, reply.outputs(plan.timing_refs[:1]), "the CUDA-graph replay")
        row["graph_ms"] = statistics.median(samples)


def _job_problem(job: dict[str, Any]) -> Problem:
    return load_problem(Path(job["problem_path"]))


def grade(job: dict[str, Any], result: dict[str, Any], phases: Phases, link: RunnerLink) -> None:
    """Grade one submission with the runner `link` drives, filling `result` as it goes (so a
    failure keeps env and seeds)."""
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
    log("worker", f"{len(shapes)} shapes × {len(seeds)} seeds on {env['device_name']}")
    hits = audit.forbidden_text_hits(problem, solution_dir)
    if hits:
        raise Failure("forbidden", f"forbidden op used: {'; '.join(hits)}")
    state = link.ready()
    phases.enter("build")
    t0 = time.perf_counter()
    imported = link.ask("import", "importing solution.py", importing=True)
    result["import_seconds"] = time.perf_counter() - t0
    _check_state(state, imported, "when solution.py was imported")
    if device == "cuda":
        result["l2"] = link.ask("gpu_setup", "resetting persisting L2", l2_bytes=env["l2_bytes"]).text("l2")
    plans, n_checks = [], 0
    for k, shape in enumerate(shapes):
        phases.enter("correctness")
        plan = make_plan(problem, reference, (shape,), seeds, (base_seed + 1, base_seed + 2), device)[0]
        log("worker", f"shape {shape.idx}: inputs drawn, {len(plan.checks)} reference outputs computed")
        plans.append(plan)
        shared = _share(link, plan, k, seeds[0], keep_timing_inputs=problem.output_rule != "allclose")
        log("worker", f"shape {shape.idx}: inputs shared, the solution's Model built")
        if device == "cuda":
            torch.cuda.empty_cache()  # the inputs moved to the arena: give their memory back
        if k == 0 and problem.forbidden_ops:
            ops = link.ask("call", "dispatch-mode call", shape=k, check=0, log_ops=True).strings("ops")
            _check_inputs(shared[0], plan.checks[0].pristine, "dispatch-mode call")
            hits = audit.forbidden_ops(problem, ops)
            if hits:
                raise Failure("forbidden", f"forbidden aten ops ran: {', '.join(hits)}")
        worst = _check_shape(link, problem, plan, k, shared, state)
        n_checks += len(plan.checks)
        plan.checks.clear()  # the next shape's plan may be large (06: GBs per input); the timing refs stay
        del shared
        log("worker", f"shape {plan.shape.idx} correct (‖d‖/‖ref‖ ≤ {worst:.3g})")
        phases.enter("timing")
        stats, audited = _time_shape(link, problem, plan, k, state, device)
        log("worker", f"shape {plan.shape.idx} median {stats.median_ms:.4f} ms × {stats.iterations}")
        result["shapes"].append({"idx": plan.shape.idx, **stats.row(), "wall_ms": stats.wall_ms,
                                 "max_rel_err": worst, **audited})
    if device == "cuda":
        _graph_times(link, problem, plans, result["shapes"])
    result.update(status="pass", message=f"correct on all {n_checks} checks ({len(plans)} shapes × "
                                         f"{len(seeds)} seeds × {1 + len(problem.numeric_stress)} numeric "
                                         f"cases + structural cases) and on every timed call")


def _time(fn: Callable[..., Any], sets: list[list[Any]], device: str, env: dict[str, Any],
          rep_ms: float | None) -> tuple[TimeStats, list[Any]]:
    kwargs = {} if rep_ms is None else {"rep_ms": rep_ms}
    if device == "cuda":
        return time_cuda(fn, sets, l2_bytes=env["l2_bytes"], **kwargs)
    return time_cpu(fn, sets, **kwargs)


def baselines(job: dict[str, Any], result: dict[str, Any]) -> None:
    """Time the reference itself — eager, through torch.compile, and each library line the problem
    names (a function of reference.py taking the model and the inputs) — on every shape, or only the
    (shape, variant) pairs in `job["todo"]`. After each shape the rows so far are written to
    `job["checkpoint_path"]`, so a run cut off by its timeout keeps the shapes it finished."""
    device = job["device"]
    problem = _job_problem(job)
    shapes = problem.shapes_for(device)
    env = probe_environment(device)
    result.update(env=env, phase="reference")
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    rows: list[dict[str, Any]] = []
    todo = job.get("todo")
    for shape in shapes:
        wanted = job["variants"] if todo is None else todo.get(str(shape.idx), [])
        if not wanted:
            continue
        plan = make_plan(problem, reference, (shape,), [int(job["base_seed"])], BASELINE_TIMING_SEEDS, device)[0]
        plan.checks.clear()  # only the timing sets are needed here
        torch.manual_seed(int(job["base_seed"]))
        model = build_model(reference, plan.init_args, device)
        for variant in wanted:
            row: dict[str, Any] = {"shape_idx": shape.idx, "variant": variant}
            try:
                fn = _variant_fn(model, variant, problem, reference)
                stats, _ = _time(fn, plan.timing_sets, device, env, job.get("rep_ms"))
                wrong = None if variant == "eager" else _baseline_mismatch(problem, plan, fn)
                if wrong is None:
                    row.update(status="ok", message="ok", **stats.row())
                    log("baseline", f"shape {shape.idx} {variant}: {stats.median_ms:.4f} ms")
                else:  # a wrong answer's time is not a ceiling
                    row.update(status="wrong", message=wrong)
                    log("baseline", f"shape {shape.idx} {variant}: wrong: {wrong}")
            except Exception as exc:  # a baseline that cannot run is recorded, not fatal
                row.update(status="error", message=one_line(type(exc).__name__, str(exc)))
                log("baseline", f"shape {shape.idx} {variant}: {row['message']}")
            fn = None
            _release_memory(device, compiled=variant.startswith("compile:"))
            rows.append(row)
        del model, plan
        _release_memory(device, compiled=False)
        if job.get("checkpoint_path"):
            _checkpoint(Path(job["checkpoint_path"]), rows)
    result.update(status="ok", message="ok", baselines=rows)


def _release_memory(device: str, compiled: bool) -> None:
    """Give back what a variant held before the next one runs: compiled code and its CUDA-graph
    memory pools (max-autotune), cached blocks. Without it 06's third shape ran out of the H200's
    memory at its max-autotune and library lines, the worker itself holding 98 GiB (2026-11-30)."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _baseline_mismatch(problem: Problem, plan: ShapePlan, fn: Callable[..., Any]) -> str | None:
    """Why a compiled or library variant's outputs on the timing sets differ from the eager
    reference's (under the rule and tolerance a solution is held to), or None if they agree.

    Each set is called once more and its output copied at once: outputs kept from the timing loop
    may be overwritten by the next call (max-autotune's CUDA graphs reuse their output memory)."""
    for i, (ref, inputs) in enumerate(zip(plan.timing_refs, plan.timing_sets, strict=True)):
        out = fn(*inputs)
        parts = out if isinstance(out, tuple) else (out,)
        outs = tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in parts)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            return f"input set {i}: returned {type(out).__name__}, not tensors"
        verdict = judge_values(problem, ref, outs, inputs, None)
        if not verdict.ok:
            return f"input set {i}: {verdict.message}"
    return None


def _checkpoint(path: Path, rows: list[dict[str, Any]]) -> None:
    """The baseline rows measured so far, written atomically (the parent reads them if we are killed)."""
    write_text_atomic(path, json.dumps({"baselines": rows}, default=str))


def _variant_fn(model: torch.nn.Module, variant: str, problem: Problem, reference: Any) -> Callable[..., Any]:
    if variant == "eager":
        return model
    if variant.startswith("library:"):
        return functools.partial(getattr(reference, problem.library[variant.split(":", 1)[1]]), model)
    if variant.startswith("compile:"):
        torch._dynamo.reset()
        return torch.compile(model, mode=variant.split(":", 1)[1])
    raise ValueError(f"unknown baseline variant {variant!r}")

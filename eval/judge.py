"""The judge: grades one submission in the trusted worker process; candidate code never runs here.

It drives a runner (runner.py), the one process that imports and runs candidate code, through
`link.RunnerLink`, and decides everything itself:

1. the reference and every reference output (each shape's seeds × stress cases and timing input
   sets, planned one shape at a time so a problem with GB-sized inputs fits) are computed here,
   in a process that never runs candidate code, and never leave it;
2. forbidden substrings are looked for in every file of the submission, before any of it runs;
3. torch's global numeric switches, as the runner reports them before the import, are compared with its
   reports after the import, each call and each timing loop, and a change is logged and named in the
   verdict (`Switches`: they reach only the runner's own process);
4. each call's inputs are shared with the runner (protocol.Arena) and compared here, after the
   call, with the judge's own pristine copies (no in-place writes);
5. every output is compared here (correctness.compare) with references the runner never sees —
   the second call of each shape (the one the op audit watches) like every other; timed calls get
   fresh input values each call, and every timed output is verified here through elements
   probed at judge-seeded positions (timing.py), the last one per input set in full; the
   statistics are recomputed here from the runner's raw per-call samples, and refused if they
   claim less than the judge's own clock allows (timing.batch_problem: batches of calls on
   never-seen inputs, timed here around the request); the audit rules are applied
   here to the raw data the runner collected (forbidden torch functions, ops and kernels,
   escaped work).

What this stops that one shared interpreter did not: a candidate that patches the comparison,
the statistics, the rules or its own clocks, or rewrites the reference outputs in memory. What a
runner can still lie about is listed in runner.py. `baselines()` times the reference itself (trusted code) here.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import audit, gpu_witness
from .atomic import write_text_atomic
from .correctness import (
    REL_ERR_MAX,
    Output,
    Verdict,
    check_type,
    compare,
    compare_topk,
    cosine,
    dtype_name,
    probe,
    probe_positions,
    probe_problem,
)
from .cuda_driver import Driver
from .deck import Problem, StressCase, load_problem
from .failure import Failure, one_line
from .job import Job
from .link import Received, Reply, RunnerLink, part_label
from .phases import Phases
from .plan import (
    ROUTER_NEAR_TIE,
    Check,
    ShapePlan,
    build_model,
    import_file,
    install_shapes_module,
    make_plan,
    nbytes,
)
from .probe import probe_environment
from .protocol import Arena, OutputArea, TensorRef, slots_bytes
from .settings import (
    BASELINE_TIMING_SEEDS,
    CANDIDATE_GPU_SHARE_MIN,
    COVER_UNCOVERED_SHARE,
    GRADER_CONTEXTS_BYTES,
    LAUNCH_BOUND_MS,
    PROOF_DISPATCH_MS,
    PROOF_FLOOR_BUDGET_MS,
    PROOF_MAX_RETRY_REPEAT,
    PROOF_RETRIES,
    PROOF_RETRY_STRETCH,
    TIMING_POOL_SETS,
    WITNESS_GPU_CALLS,
    proof_shape,
)
from .stateful import FunctionStep, StepAdapter, clone_flat
from .timing import TimeStats, batch_problem, floor_ms, retry_passes, summarize, time_cpu, time_cuda
from .witness import JudgeWitness, witness_doubt, witness_problem, witness_ratio

#: When this worker started, for the log's stamps: set by `start_clock` as the worker's `main` begins. At
#: import time it is only a default, since a judge forked from the zygote imported this module long before.
_clock = {"started": time.monotonic()}


def start_clock(started: float) -> None:
    """Stamp this worker's log lines from `started` (a `time.monotonic()` reading)."""
    _clock["started"] = started


def log(tag: str, message: str) -> None:
    """One progress line in the worker's log, stamped with seconds since the worker started (so a
    grading cut off by its timeout shows where the time went)."""
    print(f"[{tag}] {message} (+{time.monotonic() - _clock['started']:.1f} s)", flush=True)


class Switches:
    """Torch's global numeric switches in the runner: as it reported them before the import (`before`), and
    each change it reported after (`changed`: switch -> (before, now), the latest value kept).

    Noted, never a failure (since grader 0.5.12): the reference, every reference output and the baselines are
    computed in processes the solution never enters (point 1 above), so a switch it flips (say
    `allow_bf16_reduced_precision_reduction`, off for fp32 reductions in its own cuBLAS calls) reaches only
    its own computations, which every check holds to the reference. Graders up to 0.5.11 failed such a
    kernel `integrity_violation`, a rule from before the judge and runner were two processes."""

    def __init__(self, before: dict[str, Any]) -> None:
        self.before = before
        self.changed: dict[str, tuple[Any, Any]] = {}

    def note(self, reply: Reply, when: str) -> None:
        """Log each switch the runner reports at a value other than its first and than the last one logged
        (a switch set back is not logged again: it was changed)."""
        after = reply.state(self.before)
        new = {k: (self.before[k], v) for k, v in after.items()
               if v != self.before[k] and (k not in self.changed or self.changed[k][1] != v)}
        if new:
            self.changed.update(new)
            log("worker", f"torch's global switches changed {when}: {_switch_list(new)} (its own process only: "
                          "the reference, its outputs and the baselines are computed elsewhere)")

    def clause(self) -> str:
        """The verdict's words for the changes, or '' where there were none."""
        return f"; it changed torch's global switches ({_switch_list(self.changed)})" if self.changed else ""


def _switch_list(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changes.items()))


def _check_inputs(shared: list[torch.Tensor | None], pristine: list[Any], where: str, problem: Problem) -> None:
    """Stops in-place writes to inputs: the shared inputs after the call against private copies. At a
    numeric stress case's scaled positions the call wrote to the runner's scaled copy, which is not
    seen here; the same code's writes are seen on the seed's nominal call, made first. A stateful
    step may update its state in place (every input past the first: stateful.py); its hidden input not."""
    checked = 1 if problem.stateful is not None else len(shared)
    for i, (now, then) in enumerate(zip(shared[:checked], pristine[:checked], strict=True)):
        if now is not None and not torch.equal(now.to(then.device), then):
            raise Failure("integrity_violation", f"{where}: the solution wrote into input {i}")


def _judge(problem: Problem, ref: Output, got: Received, inputs: list[Any], case: StressCase | None,
           names: list[str] | None = None) -> Verdict:
    """An output the runner sent against the reference's: its header judged first (link.py), then
    its values here, under the problem's output rule and the case's tolerance. `names`: what each
    output part is, for messages (a stateful step's: 'hidden', 'state[0].S', …)."""
    if got.tensor is None:  # not a tensor, or a shape or dtype that cannot stand for `ref` (link.py names it)
        return Verdict(False, got.problem or "no output")
    parts = ref if isinstance(ref, tuple) else (ref,)
    device = parts[0].device
    if got.device != str(device):
        return Verdict(False, f"output device {got.device} != expected {device}")
    outs = got.tensor if isinstance(got.tensor, tuple) else (got.tensor,)
    return judge_values(problem, ref, tuple(o.to(device) for o in outs), inputs, case, names)


def judge_values(problem: Problem, ref: Output, outs: tuple[torch.Tensor, ...], inputs: list[Any],
                 case: StressCase | None, names: list[str] | None = None, lifted: frozenset[int] = frozenset()
                 ) -> Verdict:
    """Output tensors (on the reference's device) against the reference's, under the problem's
    output rule and the case's tolerance: the rule a solution is held to, and a library line too.
    A stateful step's parts are each held to the deck's cosine rule as well; the parts in `lifted` to it
    alone (ROUTER_NEAR_TIE's tolerance: `_near_tie_verdict`)."""
    parts = ref if isinstance(ref, tuple) else (ref,)
    if len(outs) != len(parts):
        return Verdict(False, f"{len(outs)} outputs, expected {len(parts)}")

    def part(i: int) -> str:
        return part_label(i, names)

    for i, (r, o) in enumerate(zip(parts, outs, strict=True)):
        why = check_type(r, o)
        if why is not None:
            return Verdict(False, why if len(parts) == 1 else f"{part(i)}: {why}")
    if problem.output_rule == "topk" and len(parts) == 2:
        atol, rtol = problem.tolerance_for(dtype_name(parts[0].dtype), case)
        return compare_topk(inputs[0], parts, outs, atol, rtol)
    worst: Verdict | None = None
    for i, (r, o) in enumerate(zip(parts, outs, strict=True)):
        part_case = ROUTER_NEAR_TIE if i in lifted else case
        atol, rtol = (problem.tolerance_for(dtype_name(r.dtype), part_case) if r.is_floating_point()
                      else (0.0, 0.0))
        verdict = compare(r, o, atol, rtol, REL_ERR_MAX if part_case is None else None)  # nominal: the norm too
        if not verdict.ok:
            return verdict if len(parts) == 1 else Verdict(False, f"{part(i)}: {verdict.message}", verdict.rel_err)
        if worst is None or (verdict.rel_err or 0.0) > (worst.rel_err or 0.0):
            worst = verdict
    assert worst is not None
    cos_sim = problem.stateful.cos_sim if problem.stateful is not None else None
    if cos_sim is not None:
        for i, (r, o) in enumerate(zip(parts, outs, strict=True)):
            cos = cosine(r, o) if r.is_floating_point() else 1.0
            if not cos >= cos_sim:  # NaN included
                return Verdict(False, f"{part(i)}: cosine similarity {cos:.4f} < {cos_sim:g} (the deck's rule)")
    return worst


def _share(link: RunnerLink, plan: ShapePlan, k: int, seed: int, keep_timing_inputs: bool,
           device: str, problem: Problem) -> tuple[Arena, list[list[torch.Tensor | None]]]:
    """Copy the shape's inputs into shared memory, have the runner build its Model; returns the
    arena (to unpin once the checks are done) and the judge's views of each check's inputs (None
    for a non-tensor input). The judge lets go of its copies of the timing and floor-batch sets before
    the runner places its own on the GPU: on 06's headline shape the two sides' copies, 15 GB each, did
    not fit an 80 GB H100 together (2026-12-06); it keeps the timing sets for the GPU witness only where
    that is asked for and they are small (gpu_witness.asked, skip_reason), and logs why where they are not."""
    arena = Arena({"init_args": plan.init_args, "state_dict": plan.state_dict,
                   "checks": [c.inputs for c in plan.checks], "timing": plan.timing_sets, "proof": plan.proof_sets})
    log("worker", f"shape {plan.shape.idx}: {arena.size / 1e9:.2f} GB of inputs and state copied to shared memory")
    outputs = OutputArea(max([slots_bytes([c.ref_out]) for c in plan.checks] + [slots_bytes(plan.timing_refs)]))
    link.outputs_area = outputs
    plan.kept_bytes = nbytes(plan.state_dict.values(), *plan.timing_sets)
    plan.proof_bytes = nbytes(*(s for batch in plan.proof_sets for s in batch))
    placed = plan.kept_bytes + plan.proof_bytes
    for check in plan.checks:
        check.inputs = []  # the arena holds the runner's copy; `pristine` keeps the judge's
    routed = plan.reference_step is not None  # its other expert choices are computed from the sets (_RunnerUps)
    plan.timing_inputs = plan.timing_sets if keep_timing_inputs or routed else []  # for rules that read the inputs
    if device == "cuda" and gpu_witness.asked():
        why = gpu_witness.skip_reason(problem, device, nbytes(*plan.timing_sets))
        plan.witness_sets = plan.timing_sets if why is None else []
        if why is not None:
            log("worker", f"shape {plan.shape.idx}: not witnessed on the GPU: {why}")
    plan.proof_inputs = plan.proof_sets if routed else []
    plan.timing_sets = []
    plan.proof_sets = []
    plan.state_dict = {}  # the runner's Model holds it now (06's headline: 3.2 GB)
    try:
        if device == "cuda":
            torch.cuda.empty_cache()  # the sets moved to the arena: their memory back before the runner's copies
            _fits_beside_judge(plan, placed)
        link.ask("shape", f"shape {plan.shape.idx}: building Model", fds=(arena.fd, outputs.fd), shape=k, seed=seed,
                 arena_size=arena.size, outputs_size=outputs.size, values=arena.encoded,
                 layout=[list(keys) for keys in plan.layout.layers] if plan.layout is not None else None,
                 probes=[_probe_spec(s, r) for s, r in zip(plan.timing_seeds, plan.timing_refs, strict=True)],
                 proof_probes=[[_probe_spec(s, r) for s, r in zip(seeds, refs, strict=True)]
                               for seeds, refs in zip(plan.proof_seeds, plan.proof_refs, strict=True)])
    except BaseException:
        arena.unpin()
        raise
    finally:
        arena.close_fd()
        outputs.close_fd()
    return arena, [[arena.view(r) if isinstance(r, TensorRef) else None for r in inputs]
                   for inputs in arena.encoded["checks"]]


def _fits_beside_judge(plan: ShapePlan, placed: int) -> None:
    """What the grader itself needs of the GPU for a shape, said in the log, and refused as not_graded
    where it cannot fit: the judge's references and records, and what the runner is given to place
    (the Model's state, which the interface fixes, and the timing and floor-batch sets). An
    out-of-memory error of the runner's is the candidate's (`oom`) only where the grader's own demand
    fits: the judge measures it here, as the runner's report cannot be believed."""
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved()
    log("worker", f"shape {plan.shape.idx}: the judge holds {held / 1e9:.2f} GB of the GPU "
                  f"({torch.cuda.memory_allocated() / 1e9:.2f} GB of it in tensors), the runner is given "
                  f"{placed / 1e9:.2f} GB to place there; {free / 1e9:.2f} GB of {total / 1e9:.2f} GB free")
    if held + placed + GRADER_CONTEXTS_BYTES > total:
        raise Failure("not_graded", f"shape {plan.shape.idx}: the grader's own use of the GPU does not fit its "
                                    f"{total / 1e9:.1f} GB: the judge holds {held / 1e9:.1f} GB and the runner would "
                                    f"place {placed / 1e9:.1f} GB (the Model's state, the timing and floor-batch "
                                    "sets), before any memory of the candidate's")


def _free_whole_pages() -> None:
    """Have the judge's CUDA allocator map its segments page by page (expandable segments), so that what
    it frees goes back to the GPU. With torch's default, a segment is one allocation, and a block freed
    inside it is reused but never returned while any of it is live: 06's headline references came to lie
    in the blocks its GBs of drawn inputs had left, and after `empty_cache` the judge still held 42.4 GB
    of the H100, about 18.5 GB of it in tensors by their sizes (2026-12-06). The runner, the candidate's
    process, keeps torch's default allocator, as the field's harnesses run it."""
    try:  # (torch 2.11 warns that torch.cuda's spelling is deprecated for this one)
        getattr(torch._C, "_accelerator_setAllocatorSettings", torch.cuda.memory._set_allocator_settings)(
            "expandable_segments:True")
    except (AttributeError, RuntimeError) as exc:  # a torch without them: the log says what that costs
        log("worker", f"the judge's allocator keeps whole segments ({one_line(type(exc).__name__, str(exc))}): "
                      "memory it frees may stay reserved beside the runner")


def _placed_in_runner(plans: list[ShapePlan]) -> int:
    """What the grader gave the runner to keep on the GPU, by the plans' recorded sizes: every shape's Model
    state and timing sets, and the current shape's floor batches (the earlier shapes' are released)."""
    return sum(p.kept_bytes for p in plans) + (plans[-1].proof_bytes if plans else 0)


def _oom_verdict(failure: Failure, plans: list[ShapePlan]) -> Failure:
    """A runner's out-of-memory error, judged by what the grader itself held of the GPU then: the
    candidate's (`oom`) only where it had at least CANDIDATE_GPU_SHARE_MIN of the GPU's memory beside
    the judge's hold, what the runner was given to place (every shape's state and timing sets, the
    current shape's floor batches: the runner keeps them) and the CUDA contexts; else not_graded. The
    judge measures its own hold (its cache let go first); the runner's word on its memory is not taken."""
    gc.collect()
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    judge = torch.cuda.memory_reserved()
    placed = _placed_in_runner(plans)
    left = total - judge - placed - GRADER_CONTEXTS_BYTES
    share = (f"{left / 1e9:.1f} of the GPU's {total / 1e9:.1f} GB were the candidate's (the grader's own: the judge "
             f"{judge / 1e9:.1f} GB, placed in the runner {placed / 1e9:.1f} GB, CUDA contexts "
             f"{GRADER_CONTEXTS_BYTES / 1e9:.1f} GB)")
    if left >= CANDIDATE_GPU_SHARE_MIN * total:
        return Failure("oom", f"{failure.message} [{share}]", failure.detail)
    return Failure("not_graded", f"the grader's own use of the GPU left the candidate under "
                                 f"{CANDIDATE_GPU_SHARE_MIN:.0%} of it: {share}; {failure.message}", failure.detail)


def _judge_oom_verdict(exc: torch.OutOfMemoryError, plans: list[ShapePlan], where: str) -> Failure:
    """The judge's own out-of-memory error (drawing a shape, computing its references, comparing), judged by
    what the candidate held of the GPU then: a runner that keeps more than the GPU's share a kernel is
    promised (CANDIDATE_GPU_SHARE_MIN, `_oom_verdict`'s rule seen from the other side) has taken the
    grader's room, and the error is its `oom`; otherwise the grader's share did not fit and the run is
    not_graded (graded again by --resume). Without this, a kernel that hoards memory at one shape could
    have the judge fail before the next, a shape it would fail, and leave no verdict. Measured before the
    judge lets its cache go: the candidate's use is what neither the judge nor the grader's placed sets
    and the CUDA contexts account for."""
    free, total = torch.cuda.mem_get_info()
    judge = torch.cuda.memory_reserved()
    placed = _placed_in_runner(plans)
    candidate = total - free - judge - placed - GRADER_CONTEXTS_BYTES
    share = (f"the candidate held {candidate / 1e9:.1f} of the GPU's {total / 1e9:.1f} GB (the grader's own: the "
             f"judge {judge / 1e9:.1f} GB, placed in the runner {placed / 1e9:.1f} GB, CUDA contexts "
             f"{GRADER_CONTEXTS_BYTES / 1e9:.1f} GB; {free / 1e9:.1f} GB free)")
    said, text = one_line(type(exc).__name__, str(exc)), str(exc)[:4000]
    if candidate > CANDIDATE_GPU_SHARE_MIN * total:
        return Failure("oom", f"{where}: the judge ran out of GPU memory while {share}, over the "
                              f"{CANDIDATE_GPU_SHARE_MIN:.0%} a kernel is promised", text)
    return Failure("not_graded", f"{where}: the judge ran out of GPU memory while {share}, within the "
                                 f"{CANDIDATE_GPU_SHARE_MIN:.0%} a kernel is promised: the grader's own use did "
                                 f"not fit; {said}", text)


def _probe_spec(seed: int, ref: Output) -> list[list[int]]:
    """What the runner needs to find an input set's probed positions: (seed, numel) per part."""
    parts = ref if isinstance(ref, tuple) else (ref,)
    return [[seed * 16 + i, part.numel()] for i, part in enumerate(parts)]


def _check_shape(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, shared: list[list[Any]],
                 switches: Switches) -> float:
    """Every check of one shape; returns the worst normalised error ‖d‖/‖ref‖. Where the problem
    forbids ops, the shape's second call (check 0 again, once its first call has warmed up) runs
    under the op audit and is judged like the rest: a first call that autotunes or compiles under
    the audit's two modes ran each torch call ~90× slower (Triton's benchmark loops are made of
    them), while an op used by the first call alone buys no time."""
    worst = 0.0
    names = plan.layout.names if plan.layout is not None else None
    spent = dict.fromkeys(("calls", "outputs", "inputs", "judging"), 0.0)  # seconds, for the log's split
    audit_s = 0.0
    other_choices = []  # (check label, router): near-tie steps that returned a tied router's runner-up choice
    read_before = dict(link.tensors_read)
    recycle = _recycled_check(problem, plan)
    for j, check in enumerate(plan.checks):
        where = f"shape {plan.shape.idx} ({plan.shape.label}) {check.label}"
        if check.tied:
            where += (f" ({ROUTER_NEAR_TIE.name} at router{'s' * (len(check.tied) > 1)} "
                      f"{', '.join(map(str, check.tied))})")
        # Scaled here only for a rule that reads them: on 06's headline a stress case's copy is 2.1 GB.
        called_with = check.called_with() if problem.rule_reads_inputs else []
        t0 = time.monotonic()
        reply = link.ask("call", where, shape=k, check=j, state_scale=check.stress.state_scale if check.stress else {},
                         scale={str(p): f for p, f in check.stress.scale.items()} if check.stress else {},
                         keep=recycle is not None and j == len(plan.checks) - 1)
        t1 = time.monotonic()
        if j == 0:  # said at once: a first call that compiles for minutes fails or passes long after
            log("worker", f"shape {plan.shape.idx}: its first call returned in {t1 - t0:.1f} s (the solution's own "
                          f"compiles and autotuning run there, untimed)")
        switches.note(reply, f"during {where}")
        _check_inputs(shared[j], check.pristine, where, problem)
        t2 = time.monotonic()
        got = reply.outputs([check.ref_out], names)[0]
        t3 = time.monotonic()
        if check.tied:
            verdict, router = _near_tie_verdict(problem, plan, check, got, called_with, names)
            if router is not None:
                other_choices.append((check.label, router))
        else:
            verdict = _judge(problem, check.ref_out, got, called_with, check.stress, names)
        if not verdict.ok:
            raise Failure("wrong", f"{where}: {verdict.message}")
        worst = max(worst, verdict.rel_err or 0.0)
        for key, seconds in zip(spent, (t1 - t0, t3 - t2, t2 - t1, time.monotonic() - t3), strict=True):
            spent[key] += seconds
        if j == 0 and problem.forbidden_ops:
            t4 = time.monotonic()
            _audited_call(link, problem, plan, check, shared[0], f"{where} (op audit)", k, called_with, names)
            audit_s = time.monotonic() - t4
    if recycle is not None:
        worst = max(worst, _recycled_call(link, problem, plan, k, recycle, shared[recycle], names))
    if other_choices:
        log("worker", f"shape {plan.shape.idx}: {len(other_choices)} near-tie step"
                      f"{'s' * (len(other_choices) > 1)} returned the tied router's runner-up choice, accepted "
                      f"({'; '.join(f'{label}: router {r}' for label, r in other_choices)})")
    audit = f"; the op audit's call (check 0 again) {audit_s:.1f} s beside them" if problem.forbidden_ops else ""
    came = {way: n - read_before[way] for way, n in link.tensors_read.items()}
    log("worker", f"shape {plan.shape.idx}: {len(plan.checks)} checks: the runner's calls {spent['calls']:.1f} s, "
                  f"their outputs read {spent['outputs']:.1f} s, inputs checked {spent['inputs']:.1f} s, "
                  f"outputs judged {spent['judging']:.1f} s{audit}; output tensors read: {came['shared']} through "
                  f"shared memory, {came['framed']} as socket frames")
    return worst


def _recycled_check(problem: Problem, plan: ShapePlan) -> int | None:
    """The check called again after a shape's last, with its inputs written where that call's were: the first
    nominal one (its values differ from the last check's, a later seed's or a stress case's). None for a shape
    of one check, and for a stateful step (Mega), not called so yet: a step may update its state in place, so
    the memory to recycle would be the state as the step left it, and a step that reads a state it kept under
    an address is met only where the allocator repeats one (glm-5.2's 211430)."""
    if problem.stateful is not None or len(plan.checks) < 2:
        return None
    return next((j for j, check in enumerate(plan.checks[:-1]) if check.stress is None), None)


def _recycled_call(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, j: int, shared: list[Any],
                   names: list[str] | None) -> float:
    """Check `j` called once more, its inputs written into the memory of the last check's (which the runner
    kept) as new tensors with the same sizes, strides and version counters: what any caller meets whose new
    input the caching allocator placed in a freed one's block. A kernel that keeps what it derived from an
    input under the input's address (and `_version`) serves the last check's result here (deepseek-v4-flash-0731's
    01 of 2026-08-01 keeps its K-padded x so). Judged as any check; returns its ‖d‖/‖ref‖."""
    check = plan.checks[j]
    where = (f"shape {plan.shape.idx} ({plan.shape.label}) {check.label} again, its inputs written where the call "
             "before's were (the same addresses and version counters)")
    called_with = check.called_with() if problem.rule_reads_inputs else []
    reply = link.ask("call", where, shape=k, check=j, recycle=True)
    same, ident = reply.flags("recycled"), reply.flags("recycled_ids")
    _check_inputs(shared, check.pristine, where, problem)
    verdict = _judge_again(problem, plan, check, reply, called_with, names, where)
    log("worker", f"shape {plan.shape.idx}: {check.label} again at the last check's addresses: {sum(same)} of "
                  f"{len(same)} inputs in the same memory with the same version counter ({sum(ident)} with the same "
                  "Python id), correct")
    return verdict.rel_err or 0.0


def _near_tie_verdict(problem: Problem, plan: ShapePlan, check: Check, got: Received, called_with: list[Any],
                      names: list[str] | None) -> tuple[Verdict, int | None]:
    """A checked step at a router near-tie (`check.tied`: the routers whose reference margin is under the
    deck's `router_margin_ulps`, where a rounding of the kernel's own may choose the other expert), and the
    router whose runner-up choice it returned, if it was that. Until 0.5.11 such a step kept the cosine rule
    alone on every output (a quarter to a half of Mega's checked steps). Now:
    - its output is held element-wise to the reference's, as at any step; failing that,
    - with one router tied, to the reference's output with that router's runner-up chosen instead
      (`StepAdapter.with_runner_up`, as a timed call is: `_RunnerUps`), as closely, where that output keeps
      the deck's cosine rule against the reference's;
    - with two or more tied (a flip of each may compound), or one whose runner-up choice meets a near-tie
      of its own at a later router (the kernel may flip that one too), element-wise on the state tensors of
      the layers up to the first tied router's, which no router of the step reaches (layer i's attention
      updates state[i] before its MoE routes), and the cosine rule alone on the hidden output and the later
      layers.
    """
    exact = _judge(problem, check.ref_out, got, called_with, None, names)
    parts = check.ref_out if isinstance(check.ref_out, tuple) else (check.ref_out,)
    if exact.ok or got.tensor is None or got.device != str(parts[0].device) or names is None:
        return exact, None
    outs = tuple(o.to(parts[0].device) for o in (got.tensor if isinstance(got.tensor, tuple) else (got.tensor,)))
    step = plan.reference_step
    spec = problem.stateful
    if len(check.tied) == 1 and step is not None and spec is not None and spec.router_margin_ulps is not None:
        router = check.tied[0]
        with torch.no_grad():
            other = step.with_runner_up(router, *clone_flat(check.pristine_on(str(parts[0].device))))
        later = [r for r, margin in enumerate(step.last_margins) if r > router and margin < spec.router_margin_ulps]
        if judge_values(problem, check.ref_out, other, [], ROUTER_NEAR_TIE).ok:
            alt = judge_values(problem, other, outs, called_with, None, names)
            if alt.ok:
                return alt, router
        if not later:
            return Verdict(False, f"{exact.message} (nor is it, element-wise, the output of router {router}'s "
                                  "runner-up choice, the one router at a near-tie there)", exact.rel_err), None
    first = min(check.tied)
    lifted = frozenset(i for i, name in enumerate(names) if _layer_of(name) is None or _layer_of(name) > first)
    return judge_values(problem, check.ref_out, outs, called_with, None, names, lifted), None


def _layer_of(name: str) -> int | None:
    """The layer a stateful step's output part belongs to ('state[2].S' -> 2), None for the hidden output."""
    return int(name[6:name.index("]")]) if name.startswith("state[") else None


def _audited_call(link: RunnerLink, problem: Problem, plan: ShapePlan, check: Check, shared: list[Any], where: str,
                  k: int, called_with: list[Any], names: list[str] | None) -> None:
    """Check 0 called again under the op audit: refused for a forbidden op, judged like any call."""
    reply = link.ask("call", where, shape=k, check=0, log_ops=True)
    _check_inputs(shared, check.pristine, where, problem)
    hits = audit.forbidden_ops(problem, reply.strings("ops"))
    if hits:
        raise Failure("forbidden", f"forbidden aten ops ran: {', '.join(hits)}")
    _judge_again(problem, plan, check, reply, called_with, names, where)


def _judge_again(problem: Problem, plan: ShapePlan, check: Check, reply: Reply, called_with: list[Any],
                 names: list[str] | None, where: str) -> Verdict:
    """A check's output from a call made again (the op audit's, the recycled one), held to the check's rule as
    its own call was; a miss is `wrong`, said with `where`."""
    got = reply.outputs([check.ref_out], names)[0]
    verdict = (_near_tie_verdict(problem, plan, check, got, called_with, names)[0] if check.tied
               else _judge(problem, check.ref_out, got, called_with, check.stress, names))
    if not verdict.ok:
        raise Failure("wrong", f"{where}: {verdict.message}")
    return verdict


def _verify_timed(problem: Problem, plan: ShapePlan, outputs: list[Received], what: str,
                  runner_ups: _RunnerUps | None = None) -> None:
    """The last timed output of each set, whole; one that misses the reference's but is the output of
    another expert choice (`runner_ups`) is that choice, not a wrong output."""
    for i, (ref_out, out) in enumerate(zip(plan.timing_refs, outputs, strict=False)):
        inputs = plan.timing_inputs[i] if plan.timing_inputs else []
        verdict = _judge(problem, ref_out, out, inputs, None)
        if verdict.ok or (runner_ups is not None and runner_ups.excuse(
                i, lambda other, out=out, inputs=inputs: _judge(problem, other, out, inputs, None).ok,
                f"{what} (the last on input set {i})")):
            continue
        raise Failure("wrong", f"shape {plan.shape.idx}: {what} on input set {i} returned a wrong output: "
                               f"{verdict.message}{runner_ups.none_matched(i) if runner_ups else ''}")


class _RunnerUps:
    """The outputs of another expert choice on a router problem's timed and floor-batch sets.

    Those sets are drawn clear of the *reference's* router ties (ROUTER_CLEAR_*), but a kernel's own
    sums differ from the reference's by rounding, and a kernel whose split-K sums `atomic_add` their
    partials rounds differently from call to call: at a tie in its own arithmetic one call picks the
    runner-up expert, another the last chosen one (claude-opus-4-8's Mega kernel 075926 on the H200).
    That output is valid and far outside the element-wise bound of the reference's, so a timed call
    that misses its reference is held to the output the reference gives with one router's runner-up
    chosen instead (`StepAdapter.with_runner_up`), element-wise, as closely as to the reference: a
    kernel cannot buy time with it, since that output costs a full step. An alternative is admitted
    only if it keeps the deck's cosine rule against the reference. Computed on demand, once a set.
    """

    def __init__(self, problem: Problem, step: StepAdapter, routers: int, sets: list[list[Any]],
                 refs: list[Output]) -> None:
        self.problem, self.step, self.routers, self.sets, self.refs = problem, step, routers, sets, refs
        self._of: dict[int, list[tuple[int, Output]]] = {}
        self.accepted: list[tuple[str, int]] = []  # (which call, router), for the log

    def _others(self, j: int) -> list[tuple[int, Output]]:
        """(router, the reference's output with that router's runner-up) for set j, where it keeps the cosine rule."""
        if j not in self._of:
            others = []
            with torch.no_grad():
                for r in range(self.routers):
                    other = self.step.with_runner_up(r, *clone_flat(self.sets[j]))
                    if judge_values(self.problem, self.refs[j], other, [], ROUTER_NEAR_TIE).ok:
                        others.append((r, other))
            self._of[j] = others
        return self._of[j]

    def excuse(self, j: int, fits: Callable[[Output], bool], what: str) -> bool:
        """Whether a call on set j that missed its reference `fits` one router's runner-up output; if so
        it is recorded (for the log) as that choice."""
        router = next((r for r, other in self._others(j) if fits(other)), None)
        if router is not None:
            self.accepted.append((what, router))
        return router is not None

    def none_matched(self, j: int) -> str:
        return (f" (nor is it the output of another expert choice: none of the {len(self._others(j))} runner-up "
                f"choices of its {self.routers} routers that keep the cosine rule)")

    def log(self, where: str) -> None:
        if self.accepted:
            calls = "; ".join(f"{what.removeprefix(where + ': ')}: router {r}'s runner-up"
                              for what, r in self.accepted[:5])
            more = f" and {len(self.accepted) - 5} more" if len(self.accepted) > 5 else ""
            log("worker", f"{where}: {len(self.accepted)} call{'s' if len(self.accepted) != 1 else ''} returned "
                          f"another expert choice's output, accepted ({calls}{more})")


def _runner_ups(problem: Problem, plan: ShapePlan, sets: list[list[Any]], refs: list[Output]) -> _RunnerUps | None:
    step = plan.reference_step
    return _RunnerUps(problem, step, plan.routers, sets, refs) if step is not None and sets else None


class _Targets:
    """The judge's side of the probes of one set of references (timing.py): per reference, per
    output part, (reference, probed positions, atol, rtol), or None for a part not judged by its
    values (a top-k's indices, whose tie-break may differ)."""

    def __init__(self, problem: Problem, refs: list[Output], seeds: list[int],
                 runner_ups: _RunnerUps | None = None) -> None:
        self.rows: list[list[tuple[torch.Tensor, torch.Tensor, float, float] | None]] = []
        self.runner_ups = runner_ups  # a router problem's other expert choices, tried on a miss
        for seed, ref in zip(seeds, refs, strict=True):
            row: list[tuple[torch.Tensor, torch.Tensor, float, float] | None] = []
            parts = ref if isinstance(ref, tuple) else (ref,)
            for i, (part, (position_seed, numel)) in enumerate(zip(parts, _probe_spec(seed, ref), strict=True)):
                if problem.output_rule == "topk" and i == 1:
                    row.append(None)
                    continue
                atol, rtol = (problem.tolerance_for(dtype_name(part.dtype), None)
                              if part.is_floating_point() else (0.0, 0.0))
                row.append((part, probe_positions(position_seed, numel, "cpu"), atol, rtol))
            self.rows.append(row)

    def check(self, got: torch.Tensor, which: list[int], what: str) -> None:
        """`got[i]`, the probed elements of call i (Reply.probes: parts × PROBE_ELEMENTS, NaN past a
        part's length), against reference `which[i]`'s; a miss is wrong, unless every part of the
        call is another expert choice's output (`_RunnerUps`)."""
        parts = got.shape[1]
        for i, j in enumerate(which):
            if parts != len(self.rows[j]):
                raise Failure("wrong", f"{what} {i}: {parts} output parts probed, expected {len(self.rows[j])}")
            miss = self._miss(got[i], self.rows[j], f"{what} {i} (input set {j}")
            if miss is None or (self.runner_ups is not None and self.runner_ups.excuse(
                    j, lambda other, i=i, j=j: self._miss(got[i], self._retarget(j, other), "") is None,
                    f"{what} {i} (input set {j})")):
                continue
            raise Failure("wrong", miss + (self.runner_ups.none_matched(j) if self.runner_ups else ""))

    def _retarget(self, j: int, other: Output) -> list[tuple[torch.Tensor, torch.Tensor, float, float] | None]:
        """Row j's probes (the same positions and tolerances) aimed at another output of that set."""
        parts = other if isinstance(other, tuple) else (other,)
        return [None if t is None else (part, *t[1:]) for t, part in zip(self.rows[j], parts, strict=True)]

    @staticmethod
    def _miss(values: torch.Tensor, row: list[tuple[torch.Tensor, torch.Tensor, float, float] | None],
              name: str) -> str | None:
        """The first part of one call's probes (parts × PROBE_ELEMENTS) off its target, as a message, or None."""
        multi = len(row) > 1
        for part, target in enumerate(row):
            if target is None:
                continue
            label = f"{name}{f', output {part}' if multi else ''})"
            got = values[part, :target[1].numel()]
            if not bool(torch.isfinite(got).all()):
                return (f"{label} returned an output that is not a plain tensor of the reference's size, or holds "
                        f"NaN or Inf")
            why = probe_problem(*target[:2], got.tolist(), *target[2:])
            if why:
                return f"{label} returned a wrong output: {why}"
        return None


def _probe_ms(refs: list[Output], device: str) -> float:
    """What probing one output costs the judge here (median of 5, ms): the floor's allowance for
    the probe the runner takes after each call of a batch."""
    parts = refs[0] if isinstance(refs[0], tuple) else (refs[0],)
    positions = [probe_positions(1, p.numel(), p.device) for p in parts]
    times = []
    for _ in range(5):
        t = time.perf_counter()
        done = [probe(p, w) for p, w in zip(parts, positions, strict=True)]
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        del done
    return statistics.median(times)


def _floor(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, device: str, claimed_ms: float) -> float:
    """The judge's floor under one call's time (timing.floor_ms): each batch timed here, around
    the request, its probed elements checked like the timed calls', and the runner's own samples of
    the batch held against this clock (timing.batch_problem). The runner's samples run unbroken
    over the batch, probes and its loop included, so the check allows only the round trip; the
    floor, a bound on the calls alone, also takes off the judge's own measure of the probes.

    Where no batch passes the check, up to PROOF_RETRIES longer batches follow before a refusal:
    each repeats a batch's sets until, by the runner's own claim, the calls outlast the worst
    round trip seen so far PROOF_RETRY_STRETCH times over (at most PROOF_MAX_RETRY_REPEAT passes).
    A round trip stretched by a loaded host then weighs little; a lying clock shrinks the longer
    batch as much as the short ones."""
    where = f"shape {plan.shape.idx}"
    batches: list[tuple[float, int, float]] = []
    floors: list[tuple[float, int]] = []
    probe_ms = 2.0 * _probe_ms(plan.proof_refs[0], device)

    def run(b: int, used: int, repeat: int, what: str) -> None:
        refs, seeds = plan.proof_refs[b][:used], plan.proof_seeds[b][:used]
        runner_ups = _runner_ups(problem, plan, plan.proof_inputs[b][:used] if plan.proof_inputs else [], refs)
        targets = _Targets(problem, refs, seeds, runner_ups)
        t0 = time.perf_counter()
        reply = link.ask("proof", f"{where}: {what}", shape=k, batch=b, calls=used, repeat=repeat)
        wall_ms = (time.perf_counter() - t0) * 1e3
        targets.check(reply.probes(len(refs)), list(range(len(refs))), f"{where}: {what}, call")
        if runner_ups is not None:
            runner_ups.log(where)
        calls = len(refs) * repeat
        claimed = reply.samples("samples_ms", at_least=calls)
        if len(claimed) != calls:
            raise reply._bad(f"'samples_ms' has {len(claimed)} samples for {calls} calls")
        batches.append((wall_ms, calls, sum(claimed)))
        floors.append((wall_ms - probe_ms * len(refs), calls))

    for b, refs in enumerate(plan.proof_refs):
        if b >= 2 and sum(w for w, _, _ in batches) > PROOF_FLOOR_BUDGET_MS:
            break  # slow calls: two batches already hold enough of the judge's clock
        used, repeat = proof_shape(claimed_ms, len(refs))
        run(b, used, repeat, f"floor batch {b}")
    forged = batch_problem(batches)
    for retry in range(PROOF_RETRIES if forged else 0):
        b = retry % len(plan.proof_refs)
        used, _ = proof_shape(claimed_ms, len(plan.proof_refs[b]))
        repeat = retry_passes(batches, used, PROOF_RETRY_STRETCH, PROOF_MAX_RETRY_REPEAT)
        run(b, used, repeat, f"longer floor batch {retry} (the round trip outweighed the calls)")
        forged = batch_problem(batches)
        if not forged:
            break
    log("worker", f"{where}: floor batches (judge ms, calls, runner's summed ms): "
                  + ", ".join(f"({w:.2f}, {n}, {c:.2f})" for w, n, c in batches))
    if forged:
        raise Failure("integrity_violation", f"{where}: {forged}")
    return floor_ms(floors, PROOF_DISPATCH_MS[device])


def _timed(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, switches: Switches, device: str,
           cover: bool) -> tuple[TimeStats, dict[str, float] | None]:
    """The runner's timed loop of one shape, its statistic recomputed here from the raw samples and
    every timed output checked; with `cover`, how the covered loop went (None where the runner
    timed it uncovered: more than COVER_UNCOVERED_SHARE of its calls outlasted the cover). On the
    CPU each timed call is inside the judge's witness (eval/witness.py): a report of more or fewer
    calls than it saw is refused, and its clock beside the runner's is logged."""
    where = f"shape {plan.shape.idx}"
    with JudgeWitness() if device == "cpu" else contextlib.nullcontext() as witness:
        reply = link.ask("time", f"{where}: timing{'' if cover else ' (uncovered)'}", shape=k, cover=cover,
                         fds=() if witness is None else witness.runner_fds())
    samples = reply.samples("samples_ms", at_least=2)
    if witness is not None:
        forged = (f"the runner broke the judge's witness: {witness.fault}" if witness.fault
                  else witness_problem(samples, witness.spans_ms))
        if forged:
            raise Failure("integrity_violation", f"{where}: {forged}")
        if witness.spans_ms:
            doubt = witness_doubt(samples, witness.spans_ms, device)
            log("worker", f"{where}: the judge's clock around the {len(witness.spans_ms)} timed calls: "
                          f"{statistics.median(witness.spans_ms):.4f} ms a call (median), the runner's samples "
                          f"{witness_ratio(samples, witness.spans_ms, device):.2f} of each span less the handshake"
                          + (f"; {doubt}" if doubt else ""))
    stats = summarize(samples, reply.number("wall_ms"))
    switches.note(reply, f"while timing shape {plan.shape.idx}")
    pool = len(plan.timing_refs)
    runner_ups = _runner_ups(problem, plan, plan.timing_inputs, plan.timing_refs)
    _Targets(problem, plan.timing_refs, plan.timing_seeds, runner_ups).check(
        reply.probes(stats.iterations), [i % pool for i in range(stats.iterations)], f"{where}: timed call")
    _verify_timed(problem, plan, reply.outputs(plan.timing_refs), "a timed call", runner_ups)
    if runner_ups is not None:
        runner_ups.log(where)
    return stats, reply.cover() if cover else None


def _witness_gpu(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, timed_median_ms: float) -> None:
    """The judge's own clock around WITNESS_GPU_CALLS calls of the shape (eval/gpu_witness.py), logged beside
    the timed median; each witnessed call's probed output checked, logged too. Not a verdict yet: whatever
    fails here is logged and the grading goes on."""
    where = f"shape {plan.shape.idx}"
    sets, plan.witness_sets = plan.witness_sets, []
    if not sets:  # not asked for, or skipped (_share said why)
        return
    setup: gpu_witness.Setup | None = None
    loop: gpu_witness.JudgeLoop | None = None
    try:
        driver = Driver()
        specs = [_probe_spec(seed, ref) for seed, ref in zip(plan.timing_seeds, plan.timing_refs, strict=True)]
        setup = gpu_witness.prepare(driver, sets, plan.timing_refs, specs, WITNESS_GPU_CALLS)
        spans: dict[bool, list[float]] = {}
        got = None
        for first, with_call in ((1, False), (1 + WITNESS_GPU_CALLS, True)):
            loop = gpu_witness.JudgeLoop(driver, setup, first, WITNESS_GPU_CALLS, with_call)
            reply = link.ask("witness", f"{where}: witnessed calls", fds=(setup.block.fd,), keep_error=True,
                             shape=k, layout=setup.layout.encode(), first=first, calls=WITNESS_GPU_CALLS,
                             call=with_call)
            if reply.error is not None:
                loop.release()
                loop.wait()
                raise RuntimeError(f"the runner's side: {one_line(reply.error['type'], reply.error['text'])}")
            spans[with_call], probes = loop.wait()
            got = probes if with_call else got
        fig = gpu_witness.figures(spans[True], spans[False], setup.own_ms)
        doubt = gpu_witness.doubt(timed_median_ms, fig)
        log("worker", f"{where}: {gpu_witness.describe(timed_median_ms, fig)}" + (f"; {doubt}" if doubt else ""))
        try:
            _Targets(problem, plan.timing_refs, plan.timing_seeds).check(
                got, [i % len(setup.pool) for i in range(WITNESS_GPU_CALLS)], f"{where}: witnessed call")
        except Failure as wrong:
            log("worker", f"{where}: a witnessed call's output: {wrong.message} (logged, not refused)")
    except Exception as exc:  # the witness is a measurement beside the grading, not yet part of its verdict
        log("worker", f"{where}: the GPU witness could not run: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        if loop is not None and not loop.ended():  # never unmap the block under a stream still waiting in it
            with contextlib.suppress(Exception):
                loop.release()
                loop.stream.synchronize()
        if setup is not None:
            with contextlib.suppress(Exception):
                setup.block.close()


def _loops(loops: float) -> str:
    return "" if loops <= 1 else f"; the least of {loops:.0f} loops: the host bound the first"


def _host_synced(link: RunnerLink, where: str, k: int,
                 cover: dict[str, float] | None) -> tuple[Reply, float, str | None]:
    """The shape's host-synchronised calls (`audit.host_synced_samples_ms`): their first reading, the
    median host_ms the row keeps, and why the covered figure is not trusted (None where it is, or where
    the loop was not covered; the lesser median where it was read twice). A first reading past
    `audit.cover_hid_work`'s allowance is read once more, and the covered figure is given up only where
    the second exceeds it too (since 0.5.30): work hidden from the cover is in every reading, while a
    host busy with builds stretches only some. Under 0.5.27, in a batch building five
    kernels ahead, claude-fable-5 01 034935's shapes 0 and 1 took 0.1643 and 0.2676 ms past the
    synchronises against 0.1587 and 0.2294 ms allowed and were timed synchronised (1.75× in all); the
    same kernel on a quieter host took 0.1477 and 0.2014 ms and kept its covered figures (2.38×)."""
    synced = link.ask("host_sync", f"{where}: host-timed calls", shape=k)
    host_ms, hidden = _host_reading(synced, where, cover)
    if hidden:
        again = link.ask("host_sync", f"{where}: host-timed calls, read again", shape=k)
        host_again, hidden_again = _host_reading(again, f"{where} (read again)", cover)
        if hidden_again is None:
            log("worker", f"{where}: read again, the call is within its allowance: the covered figure stands "
                          f"(the first reading: {hidden})")
        return synced, min(host_ms, host_again), hidden_again and f"{hidden}; read again, {hidden_again}"
    return synced, host_ms, hidden


def _host_reading(synced: Reply, where: str, cover: dict[str, float] | None) -> tuple[float, str | None]:
    """One reading of host-synchronised calls, logged: its median host_ms and `audit.cover_hid_work`'s
    finding against the covered loop's span and dispatch."""
    host_ms = statistics.median(synced.samples("host_ms"))
    residue_ms = statistics.median(synced.samples("residue_ms"))
    idle_ms = statistics.median(synced.samples("idle_ms"))
    log("worker", f"{where}: host-synchronised call {host_ms:.4f} ms (the synchronises alone {idle_ms:.4f} ms), "
                  f"device busy {residue_ms:.4f} ms past its stream")
    hidden = None if cover is None else audit.cover_hid_work(host_ms, cover["gpu_ms"], cover["dispatch_ms"], idle_ms)
    return host_ms, hidden


def _time_shape(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, switches: Switches,
                device: str) -> tuple[TimeStats, dict[str, Any]]:
    """Time one shape in the runner; statistics, output checks, the judge's floor and (on a GPU)
    the audit rules here. Returns the stats and the extra per-shape fields of the GPU audits."""
    where = f"shape {plan.shape.idx}"
    stats, cover = _timed(link, problem, plan, k, switches, device, cover=device == "cuda")
    if cover is not None:
        log("worker", f"{where}: covered loop: GPU span {cover['gpu_ms']:.4f} ms, dispatch {cover['dispatch_ms']:.4f} "
                      f"ms, sleep {cover['sleep_ms']:.4f} ms (medians), the samples' floor {cover['floor_ms']:.4f} ms "
                      f"(the least dispatch less one launch's {cover['launch_ms']:.4f} ms{_loops(cover['loops'])}), "
                      f"{cover['uncovered']:.0f} of {stats.iterations} calls outlasted their cover")
    elif device == "cuda":
        log("worker", f"{where}: timed with the GPU idle before each call: more than "
                      f"{COVER_UNCOVERED_SHARE:.0%} of the covered calls outlasted their cover")
    floor = _floor(link, problem, plan, k, device, stats.median_ms)
    log("worker", f"{where}: the judge's floor {floor:.4f} ms per warm call (its clock), the timed median "
                  f"{stats.median_ms:.4f} ms (the runner's)")
    if device != "cuda":
        return stats, {}
    synced, host_ms, hidden = _host_synced(link, where, k, cover)
    if hidden:
        log("worker", f"{where}: {hidden}; timed again with the GPU idle before each call")
        stats, cover = _timed(link, problem, plan, k, switches, device, cover=False)
    residues, idles = synced.samples("residue_ms"), synced.samples("idle_ms")
    if len(residues) != len(idles):
        raise synced._bad(f"{len(residues)} 'residue_ms' samples for {len(idles)} 'idle_ms'")
    escaped = audit.escaped_work(residues, idles, stats.median_ms)
    if escaped:
        raise Failure("integrity_violation", f"{where}: {escaped}")
    reply = link.ask("kernels", f"{where}: profiled call", shape=k)
    kernels, own = reply.strings("kernels"), reply.strings("own") if reply.header.get("own") is not None else None
    origin = str(reply.header.get("origin", ""))[:1000]
    log("worker", f"{where}: {'?' if own is None else len(own)} of {len(kernels)} kernels its own ({origin})")
    problems = audit.kernel_problems(problem, kernels, own, origin)
    if problems:
        raise Failure("forbidden", f"{where}: {'; '.join(problems)}")
    launches = int(reply.number("launches"))
    top_share = None if reply.header.get("top_share") is None else min(reply.number("top_share"), 1.0)
    log("worker", f"{where}: {launches} kernel launches per call"
                  + (f", the largest {top_share:.0%} of their time" if top_share is not None else ""))
    return stats, {"host_ms": host_ms, "kernels": kernels, "launches": launches, "top_kernel_share": top_share,
                   "timing_method": "covered" if cover is not None else "synchronised",
                   "gpu_span_ms": None if cover is None else cover["gpu_ms"]}


def _graph_times(link: RunnerLink, problem: Problem, plans: list[ShapePlan], shapes: list[dict[str, Any]]) -> None:
    """CUDA-graph replay times for launch-bound shapes, last, because a capture that fails can
    leave the stream unusable. A capture that fails, or a replay whose output misses the reference's
    (an empty graph: the call launches its kernels outside the capturing stream, say on the legacy
    default stream), only leaves `graph_ms` empty with a note: the problem asks for a correct call, not
    a capturable one, and a replay that did not do the call's work times nothing of it."""
    for k, (plan, row) in enumerate(zip(plans, shapes, strict=True)):
        if row["median_ms"] >= LAUNCH_BOUND_MS:
            continue
        reply = link.ask("graph", f"shape {plan.shape.idx}: CUDA-graph replay", shape=k, keep_error=True)
        why = None if reply.error is None else one_line(reply.error["type"], reply.error["text"], 200)
        if why is None:
            try:
                _verify_timed(problem, plan, reply.outputs(plan.timing_refs[:1]), "the CUDA-graph replay",
                              _runner_ups(problem, plan, plan.timing_inputs, plan.timing_refs))
            except Failure as missed:
                why = f"{missed.message.removeprefix(f'shape {plan.shape.idx}: ')} (its call was right)"
        if why is not None:  # report; the latency stays the measure and the verdict is the calls'
            row["graph_note"] = f"not capturable in a CUDA graph: {why}"
            log("worker", f"shape {plan.shape.idx}: {row['graph_note']}")
            return
        row["graph_ms"] = statistics.median(reply.samples("samples_ms"))


def _grade_shape(link: RunnerLink, problem: Problem, plan: ShapePlan, k: int, seed: int, switches: Switches,
                 phases: Phases, device: str, rows: list[dict[str, Any]]) -> int:
    """Check, then time, one shape of a grading; appends its row to `rows`, returns how many checks ran."""
    arena, shared = _share(link, plan, k, seed, problem.rule_reads_inputs, device, problem)
    log("worker", f"shape {plan.shape.idx}: inputs shared, the solution's Model built")
    if problem.stateful is not None:
        one = sum(1 for c in plan.checks if len(c.tied) == 1)
        several = sum(1 for c in plan.checks if len(c.tied) > 1)
        log("worker", f"shape {plan.shape.idx}: {one + several} of {len(plan.checks)} steps at a router near-tie: "
                      f"{one} with one router tied (held element-wise to the reference's output or that router's "
                      f"runner-up choice), {several} with several (element-wise up to the first tied router's "
                      "layer, the cosine rule alone after it)")
    try:
        worst = _check_shape(link, problem, plan, k, shared, switches)
    finally:
        arena.unpin()
    checked = len(plan.checks)
    plan.checks.clear()  # the next shape's plan may be large (06: GBs per input); the timing refs stay
    del shared
    log("worker", f"shape {plan.shape.idx} correct (‖d‖/‖ref‖ ≤ {worst:.3g})")
    phases.enter("timing")
    stats, audited = _time_shape(link, problem, plan, k, switches, device)
    if device == "cuda":
        _witness_gpu(link, problem, plan, k, stats.median_ms)
    # The floor batches are done. A router problem's reference (a GB on the Mega step) stays only
    # where a CUDA-graph replay of this shape is verified later (_graph_times).
    plan.proof_inputs, plan.proof_refs = [], []  # (06's headline: 3.2 GB of references on the judge's GPU)
    if device != "cuda" or stats.median_ms >= LAUNCH_BOUND_MS:
        plan.reference_step = None
    if plan.reference_step is None:  # a CUDA-graph replay is checked against the first timing set alone
        plan.timing_refs = plan.timing_refs[:1]
    link.ask("release", f"shape {plan.shape.idx}: letting its floor batches go", shape=k)
    if device == "cuda":
        torch.cuda.empty_cache()  # the judge's side too: it held 23.6 GB reserved after 06's headline (0.5.18)
        log("worker", f"shape {plan.shape.idx}: checked and timed; the runner has let its checks' inputs and floor "
                      f"batches go: {torch.cuda.mem_get_info()[0] / 1e9:.2f} GB of the GPU free, the judge holding "
                      f"{torch.cuda.memory_reserved() / 1e9:.2f} GB")
    log("worker", f"shape {plan.shape.idx} median {stats.median_ms:.4f} ms × {stats.iterations}")
    rows.append({"idx": plan.shape.idx, **stats.row(), "wall_ms": stats.wall_ms, "max_rel_err": worst, **audited})
    return checked


def grade(job: Job, result: dict[str, Any], phases: Phases, link: RunnerLink) -> None:
    """Grade one submission with the runner `link` drives, filling `result` as it goes (so a
    failure keeps env and seeds)."""
    if job.solution_dir is None:
        raise ValueError("a grading job names no solution_dir")
    device, base_seed = job.device, job.base_seed
    if device == "cuda":
        _free_whole_pages()
    problem = load_problem(job.problem_path)
    solution_dir = job.solution_dir
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
    switches = Switches(link.ready())
    phases.enter("build")
    t0 = time.perf_counter()
    imported = link.ask("import", "importing solution.py", importing=True)
    result["import_seconds"] = time.perf_counter() - t0
    switches.note(imported, "when solution.py was imported")
    if device == "cuda":
        result["l2"] = link.ask("gpu_setup", "resetting persisting L2", l2_bytes=env["l2_bytes"]).text("l2")
    plans, n_checks = [], 0
    where = "before the first shape"
    try:
        for k, shape in enumerate(shapes):
            where = f"shape {shape.idx} ({shape.label})"
            phases.enter("correctness")
            pool_seeds = tuple(base_seed + 1 + i for i in range(TIMING_POOL_SETS))
            plan = make_plan(problem, reference, (shape,), seeds, pool_seeds, device, proof_seed=base_seed + 97)[0]
            log("worker", f"shape {shape.idx}: inputs drawn, {len(plan.checks)} reference outputs computed")
            plans.append(plan)
            n_checks += _grade_shape(link, problem, plan, k, seeds[0], switches, phases, device, result["shapes"])
        if device == "cuda":
            where = "the CUDA-graph replays' check"
            _graph_times(link, problem, plans, result["shapes"])
    except Failure as failure:
        if failure.status == "oom" and device == "cuda":
            raise _oom_verdict(failure, plans) from failure
        raise
    except torch.OutOfMemoryError as exc:  # the judge's own allocation, with the runner holding the rest
        if device != "cuda":
            raise
        raise _judge_oom_verdict(exc, plans, where) from exc
    cases = (f"{problem.stateful.check_steps} consecutive steps, every state tensor" if problem.stateful
             else f"{1 + len(problem.numeric_stress)} numeric cases + structural cases")
    result.update(status="pass", message=f"correct on all {n_checks} checks ({len(plans)} shapes × "
                                         f"{len(seeds)} seeds × {cases}) and on every timed call"
                                         f"{switches.clause()}")


def _time(fn: Callable[..., Any], sets: list[list[Any]], device: str, env: dict[str, Any],
          rep_ms: float | None) -> tuple[TimeStats, list[Any]]:
    kwargs = {} if rep_ms is None else {"rep_ms": rep_ms}
    if device == "cuda":
        return time_cuda(fn, sets, l2_bytes=env["l2_bytes"], **kwargs)
    return time_cpu(fn, sets, **kwargs)


def baselines(job: Job, result: dict[str, Any]) -> None:
    """Time the reference itself — eager, through torch.compile, and each library line the problem
    names (a function of reference.py taking the model and the inputs) — on every shape, or only the
    (shape, variant) pairs in `job.todo`. After each row the rows so far are written to
    `job.checkpoint_path`, so a run cut off (its timeout, a batch's deadline) keeps the rows it finished:
    one max-autotune compile row can take minutes."""
    device = job.device
    problem = load_problem(job.problem_path)
    shapes = problem.shapes_for(device)
    env = probe_environment(device)
    result.update(env=env, phase="reference")
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    rows: list[dict[str, Any]] = []
    todo = job.todo
    for shape in shapes:
        wanted = job.variants if todo is None else todo.get(str(shape.idx), ())
        if not wanted:
            continue
        plan = make_plan(problem, reference, (shape,), [job.base_seed], BASELINE_TIMING_SEEDS, device)[0]
        plan.checks.clear()  # only the timing sets are needed here
        torch.manual_seed(job.base_seed)
        model = build_model(reference, plan.init_args, device, init_on_device=problem.draw_on_device)
        if problem.stateful is not None and plan.layout is not None:  # timed on flat (hidden, state) sets
            model = StepAdapter(model, plan.layout, problem.stateful.entry)
        for variant in wanted:
            row: dict[str, Any] = {"shape_idx": shape.idx, "variant": variant}
            try:
                fn = _variant_fn(model, variant, problem, reference)
                stats, _ = _time(fn, plan.timing_sets, device, env, job.rep_ms)
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
            if job.checkpoint_path:
                _checkpoint(job.checkpoint_path, rows)
        del model, plan
        _release_memory(device, compiled=False)
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
        fn = getattr(reference, problem.library[variant.split(":", 1)[1]])
        if isinstance(model, StepAdapter):  # a stateful step's line: fn(model, hidden, state) -> (hidden, state)
            return StepAdapter(FunctionStep(fn, model.model), model.layout)
        return functools.partial(fn, model)
    if variant.startswith("compile:"):
        torch._dynamo.reset()
        return torch.compile(model, mode=variant.split(":", 1)[1])
    raise ValueError(f"unknown baseline variant {variant!r}")

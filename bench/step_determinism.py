"""Does a stateful submission give the same output every time it is called on the same state?

A diagnostic for a disagreement, not a grader: it runs the submission's code in this process, with no
sandbox, so run it only on published kernels on a machine you can throw away (the GPU session's).

Why: a Mega step routes each token to 8 of 64 experts by its own router logits. A kernel whose sums
are split across programs that `atomic_add` their partials rounds differently from call to call; at a
router near-tie *in its own arithmetic* one call may choose another expert than the next. Such a call
is another valid output, not a wrong one, but the grader's timed-call probes (32 elements a part) hold
it to the reference's element-wise bound. This script calls the step N times on one timing set drawn
as the grader draws them (clear of the reference's router ties) and reports, per distinct output:
how often it came, its cosine with the reference's and its element-wise misses, part by part — enough
to tell a router flip (few distinct outputs, each near the reference by cosine) from a race (many,
some far) or a deterministic kernel (one).

    python bench/step_determinism.py SUBMISSION_DIR --deck eval/decks/mega --shape 1 --calls 300
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kernelboard.eval.correctness import compare, cosine, dtype_name
from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.plan import build_model, import_file, install_shapes_module, make_plan
from kernelboard.eval.stateful import StepAdapter, clone_flat


def _digest(out: tuple[torch.Tensor, ...]) -> str:
    """The hidden output's exact bytes and every state tensor's float64 sum: a router flip or a race
    moves the hidden output; the sums show a state that moved alone."""
    h = hashlib.sha256(out[0].detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    h.update(repr([float(t.double().sum()) for t in out[1:]]).encode())
    return h.hexdigest()[:12]


def _one_by_one(problem: Problem, step: StepAdapter, names: list[str], flat: list[Any],
                ref: tuple[torch.Tensor, ...], calls: int) -> None:
    """`calls` calls on private copies of one set, each read back before the next."""
    seen: Counter[str] = Counter()
    first_call: dict[str, int] = {}
    report: dict[str, list[str]] = {}
    for i in range(calls):
        out = tuple(t.clone() for t in step(*clone_flat(flat)))
        key = _digest(out)
        seen[key] += 1
        if key in report:
            continue
        first_call[key] = i
        lines = []
        for name, r, o in zip(names, ref, out, strict=True):
            atol, rtol = problem.tolerance_for(dtype_name(r.dtype))
            v = compare(r, o, atol, rtol)
            if not v.ok or name == "hidden":
                verdict = v.message if not v.ok else "within the bound"
                lines.append(f"    {name}: cosine {cosine(r, o):.5f}, {verdict}")
        report[key] = lines
    print(f"{calls} calls one by one, {len(seen)} distinct outputs")
    for key, n in seen.most_common():
        print(f"  output {key}: {n} calls (first at call {first_call[key]})")
        print("\n".join(report[key]))


def _queued(problem: Problem, step: StepAdapter, ref_step: StepAdapter, sets: list[list[Any]],
            refs: list[tuple[torch.Tensor, ...]], calls: int) -> None:
    """The timed loop's conditions: one live set (the same addresses every call) refilled in place,
    every call queued behind a GPU sleep so the kernels run back to back; each hidden output copied
    on the stream before the next call, all judged after one synchronise. Each distinct hidden output
    is named by what it is within the bound of: the reference's, or the reference's with one router's
    runner-up expert chosen (what grader 0.5.1 accepts on a timed call), or neither."""
    live = [t.clone() if isinstance(t, torch.Tensor) else t for t in sets[0]]
    for _ in range(3):  # warm: builds, captures, autotunes outside the queued stretch
        step(*live)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second at the H200's clock: the host queues the calls meanwhile
    hidden = []
    for i in range(calls):
        for dst, src in zip(live, sets[i % len(sets)], strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        hidden.append(step(*live)[0].clone())
    torch.cuda.synchronize()
    atol, rtol = problem.tolerance_for(dtype_name(refs[0][0].dtype))
    for k, ref in enumerate(refs):
        routers = len(ref_step.last_margins)
        others = [ref_step.with_runner_up(r, *clone_flat(sets[k]))[0] for r in range(routers)] if routers else []
        mine = [h for i, h in enumerate(hidden) if i % len(sets) == k]
        distinct: Counter[bytes] = Counter(h.view(torch.int16).cpu().numpy().tobytes() for h in mine)
        print(f"set {k}: {len(mine)} queued calls, {len(distinct)} distinct hidden outputs; the runner-ups' "
              f"cosines with the reference's: {', '.join(f'{cosine(ref[0], o):.4f}' for o in others)}")
        for key, n in distinct.most_common():
            h = next(h for h in mine if h.view(torch.int16).cpu().numpy().tobytes() == key)
            what = ("the reference's" if compare(ref[0], h, atol, rtol).ok else
                    next((f"router {r}'s runner-up" for r, o in enumerate(others) if compare(o, h, atol, rtol).ok),
                         "neither the reference's nor any one router's runner-up"))
            near = max(((cosine(o, h), r) for r, o in enumerate(others)), default=None)
            print(f"    {n} calls: within the bound of {what}; cosine {cosine(ref[0], h):.5f} with the reference's"
                  + (f", {near[0]:.5f} with router {near[1]}'s runner-up (the nearest)" if near else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("submission", type=Path)
    ap.add_argument("--deck", type=Path, default=Path("eval/decks/mega"))
    ap.add_argument("--shape", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--seed", type=int, default=12345, help="the timing set's draw seed")
    ap.add_argument("--device", default="cuda", help="cpu runs the deck's CPU shapes (to try the script)")
    ap.add_argument("--sets", type=int, default=1, help="timing sets, drawn from seed, seed + 1, …")
    ap.add_argument("--queued", action="store_true",
                    help="as the grader's timed loop: one live set refilled in place from set i %% sets before "
                         "call i, the calls queued behind a GPU sleep, no host synchronise between them")
    args = ap.parse_args()
    run = args.submission.name
    problem_dir = next(p for p in args.deck.iterdir() if p.is_dir() and run.endswith(p.name))
    problem = load_problem(problem_dir)
    spec = problem.stateful
    if spec is None:
        print(f"{problem_dir}: not a stateful problem", file=sys.stderr)
        return 2
    device = args.device
    shapes = problem.shapes_for(device)
    shape = shapes[args.shape]
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    torch.manual_seed(0)
    seeds = tuple(args.seed + i for i in range(args.sets))
    plan = make_plan(problem, reference, (shape,), [problem.seeds[0]], seeds, device)[0]
    assert plan.layout is not None
    ref_step = plan.reference_step  # kept by make_plan for a router problem; else built here
    if ref_step is None:
        torch.manual_seed(problem.seeds[0])
        ref_model = build_model(reference, plan.init_args, device, init_on_device=problem.draw_on_device)
        ref_step = StepAdapter(ref_model, plan.layout, spec.entry)
    refs = []
    with torch.no_grad():
        for k, flat in enumerate(plan.timing_sets):
            refs.append(ref_step(*clone_flat(flat)))
            print(f"{run}: shape {shape.idx} ({shape.label}), set {k} drawn from seed {seeds[k]}; the reference's "
                  f"router margins (ulps) {[round(m, 1) for m in ref_step.last_margins]}")

    sys.path.insert(0, str(args.submission))
    solution = import_file("solution", args.submission / "solution.py")
    model = build_model(solution, plan.init_args, device, init_on_device=problem.draw_on_device)
    model.load_state_dict(plan.state_dict, strict=True)
    step = StepAdapter(model, plan.layout, spec.entry)
    with torch.no_grad():
        if args.queued:
            _queued(problem, step, ref_step, plan.timing_sets, refs, args.calls)
        else:
            _one_by_one(problem, step, plan.layout.names, plan.timing_sets[0], refs[0], args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())

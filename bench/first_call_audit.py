"""How much the op audit costs a submission's first call: the same first call timed under the audit
(`audit.op_log`, as the judge makes a shape's first check) and plain, each in a fresh process with an
empty Triton cache, so each compiles and autotunes from scratch.

A diagnostic, not a grader: it runs the submission's code in this process, with no sandbox, so run it
only on published kernels on a machine you can throw away (the GPU session's). Why it exists: on this
2-core CPU a torch op plus two tensor-method calls cost 0.6 µs plain and 54 µs under the audit's two
modes, and a Triton autotuner benchmarks each config with thousands of such reps in the first call.
cursor composer-2.5-fast's Mega kernel spent more than 500 s in that call on the H200.

    python bench/first_call_audit.py SUBMISSION_DIR --deck eval/decks/mega --shape 0 [--modes plain,audited]
        [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kernelboard.eval import audit
from kernelboard.eval.deck import load_problem
from kernelboard.eval.plan import build_model, import_file, install_shapes_module, make_plan
from kernelboard.eval.stateful import StepAdapter


def _first_call(submission: Path, deck: Path, shape_idx: int, device: str, audited: bool) -> dict[str, float]:
    """One fresh first call, as the runner makes it; its seconds and (audited) the ops it logged."""
    problem_dir = next(p for p in deck.iterdir() if p.is_dir() and submission.name.endswith(p.name))
    problem = load_problem(problem_dir)
    shapes = problem.shapes_for(device)
    shape = shapes[shape_idx]
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    seed = problem.seeds[0]
    plan = make_plan(problem, reference, (shape,), [seed], (), device)[0]
    inputs = plan.checks[0].pristine_on(device)
    sys.path.insert(0, str(submission))
    solution = import_file("solution", submission / "solution.py")
    if problem.weight_transfer == "seed":
        torch.manual_seed(seed)
    model = build_model(solution, plan.init_args, device, problem.solution_class,
                        init_on_device=problem.draw_on_device and problem.weight_transfer == "state_dict")
    if problem.weight_transfer == "state_dict":
        model.load_state_dict(plan.state_dict, strict=True)
    if problem.stateful is not None:
        assert plan.layout is not None
        model = StepAdapter(model, plan.layout, problem.stateful.entry)
    started = time.perf_counter()
    ops: list[str] = []
    with torch.no_grad():
        if audited:
            ops, _ = audit.op_log(model, inputs)
        else:
            model(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - started, "distinct_ops": len(ops)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("submission", type=Path)
    ap.add_argument("--deck", type=Path, default=Path("eval/decks/mega"))
    ap.add_argument("--shape", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu runs the deck's CPU shapes (to try the script)")
    ap.add_argument("--modes", default="audited,plain", help="which first calls, in this order")
    ap.add_argument("--timeout", type=float, default=None, help="seconds each first call may take")
    ap.add_argument("--one", choices=("audited", "plain"), help=argparse.SUPPRESS)  # the child's mode
    args = ap.parse_args()
    if args.one:
        row = _first_call(args.submission, args.deck, args.shape, args.device, args.one == "audited")
        print(json.dumps(row))
        return 0
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            try:
                done = subprocess.run([sys.executable, __file__, str(args.submission), "--deck", str(args.deck),
                                       "--shape", str(args.shape), "--device", args.device, "--one", mode],
                                      env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"{args.submission.name} shape {args.shape}, first call {mode}: more than {args.timeout:.0f} s "
                      f"(stopped)")
                continue
        if done.returncode != 0:
            print(f"{mode}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{args.submission.name} shape {args.shape}, first call {mode}: {row['seconds']:.2f} s"
              + (f" ({row['distinct_ops']} distinct ops logged)" if mode == "audited" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

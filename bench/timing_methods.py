"""Timing fidelity of two GPU timing methods, side by side, on the same calls (issue 14's fidelity target).

"synchronised" (`eval.timing.time_cuda(cover_dispatch=False)`, the grading method before 0.4.0)
synchronises the device before each timed call, so a sample is the call's whole latency: the host's
dispatch plus the GPU's work. On launch-bound shapes (tens of µs) the dispatch is most of it, and it
varies from process to process with the host's state: the house 03 kernel graded three times on one
H200 spread 2.7–23.7% per shape and 10.5% on its headline. "covered" (the default, the grading
method since 0.4.0) keeps the synchronise, then has the GPU sleep for three times the measured
dispatch of one call before the start event: the launches are queued when the call starts, and a
sample is the GPU's span for it, never below the loop's least dispatch (the median under 0.4.0).
`--method covered` times one method only; the JSON keeps each process's dispatch quantiles (the
solution's and the eager line's) and its count of calls that outlasted their cover.

This bench times the submission's Model and the problem's eager reference with both methods in
`--processes` fresh processes (each builds everything anew, as separate gradings do), the methods
interleaved shape by shape, and prints per shape and per method the spread of the medians across
processes (max/min − 1; issue 14's target: ≤ 3% for shapes of ≥ 20 µs), the covered loop's median GPU
span and dispatch (a shape whose dispatch nears its span is bound by the host, and moves with it), and
the spread of the headline (geomean over shapes of eager ms ÷ solution ms; target ≤ 2%) twice: with
each process's own eager times, and with the eager times fixed (their median over processes) — a
grading reuses its GPU's cached baselines, so only the solution's medians move between gradings.
`--cpu-load N` keeps N busy-looping processes running meanwhile (another grading's host load, as with `--gpus 0,1`).

It runs the submission's code unsandboxed: use it on code you trust (the default is the house 03
kernel). Timing only: correctness is the grader's job, and this bench never writes to data/.

    python3 bench/timing_methods.py --processes 3 --cpu-load 12 --json methods.json
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
from gpu_grading import busy_host  # bench/ is this script's sys.path[0]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SUBMISSION = REPO / "data/submissions/hard/20261129_190000_house_kernelboard-house_03_paged_attention"
METHODS = ("synchronised", "covered")
#: Input sets drawn per shape (the grader's timing pool has three).
SETS = 3


class DispatchLog:
    """A model wrapped so that each call's host time (call to return) is logged: the timer's own
    dispatch figure, kept per call, so the bench can print its spread within a loop (the timer
    keeps only the median)."""

    def __init__(self, model: Any) -> None:
        self.model, self.ms = model, []

    def __call__(self, *args: Any) -> Any:
        t = time.perf_counter()
        out = self.model(*args)
        self.ms.append((time.perf_counter() - t) * 1e3)
        return out

    def quantiles(self, last: int) -> dict[str, float]:
        """min, p10, median and p90 of the last `last` calls (a timed loop's)."""
        loop = self.ms[-last:]
        deciles = statistics.quantiles(loop, n=10, method="inclusive")
        return {"min": min(loop), "p10": deciles[0], "median": statistics.median(loop), "p90": deciles[-1]}


def child(submission: Path, device: str, methods: tuple[str, ...]) -> dict[str, Any]:
    """One process's measurements: {shape label: {who: {method: {median, p10, min}}}}. On the CPU
    (a smoke test of this script: the CPU shapes, `time_cpu` for both methods) nothing is learnt."""
    import torch
    import yaml

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import apply_shape, build_model, draw_inputs, import_file, install_shapes_module
    from kernelboard.eval.timing import time_cpu, time_cuda

    meta = yaml.safe_load((submission / "run.yaml").read_text())
    problem = load_problem(REPO / "eval" / "decks" / meta.get("bench", "hard") / meta["problem"])
    shapes = problem.shapes_for(device)
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(shapes)
    sys.path.insert(0, str(submission))
    solution = import_file("solution", submission / "solution.py")
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if device == "cuda" else 0
    out: dict[str, Any] = {}
    for k, shape in enumerate(shapes):
        apply_shape(reference, problem, shape)
        init_args = list(reference.get_init_inputs())
        torch.manual_seed(42)
        ref = build_model(reference, init_args, device, init_on_device=problem.draw_on_device)
        sol = build_model(solution, init_args, device, problem.solution_class)
        if problem.weight_transfer == "state_dict":
            sol.load_state_dict(ref.state_dict(), strict=True)
        sets = [draw_inputs(reference, 1000 + i + 7919 * shape.idx, device, problem.draw_on_device)
                for i in range(SETS)]
        rows: dict[str, dict[str, Any]] = {"solution": {}, "eager": {}}
        order = methods if k % 2 == 0 else methods[::-1]  # neither method always goes first
        with torch.no_grad():
            for method in order:
                for who, model in (("solution", sol), ("eager", ref)):
                    if device == "cpu":
                        stats, _ = time_cpu(model, sets)
                    else:
                        logged = DispatchLog(model)
                        stats, _ = time_cuda(logged, sets, l2_bytes=l2_bytes, cover_dispatch=method == "covered")
                    rows[who][method] = {"median": stats.median_ms, "p10": stats.p10_ms, "min": stats.min_ms,
                                         "timing_method": stats.method}
                    if stats.cover is not None:
                        rows[who][method].update(span=stats.cover.gpu_ms, dispatch=stats.cover.dispatch_ms,
                                                 uncovered=stats.cover.uncovered,
                                                 dispatch_quantiles=logged.quantiles(stats.iterations))
        out[shape.label] = rows
        del ref, sol, sets
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


@click.command(help=__doc__)
@click.option("--submission", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=DEFAULT_SUBMISSION, show_default=True, help="A submission folder (run.yaml, solution.py).")
@click.option("--processes", type=click.IntRange(2, 20), default=3, show_default=True,
              help="Fresh processes, one after another: each measures everything once.")
@click.option("--cpu-load", type=click.IntRange(0, 256), default=0, show_default=True,
              help="Busy-looping processes kept running meanwhile.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the figures here.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: a smoke test of this script (the CPU shapes, one CPU timer), not a measurement.")
@click.option("--method", "methods", type=click.Choice(METHODS), multiple=True, default=METHODS, show_default=True,
              help="The timing methods to compare (repeat the option for both).")
@click.option("--child", "is_child", is_flag=True, hidden=True)
def main(submission: Path, processes: int, cpu_load: int, json_path: Path | None, device: str,
         methods: tuple[str, ...], is_child: bool) -> None:
    if is_child:
        print(json.dumps(child(submission, device, methods)))
        return
    runs: list[dict[str, Any]] = []
    with busy_host(cpu_load):
        for i in range(processes):
            click.echo(f"process {i + 1} of {processes}: timing {submission.name} and its eager reference …")
            done = subprocess.run([sys.executable, __file__, "--child", "--submission", str(submission),
                                   "--device", device, *(a for m in methods for a in ("--method", m))],
                                  capture_output=True, text=True, check=False,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if done.returncode != 0:
                raise click.ClickException(f"process {i + 1} failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    figures: dict[str, Any] = {"submission": submission.name, "processes": processes, "cpu_load": cpu_load,
                               "methods": list(methods),
                               "shapes": {}, "headline": {}}
    click.echo(f"{'shape':<28} {'method':<13} {'solution median ms (per process)':<40} {'spread':>7}  {'≥20µs'}")
    for label in runs[0]:
        figures["shapes"][label] = {}
        for method in methods:
            medians = [r[label]["solution"][method]["median"] for r in runs]
            sp = spread(medians)
            flag = "over 3%" if min(medians) >= 0.02 and sp > 0.03 else ""
            figures["shapes"][label][method] = {"medians": medians, "spread": sp,
                                                "eager": [r[label]["eager"][method]["median"] for r in runs]}
            click.echo(f"{label[:28]:<28} {method:<13} {', '.join(f'{m:.4f}' for m in medians):<40} "
                       f"{sp:>6.1%}  {flag}")
            solution = [r[label]["solution"][method] for r in runs]
            eager = [r[label]["eager"][method] for r in runs]
            if all("span" in x for x in eager):  # the baseline's own cover, kept for the record
                figures["shapes"][label][method]["eager_cover"] = [
                    {k: x[k] for k in ("span", "dispatch", "uncovered", "dispatch_quantiles")} for x in eager]
            if all("span" in x for x in solution):
                figures["shapes"][label][method].update(span=[x["span"] for x in solution],
                                                        dispatch=[x["dispatch"] for x in solution])
                spans = ", ".join(f"{x['span']:.4f}" for x in solution)
                dispatches = ", ".join(f"{x['dispatch']:.4f}" for x in solution)
                click.echo(f"{'':<42} GPU span {spans}; dispatch {dispatches}")
                quantiles = [x["dispatch_quantiles"] for x in solution]
                figures["shapes"][label][method].update(uncovered=[x["uncovered"] for x in solution],
                                                        dispatch_quantiles=quantiles)
                click.echo(f"{'':<42} dispatch min/p10/median/p90: " + "; ".join(
                    "/".join(f"{q[k]:.4f}" for k in ("min", "p10", "median", "p90")) for q in quantiles)
                    + f"; uncovered calls {', '.join(str(x['uncovered']) for x in solution)}")
    for method in methods:
        heads = [math.exp(statistics.fmean(math.log(r[s]["eager"][method]["median"]
                                                    / r[s]["solution"][method]["median"]) for s in r))
                 for r in runs]
        fixed = {s: statistics.median(r[s]["eager"][method]["median"] for r in runs) for s in runs[0]}
        held = [math.exp(statistics.fmean(math.log(fixed[s] / r[s]["solution"][method]["median"]) for s in r))
                for r in runs]
        figures["headline"][method] = {"per_process": heads, "spread": spread(heads),
                                       "fixed_baselines": held, "fixed_spread": spread(held)}
        click.echo(f"headline (× eager, geomean), {method}: {', '.join(f'{h:.3f}' for h in heads)} — spread "
                   f"{spread(heads):.1%}; eager fixed: {', '.join(f'{h:.3f}' for h in held)} — spread "
                   f"{spread(held):.1%} (target ≤ 2%)")
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()

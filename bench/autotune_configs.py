"""Each autotune config of a submission's Triton kernels run alone, in a process of its own, at one shape.

Why: a kernel that fails on one GPU and passed on another is an autotuner's worth of kernels, and an
illegal memory access poisons the CUDA context, so the first config that faults during the autotuner's
benchmark hides what the others do. LongCat-2.0's 07 of 2026-07-07 is the case that asked for this: an
illegal access inside Triton's autotuner on an H100 (kernelboard 0.5.7), a pass on the RTX PRO 6000
(KernelBench-Hard). This restricts one autotuner of the solution at a time to one of its configs, builds
the solution's Model at the shape as the grader does (the reference's state dict loaded into it), calls it
on seed 42's inputs and judges the output by the problem's nominal rule (`judge.judge_values`), each in a
fresh process; it says per config: `ok`, `wrong` (the rule's words), `error` (the exception's first line) or
`crashed` (no answer: the process died, with compute-sanitizer's first finding under `--sanitizer`).
A solution with no module-level autotuner (fixed launch configurations, as deepseek-v4-flash-0731's 02 of
2026-08-02) is called once as published, one row: under `--sanitizer`, which of its kernels faults.

Candidate code runs here without the grader's sandbox: a maintainer's tool for a published kernel, not a
grading. `--device cpu` runs Triton's interpreter (TRITON_INTERPRET=1) at the problem's CPU shapes. Run it
with the Python that has kernelboard installed (`.venv-eval` on a GPU host, as `make eval` makes it): a bare
`python3` there has torch but not `kernelboard.eval`, and says so for the listing.

    .venv-eval/bin/python bench/autotune_configs.py data/submissions/hard/RUN_ID --shape 0 [--sanitizer] \
        [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]

# One config of one autotuner (or, with target "-", the list of autotuners), in this process: its JSON
# answer is the last line of stdout.
_CHILD = """
import json, os, sys, traceback
from pathlib import Path
folder, deck, shape_index, target, index, device = sys.argv[1:7]
sys.path[:0] = [folder]
os.chdir(folder)
import torch, yaml
from triton.runtime.autotuner import Autotuner
from kernelboard.eval.deck import load_problem
from kernelboard.eval.judge import judge_values
from kernelboard.eval.plan import apply_shape, build_model, draw_inputs, import_file, install_shapes_module
problem = load_problem(Path(deck) / yaml.safe_load(Path(folder, "run.yaml").read_text())["problem"])
shapes = problem.shapes_for(device)
shape = shapes[int(shape_index)]
sys.path.insert(1, str(problem.folder))
reference = import_file("reference", problem.reference_path)
install_shapes_module(problem.shapes)
apply_shape(reference, problem, shape)
solution = import_file("solution", Path(folder) / "solution.py")
tuners = {name: obj for name, obj in vars(solution).items() if isinstance(obj, Autotuner)}
if device == "cpu":  # bf16 dots computed on values, as a CPU grading's runner has them
    from kernelboard.eval.interpreter import widen_bf16_dots
    widen_bf16_dots()
if target == "-":
    print(json.dumps({"autotuners": {name: [str(c) for c in t.configs] for name, t in tuners.items()}}))
    sys.exit(0)
if target != "*":  # "*": the call as published, every autotuner left whole
    tuner = tuners[target]
    tuner.configs = [tuner.configs[int(index)]]
try:
    with torch.no_grad():
        init = list(reference.get_init_inputs())
        ref = build_model(reference, init, device)
        inputs = draw_inputs(reference, 42, device)
        expected = ref(*inputs)
        model = build_model(solution, init, device, problem.solution_class)
        if problem.weight_transfer == "state_dict":
            model.load_state_dict(ref.state_dict(), strict=True)
        got = model(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
    outs = got if isinstance(got, tuple) else (got,)
    verdict = judge_values(problem, expected, tuple(o.to(device) for o in outs), inputs, None)
    print(json.dumps({"status": "ok" if verdict.ok else "wrong", "said": verdict.message or ""}))
except Exception as exc:
    first = (str(exc).strip().splitlines() or [""])[0]
    print(json.dumps({"status": "error", "said": f"{type(exc).__name__}: {first}"[:300]}))
"""


def _child(folder: Path, deck: Path, shape: int, target: str, index: int, device: str, sanitizer: bool,
           timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-c", _CHILD, str(folder), str(deck), str(shape), target, str(index), device]
    if sanitizer:
        command = ["compute-sanitizer", "--tool", "memcheck", "--print-limit", "3", *command]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "said": f"no answer in {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    found = [line for line in lines if line.startswith("=========") and ("Invalid" in line or "Error" in line)]
    said = [line for line in lines if line.startswith("{")]  # compute-sanitizer's summary comes after it
    try:
        answer = json.loads(said[-1]) if said else None
    except json.JSONDecodeError:
        answer = None
    if answer is None:
        last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        answer = {"status": "crashed", "said": last[:300]}
    if found:
        answer["sanitizer"] = found[0].strip("= ")
    return answer


@click.command()
@click.argument("submission", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--deck", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=ROOT / "eval" / "decks" / "hard", show_default=True)
@click.option("--shape", type=int, default=0, show_default=True, help="The shape's index (of --device's shapes).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--sanitizer", is_flag=True, help="Run each config under compute-sanitizer's memcheck.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Seconds per config.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the table here too.")
def main(submission: Path, deck: Path, shape: int, device: str, sanitizer: bool, timeout_s: float,
         json_out: Path | None) -> None:
    """Run each autotune config of SUBMISSION's Triton kernels alone at one shape, and judge its output."""
    folder = submission.resolve()
    meta = yaml.safe_load((folder / "run.yaml").read_text()) if (folder / "run.yaml").is_file() else None
    if not isinstance(meta, dict) or "problem" not in meta:
        raise click.ClickException(f"{folder}: no run.yaml naming its problem")
    listing = _child(folder, deck.resolve(), shape, "-", 0, device, False, timeout_s)
    if "autotuners" not in listing:
        raise click.ClickException(f"{folder.name}: its autotuners could not be listed ({listing.get('said')})")
    rows = [{"autotuner": name, "config": i, "what": config,
             **_child(folder, deck.resolve(), shape, name, i, device, sanitizer, timeout_s)}
            for name, configs in listing["autotuners"].items() for i, config in enumerate(configs)]
    if not rows:  # fixed launch configurations: the call itself, once (under --sanitizer: which kernel faults)
        rows = [{"autotuner": "—", "config": "—", "what": "no autotuner: the call as published",
                 **_child(folder, deck.resolve(), shape, "*", 0, device, sanitizer, timeout_s)}]
    table = Table(title=f"{folder.name}, shape {shape} on {device}: each config alone", title_justify="left")
    for column in ("autotuner", "config", "status", "said"):
        table.add_column(column, overflow="fold")
    for row in rows:
        said = row["said"] + (f" | sanitizer: {row['sanitizer']}" if row.get("sanitizer") else "")
        table.add_row(row["autotuner"], f"{row['config']}: {row['what']}", row["status"], said)
    Console().print(table)
    if json_out is not None:
        json_out.write_text(json.dumps({"submission": folder.name, "shape": shape, "device": device, "configs": rows},
                                       indent=1))


if __name__ == "__main__":
    main()

"""Every load and store of a submission's Triton kernels checked against the memory its launch was given, in
Triton's interpreter on the CPU, at one of the problem's GPU shapes.

Why: when a kernel faults with an illegal memory access on one GPU and passed on another, there are two
readings. Either the kernel reaches outside its tensors (its own bug, wherever it runs), or the code the
compiler made for that GPU faults where the kernel's addresses are all inside its tensors (the compiler's and
that GPU's, as LongCat-2.0's 07 config showed on the H100). compute-sanitizer tells them apart only on a GPU,
and names no access where the compiled code itself faults. This needs no GPU: Triton's interpreter runs
every program of every launch in numpy, and every address a load, store or atomic touches (masked-off
lanes left out, as the GPU leaves them) is checked against the storage of each tensor the launch was given:
the allocation a GPU faults outside of. A lane outside every one of them is counted and named (kernel,
program, and the address as a byte of the argument nearest) and masked off, so one run finds them all.
(A kernel that loads its pointers from a tensor, an array of addresses, reaches memory the launch was not
given as a tensor: those lanes count as outside, and the examples say where.)
The output is judged too, by the problem's nominal rule, against the reference computed on the CPU. An
autotuner launches each of its configs once, as its benchmark does on a GPU, and each launch is tallied
under its kernel's name and the constexpr values given as keywords (a config's block sizes); num_warps and
num_stages move no address (the interpreter runs a program whole), so configs differing only there are one.

Code written for CUDA runs on the CPU here: device "cuda" in a factory call, `.cuda()` and `.to("cuda")`
become the CPU (a TorchFunctionMode), and `torch.cuda.synchronize` does nothing; a CUDA graph cannot be made,
which code that falls back to launching without one survives. Candidate code runs without the grader's
sandbox: a maintainer's tool for a published kernel, not a grading.

    .venv/bin/python bench/triton_bounds.py data/submissions/hard/RUN_ID --shape 0 [--seed 42] [--json out.json]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: every @triton.jit runs in the interpreter

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table
from torch.overrides import TorchFunctionMode

from kernelboard.eval.interpreter import Bounds, check_memory, widen_bf16_dots

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def installed(install: Callable[..., Callable[[], None]], *args: Any) -> Iterator[None]:
    """One of kernelboard.eval.interpreter's adjustments, for the run only: installed, then undone."""
    undo = install(*args)
    try:
        yield
    finally:
        undo()


@contextlib.contextmanager
def every_config_launched() -> Iterator[None]:
    """On a GPU an autotuner launches every config in its benchmark, so any of them can fault there; the
    interpreter has no benchmarker. Each config is launched once and all are timed alike (the first is kept)."""
    from triton.runtime.autotuner import Autotuner

    saved = Autotuner.__dict__["do_bench"]

    def once(kernel_call: Any, quantiles: tuple | None = None, **_: Any) -> Any:
        kernel_call()
        return [1.0] * len(quantiles) if quantiles else 1.0

    Autotuner.do_bench = property(lambda self: once)
    try:
        yield
    finally:
        Autotuner.do_bench = saved


def _is_cuda(device: Any) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda") or (
        isinstance(device, int) and not isinstance(device, bool))


class CudaOnCpu(TorchFunctionMode):
    """Tensors that code written for CUDA puts on the GPU are put on the CPU instead."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """`CudaOnCpu`, with `torch.cuda.synchronize` a no-op (there is nothing to wait for)."""
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        with CudaOnCpu():
            yield
    finally:
        torch.cuda.synchronize = saved


def run(folder: Path, deck: Path, shape_index: int, seed: int, shapes_of: str) -> dict[str, Any]:
    """The tally and the verdict of one call of the submission at a shape (see the module docstring)."""
    from kernelboard.errors import SubmissionError
    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.failure import one_line
    from kernelboard.eval.judge import judge_values
    from kernelboard.eval.plan import apply_shape, build_model, draw_inputs, import_file, install_shapes_module
    from kernelboard.eval.submission import load_submission

    try:
        problem = load_problem(deck / load_submission(folder).problem)
    except SubmissionError as exc:
        raise click.ClickException(str(exc)) from None
    shapes = problem.shapes_for(shapes_of)
    if not 0 <= shape_index < len(shapes):
        raise click.ClickException(f"{problem.name} has {len(shapes)} {shapes_of} shapes: --shape {shape_index} "
                                   f"is not one of 0–{len(shapes) - 1}")
    shape = shapes[shape_index]
    sys.path[:0] = [str(folder), str(problem.folder)]
    os.chdir(folder)
    reference = import_file("reference", problem.reference_path)
    install_shapes_module(problem.shapes)
    apply_shape(reference, problem, shape)
    bounds = Bounds()
    stage = "its import"
    try:  # the candidate's code: whatever it raises is its answer (one line), with what its launches touched
        with torch.no_grad(), cuda_on_cpu():
            init = list(reference.get_init_inputs())
            ref = build_model(reference, init, "cpu")
            inputs = draw_inputs(reference, seed, "cpu")
            expected = ref(*inputs)
            solution = import_file("solution", folder / "solution.py")
            stage = "building its Model"
            model = build_model(solution, init, "cpu", problem.solution_class)
            if problem.weight_transfer == "state_dict":
                model.load_state_dict(ref.state_dict(), strict=True)
            stage = "its call"
            with installed(check_memory, bounds), installed(widen_bf16_dots), every_config_launched():
                got = model(*inputs)
        outs = got if isinstance(got, tuple) else (got,)
        verdict = judge_values(problem, expected, tuple(o.cpu() for o in outs), inputs, None)
        values = "right" if verdict.ok else f"wrong: {verdict.message}"
    except Exception as exc:
        values = f"not judged: {stage} raised {one_line(type(exc).__name__, str(exc))}"
    return {"submission": folder.name, "problem": problem.name, "shape": shape_index, "shapes_of": shapes_of,
            "shape_label": getattr(shape, "label", str(shape_index)), "seed": seed, "values": values,
            "kernels": {name: asdict(tally) for name, tally in bounds.kernels.items()}}


@click.command()
@click.argument("submission", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--deck", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=ROOT / "eval" / "decks" / "hard", show_default=True)
@click.option("--shape", "shape_index", type=int, default=0, show_default=True, help="The shape's index.")
@click.option("--shapes-of", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Whose shapes: the GPU's (what a GPU grading calls it on) or the CPU's (smaller, faster here).")
@click.option("--seed", type=int, default=42, show_default=True, help="The inputs' seed (the deck's first is 42).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the tally here too.")
def main(submission: Path, deck: Path, shape_index: int, shapes_of: str, seed: int, json_out: Path | None) -> None:
    """Check every address SUBMISSION's Triton kernels touch at one shape, in the interpreter."""
    answer = run(submission.resolve(), deck.resolve(), shape_index, seed, shapes_of)
    table = Table(title=f"{answer['submission']}, {shapes_of} shape {shape_index} ({answer['shape_label']}), "
                        f"seed {seed}: every address checked", title_justify="left")
    for column in ("kernel", "launches", "programs", "accesses", "outside", "first outside"):
        table.add_column(column, overflow="fold")
    for name, tally in answer["kernels"].items():
        table.add_row(name, str(tally["launches"]), f"{tally['programs']:,}", f"{tally['accesses']:,}",
                      f"{tally['outside']:,}", "; ".join(tally["examples"]) or "—")
    console = Console()
    console.print(table if answer["kernels"] else f"{answer['submission']}: it launched no Triton kernel")
    console.print(f"its output: {answer['values']}")
    if json_out is not None:
        json_out.write_text(json.dumps(answer, indent=1))


if __name__ == "__main__":
    main()

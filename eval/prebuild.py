"""Compile a solution's extensions on the CPU while the GPU grades another submission.

`python -m kernelboard.eval.prebuild PROBLEM_PATH SOLUTION_DIR [WARM_CALL_S]` imports solution.py once
with no GPU visible (`CUDA_VISIBLE_DEVICES=""`), in the same per-solution caches (TORCH_EXTENSIONS_DIR,
TRITON_CACHE_DIR) and with the same TORCH_CUDA_ARCH_LIST the grading worker will use, so that a
`load_inline` / CUDA-source build done at import is already cached when the worker imports it. With
WARM_CALL_S, it then builds the solution's Model and calls it once on meta tensors (`warm_call`), for
the kernels that build in their constructor or on their first call.

Best effort: whatever happens here is ignored; the worker's own import decides the verdict. The
candidate code runs as hostile as anywhere: own process group, scratch copy, killed at the build
timeout by the scheduler.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m kernelboard.eval.prebuild PROBLEM_PATH SOLUTION_DIR [WARM_CALL_S]", file=sys.stderr)
        return 2
    from .deck import load_problem
    from .plan import import_file

    problem = load_problem(Path(argv[0]))
    solution_dir = Path(argv[1])
    reference = import_file("reference", problem.reference_path)
    sys.path.insert(0, str(solution_dir))
    start = time.perf_counter()
    try:
        solution = import_file("solution", solution_dir / "solution.py")
    except BaseException as exc:  # the worker will report it properly
        print(f"[prebuild] import failed after {time.perf_counter() - start:.1f} s: {_said(exc)}")
        return 0
    print(f"[prebuild] imported in {time.perf_counter() - start:.1f} s", flush=True)
    if len(argv) == 3 and float(argv[2]) > 0:
        warm_call(problem, reference, solution, float(argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # its work is done: a thread the solution started (not a daemon) must not keep it alive


def warm_call(problem: Any, reference: types.ModuleType, solution: types.ModuleType, limit_s: float) -> None:
    """Build the solution's Model and call it once on meta tensors of the first shape, so that an extension
    it builds lazily (in its constructor, or on its first call before it touches the data: `_get_mod()`
    in `forward`) is built here, on the CPU, and cached for the worker. Meta tensors carry shapes and
    no data, so any PyTorch work costs nothing and the first read of data raises, which ends the call.
    `torch.cuda.get_device_capability` answers the grading GPU's arch (TORCH_CUDA_ARCH_LIST), as the
    worker's would, so a kernel that picks its flags from it builds what the worker will load; nothing
    else of CUDA is there (`_model_and_inputs` says what is built where). The call runs in a thread,
    given `limit_s`; past that the process exits whatever the thread does (a loop that catches every
    exception included), and the scheduler kills what is left of its process group."""
    start = time.perf_counter()
    said: list[str] = []

    def call() -> None:
        try:
            with _capability_from_arch_list():
                model, inputs, where = _model_and_inputs(problem, reference, solution)
                print(f"[prebuild] warm call: its Model built {where}", flush=True)
                import torch

                entry = getattr(model, problem.stateful.entry) if problem.stateful else model  # Mega: step()
                with torch.no_grad():
                    entry(*inputs)
        except BaseException as exc:  # the end it usually comes to: a read of a meta tensor's data
            said.append(f"ended after {time.perf_counter() - start:.1f} s: {_said(exc)}")
        else:
            said.append(f"returned in {time.perf_counter() - start:.1f} s")

    thread = threading.Thread(target=call, daemon=True, name="warm-call")
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        print(f"[prebuild] warm call stopped at its limit of {limit_s:g} s", flush=True)
        os._exit(0)  # the thread cannot be stopped; the process can
    print(f"[prebuild] warm call {said[0]}", flush=True)


def _model_and_inputs(problem: Any, reference: types.ModuleType,
                      solution: types.ModuleType) -> tuple[Any, list[Any], str]:
    """The solution's Model and inputs of the first shape, all on meta. Where the reference cannot draw
    them there (06's router reads its logits; Mega's weights come from a torch.Generator, which meta has
    none of) or the Model cannot be built there, the Model is built on the CPU at the first CPU shape
    (small: a full shape's weights on the CPU would cost seconds and gigabytes beside the timed process),
    the inputs moved to meta."""
    import torch

    from .plan import apply_shape, install_shapes_module, moved

    cls = getattr(solution, problem.solution_class)
    install_shapes_module(problem.shapes)
    apply_shape(reference, problem, problem.shapes[0])
    try:
        with torch.device("meta"):
            init_args = moved(list(reference.get_init_inputs()), "meta")
            inputs = moved(list(reference.get_inputs()), "meta")
            return cls(*init_args), inputs, f"on meta at {problem.shapes[0].label or 'shape 0'}"
    except Exception:
        if not problem.cpu_shapes:
            raise
    shape = problem.cpu_shapes[0]
    apply_shape(reference, problem, shape)
    init_args = list(reference.get_init_inputs())
    inputs = moved(list(reference.get_inputs()), "meta")
    return cls(*init_args), inputs, f"on the CPU at the first CPU shape ({shape.label or 'cpu shape 0'})"


@contextlib.contextmanager
def _capability_from_arch_list() -> Iterator[None]:
    """`torch.cuda.get_device_capability()` as (major, minor) of a one-arch TORCH_CUDA_ARCH_LIST ("9.0")."""
    import torch

    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    try:
        major, minor = (int(part) for part in arch.split("."))
    except ValueError:
        yield
        return
    saved = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: (major, minor)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


def _said(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0][:300]}" if first else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

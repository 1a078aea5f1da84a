"""Compile a solution's extensions on the CPU while the GPU grades another submission.

`python -m kernelboard.eval.prebuild PROBLEM_PATH SOLUTION_DIR [WARM_CALL_S [no-extensions]]` imports solution.py once
with no GPU visible (`CUDA_VISIBLE_DEVICES=""`), in the same per-solution caches (TORCH_EXTENSIONS_DIR,
TRITON_CACHE_DIR) and with the same TORCH_CUDA_ARCH_LIST the grading worker will use, so that a
`load_inline` / CUDA-source build done at import is already cached when the worker imports it. With
WARM_CALL_S, it then builds the solution's Model and calls it on meta tensors of each shape
(`warm_call`), for the kernels that build in their constructor or on their first call, Triton's
included (compiled for the grading arch, launched nowhere: triton_compile_only.py); for a GPU grading,
then every shape again on fake CUDA tensors, for the builds behind `if x.is_cuda` and those of a Model
that allocates on the GPU itself, with streams and graphs standing in for the GPU's.

Best effort: whatever happens here is ignored; the worker's own import decides the verdict. The
candidate code runs as hostile as anywhere: own process group, scratch copy, killed at the build
timeout by the scheduler.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The prebuild's last argument that refuses torch's extension builds (`_refuse_extension_builds`).
NO_EXTENSIONS = "no-extensions"
#: The grading GPU's identity (JSON of these keys of the probe's answer), which `torch.cuda.get_device_properties`
#: answers in the prebuild (`_answering_capability`).
GRADING_GPU_ENV = "KERNELBOARD_GRADING_GPU"
GRADING_GPU_KEYS = ("device_name", "sm_count", "memory_bytes", "l2_bytes")


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3, 4) or argv[3:] not in ([], [NO_EXTENSIONS]):
        print("usage: python -m kernelboard.eval.prebuild PROBLEM_PATH SOLUTION_DIR [WARM_CALL_S [no-extensions]]",
              file=sys.stderr)
        return 2
    from .deck import load_problem
    from .plan import import_file

    problem = load_problem(Path(argv[0]))
    solution_dir = Path(argv[1])
    capability = grading_capability(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))  # before a solution sets its own
    gpu = _grading_gpu(os.environ.get(GRADING_GPU_ENV, ""))
    reference = import_file("reference", problem.reference_path)
    sys.path.insert(0, str(solution_dir))
    if argv[3:] == [NO_EXTENSIONS]:
        _refuse_extension_builds()
    start = time.perf_counter()
    try:
        with _answering_capability(capability, gpu):  # a build at import picks its flags from them too
            solution = import_file("solution", solution_dir / "solution.py")
    except BaseException as exc:  # the worker will report it properly
        print(f"[prebuild] import failed after {time.perf_counter() - start:.1f} s: {_said(exc)}")
        return 0
    print(f"[prebuild] imported in {time.perf_counter() - start:.1f} s", flush=True)
    if len(argv) >= 3 and float(argv[2]) > 0:
        warm_call(problem, reference, solution, float(argv[2]), capability, gpu)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # its work is done: a thread the solution started (not a daemon) must not keep it alive


def _refuse_extension_builds() -> None:
    """torch's JIT builds raise (`ahead.py`: a host other than the grading one compiles only Triton
    kernels; an extension built against its torch would not load in the grader's)."""
    import torch.utils.cpp_extension as cpp_extension

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("not built here: extensions are built on the grading host, against its torch")

    cpp_extension.load = cpp_extension.load_inline = refused  # type: ignore[assignment]


def warm_call(problem: Any, reference: types.ModuleType, solution: types.ModuleType, limit_s: float,
              capability: tuple[int, int] | None, gpu: dict[str, Any] | None = None) -> None:
    """Build the solution's Model and call it on meta tensors, once per shape, so that an extension it
    builds lazily (in its constructor, or on its first call before it touches the data: `_get_mod()` in
    `forward`) is built here, on the CPU, and cached for the worker, and so are its Triton kernels, for
    every shape: Triton launches compile and launch nothing here (triton_compile_only.py). Meta tensors
    carry shapes and no data, so any PyTorch work costs nothing and the first read of data raises, which
    ends that shape's call. `torch.cuda.get_device_capability` answers the grading GPU's `capability`
    (the grader's TORCH_CUDA_ARCH_LIST, read before the solution's import could set its own), as the
    worker's would, so a kernel that picks its flags from it builds what the worker will load, and so
    does `get_device_properties` where the scheduler named the GPU (`_answering_capability`); nothing
    else of CUDA is there (`_warm_calls` says what is built where). For a GPU grading every shape is then
    called on fake CUDA tensors (`_fake_cuda_call`), whether or not its Model could be built on meta or
    the CPU, with torch.cuda's streams, events and graphs standing in (`_host_streams_and_graphs`). The
    calls run in a thread, given `limit_s` in all; past that the process exits whatever the thread does (a
    loop that catches every exception included), and the scheduler kills what is left of its group."""
    start = time.perf_counter()
    compiled: list[Any] = []

    def calls() -> None:
        with _answering_capability(capability, gpu), _compiling_triton(capability) as triton:
            compiled.append(triton)
            try:
                for model, inputs, where in _warm_calls(problem, reference, solution):
                    if model is None:
                        print(f"[prebuild] warm call {where}", flush=True)
                        continue
                    print(f"[prebuild] warm call: its Model built {where}", flush=True)
                    _call(problem, model, inputs)
            except Exception as exc:  # its Model built nowhere here: on fake CUDA tensors, perhaps
                print(f"[prebuild] warm call on meta and the CPU not made: {_said(exc)}", flush=True)
            if capability is not None:  # a GPU grading: again, where `x.is_cuda` is true, every shape
                for shape in problem.shapes:  # (a Model that allocates on "cuda:0" itself builds only here)
                    _fake_cuda_call(problem, reference, solution, shape)

    thread = threading.Thread(target=_logged(calls), daemon=True, name="warm-call")
    thread.start()
    thread.join(limit_s)
    if compiled and compiled[0] is not None:
        print(f"[prebuild] warm call: {compiled[0].summary()}", flush=True)
    if thread.is_alive():
        print(f"[prebuild] warm call stopped at its limit of {limit_s:g} s", flush=True)
        os._exit(0)  # the thread cannot be stopped; the process can
    print(f"[prebuild] warm calls done in {time.perf_counter() - start:.1f} s", flush=True)


def _call(problem: Any, model: Any, inputs: list[Any]) -> None:
    """One warm call, said in the log (the end it usually comes to is a read of a meta tensor's data)."""
    import torch

    began = time.perf_counter()
    try:
        entry = getattr(model, problem.stateful.entry) if problem.stateful else model  # Mega: step()
        with torch.no_grad():
            entry(*inputs)
    except BaseException as exc:
        print(f"[prebuild] warm call ended after {time.perf_counter() - began:.1f} s: {_said(exc)}", flush=True)
        return
    print(f"[prebuild] warm call returned in {time.perf_counter() - began:.1f} s", flush=True)


def _fake_cuda_call(problem: Any, reference: types.ModuleType, solution: types.ModuleType, shape: Any) -> None:
    """The warm call again, its Model and inputs fake CUDA tensors (torch's FakeTensorMode: a device of
    "cuda", shapes, no data and no GPU), for a kernel that builds only where its input is on the GPU
    (`if x.is_cuda: _get_ext()`): kinetic-0715's 07 of 2026-07-16 built its extension for 74 s of the
    H100's time that way, its call on meta having returned through its PyTorch fallback. A fake tensor's
    data pointer reads 0 and an op computes only shapes, so the call goes on to its build and its Triton
    launches (compiled, run nowhere); a launch of its own kernel, or a read of data, ends it as on meta."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    label = shape.label or "a shape"
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _host_streams_and_graphs():
            model, inputs = _model_and_inputs(problem, reference, solution, shape, "cuda", None)
            print(f"[prebuild] warm call: its Model built on fake CUDA tensors at {label}", flush=True)
            _call(problem, model, inputs)
    except BaseException as exc:
        print(f"[prebuild] warm call on fake CUDA tensors at {label} not made: {_said(exc)}", flush=True)


class _HostStand:
    """A CUDA stream, event or graph where there is no GPU: every method does nothing and says it is done.
    A kernel that warms up on a side stream and captures its call in a graph (deepseek-v4-flash's 05 of
    2026-08-01 builds its extension in the first launch it captures) reaches its build through these."""

    cuda_stream = 0
    device = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: True if name == "query" else 0.0 if name == "elapsed_time" else None

    def __enter__(self) -> _HostStand:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _host_streams_and_graphs() -> contextlib.AbstractContextManager[None]:
    """For the call on fake CUDA tensors: torch.cuda's streams, events and graphs as `_HostStand`s (a graph
    capture runs its body once, as an eager call would), `synchronize` a no-op and no stream capturing.
    deepseek-v4-flash-0731 05 225649's extension build and the Triton launches of claude-fable-5 07 034935
    and 070614 sit behind one of these, where no driver answers (bench/warm_call_reach.py)."""
    stands = dict.fromkeys(("Stream", "Event", "CUDAGraph", "graph", "stream", "current_stream", "default_stream"),
                           _HostStand)
    return _cuda_answering({**stands, "synchronize": lambda device=None: None,
                            "is_current_stream_capturing": lambda: False})


@contextlib.contextmanager
def _cuda_answering(answers: dict[str, Any]) -> Iterator[None]:
    """torch.cuda's functions named in `answers` replaced by them while the block runs, restored after."""
    import torch

    saved = {name: getattr(torch.cuda, name) for name in answers}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def _logged(calls: Any) -> Any:
    """`calls`, with what escapes it (a Model that cannot be built anywhere) said in the log."""
    def run() -> None:
        try:
            calls()
        except BaseException as exc:
            print(f"[prebuild] warm call ended: {_said(exc)}", flush=True)
    return run


def _compiling_triton(capability: tuple[int, int] | None) -> contextlib.AbstractContextManager[Any]:
    """Triton launches as compiles for the grading arch, where there is one arch to compile for."""
    if capability is None:
        return contextlib.nullcontext(None)
    from .triton_compile_only import compile_only

    return compile_only(capability)


def _warm_calls(problem: Any, reference: types.ModuleType,
                solution: types.ModuleType) -> Iterator[tuple[Any, list[Any], str]]:
    """(Model, inputs, where) for each shape, all on meta; (None, [], why) for a shape that cannot be drawn
    there. Where the first cannot (06's router reads its logits; Mega's weights come from a
    torch.Generator, which meta has none of), there is one call: its Model built on the CPU at the first
    CPU shape (small: a full shape's weights on the CPU would cost seconds and gigabytes beside the timed
    process), the inputs moved to meta."""
    for index, shape in enumerate(problem.shapes):
        label = shape.label or f"shape {index}"
        try:
            model, inputs = _model_and_inputs(problem, reference, solution, shape, "meta")
        except Exception as exc:
            if index == 0 and problem.cpu_shapes:
                cpu_shape = problem.cpu_shapes[0]
                model, inputs = _model_and_inputs(problem, reference, solution, cpu_shape, "cpu")
                yield model, inputs, f"on the CPU at the first CPU shape ({cpu_shape.label or 'cpu shape 0'})"
                return
            yield None, [], f"skipped {label}: its Model or inputs cannot be drawn on meta ({_said(exc)})"
            continue
        yield model, inputs, f"on meta at {label}"


def _model_and_inputs(problem: Any, reference: types.ModuleType, solution: types.ModuleType, shape: Any,
                      built_on: str, inputs_on: str | None = "meta") -> tuple[Any, list[Any]]:
    """The solution's Model built on `built_on` (meta, cpu, or cuda under a FakeTensorMode) at `shape`, and
    that shape's inputs on `inputs_on` (None: where `built_on` as the default device put them)."""
    import torch

    from .plan import apply_shape, install_shapes_module, moved

    cls = getattr(solution, problem.solution_class)
    install_shapes_module(problem.shapes)
    apply_shape(reference, problem, shape)
    with torch.device(built_on):
        model = cls(*moved(list(reference.get_init_inputs()), built_on))
        inputs = list(reference.get_inputs())
        return model, inputs if inputs_on is None else moved(inputs, inputs_on)


def grading_capability(arch_list: str) -> tuple[int, int] | None:
    """(major, minor) of a TORCH_CUDA_ARCH_LIST that names one arch ("9.0", "9.0a", "12.0+PTX"), else None."""
    archs = arch_list.replace(";", " ").split()
    match = re.fullmatch(r"(\d+)\.(\d+)[af]?(\+PTX)?", archs[0]) if len(archs) == 1 else None
    return (int(match[1]), int(match[2])) if match else None


def _grading_gpu(said: str) -> dict[str, Any] | None:
    """The grading GPU's identity from GRADING_GPU_ENV (None where it is not set or cannot be read)."""
    import json

    try:
        gpu = json.loads(said) if said else None
    except ValueError:
        return None
    return gpu if isinstance(gpu, dict) else None


@contextlib.contextmanager
def _answering_capability(capability: tuple[int, int] | None,
                          gpu: dict[str, Any] | None = None) -> Iterator[None]:
    """`torch.cuda.get_device_capability()` answers `capability`, where there is one; with the grading
    GPU's identity (`gpu`), `get_device_properties()` answers its name, SM count, memory and L2 too, and
    `current_device()` 0: six of 16 published Hard kernels whose builds no warm call reached had asked for
    them (`multi_processor_count` to size a grid, `major`/`minor` for `-arch`) before their build."""
    if capability is None:
        yield
        return
    answers: dict[str, Any] = {"get_device_capability": lambda device=None: capability}
    if gpu is not None:
        props = types.SimpleNamespace(
            name=str(gpu.get("device_name", "")), major=capability[0], minor=capability[1], warp_size=32,
            multi_processor_count=int(gpu.get("sm_count", 0)), total_memory=int(gpu.get("memory_bytes", 0)),
            L2_cache_size=int(gpu.get("l2_bytes", 0)))
        answers.update(get_device_properties=lambda device=None: props, current_device=lambda: 0)
    with _cuda_answering(answers):
        yield


def _said(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0][:300]}" if first else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

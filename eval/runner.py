"""The runner: the one process that imports and runs candidate code (untrusted side).

The worker starts it (`python -m kernelboard.eval.runner`, inside the sandbox of jail.py) and the judge asks it one
thing at a time over a socket (protocol.py): import solution.py, build a shape's Model, make a
call, time the calls, collect an audit's raw data. It answers with raw data only — outputs as
bytes, per-call samples, op and kernel names, torch's global switches — and never sees a
reference output. Whatever a candidate does to this interpreter (patch the grader's functions,
rewrite objects in memory, raise SystemExit, `os._exit`) it does to this process alone; the
judge checks outputs, recomputes statistics and applies the rules on its side.

What a runner (a candidate that takes it over) can still lie about, because only this process sees it:
which ops and kernels ran and which kernels are its own, torch's global switches (named in the log and
the verdict, never held against it: they reach this process alone), the device an output lived on, and
whether an output was a plain tensor when it was timed. The times it reports (samples, host-synchronised
samples, graph replays) are its own too, but the judge holds them against its own clock around batches
of calls on inputs never shown before (timing.py says how far that bound reaches). It cannot make a
wrong output pass — every timed output is probed, the last per input set compared in full — read the
references, or write the verdict.

Its process group is its own, so the judge kills it with everything it started, and it dies with
the judge (PR_SET_PDEATHSIG). Its stdout and stderr are a pipe the judge carries into its own log
(sandbox_output.py), where a line of this process's that reads as the judge's is marked as the runner's.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import itertools
import math
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import audit, gpu_witness, interpreter, origins
from .correctness import PROBE_ELEMENTS, probe, probe_positions
from .cuda_driver import Driver
from .deck import load_problem
from .plan import apply_shape, build_model, import_file, install_shapes_module, scaled_positions, scaled_state
from .probe import torch_global_state
from .protocol import (
    Channel,
    OutputSlots,
    TensorRef,
    encode_output,
    map_arena,
    pin_host,
    resolve,
    unpin_host,
    view_of,
)
from .stateful import StepAdapter, StepLayout
from .timing import Feed, time_cpu, time_cuda
from .witness import PipeWitness

_PR_SET_PDEATHSIG = 1


class _Shared(NamedTuple):
    """An input in the judge's arena, and the strides the call must see it with."""

    view: torch.Tensor
    stride: tuple[int, ...] | None

    def strides(self) -> tuple[int, ...]:
        """The strides the call sees it with: its own where the judge named them, else the view's."""
        return tuple(self.stride or self.view.stride())


def _place(value: Any, device: str) -> tuple[Any, torch.Tensor | None]:
    """A call's argument: the shared view itself where it can be (CPU, contiguous), else a private
    copy with the input's device and strides. Returns (argument, view to write back to or None)."""
    if not isinstance(value, _Shared):
        return value, None
    if device == "cpu" and value.stride is None:
        return value.view, None
    try:
        live = torch.empty_strided(value.view.shape, value.strides(),
                                   dtype=value.view.dtype, device=device)
        live.copy_(value.view)
    except RuntimeError:  # overlapping strides: contiguous it is
        live = value.view.to(device, copy=True)
    return live, value.view


class _Kept(NamedTuple):
    """One tensor argument of a call, and its version counter as the call was given it: the next call's input
    at that position is written into its memory (`_recycle`)."""

    tensor: torch.Tensor
    version: int


def _kept(args: list[Any]) -> list[_Kept | None]:
    """A call's tensor arguments as `_Kept`, before the call (the versions it is given)."""
    return [_Kept(a, a._version) if type(a) is torch.Tensor else None for a in args]


def _set_version(tensor: torch.Tensor, version: int) -> None:
    """Set a tensor's version counter (torch's signature took one tensor before it took sequences)."""
    setter = torch._C._autograd._unsafe_set_version_counter
    try:
        setter((tensor,), (version,))
    except TypeError:
        setter(tensor, version)


class _Slot(NamedTuple):
    """Where a kept argument lay: its memory, offset, size, strides, dtype, device, version counter and id."""

    storage: torch.UntypedStorage
    offset: int
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    version: int
    ident: int


def _slot(value: Any, kept: _Kept | None, device: str) -> _Slot | None:
    """The memory a check's input can be written into: the kept argument's, where the two agree in size,
    strides, dtype and device type; else None."""
    if kept is None or not isinstance(value, _Shared):
        return None
    t = kept.tensor
    if (t.shape != value.view.shape or t.stride() != value.strides()
            or t.dtype != value.view.dtype or t.device.type != torch.device(device).type):
        return None
    return _Slot(t.untyped_storage(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device, kept.version, id(t))


def _recycle(values: list[Any], kept: list[_Kept | None], device: str) -> tuple[list[tuple[Any, Any]], list[bool],
                                                                             list[bool]]:
    """A check's inputs written into the memory of the last call's arguments (`kept`, which this empties), as
    new tensors with their sizes, strides and version counters: (argument, view to write back to) per input,
    and per input whether it lies in the same memory with the same version, and whether it has the same Python
    id. A kernel that keeps what it derived from an input under the input's address (and version) serves it
    again here, as it would to any caller whose new input the caching allocator placed in a freed one's block.
    The new tensors are made right after the old ones are let go, so Python often gives them the same ids (a
    key of `id(x)` meets them too, unless the kernel holds the old tensor). An input that does not fit its
    slot is placed as any check's."""
    slots = [_slot(v, kept[i] if i < len(kept) else None, device) for i, v in enumerate(values)]
    kept.clear()  # the last references of the runner's: freed last to first, so the first new tensor takes the first's
    lives = [None if s is None else torch.empty(0, dtype=s.dtype, device=s.device) for s in slots]
    placed, same, ident = [], [], []
    for value, s, live in zip(values, slots, lives, strict=True):
        ident.append(s is not None and id(live) == s.ident)
        if s is None or live is None:
            placed.append(_place(value, device))
            same.append(False)
            continue
        live.set_(s.storage, s.offset, s.size, s.stride)
        try:
            live.copy_(value.view)
        except RuntimeError:  # overlapping strides: not written in place
            placed.append(_place(value, device))
            same.append(False)
            continue
        with contextlib.suppress(AttributeError, RuntimeError, TypeError):  # no setter: the same memory, a new counter
            _set_version(live, s.version)
        placed.append((live, value.view))
        same.append(live._version == s.version)
    return placed, same, ident


def _raise_unchecked_launch_error() -> None:
    """A launch inside the call that failed (no kernel image for this GPU, too much shared memory asked
    for) and that the candidate's code never checked leaves its output unwritten and CUDA's last error
    set. One checked launch of ours raises that error, so the call is the runtime error it is, in
    CUDA's own words (which tell `needs_other_arch` apart), not a wrong output: grok-4.5's 07 of
    2026-07-08 builds its decode kernel for sm_120a only and returned zeros on the H200."""
    torch.empty(1, device="cuda").fill_(1)  # a fill kernel: its launch check reads the last error


class _Probe:
    """Where one input set's outputs are probed: judge-seeded element positions per part, made
    when the shape is loaded (never inside a timed region or a floor batch); the spec is
    [(seed, numel), …] per part, from the judge."""

    def __init__(self, spec: list[list[int]], device: str) -> None:
        self.parts = [probe_positions(seed, numel, device) for seed, numel in spec]
        self.numels = [numel for _, numel in spec]

    def take(self, out: Any) -> list[torch.Tensor | None]:
        """The probed elements of each output part, enqueued (no synchronise); None for a part
        that is not a plain strided tensor of the expected size on the expected device."""
        parts = out if type(out) in (tuple, list) else (out,)
        got: list[torch.Tensor | None] = []
        for k, positions in enumerate(self.parts):
            part = parts[k] if k < len(parts) else None
            ok = (type(part) is torch.Tensor and part.layout == torch.strided and part.device.type != "meta"
                  and part.numel() == self.numels[k] and part.device == positions.device)
            got.append(probe(part, positions) if ok else None)  # type: ignore[arg-type]
        return got


def _finish(probes: list[list[torch.Tensor | None]]) -> torch.Tensor:
    """Probed elements as one float64 CPU tensor (calls, parts, PROBE_ELEMENTS), one synchronise:
    NaN for a part that could not be probed and past a part's own length (the judge knows each
    part's). A binary frame, not JSON: a Mega step's 15 output parts × 32 elements over a timed
    loop's calls made a 5.2 MB JSON header on the H200, past the protocol's bound for headers."""
    parts = max(map(len, probes), default=0)
    out = torch.full((len(probes), parts, PROBE_ELEMENTS), math.nan, dtype=torch.float64)
    rows, cols, taken = [], [], []
    for i, row in enumerate(probes):
        for k, p in enumerate(row):
            if p is not None:
                rows.append(i)
                cols.append(k)
                taken.append(torch.nn.functional.pad(p, (0, PROBE_ELEMENTS - p.numel()), value=math.nan))
    if taken:
        out[rows, cols] = torch.stack(taken).cpu()
    return out


def _private_like(args: list[Any]) -> list[Any]:
    """A live input set: private tensors shaped and strided like `args` (filled by a refill)."""
    return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
            if isinstance(a, torch.Tensor) else a for a in args]


class FreshFeed(Feed):
    """The runner's timed calls (timing.py): one live input set — the same tensors, at the same
    addresses, on every call — refilled in place before every call from the judge's pool (timed
    call i gets pool set i % len(pool)); each timed output probed before the next call, and the
    last one per pool set copied for the judge."""

    def __init__(self, pool: list[list[Any]], probes: list[_Probe]) -> None:
        super().__init__(pool)
        self.pool, self.probes = pool, probes
        self.live = _private_like(pool[0])
        self.taken: list[list[torch.Tensor | None]] = []

    def start_timed(self) -> None:
        """A timed loop begins (a covered loop that is run again begins more than once): the
        probes of the loop whose times are kept go to the judge (`checkpoint`, `restore`)."""
        super().start_timed()
        self.taken = []

    def next_inputs(self) -> list[Any]:
        j = self.calls % len(self.pool)
        self.calls += 1
        with torch.no_grad():
            for dst, src in zip(self.live, self.pool[j], strict=True):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
        return [dst if isinstance(dst, torch.Tensor) else src
                for dst, src in zip(self.live, self.pool[j], strict=True)]

    def checkpoint(self) -> Any:
        return self.taken, list(self.last)  # start_timed makes a new `taken`: this one stays as it is

    def restore(self, state: Any) -> None:
        self.taken, last = state
        self.last = list(last)

    def seen(self, out: Any, remaining: int) -> None:
        j = (self.calls - 1) % len(self.pool)
        self.taken.append(self.probes[j].take(out))
        if remaining < len(self.pool):  # the last call on pool set j: a copy, read before the next call
            parts = out if type(out) in (tuple, list) else (out,)
            copies = [p.clone() if type(p) is torch.Tensor else p for p in parts]
            self.last[j] = copies if type(out) in (tuple, list) else copies[0]


class _Shape:
    def __init__(self, model: torch.nn.Module, checks: list[list[Any]], timing: list[list[Any]],
                 probes: list[_Probe], proof: list[list[list[Any]]], proof_probes: list[list[_Probe]]) -> None:
        self.model, self.checks, self.timing, self.probes = model, checks, timing, probes
        self.proof, self.proof_probes = proof, proof_probes
        self.extra_logged = False  # a step's state keys of its own are logged once a shape


def _scale(value: Any) -> dict[int, float]:
    """A request's input scaling, {position: factor} (JSON keys are strings)."""
    return {int(k): v for k, v in _factor_map(value, "scale", "input positions", str.isdigit).items()}


def _factors(value: Any) -> dict[str, float]:
    """A request's state scaling, {buffer name: factor}."""
    return _factor_map(value, "state_scale", "buffer names", lambda _: True)


def _factor_map(value: Any, field: str, keys: str, key_ok: Callable[[str], bool]) -> dict[str, float]:
    """{key: factor} from a request; None is none, anything else is a broken judge."""
    if value is None:
        return {}
    if not (isinstance(value, dict) and all(isinstance(k, str) and key_ok(k) and type(v) in (int, float)
                                            for k, v in value.items())):
        raise ValueError(f"{field} must map {keys} to numbers, got {value!r}")
    return {k: float(v) for k, v in value.items()}


def report(exc: BaseException) -> dict[str, Any]:
    """An exception as the judge reads it: data, not an object."""
    return {"type": type(exc).__name__, "text": str(exc)[:4000], "oom": isinstance(exc, torch.OutOfMemoryError)}


class _Runner:
    def __init__(self, setup: dict[str, Any]) -> None:
        self.setup = setup
        self.device: str = setup["device"]
        self.problem = load_problem(Path(setup["problem_path"]))
        self.shapes = self.problem.shapes_for(self.device)
        self.reference = import_file("reference", self.problem.reference_path)  # solutions import it
        install_shapes_module(self.shapes)
        self.solution: Any = None
        self.loaded: dict[int, _Shape] = {}
        self.pinned: torch.Tensor | None = None  # the current shape's arena, while page-locked
        # The judge's output area for the current shape (protocol.OutputArea), and whether it is page-locked.
        self.outputs: torch.Tensor | None = None
        self.outputs_pinned = False
        self.flush: torch.Tensor | None = None
        self.l2_bytes = 0
        self.origins: origins.KernelOrigins | None = None  # read once per runner: _op_kernels
        self.kept: list[_Kept | None] = []  # a `keep` call's arguments, for the next (`recycle`) call
        if self.device == "cuda":
            torch.cuda.init()

    def handle(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        op = request["op"]
        handler: Callable[..., tuple[dict[str, Any], list[memoryview]]] = getattr(self, f"_op_{op}")
        return handler(request, fds)

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _op_import(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        folder = Path(self.setup["solution_dir"])
        sys.argv = [str(folder / "solution.py")]  # the spawn bootstrap copied the judge's, job path included
        sys.path.insert(0, str(folder))
        self.solution = import_file("solution", folder / "solution.py")
        return {"state": torch_global_state()}, []

    def _op_gpu_setup(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        l2 = audit.reset_persisting_l2()
        self.l2_bytes = int(request["l2_bytes"])
        self.flush = torch.empty(2 * self.l2_bytes // 4, dtype=torch.int32, device="cuda")
        return {"l2": l2}, []

    def _op_shape(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        if self.pinned is not None:
            unpin_host(self.pinned)
            self.pinned = None
        base = map_arena(fds[0], request["arena_size"])
        self._map_outputs(fds[1:], request.get("outputs_size"))
        if self.device == "cuda" and pin_host(base):  # every check copies its inputs in and back out
            self.pinned = base
        values = request["values"]
        apply_shape(self.reference, self.problem, self.shapes[request["shape"]])
        if self.problem.weight_transfer == "seed":
            torch.manual_seed(request["seed"])
        started = time.perf_counter()
        model, where = self._build_solution(resolve(values["init_args"], base))
        built = time.perf_counter()
        if self.problem.weight_transfer == "state_dict":
            model.load_state_dict(resolve(values["state_dict"], base), strict=True)
        if self.problem.stateful is not None:  # called with flat (hidden, state) tensors: stateful.py
            layout = StepLayout(tuple(tuple(str(k) for k in keys) for keys in request["layout"]))
            model = StepAdapter(model, layout, self.problem.stateful.entry)
        loaded = time.perf_counter()

        def shared(v: Any) -> Any:
            return _Shared(view_of(base, v), v.stride) if isinstance(v, TensorRef) else v

        checks = [[shared(v) for v in inputs] for inputs in values["checks"]]
        timing = [[_place(shared(v), self.device)[0] for v in inputs] for inputs in values["timing"]]
        proof = [[[_place(shared(v), self.device)[0] for v in inputs] for inputs in batch] for batch in values["proof"]]
        probes = [_Probe(spec, self.device) for spec in request["probes"]]
        proof_probes = [[_Probe(spec, self.device) for spec in batch] for batch in request["proof_probes"]]
        self._sync()
        # Where a shape's set-up time goes (06's headline took minutes here on the H200).
        locked = ("" if self.device != "cuda" else "; its inputs' shared memory page-locked" if self.pinned is not None
                  else "; its inputs' shared memory not page-locked (the driver refused: copies are staged)")
        print(f"[runner] shape {request['shape']}: its Model built {where} in {built - started:.1f} s, state loaded in "
              f"{loaded - built:.1f} s, {len(timing)} timing and {sum(map(len, proof))} floor-batch input sets "
              f"placed in {time.perf_counter() - loaded:.1f} s{locked}", flush=True)
        self.loaded[request["shape"]] = _Shape(model, checks, timing, probes, proof, proof_probes)
        return {}, []

    def _map_outputs(self, fds: list[int], size: object) -> None:
        """The new shape's output area (the first of `fds`, `size` bytes) in place of the last one's,
        page-locked on a GPU so that an output is copied into it by DMA; none without one."""
        if self.outputs is not None and self.outputs_pinned:
            unpin_host(self.outputs)
        self.outputs, self.outputs_pinned = None, False
        if fds and type(size) is int and size > 0:
            self.outputs = map_arena(fds[0], size)
            self.outputs_pinned = self.device == "cuda" and pin_host(self.outputs)
        elif fds:
            os.close(fds[0])
        for extra in fds[1:]:
            os.close(extra)

    def _build_solution(self, init_args: list[Any]) -> tuple[torch.nn.Module, str]:
        """The solution's Model, and where it was built. As KernelBench builds it (on the CPU, then
        moved), except for a problem whose reference the judge builds on the GPU (`draw_on_device`)
        and whose weights are then replaced by the reference's state dict: there the constructor's
        own draws are thrown away, and on 06's headline shape they took 41 s on the CPU. Built on
        the GPU, only where a tensor that `__init__` makes outside its parameters and buffers lives
        can differ; a constructor that fails there is built again on the CPU."""
        cls = self.problem.solution_class
        if self.device == "cuda" and self.problem.draw_on_device and self.problem.weight_transfer == "state_dict":
            try:
                return build_model(self.solution, init_args, self.device, cls, init_on_device=True), "on the GPU"
            except Exception as exc:  # any failure there: built as KernelBench builds it
                print(f"[runner] its Model could not be built on the GPU ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); building it on the CPU", flush=True)
                torch.cuda.empty_cache()
        return build_model(self.solution, init_args, self.device, cls), "on the CPU"

    def _op_call(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        shape = self.loaded[request["shape"]]
        values = shape.checks[request["check"]]
        header: dict[str, Any] = {}
        kept, self.kept = self.kept, []
        if request.get("recycle"):  # written where the call before's inputs were (it was asked to `keep`)
            placed, header["recycled"], header["recycled_ids"] = _recycle(values, kept, self.device)
        else:
            placed = [_place(v, self.device) for v in values]
        del kept
        # A numeric stress case: its scaled inputs are new tensors; what comes back to the arena is the
        # placed copy of what the judge shared, which the call never saw at a scaled position.
        args = scaled_positions([arg for arg, _ in placed], _scale(request.get("scale")))
        if request.get("keep"):
            self.kept = _kept(args)
        if request.get("log_ops"):  # the call is judged like any other: its output comes back too
            header["ops"], out = audit.op_log(shape.model, args)
        else:
            with torch.no_grad(), scaled_state(shape.model, _factors(request.get("state_scale"))):
                out = shape.model(*args)
        self._sync()
        if self.device == "cuda":
            _raise_unchecked_launch_error()
        extra = getattr(shape.model, "extra_keys", None)
        if extra and not shape.extra_logged:
            shape.extra_logged = True
            print(f"[runner] shape {request['shape']}: the step's state also holds {', '.join(extra)}, keys of its "
                  f"own (never compared, never fed back)", flush=True)
        # What the call did to its inputs, for the judge to see; a step's state (every input past the
        # hidden vector) is its to update, and the next call must get the state as the judge drew it.
        for arg, view in placed[:1] if self.problem.stateful is not None else placed:
            if view is not None:
                view.copy_(arg)
        meta, blobs = encode_output(out, OutputSlots(self.outputs))
        header.update(state=torch_global_state(), outputs=[meta])
        return header, blobs

    def _op_time(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        shape = self.loaded[request["shape"]]
        kwargs = {} if self.setup["rep_ms"] is None else {"rep_ms": self.setup["rep_ms"]}
        feed = FreshFeed(shape.timing, shape.probes)
        if self.device == "cuda":
            stats, last = time_cuda(shape.model, None, feed=feed, l2_bytes=self.l2_bytes,
                                    cover_dispatch=bool(request.get("cover", True)), **kwargs)
        else:  # the judge's clock around each timed call, where the request carries its pipes (eval/witness.py)
            witness = PipeWitness(fds[0], fds[1]) if len(fds) == 2 else None
            try:
                stats, last = time_cpu(shape.model, None, feed=feed, witness=witness, **kwargs)
            finally:
                if witness is not None:
                    witness.close()
        self._sync()
        slots = OutputSlots(self.outputs)
        encoded = [encode_output(out, slots) for out in last]
        probes, probe_blobs = encode_output(_finish(feed.taken))
        header = {"samples_ms": list(stats.samples_ms), "wall_ms": stats.wall_ms, "state": torch_global_state(),
                  "probes": probes, "outputs": [meta for meta, _ in encoded],
                  "cover": None if stats.cover is None else dataclasses.asdict(stats.cover)}
        return header, [*probe_blobs, *(blob for _, blobs in encoded for blob in blobs)]  # the probes' frame first

    def _op_proof(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        """One floor batch (timing.floor_ms): each of its input sets called once, back to back, its
        output probed before the next call; one synchronise at the end. The runner's clock runs
        unbroken over the batch: one mark before the first call and one after each call and its
        probe, so the samples add up to the whole batch — the loop's own host work included, which
        under a loaded CPU is as long as a launch-bound call (a per-call event pair left it out, and
        an honest kernel's claim fell below the judge's bound). The judge times the whole request
        with its own clock (timing.batch_problem)."""
        shape = self.loaded[request["shape"]]
        batch, repeat = request["batch"], int(request.get("repeat", 1))
        used = int(request.get("calls", len(shape.proof[batch])))
        taken: list[Any] = []
        cuda = self.device == "cuda"
        self._sync()  # the first mark must not wait for earlier work
        marks: list[Any] = [self._mark(cuda)]
        with torch.no_grad():
            for rep in range(repeat):  # later passes repeat the batch without probes: a longer batch
                for args, probes in zip(shape.proof[batch][:used], shape.proof_probes[batch][:used], strict=True):
                    out = shape.model(*args)
                    if rep == 0:
                        taken.append(probes.take(out))
                    del out
                    marks.append(self._mark(cuda))
        probed = _finish(taken)  # copying the probes back is part of the batch, and so of the last call
        marks[-1] = self._mark(cuda)
        self._sync()
        if cuda:
            samples = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        else:
            samples = [(b - a) / 1e6 for a, b in itertools.pairwise(marks)]
        probes, probe_blobs = encode_output(probed)
        return {"probes": probes, "samples_ms": samples}, probe_blobs

    def _op_witness(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        """One loop of the judge's GPU witness (gpu_witness.py): the calls the judge's own stream times, on
        the inputs it writes into the block `fds[0]` shares (`call` false: the null loop, no call)."""
        shape = self.loaded[request["shape"]]
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"a witness request carries one file descriptor, not {len(fds)}")
        gpu_witness.runner_loop(shape.model, Driver(), fds[0], gpu_witness.Layout.decode(request["layout"]),
                                shape.timing[0], int(request["first"]), int(request["calls"]), bool(request["call"]))
        return {}, []

    def _op_release(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        """A shape checked and timed: its checks' shared inputs and its floor batches let go, and what the
        runner's allocator kept of them given back to the GPU before the judge draws the next shape. Kept
        cached, they were what 06's wide shape lacked: the judge ran out of the H100's memory drawing it
        beside a runner of 38.5 GB (2026-12-06). The candidate's own tensors are not touched; only the
        CUDA-graph replay's timing sets stay. (The judge releases every shape before it loads the next.)"""
        shape = self.loaded[request["shape"]]
        shape.checks, shape.proof, shape.proof_probes = [], [], []
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        return {}, []

    @staticmethod
    def _mark(cuda: bool) -> Any:
        """A point on the runner's clock: a recorded CUDA event on the current stream, or the CPU's
        perf_counter_ns."""
        if not cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _op_host_sync(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        shape = self.loaded[request["shape"]]
        assert self.flush is not None
        feed = FreshFeed(shape.timing, shape.probes)
        return audit.host_synced_samples_ms(shape.model, feed.next_inputs, self.flush), []

    def _op_kernels(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        """The kernels one call launches, which of them came from the candidate's code (by where
        they come from: origins.own_kernels; None where that cannot be told) and how that was decided.
        A name over the protocol's 4096 characters (a CUTLASS 3 instantiation) keeps its head and
        its parameter list."""
        shape = self.loaded[request["shape"]]
        kernels, count = audit.profiled_call(shape.model, shape.timing[0])
        if self.origins is None:
            self.origins = origins.KernelOrigins(Path(self.setup["solution_dir"]))
        own, origin = origins.own_kernels(kernels, self.origins)

        def short(k: str) -> str:
            return k if len(k) <= 4000 else f"{k[:2999]}…{k[-1000:]}"

        return {"kernels": [short(k) for k in kernels], "own": None if own is None else [short(k) for k in own],
                "origin": origin, "launches": count.launches, "top_share": count.top_share}, []

    def _op_graph(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[memoryview]]:
        shape = self.loaded[request["shape"]]
        assert self.flush is not None
        samples, out = audit.graph_replay_samples_ms(shape.model, shape.timing[0], self.flush)
        self._sync()
        meta, blobs = encode_output(out, OutputSlots(self.outputs))
        return {"samples_ms": samples, "outputs": [meta]}, blobs


def _detach(parent_pid: int | None) -> None:
    """Own process group (the judge kills it whole); die with the process that started it (the
    judge, or bwrap's init, which dies with the judge: --die-with-parent)."""
    if os.getpgrp() != os.getpid():  # started in a session of its own (Popen start_new_session) it leads one
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:  # the judge died before the line above
        os._exit(1)


def _send(chan: Channel, header: dict[str, Any], blobs: list[memoryview]) -> bool:
    """Send a reply; an unencodable one (a NaN sample, say) becomes an error reply. False when the
    judge has gone."""
    try:
        chan.send_reply(header, blobs)
    except ValueError as exc:
        chan.send_reply({"ok": False, "error": report(exc)}, [])
    except OSError:
        return False
    return True


def _say_outside(kernel: str, first: str) -> None:
    print(f"[runner] interpreter: {kernel} reaches outside the tensors its launch was given ({first}); those "
          f"lanes are masked off here (a load reads 0), where a GPU faults or reads other memory", flush=True)


def serve(sock: socket.socket, setup: dict[str, Any]) -> None:
    """The runner's main loop: a hello with torch's global switches (before any candidate code
    runs), then one reply per request until the judge closes the socket."""
    _detach(setup.get("parent_pid"))
    if interpreter.interpreting():  # a CPU grading: bf16 dots computed as a GPU computes them, and no lane
        try:  # outside a launch's tensors read or written (said once per kernel)
            interpreter.widen_bf16_dots()
            interpreter.check_memory(interpreter.Bounds(on_outside=_say_outside))
        except Exception as exc:  # a Triton whose interpreter is built otherwise: graded as it computes
            print(f"[runner] interpreter: not adjusted ({type(exc).__name__}: {exc})", flush=True)
    chan = Channel(sock)
    try:
        runner = _Runner(setup)
    except BaseException as exc:
        traceback.print_exc()
        _send(chan, {"ok": False, "error": report(exc)}, [])
        return
    if not _send(chan, {"ok": True, "state": torch_global_state()}, []):
        return
    while (got := chan.recv_request()) is not None:
        request, fds = got
        try:
            header, blobs = runner.handle(request, fds)
            header["ok"] = True
        except BaseException as exc:  # SystemExit and KeyboardInterrupt included: candidate code raised them
            print(f"[runner] request {request.get('op')!r} failed:", flush=True)
            traceback.print_exc()
            header, blobs = {"ok": False, "error": report(exc)}, []
        if not _send(chan, header, blobs):
            return


def main(argv: list[str]) -> int:
    """`python -m kernelboard.eval.runner FD SETUP_JSON`: serve the judge on the inherited socket FD."""
    import json

    if len(argv) != 2:
        print("usage: python -m kernelboard.eval.runner FD SETUP_JSON", file=sys.stderr)
        return 2
    serve(socket.socket(fileno=int(argv[0])), json.loads(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

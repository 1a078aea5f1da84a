"""The judge's own GPU clock around calls the runner makes (the GPU witness), logged beside the timed median.

Why: every figure of a GPU timing is taken in the runner, the process candidate code shares, so a
solution that recognises the timed loop can shrink its samples there alone and tell the truth wherever the
judge looks (the red-team's `selective_clock_lie`; bounded today only by `scoring.beyond_hardware`). Here
the judge times the solution's calls on its own stream, in its own process, where the candidate cannot
reach, through device memory both processes map (eval/cuda_driver.py), after the shape's timed loop:

- the judge queues every call's side before it asks the runner for any: its start event, the call's
  inputs copied into the shared block (a timing pool set, from its own GPU copy), the L2 flushed with its
  own buffer, then `ready` = the call's number; a wait until `done` reaches it; its end event; the output
  slots' probed elements gathered (`correctness.probe`);
- the runner's stream waits on `ready`, calls the solution on views of the shared inputs, copies its output
  into the shared output slots, and writes `done`.

So each judge span holds the call: its inputs exist only from inside the span, and its output is read at
the span's end (a runner that writes `done` early hands the judge a stale output, which its probes show).
The span also holds the judge's copies and flush and two switches between the processes' contexts, which
take turns on the GPU (283–318 µs a call on an H100, bench/README.md): a null loop, the same judge side with
a runner that copies an output of the right size but calls nothing, measures them. The runner could
stretch its null loop to shrink the figure, so the null is capped at the judge's own part of it (timed on
its stream alone) plus WITNESS_GPU_SWITCH_CAP_MS. The figure, the median over calls of (span − null), is held
beside the main loop's median: a lie told only in the timed loop reads about half of it.

Logged, not refused (grader 0.5.28), and only where WITNESS_GPU_ENV=1 asks for it (the GPU mechanism tests,
tests/test_eval_gpu.py, and since 0.5.29 bench/gpu_session.sh's board gradings), until honest gradings have
given the ratios a refusal needs (its first measurement: settings.WITNESS_GPU_FACTOR). Anything that fails
here is logged and the grading goes on; a stall releases both sides' waits.
Skipped: the CPU, stateful (Mega) steps, and a shape whose timing sets are over WITNESS_GPU_MAX_BYTES in all.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .correctness import PROBE_ELEMENTS, probe, probe_positions
from .cuda_driver import Driver, bytes_at
from .deck import Problem
from .settings import (
    WITNESS_GPU_ENV,
    WITNESS_GPU_FACTOR,
    WITNESS_GPU_MAX_BYTES,
    WITNESS_GPU_MIN_MS,
    WITNESS_GPU_STALL_S,
    WITNESS_GPU_SWITCH_CAP_MS,
)

#: The words both sides wait on, at the block's head: the judge's `ready`, the runner's `done`.
READY, DONE, FLAG_BYTES = 0, 4, 512
#: Every slot starts on this boundary (a caching-allocator block's alignment: a kernel that assumes
#: 16-byte or wider vector loads sees the same alignment as on its own tensors).
SLOT_ALIGN = 512


@dataclass(frozen=True)
class Slot:
    """One tensor in the shared block: where it starts, its shape, strides and dtype."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return extent_bytes(self.shape, self.stride, getattr(torch, self.dtype).itemsize)

    def view(self, block: torch.Tensor) -> torch.Tensor:
        """This slot in `block`, the uint8 view of the whole shared block."""
        flat = block[self.offset:self.offset + self.nbytes].view(getattr(torch, self.dtype))
        return flat.as_strided(self.shape, self.stride)

    def encode(self) -> list[Any]:
        return [self.offset, list(self.shape), list(self.stride), self.dtype]

    @classmethod
    def decode(cls, value: Any) -> Slot:
        offset, shape, stride, dtype = value
        if not (isinstance(offset, int) and isinstance(dtype, str) and isinstance(getattr(torch, dtype, None),
                                                                                 torch.dtype)):
            raise ValueError(f"a witness slot must be [offset, shape, stride, dtype], got {value!r}")
        return cls(offset, tuple(int(n) for n in shape), tuple(int(n) for n in stride), dtype)


def extent_bytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """The bytes a strided tensor spans: from its first element to its last (0 for an empty one)."""
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize


@dataclass(frozen=True)
class Layout:
    """The shared block: the flags, one slot per tensor input (None for an argument that is not a tensor,
    which the runner takes from its own timing set), one per output part (contiguous)."""

    inputs: tuple[Slot | None, ...]
    outputs: tuple[Slot, ...]
    nbytes: int

    def encode(self) -> dict[str, Any]:
        return {"inputs": [None if s is None else s.encode() for s in self.inputs],
                "outputs": [s.encode() for s in self.outputs], "nbytes": self.nbytes}

    @classmethod
    def decode(cls, value: Any) -> Layout:
        return cls(tuple(None if s is None else Slot.decode(s) for s in value["inputs"]),
                   tuple(Slot.decode(s) for s in value["outputs"]), int(value["nbytes"]))


def plan_layout(inputs: Sequence[Any], outputs: Sequence[torch.Tensor]) -> Layout:
    """Slots for one input set (with its strides) and the output parts (contiguous), each SLOT_ALIGN-aligned
    after the flags."""
    offset = FLAG_BYTES

    def place(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> Slot:
        nonlocal offset
        slot = Slot(offset, tuple(shape), tuple(stride), str(dtype).removeprefix("torch."))
        offset += -(-slot.nbytes // SLOT_ALIGN) * SLOT_ALIGN
        return slot

    ins = tuple(place(t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else None for t in inputs)
    outs = tuple(place(t.shape, contiguous_strides(t.shape), t.dtype) for t in outputs)
    return Layout(ins, outs, offset)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def output_parts(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def asked() -> bool:
    """The witness runs only where the environment asks for it (WITNESS_GPU_ENV=1: the GPU mechanism tests and
    bench/gpu_session.sh's gradings do), so that `kernelboard eval` elsewhere runs without it until it is a rule
    (a kernel that faults on the shared block's inputs would fail the grading's later requests)."""
    return os.environ.get(WITNESS_GPU_ENV) == "1"


def skip_reason(problem: Problem, device: str, set_bytes: int) -> str | None:
    """Why a shape is not witnessed, where the witness is asked for, or None."""
    if device != "cuda":
        return "not on a GPU"
    if problem.stateful is not None:
        return "a stateful step (its state threads through calls)"
    if set_bytes > WITNESS_GPU_MAX_BYTES:
        return (f"its timing sets are {set_bytes / 1e9:.2f} GB, over the {WITNESS_GPU_MAX_BYTES / 1e9:.2f} GB the "
                "judge keeps for it")
    return None


@dataclass(frozen=True)
class Figures:
    """What one witnessed shape came to, in ms: the medians of the judge's spans with a call and with none,
    the judge's own part of a null span, the null used (capped), and the call by the judge's clock."""

    span_ms: float
    null_measured_ms: float
    own_ms: float
    null_ms: float
    call_ms: float
    calls: int


def figures(spans_ms: Sequence[float], null_spans_ms: Sequence[float], own_ms: float) -> Figures:
    """The judge's figure for a call: the median over calls of (span − null), where the null is the null
    loop's median capped at the judge's own part of it plus WITNESS_GPU_SWITCH_CAP_MS (a runner that
    stretches its null loop must not shrink the figure past what two context switches can cost)."""
    measured = statistics.median(null_spans_ms)
    null = min(measured, own_ms + WITNESS_GPU_SWITCH_CAP_MS)
    call = statistics.median(s - null for s in spans_ms)
    return Figures(statistics.median(spans_ms), measured, own_ms, null, call, len(spans_ms))


def doubt(timed_median_ms: float, fig: Figures) -> str | None:
    """Where the judge's figure is at least WITNESS_GPU_MIN_MS and the timed median is under WITNESS_GPU_FACTOR
    of it, what the two clocks say (logged, not refused: the rule's factor awaits the honest ratios)."""
    if fig.call_ms < WITNESS_GPU_MIN_MS:
        return None
    ratio = timed_median_ms / fig.call_ms
    if ratio >= WITNESS_GPU_FACTOR:
        return None
    return (f"the timed median {timed_median_ms:.4f} ms is {ratio:.2f} of a call by the judge's clock "
            f"({fig.call_ms:.4f} ms), under {WITNESS_GPU_FACTOR:g}: a clock that lies in the timed loop alone, or "
            f"a figure this rule reads wrong (logged, not refused)")


def describe(timed_median_ms: float, fig: Figures) -> str:
    ratio = f"{timed_median_ms / fig.call_ms:.2f}" if fig.call_ms > 0 else "—"
    return (f"the judge's clock around {fig.calls} witnessed calls: span {fig.span_ms:.4f} ms, null "
            f"{fig.null_ms:.4f} ms (its loop {fig.null_measured_ms:.4f} ms; the judge's own copies and flush "
            f"{fig.own_ms:.4f} ms + at most {WITNESS_GPU_SWITCH_CAP_MS:g} ms), so a call {fig.call_ms:.4f} ms; "
            f"the timed median is {ratio} of it")


class SharedBlock:
    """The device block both processes map: made and exported by the judge (`exported`; its descriptor goes
    to the runner with each request), mapped by the runner from that descriptor (`imported`)."""

    def __init__(self, driver: Driver, size: int, handle: int, address: int, fd: int | None) -> None:
        self.driver, self.size, self.handle, self.address, self.fd = driver, size, handle, address, fd
        self.bytes = bytes_at(address, size)
        self.flags = self.bytes[:FLAG_BYTES].view(torch.int32)

    @classmethod
    def exported(cls, driver: Driver, nbytes: int) -> SharedBlock:
        device = torch.cuda.current_device()
        size = driver.granular(nbytes, device)
        handle, fd = driver.create_exported(size, device)
        block = cls(driver, size, handle, driver.map(handle, size, device), fd)
        block.flags.zero_()
        torch.cuda.synchronize()
        return block

    @classmethod
    def imported(cls, driver: Driver, fd: int, nbytes: int) -> SharedBlock:
        """The judge's block from the descriptor a request carried (closed here: the handle keeps the block)."""
        device = torch.cuda.current_device()
        size = driver.granular(nbytes, device)
        try:
            handle = driver.import_fd(fd)
        finally:
            os.close(fd)
        try:
            address = driver.map(handle, size, device)
        except BaseException:
            driver("cuMemRelease", ctypes.c_ulonglong(handle))
            raise
        return cls(driver, size, handle, address, None)

    def views(self, layout: Layout) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """The input slots (None for an argument that is not a tensor) and the output slots, as tensors."""
        return ([None if s is None else s.view(self.bytes) for s in layout.inputs],
                [s.view(self.bytes) for s in layout.outputs])

    def close(self) -> None:
        """Unmapped once no stream of this process waits in it any more (on the judge's side, each
        `JudgeLoop.wait` returned): never a device-wide synchronise there, which a stuck loop would hold."""
        self.bytes = self.flags = None  # type: ignore[assignment]
        self.driver.unmap(self.address, self.size, self.handle)
        if self.fd is not None:
            os.close(self.fd)


def fill(slots: Sequence[torch.Tensor | None], values: Sequence[Any]) -> None:
    """The input slots given one pool set's values (an argument that is not a tensor has no slot)."""
    for dst, src in zip(slots, values, strict=True):
        if dst is not None:
            dst.copy_(src)


@dataclass
class Setup:
    """What the judge prepares for a shape's witnessed loops: its GPU copy of the timing pool, the block's
    layout and the block, its L2 flush buffer, the probed positions, and its own part of a span (ms)."""

    pool: list[list[Any]]
    layout: Layout
    block: SharedBlock
    flush: torch.Tensor
    positions: list[list[torch.Tensor]]
    own_ms: float


class JudgeLoop:
    """One loop of witnessed calls (`with_call` False: the null loop), queued on the judge's own
    non-blocking stream before the runner is asked; `wait` collects the spans and the probes."""

    def __init__(self, driver: Driver, setup: Setup, first_seq: int, calls: int, with_call: bool) -> None:
        block, pool = setup.block, setup.pool
        self.block, self.first, self.calls, self.with_call = block, first_seq, calls, with_call
        self.stream = torch.cuda.Stream()
        self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        self.probes: list[list[torch.Tensor]] = []
        ins, outs = block.views(setup.layout)
        self.stream.wait_stream(torch.cuda.current_stream())  # the pool and the flush buffer are ready
        with torch.cuda.stream(self.stream):
            for i in range(calls):
                j = i % len(pool)
                self.starts[i].record()
                fill(ins, pool[j])
                setup.flush.zero_()
                driver.write(self.stream.cuda_stream, block.address + READY, first_seq + i)
                driver.wait(self.stream.cuda_stream, block.address + DONE, first_seq + i)
                self.ends[i].record()
                if with_call:
                    self.probes.append([probe(out, pos) for out, pos in zip(outs, setup.positions[j], strict=True)])
        # From now on the runner may be asked: whatever becomes of it, both sides' waits end by this timer.
        self.stalled = False
        self._timer = threading.Timer(WITNESS_GPU_STALL_S, self._stall)
        self._timer.daemon = True
        self._timer.start()

    def _stall(self) -> None:
        if not self.ended():
            self.stalled = True
            self.release()

    def ended(self) -> bool:
        """Has the judge's stream passed every call (its end events recorded)?"""
        return all(e.query() for e in self.ends)

    def release(self) -> None:
        """Both sides' waits let go (a stall: a runner that stopped, or a judge that asked nothing)."""
        last = self.first + self.calls
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            self.block.flags[READY // 4].fill_(last)
            self.block.flags[DONE // 4].fill_(last)
        side.synchronize()

    def wait(self) -> tuple[list[float], torch.Tensor | None]:
        """The spans (ms) and, for a loop with calls, the probes as `_Targets.check` takes them (calls × parts
        × PROBE_ELEMENTS, NaN past a part's length). Raises where the loop stalled and was released."""
        self.stream.synchronize()  # ends: the runner wrote every `done`, or the stall timer did
        self._timer.cancel()
        if self.stalled:
            raise RuntimeError(f"the loop had not ended {WITNESS_GPU_STALL_S:g} s after it was queued; both sides "
                               "were released")
        spans = [s.elapsed_time(e) for s, e in zip(self.starts, self.ends, strict=True)]
        if not self.with_call:
            return spans, None
        got = torch.full((self.calls, len(self.probes[0]), PROBE_ELEMENTS), math.nan, dtype=torch.float64)
        for i, parts in enumerate(self.probes):
            for k, p in enumerate(parts):
                got[i, k, :p.numel()] = p.cpu()
        return spans, got


def own_cost_ms(block: SharedBlock, layout: Layout, pool: list[list[Any]], flush: torch.Tensor, calls: int) -> float:
    """The judge's own part of a witnessed span, timed on its stream with no runner: the input copies, the
    flush, and a copy of the output slots' size (the null loop's runner copies that much)."""
    stream = torch.cuda.Stream()
    ins, outs = block.views(layout)
    scratch = [torch.empty_like(o) for o in outs]
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            starts[i].record()
            fill(ins, pool[i % len(pool)])
            flush.zero_()
            for dst, src in zip(scratch, outs, strict=True):
                dst.copy_(src)
            ends[i].record()
    stream.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def probe_targets(specs: Sequence[Sequence[Sequence[int]]], device: torch.device | str) -> list[list[torch.Tensor]]:
    """Per pool set, per output part: the probed positions, from the judge's specs ((seed, numel) per part,
    `judge._probe_spec`: the positions its `_Targets` checks and the runner's probes take)."""
    return [[probe_positions(seed, numel, device) for seed, numel in spec] for spec in specs]


def prepare(driver: Driver, sets: list[list[Any]], refs: Sequence[Any], specs: Sequence[Sequence[Sequence[int]]],
            calls: int) -> Setup:
    """The judge's side, ready: the pool on its GPU, the exported block, a flush buffer twice the L2."""
    pool = [[t.to("cuda") if isinstance(t, torch.Tensor) else t for t in s] for s in sets]
    layout = plan_layout(pool[0], output_parts(refs[0]))
    block = SharedBlock.exported(driver, layout.nbytes)
    try:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device="cuda")
        return Setup(pool, layout, block, flush, probe_targets(specs, "cuda"),
                     own_cost_ms(block, layout, pool, flush, calls))
    except BaseException:
        block.close()
        raise


def runner_loop(model: Any, driver: Driver, fd: int, layout: Layout, own_set: list[Any], first_seq: int, calls: int,
                with_call: bool) -> None:
    """The runner's side of one loop: map the judge's block, then per call wait on `ready`, call the solution on
    the shared inputs (or, in the null loop, not), copy its output into the output slots, write `done`."""
    block = SharedBlock.imported(driver, fd, layout.nbytes)
    try:
        ins, outs = block.views(layout)
        args = [arg if slot is None else slot for slot, arg in zip(ins, own_set, strict=True)]
        stand_ins = [torch.zeros_like(o) for o in outs]
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(calls):
            driver.wait(stream, block.address + READY, first_seq + i)
            if with_call:
                with torch.no_grad():
                    parts = output_parts(model(*args))
            else:
                parts = tuple(stand_ins)
            if len(parts) != len(outs):
                raise RuntimeError(f"the call returned {len(parts)} output parts, the reference {len(outs)}")
            for dst, part in zip(outs, parts, strict=True):
                dst.copy_(part)
            driver.write(stream, block.address + DONE, first_seq + i)
    finally:
        torch.cuda.synchronize()  # every queued wait and write has run before the block is unmapped
        block.close()

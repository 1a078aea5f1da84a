"""Run-time audits of candidate code. Each function names the attack it stops.

A text search of solution.py alone is dodged by an alias (`getattr(F, "scaled_" + …)`), a sidecar
file or a `.cu` source; these checks look at what actually ran instead. What ran can only be seen
inside the process that ran it, so the audits come in two halves:

- *collectors* run in the runner, beside candidate code, and return raw data (the aten ops a call
  reached, the kernels it launched and which of them came from the candidate's own code,
  host-synchronised samples, graph replay samples): `op_log`, `timed_kernels`, `own_kernels`,
  `host_synced_samples_ms`, `graph_replay_samples_ms`, `reset_persisting_l2`;
- *rules* run in the judge on that data: `forbidden_text_hits`, `forbidden_ops`,
  `kernel_problems`, `escaped_work`. A candidate that patches a rule patches its own copy only.

A hostile runner can still report false raw data; the rules stop what an honest runner sees.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .deck import Problem
from .launches import LaunchCount, count_launches
from .settings import COVER_SLACK_FRACTION, COVER_SLACK_MS, ESCAPE_FRACTION, ESCAPE_SLACK_MS, LIBRARY_KERNEL


def forbidden_text_hits(problem: Problem, solution_dir: Path) -> list[str]:
    """Stops the plain call of a forbidden library: its name in any text file of the submission
    (sidecars and .cu files included, not only solution.py)."""
    hits = []
    for path in sorted(solution_dir.rglob("*")):
        if not path.is_file() or path.name == "run.yaml":
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{needle!r} in {path.name}" for needle in problem.forbidden if needle in text]
    return hits


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


class _FunctionLog(TorchFunctionMode):
    """The torch functions a call makes, before any decomposition: an op that is
    CompositeImplicitAutograd (SDPA's math path on the CPU) reaches the dispatch mode only as
    the matmuls and softmax it decomposes into, but this mode sees the call itself."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None) or type(func).__name__
        self.names.append(f"torch:{name}")
        return func(*args, **(kwargs or {}))


def op_log(fn: Callable[..., Any], inputs: list[Any]) -> tuple[list[str], Any]:
    """Collector: the distinct torch functions (`torch:<name>`, from a TorchFunctionMode) and aten
    ops (from a dispatch mode) one call reaches, in first-seen order, and the call's output (which
    the judge checks like any other call's)."""
    functions, log = _FunctionLog(), _OpLog()
    with torch.no_grad(), functions, log:
        out = fn(*inputs)
    return list(dict.fromkeys(functions.names + log.ops)), out


def _forbidden(needle: str, op: str) -> bool:
    """An aten op matches a needle as a substring; a torch function (`torch:<name>`) matches an
    `aten::NAME` needle by exact name, any other needle without a namespace as a substring."""
    if not op.startswith("torch:"):
        return needle in op
    name = op.removeprefix("torch:")
    if needle.startswith("aten::"):
        return name == needle.removeprefix("aten::")
    return "::" not in needle and needle in name


def forbidden_ops(problem: Problem, ops: list[str]) -> list[str]:
    """Rule: stops an aliased call of a forbidden op (e.g. SDPA reached through getattr), whether
    the dispatch mode saw the aten op or only the torch function mode saw the call."""
    return sorted({op for op in ops for needle in problem.forbidden_ops if _forbidden(needle, op)})


def timed_kernels(fn: Callable[..., Any], inputs: list[Any]) -> list[str]:
    """Collector: the distinct CUDA kernels one call launches, in first-launch order (torch
    profiler/CUPTI)."""
    return profiled_call(fn, inputs)[0]


def profiled_call(fn: Callable[..., Any], inputs: list[Any]) -> tuple[list[str], LaunchCount]:
    """Collector: one call under the profiler — the distinct CUDA kernels it launches, in
    first-launch order, and how many launches it made (`launches.count_launches`)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    names: list[str] = []
    device_events: list[tuple[str, float]] = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            device_events.append((event.name, float(event.time_range.elapsed_us())))
            if event.name not in names:
                names.append(event.name)
    return names, count_launches(device_events)


def kernel_problems(problem: Problem, kernels: list[str], own: list[str] | None = None,
                    origin: str = "") -> list[str]:
    """Rule: stops a library doing the whole job inside the timed call (cuBLAS behind `load_inline`, a
    flash-attention kernel, the reference resubmitted): forbidden kernel names, and — where the
    problem requires it — a call that launched no kernel of the candidate's own. Which kernels are
    its own is the runner's `own` (decided by where they come from, `origins.own_kernels`); where the runner
    could not decide (`own` None), the names decide: any kernel LIBRARY_KERNEL does not match."""
    found = [f"forbidden kernel {k!r}" for k in kernels for pattern in problem.forbidden_kernels
             if re.search(pattern, k)]
    if not problem.require_own_kernel:
        return found
    shown = ", ".join(k[:60] for k in kernels[:4]) or "none"
    shown += ", …" if len(kernels) > 4 else ""
    by_name = [k for k in kernels if not LIBRARY_KERNEL.search(k)]
    if own is not None:
        if not set(own) & set(kernels):
            hint = (f"; by name alone {len(by_name)} would pass ({', '.join(k[:60] for k in by_name[:3])})"
                    if by_name else "")
            found.append(f"no kernel of its own ran: none of the {len(kernels)} kernels it launched comes from "
                         f"its code ({shown}){hint} [{origin or 'by origin'}]")
    elif not by_name:
        found.append(f"no kernel of its own ran: all {len(kernels)} kernels are PyTorch or library kernels "
                     f"({shown}) [by name: the runner could not tell where they came from"
                     f"{': ' + origin if origin else ''}]")
    return found


def _cudart() -> ctypes.CDLL | None:
    candidates = [ctypes.util.find_library("cudart")]
    for root in {os.path.dirname(torch.__file__), *(os.path.dirname(p) for p in torch.__path__)}:
        candidates += glob.glob(os.path.join(root, "..", "nvidia", "*", "lib", "libcudart.so*"))
        candidates += glob.glob(os.path.join(root, "..", "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        candidates += glob.glob(os.path.join(root, "lib", "libcudart*.so*"))
    for path in filter(None, candidates):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def reset_persisting_l2() -> str:
    """Stops L2 residency tricks (persisting access-policy windows that survive the flush): the
    persisting-L2 limit is set to 0 and persisting lines are reset. Returns what was done."""
    lib = _cudart()
    if lib is None:
        return "persisting-L2 reset unavailable (libcudart not found)"
    limit_rc = lib.cudaDeviceSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(0))  # cudaLimitPersistingL2CacheSize
    reset_rc = lib.cudaCtxResetPersistingL2Cache()
    return f"persisting-L2 limit 0 (rc {limit_rc}), reset (rc {reset_rc})"


def host_synced_samples_ms(fn: Callable[..., Any], next_inputs: Callable[[], list[Any]], flush: torch.Tensor,
                           calls: int = 10) -> dict[str, list[float]]:
    """Collector for `escaped_work`, `calls` calls from a cold L2 as in the event timing, each
    timed by the host three ways: `host_ms`, the call until a device-wide synchronise (which
    waits for every stream); `stream_ms`, the call until an event recorded after it on the
    calling stream has completed; `residue_ms`, host_ms − stream_ms: what the device still had to
    do after the calling stream was done — work that outlived the call on another stream. And
    `idle_ms`, the same two synchronises around no call, just before each: their own latency,
    which `cover_hid_work` takes off host_ms (10–15 µs each on a loaded H200 host).

    The residue, not host_ms against the event median, is what `escaped_work` judges: a kernel
    that synchronises inside its call (`.item()`, a host-side loop) waits in both host_ms and
    stream_ms alike, so an in-call synchronise never reads as escaped work.

    `next_inputs` gives each call its inputs, before the clock starts: the runner's live set,
    refilled in place as for the timed loop (a graph keyed on the inputs' addresses replays here as
    it does there; on rotating sets it was captured anew on every call, 0.75 ms against a 0.02 ms
    replay, and read as work hidden from the covered timer)."""
    host, stream, residue, idle = [], [], [], []
    with torch.no_grad():
        for _ in range(calls):
            args = next_inputs()
            flush.zero_()
            torch.cuda.synchronize()
            idle.append(_synchronised_ms(lambda: None)[0])
            t0, t1, t2 = _synchronised_ms(functools.partial(fn, *args))
            host.append(t0)
            stream.append(t1)
            residue.append(t2)
    return {"host_ms": host, "stream_ms": stream, "residue_ms": residue, "idle_ms": idle}


def _synchronised_ms(call: Callable[[], Any]) -> tuple[float, float, float]:
    """`call()` then the two synchronises of `host_synced_samples_ms`, on an idle device: ms until
    the device-wide synchronise returned, until the stream's event did, and between the two."""
    t0 = time.perf_counter()
    call()
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3


def escaped_work(residue_ms: Sequence[float], idle_ms: Sequence[float], median_ms: float) -> str | None:
    """Rule: stops work hidden on another stream (which the timed stream's events miss): the
    median call leaves the device busy for more than ESCAPE_SLACK_MS + ESCAPE_FRACTION × the event
    median after its own stream is done (`host_synced_samples_ms`), beyond what the synchronises
    take around no call just before it (call by call: `residue_ms` − `idle_ms`, the median). In-call
    synchronises and host work inside the call do not count; an honest call leaves only the
    synchronise's own latency, which a loaded host stretches: until 0.5.26 it was not taken off, and
    a single-stream 01 kernel (kimi-k2.7-code 060247, H100 SXM, 2026-12-07, five builds beside it)
    was refused with the device "busy" 0.0744 ms past its stream while the synchronises alone took
    0.1378 ms. Over 990 timed shapes of the GPU logs then, the residue was a median 0.46 of the
    synchronises' latency (at most 1.75)."""
    excess = statistics.median(r - i for r, i in zip(residue_ms, idle_ms, strict=True))
    if excess > ESCAPE_SLACK_MS + ESCAPE_FRACTION * median_ms:
        return (f"work escaped the timed stream — the device was still busy {statistics.median(residue_ms):.4f} "
                f"ms after the calling stream finished a call timed at {median_ms:.4f} ms between its events, "
                f"{excess:.4f} ms more than the synchronises alone (allowed: {ESCAPE_SLACK_MS:g} ms + "
                f"{ESCAPE_FRACTION:g} × the median)")
    return None


def cover_hid_work(host_ms: float, gpu_ms: float, dispatch_ms: float, idle_ms: float) -> str | None:
    """Rule: the covered timing (timing.time_cuda) saw all of a call's work. A call from an idle GPU
    to a device-wide synchronise (`host_synced_samples_ms`), less those synchronises' own latency
    around no call (`idle_ms`), can take no longer than its dispatch plus its GPU span; work that
    ran on another stream while the cover's sleep held the timed stream would be in the first and
    missing from the second. Beyond COVER_SLACK_MS + COVER_SLACK_FRACTION × (span + dispatch) the
    covered figure is not trusted (the judge times the shape again uncovered: a loaded host can
    trip this, and then costs only steadiness). Until 0.4.1 the synchronises' latency was not
    taken off: on a host loaded by four busy processes the honest house 03 kernel's 15 µs shape
    took 0.079–0.093 ms to its synchronise against 0.075–0.088 ms allowed, and was timed
    synchronised in all three gradings (0.035–0.061 ms)."""
    allowed = (gpu_ms + dispatch_ms) * (1 + COVER_SLACK_FRACTION) + COVER_SLACK_MS
    if host_ms - idle_ms > allowed:
        return (f"a call from an idle GPU to a device-wide synchronise took {host_ms:.4f} ms, {host_ms - idle_ms:.4f} "
                f"ms more than the synchronises alone ({idle_ms:.4f} ms), more than its covered GPU span "
                f"{gpu_ms:.4f} ms and dispatch {dispatch_ms:.4f} ms allow ({allowed:.4f} ms)")
    return None


def graph_replay_samples_ms(fn: Callable[..., Any], inputs: list[Any], flush: torch.Tensor,
                            replays: int = 20) -> tuple[list[float], Any]:
    """Collector: GPU time of one call with launch overhead removed: the call captured in a CUDA
    graph and replayed after the L2 flush. Reported beside the latency for launch-bound shapes,
    never instead of it. Returns (per-replay ms, the graph's output for the judge to verify)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(stream):
            fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*inputs)
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, out

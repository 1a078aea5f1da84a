"""The one GPU timer (`time_cuda`), its CPU counterpart (`time_cpu`), and the judge's checks of
what a runner claims against its own clock (`batch_problem`, `floor_ms`).

Method of `time_cuda` (Triton's `do_bench` pattern, made stricter):

1. Warm-up: calls on fresh input values (below), synchronised, until both `min_warmup` calls and
   `warmup_ms` of wall time have passed — JIT builds, autotuning and CUDA-graph capture happen
   here, never in the timed region.
2. Estimate: 5 synchronised calls give a per-call time; the iteration count is
   `rep_ms / estimate`, clamped to [`min_iters`, `max_iters`].
3. Timed loop, one CUDA event pair per call on the current stream: before each call its inputs
   are refilled and a buffer of twice the L2 size is zeroed (cold L2 for every call) and the
   device is synchronised. Then (since grader 0.4.0, "covered") the GPU sleeps for COVER_FACTOR
   times the host's slowest measured dispatch of one call (`torch.cuda._sleep`, its cycles per ms
   measured once the sleep kernel is loaded), then the start event, the call, the end event: the
   call's launches are queued before it starts, so a sample is the GPU's span for the call — never
   below the loop's least host dispatch less the least dispatch of one PyTorch launch (the sleep's)
   in the same loop (`covered_samples`, `dispatch_floor`; the median dispatch until 0.4.1, the
   least whole dispatch in 0.4.1), since a call costs the host work it does beyond one launch in a
   stream of calls, while the host's own speed is not the kernel's; where that floor is above the
   median GPU span (the host bound the loop), the loop runs again, FLOOR_WINDOWS loops at most,
   each after a short sleep, and the one with the least floor is kept (since 0.4.2: `_covered`),
   with its outputs and probes for the judge's checks (since 0.4.3: `Feed.checkpoint`). A result
   computed on the CPU cannot hide behind the sleep: reading the inputs waits for the GPU, so for
   the sleep.
   A call whose dispatch outlasts COVER_MARGIN of its sleep was not covered, or waited on the GPU
   inside itself (which waits out the sleep too); where more than COVER_UNCOVERED_SHARE of the
   calls were so, the loop runs again behind a sleep COVER_RETRY_FACTOR times longer (since
   0.4.1: a loaded host's dispatch had outgrown the first; since 0.4.5 a loop is given up as soon as
   more than COVER_PILOT_SHARE of its first COVER_PILOT_CALLS calls were so, the same decision
   without the rest of its calls), and where that loop has as many, it
   runs "synchronised": no sleep, the GPU idle when the start event runs, a sample the call's
   whole latency (host dispatch plus GPU work; the method of every grader before 0.4.0). The
   judge also times the shape again synchronised where a call from an idle GPU to a device-wide
   synchronise, less the synchronises' own latency, takes longer than the covered span and
   dispatch allow (`audit.cover_hid_work`) in two readings (the second taken only where the first
   exceeds it: `judge._host_synced`): work on a stream that does not wait for the timed one can
   run under the sleep. Each shape row records its method (`timing_method`).
4. Statistic: median, with p10, p90, min and the iteration count, computed by `summarize` from
   the raw per-call samples, which the record keeps (`samples_ms`): when candidate code is timed
   in the runner process, the judge recomputes the statistic from those samples itself.

**Fresh inputs, every timed output checked** (a `Feed`). Every timed call gets the same live
input tensors — one set, at the same addresses on every call, as a serving engine's static
buffers are — refilled in place before the call, outside the timed region, from a pool of at
least three input sets whose references the judge computed: the live set never sees the same
values twice in a row. The addresses are kept on purpose and the same for every problem: a kernel
that captures a CUDA graph (or builds descriptors) keyed on its inputs' pointers replays it,
as it would in production, while its values change; with addresses rotating over two sets such a
kernel re-captured on every call and was timed at its capture cost (03 kernels of grok and
opus-5: 0.56× and 0.83× on the H200, their minimum the published H100 time). Because the values
change, an output cache keyed on tensor identity, data pointer or `_version`, or served only when
a timing function is on the stack, hands back an output for other values. After each call (outside
the timed region, before the next call) the runner reads PROBE_ELEMENTS elements of each output
part at positions seeded by the judge, which checks them against the reference under the
problem's tolerance and, since 0.4.4, within REL_ERR_MAX of the reference's norm
(correctness.probe_problem: 0.25, ten times the worst honest error measured; a deck's atol can
dwarf its outputs, and 03's let an output of other inputs, or zeros, pass every probe): every
timed output is verified, for the price of a gather per call instead of a full comparison (a GPU
loop makes up to 2000 calls), and the last output for each pool set is also copied and compared
in full. A stale output with a fraction f of its elements off passes one call's element-wise
probe with probability (1 − f)^PROBE_ELEMENTS. Chosen over a fresh seed
per call (a reference per timed call would cost the judge as much as the timing) and over K
static sets (values repeat, so an identity cache hits). A cache keyed on a fingerprint of the
values can still serve the pool's repeats; the floor below sees it, as its batches run on values
never shown before. Because each output is read before the next call, **a kernel may return the
same persistent output buffer on every call**; a tuple's parts are probed separately.

**Evidence the runner cannot forge** (`batch_problem`, `floor_ms`). Samples are taken in the
runner, which candidate code can take over (patch `time.perf_counter_ns` or
`torch.cuda.Event.elapsed_time`). So the judge also asks for PROOF_ROUNDS batches of
back-to-back calls, each on an input set never used before (no flush, no per-call synchronise:
one at the end), timed by the runner's clock *and* by the judge's own clock around the whole
request. The runner's clock runs unbroken over the batch — a mark before the first call and one
after each call and its probe — so an honest runner's samples add up to the batch, its own loop
included. The runner cannot answer before the calls are done — the reply carries their
probed elements, checked like the timed ones. One rule, and one piece of evidence:

- *same calls, two clocks*: in at least one batch, the runner's samples must add up to
  PROOF_CLAIM_FACTOR of the judge's wall time less PROOF_ROUNDTRIP_MS. A patched clock shrinks
  every batch and is refused as an integrity violation; a hiccup outside the calls only inflates
  one batch. (Until grader 0.3.1 each call had its own event pair and the judge allowed a fixed
  0.02 ms a call for the loop between them; on an H200 whose host was busy with another GPU's
  grading, that loop took ~0.04 ms a call, and the honest house 03 kernel was refused on a
  launch-bound shape: 16.9 ms claimed against 32.9 ms by the judge for 400 calls. With the
  unbroken clock, one loaded grading still covered only 0.69 — the reply carrying 346 calls'
  probes is built after the calls — so the last mark now follows the probes' copy, and the factor
  is 0.6, above the 0.38 of a halved timer.)
- *the floor* (logged, not a refusal): the lowest batch's judge time per call, less the same
  allowances, bounds a warm call from below. It is not held against the timed loop's median,
  because the conditions differ twice: a warm call is cheaper than a flushed one (on a 2-core
  CPU a cold call measured ~2.7× a warm one), and a wall-clock batch taken while another process
  holds the CPU is inflated where a median is not (an honest 07 reference under another grader's
  load: floor 31 ms, median 3.8 ms). So **a lie told only inside the timed loop, by a candidate
  that recognises the loop, and a cache keyed on a fingerprint of the pool's repeating values,
  are not refused** by it; the log shows the floor beside the median for an auditor.
- *the witness* (since grader 0.5.25, the CPU's loop only; eval/witness.py): the judge's own clock
  around each timed call, through a handshake on two pipes, so the timed loop itself meets a clock
  the runner cannot reach; a loop whose samples are, call for call, under WITNESS_FACTOR of the
  judge's spans (less the handshake) is logged beside them, not refused: a loaded host's wake-ups
  can outlast the calls (in CI an honest loop read 0.23, a halved clock 0.45), so the lie told
  only inside the timed loop stays a known gap (tests/test_redteam_judge.py), now one the log
  shows. On a GPU the runner's events time the device, which a host-side span cannot bound
  (tests/test_timing_cover_sim.py), and the parent holds the figures to the hardware instead
  (since 0.5.13, scoring.beyond_hardware): a shape timed beyond the datasheet peak for its
  problem's regime is refused, which a cache serving without the work reaches wherever the work
  is longer than the host read that keys it. The fingerprint cache stays a known gap on the CPU.
- *the GPU witness* (since grader 0.5.28, with KERNELBOARD_GPU_WITNESS=1, which the boards'
  gradings set; eval/gpu_witness.py): after a shape's timed loop, the judge's own stream times calls
  the runner makes on inputs the judge writes into device memory both processes map, and its figure
  for a call is logged beside the timed median, which a lie told only in the timed loop halves (an
  H100, 2026-12-07: honest 0.99, halved 0.56). The timed loop itself is unchanged.

Where a batch's calls are too short to stand out of the allowances (launch-bound shapes), the
floor says so by being 0. A clock that takes a constant few µs off every call shrinks a batch of
400 calls of 50 µs by less than the factor allows: lies smaller than 1 − PROOF_CLAIM_FACTOR of a
call are not refused by this rule.

Known biases: events on the current stream miss work on other streams (the caller cross-checks
the host's device-wide synchronise, `audit.escaped_work` and `audit.cover_hid_work`, and the probe,
enqueued after the call, reads outputs the stream has not waited for); work on another stream that
overlaps the sleep by less than the cross-check's slack (COVER_SLACK_MS + COVER_SLACK_FRACTION of
span and dispatch) is not seen; clocks are not locked (the GPU is measured as found, after a
spin-up that lifts it from idle clocks). The refill copies the inputs before each call, which
leaves part of them in the L2 that the flush then evicts.

**Fidelity, measured** (one H200, 2026-12-01; `bench/timing_methods.py`, the house 03 kernel and
its eager reference in three fresh processes, and `kernelboard eval` grading it three times).
Synchronised, per-shape medians spread 4–33% between processes (twelve busy processes on the host)
and the headline 8–10%: a sample held the host's dispatch. Covered with the median dispatch as
floor (0.4.0), shapes of 33–100 µs spread 0.1–0.7% in the bench, the 15–20 µs ones 28–33% even on
an idle host, and three gradings under four busy processes 6.47×/6.67×/7.72× (19%; the 33 µs
shape 46% in one): one Triton launch's median dispatch was 0.013–0.048 ms from process to process
and floored every shape shorter than it, and the synchronises' latency tripped `cover_hid_work` on
the 15 µs shape in all three. 0.4.1 floors at the least dispatch (0.010–0.017 ms in every
process), stretches the sleep before giving up the cover, and takes the synchronises' latency off;
recomputed from the same spans and dispatches, shapes spread 0.1–0.9% and the headline 0.3–0.5% —
a projection. Measured on the H200 (2026-12-02, `bench/gpu_grading.py --gpus 0 --cpu-load 4`): the
four shapes of 20 µs and more spread 0.2–0.7% (0.5% at 19.6 µs), the grade 40.5 s (median), but the
headline 7.61×/7.59×/7.19× (5.9%): in the third grading the 15 µs shape's least dispatch was
0.0198 ms (0.0146 ms in the first), above its span, in a process whose dispatches were slow for a
whole loop (the 33 µs shape's too, 0.0218 against 0.0153); on another H200 machine the next day,
the same call's least dispatch was 0.0125 ms in one grading and 0.0207 ms in the next, on a KVM
guest whose vCPUs run as fast as its host lets them. 0.4.2 takes one PyTorch launch's least
dispatch, measured in the same loop, off the floor (the host's speed cancels to first order; ten
launches still cost nine launches' worth), runs a loop the host bound again, up to FLOOR_WINDOWS
loops after short sleeps, and keeps the least floor (`_covered`). Measured the same way on a third
machine: headline 8.12× and 8.11× (0.1%), every shape at its GPU span, each shape's medians within
0.7% (the third grading ran out of device time after 4 of 5 shapes, its spans within the same).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .settings import (
    COVER_FACTOR,
    COVER_MARGIN,
    COVER_MAX_MS,
    COVER_MIN_MS,
    COVER_PILOT_CALLS,
    COVER_PILOT_SHARE,
    COVER_RETRY_FACTOR,
    COVER_UNCOVERED_SHARE,
    CPU_FLUSH_BYTES,
    CPU_TIMER,
    CUDA_TIMER,
    FLOOR_WINDOW_PAUSE_MS,
    FLOOR_WINDOWS,
    L2_FLUSH_FACTOR,
    MIN_FLUSH_BYTES,
    MIN_INPUT_SETS,
    PROOF_CLAIM_FACTOR,
    PROOF_ROUNDTRIP_MS,
    SPIN_UP_MS,
)

Inputs = Sequence[Any]


class Witness:
    """Hooks around each call of the CPU's timed loop, for a clock outside the timing process
    (`eval.witness`): `before` once the call's inputs are in place, just before the timer reads its
    clock; `after` once its sample is taken. This base does nothing: the judge's own loops (the
    baselines, trusted code) are not witnessed."""

    def before(self) -> None:
        """The call is next; may block until the witness's clock runs."""

    def after(self) -> None:
        """The call returned and its sample is taken."""


class Feed:
    """Where a timer's calls get their inputs and what it does with their outputs.

    This base rotates over fixed input sets and keeps the last output per set (the baselines,
    which are trusted code, are timed so); the runner's `FreshFeed` refills and projects."""

    def __init__(self, input_sets: Sequence[Inputs]) -> None:
        if len(input_sets) < MIN_INPUT_SETS:
            raise ValueError(f"time on at least {MIN_INPUT_SETS} rotating input sets, got {len(input_sets)}")
        self.sets = input_sets
        self.calls = 0
        self.last: list[Any] = [None] * len(input_sets)

    def start_timed(self) -> None:
        """The timed loop begins: the calls from here on are the ones the caller checks."""
        self.calls = 0

    def next_inputs(self) -> Inputs:
        """The next call's inputs (outside the timed region)."""
        self.calls += 1
        return self.sets[(self.calls - 1) % len(self.sets)]

    def seen(self, out: Any, remaining: int) -> None:
        """A timed call's output, before the next call (outside the timed region); `remaining`
        timed calls follow it."""
        self.last[(self.calls - 1) % len(self.sets)] = out

    def checkpoint(self) -> Any:
        """What a timed loop left for the caller's checks; `restore` brings it back, so that the
        outputs checked are those of the loop whose times are kept, not of a later loop."""
        return list(self.last)

    def restore(self, state: Any) -> None:
        self.last = list(state)

    def done(self) -> None:
        """After the timed loop (the device synchronised)."""


@dataclass(frozen=True)
class Cover:
    """How a covered timed loop went, for the judge's check and the log: medians over the timed
    calls of the GPU span between the call's events, of the host's dispatch (call to return), and
    of the sleep that covered it; the samples' floor (the least covered dispatch less one launch's);
    `uncovered` counts calls whose dispatch outlasted most of the sleep (or that waited on the GPU),
    whose sample is then the GPU span alone; `loops`, how many loops were run for the kept one."""

    gpu_ms: float
    dispatch_ms: float
    sleep_ms: float
    uncovered: int
    floor_ms: float  # the samples' floor, `dispatch_floor`
    launch_ms: float  # the least dispatch of one PyTorch launch (the sleep's), which the floor leaves out
    loops: int = 1  # covered loops run at this cover (more where the host bound the first: `_covered`)


@dataclass(frozen=True)
class TimeStats:
    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    iterations: int
    wall_ms: float  # host wall clock of the whole timed loop, for the escaped-work cross-check
    samples_ms: tuple[float, ...] = field(default=(), repr=False)  # one per timed call, in call order
    cover: Cover | None = field(default=None, repr=False)  # how a covered CUDA loop went; None otherwise
    method: str | None = None  # "covered" or "synchronised" on a GPU (schema.TIMING_METHODS); None on the CPU

    def row(self) -> dict[str, float | int]:
        """The statistic as a result row stores it (no wall clock, no raw samples)."""
        return {"median_ms": self.median_ms, "p10_ms": self.p10_ms, "p90_ms": self.p90_ms,
                "min_ms": self.min_ms, "iterations": self.iterations, "timing_method": self.method}


def summarize(samples_ms: Sequence[float], wall_ms: float) -> TimeStats:
    """Median, p10 and p90 (inclusive deciles), min and count of per-call samples in ms."""
    samples = tuple(float(s) for s in samples_ms)
    if len(samples) < 2:
        raise ValueError(f"need at least 2 timed calls, got {len(samples)}")
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return TimeStats(statistics.median(samples), deciles[0], deciles[-1], min(samples), len(samples),
                     wall_ms, samples)


def floor_ms(batches: Sequence[tuple[float, int]], extra_per_call_ms: float) -> float:
    """The judge's lower bound on one call's time from its own clock: for each batch (judge wall
    ms around the request, calls in it), (wall − PROOF_ROUNDTRIP_MS) / calls − extra_per_call_ms;
    the lowest batch wins (a hiccup only raises a batch). Never below 0."""
    if not batches:
        raise ValueError("a floor needs at least one batch")
    return max(0.0, min((wall - PROOF_ROUNDTRIP_MS) / calls for wall, calls in batches) - extra_per_call_ms)


def batch_problem(batches: Sequence[tuple[float, int, float]]) -> str | None:
    """Why the runner's own samples of the floor batches cannot be true, or None: for each batch
    (judge wall ms, calls, the runner's summed samples ms — unbroken over the batch, its loop and
    probes included), the samples must cover at least PROOF_CLAIM_FACTOR of the judge's wall less
    the round trip, in at least one batch (a hiccup outside the calls only hurts one batch; a
    patched clock shrinks every batch's claim)."""
    covered = [claimed / max(wall - PROOF_ROUNDTRIP_MS, 1e-9) for wall, _, claimed in batches]
    if max(covered) < PROOF_CLAIM_FACTOR:
        wall, calls, claimed = batches[covered.index(max(covered))]
        return (f"the runner's clock says {calls} back-to-back calls took {claimed:.4f} ms, the judge's clock "
                f"{wall:.4f} ms around them (less {PROOF_ROUNDTRIP_MS:g} ms for the round trip; claims below "
                f"{PROOF_CLAIM_FACTOR:g}× that are refused)")
    return None


def retry_passes(batches: Sequence[tuple[float, int, float]], calls: int, stretch: float, max_passes: int) -> int:
    """Passes over `calls` input sets for a longer floor batch after no batch passed the two-clock
    check: enough that, at the runner's own claimed pace, the calls outlast the worst round trip
    seen so far (the judge's wall less the claim) `stretch` times; 1 to `max_passes`."""
    wall, n, claimed = max(batches, key=lambda x: x[0] - x[2])
    per_call = max(claimed / max(n, 1), 1e-6)
    want_ms = stretch * max(wall - claimed, PROOF_ROUNDTRIP_MS)
    return max(1, min(max_passes, math.ceil(want_ms / (per_call * calls))))


def _iterations(per_call_ms: float, rep_ms: float, min_iters: int, max_iters: int) -> int:
    return int(min(max_iters, max(min_iters, rep_ms / max(per_call_ms, 1e-4))))


def spin_up(buffer: torch.Tensor, ms: float = SPIN_UP_MS) -> None:
    """Keep the GPU busy for `ms` so it leaves idle clocks before anything is measured."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(8):
            buffer.zero_()
        torch.cuda.synchronize()


def _feed(input_sets: Sequence[Inputs] | None, feed: Feed | None) -> Feed:
    if feed is None:
        if input_sets is None:
            raise ValueError("time needs input sets or a feed")
        return Feed(input_sets)
    return feed


def covered_samples(spans_ms: Sequence[float], dispatch_ms: Sequence[float],
                    sleeps_ms: Sequence[float], launch_ms: float = 0.0) -> list[float]:
    """A covered loop's samples, one per call: its GPU span, never below `dispatch_floor` — the
    host work a call does beyond one kernel launch, which a stream of calls pays when it outlasts
    the GPU's work, so host work done on every call cannot hide behind the cover. Where a call's
    dispatch took COVER_MARGIN of its sleep or more (it outgrew the cover, or waited on the GPU,
    which the sleep itself delays), its GPU span already holds the GPU's wait for its launches,
    and is its sample."""
    return _floored(spans_ms, dispatch_ms, sleeps_ms, dispatch_floor(dispatch_ms, sleeps_ms, launch_ms))


def _uncovered(dispatch_ms: float, sleep_ms: float) -> bool:
    """Did a call's dispatch outlast its cover (COVER_MARGIN of the sleep before it)? Then it outgrew
    the cover, or waited on the GPU inside itself, which waits out the sleep too."""
    return dispatch_ms >= COVER_MARGIN * sleep_ms


def _floored(spans_ms: Sequence[float], dispatch_ms: Sequence[float], sleeps_ms: Sequence[float],
             floor_ms: float) -> list[float]:
    return [span if _uncovered(d, sleep) else max(span, floor_ms)
            for span, d, sleep in zip(spans_ms, dispatch_ms, sleeps_ms, strict=True)]


def dispatch_floor(dispatch_ms: Sequence[float], sleeps_ms: Sequence[float], launch_ms: float = 0.0) -> float:
    """The least host dispatch among a loop's covered calls less `launch_ms`, the least dispatch of
    one PyTorch kernel launch (the cover's sleep) in the same loop; 0 where no call was covered.
    It charges the host work a call does beyond the one launch that any kernel needs (Python
    planning, a chain of launches: ten launches cost nine launches' worth), not the host's own
    speed. Until 0.4.1 the floor was the median dispatch; an honest Triton launch's median moved
    0.013–0.048 ms between processes on an H200 host, and with it every shape whose GPU span is
    near that (the house 03 kernel's 15 and 20 µs shapes: 28–33% between processes, the headline
    8.8%). 0.4.1's floor, the least whole dispatch, still moved with the host: a KVM guest's vCPU
    runs as fast as the host lets it, and the same call's least dispatch over a whole loop of 2000
    calls was 0.0125–0.0207 ms from grading to grading on one H200 machine (the headline 4–6%).
    A call that does extra host work only some of the time is not held to it (nor, below half the
    calls, was it by the median). Both dispatches are timed in the runner, like the samples: a
    candidate that slows the sleep's launch there is the known gap of a lie told inside the timed
    loop (tests/test_timing_cover_sim.py keeps it as an expected failure)."""
    covered = [d for d, sleep in zip(dispatch_ms, sleeps_ms, strict=True) if not _uncovered(d, sleep)]
    return max(0.0, min(covered) - launch_ms) if covered else 0.0


@torch.no_grad()
def time_cuda(
    fn: Callable[..., Any],
    input_sets: Sequence[Inputs] | None,
    *,
    l2_bytes: int,
    feed: Feed | None = None,
    warmup_ms: float = CUDA_TIMER.warmup_ms,
    min_warmup: int = CUDA_TIMER.min_warmup,
    rep_ms: float = CUDA_TIMER.rep_ms,
    min_iters: int = CUDA_TIMER.min_iters,
    max_iters: int = CUDA_TIMER.max_iters,
    cover_dispatch: bool = True,
) -> tuple[TimeStats, list[Any]]:
    """Time `fn(*inputs)` on a CUDA device as the module docstring describes; inputs come from
    `feed` (or rotate over `input_sets`). Returns the stats and the feed's last output per set.

    `cover_dispatch` (the grading method since 0.4.0): after the synchronise, the GPU sleeps
    (`torch.cuda._sleep`) for COVER_FACTOR times the host's measured dispatch of one call before the
    start event, so the call's launches are queued by the time it starts; a sample is
    its GPU span, never below the loop's least host dispatch less one launch's (`covered_samples`;
    a loop the host bound runs again, `_covered`). Where more than COVER_UNCOVERED_SHARE of the
    calls outlasted their cover, the loop runs again behind a longer
    sleep, then (a call that waits on the GPU inside itself waits out any sleep) without it. Off:
    the call starts on an idle GPU and a sample is its whole latency (host dispatch plus GPU work),
    the method before 0.4.0."""
    feed = _feed(input_sets, feed)
    flush = torch.empty(max(L2_FLUSH_FACTOR * l2_bytes, MIN_FLUSH_BYTES) // 4, dtype=torch.int32, device="cuda")
    spin_up(flush)
    start = time.perf_counter()
    calls = 0
    while calls < min_warmup or (time.perf_counter() - start) * 1e3 < warmup_ms:
        fn(*feed.next_inputs())
        torch.cuda.synchronize()
        calls += 1
    estimate = [feed.next_inputs() for _ in range(5)]  # refills happen before the clock starts
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for args in estimate:
        fn(*args)
    torch.cuda.synchronize()
    per_call_ms = (time.perf_counter() - t0) * 1e3 / 5
    iters = _iterations(per_call_ms, rep_ms, min_iters, max_iters)
    if cover_dispatch:
        cycles = _cover_cycles(fn, [feed.next_inputs() for _ in range(5)])
        for stretch in (1.0, COVER_RETRY_FACTOR):  # a loaded host's dispatch can outgrow the first cover
            stats = _covered(fn, feed, flush, iters, int(cycles * stretch))
            if stats is not None:
                return stats, feed.last
    stats = _timed_loop(fn, feed, flush, iters, 0)
    assert stats is not None  # only a covered loop is ever given up
    return stats, feed.last


def _covered(fn: Callable[..., Any], feed: Feed, flush: torch.Tensor, iters: int, cycles: int) -> TimeStats | None:
    """The covered loop at `cycles` of sleep, or None where more than COVER_UNCOVERED_SHARE of its
    calls outlasted the cover. Where the host bound it (its floor above the median GPU span, so the
    floor is the median sample), it runs again, up to FLOOR_WINDOWS loops, each after a pause of
    FLOOR_WINDOW_PAUSE_MS, and the covered loop with the least floor is kept: a host can be slow
    for a whole loop (an H200 KVM guest with 4 busy processes: the same call's least dispatch
    0.0198 ms in one grading, 0.0146 ms in the others), and a later loop, after the process slept,
    may not be. Alone this did not steady the figure (under 0.4.2 before the launch was taken off,
    three loops still floored the 15 µs shape at 0.0179 and 0.0211 ms in two gradings); with the
    floor less one launch's dispatch, a loop rarely binds, and this is the second line."""
    runs: list[tuple[TimeStats, Cover, Any]] = []  # each covered loop: stats, cover, the feed's checkpoint
    for loops in range(1, FLOOR_WINDOWS + 1):
        if loops > 1:
            time.sleep(FLOOR_WINDOW_PAUSE_MS / 1e3)
        stats = _timed_loop(fn, feed, flush, iters, cycles)
        if stats is not None and stats.cover is not None and stats.cover.uncovered <= COVER_UNCOVERED_SHARE * iters:
            runs.append((stats, stats.cover, feed.checkpoint()))
        elif not runs:
            return None  # the first loop outgrew its cover: the caller's longer sleep, not more loops
        best, cover, state = min(runs, key=lambda run: run[1].floor_ms)  # the first of equal floors
        if cover.floor_ms <= cover.gpu_ms:
            break
    feed.restore(state)  # a loop with wrong outputs and a low floor must not be kept unchecked
    return dataclasses.replace(best, cover=dataclasses.replace(cover, loops=loops))


def _timed_loop(fn: Callable[..., Any], feed: Feed, flush: torch.Tensor, iters: int,
                cover_cycles: int) -> TimeStats | None:
    """`iters` timed calls, each from a flushed L2 and an idle GPU, behind a sleep of
    `cover_cycles` where that is not 0 (then the samples are `covered_samples`, else the GPU spans).
    None: a covered loop given up after its pilot calls (COVER_PILOT_CALLS), most of which outlasted
    their sleep."""
    gates = [torch.cuda.Event(enable_timing=True) for _ in range(iters if cover_cycles else 0)]
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    dispatch = [0.0] * iters
    launch = [0.0] * iters  # the sleep's own dispatch: one PyTorch kernel launch, for the floor
    torch.cuda.synchronize()
    feed.start_timed()
    wall0 = time.perf_counter()
    for i in range(iters):
        args = feed.next_inputs()
        flush.zero_()
        torch.cuda.synchronize()
        if cover_cycles and i == COVER_PILOT_CALLS < iters and _outgrown(dispatch[:i], gates[:i], starts[:i]):
            feed.done()
            return None
        if cover_cycles:
            gates[i].record()
            t = time.perf_counter()
            torch.cuda._sleep(cover_cycles)
            launch[i] = (time.perf_counter() - t) * 1e3
        starts[i].record()
        t = time.perf_counter()
        out = fn(*args)
        dispatch[i] = (time.perf_counter() - t) * 1e3
        ends[i].record()
        feed.seen(out, iters - 1 - i)
        del out
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - wall0) * 1e3
    feed.done()
    spans = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    if not cover_cycles:
        return dataclasses.replace(summarize(spans, wall_ms), method="synchronised")
    sleeps = [g.elapsed_time(s) for g, s in zip(gates, starts, strict=True)]
    least_launch = min(launch)
    floor = dispatch_floor(dispatch, sleeps, least_launch)
    samples = _floored(spans, dispatch, sleeps, floor)
    cover = Cover(statistics.median(spans), statistics.median(dispatch), statistics.median(sleeps),
                  sum(_uncovered(d, s) for d, s in zip(dispatch, sleeps, strict=True)), floor, least_launch)
    return dataclasses.replace(summarize(samples, wall_ms), cover=cover, method="covered")


def _outgrown(dispatch_ms: Sequence[float], gates: Sequence[Any], starts: Sequence[Any]) -> bool:
    """Did more than COVER_PILOT_SHARE of these calls (their events complete: the device was synchronised)
    outlast their sleep?"""
    sleeps = [g.elapsed_time(s) for g, s in zip(gates, starts, strict=True)]
    uncovered = sum(_uncovered(d, s) for d, s in zip(dispatch_ms, sleeps, strict=True))
    return uncovered > COVER_PILOT_SHARE * len(dispatch_ms)


def _cover_cycles(fn: Callable[..., Any], sets: list[Inputs]) -> int:
    """GPU sleep cycles that outlast the host's dispatch of one call: COVER_FACTOR times the slowest
    of a few dispatches (host time from call to return, the GPU idle before each), clamped to
    [COVER_MIN_MS, COVER_MAX_MS]. Cycles per ms are measured here, on sleeps of 1 M cycles after one
    that loads the sleep kernel (a first launch's module load, inside the events, once made the
    sleep look slower, the cover too short, and one process's samples whole latencies)."""
    dispatch_ms = 0.0
    for args in sets:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        dispatch_ms = max(dispatch_ms, (time.perf_counter() - t0) * 1e3)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    per_ms = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(1_000_000)
        b.record()
        torch.cuda.synchronize()
        per_ms.append(1_000_000 / max(a.elapsed_time(b), 1e-3))
    return int(min(max(COVER_FACTOR * dispatch_ms, COVER_MIN_MS), COVER_MAX_MS) * max(per_ms))


@torch.no_grad()
def time_cpu(
    fn: Callable[..., Any],
    input_sets: Sequence[Inputs] | None,
    *,
    feed: Feed | None = None,
    flush_bytes: int = CPU_FLUSH_BYTES,
    warmup_ms: float = CPU_TIMER.warmup_ms,
    min_warmup: int = CPU_TIMER.min_warmup,
    rep_ms: float = CPU_TIMER.rep_ms,
    min_iters: int = CPU_TIMER.min_iters,
    max_iters: int = CPU_TIMER.max_iters,
    witness: Witness | None = None,
) -> tuple[TimeStats, list[Any]]:
    """Time `fn(*inputs)` on the CPU with `perf_counter`, a cache-sized buffer written before
    each call, each timed call inside `witness`'s hooks where one is given. CPU timings are
    labelled `cpu_wall` and never compared with GPU timings."""
    witness = witness or Witness()
    feed = _feed(input_sets, feed)
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32)
    start = time.perf_counter()
    calls = 0
    busy_ns = 0
    while calls < min_warmup or (time.perf_counter() - start) * 1e3 < warmup_ms:
        args = feed.next_inputs()
        t = time.perf_counter_ns()
        fn(*args)
        busy_ns += time.perf_counter_ns() - t
        calls += 1
    iters = _iterations(busy_ns / 1e6 / calls, rep_ms, min_iters, max_iters)
    samples: list[float] = []
    feed.start_timed()
    wall0 = time.perf_counter()
    for i in range(iters):
        args = feed.next_inputs()
        flush.zero_()
        witness.before()
        t = time.perf_counter_ns()
        out = fn(*args)
        samples.append((time.perf_counter_ns() - t) / 1e6)
        witness.after()
        feed.seen(out, iters - 1 - i)
        del out
    wall_ms = (time.perf_counter() - wall0) * 1e3
    feed.done()
    return summarize(samples, wall_ms), feed.last

"""`timing.time_cuda`'s control flow on a simulated GPU (the CPU CI has none): a host clock, a GPU
timeline that sleeps, records events and runs a call's kernel after its dispatch, and calls whose
dispatch and GPU span the test sets. It checks which method a loop ends with and what its samples
are; the real timer is verified on the H200 (tests/test_eval_gpu.py)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from kernelboard.eval import timing
from kernelboard.eval.settings import (
    COVER_FACTOR,
    COVER_MIN_MS,
    COVER_PILOT_CALLS,
    COVER_PILOT_SHARE,
    COVER_RETRY_FACTOR,
    FLOOR_WINDOWS,
)

CYCLES_PER_MS = 1_000_000.0


@dataclass
class SimGpu:
    """Host time and GPU time in ms. A synchronise waits for the GPU; a sleep or kernel queued at host
    time h runs from max(h, the GPU's last work); an event records when the GPU reaches it."""

    now: float = 0.0
    gpu: float = 0.0
    tick: float = 1e-4  # each host clock read costs a little time, so wall-clock loops end
    calls: int = 0

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now / 1e3

    def host_sleep(self, seconds: float) -> None:
        self.now += seconds * 1e3

    def synchronize(self) -> None:
        self.now = max(self.now, self.gpu)

    def sleep(self, cycles: int) -> None:
        self.gpu = max(self.gpu, self.now) + cycles / CYCLES_PER_MS

    def launch(self, dispatch_ms: float, span_ms: float, waits: bool = False) -> None:
        """A call: the host spends `dispatch_ms`, then its kernel runs for `span_ms`; `waits`: the call
        synchronises inside itself after launching (the host waits for the GPU)."""
        self.calls += 1
        self.now += dispatch_ms
        self.gpu = max(self.gpu, self.now) + span_ms
        if waits:
            self.synchronize()


class SimEvent:
    def __init__(self, sim: SimGpu) -> None:
        self.sim, self.t = sim, 0.0

    def record(self) -> None:
        self.t = self.sim.gpu = max(self.sim.gpu, self.sim.now)

    def elapsed_time(self, other: SimEvent) -> float:
        return other.t - self.t


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> SimGpu:
    gpu = SimGpu()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=gpu.perf_counter, sleep=gpu.host_sleep))
    monkeypatch.setattr(timing, "spin_up", lambda buffer, ms=0.0: None)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleep)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=True: SimEvent(gpu))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, dtype=None, device=None: real_empty(4, dtype=dtype))
    return gpu


def _time(sim: SimGpu, call) -> timing.TimeStats:
    sets = [[torch.zeros(1)], [torch.ones(1)]]
    stats, _ = timing.time_cuda(call, sets, l2_bytes=1024, warmup_ms=0.0, min_warmup=3, rep_ms=1.0,
                                min_iters=40, max_iters=40)
    return stats


CALIBRATION_CALLS = 3 + 5 + 5  # warm-up, the estimate, the cover's calibration


def test_a_gpu_bound_call_is_timed_covered_at_its_span(sim: SimGpu) -> None:
    stats = _time(sim, lambda x: sim.launch(0.01, 0.1))
    assert stats.method == "covered" and stats.cover is not None and stats.cover.uncovered == 0
    assert stats.median_ms == pytest.approx(0.1)
    assert stats.cover.sleep_ms == pytest.approx(max(COVER_FACTOR * 0.01, COVER_MIN_MS), rel=0.05)


def test_a_host_bound_call_is_floored_at_its_least_dispatch(sim: SimGpu) -> None:
    dispatch = iter([0.03] * CALIBRATION_CALLS + [0.02, 0.05, 0.03] * 100)  # jitter in the loop
    stats = _time(sim, lambda x: sim.launch(next(dispatch), 0.005))
    assert stats.method == "covered" and stats.cover is not None
    assert stats.median_ms == pytest.approx(0.02, abs=1e-3) and stats.cover.floor_ms == pytest.approx(0.02, abs=1e-3)
    # (the median dispatch, the floor until 0.4.1, is 0.03 ms here: the host's jitter, not the call's cost)
    assert stats.cover.loops == FLOOR_WINDOWS  # the host bound every loop: all of them were run


def test_a_loop_the_host_slowed_throughout_is_run_again_and_the_least_floor_kept(sim: SimGpu) -> None:
    """The first loop's every dispatch is slow (the process shared a busy core); the next is not."""
    dispatch = iter([0.03] * CALIBRATION_CALLS + [0.03] * 40 + [0.016] * 40 + [0.018] * 40)
    stats = _time(sim, lambda x: sim.launch(next(dispatch), 0.015))
    assert stats.method == "covered" and stats.cover is not None and stats.cover.loops == 3
    assert stats.cover.floor_ms == pytest.approx(0.016, abs=1e-3) and stats.median_ms == pytest.approx(0.016, abs=1e-3)
    assert sim.calls == CALIBRATION_CALLS + 3 * 40



def test_the_outputs_checked_are_those_of_the_loop_whose_times_are_kept(sim: SimGpu) -> None:
    """Only the kept loop's outputs go to the judge: a candidate whose first loop returns garbage
    behind a low floor, then computes honestly behind a high one, must be checked on the garbage."""
    loops = iter([1] * CALIBRATION_CALLS + [1] * 40 + [2] * 40 + [3] * 40)
    floors = {1: 0.016, 2: 0.03, 3: 0.03}  # loop 1: the least floor, all three host-bound

    def call(x):
        loop = next(loops)
        sim.launch(floors[loop], 0.005)
        return f"loop {loop}"

    sets = [[torch.zeros(1)], [torch.ones(1)], [torch.ones(1)]]
    stats, last = timing.time_cuda(call, sets, l2_bytes=1024, warmup_ms=0.0, min_warmup=3, rep_ms=1.0,
                                   min_iters=40, max_iters=40)
    assert stats.cover is not None and stats.cover.loops == 3 and stats.cover.floor_ms == pytest.approx(0.016, abs=1e-3)
    assert last == ["loop 1"] * 3

def test_a_loop_the_gpu_bounds_ends_the_search(sim: SimGpu) -> None:
    """A second loop whose floor is under the span ends the search: the GPU bounds it."""
    dispatch = iter([0.03] * CALIBRATION_CALLS + [0.03] * 40 + [0.01] * 80)
    stats = _time(sim, lambda x: sim.launch(next(dispatch), 0.02))
    assert stats.cover is not None and stats.cover.loops == 2 and stats.median_ms == pytest.approx(0.02, abs=1e-3)
    assert sim.calls == CALIBRATION_CALLS + 2 * 40


def test_a_host_slower_than_its_calibration_gets_a_longer_sleep_not_the_synchronised_timer(sim: SimGpu) -> None:
    """Calibrated at 0.02 ms of dispatch (a cover of 0.06 ms), timed at 0.05 ms: every call outgrows
    that cover; the loop runs again behind a sleep COVER_RETRY_FACTOR times longer, covered."""
    dispatch = iter([0.02] * CALIBRATION_CALLS + [0.05] * 1000)
    stats = _time(sim, lambda x: sim.launch(next(dispatch), 0.1))
    assert stats.method == "covered" and stats.cover is not None and stats.cover.uncovered == 0
    assert stats.cover.sleep_ms == pytest.approx(COVER_RETRY_FACTOR * COVER_FACTOR * 0.02, rel=0.05)
    assert stats.median_ms == pytest.approx(0.1)
    assert sim.calls == CALIBRATION_CALLS + COVER_PILOT_CALLS + 40  # the first loop given up, then the longer one


def test_a_call_that_waits_on_the_gpu_inside_itself_is_timed_synchronised(sim: SimGpu) -> None:
    """It waits out any sleep, so both covered loops are uncovered; the third loop has no sleep and a
    sample is its whole latency: dispatch plus span."""
    stats = _time(sim, lambda x: sim.launch(0.01, 0.1, waits=True))
    assert stats.method == "synchronised" and stats.cover is None
    assert stats.median_ms == pytest.approx(0.11, rel=0.01)
    assert sim.calls == CALIBRATION_CALLS + 2 * COVER_PILOT_CALLS + 40  # both covered loops given up early


def _time_long(sim: SimGpu, call, iters: int) -> timing.TimeStats:
    stats, _ = timing.time_cuda(call, [[torch.zeros(1)], [torch.ones(1)]], l2_bytes=1024, warmup_ms=0.0,
                                min_warmup=3, rep_ms=1.0, min_iters=iters, max_iters=iters)
    return stats


def test_a_covered_loop_most_of_whose_first_calls_outlast_their_sleep_is_given_up_there(sim: SimGpu) -> None:
    """The same decision as the whole loop's, sooner: 2,000 calls that wait on the GPU inside themselves
    cost the two covered loops 64 calls, not 4,000 waited-out sleeps (four of them 4x longer)."""
    stats = _time_long(sim, lambda x: sim.launch(0.01, 0.1, waits=True), 2000)
    assert stats.method == "synchronised" and stats.median_ms == pytest.approx(0.11, rel=0.01)
    assert sim.calls == CALIBRATION_CALLS + 2 * COVER_PILOT_CALLS + 2000


def test_a_loop_covered_through_its_pilot_is_judged_whole(sim: SimGpu) -> None:
    """A pilot that is mostly covered never ends a loop: calls that outgrow the cover only later (here 20%
    of the loop, the last fifth) are counted over the whole loop, which then runs again behind the longer
    sleep, covered, as before 0.4.5."""
    n = 200
    dispatch = iter([0.02] * CALIBRATION_CALLS + [0.02] * (n - n // 5) + [0.07] * (n // 5) + [0.02] * n)
    stats = _time_long(sim, lambda x: sim.launch(next(dispatch), 0.1), n)
    assert stats.method == "covered" and stats.cover is not None and stats.cover.uncovered == 0
    assert stats.cover.sleep_ms == pytest.approx(COVER_RETRY_FACTOR * COVER_FACTOR * 0.02, rel=0.05)
    assert sim.calls == CALIBRATION_CALLS + 2 * n


def test_a_pilot_that_just_holds_does_not_end_the_loop(sim: SimGpu) -> None:
    """Exactly COVER_PILOT_SHARE of the pilot uncovered is not more than it: the loop goes on, and its
    whole (16 of 400 uncovered, 4%) is covered enough to be kept."""
    half = int(COVER_PILOT_SHARE * COVER_PILOT_CALLS)
    dispatch = iter([0.02] * CALIBRATION_CALLS + [0.07] * half + [0.02] * 1000)
    stats = _time_long(sim, lambda x: sim.launch(next(dispatch), 0.1), 400)
    assert stats.method == "covered" and stats.cover is not None and stats.cover.uncovered == half
    assert sim.calls == CALIBRATION_CALLS + 400


@pytest.mark.xfail(strict=True, reason="known gap: a lie told inside the timed loop (eval/timing.py, 'Evidence "
                   "the runner cannot forge'); the judge's floor batches log the host cost beside the median")
def test_a_candidate_that_slows_the_covers_launch_keeps_its_host_work_charged(sim: SimGpu, monkeypatch) -> None:
    """0.4.2 takes one launch's dispatch (the sleep's, timed in the runner) off the floor. Candidate
    code in the runner can wrap `torch.cuda._sleep` in 0.1 ms of host time, so that its own 0.1 ms
    of host work per call is taken off too; the figure should still hold that work."""
    real_sleep = torch.cuda._sleep
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (sim.host_sleep(1e-4), real_sleep(cycles)))
    dispatch = iter([0.1] * 1000)
    stats = _time(sim, lambda x: sim.launch(next(dispatch), 0.005))
    assert stats.median_ms >= 0.09

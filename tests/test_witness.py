"""The judge's witness of the CPU's timed loop (eval/witness.py): its handshake across a real process
boundary, its rule, and the timer's hooks. The attack it answers, a clock lie told only inside the
timed loop, is graded end to end in tests/test_redteam_judge.py."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from kernelboard.eval import timing
from kernelboard.eval.settings import WITNESS_FACTOR, WITNESS_HANDSHAKE_MS, WITNESS_MIN_SPAN_MS
from kernelboard.eval.witness import JudgeWitness, PipeWitness, witness_doubt, witness_problem, witness_ratio


def _runner(go_fd: int, mark_fd: int, calls: int, call_s: float, lie: bool, result: multiprocessing.Queue) -> None:
    """A runner process: `calls` timed calls of `call_s` each inside the witness; reports its samples
    (halved where it `lie`s)."""
    witness = PipeWitness(go_fd, mark_fd)
    samples = []
    for _ in range(calls):
        witness.before()
        t = time.perf_counter_ns()
        time.sleep(call_s)
        samples.append((time.perf_counter_ns() - t) / 1e6 / (2 if lie else 1))
        witness.after()
    witness.close()
    result.put(samples)


def _witnessed(calls: int, call_s: float, lie: bool) -> tuple[list[float], list[float]]:
    context = multiprocessing.get_context("fork")
    result = context.Queue()
    with JudgeWitness() as witness:
        go_fd, mark_fd = witness.runner_fds()
        process = context.Process(target=_runner, args=(go_fd, mark_fd, calls, call_s, lie, result))
        process.start()
        samples = result.get(timeout=60)
        process.join(timeout=60)
    return samples, witness.spans_ms


@pytest.mark.parametrize("lie", [False, True], ids=["honest", "halved"])
def test_the_judges_spans_hold_each_call_of_another_process(lie: bool) -> None:
    samples, spans = _witnessed(calls=20, call_s=0.002, lie=lie)
    assert len(spans) == 20
    assert all(span >= 2.0 for span in spans), spans  # each span holds its 2 ms call
    assert witness_problem(samples, spans) is None  # the handshake counted every call
    doubt = witness_doubt(samples, spans, "cpu")
    if lie:
        assert doubt is not None and "the judge's clock around the same calls" in doubt, doubt
    else:
        assert doubt is None, doubt
        assert witness_ratio(samples, spans, "cpu") > 0.8


def test_a_message_out_of_turn_is_a_fault_and_the_runner_is_answered_anyway() -> None:
    with JudgeWitness() as witness:
        go_fd, mark_fd = witness.runner_fds()
        os.write(mark_fd, b"r")
        os.write(mark_fd, b"r")  # a second call begins before the first ended
        assert os.read(go_fd, 1) == b"g" and os.read(go_fd, 1) == b"g"  # both answered: no runner waits
        os.write(mark_fd, b"d")
        time.sleep(0.05)
    assert witness.fault == "a second call began before call 1 ended"


def test_the_rule() -> None:
    handshake = WITNESS_HANDSHAKE_MS["cpu"]
    spans = [1.0 + handshake] * 9
    assert witness_doubt([1.0] * 9, spans, "cpu") is None
    assert witness_doubt([0.5] * 9, spans, "cpu") is not None  # a clock halved inside the loop
    assert witness_doubt([WITNESS_FACTOR + 0.01] * 9, spans, "cpu") is None
    # one long wake-up per call in a minority of calls does not move the median ratio
    assert witness_doubt([1.0] * 9, [1.05] * 5 + [9.0] * 4, "cpu") is None
    # spans too short to tell a call from the handshake are not judged
    short = WITNESS_MIN_SPAN_MS / 2
    assert witness_doubt([short / 10] * 9, [short] * 9, "cpu") is None
    # the count is the refusal: a call the judge's clock never saw
    assert witness_problem([1.0] * 9, spans) is None
    assert "the judge's clock saw 8 calls" in witness_problem([1.0] * 9, spans[:8])


def test_the_cpu_timer_calls_the_witness_around_every_timed_call_only() -> None:
    order: list[str] = []

    class Recording(timing.Witness):
        def before(self) -> None:
            order.append("before")

        def after(self) -> None:
            order.append("after")

    def fn(x: torch.Tensor) -> torch.Tensor:
        order.append("call")
        return x * 2

    sets = [[torch.ones(4)], [torch.ones(4)]]
    stats, _ = timing.time_cpu(fn, sets, witness=Recording(), rep_ms=1.0, min_iters=5, max_iters=5,
                               warmup_ms=0.0, min_warmup=3, flush_bytes=1 << 12)
    assert order[:3] == ["call"] * 3  # the warm-up is not witnessed
    assert order[3:] == ["before", "call", "after"] * stats.iterations

"""The judge's own clock around each call of the runner's timed loop (the witness), and its rules.

Why: every sample of a timed loop is taken in the runner, the process candidate code shares, so a
solution that recognises the loop can shrink its samples there alone (patch `time.perf_counter_ns`
only when the timer's frame is on its stack, say) and tell the truth everywhere the judge looks
(`timing.batch_problem`'s floor batches run outside the loop). The witness puts the judge's clock
around the very calls the runner times, so such a lie meets a second clock it cannot reach.

The handshake, one byte a message over two pipes the judge makes and hands the runner with the
`time` request (the runner's ends), for every timed call:

- runner → judge `r`: the call's inputs are refilled and the cache flushed; the runner then waits
  for the judge's answer before it reads its clock and calls;
- judge → runner `g`: sent the moment the judge's clock starts;
- runner → judge `d`: sent after the call returned and its sample was taken; the judge's clock
  stops when it reads it.

A judge's span is the call plus two wake-ups of a process blocked on a pipe (tens of µs on an idle
host, more under load). Since the runner's clock runs only inside the span, an honest sample is
never above its span. The judge refuses a report of more or fewer calls than it saw
(`witness_problem`), and logs a loop whose samples are, call for call, well under its spans
(`witness_doubt`): logged, not refused, since a loaded host's wake-ups can outlast the calls (grader
0.5.25 refused such loops, and refused an honest reference in CI). Only the CPU's timed loop is
witnessed here: on a GPU the runner's events time the device, not the host, and the judge's span would
be the host's; there the judge's own stream waits on memory the runner's stream writes
(eval/gpu_witness.py, after the timed loop).

What it does not see: work a solution moves out of the span (done before its `r`, or after its
`d`, by code that patches the runner's side of the handshake) is not in either clock; that is the
escaped-work and cache territory of the probes and the floor batches. Lies on calls shorter than
WITNESS_MIN_SPAN_MS are not judged: there the wake-ups are most of a span.
"""

from __future__ import annotations

import os
import select
import statistics
import threading
import time
from collections.abc import Sequence
from types import TracebackType

from .settings import WITNESS_FACTOR, WITNESS_HANDSHAKE_MS, WITNESS_MIN_SPAN_MS
from .timing import Witness

#: How often the judge's watcher looks up from an idle pipe to see whether the loop is over (s).
_IDLE_POLL_S = 0.05


class PipeWitness(Witness):
    """The runner's side of the handshake: its ends of the judge's two pipes (go: read, mark: write)."""

    def __init__(self, go_fd: int, mark_fd: int) -> None:
        self.go_fd, self.mark_fd = go_fd, mark_fd

    def before(self) -> None:
        os.write(self.mark_fd, b"r")
        if os.read(self.go_fd, 1) != b"g":
            raise RuntimeError("the judge's witness closed its pipe before the call")

    def after(self) -> None:
        os.write(self.mark_fd, b"d")

    def close(self) -> None:
        for fd in (self.go_fd, self.mark_fd):
            os.close(fd)


class JudgeWitness:
    """The judge's side: makes the two pipes, hands out the runner's ends (`runner_fds`), and while
    entered answers every `r` at once from a thread, timing each call from its `g` to the runner's
    `d` (`spans_ms`). A message out of turn is kept in `fault` and the loop is answered on
    regardless, so that the runner never waits on a judge that stopped listening."""

    def __init__(self) -> None:
        self._go_read, self._go_write = os.pipe()
        self._mark_read, self._mark_write = os.pipe()
        self.spans_ms: list[float] = []
        self.fault: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="judge-witness", daemon=True)

    def runner_fds(self) -> tuple[int, int]:
        return self._go_read, self._mark_write

    def __enter__(self) -> JudgeWitness:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        for fd in (self._go_read, self._go_write, self._mark_read, self._mark_write):
            os.close(fd)  # the runner has its own copies of its ends: the request carried them

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._mark_read, select.POLLIN)
        started: int | None = None
        while not self._stop.is_set():
            if not poller.poll(_IDLE_POLL_S * 1e3):
                continue
            message = os.read(self._mark_read, 1)
            now = time.perf_counter_ns()
            if not message:
                return  # the runner's end closed
            if message == b"r":
                if started is not None:
                    self._note(f"a second call began before call {len(self.spans_ms) + 1} ended")
                started = time.perf_counter_ns()
                os.write(self._go_write, b"g")
            elif message == b"d" and started is not None:
                self.spans_ms.append((now - started) / 1e6)
                started = None
            else:
                self._note(f"an unexpected {message!r} after {len(self.spans_ms)} calls")

    def _note(self, fault: str) -> None:
        if self.fault is None:
            self.fault = fault


def witness_ratio(samples_ms: Sequence[float], spans_ms: Sequence[float], device: str) -> float:
    """The median over calls of the runner's sample / (the judge's span − WITNESS_HANDSHAKE_MS): about
    1 for an honest clock. Call by call, so that a wake-up a loaded host delays lengthens one span,
    not the figure."""
    handshake = WITNESS_HANDSHAKE_MS[device]
    return statistics.median(s / max(span - handshake, 1e-9) for s, span in zip(samples_ms, spans_ms, strict=True))


def witness_problem(samples_ms: Sequence[float], spans_ms: Sequence[float]) -> str | None:
    """Why the runner's report of a witnessed loop cannot be true, or None: one span of the judge's per
    sample. (A refusal: the handshake counts calls whatever the host's load.)"""
    if len(spans_ms) != len(samples_ms):
        return (f"the runner reported {len(samples_ms)} timed calls, the judge's clock saw {len(spans_ms)} "
                f"calls begin and end")
    return None


def witness_doubt(samples_ms: Sequence[float], spans_ms: Sequence[float], device: str) -> str | None:
    """Where the judge's median span is at least WITNESS_MIN_SPAN_MS and the `witness_ratio` is under
    WITNESS_FACTOR, what the two clocks say, for the log: logged, not refused, because a loaded host
    stretches the wake-ups past the calls (an honest reference read 0.23–0.28 on the 2-core CI machine
    under two test processes, twice in a row at one shape, 2026-12-07), and a clock lie reads
    0.45–0.51: the spans alone cannot tell them apart until the wake-ups are measured too."""
    if not spans_ms or statistics.median(spans_ms) < WITNESS_MIN_SPAN_MS:
        return None
    ratio = witness_ratio(samples_ms, spans_ms, device)
    if ratio >= WITNESS_FACTOR:
        return None
    return (f"the runner's clock says its timed calls took {statistics.median(samples_ms):.4f} ms (median), the "
            f"judge's clock around the same calls {statistics.median(spans_ms):.4f} ms: call for call, {ratio:.2f} "
            f"of the judge's span less {WITNESS_HANDSHAKE_MS[device]:g} ms for the handshake, under "
            f"{WITNESS_FACTOR:g} (a clock lie, or a loaded host's wake-ups: logged, not refused)")

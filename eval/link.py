"""The judge's end of the runner: start it, ask it one thing at a time under a deadline, read its
answers without believing them, kill it. Every way a runner can misbehave becomes a `Failure`:

- it crashes (a segfault, a sticky CUDA error that kills it) or leaves (`os._exit`, a closed
  socket): runtime_error naming the signal or exit code — a result file it forged on the way out
  is overwritten, since the judge writes the result last;
- it does not answer before the phase's deadline: timeout, with the message the scheduler would
  have written, and its whole process group killed;
- it answers something malformed (not JSON, a field of the wrong type, a tensor whose bytes do not
  match its header): runtime_error, the runner "broke the protocol";
- candidate code raised: the status `failure.status_of` picks from the reported type and text.

Outputs are read into private CPU tensors (a copy, owned by the judge before anything looks at
it); an output that is not a plain tensor, or whose shape or dtype cannot stand for the
reference, is judged from its header without reading its bytes.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from .correctness import PROBE_ELEMENTS, Output, check_type
from .failure import Failure, one_line, status_of
from .probe import torch_global_state
from .protocol import (
    MAX_PARTS,
    Channel,
    Deadline,
    OutputArea,
    ProtocolError,
    RunnerGone,
    decode_tensor,
    tensor_meta,
)

T = TypeVar("T")
_MAX_LIST = 1_000_000
_MAX_TEXT = 4096


class Clock(Protocol):
    """What the link needs from the judge's phase tracker."""

    phase: str | None

    def deadline(self) -> tuple[float | None, str]:
        """(time.monotonic() deadline or None, the timeout message)."""
        ...


@dataclass(frozen=True)
class Received:
    """One output as the judge read it: a private tensor (on the CPU, or on the reference's device where
    it came through the output area) and the device the runner says it was on, or — `tensor` None — why
    it cannot stand for the reference."""

    tensor: torch.Tensor | tuple[torch.Tensor, ...] | None
    device: str
    problem: str | None


def part_label(i: int, names: list[str] | None) -> str:
    """How messages name part i of a tuple output: 'output 13 (state[3].c_kv)' where the part has a
    name (a stateful step's), else 'output 13'."""
    return f"output {i} ({names[i]})" if names is not None and i < len(names) else f"output {i}"


class Reply:
    """A runner's answer to one request: its header fields, checked as they are read."""

    def __init__(self, link: RunnerLink, header: dict[str, Any], what: str) -> None:
        self.link, self.header, self.what = link, header, what
        self.error: dict[str, Any] | None = None
        self.asked = link.asked  # the request it answers (its shared outputs are overwritten after it)
        self._probes_read = "probes" not in header  # its frame comes first (RunnerLink._header)

    def _bad(self, detail: str) -> Failure:
        self.link.close()
        return Failure("runtime_error", f"{self.what}: the runner broke the protocol: {detail}")

    def samples(self, key: str, at_least: int = 1) -> list[float]:
        v = self.header.get(key)
        if not (isinstance(v, list) and at_least <= len(v) <= _MAX_LIST
                and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v)):
            raise self._bad(f"{key!r} is not a list of at least {at_least} finite times ≥ 0")
        return [float(x) for x in v]

    def number(self, key: str) -> float:
        v = self.header.get(key)
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
            raise self._bad(f"{key!r} is not a finite number ≥ 0")
        return float(v)

    def cover(self) -> dict[str, float] | None:
        """How a covered timed loop went (timing.Cover's fields), or None where the loop was not
        covered."""
        v = self.header.get("cover")
        if v is None:
            return None
        keys = {"gpu_ms", "dispatch_ms", "sleep_ms", "uncovered", "floor_ms", "launch_ms", "loops"}
        if not (isinstance(v, dict) and set(v) == keys
                and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v.values())):
            raise self._bad(f"'cover' is not null or an object of finite numbers ≥ 0 with keys {sorted(keys)}")
        return {k: float(x) for k, x in v.items()}

    def text(self, key: str) -> str:
        v = self.header.get(key)
        if not isinstance(v, str) or len(v) > _MAX_TEXT:
            raise self._bad(f"{key!r} is not a short string")
        return v

    def flags(self, key: str) -> list[bool]:
        v = self.header.get(key)
        if not (isinstance(v, list) and len(v) <= _MAX_LIST and all(type(x) is bool for x in v)):
            raise self._bad(f"{key!r} is not a list of booleans")
        return v

    def strings(self, key: str) -> list[str]:
        v = self.header.get(key)
        if not (isinstance(v, list) and len(v) <= _MAX_LIST
                and all(isinstance(x, str) and len(x) <= _MAX_TEXT for x in v)):
            raise self._bad(f"{key!r} is not a list of short strings")
        return v

    def probes(self, n: int) -> torch.Tensor:
        """Per-call probed output elements (timing.py) from the reply's probe frame: a float64
        tensor (n calls, up to MAX_PARTS parts, PROBE_ELEMENTS), NaN where a part was not probed
        and past each part's own length (the judge's targets know the lengths)."""
        if self._probes_read:  # the judge's own bug, not the runner's: a grader error (not_graded)
            raise RuntimeError(f"{self.what}: the reply's probe frame was read twice")
        self._probes_read = True
        try:
            shape, dtype, _, nbytes = tensor_meta(self.header.get("probes"))
        except ProtocolError as exc:
            raise self._bad(f"'probes' does not describe a tensor: {exc}") from None
        if dtype != torch.float64 or len(shape) != 3 or shape[0] != n or shape[1] > MAX_PARTS \
                or shape[2] != PROBE_ELEMENTS:
            raise self._bad(f"'probes' is a {list(shape)} {str(dtype).removeprefix('torch.')} tensor, expected "
                            f"float64 [{n}, parts ≤ {MAX_PARTS}, {PROBE_ELEMENTS}]")
        self.link._pending.popleft()
        blob = self.link._talk(self.what, lambda d: self.link.chan.recv_blob(nbytes, d))
        return decode_tensor(blob, shape, dtype)

    def state(self, like: dict[str, Any]) -> dict[str, Any]:
        """Torch's global switches as reported, with exactly the keys of `like`."""
        v = self.header.get("state")
        if not (isinstance(v, dict) and set(v) == set(like)
                and all(isinstance(x, bool | int | float | str) and len(str(x)) <= 200 for x in v.values())):
            raise self._bad("'state' does not list torch's global switches")
        return v

    def outputs(self, refs: list[Output], names: list[str] | None = None) -> list[Received]:
        """The reply's outputs, one per reference, in order; `names` name a tuple's parts in messages
        (a stateful step's: 'hidden', 'state[0].S', …)."""
        if self.asked != self.link.asked:  # the judge's own bug: a grader error (not_graded)
            raise RuntimeError(f"{self.what}: the outputs read after the next request was sent")
        if not self._probes_read:  # the probe frame precedes the outputs' frames
            self._probes_read = True
            self.link._talk(self.what, lambda d: self.link.chan.skip_blob(self.link._pending.popleft(), d))
        entries = self.header.get("outputs")
        if not (isinstance(entries, list) and len(entries) == len(refs)):
            raise self._bad(f"'outputs' is not a list of {len(refs)} entries")
        return [self.link._read_output(self, entry, ref, names) for entry, ref in zip(entries, refs, strict=True)]


class RunnerLink:
    """The runner process (worker.start_runner) and the judge's socket to it. `close()` kills the
    runner's process group, whatever happened."""

    def __init__(self, proc: Any, sock: socket.socket, clock: Clock) -> None:
        self.proc, self.chan, self.clock = proc, Channel(sock), clock
        self._closed = False
        self._pending: deque[int] = deque()  # sizes of tensor frames announced but not read yet
        #: Where the runner lays its replies' output tensors (judge._share gives it one per shape), or None.
        self.outputs_area: OutputArea | None = None
        self.asked = 0  # requests sent: a reply's shared outputs are only there until the next one
        #: Output tensors read so far, by the way they came: through the output area or as socket frames.
        self.tensors_read = {"shared": 0, "framed": 0}

    def close(self) -> None:
        """Kill the runner's process group (it and everything it started) and reap it."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.chan.close()
        if self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # first: the runner's tree is found below it while it lives
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # no such group yet: it had not detached
            self.proc.join(timeout=10)

    def _gone(self) -> str:
        self.proc.join(timeout=5)
        code, phase = self.proc.exitcode, self.clock.phase
        self.close()
        if code is None:
            return f"the runner closed its connection (in phase '{phase}')"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return f"the runner died from {name} (in phase '{phase}')"
        return (f"the runner exited with code {code} (in phase '{phase}') without answering: "
                f"a hard exit in candidate code?")

    def _talk(self, what: str, fn: Callable[[float | None], T], gone_status: str = "runtime_error") -> T:
        deadline, late = self.clock.deadline()
        try:
            return fn(deadline)
        except Deadline:
            self.close()
            raise Failure("timeout", late) from None
        except RunnerGone:
            raise Failure(gone_status, self._gone()) from None
        except ProtocolError as exc:
            self.close()
            raise Failure("runtime_error", f"{what}: the runner broke the protocol: {exc}") from None

    def _header(self, what: str, deadline: float | None) -> dict[str, Any]:
        header = self.chan.recv_header(deadline)
        ok = header.get("ok")
        if ok is True:
            if "probes" in header:  # timing.py's probe frame, before the outputs' frames
                if not (isinstance(header["probes"], dict) and header["probes"].get("kind") == "tensor"):
                    raise ProtocolError("'probes' is not a tensor entry")
                self._announce(header["probes"])
            for entry in header.get("outputs") or []:
                parts = entry.get("parts") if isinstance(entry, dict) and entry.get("kind") == "tuple" else [entry]
                if not (isinstance(parts, list) and 0 < len(parts) <= MAX_PARTS):
                    raise ProtocolError("a tuple output entry without 1 to 8 parts")
                for part in parts:
                    self._announce(part)
            return header
        error = header.get("error")
        if ok is not False or not (isinstance(error, dict) and isinstance(error.get("type"), str)
                                   and isinstance(error.get("text"), str) and isinstance(error.get("oom"), bool)):
            raise ProtocolError("a reply that is neither ok nor a reported error")
        return header

    def _announce(self, entry: object) -> None:
        """Queue the frame size of one (non-tuple) output entry, or refuse the entry (a shared one
        must lie inside the output area the judge gave the runner)."""
        if isinstance(entry, dict) and entry.get("kind") == "tensor":
            self._pending.append(tensor_meta(entry)[3])
        elif isinstance(entry, dict) and entry.get("kind") == "shared":
            nbytes = tensor_meta(entry)[3]
            if self.outputs_area is None or not self.outputs_area.holds(entry.get("at"), nbytes):
                raise ProtocolError(f"a shared output of {nbytes} bytes at {str(entry.get('at'))[:40]!r}, outside "
                                    "the output area")
        elif not (isinstance(entry, dict) and entry.get("kind") == "other"
                  and isinstance(entry.get("type"), str) and len(entry["type"]) <= _MAX_TEXT):
            raise ProtocolError("an output entry that is neither a tensor nor a described other value")

    def ready(self) -> dict[str, Any]:
        """Wait for the runner's hello; returns torch's global switches as they were before any
        candidate code ran. A runner that cannot start is the grader's problem: not_graded."""
        header = self._talk("starting the runner", lambda d: self._header("starting the runner", d), "not_graded")
        reply = Reply(self, header, "starting the runner")
        if header["ok"] is not True:
            err = header["error"]
            raise Failure("not_graded", f"the runner could not start: {one_line(err['type'], err['text'])}")
        return reply.state(torch_global_state())

    def ask(self, op: str, what: str, *, fds: tuple[int, ...] = (), importing: bool = False,
            keep_error: bool = False, **fields: Any) -> Reply:
        """Send one request and read the header of its reply. A reported error raises a Failure
        (`what: Type: text`) unless `keep_error`, which leaves it in `Reply.error`."""
        def exchange(deadline: float | None) -> dict[str, Any]:
            while self._pending:  # tensor frames of an earlier reply that nobody read
                self.chan.skip_blob(self._pending.popleft(), deadline)
            self.asked += 1
            self.chan.send_request({"op": op, **fields}, fds, deadline)
            return self._header(what, deadline)

        reply = Reply(self, self._talk(what, exchange), what)
        if reply.header["ok"] is not True:
            err = reply.header["error"]
            if not keep_error:
                raise Failure(status_of(err, importing), f"{what}: {one_line(err['type'], err['text'])}",
                              detail=err["text"])
            reply.error = err
        return reply

    def _read_output(self, reply: Reply, entry: dict[str, Any], ref: Output,
                     names: list[str] | None = None) -> Received:
        if isinstance(ref, tuple):
            return self._read_tuple(reply, entry, ref, names)
        if entry["kind"] == "tuple":
            self._skip(reply, entry["parts"])
            return Received(None, "", f"output must be a plain torch.Tensor, got a tuple of {len(entry['parts'])}")
        if entry["kind"] == "other":
            return Received(None, "", f"output must be a plain torch.Tensor, got {entry['type']}")
        shape, dtype, device, nbytes = tensor_meta(entry)
        framed = entry["kind"] == "tensor"
        if framed:
            self._pending.popleft()
        if shape != tuple(ref.shape) or dtype != ref.dtype:
            if framed:
                self._talk(reply.what, lambda d: self.chan.skip_blob(nbytes, d))
            return Received(None, device, check_type(ref, torch.empty(shape, dtype=dtype, device="meta")))
        self.tensors_read["framed" if framed else "shared"] += 1
        if not framed:  # checked by _announce; copied out now, while the runner waits for the next request
            assert self.outputs_area is not None
            return Received(self.outputs_area.read(entry["at"], shape, dtype, nbytes, ref.device), device, None)
        blob = self._talk(reply.what, lambda d: self.chan.recv_blob(nbytes, d))
        return Received(decode_tensor(blob, shape, dtype), device, None)

    def _read_tuple(self, reply: Reply, entry: dict[str, Any], ref: tuple[torch.Tensor, ...],
                    names: list[str] | None = None) -> Received:
        """A tuple output: as many parts as the reference's, each read like a single output."""
        parts = entry["parts"] if entry["kind"] == "tuple" else [entry]
        if entry["kind"] != "tuple" or len(parts) != len(ref):
            self._skip(reply, parts)
            got = f"a tuple of {len(parts)}" if entry["kind"] == "tuple" else entry.get("type", "a tensor")
            return Received(None, "", f"output must be a tuple of {len(ref)} tensors, got {got}")
        received = [self._read_output(reply, part, r) for part, r in zip(parts, ref, strict=True)]
        for i, part in enumerate(received):
            if part.tensor is None:
                return Received(None, part.device, f"{part_label(i, names)}: {part.problem}")
        devices = {part.device for part in received}
        if len(devices) > 1:
            return Received(None, "", f"the outputs are on different devices: {', '.join(sorted(devices))}")
        return Received(tuple(p.tensor for p in received), received[0].device, None)  # type: ignore[misc]

    def _skip(self, reply: Reply, parts: list[dict[str, Any]]) -> None:
        """Read past the frames of output parts nobody will look at."""
        for part in parts:
            if part["kind"] == "tensor":
                nbytes = self._pending.popleft()
                self._talk(reply.what, lambda d, n=nbytes: self.chan.skip_blob(n, d))

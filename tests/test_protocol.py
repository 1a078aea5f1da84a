"""The judge–runner wire (protocol.py), the judge's reading of it (link.py) and its deadlines
(phases.py), on the CPU. The test plays a misbehaving runner on the far end of a socket pair;
each test is named after what the judge must not be fooled by."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from grading import judge_out_of_memory

from kernelboard.eval import runner
from kernelboard.eval.failure import Failure
from kernelboard.eval.link import RunnerLink
from kernelboard.eval.phases import DEADLINE_MARGIN_S, Phases
from kernelboard.eval.protocol import (
    Arena,
    Channel,
    OutputArea,
    OutputSlots,
    TensorRef,
    decode_tensor,
    encode_output,
    map_arena,
    slots_bytes,
    tensor_meta,
)

BUDGET_MESSAGE = "phase 'correctness' ran past its 9 s budget"


class _Clock:
    phase = "correctness"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def deadline(self) -> tuple[float, str]:
        return time.monotonic() + self.seconds, BUDGET_MESSAGE


class _Exited:
    """Stands for a runner process that has already exited with `exitcode`."""

    pid = None

    def __init__(self, exitcode: int) -> None:
        self.exitcode = exitcode

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


@pytest.fixture
def pair() -> Iterator[Callable[..., tuple[RunnerLink, socket.socket]]]:
    """Makes (the judge's link, the runner's end of its socket); closes both afterwards."""
    made: list[tuple[RunnerLink, socket.socket]] = []

    def make(exitcode: int = 0, seconds: float = 5.0) -> tuple[RunnerLink, socket.socket]:
        judge_end, runner_end = socket.socketpair()
        made.append((RunnerLink(_Exited(exitcode), judge_end, _Clock(seconds)), runner_end))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for link, runner_end in made:
        link.close()
        runner_end.close()


def _frame(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# ------------------------------------------------------------------------------ shared inputs


def test_inputs_are_shared_copies_and_a_reused_tensor_is_stored_once() -> None:
    x = torch.arange(6, dtype=torch.float32)
    arena = Arena({"checks": [[x, 3], [x]]})
    first, second = arena.encoded["checks"][0][0], arena.encoded["checks"][1][0]
    assert isinstance(first, TensorRef) and first == second and arena.encoded["checks"][0][1] == 3
    theirs = map_arena(os.dup(arena.fd), arena.size)  # what the runner maps
    arena.close_fd()
    runner_view = theirs[first.offset:first.offset + first.nbytes].view(torch.float32)
    runner_view[0] = 100.0
    assert arena.view(first)[0] == 100.0  # the judge sees the runner's write
    assert x[0] == 0.0  # its own tensor is untouched


def test_a_strided_input_reaches_the_call_with_its_strides() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    arena = Arena([x])
    ref = arena.encoded[0]
    live, back = runner._place(runner._Shared(arena.view(ref), ref.stride), "cpu")
    assert back is not None and live.stride() == x.stride() and torch.equal(live, x)
    arena.close_fd()
    contiguous = Arena([torch.ones(3)])
    contiguous.close_fd()
    ref = contiguous.encoded[0]
    same, none = runner._place(runner._Shared(contiguous.view(ref), ref.stride), "cpu")
    assert none is None and same.data_ptr() == contiguous.view(ref).data_ptr()  # shared, not copied


# ------------------------------------------------------------------------------ outputs


def test_outputs_travel_as_bytes_and_arrive_as_private_tensors() -> None:
    out = torch.randn(3, 5).to(torch.bfloat16)
    meta, (blob,) = encode_output(out)
    shape, dtype, device, nbytes = tensor_meta(meta)
    assert (shape, dtype, device, nbytes) == ((3, 5), torch.bfloat16, "cpu", 30)
    assert torch.equal(decode_tensor(bytearray(blob), shape, dtype), out)


def test_a_non_tensor_or_a_subclass_is_described_not_sent() -> None:
    class Lazy(torch.Tensor):
        pass

    assert encode_output(1.0) == ({"kind": "other", "type": "builtins.float"}, [])
    meta, blobs = encode_output(torch.zeros(2).as_subclass(Lazy))
    assert meta["kind"] == "other" and "Lazy" in meta["type"] and blobs == []
    meta, blobs = encode_output([torch.zeros(2), 1.0])  # a tuple's parts are described one by one
    assert [p["kind"] for p in meta["parts"]] == ["tensor", "other"] and len(blobs) == 1


# ------------------------------------------------------------------------------ the judge's reading


def test_garbage_is_a_protocol_failure(pair) -> None:
    link, theirs = pair()
    theirs.sendall(_frame(b"not json"))
    with pytest.raises(Failure) as info:
        link.ask("call", "shape 0 check 0")
    assert info.value.status == "runtime_error" and "broke the protocol" in info.value.message


@pytest.mark.parametrize("payload", [b'{"ok": true, "samples_ms": [NaN, 1.0]}', b"[1, 2]", b'{"ok": "yes"}'])
def test_non_finite_numbers_and_odd_headers_are_refused(pair, payload: bytes) -> None:
    link, theirs = pair()
    theirs.sendall(_frame(payload))
    with pytest.raises(Failure, match="broke the protocol"):
        link.ask("time", "shape 0: timing")


def test_an_oversized_header_is_refused_before_it_is_read(pair) -> None:
    link, theirs = pair()
    theirs.sendall(struct.pack("<Q", 1 << 40))
    with pytest.raises(Failure, match="a reply header of 1099511627776 bytes"):
        link.ask("call", "shape 0 check 0")


def test_samples_that_are_not_times_are_refused(pair) -> None:
    link, theirs = pair()
    Channel(theirs).send_reply({"ok": True, "samples_ms": [1.0, "fast"], "wall_ms": 1.0}, [])
    reply = link.ask("time", "shape 0: timing")
    with pytest.raises(Failure, match="'samples_ms' is not a list"):
        reply.samples("samples_ms", at_least=2)


def test_silence_is_a_timeout_with_the_parents_message(pair) -> None:
    link, _theirs = pair(seconds=0.2)
    start = time.monotonic()
    with pytest.raises(Failure) as info:
        link.ask("call", "shape 0 check 0")
    assert (info.value.status, info.value.message) == ("timeout", BUDGET_MESSAGE)
    assert time.monotonic() - start < 2


def test_a_dead_runner_is_named_by_its_signal(pair) -> None:
    link, theirs = pair(exitcode=-11)
    theirs.close()
    with pytest.raises(Failure) as info:
        link.ask("import", "importing solution.py", importing=True)
    assert info.value.status == "runtime_error" and "died from SIGSEGV (in phase 'correctness')" in info.value.message


def test_a_hard_exit_is_named_by_its_code(pair) -> None:
    link, theirs = pair(exitcode=0)
    theirs.close()
    with pytest.raises(Failure, match="exited with code 0"):
        link.ask("import", "importing solution.py", importing=True)


def test_tensor_bytes_must_be_what_the_header_announced(pair) -> None:
    link, theirs = pair()
    meta = {"kind": "tensor", "shape": [2], "dtype": "float32", "device": "cpu", "nbytes": 8}
    theirs.sendall(_frame(b'{"ok": true, "state": {}, "outputs": [' + str(meta).replace("'", '"').encode() + b"]}")
                   + _frame(b"1234"))
    reply = link.ask("call", "shape 0 check 0")
    with pytest.raises(Failure, match="a tensor frame of 4 bytes where its header announced 8"):
        reply.outputs([torch.zeros(2)])


def test_a_header_whose_size_does_not_fit_its_shape_is_refused(pair) -> None:
    link, theirs = pair()
    Channel(theirs).send_reply({"ok": True, "outputs": [
        {"kind": "tensor", "shape": [1 << 40], "dtype": "float32", "device": "cpu", "nbytes": 4}]}, [])
    with pytest.raises(Failure, match="shape and dtype make"):
        link.ask("call", "shape 0 check 0")


def test_a_wrong_dtype_is_judged_from_the_header_and_the_next_reply_still_reads(pair) -> None:
    link, theirs = pair()
    chan = Channel(theirs)
    meta, blobs = encode_output(torch.ones(4, dtype=torch.float32))
    chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
    got = link.ask("call", "check 0").outputs([torch.ones(4, dtype=torch.bfloat16)])[0]
    assert got.tensor is None and "output dtype float32 != expected bfloat16" in (got.problem or "")
    chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
    chan.send_reply({"ok": True, "l2": "reset"}, [])
    link.ask("call", "check 1")  # its tensor frame is never read: the next request drains it
    assert link.ask("gpu_setup", "resetting persisting L2").text("l2") == "reset"


def test_tuple_outputs_are_read_part_by_part_and_a_mismatch_is_judged_not_fatal(pair) -> None:
    link, theirs = pair()
    chan = Channel(theirs)
    values, indices = torch.tensor([3.0, 2.0]), torch.tensor([7, 1])
    ref = (values, indices)
    for out in ((values, indices), [values, indices]):
        meta, blobs = encode_output(out)
        chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
        got = link.ask("call", "a pair").outputs([ref])[0]
        assert isinstance(got.tensor, tuple) and all(torch.equal(a, b) for a, b in zip(got.tensor, ref, strict=True))
    wrong = [(values,), values, (values, indices.int()), (values, indices, indices)]
    expected = ["tuple of 2 tensors, got a tuple of 1", "tuple of 2 tensors, got a tensor",
                "output 1: output dtype int32 != expected int64", "tuple of 2 tensors, got a tuple of 3"]
    for out, why in zip(wrong, expected, strict=True):
        meta, blobs = encode_output(out)
        chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
        got = link.ask("call", "a bad pair").outputs([ref])[0]
        assert got.tensor is None and why in (got.problem or ""), got.problem
    meta, blobs = encode_output((values, indices))  # a tuple where one tensor is expected
    chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
    got = link.ask("call", "one tensor").outputs([values])[0]
    assert got.tensor is None and "plain torch.Tensor, got a tuple of 2" in (got.problem or "")
    chan.send_reply({"ok": True, "l2": "reset"}, [])  # every frame above was read or skipped
    assert link.ask("gpu_setup", "resetting persisting L2").text("l2") == "reset"


def test_outputs_laid_in_the_output_area_arrive_as_private_copies_and_one_that_does_not_fit_comes_as_a_frame(
        pair) -> None:
    """06's headline outputs (0.8 GB each) crossed the socket at about 1 GB/s: the runner now lays a
    reply's output tensors in shared memory the judge gave it, where they fit, and the judge copies
    each out before judging it (the runner may write there again at any time)."""
    link, theirs = pair()
    chan = Channel(theirs)
    strided, small = torch.arange(40, dtype=torch.float32).reshape(5, 8).t(), torch.arange(3)
    link.outputs_area = area = OutputArea(slots_bytes([strided]))  # room for the first part only
    runner_view = map_arena(os.dup(area.fd), area.size)
    meta, blobs = encode_output((strided, small), OutputSlots(runner_view))
    assert [part["kind"] for part in meta["parts"]] == ["shared", "tensor"] and len(blobs) == 1
    chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
    got = link.ask("call", "a pair").outputs([(strided.contiguous(), small)])[0]
    runner_view.fill_(0)  # written over after the judge read it: the judge's copy stays
    assert isinstance(got.tensor, tuple) and got.device == "cpu"
    assert torch.equal(got.tensor[0], strided) and torch.equal(got.tensor[1], small)
    meta, blobs = encode_output(torch.ones(3, dtype=torch.float64), OutputSlots(runner_view))
    chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
    got = link.ask("call", "a wrong dtype").outputs([torch.ones(3)])[0]  # judged from the entry, nothing to skip
    assert got.tensor is None and "output dtype float64 != expected float32" in (got.problem or "")
    chan.send_reply({"ok": True, "l2": "reset"}, [])  # every frame above was read
    assert link.ask("gpu_setup", "resetting persisting L2").text("l2") == "reset"


@pytest.mark.parametrize("at", [256, 64 * 10**6, -64, 3, "0", None, 2.0**70])
def test_a_shared_output_outside_the_output_area_breaks_the_protocol(pair, at: object) -> None:
    link, theirs = pair()
    link.outputs_area = OutputArea(256)
    entry = {"kind": "shared", "at": at, "shape": [4], "dtype": "float32", "device": "cpu", "nbytes": 16}
    Channel(theirs).send_reply({"ok": True, "outputs": [entry]}, [])
    with pytest.raises(Failure, match=r"broke the protocol: a shared output of 16 bytes .* outside the output area"):
        link.ask("call", "check 0")


def test_a_shared_output_without_an_output_area_breaks_the_protocol(pair) -> None:
    link, theirs = pair()
    entry = {"kind": "shared", "at": 0, "shape": [4], "dtype": "float32", "device": "cpu", "nbytes": 16}
    Channel(theirs).send_reply({"ok": True, "outputs": [entry]}, [])
    with pytest.raises(Failure, match="outside the output area"):
        link.ask("call", "check 0")


def test_the_shared_memory_the_runner_maps_cannot_be_resized_under_the_judge() -> None:
    """The runner gets the descriptors of the input arena and the output area: shrunk, the judge's next
    read past the new end would kill it with SIGBUS. Both are sealed at their size."""
    for fd in (Arena({"x": torch.ones(4)}).fd, OutputArea(64).fd):
        for size in (0, 1 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        os.close(fd)


def test_a_replys_outputs_are_not_read_once_the_next_request_is_sent(pair) -> None:
    """A reply's shared outputs are the runner's to overwrite from its next request on."""
    link, theirs = pair()
    chan = Channel(theirs)
    meta, blobs = encode_output(torch.ones(2))
    chan.send_reply({"ok": True, "outputs": [meta]}, blobs)
    first = link.ask("call", "check 0")
    chan.send_reply({"ok": True, "l2": "reset"}, [])
    link.ask("gpu_setup", "resetting persisting L2")
    with pytest.raises(RuntimeError, match="read after the next request was sent"):
        first.outputs([torch.ones(2)])


def test_a_reported_error_becomes_its_status(pair) -> None:
    link, theirs = pair()
    Channel(theirs).send_reply({"ok": False, "error": {"type": "OutOfMemoryError", "text": "CUDA out of memory.\n…",
                                                       "oom": True}}, [])
    with pytest.raises(Failure) as info:
        link.ask("call", "shape 1 check 3")
    assert (info.value.status, info.value.message) == ("oom", "shape 1 check 3: OutOfMemoryError: CUDA out of memory.")


def test_file_descriptors_sent_to_the_judge_are_dropped(pair) -> None:
    link, theirs = pair()
    payload = b'{"ok": true, "l2": "x"}'
    before = _fd_count()
    with tempfile.TemporaryFile() as fh:
        socket.send_fds(theirs, [struct.pack("<Q", len(payload))], [fh.fileno()])
        theirs.sendall(payload)
        assert link.ask("gpu_setup", "resetting persisting L2").text("l2") == "x"
    assert _fd_count() == before


# ------------------------------------------------------------------------------ deadlines


def test_the_judge_keeps_the_parents_budgets_one_margin_early() -> None:
    phases = Phases({}, budgets={"build": 10.0}, timeout_s=30.0, started_unix=time.time())
    phases.enter("reference")
    at, message = phases.deadline()
    assert message == "killed after 30 s (in phase 'reference')"
    assert at == pytest.approx(time.monotonic() + 30.0 - DEADLINE_MARGIN_S, abs=0.5)
    phases.enter("build")
    at, message = phases.deadline()
    assert message == "phase 'build' ran past its 10 s budget"
    assert at == pytest.approx(time.monotonic() + 10.0 - DEADLINE_MARGIN_S, abs=0.5)
    assert Phases({}).deadline() == (None, "")


def test_the_plan_holds_one_copy_of_each_check_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge's record of a check's inputs is the drawn tensors themselves, not a second copy
    (06's headline shape: 16 input sets of 2.1 GB); the runner gets the arena's copy."""
    import sys
    from pathlib import Path

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file, make_plan

    monkeypatch.setitem(sys.modules, "reference", None)  # restored after: import_file registers its own
    problem = load_problem(Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "06_sonic_moe_swiglu")
    reference = import_file("reference", problem.reference_path)
    plan = make_plan(problem, reference, problem.shapes_for("cpu")[:1], [42, 7], (1, 2), "cpu")[0]
    assert len(plan.checks) > 4
    for check in plan.checks:
        assert all(a is b for a, b in zip(check.inputs, check.pristine, strict=True)), check.label
    arena = Arena({"checks": [c.inputs for c in plan.checks]})
    ref = arena.encoded["checks"][0][0]
    arena.view(ref).view(torch.bfloat16).zero_()  # the runner scribbles over its copy
    assert plan.checks[0].pristine[0].abs().sum() > 0  # the judge's record is untouched


@pytest.mark.parametrize(("max_bytes", "rounds"), [(1, 2), (1 << 40, 5)])
def test_floor_batches_past_two_stop_once_their_inputs_hold_the_byte_budget(
        monkeypatch: pytest.MonkeyPatch, max_bytes: int, rounds: int) -> None:
    """Every floor-batch input set is copied to the runner and onto its device: past two batches,
    a shape whose sets already hold PROOF_MAX_BYTES gets no more (06's headline: 2.1 GB a set)."""
    import sys
    from pathlib import Path

    from kernelboard.eval import plan as plan_module
    from kernelboard.eval.deck import load_problem

    monkeypatch.setitem(sys.modules, "reference", None)
    monkeypatch.setattr(plan_module, "PROOF_MAX_BYTES", max_bytes)
    monkeypatch.setattr(plan_module, "PROOF_REF_BUDGET_S", 1e9)  # only the bytes stop the rounds
    monkeypatch.setattr(plan_module, "PROOF_MAX_SETS", 2)
    problem = load_problem(Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "06_sonic_moe_swiglu")
    reference = plan_module.import_file("reference", problem.reference_path)
    plan = plan_module.make_plan(problem, reference, problem.shapes_for("cpu")[:1], [42], (1, 2), "cpu",
                                 proof_seed=5)[0]
    assert len(plan.proof_sets) == rounds
    assert all(len(batch) == 2 for batch in plan.proof_sets)


def test_a_seeds_stress_cases_share_its_drawn_inputs_and_are_judged_on_them_scaled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A numeric stress case's inputs are its seed's nominal tensors (the runner scales its own copy),
    so the arena holds each seed's draw once: 06's headline shape shared 8 scaled copies of 2.1 GB."""
    import sys
    from pathlib import Path

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file, make_plan

    monkeypatch.setitem(sys.modules, "reference", None)
    problem = load_problem(Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "06_sonic_moe_swiglu")
    reference = import_file("reference", problem.reference_path)
    plan = make_plan(problem, reference, problem.shapes_for("cpu")[:1], [42, 7], (1, 2), "cpu")[0]
    cases = 1 + len(problem.numeric_stress)
    numeric, structural = plan.checks[:2 * cases], plan.checks[2 * cases:]
    for seed in range(2):
        group = numeric[seed * cases:(seed + 1) * cases]
        assert all(c.inputs[0] is group[0].inputs[0] for c in group)  # one draw per seed
        for check in group[1:]:
            factor = check.stress.scale[0]
            assert torch.equal(check.called_with()[0], (group[0].pristine[0].float() * factor).to(torch.bfloat16))
    hidden = plan.checks[0].inputs[0]
    arena = Arena({"checks": [c.inputs for c in plan.checks]})
    distinct_hidden = 2 + len(structural)  # each seed's draw, and each structural case's rewrite
    assert arena.size < (distinct_hidden + 1) * hidden.numel() * hidden.element_size()


def _send_timed(sock: socket.socket, probes: list[list[torch.Tensor | None]], out: torch.Tensor) -> int:
    """A runner's timing reply as runner._op_time sends it, from a thread (its frames outgrow the
    socket's buffer); returns its header's size in bytes."""
    meta, blobs = encode_output(runner._finish(probes))
    out_meta, out_blobs = encode_output(out)
    header = {"ok": True, "samples_ms": [1.0] * len(probes), "wall_ms": 1.0, "probes": meta, "outputs": [out_meta]}
    threading.Thread(target=Channel(sock).send_reply, args=(header, [*blobs, *out_blobs]), daemon=True).start()
    return len(str(header))


def test_a_mega_steps_probes_travel_beside_a_small_header(pair) -> None:
    """On the H200 a Mega step's 15 output parts × 32 probed elements over a timed loop's calls made
    a 5.2 MB JSON header: the grading was a runtime_error of the grader's own. Probes now travel as
    one float64 frame; parts shorter than PROBE_ELEMENTS and unprobed parts come back as NaN."""
    from kernelboard.eval.correctness import PROBE_ELEMENTS

    calls, parts = 2000, 15
    link, theirs = pair()
    gen = torch.Generator().manual_seed(0)
    probes = [[torch.randn(PROBE_ELEMENTS if k else 5, dtype=torch.float64, generator=gen) if (i, k) != (7, 3) else None
               for k in range(parts)] for i in range(calls)]
    size = _send_timed(theirs, probes, torch.arange(4.0))
    assert size < 16 << 10  # its samples; the JSON probes were 15 × 32 numbers a call: 2000 calls, over 4 MB
    reply = link.ask("time", "shape 0: timing")
    got = reply.probes(calls)
    assert got.shape == (calls, parts, PROBE_ELEMENTS)
    assert torch.equal(got[1, 2], probes[1][2]) and torch.equal(got[9, 0, :5], probes[9][0])
    assert got[9, 0, 5:].isnan().all() and got[7, 3].isnan().all()
    (out,) = reply.outputs([torch.zeros(4)])
    assert torch.equal(out.tensor, torch.arange(4.0))  # the outputs' frames follow the probes'


def test_outputs_read_before_the_probes_skip_the_probe_frame(pair) -> None:
    link, theirs = pair()
    _send_timed(theirs, [[torch.ones(3, dtype=torch.float64)]] * 2, torch.arange(3.0))
    reply = link.ask("time", "shape 0: timing")
    (out,) = reply.outputs([torch.zeros(3)])
    assert torch.equal(out.tensor, torch.arange(3.0))
    with pytest.raises(RuntimeError, match="read twice"):  # the judge's bug: not_graded, never the runner's fault
        reply.probes(2)


def _probe_meta(shape: list[int], dtype: str = "float64", nbytes: int | None = None) -> dict[str, object]:
    size = 8 if dtype == "float64" else 4
    return {"kind": "tensor", "shape": shape, "dtype": dtype, "device": "cpu",
            "nbytes": size * shape[0] * shape[1] * shape[2] if nbytes is None else nbytes}


@pytest.mark.parametrize(("probes", "why"), [
    ([[1.0, 2.0]], "'probes' is not a tensor entry"),  # the JSON probes of grader 0.4.5
    (_probe_meta([2, 1, 32], "float32"), r"'probes' is a \[2, 1, 32\] float32"),
    (_probe_meta([3, 1, 32]), r"'probes' is a \[3, 1, 32\] float64"),
    (_probe_meta([2, 1, 32], nbytes=8), "an output of 8 bytes"),
])
def test_a_probe_frame_that_is_not_what_the_judge_asked_for_is_refused(pair, probes: object, why: str) -> None:
    link, theirs = pair()
    blob = b"\0" * (probes["nbytes"] if isinstance(probes, dict) else 0)
    Channel(theirs).send_reply({"ok": True, "samples_ms": [1.0, 1.0], "wall_ms": 1.0, "probes": probes},
                               [memoryview(blob)] if blob else [])
    with pytest.raises(Failure, match=f"broke the protocol: {why}"):
        link.ask("time", "shape 0: timing").probes(2)


def test_the_judge_lets_go_of_its_sets_before_the_runner_places_them_and_refuses_a_demand_over_the_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """06's headline shape on an 80 GB H100 (2026-12-06): the judge still held its 15 GB of timing and
    floor-batch sets when the runner placed its own copies, and every grading, the house reference's
    included, ran out of memory and was labelled `oom`, the candidate's failure. The judge now drops its
    copies (and the checks' inputs, kept on the host) before the runner is asked, and where the
    grader's own demand cannot fit the GPU, the shape is not_graded in the judge's words, never `oom`."""
    import sys
    from pathlib import Path

    from kernelboard.eval import gpu_witness, judge
    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file, make_plan

    monkeypatch.setitem(sys.modules, "reference", None)
    problem = load_problem(Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "06_sonic_moe_swiglu")
    reference = import_file("reference", problem.reference_path)
    gb = 10**9
    asked: list[tuple[int, int, int]] = []

    class Link:
        def ask(self, op: str, what: str, **request: object) -> None:
            asked.append((len(plan.timing_sets), len(plan.proof_sets), sum(len(c.inputs) for c in plan.checks)))

    free = {"bytes": 78 * gb}
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free["bytes"], 79 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 22 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 19 * gb)
    logged: list[str] = []
    monkeypatch.setattr(judge, "log", lambda tag, message: logged.append(message))
    plan = make_plan(problem, reference, problem.shapes_for("cpu")[:1], [42], (1, 2), "cpu", proof_seed=5)[0]
    assert plan.timing_sets and plan.proof_sets
    arena, shared = judge._share(Link(), plan, 0, 42, False, "cuda", problem)  # type: ignore[arg-type]
    arena.unpin()
    assert asked == [(0, 0, 0)]  # nothing of the judge's sets is held while the runner places its own
    # but the GPU witness's pool, where the sets are small (this CPU shape's are); 06's headline's are not
    assert plan.witness_sets == []  # the GPU witness is off unless asked for (KERNELBOARD_GPU_WITNESS=1)
    assert gpu_witness.skip_reason(problem, "cuda", 15 * gb) == (
        "its timing sets are 15.00 GB, over the 1.07 GB the judge keeps for it")
    assert plan.state_dict == {}  # nor the Model's state, which the runner's Model holds
    assert len(shared) == len(plan.checks) and all(check.pristine for check in plan.checks)
    assert any("the judge holds 22.00 GB of the GPU (19.00 GB of it in tensors)" in line for line in logged)

    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 65 * gb)  # the judge's share before the fix
    with pytest.raises(Failure) as refused:
        judge._fits_beside_judge(plan, 18 * gb)
    assert refused.value.status == "not_graded"
    assert refused.value.message.startswith("shape 0: the grader's own use of the GPU does not fit its 79.0 GB: "
                                            "the judge holds 65.0 GB and the runner would place 18.0 GB")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 22 * gb)
    judge._fits_beside_judge(plan, 18 * gb)  # 06's headline as the judge now holds it: fits


@pytest.mark.parametrize(("judge_gb", "status"), [(15, "oom"), (20, "not_graded")])
def test_an_out_of_memory_error_is_the_candidates_only_where_it_had_half_the_gpu(
        monkeypatch: pytest.MonkeyPatch, judge_gb: int, status: str) -> None:
    """The house 06 kernel was `oom` on an 80 GB H100 with 26.7 GB of its own in use, beside a judge
    that held 42.4 GB (2026-12-06): the grader's own share, not the kernel, left it short. A runner's
    OOM is now weighed against what the judge holds (measured by the judge, after letting go of its
    cache) and what the runner was given to place: every shape's kept state and timing sets, the
    current shape's floor batches, not the earlier shapes' (the runner drops them)."""
    from kernelboard.eval import judge
    from kernelboard.eval.plan import ShapePlan
    from kernelboard.eval.problem import Shape

    gb = 10**9
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3 * gb, 79 * gb))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: judge_gb * gb)
    shape = Shape(0, "headline", {})
    plans = [ShapePlan(shape, [], {}, kept_bytes=10 * gb, proof_bytes=9 * gb),
             ShapePlan(shape, [], {}, kept_bytes=5 * gb, proof_bytes=3 * gb)]
    said = "shape 1 check 3: OutOfMemoryError: CUDA out of memory."
    verdict = judge._oom_verdict(Failure("oom", said, detail="the whole text"), plans)
    assert verdict.status == status and verdict.detail == "the whole text"
    left = 79 - judge_gb - 18 - 2 * 2**30 / gb  # 10 + 5 kept, the last shape's 3 of floor batches
    share = (f"{left:.1f} of the GPU's 79.0 GB were the candidate's (the grader's own: the judge {judge_gb:.1f} GB, "
             "placed in the runner 18.0 GB, CUDA contexts 2.1 GB)")
    if status == "oom":
        assert verdict.message == f"{said} [{share}]"
    else:
        assert verdict.message == f"the grader's own use of the GPU left the candidate under 50% of it: {share}; {said}"


def test_a_shape_released_lets_go_of_its_checks_and_floor_batches_and_keeps_its_timing_sets() -> None:
    """06's wide shape: the judge ran out of the H100's memory drawing it beside a runner of 38.5 GB,
    whose allocator still held the floor batches of the shapes before (2026-12-06). Once a shape is
    checked and timed the judge asks the runner to let them go; the timing sets stay, for the CUDA-graph
    replay at the end, and so does the candidate's Model."""
    import types
    import weakref

    model = torch.nn.Identity()
    check, timing, floor = torch.ones(4), torch.ones(4), torch.ones(4)
    shape = runner._Shape(model, [[check]], [[timing]], [], [[[floor]]], [[]])
    host = types.SimpleNamespace(loaded={0: shape}, device="cpu")
    gone = [weakref.ref(check), weakref.ref(floor)]
    del check, floor
    assert runner._Runner._op_release(host, {"op": "release", "shape": 0}, []) == ({}, [])  # type: ignore[arg-type]
    assert [ref() for ref in gone] == [None, None]
    assert shape.timing[0][0] is timing and shape.model is model


def test_the_judges_own_out_of_memory_error_within_its_share_is_not_graded(monkeypatch: pytest.MonkeyPatch) -> None:
    """LongCat-2.0 06 082519 (2026-12-06): the judge ran out drawing the wide shape, holding about 40 GB, beside
    a runner of 38.5 GB whose allocator still cached the grader's floor batches of the shapes before. The
    candidate's own use was within the half of the GPU a kernel is promised: the grader's fault, no verdict
    (and `--resume` grades it again)."""
    verdict = judge_out_of_memory(monkeypatch, free_gb=1.0, judge_gb=40.0, placed_gb=12.0,
                                  where="shape 2 (wide intermediate)",
                                  error="CUDA out of memory. Tried to allocate 1024.00 MiB.\nthe rest of torch's text")
    assert verdict.status == "not_graded"
    assert verdict.message.startswith("shape 2 (wide intermediate): the judge ran out of GPU memory while the "
                                      "candidate held 29.9 of the GPU's 85.0 GB (the grader's own: the judge 40.0 GB, "
                                      "placed in the runner 12.0 GB, CUDA contexts 2.1 GB; 1.0 GB free), within the "
                                      "50% a kernel is promised")
    assert verdict.message.endswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB.")
    assert "the rest of torch's text" in verdict.detail

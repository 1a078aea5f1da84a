"""The GPU witness's CPU-side parts (eval/gpu_witness.py): the shared block's layout, the figure and its rule,
and when a shape is witnessed. The loops themselves need a GPU: tests/test_eval_gpu.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from kernelboard.eval import gpu_witness
from kernelboard.eval.deck import load_problem
from kernelboard.eval.gpu_witness import FLAG_BYTES, SLOT_ALIGN, Layout, Slot, extent_bytes, figures, plan_layout
from kernelboard.eval.settings import WITNESS_GPU_FACTOR, WITNESS_GPU_SWITCH_CAP_MS

DECKS = Path(__file__).resolve().parents[1] / "eval" / "decks"


def test_the_layout_gives_each_tensor_an_aligned_slot_of_its_own_with_its_strides() -> None:
    x = torch.randn(6, 4, dtype=torch.bfloat16).t()  # a transposed input keeps its strides
    idx = torch.arange(7, dtype=torch.int32)
    layout = plan_layout([x, 3, idx], [torch.empty(4, 6), torch.empty(5, dtype=torch.int64)])
    a, n, b = layout.inputs
    assert n is None  # not a tensor: the runner passes its own
    assert (a.offset, a.shape, a.stride, a.dtype) == (FLAG_BYTES, (4, 6), (1, 4), "bfloat16")
    assert a.nbytes == extent_bytes((4, 6), (1, 4), 2) == 48
    assert b.offset == FLAG_BYTES + SLOT_ALIGN and b.dtype == "int32"
    out0, out1 = layout.outputs
    assert out0.stride == (6, 1) and out1.stride == (1,)  # outputs are contiguous
    slots = [a, b, out0, out1]
    assert all(s.offset % SLOT_ALIGN == 0 for s in slots)
    assert all(s.offset + s.nbytes <= t.offset for s, t in itertools.pairwise(slots))  # no overlap
    assert layout.nbytes >= out1.offset + out1.nbytes
    assert Layout.decode(layout.encode()) == layout


def test_slot_views_carry_their_values_in_one_block() -> None:
    """The views the runner calls on and the judge writes into are typed, strided windows of one byte block
    (here on the CPU; on a GPU the block is the exported allocation)."""
    x = torch.randn(6, 4).t()
    y = torch.tensor([1.5, -2.0], dtype=torch.float64)
    layout = plan_layout([x, y], [torch.empty(3)])
    block = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = [s.view(block) for s in layout.inputs]
    for view, value in zip(views, (x, y), strict=True):
        view.copy_(value)
    assert torch.equal(layout.inputs[0].view(block), x) and layout.inputs[0].view(block).stride() == x.stride()
    assert torch.equal(layout.inputs[1].view(block), y)
    assert torch.count_nonzero(block[:FLAG_BYTES]) == 0  # the flags are nobody's slot


def test_a_slot_naming_no_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="a witness slot must be"):
        Slot.decode([512, [2], [1], "no_such_dtype"])


def test_the_figure_is_the_span_less_the_null_and_a_stretched_null_is_capped() -> None:
    spans = [0.52, 0.50, 0.51]  # a call of ~0.2 ms in spans that hold ~0.3 ms of the handshake
    honest = figures(spans, [0.30, 0.31, 0.30], own_ms=0.05)
    assert honest.null_ms == pytest.approx(0.30) and honest.call_ms == pytest.approx(0.21)
    # A runner that sleeps in its null loop to shrink the judge's figure gets the cap: the judge's own
    # copies and flush plus two context switches, no more.
    stretched = figures(spans, [5.0, 5.0, 5.0], own_ms=0.05)
    assert stretched.null_ms == pytest.approx(0.05 + WITNESS_GPU_SWITCH_CAP_MS)
    assert stretched.call_ms == pytest.approx(0.51 - 0.05 - WITNESS_GPU_SWITCH_CAP_MS)


def test_the_rule_logs_a_timed_median_well_under_the_judges_call() -> None:
    fig = figures([0.52, 0.50, 0.51], [0.30, 0.31, 0.30], own_ms=0.05)  # a call of 0.21 ms
    assert gpu_witness.doubt(0.20, fig) is None  # honest: about the judge's figure
    lie = gpu_witness.doubt(0.10, fig)  # halved in the timed loop alone
    assert lie is not None and f"under {WITNESS_GPU_FACTOR:g}" in lie and "logged, not refused" in lie
    tiny = figures([0.31, 0.31], [0.30, 0.30], own_ms=0.05)  # a call of 0.01 ms: the handshake's noise
    assert gpu_witness.doubt(0.001, tiny) is None
    assert "the timed median is 0.95 of it" in gpu_witness.describe(0.20, fig)


def test_which_shapes_are_witnessed(monkeypatch: pytest.MonkeyPatch) -> None:
    hard = load_problem(DECKS / "hard" / "01_fp8_gemm")
    mega = load_problem(DECKS / "mega" / "02_kimi_linear_decode")
    monkeypatch.delenv("KERNELBOARD_GPU_WITNESS", raising=False)
    assert not gpu_witness.asked()  # off by default
    monkeypatch.setenv("KERNELBOARD_GPU_WITNESS", "1")
    assert gpu_witness.asked()
    assert gpu_witness.skip_reason(hard, "cuda", 1000) is None
    assert gpu_witness.skip_reason(hard, "cpu", 1000) == "not on a GPU"
    assert gpu_witness.skip_reason(mega, "cuda", 1000) == "a stateful step (its state threads through calls)"
    assert "over the" in gpu_witness.skip_reason(hard, "cuda", 10**10)


# ---- the judge's orchestration (judge._witness_gpu), its GPU parts stood in for: whatever the witness meets,
# it logs and the grading goes on; the figure and the witnessed outputs are judged as on a GPU.


class _Block:
    fd = -1

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Reply:
    def __init__(self, error: dict | None) -> None:
        self.error = error


def _witnessed(monkeypatch: pytest.MonkeyPatch, *, runner_error: dict | None = None, wrong: bool = False,
               prepare_fails: bool = False) -> tuple[list[str], _Block, list]:
    import sys

    from kernelboard.eval import judge
    from kernelboard.eval.correctness import PROBE_ELEMENTS, probe, probe_positions
    from kernelboard.eval.plan import import_file, make_plan
    from kernelboard.eval.settings import WITNESS_GPU_CALLS

    monkeypatch.setitem(sys.modules, "reference", None)
    problem = load_problem(DECKS / "hard" / "01_fp8_gemm")
    reference = import_file("reference", problem.reference_path)
    plan = make_plan(problem, reference, problem.shapes_for("cpu")[:1], [42], (1, 2, 3), "cpu")[0]
    plan.witness_sets = plan.timing_sets
    block, loops, logged = _Block(), [], []
    got = torch.full((WITNESS_GPU_CALLS, 1, PROBE_ELEMENTS), float("nan"), dtype=torch.float64)
    for i in range(WITNESS_GPU_CALLS):  # what the judge's stream gathers from a right (or a zeroed) output
        ref, seed = plan.timing_refs[i % 3], plan.timing_seeds[i % 3]
        taken = probe(torch.zeros_like(ref) if wrong else ref, probe_positions(seed * 16, ref.numel(), "cpu"))
        got[i, 0, :taken.numel()] = taken

    class Loop:
        def __init__(self, *args: object) -> None:
            self.with_call, self.released, self.waited = args[-1], False, False
            loops.append(self)

        def release(self) -> None:
            self.released = True

        def ended(self) -> bool:
            return self.waited

        def wait(self) -> tuple[list[float], torch.Tensor | None]:
            self.waited = True
            return ([0.50] * WITNESS_GPU_CALLS, got) if self.with_call else ([0.30] * WITNESS_GPU_CALLS, None)

    def prepare(driver: object, sets: list, refs: list, specs: list, calls: int) -> gpu_witness.Setup:
        # the positions the judge's _Targets checks (judge._probe_spec), not a formula of the witness's own
        assert specs == [[[seed * 16, ref.numel()]]
                         for seed, ref in zip(plan.timing_seeds, plan.timing_refs, strict=True)]
        if prepare_fails:
            raise RuntimeError("cuMemCreate failed: 2 out of memory")
        layout = plan_layout(sets[0], gpu_witness.output_parts(refs[0]))
        return gpu_witness.Setup(sets, layout, block, torch.empty(0), [], 0.05)  # type: ignore[arg-type]

    class Link:
        def ask(self, op: str, what: str, **request: object) -> _Reply:
            assert op == "witness" and request["keep_error"] is True and request["fds"] == (block.fd,)
            return _Reply(runner_error)

    monkeypatch.setattr(judge, "Driver", lambda: None)
    monkeypatch.setattr(gpu_witness, "prepare", prepare)
    monkeypatch.setattr(gpu_witness, "JudgeLoop", Loop)
    monkeypatch.setattr(judge, "log", lambda tag, message: logged.append(message))
    judge._witness_gpu(Link(), problem, plan, 0, timed_median_ms=0.19)  # type: ignore[arg-type]
    return logged, block, loops


def test_the_judge_logs_the_figure_beside_the_timed_median(monkeypatch: pytest.MonkeyPatch) -> None:
    logged, block, loops = _witnessed(monkeypatch)
    assert [loop.with_call for loop in loops] == [False, True]  # the null loop first
    assert logged == ["shape 0: the judge's clock around 16 witnessed calls: span 0.5000 ms, null 0.3000 ms (its "
                      "loop 0.3000 ms; the judge's own copies and flush 0.0500 ms + at most 0.35 ms), so a call "
                      "0.2000 ms; the timed median is 0.95 of it"]
    assert block.closed


def test_a_wrong_witnessed_output_is_logged_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    logged, block, _ = _witnessed(monkeypatch, wrong=True)
    assert logged[-1].startswith("shape 0: a witnessed call's output: shape 0: witnessed call 0 (input set 0")
    assert logged[-1].endswith("(logged, not refused)") and block.closed


def test_a_runner_that_fails_its_side_releases_the_judges_and_the_grading_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    logged, block, loops = _witnessed(monkeypatch, runner_error={"type": "ValueError", "text": "boom"})
    assert len(loops) == 1 and loops[0].released and loops[0].waited
    assert logged == ["shape 0: the GPU witness could not run: RuntimeError: the runner's side: ValueError: boom"]
    assert block.closed


def test_a_judge_side_that_cannot_be_set_up_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    logged, _, loops = _witnessed(monkeypatch, prepare_fails=True)
    assert loops == []
    assert logged == ["shape 0: the GPU witness could not run: RuntimeError: cuMemCreate failed: 2 out of memory"]

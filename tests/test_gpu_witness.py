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
    assert gpu_witness.skip_reason(hard, "cuda", 1000).startswith("not asked for")  # off by default
    monkeypatch.setenv("KERNELBOARD_GPU_WITNESS", "1")
    assert gpu_witness.skip_reason(hard, "cuda", 1000) is None
    assert gpu_witness.skip_reason(hard, "cpu", 1000) == "not on a GPU"
    assert gpu_witness.skip_reason(mega, "cuda", 1000) == "a stateful step (its state threads through calls)"
    assert "over the" in gpu_witness.skip_reason(hard, "cuda", 10**10)

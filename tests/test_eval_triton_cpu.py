"""Triton kernels graded on the CPU: the worker runs them in Triton's interpreter (TRITON_INTERPRET=1),
so a contributor without a GPU can check a Triton solution's correctness through the same judge and
runner. One is the committed W4A16 house kernel v2 (data/submissions), unchanged; the other a bf16 `tl.dot`,
which the interpreter computes only since grader 0.5.14 (kernelboard.eval.interpreter)."""

from __future__ import annotations

import pytest
from grading import ROOT, MeasuredBaselines, grade

triton = pytest.importorskip("triton")

HOUSE_V2 = ROOT / "data" / "submissions" / "hard" / "20261130_120000_house_kernelboard-house_07_w4a16_gemm"


#: The reference's output passed through a bf16 `tl.dot` with the identity: right only where the interpreter
#: multiplies bf16 values, not their bit patterns (kernelboard.eval.interpreter).
BF16_DOT = """
import torch
import triton
import triton.language as tl

from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401


@triton.jit
def _through_identity(x_ptr, out_ptr, rows):
    r = tl.program_id(0) * 16 + tl.arange(0, 16)[:, None]
    c = tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + r * 16 + c, mask=r < rows, other=0.0)
    eye = tl.where(tl.arange(0, 16)[:, None] == tl.arange(0, 16)[None, :], 1.0, 0.0).to(tl.bfloat16)
    tl.store(out_ptr + r * 16 + c, tl.dot(x, eye), mask=r < rows)


class Model(_Reference):
    def forward(self, x):
        out = super().forward(x).contiguous()
        res = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        rows = out.numel() // 16
        _through_identity[(triton.cdiv(rows, 16),)](out, res, rows)
        return res.to(out.dtype)
"""


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> dict[str, dict]:
    """Both Triton kernels graded on the CPU in one batch."""
    source = (HOUSE_V2 / "solution.py").read_text()
    assert "@triton.jit" in source  # a real Triton kernel: it runs only because the worker interprets it
    return grade(tmp_path_factory.mktemp("triton-cpu"), ("07_w4a16_gemm",),
                 {"w4v2": ("07_w4a16_gemm", source), "bf16dot": ("07_w4a16_gemm", BF16_DOT)}, measured_baselines)


def test_a_triton_house_kernel_passes_on_the_cpu_in_the_interpreter(graded: dict[str, dict]) -> None:
    row = graded["w4v2"]
    assert row["status"] == "pass", row["message"]
    assert "correct on all" in row["message"]


def test_a_bf16_dot_is_computed_on_values_not_bit_patterns(graded: dict[str, dict]) -> None:
    """Before grader 0.5.14 this correct kernel was `wrong` on the CPU: 64 of 64 elements out, ‖d‖/‖ref‖ 1.88e9."""
    row = graded["bf16dot"]
    assert row["status"] == "pass", row["message"]

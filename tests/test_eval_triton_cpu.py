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


#: BF16_DOT with its loads masked on the columns only: at the CPU decode shape (4 rows of 16) its one program
#: reads rows 4-15 past the end of its input. Its stores are masked, so its output is still right.
READS_PAST = BF16_DOT.replace("mask=r < rows, other=0.0", "mask=c < 16, other=0.0")


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> dict[str, dict]:
    """The Triton kernels graded on the CPU in one batch, each row with its log's text."""
    source = (HOUSE_V2 / "solution.py").read_text()
    assert "@triton.jit" in source  # a real Triton kernel: it runs only because the worker interprets it
    assert READS_PAST != BF16_DOT
    root = tmp_path_factory.mktemp("triton-cpu")
    rows = grade(root, ("07_w4a16_gemm",), {"w4v2": ("07_w4a16_gemm", source), "bf16dot": ("07_w4a16_gemm", BF16_DOT),
                                              "readspast": ("07_w4a16_gemm", READS_PAST)}, measured_baselines)
    return {run_id: {**row, "log": (root / "out" / row["log_path"]).read_text()} for run_id, row in rows.items()}


def test_a_triton_house_kernel_passes_on_the_cpu_in_the_interpreter(graded: dict[str, dict]) -> None:
    row = graded["w4v2"]
    assert row["status"] == "pass", row["message"]
    assert "correct on all" in row["message"]


def test_a_bf16_dot_is_computed_on_values_not_bit_patterns(graded: dict[str, dict]) -> None:
    """Before grader 0.5.14 this correct kernel was `wrong` on the CPU: 64 of 64 elements out, ‖d‖/‖ref‖ 1.88e9."""
    row = graded["bf16dot"]
    assert row["status"] == "pass", row["message"]


def test_a_lane_outside_its_tensors_is_said_in_the_log_and_read_as_zero(graded: dict[str, dict]) -> None:
    """The interpreter would read whatever host memory lies past the input (or crash); the runner masks the
    lane off and says so once per kernel. A finding on the kernel, not a verdict: its output is right."""
    row = graded["readspast"]
    assert row["status"] == "pass", row["message"]
    said = [line for line in row["log"].splitlines() if line.startswith("[runner] interpreter:")]
    assert said == ["[runner] interpreter: _through_identity reaches outside the tensors its launch was given (load "
                    "of 2 B by program (0, 0, 0): byte 128 of x_ptr, which has 128 B); those lanes are masked off "
                    "here (a load reads 0), where a GPU faults or reads other memory"]
    assert "[runner] interpreter:" not in graded["bf16dot"]["log"]  # the same kernel, masked: nothing said

"""A Triton kernel graded on the CPU: the worker runs it in Triton's interpreter (TRITON_INTERPRET=1),
so a contributor without a GPU can check a Triton solution's correctness through the same judge and
runner. The kernel is the committed W4A16 house kernel v2 (data/submissions), unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from grading import ROOT, MeasuredBaselines, grade

triton = pytest.importorskip("triton")

HOUSE_V2 = ROOT / "data" / "submissions" / "hard" / "20261130_120000_house_kernelboard-house_07_w4a16_gemm"


def test_a_triton_house_kernel_passes_on_the_cpu_in_the_interpreter(tmp_path: Path,
                                                                    measured_baselines: MeasuredBaselines) -> None:
    source = (HOUSE_V2 / "solution.py").read_text()
    assert "@triton.jit" in source  # a real Triton kernel: it runs only because the worker interprets it
    rows = grade(tmp_path, ("07_w4a16_gemm",), {"w4v2": ("07_w4a16_gemm", source)}, measured_baselines)
    row = rows["w4v2"]
    assert row["status"] == "pass", row["message"]
    assert "correct on all" in row["message"]

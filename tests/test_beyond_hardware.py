"""A pass timed faster than the GPU can do the work is refused (scoring.beyond_hardware): the bound a
value-keyed output cache or a clock lie in the timed loop cannot get under, whatever the judge's clock says."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from grading import REEXPORT, MeasuredBaselines, grade

from kernelboard.eval import schedule
from kernelboard.eval.deck import load_problem
from kernelboard.eval.hardware import GPUS, GpuSpec
from kernelboard.eval.schema import PRECISIONS
from kernelboard.eval.scoring import beyond_hardware, shape_rows
from kernelboard.eval.settings import PEAK_FRACTION_LIMIT

ROOT = Path(__file__).resolve().parents[1]
HARD = ROOT / "eval" / "decks" / "hard"


def _rows(problem_name: str, gpu: str, ms_by_shape: dict[int, float]) -> list[dict]:
    problem = load_problem(HARD / problem_name)
    timed = [{"idx": idx, "median_ms": ms, "p10_ms": ms, "p90_ms": ms, "min_ms": ms, "iterations": 100}
             for idx, ms in ms_by_shape.items()]
    return shape_rows(problem, GPUS[gpu], "r", gpu, timed, {})


def _least_ms(problem_name: str, gpu: str, idx: int) -> float:
    """The time at which shape `idx` sits exactly at the GPU's peak for the problem's regime: a fraction is
    inverse in the time, so timed at 1 ms it reads that many ms."""
    return _rows(problem_name, gpu, {idx: 1.0})[0]["peak_fraction"]


def test_a_memory_bound_shape_faster_than_the_bandwidth_is_refused() -> None:
    problem = load_problem(HARD / "03_paged_attention")
    least = _least_ms("03_paged_attention", "h200", 1)
    assert 0.04 < least < 0.07  # 268 MB of KV cache at 4.8 TB/s
    rows = _rows("03_paged_attention", "h200", {0: 0.02, 1: least / 3})
    message = beyond_hardware(problem, GPUS["h200"], rows)
    assert message is not None
    assert message.startswith("shape 1 (")
    assert "3.00× its 4,800 GB/s" in message and "NVIDIA H200 SXM" in message and "from a flushed L2" in message


def test_a_compute_bound_shape_faster_than_the_tensor_cores_is_refused() -> None:
    problem = load_problem(HARD / "01_fp8_gemm")
    least = _least_ms("01_fp8_gemm", "h100-sxm", 0)
    message = beyond_hardware(problem, GPUS["h100-sxm"], _rows("01_fp8_gemm", "h100-sxm", {0: least / 1.5}))
    assert message is not None and "TFLOP/s, 1.50× its dense fp8 peak of 1,979" in message


@pytest.mark.parametrize("factor", [1.0, 1.3, 5.0])
def test_a_time_at_or_above_the_peak_stands(factor: float) -> None:
    problem = load_problem(HARD / "03_paged_attention")
    least = _least_ms("03_paged_attention", "h200", 1)
    assert beyond_hardware(problem, GPUS["h200"], _rows("03_paged_attention", "h200", {1: least * factor})) is None


def test_without_a_datasheet_nothing_is_held() -> None:
    """CPU gradings have no peak to hold a time against (the red-team suite's CPU gaps stay gaps there)."""
    problem = load_problem(HARD / "03_paged_attention")
    assert beyond_hardware(problem, None, []) is None


def test_no_graded_or_imported_pass_comes_near_the_limit() -> None:
    """Every pass on every board, graded here or imported, stays under its regime's peak: the limit refuses
    no kernel the field would sign (the most is 0.90, KernelBench-Hard's own H100 PCIe figure for 03)."""
    fractions = pd.concat([pd.read_parquet(p, columns=["peak_fraction"])
                           for p in sorted((ROOT / "data" / "results").glob("*/shapes.parquet"))])
    assert len(fractions) > 1000
    assert fractions["peak_fraction"].max() < 0.95 * PEAK_FRACTION_LIMIT


def test_a_grading_timed_beyond_the_peak_is_refused_and_logged(tmp_path: Path, measured_baselines: MeasuredBaselines,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path on the CPU: a datasheet for it so slow that the reference's own times lie beyond it."""
    tiny = GpuSpec("cpu", "a test machine of 1 kB/s", "none", 1, None, 1e-6, {p: 1e-12 for p in PRECISIONS}, "a test")
    monkeypatch.setattr(schedule, "GPUS", {**schedule.GPUS, "cpu": tiny})
    row = grade(tmp_path, ["03_paged_attention"], {"ref": ("03_paged_attention", REEXPORT)}, measured_baselines)["ref"]
    assert row["status"] == "integrity_violation"
    assert "faster than the a test machine of 1 kB/s can do the work from a flushed L2" in row["message"]
    assert row["speedup_vs_compile"] is None and row["n_shapes"] == 0
    log = (tmp_path / "out" / row["log_path"]).read_text()
    assert f"[grader] pass refused integrity_violation: {row['message']}" in log

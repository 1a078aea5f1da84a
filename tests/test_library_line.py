"""Library lines: baselines beside eager and torch.compile, recorded per shape, never the headline."""

from __future__ import annotations

from pathlib import Path

from grading import REEXPORT, grade

from kernelboard.eval.tables import read_table, table_path


def test_library_lines_are_timed_or_their_error_recorded(tmp_path: Path) -> None:
    rows = grade(tmp_path, ("01_fp8_gemm", "05_topk_bitonic"),
                 {"fp8": ("01_fp8_gemm", REEXPORT), "topk": ("05_topk_bitonic", REEXPORT)})
    baselines = read_table(table_path(tmp_path / "out", "cpu", "baselines"), "baselines").to_pylist()
    by_variant = {(b["problem"], b["variant"]): b for b in baselines if b["shape_idx"] == 0}
    topk = by_variant[("05_topk_bitonic", "library:torch.topk")]
    assert topk["status"] == "ok" and topk["median_ms"] > 0
    scaled = by_variant[("01_fp8_gemm", "library:torch._scaled_mm")]
    if scaled["status"] == "ok":  # CPU fp8 GEMM support depends on the torch build
        assert scaled["median_ms"] > 0
    else:
        assert scaled["status"] == "error" and scaled["median_ms"] is None and ":" in scaled["message"]
    assert rows["fp8"]["status"] == "pass"
    assert rows["fp8"]["compile_variant"] in ("compile:default",)  # the headline stays torch.compile


def test_a_skipped_baseline_is_not_measured_and_no_headline_without_torch_compile(tmp_path: Path) -> None:
    rows = grade(tmp_path, ("07_w4a16_gemm",), {"w4": ("07_w4a16_gemm", REEXPORT)},
                 skip_baselines=("compile:default",))
    baselines = read_table(table_path(tmp_path / "out", "cpu", "baselines"), "baselines").to_pylist()
    assert {b["variant"] for b in baselines} == {"eager"}
    assert rows["w4"]["status"] == "not_graded" and rows["w4"]["speedup_vs_compile"] is None
    assert "baselines are missing for shapes [0, 1]" in rows["w4"]["message"]

"""Library lines: baselines beside eager and torch.compile, recorded per shape, never the headline,
and held to the solution's correctness rule (a wrong one records no time)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from grading import REEXPORT, MeasuredBaselines, copy_deck, grade, write_submission

from kernelboard.eval.deck import DeckError, load_problem
from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import read_table, table_path

W4 = "07_w4a16_gemm"


def test_library_lines_are_timed_or_their_error_recorded(tmp_path: Path,
                                                         measured_baselines: MeasuredBaselines) -> None:
    """The session's baselines of 01 and 05 (measured once, by the grader, for every batch of those problems)."""
    rows = grade(tmp_path, ("01_fp8_gemm", "05_topk_bitonic"),
                 {"fp8": ("01_fp8_gemm", REEXPORT), "topk": ("05_topk_bitonic", REEXPORT)}, measured_baselines)
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


@pytest.mark.slow  # measures its own baselines, end to end
def test_a_skipped_baseline_is_not_measured_and_no_headline_without_torch_compile(tmp_path: Path) -> None:
    rows = grade(tmp_path, ("07_w4a16_gemm",), {"w4": ("07_w4a16_gemm", REEXPORT)},
                 skip_baselines=("compile:default",))
    baselines = read_table(table_path(tmp_path / "out", "cpu", "baselines"), "baselines").to_pylist()
    assert {b["variant"] for b in baselines} == {"eager", "library:torch._weight_int4pack_mm"}
    assert rows["w4"]["status"] == "not_graded" and rows["w4"]["speedup_vs_compile"] is None
    assert "baselines are missing for shapes [0, 1]" in rows["w4"]["message"]


@pytest.mark.slow  # measures its own baselines, end to end
def test_a_library_line_that_disagrees_with_the_reference_records_no_time(tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (W4,))
    with (deck / W4 / "reference.py").open("a") as f:
        f.write("\n\ndef library_same(model, x):\n    return model(x)\n\n\n"
                "def library_skewed(model, x):\n    return model(x) * 1.5\n")
    yaml = deck / W4 / "problem.yaml"
    text = re.sub(r"\nlibrary:\n(  .*\n)+", "\n", yaml.read_text())
    yaml.write_text(text + "\nlibrary:\n  same: library_same\n  skewed: library_skewed\n")
    write_submission(tmp_path / "subs" / "w4", W4, REEXPORT)
    opts = EvalOptions(deck=deck, submissions=tmp_path / "subs", out=tmp_path / "out", device="cpu", rep_ms=10.0,
                       skip_baselines=("compile:default",))
    run_eval(opts)
    rows = read_table(table_path(tmp_path / "out", "cpu", "baselines"), "baselines").to_pylist()
    by_variant: dict[str, list[dict]] = {}
    for row in rows:
        by_variant.setdefault(row["variant"], []).append(row)
    assert {r["status"] for r in by_variant["library:same"]} == {"ok"}
    assert all(r["median_ms"] > 0 for r in by_variant["library:same"])
    skewed = by_variant["library:skewed"]
    assert {r["status"] for r in skewed} == {"wrong"}
    assert all(r["median_ms"] is None for r in skewed)
    assert all("input set 0" in r["message"] and "out of tolerance" in r["message"] for r in skewed)


def test_a_library_name_yaml_reads_as_a_boolean_is_a_deck_error(tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (W4,))
    yaml = deck / W4 / "problem.yaml"
    yaml.write_text(re.sub(r"\nlibrary:\n(  .*\n)+", "\n", yaml.read_text()) + "\nlibrary:\n  off: library_tinygemm\n")
    with pytest.raises(DeckError, match=r"problem.yaml: library: expected 'name: function_in_reference_py'.*False"):
        load_problem(deck / W4)

"""Baseline rows: a library line is held to the solution's correctness rule (a wrong one records
no time), and cached rows are reused across grader versions whose baseline method is the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from grading import REEXPORT, copy_deck, write_submission

from kernelboard.eval import settings
from kernelboard.eval.deck import DeckError, load_problem
from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import read_table, table_path

W4 = "07_w4a16_gemm"


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


@pytest.mark.parametrize(("variant", "measured_by", "current", "reusable"), [
    ("eager", "0.2.0", "0.2.2", True),
    ("compile:max-autotune", "0.2.1", "0.2.2", True),
    ("library:torch.topk", "0.2.1", "0.2.2", False),  # library lines were not checked before 0.2.2
    ("library:torch.topk", "0.2.2", "0.2.2", True),
    ("eager", "0.1.9", "0.2.2", False),
    ("eager", "0.3.0", "0.2.2", False),  # a newer grader's rows are not this one's to trust
    ("eager", "0.2.2.dev3", "0.2.2", True),
])
def test_cached_baselines_are_reused_only_within_one_baseline_method(
        monkeypatch: pytest.MonkeyPatch, variant: str, measured_by: str, current: str, reusable: bool) -> None:
    monkeypatch.setattr(settings, "GRADER_VERSION", current)
    assert settings.baseline_reusable(variant, measured_by) is reusable


@pytest.mark.parametrize(("status", "message", "retried"), [
    ("error", "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB.", True),
    ("error", "RuntimeError: Expected trailing dimension of mat1 to be divisible by 16 (K=4127)", False),
    ("ok", "ok", False),
    ("wrong", "input set 0: 33 of 64 elements out of tolerance", False),
])
def test_only_an_out_of_memory_baseline_is_measured_again(status: str, message: str, retried: bool) -> None:
    from kernelboard.eval.schedule import _transient

    assert _transient({"status": status, "message": message}) is retried

"""Baseline caching: an interrupted run keeps the shapes it finished and the next measures only the
rest; cached rows are reused within one baseline method; an out-of-memory attempt is retried."""

from __future__ import annotations

from pathlib import Path

import pytest
from grading import REEXPORT, copy_deck, write_submission

from kernelboard.eval import settings
from kernelboard.eval.schedule import EvalOptions, _transient, run_eval
from kernelboard.eval.tables import read_table, table_path

W4 = "07_w4a16_gemm"


def _baselines(out: Path) -> dict[int, dict]:
    rows = read_table(table_path(out, "cpu", "baselines"), "baselines").to_pylist()
    return {r["shape_idx"]: r for r in rows}


@pytest.mark.slow  # waits out a baseline timeout, grades twice
def test_a_baseline_run_cut_off_by_its_timeout_keeps_what_it_measured(tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (W4,))
    hang = tmp_path / "hang"
    hang.touch()
    with (deck / W4 / "reference.py").open("a") as f:  # the second CPU shape (N = 96) hangs while `hang` exists
        f.write(f"""

import pathlib as _pathlib
import time as _time

_forward = Model.forward


def _hanging_forward(self, *args):
    if self.N == 96 and _pathlib.Path({str(hang)!r}).exists():
        _time.sleep(3600)
    return _forward(self, *args)


Model.forward = _hanging_forward
""")
    write_submission(tmp_path / "subs" / "w4", W4, REEXPORT)
    opts = EvalOptions(deck=deck, submissions=tmp_path / "subs", out=tmp_path / "out", device="cpu", rep_ms=20.0,
                       skip_baselines=("compile:default", "library:torch._weight_int4pack_mm"),
                       baseline_timeout_s=25.0, check_timeout_s=10.0)
    run_eval(opts)
    first = _baselines(tmp_path / "out")
    assert sorted(first) == [0] and first[0]["variant"] == "eager" and first[0]["median_ms"] > 0
    hang.unlink()
    run_eval(opts)
    second = _baselines(tmp_path / "out")
    assert sorted(second) == [0, 1]
    assert second[0]["measured_at"] == first[0]["measured_at"]  # shape 0 was not measured again
    log = (tmp_path / "out" / "cpu" / "logs" / f"baselines-hard-{W4}.log").read_text()
    runs = log.split("=== ")[1:]  # one headed part per measuring run: the log accumulates, like the table
    assert len(runs) == 2 and all("UTC, kernelboard" in r for r in runs)
    assert "[baseline] shape 0 eager" in runs[0]
    assert "[baseline] shape 0" not in runs[1] and "[baseline] shape 1 eager" in runs[1]


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
    monkeypatch.setattr(settings, "BASELINE_METHOD_SINCE", {"eager": "0.2.0", "compile": "0.2.0", "library": "0.2.2"})
    assert settings.baseline_reusable(variant, measured_by) is reusable


@pytest.mark.parametrize("variant", ["eager", "compile:default", "library:torch.topk"])
def test_baselines_timed_before_the_covered_timer_are_measured_again(variant: str) -> None:
    """0.4.0 times every GPU line with its dispatch covered, 0.4.1 floors a sample at the least
    dispatch, 0.4.2 keeps the least floor of up to three loops the host bound: a 0.3.x, 0.4.0 or
    0.4.1 row means another statistic."""
    assert not settings.baseline_reusable(variant, "0.3.6")
    assert not settings.baseline_reusable(variant, "0.4.0")
    assert not settings.baseline_reusable(variant, "0.4.1")
    assert settings.baseline_reusable(variant, settings.GRADER_VERSION)


@pytest.mark.parametrize(("graded_by", "current", "comparable_since", "skipped"), [
    ("0.4.4", "0.4.5", "0.4.4", True),  # the pilot calls move no verdict and no figure beyond noise
    ("0.4.5", "0.4.5", "0.4.4", True),
    ("0.4.3", "0.4.5", "0.4.4", False),  # 0.4.4 bounded the probes' norm: a 0.4.3 pass may not be one now
    ("0.4.6", "0.4.5", "0.4.4", False),  # a newer grader's rows are not this one's to trust
    ("0.4.5.dev2", "0.4.5", "0.4.5", True),
])
def test_resume_skips_only_results_this_grader_would_give(monkeypatch: pytest.MonkeyPatch, graded_by: str,
                                                          current: str, comparable_since: str, skipped: bool) -> None:
    monkeypatch.setattr(settings, "GRADER_VERSION", current)
    monkeypatch.setattr(settings, "RESULTS_COMPARABLE_SINCE", comparable_since)
    assert settings.result_current(graded_by) is skipped


@pytest.mark.parametrize(("graded_by", "message", "current"), [
    ("0.4.8", "shape 0 (context 2048) seed 0 step 0 (op audit): StepOutputError: state[3] returned has keys "
              "['c_kv', 'k_nope', 'k_rope', 'v'], expected ['c_kv', 'k_rope']", False),  # 0.5.0 accepts them
    ("0.5.0", "shape 0 seed 0 step 0: StepOutputError: state[3] returned has keys ['c_kv'], expected "
              "['c_kv', 'k_rope'] (k_rope missing)", True),  # a key missing: refused by 0.5.0 too
    ("0.4.8", None, True),
])
def test_resume_grades_again_a_verdict_a_later_rule_changed(monkeypatch: pytest.MonkeyPatch, graded_by: str,
                                                            message: str | None, current: bool) -> None:
    monkeypatch.setattr(settings, "GRADER_VERSION", "0.5.1")
    assert settings.result_current(graded_by, message) is current
    assert settings.verdict_superseded(graded_by, message) is (not current)


SWITCHES = ("torch global state changed when solution.py was imported: "
            "matmul.allow_bf16_reduced_precision_reduction: True -> False")


def test_resume_grades_again_a_kernel_failed_for_its_torch_switches() -> None:
    """0.5.12 names a switch a solution flips (its own process only) where earlier graders failed it: such a
    verdict is graded again and held back meanwhile; an integrity violation of another kind stands."""
    assert not settings.result_current("0.5.11", SWITCHES, "07_w4a16_gemm", "integrity_violation")
    assert settings.verdict_superseded("0.5.5", SWITCHES, "07_w4a16_gemm")
    assert settings.result_current("0.5.11", "shape 0 seed 42 case nominal: the solution wrote into input 0",
                                   "07_w4a16_gemm", "integrity_violation")


TIMED_MISS = "shape 1: timed call 114 (input set 0, output 0) returned a wrong output: 6 of 32 probed elements"


@pytest.mark.parametrize(("graded_by", "message", "problem", "current"), [
    ("0.4.8", TIMED_MISS, "02_kimi_linear_decode", False),  # 0.5.1 may take it as another expert choice
    ("0.4.8", "shape 0: floor batch 1, call 3 (input set 3) returned a wrong output", "02_kimi_linear_decode", False),
    ("0.4.8", "shape 0: longer floor batch 0 (the round trip outweighed the calls), call 3 (input set 3) returned a "
              "wrong output", "02_kimi_linear_decode", False),
    ("0.4.8", "shape 1: a timed call on input set 2 returned a wrong output", "02_kimi_linear_decode", False),
    ("0.4.8", TIMED_MISS, "01_fp8_gemm", True),  # no router there: the rule changed nothing
    ("0.5.1", TIMED_MISS, "02_kimi_linear_decode", True),
    ("0.4.8", "shape 0 (context 2048) seed 7 step 0: output 0 (hidden): cosine similarity 0.8514 < 0.98",
     "02_kimi_linear_decode", True),
])
def test_a_timed_miss_on_a_router_problem_is_graded_again(monkeypatch: pytest.MonkeyPatch, graded_by: str,
                                                          message: str, problem: str, current: bool) -> None:
    monkeypatch.setattr(settings, "GRADER_VERSION", "0.5.1")
    assert settings.result_current(graded_by, message, problem) is current


@pytest.mark.parametrize(("graded_by", "problem", "status", "current"), [
    ("0.5.10", "02_kimi_linear_decode", "pass", False),  # its near-tie steps kept the cosine rule alone
    ("0.5.10", "02_kimi_linear_decode", "wrong", True),  # a stricter check fails what a looser one failed
    ("0.5.10", "03_paged_attention", "pass", True),  # no router: the rule changed nothing
    ("0.5.11", "02_kimi_linear_decode", "pass", True),
])
def test_a_mega_pass_of_a_looser_check_is_graded_again_and_still_shown(
        monkeypatch: pytest.MonkeyPatch, graded_by: str, problem: str, status: str, current: bool) -> None:
    monkeypatch.setattr(settings, "GRADER_VERSION", "0.5.11")
    message = "correct on all 96 checks (3 shapes × 4 seeds × 4 consecutive steps, every state tensor)"
    assert settings.result_current(graded_by, message, problem, status) is current
    assert not settings.verdict_superseded(graded_by, message, problem)  # the site keeps showing it meanwhile


RECYCLED_PASS = "20260801_205612_or-fable_deepseek_deepseek-v4-flash-0731_01_fp8_gemm"


@pytest.mark.parametrize(("graded_by", "run_id", "status", "current"), [
    ("0.5.27", RECYCLED_PASS, "pass", False),  # it keeps x's padded copy under x's address: graded again
    ("0.5.27", RECYCLED_PASS, "wrong", True),
    ("0.5.27", "20260725_063736_or-opus_anthropic_claude-opus-5_01_fp8_gemm", "pass", True),  # another 01 kernel
    ("0.5.29", RECYCLED_PASS, "pass", True),
])
def test_a_pass_tightened_for_its_run_alone_is_graded_again(graded_by: str, run_id: str, status: str,
                                                            current: bool) -> None:
    """0.5.29's call on new inputs in the last call's memory changes the verdict of one pass on a board, named
    by run id (settings.TIGHTENED_PASSES), not every pass of its problem."""
    assert settings.result_current(graded_by, "correct on all 64 checks", "01_fp8_gemm", status, run_id) is current
    assert (settings.tightened_since(graded_by, "01_fp8_gemm", status, run_id) is None) is current


@pytest.mark.parametrize(("status", "message", "retried"), [
    ("error", "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB.", True),
    ("error", "RuntimeError: Expected trailing dimension of mat1 to be divisible by 16 (K=4127)", False),
    ("ok", "ok", False),
    ("wrong", "input set 0: 33 of 64 elements out of tolerance", False),
])
def test_only_an_out_of_memory_baseline_is_measured_again(status: str, message: str, retried: bool) -> None:
    assert _transient({"status": status, "message": message}) is retried

"""Where kernelboard's verdict differs from the original grader's (sitegen/agreement.py): the cause classes
on hand-made verdicts, the table on the committed data, and its section on the methodology page."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import html5lib
import pyarrow.parquet as pq
import pytest
from site_pages import text

from kernelboard.eval.deck import load_problem
from kernelboard.eval.schema import STATUSES
from kernelboard.sitegen.agreement import (
    EVIDENCE,
    EXCLUDED_OURS,
    OUR_LIMIT,
    OUR_LIMITS,
    OURS_ONLY_CASES,
    THEIRS_COMPARED_OUTPUTS,
    THEIRS_NUMERIC_STRESS_SINCE,
    THEIRS_STRUCTURAL_SINCE,
    TO_EXPLAIN,
    Agreement,
    agreement,
    classify,
    their_reason,
)
from kernelboard.sitegen.board import gpu_label
from kernelboard.sitegen.format import pct
from kernelboard.sitegen.load import SiteData, load_site
from kernelboard.sitegen.pages import plan
from kernelboard.sitegen.render import _render, _site, make_env

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
DECKS = REPO / "eval" / "decks"
HY3_07 = "20260709_090316_hy3_hy3_07_w4a16_gemm"
GROK_03 = "20260709_040836_grok_grok-4.5_03_paged_attention"
THEIRS_WRONG = "KernelBench-Hard (run detail): check.py: the output is incorrect"


@pytest.fixture(scope="module")
def deck07():
    return load_problem(DECKS / "hard" / "07_w4a16_gemm")


@pytest.fixture(scope="module")
def mega02():
    return load_problem(DECKS / "mega" / "02_kimi_linear_decode")


@pytest.fixture(scope="module")
def deck02():
    return load_problem(DECKS / "hard" / "02_kda_cutlass")


# ----------------------------------------------------------------------------------- classification


@pytest.mark.parametrize(("ours", "theirs"), [("pass", "pass"), ("wrong", "wrong"), ("runtime_error", "wrong"),
                                              ("forbidden", "timeout"), ("oom", "build_error")])
def test_same_side_of_pass_agrees(ours: str, theirs: str) -> None:
    verdict = classify(ours, "whatever", theirs, "whatever")
    assert verdict.kind == "agree" and verdict.cause is None and not verdict.stronger


@pytest.mark.parametrize("ours", EXCLUDED_OURS)
def test_no_verdict_of_ours_is_excluded(ours: str) -> None:
    for theirs in ("pass", "wrong"):
        verdict = classify(ours, "needs sm_100a", theirs)
        assert verdict.kind == "excluded" and ours in verdict.cause and not verdict.stronger


@pytest.mark.parametrize("theirs", ["not_graded", "dnf"])
def test_no_published_verdict_is_excluded(theirs: str) -> None:
    verdict = classify("pass", "correct on all 60 checks", theirs,
                       "KernelBench-Hard (run detail): the agent wrote no solution")
    assert verdict.kind == "excluded" and verdict.cause.startswith("theirs: ")


def test_a_published_check_timeout_is_excluded_not_a_failure() -> None:
    """hy3 06 090251 passes here; KernelBench-Hard's check of it timed out (180 s of GPU, 46 s more waiting for the
    lock). Its own classifier calls that a retryable infrastructure failure, and its operator regraded another
    such run with a ten times longer timeout to a pass: no verdict on the kernel, on either side of pass."""
    for ours in ("pass", "wrong"):
        verdict = classify(ours, "correct on all 48 checks", "timeout",
                           "KernelBench-Hard (run detail): check.py timed out")
        assert verdict.kind == "excluded" and verdict.cause.startswith("theirs: check.py timed out")
    assert classify("pass", "", "timeout", "KernelBench-Hard (run detail): correct, but benchmark.py timed out"
                    ).kind == "differ"  # a benchmark timeout is theirs after a verdict: not this rule


def test_every_status_gets_a_class() -> None:
    for ours in STATUSES:
        for theirs in STATUSES:
            verdict = classify(ours, "", theirs, "")
            assert verdict.kind in ("agree", "excluded", "differ")
            assert (verdict.cause is None) == (verdict.kind == "agree")


def test_a_stress_case_of_ours_only_is_a_stronger_check(deck07) -> None:
    message = ("shape 0 (decode) seed 42 case small_scales: 12275 of 12288 elements out of tolerance "
               "(atol=0.001, rtol=0.05)")
    verdict = classify("wrong", message, "pass", "", deck07)
    assert verdict.kind == "differ" and verdict.stronger and verdict.explained
    assert verdict.cause == "stronger check: stress case small_scales (ours only)"


def test_a_stress_case_both_decks_have_is_not_explained(deck07) -> None:
    message = "shape 0 (decode) seed 42 case small_activation: 3 of 12288 elements out of tolerance"
    verdict = classify("wrong", message, "pass", "", deck07)
    assert verdict.kind == "differ" and not verdict.stronger and not verdict.explained
    assert verdict.cause == f"ours: wrong {TO_EXPLAIN}"


def test_a_structural_case_is_a_stronger_check(deck02) -> None:
    fn = deck02.structural_stress.function
    message = f"shape 1 (long) seed 42 case {fn}(split=3, beta_percent=80): 9 of 4096 elements out of tolerance"
    verdict = classify("wrong", message, "pass", "", deck02)
    assert verdict.stronger and verdict.cause == f"stronger check: structural case {fn} (not run by theirs)"


def test_a_structural_case_theirs_ran_too_is_no_stronger_check(deck02) -> None:
    """KernelBench-Hard's check has run structural cases of the same kinds since 2026-08-07 (f41cf40): a
    kernel it passed after that failed one of ours on another GPU is "other GPU", not a stronger check."""
    fn = deck02.structural_stress.function
    message = f"shape 1 (long) seed 42 case {fn}(split=3, beta_percent=80): 9 of 4096 elements out of tolerance"
    gpus = ("h100-sxm", "rtx-pro-6000")
    before = classify("wrong", message, "pass", "", deck02, gpus, their_graded=datetime(2026, 8, 4, tzinfo=UTC))
    assert before.stronger and before.cause.endswith("(not run by theirs)")
    after = classify("wrong", message, "pass", "", deck02, gpus, their_graded=THEIRS_STRUCTURAL_SINCE)
    assert not after.stronger and after.cause.startswith("other GPU")


def test_a_step_output_theirs_never_compares_is_a_stronger_check(mega02) -> None:
    """KernelBench-Mega's check.py compares the hidden output, layer 0's S and the MLA c_kv: a `wrong` on
    another state tensor is ours only; one on a tensor both compare is not explained by this rule."""
    def message(part: int, name: str) -> str:
        return (f"shape 0 (context 2048) seed 0 step 0: output {part} ({name}): 56 of 131136 elements out of "
                f"tolerance (atol=0.1, rtol=0.03); max abs diff 3.828")

    k_rope = classify("wrong", message(14, "state[3].k_rope"), "pass", "", mega02, ("h200", "h100-pcie"))
    assert k_rope.stronger and k_rope.explained
    assert k_rope.cause == ("stronger check: state[3].k_rope checked (theirs compares only hidden, state[0].S, "
                            "state[3].c_kv)")
    for part, name in ((0, "hidden"), (1, "state[0].S"), (13, "state[3].c_kv")):
        both = classify("wrong", message(part, name), "pass", "", mega02, ("h200", "h200"))
        assert not both.stronger and not both.explained, name
    assert ("mega", "02_kimi_linear_decode") in THEIRS_COMPARED_OUTPUTS


@pytest.mark.parametrize(("rel", "stronger"), [(0.0323, True), (0.181, True), (0.2, False), (0.311, False)])
def test_an_element_wise_failure_the_cosine_rule_passes_is_a_stronger_check(mega02, rel: float,
                                                                            stronger: bool) -> None:
    """On a tensor both compare, ‖d‖/‖ref‖ = r bounds the cosine below by √(1 − r²): at most about 0.199
    keeps their 0.98, so only our element-wise bound can have failed it; past that, theirs may fail too."""
    message = (f"shape 0 (context 2048) seed 0 step 0: output 0 (hidden): 1 of 2304 elements out of tolerance "
               f"(atol=0.1, rtol=0.03); max abs diff 0.1143, max rel diff 117, worst at (416,): got -0.115234, "
               f"expected -0.000976562; ‖d‖/‖ref‖={rel:.3g}")
    verdict = classify("wrong", message, "pass", "", mega02, ("h200", "h100-pcie"))
    assert verdict.stronger is stronger
    if stronger:
        assert verdict.cause.startswith(f"stronger check: element-wise bound (‖d‖/‖ref‖ {rel:g} keeps the cosine ≥ ")
    cosine_failed = message.replace("1 of 2304 elements out of tolerance (atol=0.1, rtol=0.03); max abs diff "
                                    "0.1143, max rel diff 117, worst at (416,): got -0.115234, expected "
                                    "-0.000976562; ", "cosine 0.85 < 0.98; ")
    assert not classify("wrong", cosine_failed, "pass", "", mega02, ("h200", "h200")).stronger


def test_a_check_both_run_failing_on_another_gpu_is_explained_but_counts(deck07) -> None:
    message = "shape 0 (decode) seed 42 case small_activation: 3 of 12288 elements out of tolerance"
    verdict = classify("wrong", message, "pass", "", deck07, ("h200", "rtx-pro-6000"))
    assert verdict.kind == "differ" and verdict.explained and not verdict.stronger
    assert verdict.cause == "other GPU: fails a check both run on h200, passed on rtx-pro-6000"
    same_gpu = classify("wrong", message, "pass", "", deck07, ("h200", "h200"))
    assert not same_gpu.explained  # on the same GPU such a difference is still to explain
    crashed = classify("runtime_error", "CUDA error: misaligned address", "pass", "", deck07, ("h200", "b200"))
    assert not crashed.explained  # only a verdict on a named check qualifies


def test_a_launch_over_this_gpus_shared_memory_is_another_gpus_difference() -> None:
    message = ("shape 0 (short context) seed 42 case nominal: OutOfResources: out of resource: shared memory, "
               "Required: 239616, Hardware limit: 232448. Reducing block sizes or `num_stages` may help.")
    verdict = classify("runtime_error", message, "pass", "", None, ("h100-sxm", "b200"))
    assert verdict.kind == "differ" and verdict.explained and not verdict.stronger
    assert verdict.cause == ("other GPU: a launch of its asks 239,616 B of shared memory, over the 232,448 B a block "
                             "may have on h100-sxm (Triton refuses it before it runs); passed on b200")
    assert not classify("runtime_error", message, "pass", "", None, ("h100-sxm", "h100-sxm")).explained
    assert not classify("runtime_error", message, "pass", "").explained  # GPUs unknown: still to explain


def test_the_fresh_seed_is_a_stronger_check(deck07) -> None:
    fresh = max(deck07.seeds) + 1000
    verdict = classify("wrong", f"shape 2 (prefill) seed {fresh} case nominal: 4 of 8192 elements out of tolerance",
                       "pass", "", deck07)
    assert verdict.stronger and f"fresh seed {fresh}" in verdict.cause
    deck_seed = deck07.seeds[0]
    verdict = classify("wrong", f"shape 2 (prefill) seed {deck_seed} case nominal: 4 of 8192 elements out of "
                       "tolerance", "pass", "", deck07)
    assert not verdict.stronger and not verdict.explained


@pytest.mark.parametrize(("status", "message", "cause"), [
    ("wrong", "shape 0 (decode) seed 42 case nominal: output dtype float32 != expected bfloat16", "output dtype"),
    ("wrong", "shape 0 (decoder vocabulary) seed 42 case nominal (op audit): row 0 names the same index twice",
     "top-k indices distinct within a row"),
    ("wrong", "shape 1 seed 42 case nominal: reads past the sequence length of sequence 3",
     "reads past the sequence length"),
    ("wrong", "shape 0: a timed call on input set 2 returned a wrong output: 7 of 12288 elements",
     "outputs of the timed calls verified"),
    ("wrong", "shape 1 (K not a multiple of 128) seed 42 case nominal again, its inputs written where the call "
              "before's were (the same addresses and version counters): 15000000 of 16777216 elements out of "
              "tolerance", "new inputs in the last call's memory"),
    ("forbidden", "shape 0: no kernel of its own ran: all 27 kernels are PyTorch or library kernels",
     "no kernel of its own"),
    ("forbidden", "forbidden aten ops ran: aten::topk", "forbidden aten op at run time"),
    ("forbidden", "shape 0: forbidden kernel 'gemv_4bit_kernel'", "forbidden library kernel at run time"),
    ("forbidden", "forbidden op used: 'marlin_kernel.gemm' in helper.py", "forbidden text in a file beside"),
    ("integrity_violation", "shape 0: work escaped the timed stream — the device was still busy",
     "integrity: work escaped the timed stream"),
    ("integrity_violation", "shape 0 (decode) seed 42 case nominal: the solution wrote into input 0",
     "integrity: wrote into its inputs"),
    ("integrity_violation", "shape 0: the runner's clock says 40 back-to-back calls took 0.1 ms",
     "integrity: its clock disagrees"),
])
def test_stronger_checks_by_message(status: str, message: str, cause: str) -> None:
    verdict = classify(status, message, "pass", "")
    assert verdict.kind == "differ" and verdict.stronger and verdict.explained
    assert verdict.cause.startswith("stronger check: ") and cause in verdict.cause


def test_forbidden_text_in_solution_py_is_not_explained() -> None:
    verdict = classify("forbidden", "forbidden op used: 'marlin_kernel.gemm' in solution.py", "pass", "")
    assert not verdict.stronger and not verdict.explained and verdict.cause == f"ours: forbidden {TO_EXPLAIN}"


@pytest.mark.parametrize("status", ["runtime_error", "build_error", "timeout", "oom"])
def test_ours_failing_to_run_is_flagged_to_explain(status: str) -> None:
    verdict = classify(status, "CUDA error: an illegal memory access was encountered", "pass", "")
    assert verdict.kind == "differ" and not verdict.stronger and not verdict.explained
    assert verdict.cause == f"ours fails where theirs passed: {status} {TO_EXPLAIN}"


def test_ours_passing_names_their_failure() -> None:
    verdict = classify("pass", "correct on all 60 checks", "wrong", THEIRS_WRONG)
    assert verdict.kind == "differ" and not verdict.stronger and verdict.explained
    assert verdict.cause == "ours passes where theirs failed: wrong (check.py: the output is incorrect)"
    reason = their_reason("timeout", "KernelBench-Hard (run detail): check.py timed out")
    assert reason == "timeout (check.py timed out)"


def test_ours_only_cases_are_in_their_decks() -> None:
    """Each hand-kept case of ours is a numeric stress case of its deck, and its problem.yaml says it is ours."""
    for (bench, name), cases in OURS_ONLY_CASES.items():
        problem = load_problem(DECKS / bench / name)
        assert cases <= {c.name for c in problem.numeric_stress}
        header = (DECKS / bench / name / "problem.yaml").read_text(encoding="utf-8").split("\nname:")[0]
        for case in cases:
            assert "of ours" in header and f"`{case}`" in header


def test_the_rate_leaves_stronger_checks_and_exclusions_out() -> None:
    def pair(ours: str, theirs: str, message: str = ""):
        return dataclasses.make_dataclass("P", ["verdict"])(classify(ours, message, theirs, ""))

    pairs = (pair("pass", "pass"), pair("wrong", "wrong"), pair("pass", "wrong"),
             pair("forbidden", "pass", "no kernel of its own ran"), pair("needs_other_arch", "pass"))
    a = Agreement(pairs, published=10, regraded=5, gpus=("h200",))  # type: ignore[arg-type]
    assert (a.compared, len(a.agree), len(a.stronger), len(a.other), len(a.excluded)) == (4, 2, 1, 1, 1)
    assert a.rate == pytest.approx(2 / 3)
    assert Agreement((), 0, 0, ()).rate is None


# --------------------------------------------------------------------------------- committed data


@pytest.fixture(scope="module")
def committed() -> SiteData:
    return load_site(DATA, DECKS)


def test_committed_data(committed: SiteData) -> None:
    a = agreement(committed)
    by_run = {p.run.run_id: p for p in a.pairs}
    hy3 = by_run[HY3_07]
    assert hy3.ours.gpu == "h200" and hy3.theirs.is_imported and hy3.theirs.status == "pass"
    assert hy3.verdict.kind == "differ" and hy3.verdict.stronger
    assert "small_scales" in hy3.verdict.cause
    grok = by_run[GROK_03]
    theirs = next(r for r in committed.results if r.run_id == GROK_03 and r.is_imported)
    assert grok.theirs == theirs and theirs.gpu == committed.runs[GROK_03].gpu
    assert grok.verdict.kind == ("agree" if theirs.status == grok.ours.status == "pass" else "differ")
    assert grok.verdict.kind == "agree"  # today: both pass
    # Only published kernels count: house and calibration runs graded on the h200 are no pair.
    assert all(not p.run.is_house for p in a.pairs)
    assert a.published == len({r.run_id for r in committed.results if r.is_imported})
    assert a.regraded == len({p.run.run_id for p in a.pairs}) <= a.published  # kernels; pairs: one per our GPU
    assert len(a.pairs) == len({(p.run.run_id, p.ours.gpu) for p in a.pairs}) >= a.regraded
    assert not a.unexplained  # the acceptance: every disagreement explained


# ------------------------------------------------------------------------------------------ the page


def _methodology(data: SiteData) -> bytes:
    page = next(p for p in plan(data) if p.kind == "methodology")
    return _render(make_env(), page, _site(data, None), None)


def _section(html: bytes):
    tree = html5lib.parse(html, treebuilder="etree", namespaceHTMLElements=False)
    section = tree.find(".//section[@id='agreement']")
    assert section is not None
    return section


def test_the_methodology_page_lists_the_differences(committed: SiteData) -> None:
    html = _methodology(committed)
    html5lib.HTMLParser(strict=True).parse(html)
    section = _section(html)
    words = text(section)
    a = agreement(committed)
    assert "Where we differ from the original grader" in words
    graded_on = ", ".join(gpu_label(committed, gpu) for gpu in a.gpus)  # every GPU of ours, by its name
    assert "NVIDIA H200" in graded_on
    assert f"{a.regraded} of {a.published} published kernels regraded so far (on {graded_on})" in words
    figures = section.find(".//dl")
    facts = dict(zip((text(dt) for dt in figures.iterfind("dt")), (text(dd) for dd in figures.iterfind("dd")),
                     strict=True))
    assert facts["compared"].startswith(f"{a.compared} ")
    assert (facts["agree"], facts["differ: a stronger check of ours"], facts["differ: other causes"],
            facts["excluded"]) == (str(len(a.agree)), str(len(a.stronger)), str(len(a.other)), str(len(a.excluded)))
    assert facts["agreement"].startswith(f"{pct(a.rate)} = agree / (agree + other differences)")
    agreeing, compared = a.per_kernel
    assert compared < len(a.agree) + len(a.other)  # kernels graded on two GPUs count once
    assert facts["agreement per kernel"].startswith(f"{pct(agreeing / compared)} = {agreeing} / {compared}: each")
    tables = section.findall(".//table")
    assert len(tables) == bool(a.stronger) + bool(a.other)  # a table for each kind of difference present
    rows = [tbody for table in tables for tbody in table.iterfind("./tbody")]  # a tbody per difference
    assert len(rows) == len(a.stronger) + len(a.other)
    row = next(tr for tr in rows if HY3_07 in text(tr) and "NVIDIA H200" in text(tr))  # also on the H100 SXM
    assert "stronger check: stress case small_scales (ours only)" in text(row)
    assert row.find(".//th/a").get("href") == f"../runs/h200/{HY3_07}/"
    assert len(a.pairs) > a.regraded  # kernels graded on both the H200 and the H100 SXM: compared on each
    assert f"({len(a.pairs)} gradings of {a.regraded} kernels)" in words
    assert "unexplained" not in (row.get("class") or "")


def test_an_unexplained_difference_is_flagged_on_the_page(committed: SiteData) -> None:
    results = tuple(dataclasses.replace(r, status="runtime_error", message="CUDA error: an illegal memory access")
                    if r.run_id == GROK_03 and r.gpu == "h200" else r for r in committed.results)
    html = _methodology(dataclasses.replace(committed, results=results))
    section = _section(html)
    assert "1 to explain" in text(section)
    rows = [tbody for tbody in section.iterfind(".//tbody") if "unexplained" in tbody.get("class", "").split()]
    assert len(rows) == 1 and GROK_03 in text(rows[0])
    assert f"not explained yet ours fails where theirs passed: runtime_error {TO_EXPLAIN}" in text(rows[0])


def test_a_stress_case_theirs_added_after_grading_the_kernel_is_a_stronger_check(deck07) -> None:
    """fable-5's 03 passed on 2026-06-11, graded by check.py files with no stress case; a stress case
    both decks have now is a check theirs never ran on it, and the same case after that date is not."""
    message = f"shape 0 (decode) seed 42 case {deck07.numeric_stress[0].name}: 12 of 4096 elements out of tolerance"
    before = THEIRS_NUMERIC_STRESS_SINCE.replace(day=11)
    verdict = classify("wrong", message, "pass", "", deck07, ("h200", "rtx-pro-6000"), their_graded=before)
    assert verdict.stronger and "2026-06-11" in verdict.cause
    after = datetime(2026, 7, 9, tzinfo=UTC)
    verdict = classify("wrong", message, "pass", "", deck07, ("h200", "rtx-pro-6000"), their_graded=after)
    assert not verdict.stronger and verdict.cause.startswith("other GPU")


def test_evidence_explains_a_difference_and_still_counts() -> None:
    why = next(iter(EVIDENCE.values()))
    verdict = classify("pass", "correct on all 80 checks", "wrong", THEIRS_WRONG, evidence=why)
    assert verdict.kind == "differ" and verdict.explained and not verdict.stronger
    assert verdict.cause.endswith(why) and verdict.cause.startswith("ours passes where theirs failed")
    assert classify("pass", "", "pass", "", evidence=why).kind == "agree"  # evidence never turns a verdict


def test_every_evidence_entry_is_a_disagreement_in_the_data() -> None:
    """An entry whose kernel now agrees (or was never graded) is stale: the table would not show it. A kernel
    whose pass is held back until its regrade (its problem's baselines measured by a newer method) is not
    in the table meanwhile, and keeps its entry, as does a kernel graded into data/held, whose problem joins its
    board once whole there."""
    data = load_site(DATA, DECKS)
    pairs = {p.run.run_id: p for p in agreement(data).pairs}
    held = {r.run_id for r in data.superseded}
    for table in DATA.glob("held/*/results.parquet"):
        held |= set(pq.read_table(table, columns=["run_id"]).column("run_id").to_pylist())
    for run_id in EVIDENCE:
        assert (run_id in pairs and pairs[run_id].verdict.kind == "differ") or (
            run_id not in pairs and run_id in held), run_id


def test_our_limit_replaces_a_stronger_class_and_counts_against_the_figure() -> None:
    """As claude-opus-4-8's Mega kernel 075926 was until grader 0.5.1: a timed call's probes missed (the class
    would be "stronger check: outputs of the timed calls verified"), but the miss was our grader's limit, so
    it counted against the figure."""
    message = ("shape 1: timed call 114 (input set 0, output 0) returned a wrong output: 6 of 32 probed elements "
               "out of tolerance")
    assert classify("wrong", message, "pass").stronger
    why = "a timed call's router flip judged by the element-wise bound"
    verdict = classify("wrong", message, "pass", limit=why)
    assert verdict.kind == "differ" and verdict.explained and not verdict.stronger
    assert verdict.cause == f"{OUR_LIMIT}{why}"
    assert classify("pass", "", "pass", "", limit=why).kind == "agree"  # a limit never turns a verdict


def test_every_limit_entry_is_a_disagreement_in_the_data_that_counts() -> None:
    a = agreement(load_site(DATA, DECKS))
    pairs = {p.run.run_id: p for p in a.pairs}
    for run_id in OUR_LIMITS:
        assert run_id in pairs and pairs[run_id].verdict.kind == "differ", run_id
        assert pairs[run_id] in a.other and pairs[run_id] not in a.stronger


def test_a_kernel_that_differs_on_one_of_its_gpus_does_not_agree_per_kernel(committed: SiteData) -> None:
    a = agreement(committed)
    twice = next(run_id for run_id in {p.run.run_id for p in a.agree}
                 if sum(p.run.run_id == run_id and p.verdict.kind == "agree" for p in a.pairs) == 2)
    first = next(p for p in a.pairs if p.run.run_id == twice)
    differing = dataclasses.replace(first, verdict=dataclasses.replace(first.verdict, kind="differ"))
    changed = dataclasses.replace(a, pairs=tuple(differing if p is first else p for p in a.pairs))
    agreeing, compared = a.per_kernel
    assert changed.per_kernel == (agreeing - 1, compared)
    assert len(changed.agree) == len(a.agree) - 1 and len(changed.other) == len(a.other) + 1

"""A regrade in progress: on a board kernelboard measured, a model whose published runs on the board's
problems are not all graded on its GPU yet is listed unranked, with its counts, and never sets the best.

Here on the committed data (the H200 board, where a few imported KernelBench-Hard kernels have been
regraded so far); on the fixture site with its imported board, in test_site_imported.py (it shares that
site), where Fable 5 has two published runs (IMP_SPEED, IMP_OFF) not graded on the h200, and Orbit 2 one
(IMP_FAIL).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kernelboard.sitegen.board import Board, Row, build_boards
from kernelboard.sitegen.load import SiteData, load_site

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
DECKS = REPO / "eval" / "decks"


def _rows(board: Board) -> dict[str, Row]:
    return {r.model: r for r in board.rows}


# ---------------------------------------------------------------------------------- committed data


@pytest.fixture(scope="module")
def committed() -> SiteData:
    return load_site(DATA, DECKS)


@functools.cache
def _all_runs() -> dict[str, dict]:
    runs: dict[str, dict] = {}
    for folder in sorted((DATA / "results").iterdir()):
        if (folder / "runs.parquet").is_file():
            runs.update({r["run_id"]: r for r in pq.read_table(folder / "runs.parquet").to_pylist()})
    return runs


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3])


#: The grader version since which torch.compile baselines are timed as today (eval/settings.py says so
#: too; written out here so the test does not read the rule it checks from the code under test).
COMPILE_METHOD_SINCE = (0, 4, 2)
#: The grader that accepts a Mega step's state keys of its own: earlier refusals are held back (SUPERSEDED_VERDICTS).
STATE_KEYS_SINCE = (0, 5, 0)
#: The grader that takes a Mega timed call returning another expert choice's output as that choice.
RUNNER_UPS_SINCE = (0, 5, 1)
#: The grader that keeps a CUDA-graph replay missing the reference out of `graph_ms` instead of failing the kernel.
GRAPH_NOTE_SINCE = (0, 5, 9)
#: The grader that names a solution's change of torch's global switches instead of failing it integrity_violation.
SWITCHES_SINCE = (0, 5, 12)


@functools.cache
def _superseded_ids(gpu: str) -> frozenset[str]:
    """Run ids of `gpu`'s passes timed before COMPILE_METHOD_SINCE on a problem whose compile baselines on
    `gpu` were measured since, and of its verdicts a later rule changed (the *_SINCE graders above), read
    straight off the parquet tables."""
    runs = _all_runs()
    folder = DATA / "results" / gpu
    rebaselined = {(b["bench"], b["problem"]) for b in pq.read_table(folder / "baselines.parquet").to_pylist()
                   if b["variant"].startswith("compile") and _version(b["grader_version"]) >= COMPILE_METHOD_SINCE}
    return frozenset(r["run_id"] for r in pq.read_table(folder / "results.parquet").to_pylist()
                     if not r["measured_by"].endswith("(imported)") and (
                         (r["status"] == "pass"
                          and (runs[r["run_id"]]["bench"], runs[r["run_id"]]["problem"]) in rebaselined
                          and _version(r["grader_version"]) < COMPILE_METHOD_SINCE)
                         or (_version(r["grader_version"]) < STATE_KEYS_SINCE
                             and "StepOutputError: state[" in (r["message"] or "")
                             and "returned has keys" in r["message"])
                         or (_version(r["grader_version"]) < RUNNER_UPS_SINCE
                             and runs[r["run_id"]]["problem"] == "02_kimi_linear_decode"
                             and "timed call" in (r["message"] or "") and "returned a wrong output" in r["message"])
                         or (_version(r["grader_version"]) < GRAPH_NOTE_SINCE
                             and "the CUDA-graph replay on input set" in (r["message"] or ""))
                         or (_version(r["grader_version"]) < SWITCHES_SINCE
                             and (r["message"] or "").startswith("torch global state changed"))))


def _counts(model: str, gpu: str, bench: str, problems: set[str]) -> tuple[int, int]:
    """(graded on `gpu`, published) runs of a model on a board's problems, read straight off the parquet
    tables of every GPU folder (not through sitegen); a superseded pass is not graded, and a run whose agent
    left no kernel (no solution hash) is not published for regrading."""
    runs = _all_runs()
    graded = set(pq.read_table(DATA / "results" / gpu / "results.parquet").column("run_id").to_pylist())
    graded -= _superseded_ids(gpu)
    mine = [i for i, r in runs.items() if (r["model"], r["bench"]) == (model, bench) and r["problem"] in problems
            and r["solution_sha256"] is not None]
    return sum(1 for i in mine if i in graded), len(mine)


def test_the_committed_h200_board_lists_grok_unranked_with_its_counts(committed: SiteData) -> None:
    board = next(b for b in build_boards(committed) if (b.gpu, b.bench) == ("h200", "hard"))
    assert not board.is_imported
    grok = _rows(board)["grok-4.5"]
    graded, published = _counts("grok-4.5", "h200", "hard", {p.name for p in board.problems})
    assert 1 <= graded < published  # one paged-attention kernel regraded so far, of every grok-4.5 run
    assert grok.regrade is not None and (grok.regrade.graded, grok.regrade.published) == (graded, published)
    assert grok.regrade.text == f"regrade in progress: {graded} of {published} published runs graded on this GPU"
    assert (grok.rank, grok.score) == (None, None)
    assert grok.passes >= 1  # its graded cells still show
    assert not any(c is not None and c.is_best for c in grok.cells)
    # every AI row still missing a grade here is unranked; nothing on the board is ranked above it by default
    for row in board.rows:
        if row.is_house:
            assert row.regrade is None
            continue
        g, p = _counts(row.model, "h200", "hard", {q.name for q in board.problems})
        assert (row.regrade is not None) == (g < p), row.model
        if row.regrade is not None:
            assert row.rank is None and row.score is None
    kinds = ["ranked" if r.rank is not None else "regrade" if r.regrade else "house" if r.is_house else "unscored"
             for r in board.rows]
    assert kinds == sorted(kinds, key=["ranked", "regrade", "unscored", "house"].index)  # in-progress after ranked


def test_a_published_run_whose_agent_left_no_kernel_holds_no_rank_back(committed: SiteData) -> None:
    """gpt-5.5's 07 run 20260620_111851 wrote no solution (KernelBench-Hard: "the agent wrote no solution"):
    there is no kernel to regrade, on this GPU or any. Once every gpt-5.5 run with a kernel on the H100
    SXM board's problems has a result there (here its graded 03 row copied onto the others), gpt-5.5 is
    ranked; counting its kernel-less run kept it a regrade in progress for good."""
    from dataclasses import replace

    kernel_less = "20260620_111851_codex_gpt-5.5_07_w4a16_gemm"
    assert _all_runs()[kernel_less]["solution_sha256"] is None
    assert kernel_less not in {r.run_id for r in committed.results if r.gpu == "h100-sxm"}
    board = next(b for b in build_boards(committed) if (b.gpu, b.bench) == ("h100-sxm", "hard"))
    problems = {p.name for p in board.problems}
    theirs = [i for i, r in _all_runs().items() if (r["model"], r["bench"]) == ("gpt-5.5", "hard")
              and r["problem"] in problems and r["solution_sha256"] is not None]
    graded = [r for r in committed.results if r.gpu == "h100-sxm" and r.run_id in theirs]
    assert graded  # one of its rows to copy onto the rest (on 2026-12-05 its regrade was in progress there)
    filled = tuple(replace(graded[0], run_id=i) for i in theirs if i not in {r.run_id for r in graded})
    data = replace(committed, results=(*committed.results, *filled))
    board = next(b for b in build_boards(data) if (b.gpu, b.bench) == ("h100-sxm", "hard"))
    gpt = _rows(board)["gpt-5.5"]
    assert gpt.regrade is None and gpt.score is not None and gpt.rank is not None


def test_committed_imported_boards_are_unchanged(committed: SiteData) -> None:
    imported = [b for b in build_boards(committed) if b.is_imported]
    assert imported
    for board in imported:
        # every run of an imported folder has its result row there, by construction
        runs = set(pq.read_table(DATA / "results" / board.gpu / "runs.parquet").column("run_id").to_pylist())
        results = set(pq.read_table(DATA / "results" / board.gpu / "results.parquet").column("run_id").to_pylist())
        assert runs == results, board.gpu
        for row in board.rows:
            assert row.regrade is None
            assert (row.rank is None) == (row.is_house or row.score is None), (board.gpu, row.model)


# ------------------------------------------------------------------- results timed by an older method


def test_the_committed_superseded_results_are_those_the_tables_say(committed: SiteData) -> None:
    """On the committed data, sitegen holds back exactly the results the parquet tables say, and nothing
    else. On 2026-12-02 grader 0.5.2 graded again the four Mega kernels 0.4.8 had refused (three for state
    keys of their own, which 0.5.0 accepts; one for a timed call that 0.5.1 takes as another expert choice):
    their new rows are shown, and the same rows with the old verdicts would be held back."""
    from dataclasses import replace

    from kernelboard.sitegen.load import split_superseded

    held_on = {(run_id, gpu) for gpu in ("h200", "h100-sxm") for run_id in _superseded_ids(gpu)}
    held = {run_id for run_id, _ in held_on}
    assert {(r.run_id, r.gpu) for r in committed.superseded} == held_on
    assert not held_on & {(r.run_id, r.gpu) for r in committed.results}  # a run may be shown on another GPU
    old = {"20260618_150545_kimi-claude_kimi-k2.7-code_02_kimi_linear_decode":
           "shape 0 (context 2048) seed 0 step 0 (op audit): StepOutputError: state[3] returned has keys "
           "['c_kv', 'k_nope', 'k_rope', 'v'], expected ['c_kv', 'k_rope']",
           "20260618_075926_claude_claude-opus-4-8_02_kimi_linear_decode":
           "shape 1: timed call 114 (input set 0, output 0) returned a wrong output: 6 of 32 probed elements out "
           "of tolerance"}
    regraded = {r.run_id: r for r in committed.results if r.gpu == "h200" and r.run_id in old}
    assert set(regraded) == set(old) and all(r.grader_version == "0.5.2" and r.is_pass for r in regraded.values())
    as_before = tuple(replace(r, grader_version="0.4.8", status="wrong", message=old[r.run_id])
                      for r in regraded.values())
    shown, back = split_superseded(committed.runs, (*committed.results, *committed.superseded, *as_before),
                                   committed.baselines)
    assert {r.run_id for r in back} == held | set(old)
    assert not any(r is s for r in as_before for s in shown)
    assert all(any(r is s for s in shown) for r in regraded.values())


def test_superseded_passes_are_on_no_page_but_the_methodologys(committed: SiteData, tmp_path: Path) -> None:
    """A copy of the committed data in which 01's compile baselines on the H200 were measured by today's
    method: every 01 pass graded before it is on no board, problem page or run page of the H200, and is
    listed on the methodology page; 01's failures keep their place (a verdict carries no speed)."""
    from kernelboard.sitegen import build_site

    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    path = data / "results" / "h200" / "baselines.parquet"
    table = pq.read_table(path)
    rows = [dict(r, grader_version="0.4.5") if r["problem"] == "01_fp8_gemm" and r["variant"].startswith("compile")
            else r for r in table.to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    site = load_site(data, DECKS)
    held = {r.run_id for r in site.superseded}
    assert {r.run_id for r in site.superseded if site.runs[r.run_id].problem == "01_fp8_gemm"} == {
        r.run_id for r in committed.results if r.gpu == "h200" and r.is_pass
        and r.run_id.endswith("_01_fp8_gemm") and _version(r.grader_version) < COMPILE_METHOD_SINCE} != set()
    failures = {r.run_id for r in site.results
                if r.gpu == "h200" and not r.is_pass and r.run_id.endswith("_01_fp8_gemm")}
    board = next(b for b in build_boards(site) if (b.gpu, b.bench) == ("h200", "hard"))
    cells = {c.result.run_id for row in board.rows for c in row.cells if c is not None}
    assert cells and not held & cells
    out = build_site(data, DECKS, tmp_path / "dist").out_dir
    methodology = (out / "methodology" / "index.html").read_text()
    listed = methodology.split('id="superseded"', 1)[1].split("</ul>", 1)[0]
    assert all(f"<code>{i}</code>" in listed for i in held) and listed.count("<li>") == len(held)
    assert not any((out / "runs" / "h200" / i).exists() for i in held)
    assert failures and all((out / "runs" / "h200" / i).is_dir() for i in failures)
    linked = [f"h200/{i}" for i in held]  # the same runs' imported results on other GPUs are still listed
    assert not any(link in page.read_text() for page in out.rglob("*.html") for link in linked)


def test_a_problem_measured_again_supersedes_only_its_older_rows(committed: SiteData) -> None:
    """The rule on its own: once 01's compile baselines on the H200 are re-measured by a grader of today's
    method, every 01 row graded before that method is held back, and nothing else moves; imported results
    (another grader's) never are."""
    from dataclasses import replace

    from kernelboard.sitegen.load import split_superseded

    everything = (*committed.results, *committed.superseded)
    same, _ = split_superseded(committed.runs, everything, committed.baselines)
    assert [r.run_id for r in same] == [r.run_id for r in committed.results]
    moved = tuple(replace(b, grader_version="0.4.4") if b.problem == "01_fp8_gemm" and b.variant.startswith("compile")
                  else b for b in committed.baselines)
    gpus = {b.gpu for b in moved if b.problem == "01_fp8_gemm" and b.variant.startswith("compile")}
    shown, held = split_superseded(committed.runs, everything, moved)
    newly = {(r.gpu, r.run_id) for r in held} - {(r.gpu, r.run_id) for r in committed.superseded}
    old_01 = {(r.gpu, r.run_id) for r in everything if r.gpu in gpus and r.is_pass and not r.is_imported
              and committed.runs[r.run_id].problem == "01_fp8_gemm"
              and _version(r.grader_version) < COMPILE_METHOD_SINCE}
    assert old_01 and newly == old_01
    imported = [r for r in everything if r.is_imported and r.gpu in gpus]
    assert all(any(r is s for s in shown) for r in imported)

"""`kernelboard eval todo`: what is left to grade on a GPU's board, in the order that ranks AI models soonest,
and `--only`'s order as the grading order.

On made-up submission folders (the order's rules one by one), then on the committed data, where the runs the
queue says hold a rank back must be exactly the ones the site's board holds each model's rank back for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kernelboard.cli import main
from kernelboard.eval.schedule import EvalOptions, select_submissions
from kernelboard.eval.settings import result_current
from kernelboard.eval.submission import Submission
from kernelboard.eval.todo import plan_todo, todo

REPO = Path(__file__).resolve().parents[1]


def _sub(root: Path, run_id: str, problem: str, model: str, harness: str = "agent", kernel: str | None = "pass\n"
         ) -> Submission:
    folder = root / run_id
    folder.mkdir(parents=True)
    if kernel is not None:
        (folder / "solution.py").write_text(kernel)
    return Submission(run_id, folder, {"problem": problem, "model": model, "harness": harness})


@pytest.fixture
def subs(tmp_path: Path) -> dict[str, Submission]:
    """P1 is on the board (a graded run), P2 and P3 are not started; P3 has fewer runs left than P2."""
    made = [
        ("a1", "P1", "alpha"), ("b1", "P1", "beta"), ("b2", "P1", "beta"), ("b3", "P1", "beta"),
        ("c1", "P1", "gamma"), ("c2", "P1", "gamma"),
        ("p2a", "P2", "alpha"), ("p2b", "P2", "beta"), ("p2c", "P2", "beta"), ("p3a", "P3", "gamma"),
    ]
    out = {run_id: _sub(tmp_path, run_id, problem, model) for run_id, problem, model in made}
    out["h1"] = _sub(tmp_path, "h1", "P1", "kernelboard-house", harness="house")
    out["n1"] = _sub(tmp_path, "n1", "P1", "alpha", kernel=None)  # its agent left no kernel
    return out


def _ids(subs: tuple[Submission, ...]) -> list[str]:
    return [s.run_id for s in subs]


def test_the_queue_ranks_the_model_with_fewest_runs_left_first_then_starts_one_problem_at_a_time(
        subs: dict[str, Submission]) -> None:
    graded = {"b1": subs["b1"].solution_sha256()}  # beta has one of its three P1 runs graded
    plan = plan_todo("h200", subs.values(), graded, shown=["b1"])
    assert _ids(plan.queue) == [
        "a1",  # alpha: one P1 run holds its rank back (n1 has no kernel to regrade)
        "b2", "b3",  # beta: two
        "c1", "c2",  # gamma: two, after beta by name
        "n1", "h1",  # the kernel-less run and the house run hold no AI model's rank back (models by name)
        "p3a",  # then the problem not started with the fewest runs
        "p2a", "p2b", "p2c",  # then the other, alpha (one run) before beta (two)
    ]
    assert plan.blocking == 5 and _ids(plan.now()) == _ids(plan.queue)[:7]  # a call is given the board's problems
    assert plan.ranked_after() == {"alpha": 1, "beta": 3, "gamma": 5}
    assert [(p.problem, p.graded, p.total, p.on_board) for p in plan.progress] == [
        ("P1", 1, 8, True), ("P2", 0, 3, False), ("P3", 0, 1, False)]


def test_a_shown_row_to_be_graded_again_comes_after_the_runs_holding_ranks(subs: dict[str, Submission]) -> None:
    graded = {"b1": "another solution's hash", "b2": subs["b2"].solution_sha256()}
    # b1 (another solution) and c1 (an earlier grader's row) are shown on the board: no rank waits on them
    plan = plan_todo("h200", subs.values(), graded, shown=["b1", "b2", "c1"])
    assert _ids(plan.queue)[:plan.blocking] == ["a1", "b3", "c2"]
    assert _ids(plan.queue)[plan.blocking:plan.ready] == ["n1", "b1", "c1", "h1"]
    assert plan.progress[0].graded == 1


def test_a_problem_on_the_board_whose_baselines_are_to_be_measured_again_waits_its_turn(
        subs: dict[str, Submission]) -> None:
    """P2 has a graded run but no baselines the current grader reuses: it is taken whole after P1 (a batch
    given it would measure its baselines first), and before P3, which is not on the board."""
    graded = {"b1": subs["b1"].solution_sha256(), "p2a": subs["p2a"].solution_sha256()}
    plan = plan_todo("h200", subs.values(), graded, shown=["b1", "p2a"], measured={"P1", "P3"})
    ids = _ids(plan.queue)
    assert ids == ["a1", "b2", "b3", "c1", "c2", "n1", "h1", "p2b", "p2c", "p3a"]
    assert _ids(plan.now()) == ids[:7]
    assert [(p.problem, p.on_board, p.measured) for p in plan.progress] == [
        ("P1", True, True), ("P2", True, False), ("P3", False, True)]
    p1_done = {s.run_id: s.solution_sha256() for s in subs.values() if s.problem == "P1"} | graded
    assert _ids(plan_todo("h200", subs.values(), p1_done, shown=p1_done, measured={"P1", "P3"}).now()) == ["p2b", "p2c"]


def test_nothing_on_the_board_yet_takes_whole_problems_in_turn(subs: dict[str, Submission]) -> None:
    plan = plan_todo("h100-sxm", subs.values(), {}, shown=[])
    assert plan.blocking == 0 and plan.ranked_after() == {}
    assert _ids(plan.queue)[:4] == ["p3a", "p2a", "p2b", "p2c"]
    assert _ids(plan.now()) == ["p3a"]  # one problem started at a time: its baselines, not every problem's
    assert set(_ids(plan.queue)[4:]) == {"a1", "b1", "b2", "b3", "c1", "c2", "h1", "n1"}


def test_only_globs_give_the_grading_order(tmp_path: Path) -> None:
    for run_id in ("20260101_a_01_x", "20260102_b_01_x", "20260103_c_02_y"):
        folder = tmp_path / run_id
        folder.mkdir()
        (folder / "solution.py").write_text("pass\n")
        (folder / "run.yaml").write_text(f"problem: {run_id[-4:]}\nmodel: m\nharness: h\nagent_outcome: completed\n"
                                         "gpu: h200\n")
    opts = EvalOptions(deck=tmp_path, submissions=tmp_path, out=tmp_path,
                       only=("20260103_c_02_y", "*_01_x"), exclude=("20260101_*",))
    assert [s.run_id for s in select_submissions(opts)] == ["20260103_c_02_y", "20260102_b_01_x"]
    everything = EvalOptions(deck=tmp_path, submissions=tmp_path, out=tmp_path)
    assert [s.run_id for s in select_submissions(everything)] == sorted(
        ["20260101_a_01_x", "20260102_b_01_x", "20260103_c_02_y"])


def test_on_the_committed_data_the_queues_first_runs_are_those_the_board_holds_ranks_back_for(
        tmp_path: Path) -> None:
    """The eval side (submission folders, `--resume`'s rule) and the site (results tables, the regrade rule)
    agree: the runs the queue puts first are exactly the published runs the H100 SXM and H200 boards count
    as not graded yet (on problems whose baselines are current), and the rows it grades again after them are
    ones `--resume` does not count; the CLI writes that queue, one run_id a line."""
    from kernelboard.sitegen.board import build_boards, regrades
    from kernelboard.sitegen.load import load_site

    site = load_site(REPO / "data", REPO / "eval" / "decks")
    mega = todo(EvalOptions(deck=REPO / "eval/decks/mega", submissions=REPO / "data/submissions/mega",
                            out=REPO / "data/results"), "h200")
    board = next(b for b in build_boards(site) if (b.gpu, b.bench) == ("h200", "mega"))
    waited = regrades(site, "h200", "mega", {p.name for p in board.problems})
    assert mega.blocking == sum(r.published - r.graded for r in waited.values())  # kernels without a row: not waited on
    result = CliRunner().invoke(main, [
        "eval", "todo", "--deck", str(REPO / "eval/decks/hard"), "--submissions", str(REPO / "data/submissions/hard"),
        "--out", str(REPO / "data/results"), "--gpu", "h100-sxm", "--gpu", "h200",
        "--queue", str(tmp_path / "queue-{gpu}.txt")])
    assert result.exit_code == 0, result.output
    for gpu in ("h100-sxm", "h200"):
        board = next(b for b in build_boards(site) if (b.gpu, b.bench) == (gpu, "hard"))
        problems = {p.name for p in board.problems}
        graded_here = {r.run_id for r in site.results if r.gpu == gpu}
        imported = {r.run_id for r in site.results if r.is_imported}
        pending = {run.run_id for run in site.runs.values()
                   if run.bench == "hard" and run.problem in problems and not run.is_house and run.run_id in imported
                   and run.solution_sha256 is not None and run.run_id not in graded_here}
        assert sum(r.published - r.graded for r in regrades(site, gpu, "hard", problems).values()) == len(pending)
        plan = todo(EvalOptions(deck=REPO / "eval/decks/hard", submissions=REPO / "data/submissions/hard",
                                out=REPO / "data/results"), gpu)
        assert {p.problem for p in plan.progress if p.on_board} == problems
        problems = {p.problem for p in plan.progress if p.on_board and p.measured}  # ready: baselines measured
        assert problems  # 03, 05 and 07 on both GPUs
        pending = {i for i in pending if site.runs[i].problem in problems}
        assert set(_ids(plan.queue[:plan.blocking])) == pending
        regraded = [s for s in plan.queue[plan.blocking:plan.ready] if s.run_id in graded_here]
        assert not any(result_current(r.grader_version, r.message, site.runs[r.run_id].problem, r.status, r.run_id)
                       for r in site.results if r.gpu == gpu and r.run_id in {s.run_id for s in regraded})
        written = (tmp_path / f"queue-{gpu}.txt").read_text().split()
        assert written == _ids(plan.now())
        if plan.ready:  # the board's ready problems have runs left: a call gets those and nothing else
            assert written == _ids(plan.queue[:plan.ready])
            assert {s.problem for s in plan.now()} <= problems  # nothing of a problem not on the board
        else:  # else the next problem, whole
            assert len({s.problem for s in plan.now()}) <= 1
        assert f"{gpu}: {len(plan.queue)} runs left of " in result.output


def test_several_boards_into_one_queue_file_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["eval", "todo", "--gpu", "h200", "--gpu", "h100-sxm",
                                       "--queue", str(tmp_path / "q.txt")])
    assert result.exit_code == 2 and "'{gpu}'" in result.output

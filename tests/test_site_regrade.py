"""A regrade in progress: on a board kernelboard measured, a model whose published runs on the board's
problems are not all graded on its GPU yet is listed unranked, with its counts, and never sets the best.

Two sources: the committed data (the H200 board, where a few imported KernelBench-Hard kernels have been
regraded so far), and the fixture site with its imported h100-pcie board (tests/site_fixtures.py), where
Fable 5 has one run graded on the h200 and two published runs (IMP_SPEED, IMP_OFF) that are not, and
Orbit 2 one graded and one (IMP_FAIL) not.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from site_fixtures import GPU, IMP_FAIL, IMPORTED_GPU, PASS, WRONG, SiteInputs, add_imported_board, make_site_inputs
from site_pages import parse, text

from kernelboard.sitegen import build_site
from kernelboard.sitegen.board import ORDERING_RULE, REGRADE_HELP, Board, Row, build_boards
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


def _counts(model: str, gpu: str, bench: str, problems: set[str]) -> tuple[int, int]:
    """(graded on `gpu`, published) runs of a model on a board's problems, read straight off the parquet
    tables of every GPU folder (not through sitegen)."""
    runs: dict[str, dict] = {}
    for folder in sorted((DATA / "results").iterdir()):
        if (folder / "runs.parquet").is_file():
            runs.update({r["run_id"]: r for r in pq.read_table(folder / "runs.parquet").to_pylist()})
    graded = set(pq.read_table(DATA / "results" / gpu / "results.parquet").column("run_id").to_pylist())
    mine = [i for i, r in runs.items() if (r["model"], r["bench"]) == (model, bench) and r["problem"] in problems]
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


# ----------------------------------------------------------------------------------- fixture site


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> SiteInputs:
    made = make_site_inputs(tmp_path_factory.mktemp("regrade"))
    add_imported_board(made)
    return made


@pytest.fixture(scope="module")
def data(inputs: SiteInputs) -> SiteData:
    return load_site(inputs.data_dir, inputs.decks_dir)


@pytest.fixture(scope="module")
def site(inputs: SiteInputs) -> Path:
    out = inputs.data_dir.parent / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    return out


def _h200(data: SiteData) -> Board:
    return next(b for b in build_boards(data) if b.gpu == GPU)


def test_a_model_with_ungraded_published_runs_is_unranked_and_never_the_best(data: SiteData) -> None:
    board = _h200(data)
    rows = _rows(board)
    fable, orbit = rows["fable-5"], rows["orbit-2"]
    assert fable.regrade is not None and (fable.regrade.graded, fable.regrade.published) == (0, 2)
    assert fable.regrade.text == "regrade in progress: 0 of 2 published runs graded on this GPU"
    assert orbit.regrade is not None and (orbit.regrade.graded, orbit.regrade.published) == (0, 1)
    assert (fable.rank, fable.score, orbit.rank, orbit.score) == (None, None, None, None)
    cell = fable.cells[0]
    assert cell is not None and cell.run.run_id == PASS and cell.state == "pass"  # the graded cell still shows
    assert not cell.is_best and cell.value is not None
    # with no ranked AI model passing, nothing sets the best: no share, the house kernel's included
    assert all(c is None or c.share is None for r in board.rows for c in r.cells)
    assert [r.display for r in board.rows] == ["Fable 5", "Orbit 2", "Kinetic K3 <beta>", "kernelboard house",
                                               "Reference (eager PyTorch)"]
    imported = next(b for b in build_boards(data) if b.gpu == IMPORTED_GPU)
    assert [(r.display, r.rank, r.regrade) for r in imported.rows] == [
        ("Nova 4", 1, None), ("Fable 5", 2, None), ("Orbit 2", 3, None)]


def test_a_fully_graded_model_is_ranked_again(data: SiteData, site_inputs: SiteInputs) -> None:
    # regrade Orbit 2's imported run on the h200: all its published runs there are graded now
    base = next(r for r in data.results if (r.run_id, r.gpu) == (WRONG, GPU))
    regraded = replace(data, results=(*data.results, replace(base, run_id=IMP_FAIL)))
    rows = _rows(_h200(regraded))
    assert (rows["orbit-2"].regrade, rows["orbit-2"].rank, rows["orbit-2"].score) == (None, 1, 0.0)
    assert rows["fable-5"].regrade is not None and rows["fable-5"].rank is None  # Fable 5 still is not
    # the plain fixture (no imported board): every published run is graded, Fable 5 ranked first and the best
    plain = _rows(_h200(load_site(site_inputs.data_dir, site_inputs.decks_dir)))
    assert (plain["fable-5"].regrade, plain["fable-5"].rank, plain["fable-5"].score) == (None, 1, 1.0)
    assert plain["fable-5"].cells[0] is not None and plain["fable-5"].cells[0].is_best


def test_the_pages_say_so(site: Path) -> None:
    want = "regrade in progress: 0 of 2 published runs graded on this GPU"
    home = parse(site / "index.html")
    row = next(tr for tr in home.iterfind(f".//section[@id='hard-{GPU}']//table[@class='leaderboard']/tbody/tr")
               if "Fable 5" in text(tr.find("th")))
    assert want in text(row.find("th"))
    assert text(row.find("td[@class='rank']")) == "—"
    assert "not ranked yet" in text(row.find("td[@data-label='Score']"))
    span = row.find(".//span[@class='sub regrade']")
    assert span is not None and span.get("title") == REGRADE_HELP and "not failures" in REGRADE_HELP
    gpu = parse(site / "gpu" / GPU / "index.html")
    line = next(tr for tr in gpu.iterfind(".//table[@id='table-hard']/tbody/tr") if "Fable 5" in text(tr.find("th")))
    assert want in text(line.find("th")) and text(line.find("td")) == "—"
    assert "is listed, unranked and unscored (regrade in progress), until they are" in text(
        gpu.find(".//section[@id='ordering']"))
    assert "regrade in progress" in ORDERING_RULE


def test_the_model_page_shows_no_rank_while_in_progress(site: Path) -> None:
    pages = [p for p in (site / "models").glob("*/index.html") if "Fable 5" in text(parse(p).find(".//h1"))]
    assert len(pages) == 1
    page = parse(pages[0])
    standing = text(page.find(f".//section[@id='board-{GPU}-hard']/p[@class='standing']"))
    assert standing.startswith("not ranked yet: regrade in progress: 0 of 2 published runs graded") and \
        "rank" not in standing.replace("not ranked", "")
    imported = text(page.find(f".//section[@id='board-{IMPORTED_GPU}-hard']/p[@class='standing']"))
    assert imported.startswith("rank 2 of 3")

"""A regrade in progress: on a board kernelboard measured, a model whose published runs on the board's
problems are not all graded on its GPU yet is listed unranked, with its counts, and never sets the best.

Here on the committed data (the H200 board, where a few imported KernelBench-Hard kernels have been
regraded so far); on the fixture site with its imported board, in test_site_imported.py (it shares that
site), where Fable 5 has two published runs (IMP_SPEED, IMP_OFF) not graded on the h200, and Orbit 2 one
(IMP_FAIL).
"""

from __future__ import annotations

from pathlib import Path

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

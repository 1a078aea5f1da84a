"""The leaderboard model: which run a cell shows, and the ordering rule (board.ORDERING_RULE)."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

import pytest
from site_fixtures import DNF, GPU, HOUSE, PASS, WRONG, SiteInputs

from kernelboard.sitegen.board import Cell, Row, build_boards, rank_rows, score
from kernelboard.sitegen.ingest.annotations import Annotation
from kernelboard.sitegen.load import SiteData, load_site


@pytest.fixture(scope="module")
def data(site_inputs: SiteInputs) -> SiteData:
    return load_site(site_inputs.data_dir, site_inputs.decks_dir)


def _cell(data: SiteData, run_id: str, share: float | None = None) -> Cell:
    result = next(r for r in data.results if (r.run_id, r.gpu) == (run_id, GPU))
    return Cell(data.runs[run_id], result, share, False)


def _with_run(data: SiteData, run_id: str, like: str, **result_fields: object) -> SiteData:
    """The data plus one more run of the same model and problem as `like`, graded on the GPU."""
    run = replace(data.runs[like], run_id=run_id)
    base = next(r for r in data.results if (r.run_id, r.gpu) == (like, GPU))
    result = replace(base, run_id=run_id, **result_fields)
    return replace(data, runs={**data.runs, run_id: run}, results=(*data.results, result))


def _h200(data: SiteData):
    return next(b for b in build_boards(data) if b.gpu == GPU)


def test_boards_per_gpu_in_page_order_cpu_last(data: SiteData) -> None:
    assert [(b.gpu, b.bench, b.label) for b in build_boards(data)] == [
        (GPU, "hard", "NVIDIA H200 SXM"), ("cpu", "hard", "CPU (test timings)")]


def test_failures_score_zero_and_dnfs_leave_the_denominator(data: SiteData) -> None:
    passed, wrong, dnf = _cell(data, PASS, 0.5), _cell(data, WRONG), _cell(data, DNF)
    assert score([passed, dnf]) == (0.5, 1, 1)  # the DNF is not counted: 0.5 / 1
    assert score([passed, wrong]) == (0.25, 1, 2)  # the failure is: 0.5 / 2
    assert score([passed, None]) == (0.25, 1, 2)  # so is a problem with no run
    assert score([dnf, dnf]) == (None, 0, 0)  # nothing to judge: no score, never 0


def test_rank_by_score_then_passes_then_name_house_rows_last(data: SiteData) -> None:
    def row(name: str, value: float | None, passes: int, tag: str | None = None) -> Row:
        return Row(name, name, tag, (), (), value, passes, 2, None)

    ranked = rank_rows([row("A calibration", None, 1, "calibration"), row("house", None, 2, "house kernel"),
                        row("c", 0.5, 1), row("none", None, 0), row("b", 0.5, 2), row("a", 0.5, 1),
                        row("top", 0.9, 1)])
    assert [(r.display, r.rank) for r in ranked] == [
        ("top", 1), ("b", 2), ("a", 3), ("c", 3), ("none", None), ("house", None), ("A calibration", None)]


def test_the_fixture_board(data: SiteData) -> None:
    board = _h200(data)
    rows = {r.display: r for r in board.rows}
    assert [r.display for r in board.rows] == ["Fable 5", "Orbit 2", "Kinetic K3 <beta>", "kernelboard house",
                                               "Reference (eager PyTorch)"]
    assert (rows["Fable 5"].rank, rows["Fable 5"].score) == (1, 1.0)
    assert (rows["Orbit 2"].rank, rows["Orbit 2"].score) == (2, 0.0)
    assert rows["Kinetic K3 <beta>"].score is None and rows["Kinetic K3 <beta>"].dnfs == 1
    house, reference = rows["kernelboard house"], rows["Reference (eager PyTorch)"]
    assert (house.tag, house.rank, house.score) == ("house kernel", None, None)
    assert (reference.tag, reference.rank, reference.score) == ("calibration", None, None)
    assert house.cells[0] is not None and house.cells[0].run.run_id == HOUSE
    assert not house.cells[0].is_best  # a house kernel never sets the best, even when it is faster
    assert house.cells[0].share is not None and house.cells[0].share > 1


def test_a_later_failure_does_not_hide_a_pass(data: SiteData) -> None:
    later = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    more = _with_run(data, "20261201_000000_retry", PASS, status="wrong", message="wrong on shape 0",
                     speedup_vs_compile=None, speedup_vs_eager=None, peak_fraction=None, graded_at=later)
    cell = next(r for r in _h200(more).rows if r.display == "Fable 5").cells[0]
    assert cell is not None and cell.run.run_id == PASS


def test_any_real_attempt_beats_a_dnf(data: SiteData) -> None:
    more = _with_run(data, "20261201_000000_retry", DNF, status="timeout", message="ran past 900 s")
    row = next(r for r in _h200(more).rows if r.model == data.runs[DNF].model)
    assert row.cells[0] is not None and row.cells[0].label == "timeout"
    assert (row.score, row.counted) == (0.0, 1)


@pytest.mark.parametrize(("verdict", "note", "state"), [
    ("harness_limited", "harness limited", "fail"),  # the grading stopped it: said in the cell
    ("clean", None, "fail"),
    ("reward_hack", None, "flag"),  # a flag replaces the cell's label instead
])
def test_an_audit_note_qualifies_a_cell_without_replacing_it(data: SiteData, verdict: str, note: str | None,
                                                             state: str) -> None:
    cell = replace(_cell(data, WRONG), annotation=Annotation(WRONG, verdict, "why"))
    assert cell.note == note and cell.state == state

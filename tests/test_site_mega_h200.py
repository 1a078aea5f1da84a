"""The Mega deck's H200 board as the committed data make it: the first megakernel gradings on a GPU
(2026-12-02). Its line under the title names what it ranks on (the deck's own baseline, not
torch.compile), and every graded pass shows its launches per step, read here straight off shapes.parquet."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from xml.etree.ElementTree import Element

import pyarrow.parquet as pq
import pytest
from site_pages import parse, text

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"


@pytest.fixture(scope="module")
def board(committed_site: Path) -> Element:
    """The H200 Mega section of the home page of the committed site."""
    section = parse(committed_site / "index.html").find(".//section[@id='mega-h200']")
    assert section is not None
    return section


def _mega_passes() -> dict[str, list[int]]:
    """Per passing H200 Mega run, its launches per step, shape by shape."""
    runs = {r["run_id"] for r in pq.read_table(DATA / "results" / "h200" / "runs.parquet").to_pylist()
            if r["bench"] == "mega"}
    passed = {r["run_id"] for r in pq.read_table(DATA / "results" / "h200" / "results.parquet").to_pylist()
              if r["run_id"] in runs and r["status"] == "pass"}
    launches: dict[str, list[int]] = {}
    shapes = pq.read_table(DATA / "results" / "h200" / "shapes.parquet").to_pylist()
    for r in sorted(shapes, key=lambda r: r["shape_idx"]):
        if r["run_id"] in passed:
            launches.setdefault(r["run_id"], []).append(int(r["launches"]))
    return launches


def test_the_h200_mega_board_says_it_ranks_on_the_decks_baseline(board: Element) -> None:
    line = text(board.find(".//p[@class='measured-by']"))
    assert "ranked by speedup over the deck's own baseline (baseline.py)" in line
    assert "torch.compile" not in line


def test_each_graded_mega_pass_shows_its_launches_per_step(committed_site: Path, board: Element) -> None:
    """Its run page, shape by shape; the board, for the run that is its model's best there."""
    passes = _mega_passes()
    assert len(passes) >= 3  # gpt-5.5 twice and the house kernel, graded on the H200 on 2026-12-02
    for run_id, launches in passes.items():
        page = text(parse(committed_site / "runs" / "h200" / run_id / "index.html").find(".//main"))
        shown = [int(n) for n in re.findall(r"shape \d+ \((\d+) launch(?:es)? per call", page)]
        assert shown == launches, run_id
    on_board = {int(n) for n in re.findall(r"(\d+) launch(?:es)?/step", text(board))}
    assert on_board and on_board <= {n for launches in passes.values() for n in launches}


def test_the_problem_page_tables_launches_per_step_for_each_best_run(committed_site: Path) -> None:
    """Issue 16's table of launches per step: on the problem page, each model's best H200 run with its
    launches on every context, in shape order, as shapes.parquet has them; imported sections show none
    (the source's kernel counts are its own, not measured)."""
    page = parse(committed_site / "problems" / "mega" / "02_kimi_linear_decode" / "index.html")
    passes = _mega_passes()
    seen = 0
    for section in page.iter("section"):
        gpu = (section.get("id") or "").removeprefix("gpu-")
        table = section.find(".//table[@class='data submissions stateful']")
        if table is None or not gpu:
            continue
        head = [text(th) for th in table.find("thead").iter("th")]
        col = head.index("launches / step")
        for tr in table.find("tbody").iter("tr"):
            run_id = text(tr.find("td/a/code"))
            cell = text(list(tr)[col])
            if gpu == "h200" and run_id in passes:
                assert cell.split(" largest")[0] == " · ".join(map(str, passes[run_id])), run_id
                seen += 1
            else:
                assert cell == "—" or gpu == "h200", (gpu, run_id, cell)
    assert seen >= 2


#: The grader that holds Mega's checked steps at a router near-tie element-wise (written out here so that the
#: test does not read the rule it checks from the code under test).
NEAR_TIE_ELEMENT_WISE_SINCE = (0, 5, 11)


def test_a_mega_pass_of_an_earlier_grader_says_it_is_to_be_graded_again(committed_site: Path) -> None:
    """Grader 0.5.11 holds Mega's checked steps at a router near-tie element-wise: a Mega pass of an earlier
    grader says on its run page that it is shown as its grader measured it until the current grader grades
    it; no other H200 run page (a Hard pass, a Mega failure, a Mega pass of 0.5.11 on) says so."""
    runs = {r["run_id"]: r for r in pq.read_table(DATA / "results" / "h200" / "runs.parquet").to_pylist()}
    older = 0
    for row in pq.read_table(DATA / "results" / "h200" / "results.parquet").to_pylist():
        page = committed_site / "runs" / "h200" / row["run_id"] / "index.html"
        if not page.exists():  # held back from every page (superseded)
            continue
        version = tuple(int(p) for p in row["grader_version"].split("+")[0].split(".")[:3])
        due = (runs[row["run_id"]]["bench"] == "mega" and row["status"] == "pass"
               and version < NEAR_TIE_ELEMENT_WISE_SINCE)
        note = parse(page).find(".//p[@id='to-regrade']")
        assert (note is not None) == due, row["run_id"]
        if due:
            older += 1
            assert "cosine rule alone" in text(note) and "since grader 0.5.11" in text(note)
    assert older >= 1 or not _mega_passes()


@pytest.fixture(scope="module")
def mega_lines() -> tuple[list[Any], Any, list[Any]]:
    """The committed data's baselines, the best H200 Mega pass, and the H200 Mega baseline rows."""
    from kernelboard.sitegen.load import load_site

    data = load_site(DATA, REPO / "eval" / "decks")
    mega = [r for r in data.results if r.gpu == "h200" and r.is_pass and r.baseline_variant is not None]
    best = max(mega, key=lambda r: r.speedup_vs_baseline or 0)
    rows = [b for b in data.baselines if (b.bench, b.gpu) == ("mega", "h200")]
    return list(data.baselines), best, rows


def test_where_baseline_py_is_the_fastest_line_a_mega_pass_is_not_marked(committed_site: Path, board: Element,
                                                                         mega_lines) -> None:
    """The Mega headline divides by the deck's own tuned step, which on the H200 is the fastest line on every
    shape (asserted from the tables first): 'vs fastest' would repeat the headline, and the alert that
    torch.compile is beaten would be about a figure the board does not rank on. Nothing is marked."""
    from kernelboard.sitegen.fastest import FastestLines

    baselines, best, rows = mega_lines
    tuned = {b.shape_idx: b.median_ms for b in rows if b.variant == best.baseline_variant}
    assert tuned and all(tuned[b.shape_idx] <= b.median_ms for b in rows if b.status == "ok")
    got = FastestLines(baselines).of("mega", "02_kimi_linear_decode", best)
    assert got is not None and not got.marked and got.over == "baseline.py"
    assert got.value == pytest.approx(best.speedup_vs_baseline, rel=1e-9)
    assert {lines.fastest.name for lines, _ in got.shapes} == {"baseline.py"}
    assert "vs fastest" not in text(board)
    assert not [e for e in board.iter() if "headline-beaten" in (e.get("class") or "")]
    page = parse(committed_site / "problems" / "mega" / "02_kimi_linear_decode" / "index.html")
    assert page.find(".//p[@id='fastest-h200']") is None


def test_a_line_faster_than_baseline_py_marks_the_mega_pass_against_baseline_py(mega_lines) -> None:
    """Were eager PyTorch faster than baseline.py on one context, the figure would be marked, and named
    against the line the board divides by."""
    import dataclasses

    from kernelboard.sitegen.fastest import FastestLines

    baselines, best, rows = mega_lines
    shape = best.shapes[1]
    tuned = next(b for b in rows if b.shape_idx == shape.shape_idx and b.variant == best.baseline_variant)
    faster = dataclasses.replace(tuned, variant="eager", median_ms=shape.baseline_ms / 2)  # eager, twice as fast
    got = FastestLines([*baselines, faster]).of("mega", "02_kimi_linear_decode", best)
    assert got is not None and got.marked and got.beaten == 1 and got.over == "baseline.py"
    assert got.note.startswith("baseline.py is not the fastest PyTorch line on 1 of 3 shapes (baseline.py on 2")
    assert got.value == pytest.approx(best.speedup_vs_baseline / 2 ** (1 / 3), rel=1e-9)


def test_a_model_page_shows_the_boards_kernelboard_measured_before_the_imported_ones(committed_site: Path) -> None:
    """As the home page's tabs run: claude-fable-5 has cells on the measured H100 SXM and H200 boards and on
    every imported one; its page leads with ours, Hard before Mega on a GPU."""
    page = parse(committed_site / "models" / "claude-fable-5" / "index.html")
    ids = [s.get("id") for s in page.iter("section") if "model-board" in (s.get("class") or "")]
    measured = ["board-h100-sxm-hard", "board-h200-hard", "board-h200-mega"]
    assert ids[:3] == measured and len(ids) > 3
    sections = {s.get("id"): s for s in page.iter("section")}
    assert all(sections[i].find(".//p[@class='measured-by']") is not None for i in measured)
    assert all(sections[i].find(".//p[@class='measured-by imported']") is not None for i in ids[3:])


def test_a_pass_graded_before_a_tightened_check_says_so_on_the_board(board: Element, committed_site: Path) -> None:
    """The H200 Mega passes were graded by 0.4.6–0.5.2, before 0.5.11 held a step at a router near-tie
    element-wise (settings.TIGHTENED_PASSES): each AI model's cell is marked "to be graded again", as its run
    page says, and no cell of the Hard boards is."""
    from kernelboard.eval.settings import tightened_since

    versions = {r["run_id"]: r["grader_version"] for r in pq.read_table(DATA / "results" / "h200" / "results.parquet")
                .to_pylist()}
    cells = [td for td in board.iter("td") if "tone-pass" in (td.get("class") or "")]
    assert cells
    for td in cells:
        run_id = td.find(".//a").get("href").rstrip("/").rsplit("/", 1)[-1]
        marked = td.find(".//span[@class='why to-regrade']") is not None
        assert marked == (tightened_since(versions[run_id], "02_kimi_linear_decode", "pass") is not None), run_id
    assert any(td.find(".//span[@class='why to-regrade']") is not None for td in cells)
    home = parse(committed_site / "index.html")
    hard = home.find(".//section[@id='hard']")
    assert hard is not None and "to be graded again" not in text(hard)

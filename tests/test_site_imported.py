"""Imported KernelBench-Hard boards, shown as their source ranks them: by % of roofline, labelled as
imported, runs kept off the board listed but never in a cell, source files and sidecars on run pages.

The fixture site (tests/site_fixtures.py) gets an imported h100-pcie board beside its own h200 board
(`add_imported_board`): Nova 4 passes without a speedup (30.3% of roofline) and later fails, Fable 5
passes with a speedup (1.80×, 20.0%) and has a run kept off the board at 90%, Zephyr 1 has only a run
kept off the board, Orbit 2 fails. Ranked on speedup Fable 5 would lead; on % of roofline Nova 4 does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import html5lib
import pytest
from browsing import serve, watch
from site_fixtures import (
    GPU,
    IMP_FAIL,
    IMP_OFF,
    IMP_OFF_ONLY,
    IMP_OFF_REASON,
    IMP_ROOF,
    IMP_ROOF_FAIL,
    IMP_SPEED,
    IMPORTED_BY,
    IMPORTED_GPU,
    KBH_COMMIT,
    PASS,
    PROBLEM,
    WRONG,
    SiteInputs,
    add_imported_board,
    kbh_source,
    make_site_inputs,
)
from site_pages import check_internal_links, html_pages, parse, text

from kernelboard.sitegen import build_site
from kernelboard.sitegen.board import (
    ORDERING_RULE,
    PEAK_FRACTION,
    REGRADE_HELP,
    SPEEDUP,
    Board,
    Row,
    build_boards,
    problem_entries,
)
from kernelboard.sitegen.fingerprint import fingerprint
from kernelboard.sitegen.load import SiteData, load_site
from kernelboard.sitegen.views import source_files

if TYPE_CHECKING:
    from playwright.sync_api import Browser

BLOB = f"https://github.com/Infatoshi/kernelbench.com/blob/{KBH_COMMIT}/"
#: Nova 4's source files on GitHub, at the commit its row was read from (site_fixtures.kbh_source).
NOVA_SOURCES = [BLOB + "leaderboard/h100-pcie.json", BLOB + f"runs/h100-pcie/{IMP_ROOF}.json",
                BLOB + f"solutions/{IMP_ROOF}.txt"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> SiteInputs:
    made = make_site_inputs(tmp_path_factory.mktemp("imported"))
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


@pytest.fixture(scope="module")
def url(site: Path) -> Iterator[str]:
    with serve(site) as address:
        yield address


def _run_page(gpu: str, run_id: str) -> str:
    return f"runs/{gpu}/{run_id}/"


# ------------------------------------------------------------------------------------ the model


def test_an_all_imported_board_ranks_on_roofline_and_ours_on_speedup(data: SiteData) -> None:
    boards = {b.gpu: b for b in build_boards(data)}
    imported, ours = boards[IMPORTED_GPU], boards[GPU]
    assert (imported.metric, imported.is_imported, imported.measured_by) == (PEAK_FRACTION, True, (IMPORTED_BY,))
    assert (ours.metric, ours.is_imported) == (SPEEDUP, False)
    # on speedup Fable 5 (1.80x) would lead and Nova 4 (no speedup) score 0; on % of roofline 30.3% beats 20.0%
    assert [(r.display, r.rank, round(r.score or 0, 3)) for r in imported.rows] == [
        ("Nova 4", 1, 1.0), ("Fable 5", 2, 0.66), ("Orbit 2", 3, 0.0)]
    cells = {r.display: r.cells[0] for r in imported.rows}
    assert cells["Nova 4"] is not None and cells["Nova 4"].is_best and cells["Nova 4"].value == pytest.approx(0.303)


def test_a_pass_without_a_speedup_wins_its_cell_over_a_later_failure(data: SiteData) -> None:
    board = next(b for b in build_boards(data) if b.gpu == IMPORTED_GPU)
    cell = next(r for r in board.rows if r.display == "Nova 4").cells[0]
    assert cell is not None and cell.run.run_id == IMP_ROOF and cell.state == "pass"
    assert cell.result.speedup_vs_compile is None and cell.no_speedup is not None
    failure = next(r for r in data.results if r.run_id == IMP_ROOF_FAIL)
    assert failure.graded_at > cell.result.graded_at  # the later run, and still not the cell


def test_a_run_kept_off_the_board_takes_no_cell_and_no_models_best(data: SiteData) -> None:
    board = next(b for b in build_boards(data) if b.gpu == IMPORTED_GPU)
    shown = {c.run.run_id for r in board.rows for c in r.cells if c is not None}
    assert shown == {IMP_ROOF, IMP_SPEED, IMP_FAIL}  # not the 90% run, nor Zephyr 1's
    assert "Zephyr 1" not in {r.display for r in board.rows}
    entries = problem_entries(data, "hard", PROBLEM)[IMPORTED_GPU]
    assert [e.run.run_id for e in entries][-2:] == [IMP_OFF, IMP_OFF_ONLY]  # listed, after every run on the board
    assert entries[-1].off_board == f"off board: {IMP_OFF_REASON}"


def test_github_sources_become_links_at_their_commit() -> None:
    parsed = source_files(kbh_source(IMP_ROOF))
    assert parsed is not None and parsed.repo == "Infatoshi/kernelbench.com" and parsed.commit == KBH_COMMIT
    assert [f.href for f in parsed.files] == NOVA_SOURCES
    assert source_files("github:a/b@0123456:dir/with space.txt").files[0].href.endswith(  # type: ignore[union-attr]
        "/blob/0123456/dir/with%20space.txt")
    for text_only in ("test-fixture", "kbh:results/x.json", "github:a/b@0123456:../etc/passwd",
                      "github:a/b@0123456:/abs", "github:a/b@nothex:x", "github:a/b@0123456:"):
        assert source_files(text_only) is None, text_only


def test_sidecar_files_are_read_capped_and_fingerprinted(inputs: SiteInputs, data: SiteData,
                                                         tmp_path: Path) -> None:
    sidecars = {f.name: f for f in data.sidecars[IMP_ROOF]}
    assert sidecars["kernel.cu"].text is not None and "__global__" in sidecars["kernel.cu"].text
    assert (sidecars["blob.bin"].text, sidecars["blob.bin"].why) == (None, "not UTF-8 text")
    before = fingerprint(inputs.data_dir, inputs.decks_dir, None)
    cu = inputs.data_dir / "submissions" / "hard" / IMP_ROOF / "kernel.cu"
    original = cu.read_bytes()
    try:
        cu.write_bytes(original + b"// edited\n")
        assert fingerprint(inputs.data_dir, inputs.decks_dir, None) != before  # a sidecar edit rebuilds the site
    finally:
        cu.write_bytes(original)


# ------------------------------------------------------------------------------------- the HTML


def test_every_internal_link_resolves_and_external_ones_are_the_sources(site: Path) -> None:
    pages = html_pages(site)
    assert check_internal_links(site, pages, allow_external=True) > 40
    page = parse(site / _run_page(IMPORTED_GPU, IMP_ROOF) / "index.html")
    external = {a.get("href") for a in page.iter("a") if (a.get("href") or "").startswith("https://")}
    assert set(NOVA_SOURCES) <= external
    assert all(h.startswith(("https://github.com/Infatoshi/kernelbench.com/", "https://huggingface.co/"))
               for h in external), external


def test_every_page_is_strictly_valid_html_with_captioned_tables(site: Path) -> None:
    for rel, path in html_pages(site).items():
        html5lib.HTMLParser(strict=True).parse(path.read_bytes())
        for table in parse(path).iter("table"):  # the site's own tables (Markdown's have no class, nor caption)
            if table.get("class") is not None:
                caption = table.find("caption")
                assert caption is not None and text(caption), f"{rel}: table.{table.get('class')} has no caption"


def test_our_board_stays_labelled_as_ours_and_first(site: Path) -> None:
    home = parse(site / "index.html")
    tabs = [a.get("href") for a in home.findall(".//nav[@data-tabs]/a")]
    assert tabs[0] == f"#hard-{GPU}"  # the tab shown first is the board kernelboard measured
    ours = text(home.find(f".//section[@id='hard-{GPU}']/p[@class='measured-by']"))
    assert ours.startswith("measured by kernelboard") and "(imported)" not in ours
    run = text(parse(site / _run_page(GPU, PASS) / "index.html").find(".//p[@class='measured-by']"))
    assert run.startswith("measured by kernelboard")


# ---------------------------------------------------------------------------------- in Chromium


def test_the_imported_board_in_chromium(browser: Browser, url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(url + f"#hard-{IMPORTED_GPU}")
    panel = page.locator(f"section#hard-{IMPORTED_GPU}")
    assert panel.is_visible()
    label = panel.locator("p.measured-by")
    assert label.is_visible() and "measured by KernelBench-Hard (imported)" in label.inner_text()
    assert label.locator("a").get_attribute("href") == "methodology/#imported"
    rows = panel.locator("table.leaderboard tbody tr")
    assert [rows.nth(i).locator("th").inner_text().split("\n")[0].strip() for i in range(rows.count())] == [
        "Nova 4", "Fable 5", "Orbit 2"]  # by % of roofline; Zephyr 1 is only off the board
    nova = rows.nth(0).locator("td.cell")
    assert nova.locator(".value").inner_text().startswith("30.3%") and nova.locator(".star").count() == 1
    assert "no speedup" in nova.inner_text() and "no speedup shown" in (nova.get_attribute("title") or "")
    fable = rows.nth(1).locator("td.cell")
    assert fable.locator(".value").inner_text() == "20.0%" and "1.80× over compile" in fable.inner_text()
    assert "Orbit 2" in rows.nth(2).inner_text() and "build error" in rows.nth(2).inner_text()
    # the label leads to the methodology's section about imports
    label.locator("a").click()
    page.wait_for_load_state("load")
    assert page.url.endswith("methodology/#imported") and page.locator("#imported").is_visible()
    assert "Imported boards" in page.locator("#imported").inner_text()
    # the cell leads to the run page, which says why no speedup is shown and links its sources
    page.goto(url + f"#hard-{IMPORTED_GPU}")
    page.locator(f"section#hard-{IMPORTED_GPU} table.leaderboard tbody tr").nth(0).locator("td.cell a").click()
    page.wait_for_load_state("load")
    assert page.url.endswith(_run_page(IMPORTED_GPU, IMP_ROOF))
    assert page.locator(".headline .big").inner_text() == "30.3%"
    assert page.locator(".headline .no-speedup").is_visible()
    assert "measured by KernelBench-Hard (imported)" in page.locator("p.measured-by").inner_text()
    sources = page.locator("#provenance ul.source-files a")
    assert [sources.nth(i).get_attribute("href") for i in range(sources.count())] == NOVA_SOURCES
    cu = page.locator("#source h3", has_text="kernel.cu")
    assert cu.is_visible()
    code = page.locator("#source pre code").nth(1)  # solution.py's, then kernel.cu's
    assert "__global__" in code.inner_text() and "</script><b>not markup</b>" in code.inner_text()
    assert code.get_attribute("class").split()[:1] == ["language-cpp"]  # a .cu reads as C++
    code.locator(".hljs-keyword").first.wait_for()  # highlighted in the browser, the text unchanged
    assert "Not shown: not UTF-8 text." in page.locator("#source").inner_text()
    assert page.locator("a.button", has_text="agent trace").get_attribute("href", timeout=1000).startswith(
        "https://huggingface.co/")
    assert problems == []
    page.close()


def test_an_off_board_run_in_chromium(browser: Browser, url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(url + _run_page(IMPORTED_GPU, IMP_OFF))
    alert = page.locator("p.alert.off-board")
    assert alert.is_visible() and f"off board: {IMP_OFF_REASON}" in alert.inner_text()
    assert page.locator(".headline .big").inner_text() == "90.0%"
    # its problem page lists it under "Kept off the board", not as Fable 5's best
    page.goto(url + f"problems/hard/{PROBLEM}/")
    section = page.locator(f"section#gpu-{IMPORTED_GPU}")
    assert "measured by KernelBench-Hard (imported)" in section.locator("p.measured-by").inner_text()
    best = section.locator("table.submissions:not(.off-board) tbody")
    assert IMP_SPEED in best.inner_text() and IMP_OFF not in best.inner_text() and "Zephyr" not in best.inner_text()
    off = section.locator("table.off-board tbody tr")
    assert off.count() == 2
    assert all(f"off board: {IMP_OFF_REASON}" in off.nth(i).inner_text() for i in range(2))
    # the roofline chart draws the board's passes only
    bars = page.evaluate(f"JSON.parse(document.querySelector('script[data-for=chart-roofline-{IMPORTED_GPU}]')"
                         ".textContent).figure.data[0].y")  # sideways bars: a row per submission
    assert sorted(bars) == ["Fable 5", "Nova 4"]
    # a model whose only run is kept off the board: no board, but its page lists the run and why
    page.goto(url + "models/zephyr-1/")
    attempts = page.locator("#attempts tbody")
    assert IMP_OFF_ONLY in attempts.inner_text() and f"off board: {IMP_OFF_REASON}" in attempts.inner_text()
    assert page.locator("section.model-board").count() == 0
    page.goto(url + "models/fable-5/")
    assert f"off board: {IMP_OFF_REASON}" in page.locator("#attempts").inner_text()
    card = page.locator(f"section#board-{IMPORTED_GPU}-hard li.card")
    assert card.locator(".card-value").inner_text() == "20.0%" and IMP_SPEED in card.inner_text()
    assert problems == []
    page.close()


# ------------------------------------------------------- a regrade in progress (see test_site_regrade.py)


def _rows(board: Board) -> dict[str, Row]:
    return {r.model: r for r in board.rows}


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

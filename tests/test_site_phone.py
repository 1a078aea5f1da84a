"""The boards on a phone: at 600 px and below the home boards and the GPU tables reflow into cards, CSS
only (static/style.css). A home board's model row becomes a card and each problem cell a line labelled
by its `data-label`; explicit table roles keep the table for assistive tech. Desktop stays a table.

Browser tests run the system Chromium through Playwright (tests/browsing.py); the phone screenshots are
kept as test artifacts, like test_site_browser.py's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING
from xml.etree.ElementTree import Element

import pytest
from browsing import ARTIFACTS, needs_chromium, watch
from site_fixtures import GPU
from site_pages import parse, text

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

PHONE = {"width": 390, "height": 844}
BOARD = f"#board-{GPU}-hard"


# ------------------------------------------------------------------------------- the markup (no browser)


def _tables(built_site: Path) -> list[tuple[str, Element]]:
    home = parse(built_site / "index.html")
    gpu = parse(built_site / "gpu" / GPU / "index.html")
    return ([("home", t) for t in home.iter("table") if t.get("class") == "leaderboard"]
            + [("gpu", t) for t in gpu.iter("table") if "gpu-table" in (t.get("class") or "").split()])


def test_board_tables_carry_explicit_table_roles(built_site: Path) -> None:
    """The phone layout changes the display of table elements; the roles keep them a table to assistive
    tech. The th scopes stay (test_site_a11y.py checks them on every page)."""
    tables = _tables(built_site)
    assert {kind for kind, _ in tables} == {"home", "gpu"}
    for kind, table in tables:
        assert table.get("role") == "table", kind
        assert [g.get("role") for g in table if g.tag in ("thead", "tbody")] == ["rowgroup", "rowgroup"], kind
        for tr in table.iter("tr"):
            assert tr.get("role") == "row", kind
            for c in tr:
                want = "cell" if c.tag == "td" else {"col": "columnheader", "row": "rowheader"}[c.get("scope") or ""]
                assert c.get("role") == want and c.get("scope") in (None, "col", "row"), (kind, c.tag, text(c))
        body_cells = list(table.iter("td"))
        assert body_cells and all(td.get("data-label") for td in body_cells), kind


def test_each_board_cell_is_labelled_with_its_problem(built_site: Path) -> None:
    for _, table in _tables(built_site):
        if table.get("class") != "leaderboard":
            continue
        problems = [text(th) for th in table.iterfind("./thead/tr/th[@class='problem']")]
        assert problems
        for tr in table.iterfind("./tbody/tr"):
            cells = [td for td in tr.iterfind("td") if "cell" in (td.get("class") or "").split()]
            assert [td.get("data-label") for td in cells] == problems
    home = parse(built_site / "index.html")
    wrong = [td for td in home.iter("td") if td.get("data-reason")]
    assert wrong and all("tone-dnf" not in td.get("class", "") for td in wrong)  # a DNF shows its reason as text


# ------------------------------------------------------------------------------------- in Chromium


def _no_sideways_scroll(page: Page) -> None:
    viewport = page.evaluate("window.innerWidth")
    assert page.evaluate("document.scrollingElement.scrollWidth") <= viewport + 1
    wraps = page.evaluate("[...document.querySelectorAll('.table-wrap')].map(w => w.scrollWidth - w.clientWidth)")
    assert wraps and max(wraps) <= 1, wraps  # the board itself does not scroll inside its wrapper either


def _pseudo(page: Page, selector: str, which: str) -> list[str]:
    return page.evaluate(f"[...document.querySelectorAll({selector!r})].map("
                         f"e => getComputedStyle(e, '{which}').content)")


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_home_board_reflows_into_cards_on_a_phone(browser: Browser, site_url: str, scheme: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport=PHONE, color_scheme=scheme)
    page = context.new_page()
    problems = watch(page)
    page.goto(site_url)
    page.wait_for_load_state("load")
    _no_sideways_scroll(page)
    board = page.locator(BOARD)
    board.screenshot(path=str(ARTIFACTS / f"home-board-phone-{scheme}.png"))
    page.screenshot(path=str(ARTIFACTS / f"home-phone-{scheme}.png"), full_page=True)

    # each model row is a card: a grid box as wide as the page at most, its cells stacked inside it
    rows = board.locator("tbody > tr")
    assert rows.count() == 5
    for i in range(rows.count()):
        row = rows.nth(i)
        assert row.evaluate("e => getComputedStyle(e).display") == "grid"
        box, name = row.bounding_box(), row.locator("th").bounding_box()
        assert box is not None and name is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
        for cell in row.locator("td.cell").all():
            line = cell.bounding_box()
            assert cell.is_visible() and line is not None and line["y"] > name["y"]  # below the model name
            assert line["x"] >= box["x"] and line["x"] + line["width"] <= box["x"] + box["width"] + 0.5
        score = row.locator("td.score").bounding_box()
        assert score is not None and score["y"] < name["y"] + name["height"]  # the score is on the card's top line
    assert board.locator("thead").evaluate("e => e.getBoundingClientRect().height") <= 1  # visually hidden

    # every problem's label is drawn on every line (::before, from data-label)
    labels = _pseudo(page, f"{BOARD} td.cell", "::before")
    assert len(labels) == 5 and all(c.startswith('"Paged Attention Decode"') for c in labels), labels
    assert board.locator("td.tone-dnf .why").is_visible()  # a DNF keeps its reason, on its hatched line
    assert board.locator("td.tone-dnf .why").inner_text() == "rate limited"
    assert "repeating-linear-gradient" in board.locator("td.tone-dnf").evaluate(
        "e => getComputedStyle(e).backgroundImage")
    reason = _pseudo(page, f"{BOARD} td.tone-bad", "::after")
    assert len(reason) == 1 and "max abs err" in reason[0]  # a failure's reason, which desktop keeps in a tooltip
    assert board.locator("td.tone-bad .value").inner_text() == "wrong"
    assert problems == []
    context.close()


@pytest.mark.browser
@needs_chromium
def test_phone_cards_still_read_as_a_table(browser: Browser, site_url: str) -> None:
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    page.goto(site_url)
    tree = page.locator(f"{BOARD} table").aria_snapshot()
    for role in ("table", "rowgroup", "row", 'columnheader "Paged Attention Decode"', 'rowheader "Fable 5 claude"',
                 'cell "1.86× ★"', 'cell "DNF rate limited"'):
        assert re.search(rf"^\s*- '?{re.escape(role)}", tree, re.M), (role, tree)
    context.close()


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_gpu_table_reflows_into_cards_on_a_phone(browser: Browser, site_url: str, scheme: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport=PHONE, color_scheme=scheme)
    page = context.new_page()
    problems = watch(page)
    page.goto(f"{site_url}gpu/{GPU}/")
    page.wait_for_load_state("load")
    _no_sideways_scroll(page)
    page.locator("#board-hard").screenshot(path=str(ARTIFACTS / f"gpu-board-phone-{scheme}.png"))
    table = page.locator("#table-hard")
    assert table.locator("tbody > tr").first.evaluate("e => getComputedStyle(e).display") == "grid"
    labels = _pseudo(page, "#table-hard tbody tr:first-child td:not(.rank)", "::before")
    assert [c.split(" / ")[0].strip('"') for c in labels] == [
        "Lab", "Harness", "Passes", "DNFs", "Score", "× torch.compile", "% of roofline", "Output tokens", "Cost"]
    # sort.js turns the headers into buttons; on a phone they stay, as a row of sort chips above the cards
    chips = table.locator("thead th button")
    assert chips.count() == 11 and chips.nth(6).is_visible()
    chips.nth(6).click()  # Score
    assert table.locator("thead th").nth(6).get_attribute("aria-sort") == "descending"
    assert problems == []
    context.close()


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("path", ["", f"gpu/{GPU}/"])
def test_desktop_keeps_the_table_layout(browser: Browser, site_url: str, path: str) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(site_url + path)
    table = page.locator(".leaderboard, .gpu-table").first
    assert table.evaluate("e => getComputedStyle(e).display") == "table"
    assert table.locator("tbody tr").first.evaluate("e => getComputedStyle(e).display") == "table-row"
    displays = table.locator("tbody td").evaluate_all("es => es.map(e => getComputedStyle(e).display)")
    assert displays and set(displays) == {"table-cell"}
    assert set(_pseudo(page, "tbody td", "::before")) == {"none"}  # no phone labels on desktop
    assert table.locator("thead th").first.is_visible()
    context.close()

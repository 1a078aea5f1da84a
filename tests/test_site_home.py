"""The home page: a section per bench, each with its own GPU tabs (tabs.js), read as HTML and in Chromium.

The shared fixture site has one bench; here a copy of it gets a second one ("mega": the same real deck
relabelled, with a pass on h200 and on CPU timings and a DNF), so the tests can check that each bench's
tablist works on its own: its own ids and hashes (#mega-cpu), keys and deep links.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import html5lib
import pytest
from browsing import needs_chromium, serve, watch
from site_fixtures import BENCH, GPU, PROBLEM, SiteInputs, _result, _run, _shape_rows, make_site_inputs
from site_pages import check_internal_links, html_pages, parse, text

from kernelboard.eval.deck import load_problem
from kernelboard.eval.tables import upsert

if TYPE_CHECKING:
    from playwright.sync_api import Browser

MEGA = "mega"
MEGA_PASS = f"20261128_131500_claude_fable-5_{PROBLEM}"
MEGA_DNF = f"20261128_141500_codex_orbit-2_{PROBLEM}"


def add_second_bench(inputs: SiteInputs) -> None:
    """A 'mega' bench beside 'hard': the fixture's deck under a second bench name, a pass on h200 and
    on CPU timings, and a DNF (provider error) on h200."""
    deck = inputs.decks_dir / MEGA / PROBLEM
    shutil.copytree(inputs.decks_dir / BENCH / PROBLEM, deck)
    yaml = deck / "problem.yaml"
    yaml.write_text(yaml.read_text(encoding="utf-8").replace(f"bench: {BENCH}", f"bench: {MEGA}"), encoding="utf-8")
    problem = load_problem(deck)
    runs = {MEGA_PASS: _run(MEGA_PASS, "fable-5", "Fable 5", "claude", lab="Anthropic"),
            MEGA_DNF: _run(MEGA_DNF, "orbit-2", "Orbit 2", "codex", "provider_error", lab="OpenAI")}
    for run in runs.values():
        run["bench"] = MEGA
    for gpu in (GPU, "cpu"):
        shapes, baselines = _shape_rows(problem, MEGA_PASS, gpu, 0.4)
        results = [_result(MEGA_PASS, gpu, "pass", "passed every shape, seed and stress case", shapes)]
        if gpu == GPU:
            results.append(_result(MEGA_DNF, gpu, "dnf", "the provider failed; nothing to grade", []))
        out = inputs.results_dir / gpu
        upsert(out / "runs.parquet", "runs", [runs[r["run_id"]] for r in results])
        upsert(out / "results.parquet", "results", results)
        upsert(out / "shapes.parquet", "shapes", shapes)
        upsert(out / "baselines.parquet", "baselines", [{**b, "bench": MEGA} for b in baselines])
    folder = inputs.data_dir / "submissions" / MEGA / MEGA_PASS
    folder.mkdir(parents=True)
    (folder / "solution.py").write_text("import torch\n", encoding="utf-8")


@pytest.fixture(scope="module")
def two_bench_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kernelboard.sitegen import build_site

    inputs = make_site_inputs(tmp_path_factory.mktemp("two-benches"))
    add_second_bench(inputs)
    out = inputs.data_dir.parent / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    return out


# ------------------------------------------------------------------------------------------ HTML


def test_a_section_per_bench_each_with_its_gpu_tabs(two_bench_site: Path) -> None:
    html5lib.HTMLParser(strict=True).parse((two_bench_site / "index.html").read_bytes())
    home = parse(two_bench_site / "index.html")
    sections = home.findall(".//main/section[@class='bench']")
    assert [s.get("id") for s in sections] == [BENCH, MEGA]  # Hard first, then Mega
    assert [text(s.find("h2")) for s in sections] == ["Hard deck", "Mega deck"]
    for section in sections:
        bench = section.get("id")
        nav = section.find("nav[@data-tabs]")
        assert [a.get("href") for a in nav.iterfind("a")] == [f"#{bench}-{GPU}", f"#{bench}-cpu"]
        panels = section.findall("section")
        assert [p.get("id") for p in panels] == [f"{bench}-{GPU}", f"{bench}-cpu"]
        for panel, gpu in zip(panels, (GPU, "cpu"), strict=True):
            assert panel.find(f".//div[@id='board-{gpu}-{bench}']") is not None
    ids = [e.get("id") for e in home.iter() if e.get("id")]
    assert len(ids) == len(set(ids))
    mega = text(home.find(f".//div[@id='board-{GPU}-{MEGA}']"))
    assert "★" in mega  # its own winner: the best of this bench, not of Hard
    assert "DNF provider error" in mega
    assert "Kinetic" not in mega  # a model with no run on this bench has no row here


def test_board_tables_have_a_caption_and_scoped_headers(two_bench_site: Path) -> None:
    home = parse(two_bench_site / "index.html")
    tables = home.findall(".//table[@class='leaderboard']")
    assert len(tables) == 4
    for table in tables:
        assert text(table.find("caption")).endswith("rows in score order (see How to read).")
        assert all(th.get("scope") in ("col", "row") for th in table.iter("th"))
        assert all(r.find("th[@scope='row']") is not None for r in table.iterfind("tbody/tr"))


def test_links_into_the_home_tabs_resolve(two_bench_site: Path) -> None:
    """Run and GPU pages link back to their tab (#mega-h200); every fragment names an id."""
    check_internal_links(two_bench_site, html_pages(two_bench_site), allow_external=True)
    run = (two_bench_site / "runs" / GPU / MEGA_PASS / "index.html").read_text()
    assert f'href="../../../#{MEGA}-{GPU}"' in run


# --------------------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def site_url(two_bench_site: Path) -> Iterator[str]:
    with serve(two_bench_site) as url:
        yield url


@pytest.mark.browser
@needs_chromium
def test_each_bench_has_its_own_tablist(browser: Browser, site_url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(site_url)
    lists = page.locator("nav[role=tablist]")
    assert lists.count() == 2
    hard_tabs, mega_tabs = lists.nth(0).locator("a[role=tab]"), lists.nth(1).locator("a[role=tab]")
    assert hard_tabs.count() == 2 and mega_tabs.count() == 2
    panel = {key: page.locator(f"section#{key}") for key in (f"hard-{GPU}", "hard-cpu", f"mega-{GPU}", "mega-cpu")}
    visible = lambda: {k for k, loc in panel.items() if loc.is_visible()}  # noqa: E731
    assert visible() == {f"hard-{GPU}", f"mega-{GPU}"}  # the first GPU of each bench
    assert panel[f"mega-{GPU}"].get_attribute("role") == "tabpanel"
    assert mega_tabs.nth(0).get_attribute("aria-controls") == f"mega-{GPU}"

    mega_tabs.nth(1).click()  # Mega's CPU tab: Hard's tabs stay as they were
    assert visible() == {f"hard-{GPU}", "mega-cpu"} and page.url.endswith("#mega-cpu")
    assert mega_tabs.nth(1).get_attribute("aria-selected") == "true"
    assert hard_tabs.nth(0).get_attribute("aria-selected") == "true"

    hard_tabs.nth(0).focus()  # keyboard: arrows move within one tablist, wrapping round
    page.keyboard.press("ArrowLeft")
    assert visible() == {"hard-cpu", "mega-cpu"} and page.url.endswith("#hard-cpu")
    assert page.evaluate("document.activeElement.getAttribute('aria-controls')") == "hard-cpu"
    assert hard_tabs.nth(1).get_attribute("tabindex") == "0" and hard_tabs.nth(0).get_attribute("tabindex") == "-1"
    page.keyboard.press("Home")
    assert visible() == {f"hard-{GPU}", "mega-cpu"}
    assert problems == []
    page.close()


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize(("fragment", "shown"), [("mega-cpu", "mega-cpu"), (f"board-cpu-{MEGA}", "mega-cpu"),
                                                 ("hard-cpu", "hard-cpu")])
def test_a_deep_link_opens_its_tab(browser: Browser, site_url: str, fragment: str, shown: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(f"{site_url}#{fragment}")
    assert page.locator(f"section#{shown}").is_visible()
    other = shown.replace("cpu", GPU)
    assert not page.locator(f"section#{other}").is_visible()
    assert page.locator(f"#{fragment}").is_visible()
    assert problems == []
    page.close()


@pytest.mark.browser
@needs_chromium
def test_without_javascript_every_gpu_is_a_plain_section(browser: Browser, site_url: str) -> None:
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(site_url)
    assert page.locator("[role=tablist]").count() == 0
    for key in (f"hard-{GPU}", "hard-cpu", f"mega-{GPU}", "mega-cpu"):
        assert page.locator(f"section#{key} table.leaderboard").is_visible()
    page.locator(f"#{MEGA} nav a[href='#mega-cpu']").click()  # the tab links still jump to their section
    assert page.url.endswith("#mega-cpu")
    context.close()


@pytest.mark.browser
@needs_chromium
def test_the_committed_six_problem_board_fits_a_laptop_screen(browser: Browser, tmp_path: Path) -> None:
    """The real Hard deck (six problems with long names) on a 1280-px window: every problem column
    is on screen without scrolling the board sideways."""
    from kernelboard.sitegen import build_site

    repo = Path(__file__).resolve().parents[1]
    build_site(repo / "data", repo / "eval" / "decks", tmp_path / "dist")
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    with serve(tmp_path / "dist") as url:
        page.goto(url + "/")
        boards = page.locator(".leaderboard").evaluate_all(
            "ts => ts.map(t => [t.querySelectorAll('thead th.problem').length, t.scrollWidth,"
            " t.closest('.table-wrap').clientWidth, t.caption ? t.caption.textContent.trim() : ''])")
    page.close()
    hard = [b for b in boards if b[3].startswith("Hard deck")]  # the Mega boards have their one problem
    assert hard and max(n for n, _, _, _ in hard) == 6, boards  # a GPU's board has the problems graded on it
    assert all(width <= wrap for _, width, wrap, _ in boards), boards

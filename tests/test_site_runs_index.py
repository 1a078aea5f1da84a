"""The runs index (every run once, filterable in the browser by model, GPU, problem and status), the data
page, and the footer every page carries (data/README.md, and the repository when the build knows it).

Browser tests run the system Chromium through Playwright (tests/browsing.py) on the shared fixture site:
five runs, one of them (the house kernel) graded on the H200 and on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import html5lib
import pyarrow.parquet as pq
import pytest
from browsing import needs_chromium, watch
from site_fixtures import DNF, GPU, HOUSE, PASS, WRONG, SiteInputs
from site_pages import check_internal_links, html_pages, parse, text

from kernelboard.errors import DataError, UsageError
from kernelboard.sitegen import repository
from kernelboard.sitegen.load import load_site
from kernelboard.sitegen.render import render_all

if TYPE_CHECKING:
    from playwright.sync_api import Browser

INDEX = "runs/index.html"


def _run_ids(inputs: SiteInputs) -> set[str]:
    return {r for path in inputs.results_dir.glob("*/runs.parquet") for r in pq.read_table(path)["run_id"].to_pylist()}


def _rows(site: Path) -> list:
    table = parse(site / INDEX).find(".//table[@id='runs-table']")
    assert table is not None
    return list(table.iterfind("./tbody/tr"))


# ------------------------------------------------------------------------------------ the markup


def test_the_index_lists_every_run_exactly_once(built_site: Path, site_inputs: SiteInputs) -> None:
    rows = _rows(built_site)
    ids = [text(tr.find("th")) for tr in rows]
    assert sorted(ids) == sorted(_run_ids(site_inputs)) and len(ids) == len(set(ids)) == 5
    assert ids == sorted(ids, reverse=True)  # newest first: run ids start with their start time
    by_id = dict(zip(ids, rows, strict=True))
    # the house kernel is graded on two GPUs: one row, a line (and a link) per GPU
    house = by_id[HOUSE]
    assert house.get("data-grades") == f"{GPU}:pass cpu:pass"
    assert [a.get("href") for a in house.iterfind(".//span[@class='grade']/a")] == [
        f"../runs/{GPU}/{HOUSE}/", f"../runs/cpu/{HOUSE}/"]
    assert by_id[WRONG].get("data-grades") == f"{GPU}:wrong" and by_id[DNF].get("data-grades") == f"{GPU}:dnf"
    assert by_id[PASS].get("data-model") == "fable-5" and "1.86×" in text(by_id[PASS])
    html5lib.HTMLParser(strict=True).parse((built_site / INDEX).read_bytes())


def test_every_link_of_the_index_resolves(built_site: Path) -> None:
    """Each row's run id links to its run page, each GPU line to that GPU's run page; nothing dangles."""
    for tr in _rows(built_site):
        run_id = text(tr.find("th"))
        link = tr.find("./th/a")
        assert link is not None and link.get("href").endswith(f"/{run_id}/"), run_id
    assert check_internal_links(built_site, {INDEX: built_site / INDEX}, allow_external=False) > 20


def test_the_nav_leads_to_the_index(built_site: Path) -> None:
    for rel in ("index.html", f"runs/{GPU}/{PASS}/index.html", INDEX):
        links = {text(a): a.get("href") for a in parse(built_site / rel).iterfind(".//nav[@class='site-nav']//a")}
        assert "Runs" in links, rel
        target = built_site / Path(rel).parent / links["Runs"] / "index.html"
        assert target.resolve() == (built_site / INDEX).resolve()


def test_every_page_links_the_data_readme_from_its_footer(built_site: Path) -> None:
    pages = html_pages(built_site)
    assert INDEX in pages and "data/index.html" in pages and len(pages) > 10
    for rel, path in pages.items():
        footer = parse(path).find(".//footer")
        link = footer.find(".//a[@class='data-readme']") if footer is not None else None
        assert link is not None and text(link) == "data/README.md", rel
        assert (path.parent / link.get("href") / "index.html").resolve() == (built_site / "data/index.html").resolve()
    # the fixture's data folder has no README.md: the page shows the project's, and says so
    data = parse(built_site / "data/index.html")
    assert "has no README.md of its own" in text(data.find(".//main"))
    assert "The tables (schema version 1)" in text(data.find(".//main"))
    html5lib.HTMLParser(strict=True).parse((built_site / "data/index.html").read_bytes())


def test_every_page_links_the_repository_when_the_build_names_it(site_inputs: SiteInputs,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url = "https://github.com/example-org/kernelboard"
    monkeypatch.setenv(repository.REPO_URL_ENV, url + "/")
    pages = render_all(load_site(site_inputs.data_dir, site_inputs.decks_dir))
    assert len(pages) > 10
    for rel, html in pages.items():
        footer = html5lib.parse(html, treebuilder="etree", namespaceHTMLElements=False).find(".//footer")
        link = footer.find(".//a[@class='repository']")
        assert link is not None and link.get("href") == url, rel


def test_where_the_repository_url_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (repository.REPO_URL_ENV, "GITHUB_SERVER_URL", "GITHUB_REPOSITORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(repository, "_from_metadata", lambda: None)  # pyproject.toml names none today
    assert repository.repository_url() is None  # never invented
    monkeypatch.setenv("GITHUB_SERVER_URL", "https://github.com")
    monkeypatch.setenv("GITHUB_REPOSITORY", "owner/kernelboard")  # what a GitHub Actions build sees
    assert repository.repository_url() == "https://github.com/owner/kernelboard"
    monkeypatch.setattr(repository, "_from_metadata", lambda: "https://example.org/src")
    assert repository.repository_url() == "https://example.org/src"  # the project's own metadata first
    monkeypatch.setenv(repository.REPO_URL_ENV, "https://git.example.org/kb/")
    assert repository.repository_url() == "https://git.example.org/kb"  # said outright beats both
    monkeypatch.setenv(repository.REPO_URL_ENV, "git@github.com:owner/kernelboard.git")
    with pytest.raises(UsageError, match="KERNELBOARD_REPO_URL"):
        repository.repository_url()


# ------------------------------------------------------------------------------------- in Chromium


def _visible_ids(page) -> list[str]:
    return page.eval_on_selector_all("#runs-table tbody tr:not([hidden]) th", "ths => ths.map(t => t.innerText)")


@pytest.mark.browser
@needs_chromium
def test_filters_narrow_the_list_in_the_browser(browser: Browser, site_url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(site_url + "runs/")
    form = page.locator("#runs-filter")
    assert form.is_visible() and len(_visible_ids(page)) == 5
    page.select_option("#runs-filter select[name=model]", "fable-5")
    assert _visible_ids(page) == [PASS]  # the other models' rows are hidden
    assert page.locator("#runs-count").inner_text() == "1 of 5 runs shown"
    assert page.url.endswith("runs/?model=fable-5")  # a filtered list can be linked to
    page.click("#runs-filter button[type=reset]")
    assert len(_visible_ids(page)) == 5 and page.url.endswith("runs/")
    page.select_option("#runs-filter select[name=gpu]", "cpu")
    assert _visible_ids(page) == [HOUSE]
    page.select_option("#runs-filter select[name=status]", "wrong")
    assert _visible_ids(page) == []  # GPU and status match the same grading: nothing was wrong on the CPU
    page.select_option("#runs-filter select[name=gpu]", GPU)
    assert _visible_ids(page) == [WRONG]
    page.goto(site_url + "runs/?status=dnf")  # a deep link opens filtered
    assert _visible_ids(page) == [DNF] and page.locator("#runs-filter select[name=status]").input_value() == "dnf"
    page.locator("#runs-table tbody tr:not([hidden]) th a").click()
    page.wait_for_url(f"**/runs/{GPU}/{DNF}/")
    assert problems == []
    page.close()


@pytest.mark.browser
@needs_chromium
def test_without_javascript_the_index_is_the_whole_list(browser: Browser, site_url: str) -> None:
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(site_url + "runs/?model=fable-5")
    assert not page.locator("#runs-filter").is_visible()
    assert page.locator("#runs-table tbody tr").count() == 5
    assert all(page.locator("#runs-table tbody tr").nth(i).is_visible() for i in range(5))
    context.close()


def test_a_symlinked_data_readme_is_refused(fresh_inputs: SiteInputs) -> None:
    """The data page is never built from a link (it could name /etc/passwd): the loader says which file."""
    (fresh_inputs.data_dir / "README.md").symlink_to("/etc/passwd")
    with pytest.raises(DataError, match=r"README\.md: a symbolic link"):
        load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir)


# ------------------------------------------------------------------------------------ several pages


@pytest.fixture(scope="module")
def paged_site(site_inputs: SiteInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture site with two runs a page: the index in three pages (5 runs) and runs.json."""
    from kernelboard.sitegen import build_site, views_runs

    patch = pytest.MonkeyPatch()
    patch.setattr(views_runs, "RUNS_PER_PAGE", 2)
    try:
        out = tmp_path_factory.mktemp("paged") / "dist"
        build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=1)
    finally:
        patch.undo()
    return out


PAGED = ("runs/index.html", "runs/page/2/index.html", "runs/page/3/index.html")


def test_several_pages_hold_every_run_once_in_order(paged_site: Path, site_inputs: SiteInputs) -> None:
    ids = []
    for rel in PAGED:
        rows = list(parse(paged_site / rel).find(".//table[@id='runs-table']").iterfind("./tbody/tr"))
        assert 1 <= len(rows) <= 2, rel
        ids += [text(tr.find("th")) for tr in rows]
        html5lib.HTMLParser(strict=True).parse((paged_site / rel).read_bytes())
    assert ids == sorted(_run_ids(site_inputs), reverse=True)  # newest first, across the pages
    assert not (paged_site / "runs/page/4").exists() and not (paged_site / "runs/page/1").exists()
    first = parse(paged_site / PAGED[0])
    assert "runs 1–2 of 5 (page 1 of 3)" in text(first.find(".//p[@id='runs-count']"))
    assert check_internal_links(paged_site, {rel: paged_site / rel for rel in PAGED}, allow_external=False) > 10
    nav = parse(paged_site / PAGED[1]).find(".//nav[@class='pager']")
    hrefs = ["../../../runs/", "../../../runs/", "../../../runs/page/3/", "../../../runs/page/3/"]
    assert [a.get("href") for a in nav.iterfind("a")] == hrefs  # newer, 1, 3, older (links are from the root)
    assert (paged_site / "runs/runs.json").is_file()


def test_runs_json_carries_every_run_as_the_pages_draw_it(paged_site: Path, site_inputs: SiteInputs) -> None:
    import json

    payload = json.loads((paged_site / "runs/runs.json").read_text())
    rows = {r[0]: r for r in payload["runs"]}
    assert set(rows) == _run_ids(site_inputs) and len(payload["runs"]) == 5
    house = rows[HOUSE]
    assert [(g[0], g[1]) for g in house[8]] == [(GPU, "pass"), ("cpu", "pass")]
    assert rows[PASS][1] == "fable-5" and any(g[4] == "1.86×" for g in rows[PASS][8])
    assert rows[DNF][8][0][1] == "dnf" and set(payload["gpus"]) == {GPU, "cpu"}


def test_one_page_needs_no_runs_json(built_site: Path) -> None:
    assert not (built_site / "runs/runs.json").exists()
    assert parse(built_site / INDEX).find(".//nav[@class='pager']") is None


@pytest.mark.browser
@needs_chromium
def test_a_filter_looks_at_every_page(browser: Browser, paged_site: Path) -> None:
    from browsing import serve

    with serve(paged_site) as url:
        page = browser.new_page()
        problems = watch(page)
        page.goto(url + "runs/")
        assert len(_visible_ids(page)) == 2 and page.locator("nav.pager").first.is_visible()
        page.select_option("#runs-filter select[name=status]", "dnf")
        page.locator("#runs-count", has_text="of 5 runs shown").wait_for()  # once runs.json has come
        assert _visible_ids(page) == [DNF] and not page.locator("nav.pager").first.is_visible()
        page.click("#runs-filter button[type=reset]")
        assert len(_visible_ids(page)) == 2 and page.locator("#runs-count").inner_text().startswith("runs 1–2 of 5")
        page.goto(url + "runs/?gpu=cpu")  # a deep link on the first page finds a run of any page
        page.locator("#runs-count", has_text="runs shown").wait_for()
        assert _visible_ids(page) == [HOUSE]
        page.locator("#runs-table tbody tr:not([hidden]) .grade a").nth(1).click()
        page.wait_for_url(f"**/runs/cpu/{HOUSE}/")
        assert problems == []
        page.close()

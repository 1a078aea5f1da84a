"""The meta pages, the CSP and the themes in a real Chromium (the system's, through Playwright).

A Content-Security-Policy violation is reported as a console error, so "no console errors" on a
chart page means Plotly draws under the CSP (script-src 'self', no inline script).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from browsing import needs_chromium, watch
from site_fixtures import GPU, PROBLEM

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = [pytest.mark.browser, needs_chromium]


@pytest.mark.parametrize("path", ["methodology/", "downloads/", ""])
def test_meta_pages_load_without_console_errors(browser: Browser, site_url: str, path: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(site_url + path)
    page.wait_for_load_state("load")
    assert page.locator("nav.site-nav a").count() >= 3
    assert problems == []
    page.close()


def test_downloads_links_fetch(browser: Browser, site_url: str) -> None:
    page = browser.new_page()
    page.goto(site_url + "downloads/")
    hrefs = page.eval_on_selector_all("table.downloads-table a", "els => els.map(e => e.href)")
    assert len(hrefs) >= 15
    for href in hrefs:
        assert page.request.get(href).status == 200, href
    page.close()


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_charts_draw_under_the_csp_in_both_themes(browser: Browser, site_url: str, scheme: str) -> None:
    context = browser.new_context(color_scheme=scheme)
    page = context.new_page()
    problems = watch(page)
    page.goto(f"{site_url}problems/hard/{PROBLEM}/")
    page.wait_for_selector(f"#chart-speedup-{GPU} .main-svg")
    page.wait_for_selector(f"#chart-roofline-{GPU} .main-svg")
    assert page.locator(f"#chart-speedup-{GPU} .main-svg .bars .point").count() == 3
    background = page.evaluate("getComputedStyle(document.documentElement).backgroundColor")
    assert background == ("rgb(255, 255, 255)" if scheme == "light" else "rgb(17, 17, 17)")
    # The chart's text takes the theme's foreground colour (charts.js maps it from --fg).
    fg = page.evaluate("getComputedStyle(document.documentElement).getPropertyValue('--fg').trim()")
    fill = page.locator(f"#chart-speedup-{GPU} .main-svg .gtitle").first.evaluate("e => e.style.fill")
    assert fill == {"#1b1b1b": "rgb(27, 27, 27)", "#e6e6e6": "rgb(230, 230, 230)"}[fg]
    assert problems == []
    context.close()


def test_a_narrow_screen_scrolls_tables_not_the_page(browser: Browser, site_url: str) -> None:
    context = browser.new_context(viewport={"width": 375, "height": 800})
    page = context.new_page()
    for path in ("", "methodology/", "downloads/", f"problems/hard/{PROBLEM}/"):
        page.goto(site_url + path)
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 1, (path, overflow)
    context.close()

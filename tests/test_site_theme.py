"""Light and dark themes: the palette of static/style.css and the colours of highlighted code (highlight.js
in the browser, --hl-* colours) are readable (WCAG AA, 4.5:1) in both, and the code follows the page's theme
(light code on a light page).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from browsing import needs_chromium, watch
from site_fixtures import GPU, PASS

if TYPE_CHECKING:
    from playwright.sync_api import Browser

STYLE = Path(__file__).resolve().parents[1] / "static" / "style.css"
AA = 4.5


def luminance(color: str) -> float:
    """Relative luminance (WCAG 2) of '#rrggbb', '#rgb' or 'rgb(r, g, b)'."""
    if color.startswith("rgb"):
        channels = [int(c) / 255 for c in re.findall(r"\d+", color)[:3]]
    else:
        h = color.lstrip("#")
        h = "".join(c * 2 for c in h) if len(h) == 3 else h[:6]
        channels = [int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def _palette(css: str, scheme: str) -> dict[str, str]:
    """The custom properties of one theme: the :root block (dark), or the light block over it."""
    dark = dict(re.findall(r"--([\w-]+):\s*(#[0-9a-fA-F]{3,8});", css[:css.index("}")]))
    if scheme == "dark":
        return dark
    start = css.index("@media (prefers-color-scheme: light)")
    return {**dark, **dict(re.findall(r"--([\w-]+):\s*(#[0-9a-fA-F]{3,8});", css[start:css.index("}", start)]))}


#: (text, background) pairs the pages use: body text, muted notes, links, every cell tone on its fill.
PAIRS = [("fg", "bg"), ("fg", "panel"), ("muted", "bg"), ("muted", "panel"), ("muted", "head-bg"),
         ("muted", "house-row"), ("accent", "bg"), ("accent", "panel"), ("house", "panel"), ("pass", "panel"),
         ("bad", "bad-bg"), ("warn", "warn-bg"), ("warn", "alert-bg"), ("dnf-fg", "dnf-a"), ("dnf-fg", "dnf-b"),
         ("muted", "dnf-a"), ("lede", "bg"), ("linenos", "bg"), ("linenos", "panel"),
         ("linenos", "code-bg"), ("fg", "code-bg"),
         *((f"hl-{token}", "code-bg") for token in ("keyword", "string", "title", "number", "comment", "builtin"))]


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_the_palette_is_readable_in_both_themes(scheme: str) -> None:
    colors = _palette(STYLE.read_text(encoding="utf-8"), scheme)
    low = {(a, b): round(contrast(colors[a], colors[b]), 2) for a, b in PAIRS if contrast(colors[a], colors[b]) < AA}
    assert low == {}


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_highlighted_code_follows_the_theme_and_reads(browser: Browser, site_url: str, scheme: str) -> None:
    context = browser.new_context(color_scheme=scheme)
    page = context.new_page()
    problems = watch(page)
    page.goto(f"{site_url}runs/{GPU}/{PASS}/")
    page.locator("#source code .hljs-keyword").first.wait_for()  # static/code.js has highlighted it
    page_bg = page.evaluate("getComputedStyle(document.documentElement).backgroundColor")
    code_bg = page.evaluate("getComputedStyle(document.querySelector('#source .code')).backgroundColor")
    assert (luminance(page_bg) > 0.5) == (luminance(code_bg) > 0.5) == (scheme == "light")
    colors = page.evaluate("""() => {
        const seen = {};
        for (const el of document.querySelectorAll('#source pre code span, #source pre code')) {
            seen[el.className || el.tagName] = getComputedStyle(el).color;
        }
        return seen;
    }""")
    assert len(colors) >= 6  # keywords, names, strings, comments, … each their own class
    low = {cls: round(contrast(color, code_bg), 2) for cls, color in colors.items() if contrast(color, code_bg) < AA}
    assert low == {}, (scheme, low)
    assert len(set(colors.values())) >= 3  # highlighted, not one flat colour
    line_number = page.evaluate("getComputedStyle(document.querySelector('#source pre.linenos')).color")
    assert contrast(line_number, page_bg) >= AA
    assert problems == []
    context.close()

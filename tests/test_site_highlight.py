"""Kernel source on run pages: escaped text tagged with its language, for highlight.js in the browser
(the browser side is tests/test_site_browser.py and tests/test_site_theme.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from site_fixtures import GPU, PASS, SiteInputs
from site_pages import parse

from kernelboard.sitegen.highlight import code, language_for
from kernelboard.sitegen.load import load_site


@pytest.mark.parametrize(("name", "language"), [
    ("solution.py", "python"), ("kernel.cu", "cpp"), ("kernel.CUH", "cpp"), ("helpers.h", "cpp"),
    ("ops.cpp", "cpp"), ("notes.txt", "plaintext"), ("Makefile", "plaintext"), ("setup.cfg", "plaintext"),
])
def test_each_file_is_tagged_with_the_language_its_name_says(name: str, language: str) -> None:
    assert language_for(name) == language


@pytest.mark.parametrize(("source", "lines"), [("", 1), ("a", 1), ("a\n", 1), ("a\nb", 2), ("a\nb\n\n", 3)])
def test_one_line_number_per_line(source: str, lines: int) -> None:
    assert code(source).line_numbers.split("\n") == [str(n) for n in range(1, lines + 1)]


def test_the_run_page_carries_the_source_escaped_and_whole(built_site: Path, site_inputs: SiteInputs) -> None:
    """The source is in the HTML as text (what a reader without JavaScript sees), escaped, byte for byte,
    with no server-side highlighting markup in it."""
    source = load_site(site_inputs.data_dir, site_inputs.decks_dir).solutions[PASS]
    page = built_site / "runs" / GPU / PASS / "index.html"
    elements = [c for c in parse(page).iter("code") if (c.get("class") or "").startswith("language-")]
    assert [c.get("class") for c in elements] == ["language-python"]
    assert "".join(elements[0].itertext()) == source and len(elements[0]) == 0  # no child elements
    html = page.read_text(encoding="utf-8")
    assert 'type="module"' in html and "static/code.js" in html
    if "<" in source:
        assert "&lt;" in html


def test_a_source_the_page_cannot_give_back_is_published_as_its_file(fresh_inputs: SiteInputs, tmp_path: Path) -> None:
    """A NUL does not survive HTML parsing (it reads back as U+FFFD), so such a solution lies beside its
    page, linked plainly."""
    from kernelboard.sitegen import build_site

    path = fresh_inputs.data_dir / "submissions" / "hard" / PASS / "solution.py"
    odd = path.read_bytes() + b"# a NUL: \0\n"
    path.write_bytes(odd)
    out = tmp_path / "dist"
    build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, out)
    run_dir = out / "runs" / GPU / PASS
    assert (run_dir / "solution.py").read_bytes() == odd
    assert "solution.py" in [a.get("href") for a in parse(run_dir / "index.html").iter("a")]

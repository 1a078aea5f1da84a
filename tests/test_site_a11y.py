"""Accessibility rules every page of the built site keeps (the issue's "accessible tables and charts"):
tables say what they hold (a caption) and which way each header runs (th scope), every chart has a text
alternative (its figcaption), every image an alt text, every page a language.
"""

from __future__ import annotations

from pathlib import Path

from site_fixtures import GPU, PROBLEM
from site_pages import html_pages, parse, text


def _ancestors(root, element):  # type: ignore[no-untyped-def]
    """The classes of the elements around `element` (ElementTree has no parent links)."""
    parents = {c: p for p in root.iter() for c in p}
    classes: set[str] = set()
    while element in parents:
        element = parents[element]
        classes.update((element.get("class") or "").split())
    return classes


def test_every_table_has_a_caption_and_scoped_headers(built_site: Path) -> None:
    missing = []
    for rel, path in html_pages(built_site).items():
        root = parse(path)
        assert root.get("lang") == "en", rel
        for table in root.iter("table"):
            prose = _ancestors(root, table) & {"readme", "prose"}  # Markdown tables have no caption syntax
            if not prose and (table.find("caption") is None or not text(table.find("caption"))):
                missing.append(f"{rel}: table.{table.get('class')} has no caption")
            missing += [f"{rel}: <th>{text(th)}</th> has no scope" for th in table.iter("th")
                        if th.get("scope") not in ("col", "row")]
    assert missing == []


def test_every_chart_and_image_has_a_text_alternative(built_site: Path) -> None:
    charts = 0
    for rel, path in html_pages(built_site).items():
        root = parse(path)
        for figure in root.iter("figure"):
            charts += 1
            caption = figure.find("figcaption")
            assert caption is not None and len(text(caption)) > 40, f"{rel}: a chart without a text alternative"
        assert all(img.get("alt") is not None for img in root.iter("img")), rel
    assert charts >= 3


def test_the_problem_charts_say_what_they_show(built_site: Path) -> None:
    page = parse(built_site / "problems" / "hard" / PROBLEM / "index.html")
    section = page.find(f".//section[@id='gpu-{GPU}']")
    captions = [text(c) for c in section.iter("figcaption")]
    assert captions[0].startswith("Bar chart, log axis: the geomean speedup over torch.compile of the 3 passing")
    assert "the fastest is kernelboard house at 2.54×" in captions[0]
    assert "2 submissions that did not pass are marked on the 1× line" in captions[0]
    assert "the highest is kernelboard house at 71.0%" in captions[1]

"""Reading a built site in tests: pages parsed with html5lib, their text, and the internal-link check
that every site test applies to the pages it owns."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from xml.etree.ElementTree import Element

import html5lib

if TYPE_CHECKING:
    from kernelboard.sitegen.load import SiteData


def html_pages(site: Path) -> dict[str, Path]:
    """Every HTML page of a built site, by its path relative to the site."""
    return {p.relative_to(site).as_posix(): p for p in sorted(site.rglob("*.html"))}


def parse(path: Path) -> Element:
    return html5lib.parse(path.read_bytes(), treebuilder="etree", namespaceHTMLElements=False)


def text(element: Element | None) -> str:
    """An element's text with its whitespace collapsed, as a reader sees it."""
    assert element is not None
    return " ".join("".join(element.itertext()).split())


def check_internal_links(site: Path, pages: Mapping[str, Path], *, allow_external: bool) -> int:
    """Assert that every href/src of `pages` is relative (no scheme, host or leading '/': the site must
    work under /REPO/), names a file of the site or a folder with index.html, and that each #fragment
    names an id on its target. http(s) links to other hosts pass only with `allow_external`.
    Returns how many links were checked."""
    root = site.resolve()
    ids: dict[str, set[str]] = {}
    checked = 0
    for rel, path in pages.items():
        for element in parse(path).iter():
            for attr in ("href", "src"):
                url = element.get(attr)
                if url is None:
                    continue
                parts = urlsplit(url)
                if allow_external and parts.scheme in ("http", "https"):
                    continue
                assert not parts.scheme and not parts.netloc, f"{rel}: {attr}={url!r} is not a relative link"
                assert not url.startswith("/"), f"{rel}: {attr}={url!r} is root-absolute; breaks under /REPO/"
                target = (path.parent / parts.path).resolve() if parts.path else path.resolve()
                if target.is_dir():
                    target = target / "index.html"
                assert target.is_file(), f"{rel}: {attr}={url!r} -> {target} does not exist"
                assert root in target.parents, f"{rel}: {url!r} leaves the site"
                if parts.fragment:
                    key = target.relative_to(root).as_posix()
                    if key not in ids:
                        ids[key] = {e.get("id") for e in parse(target).iter() if e.get("id")}
                    assert parts.fragment in ids[key], f"{rel}: {url!r}: no id {parts.fragment!r} in {key}"
                checked += 1
    return checked


def methodology_section(data: SiteData, section_id: str) -> Element:
    """One section of the methodology page rendered from `data` alone, without building the site."""
    from kernelboard.sitegen.pages import plan
    from kernelboard.sitegen.render import _render, _site, make_env

    page = next(p for p in plan(data) if p.kind == "methodology")
    doc = html5lib.parse(_render(make_env(), page, _site(data, None), None), namespaceHTMLElements=False)
    return next(s for s in doc.iter("section") if s.get("id") == section_id)

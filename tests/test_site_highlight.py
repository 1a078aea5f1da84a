"""Highlighted source: each build (and each page plan) highlights through the cache it is handed."""

from __future__ import annotations

import threading
from itertools import chain
from pathlib import Path

import pytest
from site_fixtures import SiteInputs

from kernelboard.sitegen import build_site, render
from kernelboard.sitegen.highlight import HighlightCache
from kernelboard.sitegen.load import load_site
from kernelboard.sitegen.pages import plan


def _entries(cache_dir: Path) -> set[str]:
    return {p.name for p in (cache_dir / "highlight").rglob("*.html")}


def test_two_plans_rendered_in_turn_each_use_their_own_cache(site_inputs: SiteInputs) -> None:
    """The same run pages from two plans, rendered alternately in one process: each page highlights
    through its plan's cache, and both give the same source HTML."""
    data = load_site(site_inputs.data_dir, site_inputs.decks_dir)
    first, second = HighlightCache(), HighlightCache()
    runs = [[p for p in plan(data, highlight=cache) if p.kind == "run"] for cache in (first, second)]
    sources = {r.run_id: data.solutions.get(r.run_id) for r in data.results}
    assert len(set(filter(None, sources.values()))) > 1  # several distinct sources to highlight
    html = [[page.context()["source_html"] for page in pair] for pair in zip(*runs, strict=True)]
    assert all(a == b for a, b in html) and any(a is not None for a, _ in html)
    assert first.used == second.used and first.misses == second.misses == len(first.used)
    assert HighlightCache().used == set()  # a fresh cache starts empty: nothing is shared between them


def test_two_builds_at_once_fill_their_own_cache_folders(site_inputs: SiteInputs, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builds in two threads, each with its own cache folder, both planned before either renders.
    The cache used to be a module global that each build swapped in: the build that swapped first
    rendered through the other's cache, so its folder stayed empty (and the global was left pointing at
    a finished build's cache). Now each build's pages carry the build's cache."""
    barrier = threading.Barrier(2, timeout=60)
    real_plan = render.plan

    def plan_then_wait(*args: object, **kwargs: object) -> list:
        pages = real_plan(*args, **kwargs)
        barrier.wait()  # both builds have planned (and chosen their cache) before either renders
        return pages

    monkeypatch.setattr(render, "plan", plan_then_wait)
    caches, outs = [tmp_path / "cache-a", tmp_path / "cache-b"], [tmp_path / "dist-a", tmp_path / "dist-b"]
    errors: list[BaseException] = []

    def build(i: int) -> None:
        try:
            build_site(site_inputs.data_dir, site_inputs.decks_dir, outs[i], cache_dir=caches[i], jobs=1)
        except BaseException as exc:  # handed to the test thread below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert _entries(caches[0]) == _entries(caches[1]) != set()
    pages = [{p.relative_to(out): p.read_bytes() for p in out.rglob("*.html")} for out in outs]
    assert pages[0] == pages[1] and any(b"highlighttable" in html for html in chain(pages[0].values()))

"""The output tree: a build spread over worker processes writes the same bytes as one process, and a
build that fails in a worker leaves the previous site as it was."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from site_fixtures import SiteInputs

from kernelboard.sitegen import build_site, render
from kernelboard.sitegen import views as site_views
from kernelboard.sitegen.output import Workers, swap_in, sweep


def _files(site: Path) -> dict[str, bytes]:
    return {p.relative_to(site).as_posix(): p.read_bytes() for p in sorted(site.rglob("*")) if p.is_file()}


def test_two_workers_write_the_same_site_as_one_process(site_inputs: SiteInputs, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    one = build_site(site_inputs.data_dir, site_inputs.decks_dir, tmp_path / "one", jobs=1)
    two = build_site(site_inputs.data_dir, site_inputs.decks_dir, tmp_path / "two", jobs=2)
    assert (one.pages, one.files) == (two.pages, two.files)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert len(_files(tmp_path / "two")) == two.files


def test_a_worker_that_fails_leaves_the_previous_site_untouched(site_inputs: SiteInputs, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dist"
    build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=2)
    before = _files(out)

    def broken(*args: object) -> None:
        raise RuntimeError("a run page that cannot render")

    monkeypatch.setattr(site_views, "run", broken)  # the workers fork after this, so they inherit it
    with pytest.raises(RuntimeError, match="cannot render"):
        build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=2, force=True)
    assert _files(out) == before
    # no half-written folder left beside it (the input files' digests are kept: fingerprint.Hashes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dist.hashes", "dist"]


def test_swap_in_replaces_the_previous_site_and_removes_it(tmp_path: Path) -> None:
    out, new = tmp_path / "dist", tmp_path / "new"
    for i in range(3):
        (out / "runs" / "gpu" / f"r{i}").mkdir(parents=True)
        (out / "runs" / "gpu" / f"r{i}" / "index.html").write_text("old")
    (new / "runs").mkdir(parents=True)
    (new / "index.html").write_text("new")
    with Workers(1) as workers:
        swap_in(new, out, workers)
    assert _files(out) == {"index.html": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist"]


def test_stale_leftovers_of_an_interrupted_removal_are_swept(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    out.mkdir()
    stale, fresh = tmp_path / ".dist.old.stale", tmp_path / ".dist.old.fresh"
    (stale / "site").mkdir(parents=True)
    (fresh / "site").mkdir(parents=True)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    sweep(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dist.old.fresh", "dist"]


def test_a_large_site_keeps_a_spare_that_the_next_build_rewrites_into_the_same_bytes(
        site_inputs: SiteInputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large sites keep the previous copy as `.dist.spare`; the next build takes it over, rewrites what
    changed in place and removes what the new site lacks: the result is the same bytes as a fresh build."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    fresh = tmp_path / "fresh" / "dist"
    build_site(site_inputs.data_dir, site_inputs.decks_dir, fresh, jobs=1)
    monkeypatch.setattr(render, "PARALLEL_MIN_PAGES", 1)
    out = tmp_path / "site" / "dist"
    for _ in range(2):
        build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=2, force=True)
    spare = out.parent / ".dist.spare"
    assert sorted(p.name for p in out.parent.iterdir()) == [".dist.data", ".dist.hashes", ".dist.spare", "dist"]
    # junk in the spare: a stale page, a file where a folder belongs, a folder where a file belongs, a link
    (spare / "runs" / "gone" / "r0").mkdir(parents=True)
    (spare / "runs" / "gone" / "r0" / "index.html").write_text("stale")
    shutil.rmtree(spare / "static")
    (spare / "static").write_text("not a folder")
    (spare / "robots.txt").unlink()
    (spare / "robots.txt").mkdir()
    (spare / "index.html").unlink()
    (spare / "index.html").symlink_to(tmp_path / "outside.html")
    before = (spare / "runs").stat().st_ino
    build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=2, force=True)
    assert (out / "runs").stat().st_ino == before  # the spare's folders, taken over
    assert _files(out) == _files(fresh)
    assert not (tmp_path / "outside.html").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == [".dist.data", ".dist.hashes", ".dist.spare", "dist"]


def test_a_failed_large_build_gives_the_spare_back(site_inputs: SiteInputs, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "PARALLEL_MIN_PAGES", 1)
    out = tmp_path / "dist"
    for _ in range(2):
        build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=2, force=True)
    before = _files(out)

    def broken(*args: object) -> None:
        raise RuntimeError("a run page that cannot render")

    monkeypatch.setattr(site_views, "run", broken)
    with pytest.raises(RuntimeError, match="cannot render"):
        build_site(site_inputs.data_dir, site_inputs.decks_dir, out, jobs=2, force=True)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dist.data", ".dist.hashes", ".dist.spare", "dist"]

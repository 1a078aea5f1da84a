"""Shared fixtures: the generated site inputs (tests/site_fixtures.py), one built site and its URL, and the
CPU baselines the session's grading batches measured, kept for later batches of the same problem (tests/grading.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from browsing import CHROMIUM, HAVE_CHROMIUM, chromium, serve
from site_fixtures import SiteInputs, make_site_inputs

if TYPE_CHECKING:
    from grading import MeasuredBaselines


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests keep kernelboard's cache ($KERNELBOARD_CACHE) in the session's temp folder, not in ~/.cache."""
    os.environ["KERNELBOARD_CACHE"] = str(tmp_path_factory.mktemp("kernelboard-cache"))


@pytest.fixture(scope="session")
def site_inputs(tmp_path_factory: pytest.TempPathFactory) -> SiteInputs:
    """Read-only inputs shared by the session; tests that change inputs use `fresh_inputs`."""
    return make_site_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture
def fresh_inputs(tmp_path: Path) -> SiteInputs:
    """A private copy of the inputs that a test may corrupt."""
    return make_site_inputs(tmp_path / "inputs")


@pytest.fixture(scope="session")
def built_site(site_inputs: SiteInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture site, built once: the `dist` folder."""
    from kernelboard.sitegen import build_site  # here, so grader-only test runs never load the site stack

    out = tmp_path_factory.mktemp("built") / "dist"
    build_site(site_inputs.data_dir, site_inputs.decks_dir, out)
    return out


@pytest.fixture(scope="session")
def site_url(built_site: Path) -> Iterator[str]:
    """The fixture site served over HTTP for the session (files that build their own site override it)."""
    with serve(built_site) as url:
        yield url


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless system Chromium for every browser test of the session."""
    if not HAVE_CHROMIUM:
        pytest.skip(f"{CHROMIUM} is not installed (and CI is unset)")
    with chromium() as browser:
        yield browser


@pytest.fixture(scope="session")
def measured_baselines() -> MeasuredBaselines:
    """Each problem's CPU baselines measured once, for the grading batches that are about their verdicts."""
    from grading import MeasuredBaselines  # here, so site-only test runs never load the grader

    return MeasuredBaselines()

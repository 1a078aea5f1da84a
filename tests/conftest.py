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

# torch on one thread in this process and in every grader it starts (judge, runner and baselines alike, so
# speedups still compare like with like; the sandbox passes OMP_NUM_THREADS on): two xdist workers grading
# at once on a 2-core machine would run four processes of a thread per core, and an op of a few hundred µs
# then took 20-50 ms while its OpenMP threads waited for each other's time slices. Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
def committed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site of the committed `data/` and decks, as `make site` builds it, built once: the `dist` folder."""
    from kernelboard.sitegen import build_site

    repo = Path(__file__).resolve().parents[1]
    return build_site(repo / "data", repo / "eval" / "decks", tmp_path_factory.mktemp("committed") / "dist").out_dir


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
def measured_baselines(tmp_path_factory: pytest.TempPathFactory) -> MeasuredBaselines:
    """Each problem's CPU baselines measured once, for the grading batches that are about their verdicts;
    under pytest-xdist in the run's folder that every worker's own temp folder sits in, so workers share them."""
    from grading import MeasuredBaselines  # here, so site-only test runs never load the grader

    own = tmp_path_factory.getbasetemp()
    return MeasuredBaselines((own.parent if os.environ.get("PYTEST_XDIST_WORKER") else own) / "measured-baselines")


_SLOW_LEFT_OUT = pytest.StashKey[int]()


def _runs_slow(config: pytest.Config) -> bool:
    """Slow tests run in CI (`CI` set: `.ci/run`, `make test-all`) or when `-m` names them."""
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return ci or "slow" in (config.getoption("markexpr") or "")


#: Test modules that take a minute or more (mostly one CPU grading batch in a module fixture), longest first.
#: They are collected first, so that pytest-xdist (`make test` runs `--dist loadfile`, a module to a worker)
#: starts them at once and the short modules fill in around them, instead of one long module starting last.
LONGEST_FIRST = ("test_eval_cpu.py", "test_eval_stateful.py", "test_redteam_judge.py", "test_redteam_sandbox.py",
                 "test_deck_gemms.py", "test_deck_topk_moe.py", "test_deck_kda.py", "test_library_line.py",
                 "test_formats.py", "test_redteam_faults.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests marked `slow` outside CI; put the longest modules first (stable: the order within
    a module and among the other modules is kept)."""
    if not _runs_slow(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.stash[_SLOW_LEFT_OUT] = len(slow)
            if hasattr(config, "workeroutput"):  # an xdist worker: its controller prints the summary
                config.workeroutput["slow_left_out"] = len(slow)
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist's controller: keep what a worker left out (every worker collects, and leaves out, the same)."""
    left_out = getattr(node, "workeroutput", {}).get("slow_left_out", 0)
    node.config.stash[_SLOW_LEFT_OUT] = max(node.config.stash.get(_SLOW_LEFT_OUT, 0), left_out)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say, under the results, how many slow tests were left out and how to run them."""
    left_out = config.stash.get(_SLOW_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow end-to-end tests deselected (CI only): "
                                    "`make test-all` or `CI=true pytest` runs them")

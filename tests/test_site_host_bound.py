"""Host-bound shapes on run pages: a covered time well above the call's CUDA-graph GPU time was set by the
host's dispatch, and moves with the grading host's CPU (gpt-5.5's 03 kernel: 3.57x and 5.08x under one
timing method on two H200 hosts), so its run page says so beside the time."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kernelboard.sitegen.load import HOST_BOUND_RATIO, SiteData, load_site

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
DECKS = REPO / "eval" / "decks"


@pytest.fixture(scope="module")
def committed() -> SiteData:
    return load_site(DATA, DECKS)


def test_only_a_covered_time_well_above_its_graph_time_is_host_bound(committed: SiteData) -> None:
    shape = next(s for r in committed.results for s in r.shapes if s.graph_ms and s.median_ms)
    covered = replace(shape, timing_method="covered", graph_ms=0.02)
    assert replace(covered, median_ms=0.05).host_bound == pytest.approx(2.5)
    assert replace(covered, median_ms=0.02 * HOST_BOUND_RATIO).host_bound == pytest.approx(HOST_BOUND_RATIO)
    assert replace(covered, median_ms=0.024).host_bound is None  # 1.2x: the GPU's time, give or take
    # a synchronised time includes the dispatch by design; no graph time and no GPU span, nothing to compare
    # with (which committed shape comes first is the data's: its own span may or may not be set)
    assert replace(covered, median_ms=0.05, timing_method="synchronised").host_bound is None
    assert replace(covered, median_ms=0.05, graph_ms=None, gpu_span_ms=None).host_bound is None


def test_without_a_graph_time_the_covered_loops_gpu_span_decides(committed: SiteData) -> None:
    """A Mega step (ms, so no CUDA-graph replay): gpt-5.5's 040852 on the H200, shape 1, a GPU span of
    1.47 ms inside a 5.34 ms covered median (grader 0.4.6's log), is host-bound; the graph time, where
    there is one, still decides."""
    shape = next(s for r in committed.results for s in r.shapes if s.median_ms)
    step = replace(shape, timing_method="covered", graph_ms=None, median_ms=5.3368, gpu_span_ms=1.4664)
    assert step.gpu_ms == 1.4664 and step.host_bound == pytest.approx(3.64, abs=0.01)
    assert replace(step, gpu_span_ms=5.0).host_bound is None  # its GPU's time, give or take
    assert replace(step, graph_ms=5.0).host_bound is None and replace(step, graph_ms=5.0).gpu_ms == 5.0
    assert replace(step, gpu_span_ms=None).host_bound is None  # graded before 0.4.8: nothing to compare with


def test_each_h200_run_page_labels_exactly_its_host_bound_shapes(committed_site: Path) -> None:
    """Counted straight off shapes.parquet, not through sitegen: every covered shape whose median is at
    least HOST_BOUND_RATIO times its graph time, and only those, is labelled on its run's page."""
    expected: dict[str, int] = {}
    for r in pq.read_table(DATA / "results" / "h200" / "shapes.parquet").to_pylist():
        bound = (r["timing_method"] == "covered" and r["median_ms"] and r["graph_ms"]
                 and r["median_ms"] >= HOST_BOUND_RATIO * r["graph_ms"])
        expected[r["run_id"]] = expected.get(r["run_id"], 0) + bool(bound)
    pages = {p.parent.name: p.read_text() for p in (committed_site / "runs" / "h200").glob("*/index.html")}
    assert pages
    for run_id, text in pages.items():
        labels = re.findall(r'class="sub host-bound" title="([0-9.]+)× its GPU time \(CUDA-graph replay\)', text)
        assert len(labels) == expected.get(run_id, 0), run_id
        assert all(float(x) >= HOST_BOUND_RATIO - 0.05 for x in labels)
    assert sum(expected.get(i, 0) for i in pages) >= 1  # host-bound 03 kernels are on the board (gpt-5.5, MiniMax-M3)

"""The launch counter (eval/launches.py) on fake profiles: what counts as a launch, and the largest
launch's share; and the shapes table reads files written before its two columns existed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelboard.eval.launches import count_launches
from kernelboard.eval.tables import read_table

DATA = Path(__file__).resolve().parents[1] / "data" / "results"


def test_a_single_kernel_step_is_one_launch_holding_all_its_time() -> None:
    count = count_launches([("Memcpy HtoD (Pageable -> Device)", 3.0), ("decode_step_megakernel", 410.0),
                            ("Memset (Device)", 1.0)])
    assert (count.launches, count.top_share) == (1, 1.0)


def test_a_graph_replay_counts_every_node() -> None:
    """A CUDA-graph replay's kernels are device events like any others: forty nodes, forty launches."""
    nodes = [(f"void gemv_kernel<{i % 4}>(...)", 10.0) for i in range(39)] + [("rmsnorm_kernel", 30.0)]
    count = count_launches(nodes)
    assert count.launches == 40 and count.top_share == pytest.approx(30.0 / 420.0)


def test_no_kernel_means_no_share() -> None:
    assert count_launches([]).top_share is None and count_launches([("Memcpy DtoD", 5.0)]).launches == 0
    zero = count_launches([("k", 0.0), ("k", 0.0)])
    assert (zero.launches, zero.top_share) == (2, None)  # launches counted, but no time to share out


def test_committed_shapes_read_with_the_new_columns_as_nulls() -> None:
    table = read_table(DATA / "h200" / "shapes.parquet", "shapes")
    assert {"launches", "top_kernel_share"} <= set(table.column_names)
    assert table.num_rows > 0


def test_the_run_page_shows_launches_per_call_beside_the_kernels() -> None:
    """A graded row with kernels and launches: the run page's kernel list says how many launches per
    call and the largest one's share; a row without the count (graded before 0.3.6) says nothing."""
    import dataclasses

    import html5lib

    from kernelboard.sitegen.load import load_site
    from kernelboard.sitegen.pages import plan
    from kernelboard.sitegen.render import _render, _site, make_env

    data = load_site(DATA.parent, DATA.parents[1] / "eval" / "decks")
    result = next(r for r in data.results if r.shapes and r.shapes[0].kernels and r.gpu == "h200"
                  and all(s.launches is None for s in r.shapes))  # graded before 0.3.6: no count yet
    counted = dataclasses.replace(result, shapes=(
        dataclasses.replace(result.shapes[0], launches=3, top_kernel_share=0.82), *result.shapes[1:]))
    data = dataclasses.replace(data, results=[counted if r is result else r for r in data.results])
    page = next(p for p in plan(data) if p.kind == "run" and p.result is counted)
    html = _render(make_env(), page, _site(data, None), None).decode()
    html5lib.HTMLParser(strict=True).parse(html)
    assert f"shape {counted.shapes[0].shape_idx} (3 launches per call, the largest 82" in html
    if len(counted.shapes) > 1:
        assert f"shape {counted.shapes[1].shape_idx}: " in html  # no count: nothing claimed

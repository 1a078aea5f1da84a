"""The efficiency page: the Pareto frontier, what is plotted and what is listed instead, and the charts
drawn in a real Chromium (the system's, through Playwright; never a downloaded browser)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from xml.etree.ElementTree import Element

import html5lib
import pytest
from browsing import needs_chromium, serve, watch
from site_fixtures import GPU, PROBLEM, SiteInputs, _result, _run, _shape_rows, make_site_inputs
from site_pages import parse as _tree
from site_pages import text as _text

from kernelboard.eval.deck import load_problem
from kernelboard.eval.tables import upsert
from kernelboard.sitegen.board import build_boards
from kernelboard.sitegen.load import load_site
from kernelboard.sitegen.render import render_all
from kernelboard.sitegen.views_efficiency import efficiency, pareto_frontier

# ------------------------------------------------------------------------------------------ frontier


def test_frontier_of_nothing_and_of_one_point() -> None:
    assert pareto_frontier([]) == []
    assert pareto_frontier([(5.0, 0.3)]) == [0]


def test_frontier_is_the_staircase_ordered_by_spend() -> None:
    points = [(10.0, 0.9), (1.0, 0.2), (5.0, 0.5), (6.0, 0.4), (20.0, 0.9), (3.0, 0.6)]
    # (5, .5) and (6, .4) lose to (3, .6); (20, .9) loses to (10, .9): same score for more.
    assert pareto_frontier(points) == [1, 5, 0]


def test_frontier_ties() -> None:
    # Equal points do not dominate each other: both stay.
    assert pareto_frontier([(2.0, 0.5), (2.0, 0.5)]) == [0, 1]
    # Same spend, lower score: dominated. Same score, higher spend: dominated.
    assert pareto_frontier([(2.0, 0.5), (2.0, 0.7)]) == [1]
    assert pareto_frontier([(3.0, 0.7), (2.0, 0.7)]) == [1]
    # A duplicate of a dominated point is dominated too.
    assert pareto_frontier([(1.0, 1.0), (2.0, 0.5), (2.0, 0.5)]) == [0]


def test_one_point_dominating_all_others_is_the_whole_frontier() -> None:
    points = [(4.0, 0.1), (2.0, 0.0), (1.0, 1.0), (8.0, 0.99), (1.5, 1.0)]
    assert pareto_frontier(points) == [2]
    # Every score 0: only the cheapest survives.
    assert pareto_frontier([(3.0, 0.0), (1.0, 0.0), (2.0, 0.0)]) == [1]


# ------------------------------------------------------------------------------------- fixture site

#: Extra AI-model passes on h200 beside the fixture's five runs (Fable 5 and Orbit 2 report 61,340 output
#: tokens and $4.12; Kinetic K3 is a DNF). Bandwidth fraction sets the speedup; None is missing telemetry.
NOVA = "20261128_131500_claude_nova-1_03_paged_attention"  # no telemetry at all
QUILL = "20261128_141500_codex_quill-2_03_paged_attention"  # tokens, no cost
EMBER = "20261128_151500_aider_ember-3_03_paged_attention"  # both: cheap, slower than Fable
_EXTRA = (
    (NOVA, "nova-1", "Nova 1", "claude", 0.45, None, None),
    (QUILL, "quill-2", "Quill 2", "codex", 0.30, 20_000, None),
    (EMBER, "ember-3", "Ember 3", "aider", 0.40, 150_000, 1.50),
)
WITH_TOKENS = {"Fable 5", "Orbit 2", "Quill 2", "Ember 3"}
WITH_COST = {"Fable 5", "Orbit 2", "Ember 3"}


def _add_models(inputs: SiteInputs) -> None:
    problem = load_problem(inputs.decks_dir / "hard" / PROBLEM)
    runs, results, shapes = [], [], []
    for run_id, model, display, harness, bw, tokens, cost in _EXTRA:
        runs.append(_run(run_id, model, display, harness, output_tokens=tokens, cost_usd=cost))
        rows, _ = _shape_rows(problem, run_id, GPU, bw)
        results.append(_result(run_id, GPU, "pass", "passed every shape, seed and stress case", rows))
        shapes += rows
    out = inputs.results_dir / GPU
    upsert(out / "runs.parquet", "runs", runs)
    upsert(out / "results.parquet", "results", results)
    upsert(out / "shapes.parquet", "shapes", shapes)


@pytest.fixture(scope="module")
def eff_inputs(tmp_path_factory: pytest.TempPathFactory) -> SiteInputs:
    inputs = make_site_inputs(tmp_path_factory.mktemp("eff-inputs"))
    _add_models(inputs)
    return inputs


@pytest.fixture(scope="module")
def eff_site(eff_inputs: SiteInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kernelboard.sitegen import build_site

    out = tmp_path_factory.mktemp("eff-built") / "dist"
    build_site(eff_inputs.data_dir, eff_inputs.decks_dir, out)
    return out






def _find(tree: Element, element_id: str) -> Element:
    found = tree.find(f".//*[@id='{element_id}']")
    assert found is not None, f"no element with id {element_id!r}"
    return found


def _plotted(html: str, div_id: str) -> list[dict]:
    """The traces of one chart, parsed from the page: its JSON data block (drawn by static/charts.js) or,
    in the older form, its inline Plotly.newPlot call."""
    block = re.search(r'<script type="application/json" class="chart-data" data-for="' + re.escape(div_id)
                      + r'">(.*?)</script>', html, re.S)
    if block:
        return json.loads(block.group(1))["figure"]["data"]
    match = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*', html)
    assert match, f"no chart data for {div_id!r}"
    data, _ = json.JSONDecoder().raw_decode(html, match.end())
    return data


def _page(site: Path) -> Path:
    return site / "efficiency" / "index.html"


def test_the_page_is_strictly_valid_html(eff_site: Path, built_site: Path) -> None:
    for site in (eff_site, built_site):
        html5lib.HTMLParser(strict=True).parse(_page(site).read_bytes())


def test_models_without_telemetry_or_score_are_listed_with_the_reason(eff_site: Path) -> None:
    listed = {_text(li.find("strong")): _text(li)
              for li in _find(_tree(_page(eff_site)), f"no-telemetry-{GPU}-hard").iterfind(".//li")}
    assert set(listed) == {"Nova 1", "Quill 2", "Kinetic K3 <beta>"}
    assert "no output-token count (1 of 1 run)" in listed["Nova 1"] and "no cost (1 of 1 run)" in listed["Nova 1"]
    assert "no cost" in listed["Quill 2"] and "output-token" not in listed["Quill 2"]
    assert "no score: every run on this board was a DNF" in listed["Kinetic K3 <beta>"]


def test_the_charts_carry_every_model_with_telemetry_and_no_house_row(eff_site: Path) -> None:
    html = _page(eff_site).read_text()
    for key, expected in (("tokens", WITH_TOKENS), ("cost", WITH_COST)):
        traces = _plotted(html, f"chart-eff-{key}-{GPU}-hard")
        names = [n for t in traces if t.get("mode") == "markers+text" for n in t["text"]]
        assert sorted(names) == sorted(expected), key
        frontier = next(t for t in traces if t.get("mode") == "lines")
        assert frontier["line"]["shape"] == "hv"
    tokens = _plotted(html, f"chart-eff-tokens-{GPU}-hard")
    frontier = next(t for t in tokens if t.get("mode") == "lines")
    assert frontier["x"] == [20_000, 61_340]  # Quill 2, then Fable 5; Orbit 2 and Ember 3 are dominated
    for house in ("kernelboard house", "Reference (eager PyTorch)"):
        assert house not in json.dumps([_plotted(html, f"chart-eff-{k}-{GPU}-hard") for k in ("tokens", "cost")])


def test_the_tables_beside_the_charts_hold_the_board_scores(eff_site: Path, eff_inputs: SiteInputs) -> None:
    data = load_site(eff_inputs.data_dir, eff_inputs.decks_dir)
    board = next(b for b in build_boards(data) if (b.gpu, b.bench) == (GPU, "hard"))
    scores = {r.display: f"{r.score:.3f}" for r in board.rows if r.score is not None}
    tree = _tree(_page(eff_site))
    for key, expected in (("tokens", WITH_TOKENS), ("cost", WITH_COST)):
        table = _find(tree, f"table-eff-{key}-{GPU}-hard")
        rows = {(tr.find("th").text or "").strip(): [_text(td) for td in tr.iterfind("td")]
                for tr in table.iterfind(".//tbody/tr")}
        assert set(rows) == expected
        for name, cells in rows.items():
            assert cells[0] == scores[name], name  # the very number the home board prints
        figure = _find(tree, f"chart-eff-{key}-{GPU}-hard-alt")  # the chart's text alternative
        assert "Pareto frontier" in _text(figure)
    tokens = _find(tree, f"table-eff-tokens-{GPU}-hard")
    rows = {(tr.find("th").text or "").strip(): [_text(td) for td in tr.iterfind("td")]
            for tr in tokens.iterfind(".//tbody/tr")}
    assert rows["Fable 5"] == [scores["Fable 5"], "61,340", "1", "◆ frontier"]
    assert rows["Orbit 2"][3] == "dominated" and rows["Orbit 2"][0] == "0.000"
    cost = _find(tree, f"table-eff-cost-{GPU}-hard")
    assert "$1.50" in _text(cost) and "$4.12" in _text(cost)


def test_house_rows_are_named_and_left_out(eff_site: Path) -> None:
    tree = _tree(_page(eff_site))
    assert "not models: they are never plotted and never on a frontier" in _text(tree.find(".//main"))
    board = _text(_find(tree, f"eff-{GPU}-hard"))
    assert "Left out as reference points (house rows, not models): kernelboard house house kernel, " \
           "Reference (eager PyTorch) calibration." in board
    cpu = _text(_find(tree, "eff-cpu-hard"))
    assert "No AI-model runs on this board yet" in cpu


def test_plotly_loads_once_on_the_page(eff_site: Path) -> None:
    html = _page(eff_site).read_text()
    assert html.count('<script src="../static/plotly.min.js"></script>') == 1


def test_only_house_rows_means_nothing_to_plot_and_no_plotly(site_inputs: SiteInputs) -> None:
    data = load_site(site_inputs.data_dir, site_inputs.decks_dir)
    house_only = dataclasses.replace(data, results=tuple(r for r in data.results if data.runs[r.run_id].is_house))
    context = efficiency(house_only)
    assert context["charts"] is False and context["any_points"] is False
    html = render_all(house_only)["efficiency/index.html"].decode()
    tree = html5lib.parse(html, treebuilder="etree", namespaceHTMLElements=False)
    assert "Every graded row so far is a house row." in _text(_find(tree, "nothing-to-plot"))
    assert "plotly" not in html


# ------------------------------------------------------------------------------------------ browser

@pytest.fixture(scope="module")
def eff_url(eff_site: Path) -> Iterator[str]:
    with serve(eff_site) as url:
        yield url


@pytest.mark.browser
@needs_chromium
def test_the_charts_draw_without_console_errors(browser, eff_url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(f"{eff_url}efficiency/")
    for key, expected in (("tokens", WITH_TOKENS), ("cost", WITH_COST)):
        chart = f"#chart-eff-{key}-{GPU}-hard"
        page.wait_for_selector(f"{chart} .plot-container .main-svg")
        assert page.locator(f"{chart} .scatterlayer .point").count() == len(expected)
        assert page.locator(f"{chart} .scatterlayer .js-line").count() == 1  # the frontier
    assert problems == []
    page.close()


def test_the_gpus_kernelboard_measured_come_first(committed_site: Path) -> None:
    """As the home page's tabs run: on the committed data the H100 SXM and H200 sections (graded here) come
    before the imported B200, H100 PCIe and RTX PRO 6000 ones."""
    page = _tree(committed_site / "efficiency" / "index.html")
    gpus = [s.get("id") for s in page.iter("section") if "gpu" in (s.get("class") or "").split()]
    assert gpus == ["gpu-h100-sxm", "gpu-h200", "gpu-b200", "gpu-h100-pcie", "gpu-rtx-pro-6000"]

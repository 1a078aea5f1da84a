"""The charts as a reader sees them (issue 15): log axes ticked 0.5×, 1×, 2× with the 1× line named, one
colour per model on every page from a colour-blind-safe palette, sorted sideways bars, no invisible
roofline sliver, a phone layout that fits 390 px, and a problem page that weighs under 1 MB on the wire.

Three layers: the figure specs of `sitegen.charts` (no browser); the fixture site in the system Chromium
(tests/browsing.py), at 1280 and 390 px, dark and light; and a page of three charts with 30 models and
long names, written from `sitegen.charts` with the site's own static/ files, for what the small fixture
cannot show (crowding, a 0.5% bar, colour clashes).
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from browsing import ARTIFACTS, needs_chromium, serve, watch
from site_fixtures import GPU, PROBLEM
from site_pages import html_pages

from kernelboard.sitegen import charts

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

REPO = Path(__file__).resolve().parents[1]
STATIC = REPO / "static"
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
PROBLEM_PAGE = f"problems/hard/{PROBLEM}/"
#: The issue's budget for a problem page: HTML + the scripts, styles and icon it loads, as sent gzipped
#: (GitHub Pages compresses text). Uncompressed, the published basic Plotly bundle alone is 1.19 MB; the
#: raw budget below is there to catch the full 4.8 MB bundle coming back.
WIRE_BUDGET_BYTES = 1_000_000
RAW_BUDGET_BYTES = 1_400_000


# --------------------------------------------------------------------------------- the specs, no browser


def test_speedup_ticks_are_1_2_5_steps_labelled_with_times() -> None:
    spec = charts.speedup_spec(["a", "b", "c"], [0.62, 2.28, 9.08], [False] * 3, "GPU")
    axis = spec["layout"]["xaxis"]
    assert axis["type"] == "log"
    assert axis["ticktext"] == ["0.5×", "1×", "2×", "5×", "10×"]
    assert axis["tickvals"] == [0.5, 1, 2, 5, 10]
    wide = charts.speedup_spec(["a", "b"], [0.004, 300.0], [False] * 2, "GPU")["layout"]["xaxis"]
    assert wide["ticktext"] == ["0.01×", "0.1×", "1×", "10×", "100×"]  # past four decades: decades only


def test_the_1x_line_is_drawn_at_1_and_named_at_log10_of_1() -> None:
    """On a log axis a shape takes the value (1) and an annotation its log10 (0): the old label at 1 sat at 10×."""
    layout = charts.speedup_spec(["a"], [3.0], [False], "GPU")["layout"]
    (line,) = layout["shapes"]
    assert (line["xref"], line["x0"], line["x1"]) == ("x", 1.0, 1.0)
    (note,) = layout["annotations"]
    assert note["text"] == "torch.compile (1×)" and note["xref"] == "x" and note["x"] == 0.0
    lo, hi = layout["xaxis"]["range"]
    assert lo < note["x"] < hi


def test_bars_are_sorted_best_first_with_exact_figures_in_the_hover() -> None:
    spec = charts.speedup_spec(["slow", "fast", "mid"], [0.8, 5.0, 1.5], [False] * 3, "GPU",
                               [("broke", "wrong", "max abs error 3")])
    bars, failures = spec["data"]
    assert bars["y"] == ["fast", "mid", "slow"] and bars["customdata"] == [5.0, 1.5, 0.8]
    assert "%{customdata:.3f}×" in bars["hovertemplate"]
    assert spec["layout"]["yaxis"]["categoryarray"] == ["fast", "mid", "slow", "broke"]  # failures below
    assert failures["x"] == [1.0] and failures["text"] == ["wrong"]
    roof = charts.roofline_spec(["a", "b"], [0.0048, 0.61], [False, False], "GPU", "memory bandwidth")
    achieved = roof["data"][1]
    assert achieved["y"] == ["b", "a"] and achieved["text"] == ["61%", "0.48%"]
    assert achieved["customdata"] == ["61", "0.48"] and "% of memory bandwidth" in achieved["hovertemplate"]
    assert achieved["marker"]["line"]["width"] == charts.ROOFLINE_OUTLINE_PX  # the sliver's minimum width


def test_long_names_are_shortened_on_the_axis_and_whole_in_the_data() -> None:
    name = "deepseek/deepseek-v4-flash-0731-preview"
    axis = charts.speedup_spec([name, "short"], [2.0, 1.5], [False, False], "GPU")["layout"]["yaxis"]
    assert axis["tickvals"] == [name, "short"]
    short = axis["ticktext"][0]
    assert len(short) == charts.LABEL_CHARS and short.startswith("deepseek/") and short.endswith("731-preview")
    assert axis["ticktext"][1] == "short"


def test_a_models_colour_depends_on_its_name_only() -> None:
    """The same colour on every chart kind and page, whatever else the chart holds."""
    color = charts.model_color("gpt-5.5")
    assert color in charts.MODEL_PALETTE
    speed = charts.speedup_spec(["house", "gpt-5.5"], [3.0, 2.0], [True, False], "GPU")["data"][0]
    roof = charts.roofline_spec(["gpt-5.5", "x"], [0.4, 0.1], [False, False], "GPU", "peak")["data"][1]
    shape = charts.shape_spec(["0: s", "1: m"], [("x", False, [1.0, 2.0]), ("gpt-5.5", False, [2.0, 3.0])], "GPU")
    eff = charts.efficiency_spec("Score vs cost — hard, GPU", "cost", [charts.SpendPoint("gpt-5.5", 1.0, "$1", 0.5,
                                                                                         True)])
    assert speed["marker"]["color"][1] == roof["marker"]["color"][0] == color
    assert shape is not None and shape["data"][1]["marker"]["color"] == color
    assert next(t for t in eff["data"] if t.get("text") == ["gpt-5.5"])["marker"]["color"] == [color]
    # house kernels are never a model colour: grey and hatched
    assert speed["marker"]["color"][0] == charts.COLORS["muted"] not in charts.MODEL_PALETTE
    assert speed["marker"]["pattern"]["shape"] == ["/", ""]


def test_the_colour_is_the_same_in_another_process() -> None:
    """SHA-256 of the name, not Python's salted hash(): another build picks the same colour."""
    code = "from kernelboard.sitegen.charts import model_color; print(model_color('gpt-5.5'), model_color('hy3'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == [charts.model_color("gpt-5.5"), charts.model_color("hy3")]


def test_per_shape_series_never_look_alike_even_when_names_share_a_colour() -> None:
    names = [f"model-{i}" for i in range(40)]
    clash = [n for n in names if charts.model_color(n) == charts.model_color(names[0])][:3]
    assert len(clash) == 3
    series = [(n, False, [1.5, 2.0]) for n in clash] + [("house", True, [2.0, 2.5]), ("reference", True, [0.5, 0.6])]
    spec = charts.shape_spec(["0: s", "1: m"], series, "GPU")
    assert spec is not None
    looks = [(t["marker"]["color"], t["marker"].get("pattern", {}).get("shape", "")) for t in spec["data"]]
    assert len(set(looks)) == len(looks), looks
    assert looks[0] == (charts.model_color(clash[0]), "")  # the first keeps the plain colour
    assert looks[3] == (charts.COLORS["muted"], "/")


def test_a_per_shape_chart_without_any_speedup_is_not_drawn() -> None:
    """Boards imported without baselines carry no per-shape speedup: an empty frame helps nobody."""
    assert charts.shape_chart("chart-x", ["0: a", "1: b"], [("m", False, [None, None])], "GPU") is None


def test_a_speedup_that_is_not_positive_is_an_error() -> None:
    with pytest.raises(ValueError, match="positive"):
        charts.speedup_spec(["a"], [0.0], [False], "GPU")


def _plotly_js_version(source: str) -> str:
    match = re.search(r"plotly\.js (?:\([^)]*\) )?v(\d+\.\d+\.\d+)", source[:400])
    assert match, source[:400]
    return match.group(1)


def test_the_vendored_plotly_bundle_is_the_basic_one_with_its_licence_and_note() -> None:
    import plotly.offline

    bundle = (STATIC / "plotly.min.js").read_text(encoding="utf-8")
    assert bundle.startswith("/**\n* plotly.js (basic - minified) v")
    vendored = _plotly_js_version(bundle)
    python_side = _plotly_js_version(plotly.offline.get_plotlyjs())
    assert vendored.split(".")[0] == python_side.split(".")[0], (vendored, python_side)  # the same schema
    assert "MIT License" in (STATIC / "plotly.LICENSE.txt").read_text()
    note = (STATIC / "plotly.README.md").read_text()
    assert f"version **{vendored}**" in note and "plotly.js-basic-dist-min" in note
    # every trace type the charts use is in the basic bundle (bar, scatter, pie)
    specs = [charts.speedup_spec(["a"], [2.0], [False], "G", [("b", "wrong", "r")]),
             charts.roofline_spec(["a"], [0.5], [False], "G", "p"),
             charts.shape_spec(["0", "1"], [("a", False, [1.0, 2.0])], "G"),
             charts.efficiency_spec("t", "x", [charts.SpendPoint("a", 1.0, "1", 0.5, True),
                                               charts.SpendPoint("b", 2.0, "2", 0.9, True),
                                               charts.SpendPoint("c", 3.0, "3", 0.1, False)])]
    assert {t["type"] for s in specs if s for t in s["data"]} <= {"bar", "scatter", "pie"}


def _loaded_assets(page: Path) -> list[Path]:
    html = page.read_text()
    refs = re.findall(r'<(?:script|link)[^>]*(?:src|href)="([^"]+\.(?:js|css|ico))"', html)
    return [page] + [(page.parent / r).resolve() for r in refs]


def test_a_problem_page_and_what_it_loads_fit_the_budget(built_site: Path) -> None:
    files = _loaded_assets(built_site / PROBLEM_PAGE / "index.html")
    assert {f.name for f in files} >= {"index.html", "plotly.min.js", "charts.js", "style.css"}
    raw = sum(f.stat().st_size for f in files)
    wire = sum(len(gzip.compress(f.read_bytes(), 6)) for f in files)
    assert raw <= RAW_BUDGET_BYTES, raw
    assert wire <= WIRE_BUDGET_BYTES, wire


# ---------------------------------------------------------------------------- in Chromium: helpers

#: The drawn geometry of one chart: plot area, ticks, annotations, bars, legend (page coordinates).
_GEOMETRY = """id => {
  const gd = document.getElementById(id);
  const box = e => { const r = e.getBoundingClientRect();
                     return {left: r.left, right: r.right, top: r.top, bottom: r.bottom, width: r.width,
                             height: r.height}; };
  const texts = sel => [...gd.querySelectorAll(sel)].map(t => ({text: t.textContent, ...box(t)}));
  return {
    svg: box(gd.querySelector('.main-svg')),
    plot: box(gd.querySelector('.nsewdrag')),
    xticks: texts('.xtick text'),
    yticks: texts('.ytick text'),
    notes: texts('.annotation-text'),
    legend: texts('.legendtext'),
    bartexts: texts('.bartext'),
    modebar: gd.querySelectorAll('.modebar').length,
  };
}"""


def _geometry(page: Page, div_id: str) -> dict[str, Any]:
    page.wait_for_selector(f"#{div_id} .main-svg")
    return page.evaluate(_GEOMETRY, div_id)


def _drawn_fill(page: Page, div_id: str, label: str) -> str:
    """The fill Chromium paints for `label`'s bar (bar chart) or point (scatter) in a chart."""
    return page.evaluate("""([id, label]) => {
      const gd = document.getElementById(id);
      const seen = {bar: 0, scatter: 0};
      for (const d of gd.data) {
        const n = seen[d.type]++;
        const names = d.type === 'bar' ? d.y : (d.text || []);
        const i = names.indexOf(label);
        if (i < 0) { continue; }
        const layer = d.type === 'bar' ? '.barlayer .trace' : '.scatterlayer .trace';
        const mark = gd.querySelectorAll(layer)[n].querySelectorAll('.point')[i];
        return getComputedStyle(mark.tagName === 'path' ? mark : mark.querySelector('path')).fill;
      }
      return null;
    }""", [div_id, label])


def _open(browser: Browser, url: str, viewport: dict[str, int], scheme: str = "dark") -> tuple[Any, Page, list]:
    context = browser.new_context(viewport=viewport, color_scheme=scheme)
    page = context.new_page()
    problems = watch(page)
    page.goto(url)
    page.wait_for_load_state("load")
    return context, page, problems


def _no_overlap(boxes: list[dict[str, Any]]) -> None:
    rows = sorted(boxes, key=lambda b: b["top"])
    for a, b in itertools.pairwise(rows):
        assert a["bottom"] <= b["top"] + 0.5, (a, b)


def _inside(inner: dict[str, Any], outer: dict[str, Any], slack: float = 0.5) -> bool:
    return (inner["left"] >= outer["left"] - slack and inner["right"] <= outer["right"] + slack
            and inner["top"] >= outer["top"] - slack and inner["bottom"] <= outer["bottom"] + slack)


# ------------------------------------------------------------------------ in Chromium: the fixture site


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("scheme", ["dark", "light"])
@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1280", "390"])
def test_the_speedup_chart_reads_at_a_glance(browser: Browser, site_url: str, viewport: dict[str, int],
                                             scheme: str) -> None:
    context, page, problems = _open(browser, site_url + PROBLEM_PAGE, viewport, scheme)
    chart = f"chart-speedup-{GPU}"
    g = _geometry(page, chart)
    ticks = [t["text"] for t in g["xticks"]]
    assert {"0.5×", "1×", "2×"} <= set(ticks) and all(t.endswith("×") for t in ticks), ticks
    # the 1× line's label: shown, starting (or ending) on the 1× tick, just above the plot area, inside the chart
    (note,) = [n for n in g["notes"] if n["text"] == "torch.compile (1×)"]
    one = next(t for t in g["xticks"] if t["text"] == "1×")
    one_x = (one["left"] + one["right"]) / 2
    assert min(abs(note["left"] - one_x), abs(note["right"] - one_x)) <= 6, (note, one_x)
    assert g["plot"]["left"] <= one_x <= g["plot"]["right"]
    assert g["plot"]["top"] - 30 <= note["top"] and note["bottom"] <= g["plot"]["top"] + 2, (note, g["plot"])
    assert _inside(note, g["svg"])
    # every row label and bar figure fits the chart; rows do not collide
    _no_overlap(g["yticks"])
    assert all(_inside(t, g["svg"]) for t in g["yticks"] + g["bartexts"]), g
    assert page.locator(f"#{chart}").evaluate("e => e.querySelectorAll('.main-svg .bars .point').length") == 3
    # the mode bar is gone on a phone, where it covered the titles
    assert g["modebar"] == (0 if viewport == PHONE else 1)
    if viewport == PHONE:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / f"chart-speedup-phone-{scheme}.png"
        page.locator(f"#gpu-{GPU} figure.chart").first.screenshot(path=str(shot))
    assert problems == []
    context.close()


@pytest.mark.browser
@needs_chromium
def test_per_shape_series_are_told_apart(browser: Browser, site_url: str) -> None:
    context, page, problems = _open(browser, site_url + PROBLEM_PAGE, PHONE)
    chart = f"chart-shapes-{GPU}"
    g = _geometry(page, chart)
    looks = page.evaluate("""id => document.getElementById(id)._fullData.map(
        t => [t.name, t.marker.color, (t.marker.pattern || {}).shape || ''])""", chart)
    assert len(looks) >= 2
    assert len({(c, p) for _, c, p in looks}) == len(looks), looks  # no two series alike
    models = [c for name, c, _ in looks if name == "Fable 5"]
    assert models and all(c != models[0] for name, c, _ in looks if name != "Fable 5"), looks  # a model's own colour
    # the legend, one entry a line on a phone, sits below the plot and inside the chart
    assert len(g["legend"]) == len(looks)
    assert all(_inside(t, g["svg"]) and t["top"] >= g["plot"]["bottom"] for t in g["legend"]), g
    _no_overlap(g["legend"])
    assert problems == []
    context.close()


@pytest.mark.browser
@needs_chromium
def test_a_model_has_the_same_colour_on_two_pages(browser: Browser, site_url: str) -> None:
    context, page, problems = _open(browser, site_url + PROBLEM_PAGE, DESKTOP)
    _geometry(page, f"chart-speedup-{GPU}")
    on_problem = _drawn_fill(page, f"chart-speedup-{GPU}", "Fable 5")
    page.goto(site_url + "efficiency/")
    chart = f"chart-eff-tokens-{GPU}-hard"
    _geometry(page, chart)
    on_efficiency = _drawn_fill(page, chart, "Fable 5")
    hex_color = charts.model_color("Fable 5").lstrip("#")
    rgb = "rgb({}, {}, {})".format(*(int(hex_color[i:i + 2], 16) for i in (0, 2, 4)))
    assert on_problem == on_efficiency == rgb
    assert problems == []
    context.close()


@pytest.mark.browser
@needs_chromium
def test_no_page_is_wider_than_a_phone(browser: Browser, site_url: str, built_site: Path) -> None:
    context = browser.new_context(viewport=PHONE)
    page = context.new_page()
    problems = watch(page)
    wide = {}
    for rel in html_pages(built_site):
        page.goto(site_url + rel)
        page.wait_for_load_state("load")
        if page.locator(".chart-mount").count():
            page.wait_for_selector(".chart-mount .main-svg")
        width = page.evaluate("document.scrollingElement.scrollWidth")
        if width > PHONE["width"]:
            wide[rel] = width
    assert wide == {}
    assert problems == []
    context.close()


@pytest.mark.browser
@needs_chromium
def test_a_problem_page_weighs_under_a_megabyte_on_the_wire(browser: Browser, site_url: str) -> None:
    """Every response the page loads, gzipped as GitHub Pages sends text (the test server sends it raw)."""
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    bodies: list[bytes] = []
    page.on("response", lambda r: bodies.append(r.body()) if r.ok else None)
    page.goto(site_url + PROBLEM_PAGE)
    page.wait_for_load_state("load")
    page.wait_for_selector(f"#chart-speedup-{GPU} .main-svg")
    assert len(bodies) >= 4  # the page, style.css, plotly.min.js, charts.js (and the icon)
    raw = sum(len(b) for b in bodies)
    wire = sum(len(gzip.compress(b, 6)) for b in bodies)
    assert raw <= RAW_BUDGET_BYTES, raw
    assert wire <= WIRE_BUDGET_BYTES, wire
    context.close()


# --------------------------------------------------------------- in Chromium: 30 models, long names

#: Thirty model names of the lengths real boards carry, a speedup each (one slower than torch.compile).
CROWD = [f"{vendor}/{name}-{i}" for i, (vendor, name) in enumerate(
    [("anthropic", "claude-opus"), ("deepseek", "deepseek-v4-flash-0731-preview"), ("qwen", "qwen3.8-max"),
     ("x", "grok"), ("tencent", "hy3-preview"), ("moonshot", "kimi-k2.7-code")] * 5)]
CROWD_SPEEDUPS = [round(0.45 + 0.37 * i, 2) for i in range(30)]
TINY = "tiny/roofline-0.5-percent"


def _crowd_page(folder: Path) -> None:
    """One page with the three bar charts at 30 models, written like the site writes them."""
    for name in ("plotly.min.js", "charts.js", "style.css", "favicon.ico"):
        shutil.copy(STATIC / name, folder / name)
    house = [i == 3 for i in range(30)]
    blocks = [
        charts.speedup_chart("crowd-speedup", CROWD, CROWD_SPEEDUPS, house, "NVIDIA H200 SXM",
                             [("broken/model-with-a-long-name", "integrity violation", "it cheated"),
                              ("other/forbidden-model", "forbidden", "used torch")]),
        charts.roofline_chart("crowd-roofline", [*CROWD[:29], TINY], [0.01 * (i + 1) for i in range(29)] + [0.005],
                              house, "NVIDIA H200 SXM", "memory bandwidth (4,800 GB/s)"),
        charts.shape_chart("crowd-shapes", [f"{i}: M=4096, N={1024 * i}, K=7168 fp8" for i in range(5)],
                           [(n, h, [s * (1 + 0.1 * k) for k in range(5)])
                            for n, h, s in zip(CROWD[:10], house[:10], CROWD_SPEEDUPS[:10], strict=True)],
                           "NVIDIA H200 SXM"),
    ]
    figures = "\n".join(f'<figure class="chart">{b}</figure>' for b in blocks)
    (folder / "index.html").write_text(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><title>crowd</title>'
        '<link rel="icon" href="favicon.ico"><link rel="stylesheet" href="style.css">'
        '<script src="plotly.min.js"></script>'
        f'<script src="charts.js" defer></script></head><body><main>{figures}</main></body></html>\n')


@pytest.fixture(scope="module")
def crowd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("crowd")
    _crowd_page(folder)
    with serve(folder) as url:
        yield url


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["1280", "390"])
def test_thirty_models_read_on_desktop_and_phone(browser: Browser, crowd_url: str, viewport: dict[str, int]) -> None:
    context, page, problems = _open(browser, crowd_url, viewport)
    assert page.evaluate("document.scrollingElement.scrollWidth") <= viewport["width"]
    for chart, rows in (("crowd-speedup", 32), ("crowd-roofline", 30), ("crowd-shapes", 5)):
        g = _geometry(page, chart)
        assert len(g["yticks"]) == rows, chart
        _no_overlap(g["yticks"])
        assert all(_inside(t, g["svg"]) for t in g["yticks"] + g["bartexts"] + g["notes"]), chart
        limit = charts.PHONE_LABEL_CHARS if viewport == PHONE else charts.LABEL_CHARS
        assert all(len(t["text"]) <= limit for t in g["yticks"]), chart
        assert g["plot"]["width"] >= 0.4 * g["svg"]["width"], (chart, g["plot"], g["svg"])  # labels leave room
        assert g["modebar"] == (0 if viewport == PHONE else 1)
    # the failures' status is printed whole beside the 1× line
    texts = page.evaluate("[...document.querySelectorAll('#crowd-speedup .scatterlayer .textpoint')]"
                          ".map(t => t.textContent)")
    assert texts == ["integrity violation", "forbidden"]
    # the full name is in the data (and so in the hover) while the axis shows it shortened
    full = page.evaluate("document.getElementById('crowd-speedup').data[0].y")
    assert CROWD[1] in full and all(len(n) > charts.LABEL_CHARS for n in CROWD[1::6])
    # a 0.5% roofline bar is still a visible mark: its geometry plus its outline, in its own colour
    bar = page.evaluate("""label => {
      const gd = document.getElementById('crowd-roofline');
      const i = gd.data[1].y.indexOf(label);
      const path = gd.querySelectorAll('.barlayer .trace')[1].querySelectorAll('.point path')[i];
      const s = getComputedStyle(path);
      return {width: path.getBoundingClientRect().width, stroke: parseFloat(s.strokeWidth),
              strokeColor: s.stroke, fill: s.fill};
    }""", TINY)
    assert bar["width"] + bar["stroke"] >= 3, bar
    assert bar["strokeColor"] == bar["fill"], bar
    if viewport == PHONE:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "charts-30-models-phone.png"), full_page=True)
    assert problems == []
    context.close()


def test_the_crowd_page_uses_the_site_charts_json(tmp_path: Path) -> None:
    """The crowd page's blocks are the site's own (JSON data blocks drawn by static/charts.js)."""
    _crowd_page(tmp_path)
    html = (tmp_path / "index.html").read_text()
    blocks = re.findall(r'<script type="application/json" class="chart-data" data-for="([^"]+)">(.*?)</script>',
                        html, re.S)
    assert [b[0] for b in blocks] == ["crowd-speedup", "crowd-roofline", "crowd-shapes"]
    shapes = json.loads(blocks[2][1])
    assert shapes["phone"]["height"] > shapes["figure"]["layout"]["height"]  # a legend entry a line on a phone

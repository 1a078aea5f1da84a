"""Plotly figure builders for the problem and efficiency pages: speedup and roofline bars, per-shape
speedups, score against spend.

Each `*_spec` function returns a figure as a plain dict, the JSON that plotly.js draws; each
`*_chart` function wraps it into an HTML fragment: a `<div>` with a fixed id followed by the figure
as a JSON data block (`<script type="application/json">`, never executed); `static/charts.js` draws
every such block with plotly.js, loaded once per page from `static/plotly.min.js`. No inline
script, so the pages' Content-Security-Policy allows scripts from the site only. Fixed ids and
a fixed layout keep builds byte-identical. The same numbers are always printed in a table beside
the chart, so a page without JavaScript loses nothing.

Every chart stays readable with dozens of models on a 390 px phone: ranked bars run sideways, one
row per submission with the best on top, names on the left (shortened past `LABEL_CHARS`, the full
name in the hover), and the chart grows with its rows; speedup axes are logarithmic with ticks at
1-2-5 steps labelled 0.5×, 1×, 2×; the 1× line (torch.compile) is drawn and named; a model has one
colour on every page (`model_color`, a colour-blind-safe palette), house kernels are grey and hatched.

Specs are plain dicts rather than `plotly.graph_objects.Figure`s: validating a figure property by
property costs milliseconds per trace, seconds per build at ten thousand runs. The dicts are exactly
what `Figure(spec).to_plotly_json()` gives back (the "none" template included), which
tests/test_site_charts.py checks for every kind, so the schema stays Plotly's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from markupsafe import Markup

#: Plotly's config for every chart: no logo, resize with the page. static/charts.js hides the mode bar
#: on a phone, where it would cover the titles.
PLOT_CONFIG = {"displaylogo": False, "responsive": True}

#: Colours shared with static/style.css (THEME_VARS): text, secondary marks (the 1× and peak lines,
#: failures, headroom, house kernels) and grid lines.
COLORS = {"fg": "#e6e6e6", "muted": "#9a9a9a", "grid": "#2a2a2a"}

#: CSS custom property of static/style.css that replaces each COLORS value when static/charts.js draws,
#: so a chart follows the page's light or dark theme.
THEME_VARS = {COLORS["fg"]: "--fg", COLORS["muted"]: "--muted", COLORS["grid"]: "--line"}

#: The colours of AI models: the palette of Okabe & Ito ("Color Universal Design", 2008), whose hues stay
#: apart under the common colour-vision deficiencies (protanopia, deuteranopia, tritanopia), without its
#: yellow (too faint on the light theme's white) and with its black drawn in the theme's text colour
#: (COLORS["fg"]: near-black on the light theme, near-white on the dark one). House kernels are never in
#: it: they are grey and hatched.
MODEL_PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", COLORS["fg"])

#: Fill patterns that tell apart two series of one chart drawn in the same colour (the per-shape chart
#: names its series by colour only): a model takes the first one its colour has free, a house kernel
#: starts at the hatch.
_HATCHES = ("", "/", "x", ".", "\\", "+", "-", "|")

#: A bar chart's rows and margins: the chart grows with its rows, so 30 models read as well as 3.
_ROW_PX = 26
_TOP_PX = 80  # title, subtitle and the label of the 1× or peak line
_BOTTOM_PX = 40  # the value axis' tick labels (the subtitle names the axis: "log scale", "% of …")
#: Axis labels longer than this are shortened in the middle ("anthropic/…-fable-5"); the hover has the full
#: name. A phone (static/charts.js) shortens them further, to PHONE_LABEL_CHARS, to leave the bars room.
LABEL_CHARS = 24
PHONE_LABEL_CHARS = 16


def model_color(label: str) -> str:
    """The colour of the model shown as `label`, the same on every chart, page and build:
    `MODEL_PALETTE[n % 7]`, n the first eight bytes of the label's SHA-256 (not Python's `hash()`,
    which is salted per process). It depends on the name alone, never on which other models a chart
    holds, so two models may share a colour (seven colours, dozens of models): the bar charts name
    every bar on their axis, and the per-shape chart hatches the second of two (`_HATCHES`).

    >>> model_color("gpt-5.5") == model_color("gpt-5.5")
    True
    """
    n = int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big")
    return MODEL_PALETTE[n % len(MODEL_PALETTE)]


def _short(label: str, limit: int = LABEL_CHARS) -> str:
    """`label` as an axis shows it: at most `limit` characters, cut in the middle so the end that tells
    versions apart stays."""
    if len(label) <= limit:
        return label
    tail = limit // 2 - 1
    return f"{label[:limit - tail - 1]}…{label[-tail:]}"


def _times(value: float) -> str:
    """A tick of a speedup axis: 0.5×, 1×, 20×."""
    return f"{value:g}×"


def _log_range(values: Sequence[float], right: float = 2.0) -> tuple[float, float]:
    """The range of a speedup axis in decades (log10), as plotly.js wants it for a log axis: every value
    with a little room, and at least 0.5× to `right`× so the 1× line never sits on an edge."""
    bad = [v for v in values if not (v > 0 and math.isfinite(v))]
    if bad:
        raise ValueError(f"a speedup on a log axis must be a positive number, got {bad[0]!r}")
    return (min(math.log10(min(values)) - 0.1, math.log10(0.5)),
            max(math.log10(max(values)) + 0.1, math.log10(right)))


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values over 10**lo … 10**hi at 1-2-5 steps (decades only past four decades; 1-1.5-2-3-5-7
    when 1-2-5 gives fewer than three) — not plotly's default minor digits (9, 8, 7 …)."""
    def within(steps: tuple[float, ...]) -> list[float]:
        ticks = [round(m * 10.0 ** k, 12) for k in range(math.floor(lo), math.ceil(hi) + 1) for m in steps]
        return [t for t in ticks if lo <= math.log10(t) <= hi]

    ticks = within((1, 2, 5) if hi - lo <= 4 else (1,))
    return ticks if len(ticks) >= 3 else within((1, 1.5, 2, 3, 5, 7))


def _log_axis(lo: float, hi: float) -> dict[str, Any]:
    """A log speedup axis over 10**lo … 10**hi, ticks at 1-2-5 steps labelled 0.5×, 1×, 2×, 5×, 10×."""
    ticks = _log_ticks(lo, hi)
    return {"type": "log", "range": [lo, hi], "tickmode": "array", "tickvals": ticks,
            "ticktext": [_times(t) for t in ticks]}


def _rows_axis(rows: Sequence[str]) -> dict[str, Any]:
    """The category axis of a sideways bar chart: one row per label, the first on top, each shown
    shortened (`_short`) while the hover and the data keep the full label."""
    return {"type": "category", "categoryorder": "array", "categoryarray": list(rows), "autorange": "reversed",
            "tickmode": "array", "tickvals": list(rows), "ticktext": [_short(r) for r in rows],
            "automargin": True, "showgrid": False, "ticks": "", "ticklabelstandoff": 6}


def _layout(title: str, subtitle: str, height_px: int, xaxis: dict[str, Any], yaxis: dict[str, Any]) -> dict:
    """A chart's frame: title and subtitle on two short lines (they fit a phone), transparent
    backgrounds and theme colours, margins that grow with the axis labels."""
    return {
        "title": {"text": title, "x": 0, "xref": "container", "xanchor": "left", "y": 1, "yref": "container",
                  "yanchor": "top", "pad": {"l": 10, "t": 12}, "font": {"size": 14},
                  "subtitle": {"text": subtitle, "font": {"color": COLORS["muted"], "size": 12}}},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": COLORS["fg"], "family": "system-ui, sans-serif", "size": 12},
        "height": height_px,
        "margin": {"l": 10, "r": 56, "t": _TOP_PX, "b": _BOTTOM_PX},
        "showlegend": False,
        "xaxis": {"automargin": True, "gridcolor": COLORS["grid"], "zeroline": False, **xaxis},
        "yaxis": yaxis,
        "bargap": 0.3,
        "hovermode": "closest",
    }


def _height(rows: int, extra_px: int = 0) -> int:
    return _TOP_PX + _BOTTOM_PX + max(rows, 2) * _ROW_PX + extra_px


@lru_cache(maxsize=1)
def _template() -> dict[str, Any]:
    """Plotly's "none" template as a figure's JSON carries it (plotly.py puts a template in every
    figure's layout; plotly.js itself knows none). The default "plotly" template is ~7 KB of styling
    that `_layout` overrides anyway, repeated in every chart (three or more per problem page), so
    the charts name "none" and style themselves. Read once per process from the installed plotly."""
    import plotly.graph_objects as go
    import plotly.io as pio

    return json.loads(pio.to_json(go.Figure(layout={"template": "none"}), validate=False))["layout"]["template"]


def _figure(data: list[dict[str, Any]], layout: dict[str, Any]) -> dict[str, Any]:
    return {"data": data, "layout": {**layout, "template": _template()}}


def _vline(x: float, dash: str, text: str, anchor: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A vertical line across the plot at data value `x`, and its label just above the plot.

    Shapes take data values on a log axis, annotations take log10 of them (plotly.js's rule), so the
    label sits at `log10(x)` there; `anchor` says on which side of the line the label runs."""
    shape = {"type": "line", "xref": "x", "x0": x, "x1": x, "yref": "y domain", "y0": 0, "y1": 1,
             "line": {"color": COLORS["muted"], "dash": dash, "width": 1.5}}
    note = {"font": {"color": COLORS["muted"]}, "showarrow": False, "text": text, "x": x, "xref": "x",
            "xanchor": anchor, "y": 1, "yref": "y domain", "yanchor": "bottom"}
    return shape, note


def _one_x_line(lo: float, hi: float, over: str = "torch.compile") -> tuple[dict[str, Any], dict[str, Any]]:
    """The 1× line (`over`: torch.compile, or a deck's own baseline) of a log speedup axis over lo … hi
    decades, named: its label runs to the side with more room."""
    shape, note = _vline(1.0, "dash", f"{over} (1×)", "left" if hi >= -lo else "right")
    return shape, {**note, "x": 0.0}  # log10(1): annotations on a log axis are placed in decades


def _html(spec: dict[str, Any], div_id: str, phone: dict[str, Any] | None = None) -> Markup:
    """The chart's `<div>` and its figure as a JSON data block (never executed), which
    static/charts.js draws: the pages carry no inline script, so the CSP can say script-src 'self'.
    `phone`: layout keys that replace the figure's on a phone (static/charts.js, PHONE_QUERY)."""
    block = {"figure": spec, "config": PLOT_CONFIG, "theme": THEME_VARS, **({"phone": phone} if phone else {})}
    payload = json.dumps(block, sort_keys=True, separators=(", ", ": "))
    # "<" never appears raw inside the data block, so no "</script>" or "<!--" can end it early.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    height = spec["layout"]["height"]
    return Markup(
        f'<div id="{div_id}" class="plotly-graph-div chart-mount" style="height:{height}px; width:100%;">'
        f'</div>\n<script type="application/json" class="chart-data" data-for="{div_id}">{payload}</script>'
    )


def _phone_layout(spec: dict[str, Any], legend: bool = False) -> dict[str, Any]:
    """The layout keys a phone draws instead (static/charts.js): row labels cut to PHONE_LABEL_CHARS and,
    for a chart with a legend, room for one legend entry a line."""
    layout = spec["layout"]
    rows = layout["yaxis"]
    phone: dict[str, Any] = {"yaxis": {**rows, "ticktext": [_short(r, PHONE_LABEL_CHARS) for r in rows["tickvals"]]}}
    if legend:
        phone.update(_legend_room(layout, len(spec["data"]), _LEGEND_PER_LINE["phone"]))
    return phone


def _bar_marker(labels: Sequence[str], is_house: Sequence[bool], **extra: Any) -> dict[str, Any]:
    """Per-bar colours of a ranked chart: each model its own colour (`model_color`), house kernels grey
    and hatched."""
    marker: dict[str, Any] = {"color": [COLORS["muted"] if h else model_color(x) for x, h in zip(labels, is_house,
                                                                                                 strict=True)],
                              **extra}
    if any(is_house):
        marker["pattern"] = {"shape": ["/" if h else "" for h in is_house], "fillmode": "overlay", "size": 6}
    return marker


def _series_markers(series: Sequence[tuple[str, bool]]) -> list[dict[str, Any]]:
    """One marker per series of a grouped chart, no two alike: the model's colour (house kernels grey),
    hatched with the first pattern that colour has free in this chart (`_HATCHES`)."""
    taken: set[tuple[str, str]] = set()
    markers = []
    for name, house in series:
        color = COLORS["muted"] if house else model_color(name)
        order = ("/", *(h for h in _HATCHES if h != "/")) if house else _HATCHES
        hatch = next((h for h in order if (color, h) not in taken), order[-1])
        taken.add((color, hatch))
        marker: dict[str, Any] = {"color": color}
        if hatch:
            marker["pattern"] = {"shape": hatch, "fillmode": "overlay", "size": 6}
        markers.append(marker)
    return markers


def speedup_spec(labels: Sequence[str], speedups: Sequence[float], is_house: Sequence[bool], gpu_label: str,
                 failures: Sequence[tuple[str, str, str]] = (), over: str = "torch.compile") -> dict[str, Any]:
    """Bars of geomean speedup over `over` (torch.compile, or a deck's own baseline such as Mega's
    baseline.py) per submission on a log axis, fastest on top, from a
    named line at 1×; each failed or DNF submission `(label, kind, reason)` is a row below them with a
    mark on the 1× line and its status, never a bar. The hover gives the speedup to three decimals."""
    bars = sorted(zip(labels, speedups, is_house, strict=True), key=lambda b: (-b[1], b[0]))
    names = [b[0] for b in bars]
    values = [b[1] for b in bars]
    # Bars grow from 1× (torch.compile) right to a faster or left to a slower kernel.
    data = [{"type": "bar", "orientation": "h", "y": names, "x": [v - 1.0 for v in values], "base": 1.0,
             "marker": _bar_marker(names, [b[2] for b in bars]), "text": [f"{v:.2f}×" for v in values],
             "textposition": "outside", "cliponaxis": False, "customdata": values,
             "hovertemplate": f"%{{y}}<br>%{{customdata:.3f}}× {_escape_template(over)}<extra></extra>"}]
    if failures:
        data.append({"type": "scatter", "y": [f[0] for f in failures], "x": [1.0] * len(failures),
                     "mode": "markers+text", "marker": {"symbol": "x-thin-open", "size": 11, "color": COLORS["muted"],
                                                        "line": {"width": 2, "color": COLORS["muted"]}},
                     "text": [f[1] for f in failures], "textposition": "middle right", "cliponaxis": False,
                     "textfont": {"color": COLORS["muted"]}, "customdata": [f[2] for f in failures],
                     "hovertemplate": "%{y}: %{text}<br>%{customdata}<extra></extra>", "showlegend": False})
    rows = list(dict.fromkeys([*names, *(f[0] for f in failures)]))
    lo, hi = _log_range(values, right=4.0 if failures else 2.0)  # room for the failures' status beside 1×
    shape, note = _one_x_line(lo, hi, over)
    layout = _layout(f"Speedup over {over}", f"{gpu_label} · log scale", _height(len(rows)),
                     _log_axis(lo, hi), _rows_axis(rows))
    return _figure(data, {**layout, "shapes": [shape], "annotations": [note]})


def speedup_chart(div_id: str, *args: Any, **kwargs: Any) -> Markup:
    """`speedup_spec` as a chart block with id `div_id`, with its phone layout."""
    spec = speedup_spec(*args, **kwargs)
    return _html(spec, div_id, _phone_layout(spec))


def _pct(value: float) -> str:
    """A bar's label on the roofline chart: 45%, 4.5%, 0.48%."""
    return f"{value:.0f}%" if value >= 10 else f"{value:.1f}%" if value >= 1 else f"{value:.2f}%"


#: The outline of every roofline bar, in its own colour: a bar of 0.5% of the peak is a sliver under
#: 2 px on a phone, the outline keeps it several pixels wide (the label beside it gives the figure).
ROOFLINE_OUTLINE_PX = 3


def roofline_spec(labels: Sequence[str], peak_fractions: Sequence[float], is_house: Sequence[bool],
                  gpu_label: str, peak_text: str) -> dict[str, Any]:
    """Bars of the geomean fraction of the GPU's datasheet peak per submission, in %, highest on top, each
    labelled with its figure (and outlined so the smallest still shows), the headroom up to 100% drawn
    faintly after it; the hover gives the fraction to three significant digits."""
    bars = sorted(zip(labels, (100.0 * f for f in peak_fractions), is_house, strict=True),
                  key=lambda b: (-b[1], b[0]))
    names = [b[0] for b in bars]
    pct = [b[1] for b in bars]
    marker = _bar_marker(names, [b[2] for b in bars])
    marker["line"] = {"width": ROOFLINE_OUTLINE_PX, "color": marker["color"]}
    data = [
        # The headroom up to the ceiling, drawn first and faintly: the achieved bar and its label sit on it.
        {"type": "bar", "orientation": "h", "y": names, "x": [max(100.0 - v, 0.0) for v in pct], "base": pct,
         "name": "headroom", "marker": {"color": COLORS["muted"]}, "opacity": 0.18,
         "hovertemplate": "%{y}<br>headroom %{x:.1f} points<extra></extra>"},
        {"type": "bar", "orientation": "h", "y": names, "x": pct, "marker": marker, "name": "achieved",
         "text": [_pct(v) for v in pct], "textposition": "outside", "cliponaxis": False,
         "customdata": [f"{v:.3g}" for v in pct],
         "hovertemplate": f"%{{y}}<br>%{{customdata}}% of {_escape_template(peak_text)}<extra></extra>"},
    ]
    shape, note = _vline(100.0, "dot", "datasheet peak", "right")
    layout = _layout("Roofline: % of datasheet peak", f"{peak_text} · {gpu_label}", _height(len(names)),
                     {"range": [0, 108], "tickmode": "array", "tickvals": [0, 25, 50, 75, 100],
                      "ticktext": ["0%", "25%", "50%", "75%", "100%"]}, _rows_axis(names))
    return _figure(data, {**layout, "barmode": "overlay", "shapes": [shape], "annotations": [note]})


def _escape_template(text: str) -> str:
    """`text` inside a plotly hovertemplate, where "%{" starts a field."""
    return text.replace("%{", "%\u200b{")


def roofline_chart(div_id: str, *args: Any, **kwargs: Any) -> Markup:
    """`roofline_spec` as a chart block with id `div_id`, with its phone layout."""
    spec = roofline_spec(*args, **kwargs)
    return _html(spec, div_id, _phone_layout(spec))


#: The per-shape chart: one bar per series in each shape's group; a legend line under the chart, with
#: room for three entries a line on a desktop and one on a phone (static/charts.js picks the phone layout).
_SHAPE_BAR_PX = 10
_LEGEND_LINE_PX = 22
_LEGEND_PER_LINE = {"desktop": 3, "phone": 1}


def _legend_room(layout: dict[str, Any], entries: int, per_line: int) -> dict[str, Any]:
    """The height and margins that fit a legend of `entries` under the chart, `per_line` a line."""
    legend_px = math.ceil(entries / per_line) * _LEGEND_LINE_PX + 8
    plot_px = layout["height"] - layout["margin"]["t"] - layout["margin"]["b"]
    return {"height": _TOP_PX + plot_px + _BOTTOM_PX + legend_px,
            "margin": {**layout["margin"], "b": _BOTTOM_PX + legend_px}}


def shape_spec(shape_labels: Sequence[str], series: Sequence[tuple[str, bool, Sequence[float | None]]],
               gpu_label: str, over: str = "torch.compile") -> dict[str, Any] | None:
    """Speedup over `over` (as in `speedup_spec`) per shape (a row each) and submission (one bar per row, a colour and
    legend entry each), log axis: shows where a kernel wins and where it loses, which a geomean hides.
    A missing shape draws no bar; no speedup for any shape (boards imported without baselines) draws
    no chart: None."""
    values = [v for _, _, ys in series for v in ys if v is not None]
    if not values:
        return None
    data = []
    for (name, _, ys), marker in zip(series, _series_markers([(n, h) for n, h, _ in series]), strict=True):
        # The legend shows the name shortened like an axis label; the hover has it whole.
        data.append({"type": "bar", "orientation": "h", "y": list(shape_labels),
                     "x": [(v - 1.0) if v is not None else None for v in ys], "base": 1.0, "name": _short(name),
                     "marker": marker, "customdata": list(ys),
                     "hovertemplate": f"{_escape_template(name)}<br>%{{y}}: %{{customdata:.3f}}× "
                                      f"{_escape_template(over)}<extra></extra>"})
    lo, hi = _log_range(values)
    shape, note = _one_x_line(lo, hi, over)
    rows_px = len(shape_labels) * (len(series) * _SHAPE_BAR_PX + 16)
    layout = _layout("Speedup per shape", f"{gpu_label} · log scale", _TOP_PX + _BOTTOM_PX + rows_px,
                     _log_axis(lo, hi), _rows_axis(shape_labels))
    layout.update(_legend_room(layout, len(series), _LEGEND_PER_LINE["desktop"]))
    return _figure(data, {**layout, "barmode": "group", "bargap": 0.25, "bargroupgap": 0.05, "showlegend": True,
                          "legend": {"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yanchor": "bottom",
                                     "yref": "container", "traceorder": "normal"},
                          "shapes": [shape], "annotations": [note]})


def shape_chart(div_id: str, *args: Any, **kwargs: Any) -> Markup | None:
    """`shape_spec` as a chart block with id `div_id` (with a taller phone layout, one legend entry a
    line), or None when it has nothing to draw."""
    spec = shape_spec(*args, **kwargs)
    if spec is None:
        return None
    return _html(spec, div_id, _phone_layout(spec, legend=True))


@dataclass(frozen=True)
class SpendPoint:
    """One model on an efficiency chart: its deck score against what it spent."""

    label: str
    spend: float
    spend_text: str
    score: float
    on_frontier: bool


def efficiency_spec(title: str, axis_title: str, points: Sequence[SpendPoint]) -> dict[str, Any]:
    """Deck score against spend on a log x axis: every point labelled and drawn in its model's colour
    (`model_color`), filled on the Pareto frontier and open when dominated, the frontier a stepped line.
    The legend explains the two marks in grey (one trace each, with no point), since the points'
    colours name models, not the frontier. A `title` "what — where" is drawn on two lines, the part
    after the dash as the subtitle, so it fits a phone."""
    frontier = [p for p in points if p.on_frontier]
    others = [p for p in points if not p.on_frontier]

    def trace(ps: Sequence[SpendPoint], symbol: str, name: str) -> dict[str, Any]:
        colors = [model_color(p.label) for p in ps]
        return {
            "type": "scatter", "x": [p.spend for p in ps], "y": [p.score for p in ps], "mode": "markers+text",
            "name": name, "text": [p.label for p in ps], "textposition": "top center", "cliponaxis": False,
            "marker": {"color": colors, "size": 11, "symbol": symbol, "line": {"width": 2, "color": colors}},
            "customdata": [[p.spend_text, f"{p.score:.3f}", name] for p in ps], "showlegend": False,
            "hovertemplate": "%{text}<br>%{customdata[0]}<br>score %{customdata[1]}<br>%{customdata[2]}"
                             "<extra></extra>",
        }

    def key(symbol: str, name: str) -> dict[str, Any]:
        return {"type": "scatter", "x": [None], "y": [None], "mode": "markers", "name": name, "hoverinfo": "skip",
                "marker": {"color": COLORS["muted"], "size": 11, "symbol": symbol,
                           "line": {"width": 2, "color": COLORS["muted"]}}}

    data = []
    if len(frontier) > 1:
        data.append({
            "type": "scatter", "x": [p.spend for p in frontier], "y": [p.score for p in frontier], "mode": "lines",
            "line": {"color": COLORS["muted"], "width": 2, "dash": "dot", "shape": "hv"}, "hoverinfo": "skip",
            "name": "Pareto frontier",
        })
    data += [trace(frontier, "circle", "on the Pareto frontier"), key("circle", "on the Pareto frontier")]
    if others:
        data += [trace(others, "circle-open", "dominated"), key("circle-open", "dominated")]
    spends = [p.spend for p in points]
    low, high = math.log10(min(spends)), math.log10(max(spends))
    pad = max(0.25, 0.1 * (high - low))
    what, _, where = title.partition(" — ")
    return _figure(data, {
        "title": {"text": what, "x": 0, "xref": "container", "xanchor": "left", "y": 1, "yref": "container",
                  "yanchor": "top", "pad": {"l": 10, "t": 12}, "font": {"size": 14},
                  "subtitle": {"text": where, "font": {"color": COLORS["muted"], "size": 12}}},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": COLORS["fg"], "family": "system-ui, sans-serif", "size": 12},
        "height": 400,
        "margin": {"l": 64, "r": 24, "t": 72, "b": 96},
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "y": 0, "yref": "container", "yanchor": "bottom",
                   "font": {"color": COLORS["muted"]}},
        "xaxis": {"type": "log", "title": {"text": axis_title}, "gridcolor": COLORS["grid"],
                  "range": [low - pad, high + pad], "tickmode": "array", "tickangle": 0,
                  "tickvals": _log_ticks(low - pad, high + pad)},
        "yaxis": {"title": {"text": "deck score"}, "gridcolor": COLORS["grid"], "zeroline": False,
                  "range": [-0.08, 1.15]},
    })


def efficiency_chart(div_id: str, title: str, axis_title: str, points: Sequence[SpendPoint]) -> Markup:
    """`efficiency_spec` as a chart block with id `div_id`."""
    return _html(efficiency_spec(title, axis_title, points), div_id)

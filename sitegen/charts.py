"""Plotly figure builders for the problem and efficiency pages: speedup and roofline bars, per-shape
speedups, score against spend.

Each `*_spec` function returns a figure as a plain dict, the JSON that plotly.js draws; each
`*_chart` function wraps it into an HTML fragment: a `<div>` with a fixed id followed by the figure
as a JSON data block (`<script type="application/json">`, never executed); `static/charts.js` draws
every such block with plotly.js, loaded once per page from `static/plotly.min.js`. No inline
script, so the pages' Content-Security-Policy allows scripts from the site only. Fixed ids and
a fixed layout keep builds byte-identical. The same numbers are always printed in a table beside
the chart, so a page without JavaScript loses nothing.

Specs are plain dicts rather than `plotly.graph_objects.Figure`s: validating a figure property by
property costs milliseconds per trace, seconds per build at ten thousand runs. The dicts are exactly
what `Figure(spec).to_plotly_json()` gives back (the "none" template included), which
tests/test_site_charts.py checks for every kind, so the schema stays Plotly's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from markupsafe import Markup

#: Plotly's config for every chart: no logo, resize with the page.
PLOT_CONFIG = {"displaylogo": False, "responsive": True}

#: Colours shared with static/style.css: AI models in the accent colour, house kernels in blue.
COLORS = {"model": "#76b900", "house": "#8ab4f8", "fg": "#e6e6e6", "muted": "#9a9a9a", "grid": "#2a2a2a"}

_HEIGHT_PX = 380


def _layout(title: str, y_title: str, **yaxis: object) -> dict:
    return {
        "title": {"text": title, "x": 0, "xanchor": "left", "font": {"size": 14}},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": COLORS["fg"], "family": "system-ui, sans-serif", "size": 12},
        "margin": {"l": 64, "r": 16, "t": 48, "b": 96},
        "showlegend": False,
        "xaxis": {"automargin": True, "tickangle": -20, "gridcolor": COLORS["grid"]},
        "yaxis": {"title": {"text": y_title}, "gridcolor": COLORS["grid"], "zeroline": False, **yaxis},
        "bargap": 0.35,
    }


#: CSS custom property of static/style.css that replaces each COLORS value when static/charts.js draws,
#: so a chart follows the page's light or dark theme.
THEME_VARS = {COLORS["model"]: "--accent", COLORS["house"]: "--house", COLORS["fg"]: "--fg",
              COLORS["muted"]: "--muted", COLORS["grid"]: "--line"}


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


def _hline(y: float, dash: str, text: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A horizontal line across the plot at `y` (and its label at the top left), as
    `Figure.add_hline(y, line_dash=…, line_color=muted, annotation_text=…)` writes it."""
    shape = {"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y", "y0": y, "y1": y,
             "line": {"color": COLORS["muted"], "dash": dash}}
    notes = [] if text is None else [{"font": {"color": COLORS["muted"]}, "showarrow": False, "text": text,
                                      "x": 0, "xanchor": "left", "xref": "x domain", "y": y,
                                      "yanchor": "bottom", "yref": "y"}]
    return shape, notes


def _html(spec: dict[str, Any], div_id: str) -> Markup:
    """The chart's `<div>` and its figure as a JSON data block (never executed), which
    static/charts.js draws: the pages carry no inline script, so the CSP can say script-src 'self'."""
    payload = json.dumps({"figure": spec, "config": PLOT_CONFIG, "theme": THEME_VARS},
                         sort_keys=True, separators=(", ", ": "))
    # "<" never appears raw inside the data block, so no "</script>" or "<!--" can end it early.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(
        f'<div id="{div_id}" class="plotly-graph-div chart-mount" style="height:{_HEIGHT_PX}px; width:100%;">'
        f'</div>\n<script type="application/json" class="chart-data" data-for="{div_id}">{payload}</script>'
    )


def _colors(is_house: Sequence[bool]) -> list[str]:
    return [COLORS["house"] if h else COLORS["model"] for h in is_house]


def speedup_spec(labels: Sequence[str], speedups: Sequence[float], is_house: Sequence[bool], gpu_label: str,
                 failures: Sequence[tuple[str, str, str]] = ()) -> dict[str, Any]:
    """Bars of geomean speedup over torch.compile per submission on a log axis, a line at 1×; each
    failed or DNF submission `(label, kind, reason)` is a marked point on the 1× line, never a bar."""
    # Bars grow from 1× (torch.compile) up to a faster or down to a slower kernel.
    data = [{"type": "bar", "x": list(labels), "y": [v - 1.0 for v in speedups], "base": 1.0,
             "marker": {"color": _colors(is_house)}, "text": [f"{v:.2f}×" for v in speedups],
             "textposition": "outside", "cliponaxis": False, "customdata": list(speedups),
             "hovertemplate": "%{x}<br>%{customdata:.3f}× torch.compile<extra></extra>"}]
    if failures:
        data.append({"type": "scatter", "x": [f[0] for f in failures], "y": [1.0] * len(failures),
                     "mode": "markers+text", "marker": {"symbol": "x-thin-open", "size": 12, "color": COLORS["muted"]},
                     "text": [f[1] for f in failures], "textposition": "top center",
                     "customdata": [f[2] for f in failures],
                     "hovertemplate": "%{x}: %{text}<br>%{customdata}<extra></extra>", "showlegend": False})
    low, high = min(min(speedups), 1.0), max(max(speedups), 1.0)
    layout = _layout(f"Speedup over torch.compile — {gpu_label}", "speedup (×, log scale)",
                     type="log", range=[math.log10(low) - 0.25, math.log10(high) + 0.25])
    shape, notes = _hline(1, "dash", "torch.compile (1×)")
    return _figure(data, {**layout, "shapes": [shape], "annotations": notes})


def speedup_chart(div_id: str, *args: Any, **kwargs: Any) -> Markup:
    """`speedup_spec` as a chart block with id `div_id`."""
    return _html(speedup_spec(*args, **kwargs), div_id)


def roofline_spec(labels: Sequence[str], peak_fractions: Sequence[float], is_house: Sequence[bool],
                  gpu_label: str, peak_text: str) -> dict[str, Any]:
    """Bars of the geomean fraction of the GPU's datasheet peak per submission, in %."""
    pct = [100.0 * f for f in peak_fractions]
    data = [
        {"type": "bar", "x": list(labels), "y": pct, "marker": {"color": _colors(is_house)}, "name": "achieved",
         "text": [f"{v:.1f}%" for v in pct], "textposition": "outside", "cliponaxis": False,
         "hovertemplate": "%{x}<br>%{y:.2f}% of peak<extra></extra>"},
        # The headroom up to the ceiling, drawn as a faint bar above each achieved one.
        {"type": "bar", "x": list(labels), "y": [max(100.0 - v, 0.0) for v in pct], "base": pct,
         "name": "headroom", "marker": {"color": COLORS["muted"]}, "opacity": 0.18,
         "hovertemplate": "%{x}<br>headroom %{y:.1f} points<extra></extra>"},
    ]
    layout = _layout(f"Roofline: % of {peak_text} — {gpu_label}", "% of datasheet peak", rangemode="tozero")
    shape, notes = _hline(100, "dot", "datasheet peak")
    return _figure(data, {**layout, "barmode": "overlay", "shapes": [shape], "annotations": notes})


def roofline_chart(div_id: str, *args: Any, **kwargs: Any) -> Markup:
    """`roofline_spec` as a chart block with id `div_id`."""
    return _html(roofline_spec(*args, **kwargs), div_id)


def shape_spec(shape_labels: Sequence[str], series: Sequence[tuple[str, bool, Sequence[float | None]]],
               gpu_label: str) -> dict[str, Any]:
    """Speedup over torch.compile per shape (x) and submission (one bar group each), log axis: shows
    where a kernel wins and where it loses, which a geomean hides. A missing shape draws no bar."""
    data = []
    values = [v for _, _, ys in series for v in ys if v]
    for name, house, ys in series:
        trace = {"type": "bar", "x": list(shape_labels), "y": [(v - 1.0) if v else None for v in ys], "base": 1.0,
                 "name": name, "customdata": list(ys),
                 "hovertemplate": f"{name}<br>%{{x}}: %{{customdata:.3f}}× torch.compile<extra></extra>"}
        if house:
            trace["marker"] = {"color": COLORS["house"]}
        data.append(trace)
    low, high = min([*values, 1.0]), max([*values, 1.0])
    layout = _layout(f"Per shape — {gpu_label}", "speedup (×, log scale)", type="log",
                     range=[math.log10(low) - 0.2, math.log10(high) + 0.2])
    shape, _ = _hline(1, "dash")
    return _figure(data, {**layout, "barmode": "group", "showlegend": True, "shapes": [shape]})


def shape_chart(div_id: str, *args: Any, **kwargs: Any) -> Markup:
    """`shape_spec` as a chart block with id `div_id`."""
    return _html(shape_spec(*args, **kwargs), div_id)


@dataclass(frozen=True)
class SpendPoint:
    """One model on an efficiency chart: its deck score against what it spent."""

    label: str
    spend: float
    spend_text: str
    score: float
    on_frontier: bool


def efficiency_spec(title: str, axis_title: str, points: Sequence[SpendPoint]) -> dict[str, Any]:
    """Deck score against spend on a log x axis: every point labelled, the Pareto frontier a stepped line."""
    frontier = [p for p in points if p.on_frontier]
    others = [p for p in points if not p.on_frontier]

    def trace(ps: Sequence[SpendPoint], color: str, symbol: str, name: str) -> dict[str, Any]:
        return {
            "type": "scatter", "x": [p.spend for p in ps], "y": [p.score for p in ps], "mode": "markers+text",
            "name": name, "text": [p.label for p in ps], "textposition": "top center", "cliponaxis": False,
            "marker": {"color": color, "size": 11, "symbol": symbol, "line": {"width": 1, "color": color}},
            "customdata": [[p.spend_text, f"{p.score:.3f}", name] for p in ps],
            "hovertemplate": "%{text}<br>%{customdata[0]}<br>score %{customdata[1]}<br>%{customdata[2]}"
                             "<extra></extra>",
        }

    data = []
    if len(frontier) > 1:
        data.append({
            "type": "scatter", "x": [p.spend for p in frontier], "y": [p.score for p in frontier], "mode": "lines",
            "line": {"color": COLORS["model"], "width": 2, "dash": "dot", "shape": "hv"}, "hoverinfo": "skip",
            "name": "Pareto frontier",
        })
    data.append(trace(frontier, COLORS["model"], "circle", "on the Pareto frontier"))
    if others:
        data.append(trace(others, COLORS["muted"], "circle-open", "dominated"))
    spends = [p.spend for p in points]
    low, high = math.log10(min(spends)), math.log10(max(spends))
    pad = max(0.25, 0.1 * (high - low))
    return _figure(data, {
        "title": {"text": title, "x": 0, "xanchor": "left", "font": {"size": 14}},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": COLORS["fg"], "family": "system-ui, sans-serif", "size": 12},
        "margin": {"l": 64, "r": 24, "t": 56, "b": 64},
        "showlegend": True,
        "legend": {"orientation": "h", "x": 0, "y": -0.18, "font": {"color": COLORS["muted"]}},
        "xaxis": {"type": "log", "title": {"text": axis_title}, "gridcolor": COLORS["grid"],
                  "range": [low - pad, high + pad]},
        "yaxis": {"title": {"text": "deck score"}, "gridcolor": COLORS["grid"], "zeroline": False,
                  "range": [-0.08, 1.15]},
    })


def efficiency_chart(div_id: str, title: str, axis_title: str, points: Sequence[SpendPoint]) -> Markup:
    """`efficiency_spec` as a chart block with id `div_id`."""
    return _html(efficiency_spec(title, axis_title, points), div_id)

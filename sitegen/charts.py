"""Plotly figure builders for the problem pages: speedup and roofline bars per submission.

Each builder returns an HTML fragment: a `<div>` with a fixed id followed by the figure as a
JSON data block (`<script type="application/json">`, never executed); `static/charts.js` draws
every such block with plotly.js, loaded once per page from `static/plotly.min.js`. No inline
script, so the pages' Content-Security-Policy allows scripts from the site only. Fixed ids and
a fixed layout keep builds byte-identical. The same numbers
are always printed in a table beside the chart, so a page without JavaScript loses nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import plotly.io as pio
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


def _html(fig: go.Figure, div_id: str) -> Markup:
    """The chart's `<div>` and its figure as a JSON data block (never executed), which
    static/charts.js draws: the pages carry no inline script, so the CSP can say script-src 'self'."""
    payload = json.dumps({"figure": json.loads(pio.to_json(fig, validate=True)), "config": PLOT_CONFIG,
                          "theme": THEME_VARS}, sort_keys=True, separators=(", ", ": "))
    # "<" never appears raw inside the data block, so no "</script>" or "<!--" can end it early.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(
        f'<div id="{div_id}" class="plotly-graph-div chart-mount" style="height:{_HEIGHT_PX}px; width:100%;">'
        f'</div>\n<script type="application/json" class="chart-data" data-for="{div_id}">{payload}</script>'
    )


def _colors(is_house: Sequence[bool]) -> list[str]:
    return [COLORS["house"] if h else COLORS["model"] for h in is_house]


def speedup_chart(div_id: str, labels: Sequence[str], speedups: Sequence[float],
                  is_house: Sequence[bool], gpu_label: str,
                  failures: Sequence[tuple[str, str, str]] = ()) -> Markup:
    """Bars of geomean speedup over torch.compile per submission on a log axis, a line at 1×; each
    failed or DNF submission `(label, kind, reason)` is a marked point on the 1× line, never a bar."""
    # Bars grow from 1× (torch.compile) up to a faster or down to a slower kernel.
    fig = go.Figure(go.Bar(
        x=list(labels), y=[v - 1.0 for v in speedups], base=1.0, marker_color=_colors(is_house),
        text=[f"{v:.2f}×" for v in speedups], textposition="outside", cliponaxis=False,
        customdata=list(speedups), hovertemplate="%{x}<br>%{customdata:.3f}× torch.compile<extra></extra>",
    ))
    if failures:
        fig.add_trace(go.Scatter(
            x=[f[0] for f in failures], y=[1.0] * len(failures), mode="markers+text",
            marker={"symbol": "x-thin-open", "size": 12, "color": COLORS["muted"]},
            text=[f[1] for f in failures], textposition="top center", customdata=[f[2] for f in failures],
            hovertemplate="%{x}: %{text}<br>%{customdata}<extra></extra>", showlegend=False,
        ))
    low, high = min(min(speedups), 1.0), max(max(speedups), 1.0)
    fig.update_layout(_layout(f"Speedup over torch.compile — {gpu_label}", "speedup (×, log scale)",
                              type="log", range=[math.log10(low) - 0.25, math.log10(high) + 0.25]))
    fig.add_hline(y=1, line_dash="dash", line_color=COLORS["muted"], annotation_text="torch.compile (1×)",
                  annotation_position="top left", annotation_font_color=COLORS["muted"])
    return _html(fig, div_id)


def roofline_chart(div_id: str, labels: Sequence[str], peak_fractions: Sequence[float],
                   is_house: Sequence[bool], gpu_label: str, peak_text: str) -> Markup:
    """Bars of the geomean fraction of the GPU's datasheet peak per submission, in %."""
    pct = [100.0 * f for f in peak_fractions]
    fig = go.Figure(go.Bar(
        x=list(labels), y=pct, marker_color=_colors(is_house), name="achieved",
        text=[f"{v:.1f}%" for v in pct], textposition="outside", cliponaxis=False,
        hovertemplate="%{x}<br>%{y:.2f}% of peak<extra></extra>",
    ))
    # The headroom up to the ceiling, drawn as a faint bar above each achieved one.
    fig.add_trace(go.Bar(
        x=list(labels), y=[max(100.0 - v, 0.0) for v in pct], base=pct, name="headroom",
        marker_color=COLORS["muted"], opacity=0.18, hovertemplate="%{x}<br>headroom %{y:.1f} points<extra></extra>",
    ))
    fig.update_layout(barmode="overlay", showlegend=False)
    fig.update_layout(_layout(f"Roofline: % of {peak_text} — {gpu_label}", "% of datasheet peak",
                              rangemode="tozero"))
    fig.add_hline(y=100, line_dash="dot", line_color=COLORS["muted"], annotation_text="datasheet peak",
                  annotation_position="top left", annotation_font_color=COLORS["muted"])
    return _html(fig, div_id)


def shape_chart(div_id: str, shape_labels: Sequence[str], series: Sequence[tuple[str, bool, Sequence[float | None]]],
                gpu_label: str) -> Markup:
    """Speedup over torch.compile per shape (x) and submission (one bar group each), log axis: shows
    where a kernel wins and where it loses, which a geomean hides. A missing shape draws no bar."""
    fig = go.Figure()
    values = [v for _, _, ys in series for v in ys if v]
    for name, house, ys in series:
        fig.add_trace(go.Bar(
            x=list(shape_labels), y=[(v - 1.0) if v else None for v in ys], base=1.0, name=name,
            marker_color=COLORS["house"] if house else None, customdata=list(ys),
            hovertemplate=f"{name}<br>%{{x}}: %{{customdata:.3f}}× torch.compile<extra></extra>",
        ))
    low, high = min([*values, 1.0]), max([*values, 1.0])
    fig.update_layout(_layout(f"Per shape — {gpu_label}", "speedup (×, log scale)", type="log",
                              range=[math.log10(low) - 0.2, math.log10(high) + 0.2]))
    fig.update_layout(barmode="group", showlegend=True)
    fig.add_hline(y=1, line_dash="dash", line_color=COLORS["muted"])
    return _html(fig, div_id)


@dataclass(frozen=True)
class SpendPoint:
    """One model on an efficiency chart: its deck score against what it spent."""

    label: str
    spend: float
    spend_text: str
    score: float
    on_frontier: bool


def efficiency_chart(div_id: str, title: str, axis_title: str, points: Sequence[SpendPoint]) -> Markup:
    """Deck score against spend on a log x axis: every point labelled, the Pareto frontier a stepped line."""
    frontier = [p for p in points if p.on_frontier]
    others = [p for p in points if not p.on_frontier]

    def trace(ps: Sequence[SpendPoint], color: str, symbol: str, name: str) -> go.Scatter:
        return go.Scatter(
            x=[p.spend for p in ps], y=[p.score for p in ps], mode="markers+text", name=name,
            text=[p.label for p in ps], textposition="top center", cliponaxis=False,
            marker={"color": color, "size": 11, "symbol": symbol, "line": {"width": 1, "color": color}},
            customdata=[[p.spend_text, f"{p.score:.3f}", name] for p in ps],
            hovertemplate="%{text}<br>%{customdata[0]}<br>score %{customdata[1]}<br>%{customdata[2]}"
                          "<extra></extra>",
        )

    fig = go.Figure()
    if len(frontier) > 1:
        fig.add_trace(go.Scatter(
            x=[p.spend for p in frontier], y=[p.score for p in frontier], mode="lines", line_shape="hv",
            line={"color": COLORS["model"], "width": 2, "dash": "dot"}, hoverinfo="skip",
            name="Pareto frontier",
        ))
    fig.add_trace(trace(frontier, COLORS["model"], "circle", "on the Pareto frontier"))
    if others:
        fig.add_trace(trace(others, COLORS["muted"], "circle-open", "dominated"))
    spends = [p.spend for p in points]
    low, high = math.log10(min(spends)), math.log10(max(spends))
    pad = max(0.25, 0.1 * (high - low))
    fig.update_layout(
        title={"text": title, "x": 0, "xanchor": "left", "font": {"size": 14}},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
        font={"color": COLORS["fg"], "family": "system-ui, sans-serif", "size": 12},
        margin={"l": 64, "r": 24, "t": 56, "b": 64},
        showlegend=True,
        legend={"orientation": "h", "x": 0, "y": -0.18, "font": {"color": COLORS["muted"]}},
        xaxis={"type": "log", "title": {"text": axis_title}, "gridcolor": COLORS["grid"],
               "range": [low - pad, high + pad]},
        yaxis={"title": {"text": "deck score"}, "gridcolor": COLORS["grid"], "zeroline": False,
               "range": [-0.08, 1.15]},
    )
    return _html(fig, div_id)

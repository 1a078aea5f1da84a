"""Every kind of chart the site emits is a valid Plotly figure: the plain-dict specs of `sitegen.charts`
go through `plotly.graph_objects.Figure` (which validates each property) and come back unchanged."""

from __future__ import annotations

import json
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from kernelboard.sitegen import charts

_POINTS = [charts.SpendPoint("m1", 1.0, "$1.00", 0.5, True), charts.SpendPoint("m2", 3.0, "$3.00", 0.9, True),
           charts.SpendPoint("m3", 2.0, "$2.00", 0.2, False)]

SPECS: dict[str, dict[str, Any]] = {
    "speedup": charts.speedup_spec(["house", "Model <b>", "Model 2"], [2.5, 0.8, 1.2], [True, False, False],
                                   "NVIDIA H200", [("Model 3", "wrong", "max abs error 3 & more")]),
    "speedup without failures": charts.speedup_spec(["Model 1"], [1.7], [False], "NVIDIA H200"),
    "roofline": charts.roofline_spec(["house", "Model 1"], [0.52, 0.91], [True, False], "NVIDIA H200",
                                     "memory bandwidth (4,800 GB/s)"),
    "per shape": charts.shape_spec(["0: small", "1: large"], [("house", True, [2.0, None]),
                                                             ("Model 1", False, [0.5, 3.0])], "NVIDIA H200"),
    "efficiency": charts.efficiency_spec("Score against cost", "cost (USD, log scale)", _POINTS),
    "efficiency, one point": charts.efficiency_spec("Score against cost", "cost (USD)", _POINTS[:1]),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_each_chart_spec_is_what_plotly_makes_of_it(kind: str) -> None:
    spec = SPECS[kind]
    validated = json.loads(pio.to_json(go.Figure(spec), validate=True))  # raises on any unknown property
    assert validated == json.loads(json.dumps(spec))


def test_a_chart_block_never_ends_its_script_early() -> None:
    html = str(charts.speedup_chart("chart-x", ["</script><b>"], [1.5], [False], "GPU & co"))
    body = html.split('class="chart-data" data-for="chart-x">', 1)[1]
    assert body.count("</script>") == 1 and body.endswith("</script>")
    assert "<b>" not in body and "&" not in body.removesuffix("</script>")

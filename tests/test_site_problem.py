"""Problem pages stay light however many runs there are: one row and one bar per model (its best run,
the one its board cell shows), the number of runs behind each row, and a link to the model's page that
lists every one of them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from site_fixtures import make_large_site_inputs
from site_pages import parse, text

from kernelboard.sitegen import build_site
from kernelboard.sitegen.format import model_slug
from kernelboard.sitegen.load import load_site

BENCH, PROBLEM, GPU = "hard", "03_paged_attention", "h200"


def test_a_problem_page_lists_each_models_best_run_and_counts_the_rest(tmp_path: Path) -> None:
    inputs = make_large_site_inputs(tmp_path / "in", n_runs=120, n_models=2)
    data = load_site(inputs.data_dir, inputs.decks_dir)
    graded = [data.runs[r.run_id] for r in data.results
              if r.gpu == GPU and (data.runs[r.run_id].bench, data.runs[r.run_id].problem) == (BENCH, PROBLEM)]
    per_model = Counter(run.model for run in graded)
    assert max(per_model.values()) > 1  # several runs per model: the page must not list them all
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    page = out / "problems" / BENCH / PROBLEM / "index.html"
    section = parse(page).find(f".//section[@id='gpu-{GPU}']")
    assert section is not None
    table = section.find(".//table")
    assert table is not None
    assert f"({len(graded)} graded runs in all)" in text(table.find(".//caption"))
    rows = table.findall(".//tbody/tr")
    assert len(rows) == len(per_model)
    runs_cells = [row.findall("td")[-1] for row in rows]
    assert sorted(int(text(c)) for c in runs_cells) == sorted(per_model.values())
    links = {c.find("a").get("href") for c in runs_cells}  # type: ignore[union-attr]
    assert links == {f"../../../models/{model_slug(m)}/#attempts" for m in per_model}
    # one bar per model on the speedup chart: its passes, and its failures as marks on the 1× line
    block = section.find(".//script[@data-for='chart-speedup-h200']")
    assert block is not None
    traces = json.loads(block.text or "")["figure"]["data"]
    assert sum(len(t["y"]) for t in traces) == len(per_model)  # bars run sideways: one row per model

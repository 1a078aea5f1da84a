"""What each page shows: the template context of the home, problem and run pages.

Contexts hold the loaded records themselves (templates read their fields under StrictUndefined)
plus what a template should not compute: charts, rendered Markdown, highlighted source, and the
printed arithmetic behind each headline number. Links are made in the templates with `url()`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from markdown_it import MarkdownIt
from markupsafe import Markup

from kernelboard.eval.roofline import geomean

from . import charts
from .board import (
    ORDERING_RULE,
    OUTCOME_LABELS,
    STATUS_HELP,
    STATUS_LABELS,
    STATUS_TONES,
    Board,
    best_per_model,
    build_boards,
    gpu_label,
    problem_entries,
    reason_for,
)
from .format import model_slug, num, pct, speedup
from .highlight import highlight_python
from .load import CPU_KEY, Hardware, Problem, Result, SiteData


@lru_cache(maxsize=256)
def _markdown(text: str) -> Markup:
    """CommonMark plus tables, raw HTML off, headings moved one level down (the page owns h1), table
    headers scoped.
    Cached per text: the same README or prose renders once per process."""
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(text)
    for token in tokens:
        if token.type in ("heading_open", "heading_close"):
            token.tag = f"h{min(int(token.tag[1]) + 1, 6)}"
        elif token.type == "th_open":  # Markdown tables only have column headers: say so to screen readers
            token.attrSet("scope", "col")
    return Markup(md.renderer.render(tokens, md.options, {}))


def _safe_href(url: str | None) -> str | None:
    """An external link only when it is http(s); anything else is shown as text, not linked."""
    return url if url and urlsplit(url).scheme in ("http", "https") else None


def peak_text(problem: Problem, hardware: Hardware | None) -> str:
    """The peak a problem's roofline fraction is measured against on one GPU, in words."""
    if hardware is None:
        return "no datasheet peak (CPU timings)"
    if problem.regime == "memory":
        return f"memory bandwidth ({num(hardware.bandwidth_gb_s, 0)} GB/s)"
    key = problem.peak_tflops_key
    return f"dense {key} compute ({num(hardware.peak_tflop_s.get(key))} TFLOP/s)"


# ------------------------------------------------------------------------------------------ home


@dataclass(frozen=True)
class GpuTab:
    """One GPU's board inside a bench section of the home page: a tab with JavaScript, a section without."""

    bench: str
    gpu: str
    label: str
    is_cpu: bool
    hardware: Hardware | None
    board: Board  # cut to its top HOME_MODEL_ROWS model rows (plus its house rows)
    hidden: int  # model rows left off (they are on the GPU page)

    @property
    def id(self) -> str:
        """The tab panel's id and URL hash, e.g. 'hard-h200': unique across benches, stable for deep links."""
        return f"{self.bench}-{self.gpu}"


@dataclass(frozen=True)
class BenchSection:
    """One bench (deck) on the home page, with a tab per GPU it has results on."""

    bench: str
    label: str
    tabs: tuple[GpuTab, ...]


#: Model rows a home board shows: the top ranks (house rows always follow); the GPU page has them all.
#: Keeps the home page light however many models have run: 10 rows × 6 problems × 4 GPUs ≈ 120 KB.
HOME_MODEL_ROWS = 10

#: Benches in home page order: these first, any other after them in name order.
BENCH_ORDER = ("hard", "mega")


def _top(board: Board) -> tuple[Board, int]:
    """The board with its first HOME_MODEL_ROWS model rows (rank order) and every house row; rows left off."""
    models = [r for r in board.rows if not r.is_house]
    if len(models) <= HOME_MODEL_ROWS:
        return board, 0
    return (dataclasses.replace(board, rows=(*models[:HOME_MODEL_ROWS], *(r for r in board.rows if r.is_house))),
            len(models) - HOME_MODEL_ROWS)


def bench_sections(data: SiteData) -> list[BenchSection]:
    """A section per bench that has graded results, each with its GPU tabs in `gpu_order`
    (build_boards already yields boards in that order)."""
    boards = build_boards(data)
    benches = sorted({b.bench for b in boards},
                     key=lambda b: (BENCH_ORDER.index(b) if b in BENCH_ORDER else len(BENCH_ORDER), b))
    sections = []
    for bench in benches:
        tabs = tuple(GpuTab(bench, b.gpu, b.label, b.is_cpu, data.hardware.get(b.gpu), *_top(b))
                     for b in boards if b.bench == bench)
        sections.append(BenchSection(bench, bench.title(), tabs))
    return sections


def home(data: SiteData) -> dict[str, Any]:
    sections = bench_sections(data)
    return {
        "title": "Leaderboards",
        "sections": sections,
        "problems": [data.problems[k] for k in sorted(data.problems)],
        "ordering_rule": ORDERING_RULE,
        "legend": [(s, STATUS_LABELS[s], STATUS_TONES[s], STATUS_HELP[s]) for s in STATUS_LABELS],
        "downloads": sorted(k for k in data.table_files if k.endswith(".parquet")),
        "n_runs": len(data.runs),
        "n_results": len(data.results),
        "charts": False,
    }


# --------------------------------------------------------------------------------------- problem


@dataclass(frozen=True)
class BaselineRow:
    shape_idx: int
    label: str
    cells: tuple[Any, ...]  # one Baseline (or None) per variant


def _baseline_rows(data: SiteData, bench: str, name: str,
                   gpu: str) -> tuple[tuple[str, ...], list[BaselineRow]]:
    """Baseline variants measured for a problem on a GPU, and one row per shape of their timings."""
    rows = [b for b in data.baselines if (b.bench, b.problem, b.gpu) == (bench, name, gpu)]
    variants = tuple(sorted({b.variant for b in rows}))
    by_shape: dict[int, dict[str, Any]] = {}
    labels: dict[int, str] = {}
    for b in rows:
        by_shape.setdefault(b.shape_idx, {})[b.variant] = b
        labels[b.shape_idx] = b.shape_label
    return variants, [BaselineRow(i, labels[i], tuple(by_shape[i].get(v) for v in variants))
                      for i in sorted(by_shape)]


#: The per-shape chart draws this many of the fastest passes (plus the house rows): more bars per
#: shape than this cannot be read, and the full per-shape numbers are on each run page.
SHAPE_CHART_PASSES = 10


def _shape_chart(gpu: str, gpu_label: str, passes: list[Any]) -> Markup | None:
    """The per-shape speedups of the fastest passes on one GPU (only when a problem has several shapes);
    `passes` come fastest first (board.problem_entries)."""
    models = [e for e in passes if not e.run.is_house][:SHAPE_CHART_PASSES]
    passes = [e for e in passes if e.run.is_house or e in models]
    shape_labels: dict[int, str] = {}
    for e in passes:
        shape_labels.update({s.shape_idx: s.shape_label for s in e.result.shapes})
    if not passes or len(shape_labels) < 2:
        return None
    order = sorted(shape_labels)
    series = []
    for e in passes:
        by_idx = {s.shape_idx: s.speedup_vs_compile for s in e.result.shapes}
        series.append((e.label, e.run.is_house, [by_idx.get(i) for i in order]))
    return charts.shape_chart(f"chart-shapes-{gpu}", [f"{i}: {shape_labels[i]}" for i in order], series, gpu_label)


def problem(data: SiteData, bench: str, name: str) -> dict[str, Any]:
    prob = data.problems[(bench, name)]
    readme = prob.folder / "README.md"
    gpus = []
    for gpu, every in problem_entries(data, bench, name).items():
        label = gpu_label(data, gpu)
        hardware = data.hardware.get(gpu)
        # One row and one bar per model: its best run, the one its board cell shows. At thousands of
        # runs a row per run made megabyte pages and unreadable charts; the rest are on the model pages.
        best = best_per_model(every)
        entries = [b.entry for b in best]
        passes = [e for e in entries if e.result.is_pass]
        # CPU timings have no datasheet peak to be a fraction of: no roofline chart for them.
        roof = [e for e in passes if e.result.peak_fraction is not None and gpu != CPU_KEY]
        variants, baseline_rows = _baseline_rows(data, bench, name, gpu)
        gpus.append({
            "gpu": gpu,
            "label": label,
            "is_cpu": gpu == CPU_KEY,
            "entries": entries,
            "rows": [{"entry": b.entry, "runs": b.runs, "slug": model_slug(b.entry.run.model)} for b in best],
            "n_runs": len(every),
            "peak_text": peak_text(prob, hardware),
            "variants": variants,
            "baseline_rows": baseline_rows,
            "speedup_chart": charts.speedup_chart(
                f"chart-speedup-{gpu}", [e.label for e in passes],
                [e.result.speedup_vs_compile for e in passes],  # type: ignore[misc]
                [e.run.is_house for e in passes], label,
                [(e.label, e.status_label, e.reason) for e in entries if not e.result.is_pass]) if passes else None,
            "shape_chart": _shape_chart(gpu, label, passes),
            "roofline_chart": charts.roofline_chart(
                f"chart-roofline-{gpu}", [e.label for e in roof],
                [e.result.peak_fraction for e in roof],  # type: ignore[misc]
                [e.run.is_house for e in roof], label, peak_text(prob, hardware)) if roof else None,
        })
    return {
        "title": prob.display_name,
        "problem": prob,
        "readme_html": _markdown(readme.read_text(encoding="utf-8")) if readme.is_file() else None,
        "shapes": [
            {"shape": s, "params": ", ".join(f"{k}={v}" for k, v in s.params.items()),
             "gflop": _scaled(prob.flops(s), 1e-9), "mb": _scaled(prob.bytes_moved(s), 1e-6)}
            for s in prob.shapes
        ],
        "gpus": gpus,
        "charts": any(g["speedup_chart"] or g["roofline_chart"] for g in gpus),
        "shape_chart_passes": SHAPE_CHART_PASSES,
    }


# ------------------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class Arithmetic:
    """A geomean written out so it can be checked by hand: (a × b × …)^(1/n) = value."""

    terms: tuple[str, ...]
    value: float
    percent: bool = False  # a roofline fraction (terms and value in %), not a speedup

    @property
    def text(self) -> str:
        value = pct(self.value) if self.percent else speedup(self.value)
        return f"({' × '.join(self.terms)})^(1/{len(self.terms)}) = {value}"


def _arithmetic(values: list[float | None], percent: bool = False) -> Arithmetic | None:
    """A headline written out from its per-shape values (speedups, or roofline fractions in %), so a
    reader can check the geomean by hand; None when a shape has no positive value."""
    if not values or any(v is None or v <= 0 for v in values):
        return None
    terms = tuple(f"{100 * v:.2f}%" if percent else f"{v:.3f}" for v in values)  # type: ignore[operator]
    return Arithmetic(terms, geomean(values), percent)  # type: ignore[arg-type]


def _params(shape_json: str) -> str:
    try:
        params = json.loads(shape_json)
    except json.JSONDecodeError:
        return shape_json
    if not isinstance(params, dict):
        return shape_json
    return ", ".join(f"{k}={v}" for k, v in params.items())


def run(data: SiteData, result: Result) -> dict[str, Any]:
    the_run = data.runs[result.run_id]
    prob = data.problems[(the_run.bench, the_run.problem)]
    source = data.solutions.get(result.run_id)
    return {
        "title": f"{prob.display_name} · {the_run.model_display}",
        "run": the_run,
        "result": result,
        "problem": prob,
        "gpu_label": gpu_label(data, result.gpu),
        "hardware": data.hardware.get(result.gpu),
        "status_label": STATUS_LABELS[result.status],
        "tone": STATUS_TONES[result.status],
        "reason": reason_for(the_run, result),
        "outcome_label": OUTCOME_LABELS[the_run.agent_outcome],
        "cpu_timings": result.timer == "cpu_wall",
        "arithmetic": _arithmetic([s.speedup_vs_compile for s in result.shapes]) if result.is_pass else None,
        "roofline_arithmetic": _arithmetic([s.peak_fraction for s in result.shapes], percent=True)
        if result.is_pass and result.peak_fraction is not None else None,
        "shape_params": {s.shape_idx: _params(s.shape_json) for s in result.shapes},
        "peak_text": peak_text(prob, data.hardware.get(result.gpu)),
        "source_html": highlight_python(source) if source is not None else None,
        "trace_href": _safe_href(the_run.trace_url),
        "solution_href": "solution.py" if source is not None else None,
        "annotation": data.annotations.get(result.run_id),
        "log_href": f"data/results/{result.log_path}" if f"data/results/{result.log_path}" in data.table_files
        else None,
        "charts": False,
    }


def _scaled(value: float | None, factor: float) -> float | None:
    """A formula's value in display units, or None when the problem has no such formula."""
    return None if value is None else value * factor

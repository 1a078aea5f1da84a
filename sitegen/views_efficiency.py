"""The efficiency page: each model's deck score against what it spent to get it.

Per board (a bench on a GPU, as `board.build_boards` makes them) each AI-model row is one point:
y is the row's **deck score** — the very number the home board prints — and x is what the runs
behind that score spent, summed over the row's counted cells (the one run per problem the board
shows; a DNF cell is left out of the spend as it is left out of the score): output tokens on one
chart, cost in USD on the other, both on a log axis. The **Pareto frontier** (`pareto_frontier`)
joins the rows no other row beats on both counts (a score at least as high for at most as much).

Nothing is dropped silently: a row whose runs lack a token count or a cost is listed under "not
plotted" with the reason, as is a row with no score (every cell a DNF, or a regrade in progress). House rows (the house
kernel and calibration rows, harness 'house') are reference points, not models: they are never
plotted nor on a frontier, and the page names them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

from . import charts
from .board import Board, Cell, Row, build_boards, tab_gpu_order
from .load import CPU_KEY, Run, SiteData

#: What the page says about how x is measured; the template prints it once.
SPEND_RULE = (
    "Each point is one model on one board. Its height is the model's deck score — the same number the "
    "leaderboard prints (mean share of the best on the board's metric: speedup over torch.compile, or % of "
    "roofline on a board imported from KernelBench-Hard; a failure scores 0; a DNF is left out). Its x is "
    "what the runs behind that score spent: summed over the board's cells of that model (one run per "
    "problem, the run the board shows), leaving out DNF cells as the score does. The x axis is "
    "logarithmic. The line is the Pareto frontier: the models no other model beats on both counts "
    "(a score at least as high for no more tokens or dollars, one of them strictly better)."
)

HOUSE_RULE = (
    "House rows — the house kernel and the calibration rows (harness 'house') — are reference points "
    "made by the maintainers, not models: they are never plotted and never on a frontier."
)


# ---------------------------------------------------------------------------------------- frontier


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points, ordered by x (then by descending y, then index).

    A point (x, y) — x a spend (lower is better), y a score (higher is better) — is dominated when
    another point has x' <= x and y' >= y with at least one strict. Equal points do not dominate
    each other, so duplicates on the frontier are all kept. An empty input gives an empty frontier;
    a single point is its own frontier.
    """
    frontier = [
        i for i, (x, y) in enumerate(points)
        if not any(x2 <= x and y2 >= y and (x2 < x or y2 > y) for x2, y2 in points)
    ]
    return sorted(frontier, key=lambda i: (points[i][0], -points[i][1], i))


# -------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Measure:
    """One x axis: what it measures, how a run reports it, and how the page prints it."""

    key: str  # 'tokens' or 'cost': part of chart and table ids
    title: str
    axis: str
    get: Callable[[Run], float | int | None]
    fmt: Callable[[float], str]
    missing: str  # the reason a row without it gives


def _tokens(value: float) -> str:
    return f"{value:,.0f}"


def _usd(value: float) -> str:
    return f"${value:,.2f}"


MEASURES: tuple[Measure, ...] = (
    Measure("tokens", "Score vs output tokens", "output tokens (log scale)", lambda r: r.output_tokens,
            _tokens, "no output-token count"),
    Measure("cost", "Score vs cost", "cost in USD (log scale)", lambda r: r.cost_usd, _usd, "no cost"),
)


@dataclass(frozen=True)
class Point:
    """One model row on one chart: its deck score and its summed spend."""

    display: str
    model: str
    harnesses: tuple[str, ...]
    score: float
    passes: int
    counted: int
    spend: float
    runs: int  # how many runs the spend sums
    on_frontier: bool


@dataclass(frozen=True)
class Missing:
    """A row that is not on a chart, and why (never dropped silently)."""

    display: str
    model: str
    harnesses: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class ChartBlock:
    """One chart of a board (tokens or cost), its table, and the rows it could not plot."""

    measure: Measure
    chart_id: str
    table_id: str
    points: tuple[Point, ...]  # sorted by spend, then score descending
    frontier: tuple[Point, ...]
    chart: Markup | None  # None when no point has this telemetry
    summary: str  # the chart's text alternative

    def fmt(self, value: float) -> str:
        return self.measure.fmt(value)


@dataclass(frozen=True)
class EfficiencyBoard:
    bench: str
    gpu: str
    label: str
    is_cpu: bool
    n_problems: int
    n_models: int  # AI-model rows on the board (house rows not counted)
    blocks: tuple[ChartBlock, ...]
    not_plotted: tuple[Missing, ...]  # model rows missing a score or some telemetry
    house: tuple[Row, ...]

    @property
    def has_points(self) -> bool:
        return any(b.points for b in self.blocks)


def _counted(row: Row) -> list[Cell]:
    """The cells whose runs stand behind the row's score: every cell present that is not a DNF or unscored."""
    return [c for c in row.cells if c is not None and c.state != "dnf" and not c.unscored]


def _spend(row: Row, measure: Measure) -> tuple[float | None, int, int]:
    """(summed spend or None, runs counted, runs lacking the measure) of a row's counted cells."""
    values = [measure.get(c.run) for c in _counted(row)]
    lacking = sum(1 for v in values if v is None or not math.isfinite(v))
    if not values or lacking:
        return None, len(values), lacking
    return float(sum(values)), len(values), 0  # type: ignore[arg-type]


def _summary(measure: Measure, points: Sequence[Point], frontier: Sequence[Point], where: str) -> str:
    if not points:
        return f"No model on {where} reports its {measure.key}: nothing to plot."
    names = "; ".join(f"{p.display} ({measure.fmt(p.spend)}, score {p.score:.3f})" for p in frontier)
    return (f"{measure.title} on {where}: {len(points)} model{'s' if len(points) != 1 else ''} plotted; "
            f"Pareto frontier: {names}. The table beside the chart lists every point.")


def _block(board: Board, rows: Sequence[Row], measure: Measure) -> tuple[ChartBlock, list[Missing]]:
    candidates, missing = [], []
    for row in rows:
        spend, n_runs, lacking = _spend(row, measure)
        if spend is None or spend <= 0:
            why = (f"{measure.missing} ({lacking} of {n_runs} run{'s' if n_runs != 1 else ''})" if lacking
                   else f"{measure.missing} (no counted run)" if not n_runs
                   else f"{measure.missing} (reported as 0: not plottable on a log axis)")
            missing.append(Missing(row.display, row.model, row.harnesses, why))
            continue
        candidates.append((row, spend, n_runs))
    on = set(pareto_frontier([(spend, row.score) for row, spend, _ in candidates]))  # type: ignore[misc]
    points = sorted(
        (Point(row.display, row.model, row.harnesses, row.score, row.passes, row.counted,  # type: ignore[arg-type]
               spend, n, i in on) for i, (row, spend, n) in enumerate(candidates)),
        key=lambda p: (p.spend, -p.score, p.display, p.model),
    )
    frontier = tuple(p for p in points if p.on_frontier)
    base = f"eff-{measure.key}-{board.gpu}-{board.bench}"
    where = f"the {board.bench} deck on {board.label}"
    chart = charts.efficiency_chart(
        f"chart-{base}", f"{measure.title} — {board.bench}, {board.label}", measure.axis,
        [charts.SpendPoint(p.display, p.spend, measure.fmt(p.spend), p.score, p.on_frontier) for p in points],
    ) if points else None
    return ChartBlock(measure, f"chart-{base}", f"table-{base}", tuple(points), frontier, chart,
                      _summary(measure, points, frontier, where)), missing


def _board(board: Board) -> EfficiencyBoard:
    models = [r for r in board.rows if not r.is_house]
    scored = [r for r in models if r.score is not None]
    not_plotted: dict[tuple[str, str], list[str]] = {}
    meta: dict[str, Row] = {r.model: r for r in models}
    for r in models:
        if r.regrade is not None:
            not_plotted.setdefault((r.display, r.model), []).append(f"no score yet: {r.regrade.text}")
        elif r.score is None:
            not_plotted.setdefault((r.display, r.model), []).append("no score: every run on this board was a DNF")
    blocks = []
    for measure in MEASURES:
        block, missing = _block(board, scored, measure)
        blocks.append(block)
        for m in missing:
            not_plotted.setdefault((m.display, m.model), []).append(m.reason)
    listed = tuple(Missing(display, model, meta[model].harnesses, "; ".join(reasons))
                   for (display, model), reasons in sorted(not_plotted.items()))
    return EfficiencyBoard(board.bench, board.gpu, board.label, board.is_cpu, len(board.problems), len(models),
                           tuple(blocks), listed, tuple(r for r in board.rows if r.is_house))


# --------------------------------------------------------------------------------------------- page


@dataclass(frozen=True)
class Section:
    gpu: str
    label: str
    is_cpu: bool
    boards: tuple[EfficiencyBoard, ...]


def efficiency(data: SiteData) -> dict[str, Any]:
    """Context of efficiency/index.html: one section per GPU, one efficiency board per bench."""
    built = build_boards(data)
    boards = [_board(b) for b in built]
    gpus = tab_gpu_order((b.gpu for b in built), {b.gpu for b in built if not b.is_imported})
    sections = [Section(gpu, next(b.label for b in boards if b.gpu == gpu), gpu == CPU_KEY,
                        tuple(b for b in boards if b.gpu == gpu))
                for gpu in gpus]
    return {
        "title": "Efficiency",
        "sections": sections,
        "spend_rule": SPEND_RULE,
        "house_rule": HOUSE_RULE,
        "any_points": any(b.has_points for b in boards),
        "any_models": any(b.n_models for b in boards),
        "charts": any(block.chart is not None for b in boards for block in b.blocks),
    }

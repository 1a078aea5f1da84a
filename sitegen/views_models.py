"""What the per-GPU leaderboard pages, the models index and the model pages show.

Every ranking here is `board.build_boards` / `board.rank_rows` (ORDERING_RULE): a GPU page shows the
same boards as the home page, in the same row order, with more columns per row. A model page reads
its cells off those same boards, so a card never disagrees with the home board. `ModelPages`
builds the boards once per site build and hands out the context of each page.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kernelboard.eval.roofline import geomean

from .board import (
    ORDERING_RULE,
    Board,
    Cell,
    Entry,
    Row,
    build_boards,
    gpu_label,
    gpu_order,
    tab_order,
)
from .format import model_slug
from .load import CPU_KEY, Problem, Result, Run, SiteData
from .views import MeasuredBy

# ------------------------------------------------------------------------------------- GPU pages


@dataclass(frozen=True)
class BoardLine:
    """One row of a GPU page's table: the board's Row plus what the home board does not show."""

    row: Row
    slug: str
    lab: str | None
    n_problems: int
    geomean_speedup: float | None  # geomean headline speedup of the row's counted passes (Result.headline_speedup)
    mean_roofline: float | None  # arithmetic mean of those passes' geomean fraction of the roofline
    output_tokens: int | None  # summed over every run of the model graded on this board
    cost_usd: float | None  # the same runs' cost
    n_runs: int


@dataclass(frozen=True)
class GpuBoard:
    board: Board
    lines: tuple[BoardLine, ...]

    @property
    def measured(self) -> MeasuredBy:
        return MeasuredBy.of_board(self.board)


def _total(values: list[Any]) -> Any:
    """The sum of the known values, or None when none is known (a missing value is never 0)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _lab(runs: list[Run]) -> str | None:
    """The lab of a model's latest run (by run_id) that names one."""
    return next((r.lab for r in sorted(runs, key=lambda r: r.run_id, reverse=True) if r.lab), None)


class ModelPages:
    """The boards of one build, computed once, and the context of every GPU and model page.

    The boards are computed on first use, in whichever process renders the first GPU or model page: a
    rebuild that renders none of them (one edited solution) does not pay for them (0.4 s at 10,000
    runs), and the page lists (`gpus`, `models`) do not need them."""

    def __init__(self, data: SiteData) -> None:
        self.data = data
        self.runs_by_model: dict[str, list[Run]] = defaultdict(list)
        for run in data.runs.values():
            self.runs_by_model[run.model].append(run)
        self.results_by_run: dict[str, list[Result]] = defaultdict(list)
        for result in data.results:
            self.results_by_run[result.run_id].append(result)
        self.slugs = {model: model_slug(model) for model in self.runs_by_model}
        clash = len(set(self.slugs.values())) != len(self.slugs)
        if clash:  # only a sha256 prefix collision could do this; refuse rather than overwrite a page
            raise RuntimeError("two model keys share a page slug")

    # ---------------------------------------------------------------------------------- lists

    @functools.cached_property
    def boards(self) -> tuple[Board, ...]:
        return build_boards(self.data)

    @functools.cached_property
    def gpus(self) -> list[str]:
        """Every GPU key with a board, in page order (CPU test timings last): `build_boards` makes one per
        (GPU, bench) with a result on the board. Cached: model pages sort by it once per result."""
        return gpu_order(r.gpu for r in self.data.results if not r.off_board)

    @property
    def models(self) -> list[str]:
        """Every model key that has a run: AI models by display name, then house rows."""
        def key(model: str) -> tuple:
            latest = max(self.runs_by_model[model], key=lambda r: r.run_id)
            return (latest.is_house, latest.model_display.casefold(), model)
        return sorted(self.runs_by_model, key=key)

    def _display(self, model: str) -> str:
        return max(self.runs_by_model[model], key=lambda r: r.run_id).model_display

    # ------------------------------------------------------------------------------- GPU page

    def _line(self, board: Board, row: Row) -> BoardLine:
        graded = [(self.data.runs[r.run_id], r) for r in self.data.results
                  if r.gpu == board.gpu and not r.off_board and self.data.runs[r.run_id].model == row.model
                  and self.data.runs[r.run_id].bench == board.bench]
        passes = [c for c in row.cells if c is not None and c.state == "pass"]
        speedups = [c.result.headline_speedup for c in passes if c.result.headline_speedup is not None]
        roofs = [c.result.peak_fraction for c in passes if c.result.peak_fraction is not None]
        return BoardLine(
            row=row,
            slug=self.slugs[row.model],
            lab=_lab([run for run, _ in graded]),
            n_problems=len(board.problems),
            geomean_speedup=geomean(speedups) if speedups else None,
            mean_roofline=sum(roofs) / len(roofs) if roofs and board.gpu != CPU_KEY else None,
            output_tokens=_total([run.output_tokens for run, _ in graded]),
            cost_usd=_total([run.cost_usd for run, _ in graded]),
            n_runs=len(graded),
        )

    def gpu(self, gpu: str) -> dict[str, Any]:
        label = gpu_label(self.data, gpu)
        boards = [b for b in self.boards if b.gpu == gpu]
        return {
            "title": f"{label} leaderboard",
            "gpu": gpu,
            "label": label,
            "is_cpu": gpu == CPU_KEY,
            "hardware": self.data.hardware.get(gpu),
            "boards": [GpuBoard(b, tuple(self._line(b, row) for row in b.rows)) for b in boards],
            "ordering_rule": ORDERING_RULE,
            "other_gpus": [(g, gpu_label(self.data, g)) for g in self.gpus if g != gpu],
            "charts": False,
        }

    # ---------------------------------------------------------------------------- models index

    def index(self) -> dict[str, Any]:
        entries = []
        for model in self.models:
            runs = self.runs_by_model[model]
            latest = max(runs, key=lambda r: r.run_id)
            gpus = gpu_order(r.gpu for run in runs for r in self.results_by_run[run.run_id])
            entries.append({
                "model": model,
                "slug": self.slugs[model],
                "display": latest.model_display,
                "tag": latest.house_tag,
                "lab": _lab(runs),
                "harnesses": sorted({r.harness for r in runs}),
                "runs": len(runs),
                "dnfs": sum(1 for run in runs for r in self.results_by_run[run.run_id] if r.status == "dnf"),
                "gpus": [(g, gpu_label(self.data, g)) for g in gpus],
            })
        return {"title": "Models", "entries": entries, "charts": False}

    # ------------------------------------------------------------------------------ model page

    def model(self, model: str) -> dict[str, Any]:
        runs = sorted(self.runs_by_model[model], key=lambda r: r.run_id)
        latest = runs[-1]
        notes = self.data.annotations
        sections = []
        for board in tab_order(self.boards):  # as the home page's tabs run: ours first, then the imported
            row = next((r for r in board.rows if r.model == model), None)
            if row is None:
                continue
            ranked = sum(1 for r in board.rows if r.rank is not None)
            sections.append({
                "board": board,
                "measured": MeasuredBy.of_board(board),
                "row": row,
                "ranked": ranked,
                "cards": list(zip(board.problems, row.cells, strict=True)),
            })
        attempts = []
        for run in runs:
            results = sorted(self.results_by_run[run.run_id], key=lambda r: gpu_order(self.gpus).index(r.gpu))
            for result in results:
                attempts.append({"entry": Entry(run, result, run.model_display, notes.get(run.run_id)),
                                 "gpu_label": gpu_label(self.data, result.gpu)})
            if not results:
                attempts.append({"entry": None, "run": run, "annotation": notes.get(run.run_id)})
        return {
            "title": latest.model_display,
            "model": model,
            "display": latest.model_display,
            "tag": latest.house_tag,
            "lab": _lab(runs),
            "harnesses": sorted({r.harness for r in runs}),
            "efforts": sorted({r.effort for r in runs if r.effort}),
            "n_runs": len(runs),
            "sections": sections,
            "compare": self._compare(model),
            "attempts": attempts,
            "charts": False,
        }

    def _compare(self, model: str) -> dict[str, Any] | None:
        """Problem × GPU of the model's cells (GPUs only: CPU test timings are never compared). Each pass
        carries its share of the row's best speedup, drawn as a bar, so the GPU where the model does worse
        stands out at a glance; a last row per bench gives the board score and rank on each GPU."""
        cells: dict[tuple[str, str], dict[str, Cell | None]] = defaultdict(dict)
        problems: dict[tuple[str, str], Problem] = {}
        standing: dict[str, dict[str, tuple[Row, int]]] = defaultdict(dict)  # bench -> gpu -> (row, ranked)
        gpus = []
        for board in self.boards:
            row = next((r for r in board.rows if r.model == model), None)
            if row is None or board.is_cpu:
                continue
            if board.gpu not in gpus:
                gpus.append(board.gpu)
            standing[board.bench][board.gpu] = (row, sum(1 for r in board.rows if r.rank is not None))
            for problem, cell in zip(board.problems, row.cells, strict=True):
                key = (problem.bench, problem.name)
                problems[key] = problem
                cells[key][board.gpu] = cell
        if not gpus:
            return None
        rows = []
        for key in sorted(problems):
            line = [cells[key].get(g) for g in gpus]
            best = max((c.result.headline_speedup or 0.0 for c in line if c is not None and c.state == "pass"),
                       default=0.0)
            # a pass without a speedup (an imported one whose source published no baselines) gets no bar
            rows.append((problems[key], [
                (c, c.result.headline_speedup / best if c is not None and c.state == "pass" and best
                 and c.result.headline_speedup is not None else None) for c in line]))
        return {
            "gpus": [(g, gpu_label(self.data, g)) for g in gpus],
            "rows": rows,
            "standing": [(bench, [standing[bench].get(g) for g in gpus]) for bench in sorted(standing)],
        }

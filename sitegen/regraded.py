"""How far a figure moves when kernelboard times the same kernel again: the methodology page's "Graded again".

A board shows each run's latest grading; `data/regrades.parquet` (`eval/regrades.py`) keeps, shape by shape,
the median it replaced. Split by what set each figure: a shape the GPU's own span set in both gradings is the
kernel's time and should come back within a few per cent on another host and day; a shape the host set (its
least dispatch, or a synchronise after each call) carries that host, and the run page marks it host-bound.
The reader sees both spreads, measured on the board's own kernels, and the largest moves with their runs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from .load import SiteData

#: How many of the largest moves the page lists.
LARGEST = 8


@dataclass(frozen=True)
class Spread:
    """Medians after ÷ before of a set of shapes graded again."""

    count: int
    median: float
    within_2: int  # within ±2%
    within_5: int
    least: float
    most: float

    @classmethod
    def of(cls, ratios: list[float]) -> Spread | None:
        if not ratios:
            return None
        return cls(len(ratios), statistics.median(ratios), sum(abs(r - 1) <= 0.02 for r in ratios),
                   sum(abs(r - 1) <= 0.05 for r in ratios), min(ratios), max(ratios))


@dataclass(frozen=True)
class Move:
    """One shape graded again: both medians, both graders, what set each."""

    gpu: str
    run_id: str
    shape_idx: int
    before_ms: float
    before_grader: str
    before_set_by: str
    after_ms: float
    after_grader: str
    after_set_by: str
    linked: bool  # the run has a result on this GPU's board, so its page exists

    @property
    def ratio(self) -> float:
        return self.after_ms / self.before_ms

    @property
    def size(self) -> float:
        """How far it moved, either way: |log(after ÷ before)|."""
        return abs(math.log(self.ratio))

    @property
    def set_by_gpu(self) -> bool:
        return self.before_set_by == self.after_set_by == "gpu"


@dataclass(frozen=True)
class GpuRegrades:
    gpu: str
    runs: int  # runs with a shape graded again
    by_gpu: Spread | None  # shapes the GPU's span set in both gradings
    by_host: Spread | None  # shapes the host set in either


@dataclass(frozen=True)
class Regraded:
    gpus: tuple[GpuRegrades, ...]
    largest: tuple[Move, ...]  # by |log(after ÷ before)|, the largest first
    largest_by_gpu: Move | None  # the largest move of a shape the GPU's span set in both


def regraded(data: SiteData) -> Regraded:
    """The section's figures from the data's regrades, per GPU, in the boards' GPU order."""
    shown = {(r.run_id, r.gpu) for r in data.results}
    moves = [_move(row, (row["run_id"], row["gpu"]) in shown) for row in data.regrades]
    gpus = []
    for gpu in sorted({m.gpu for m in moves}):
        mine = [m for m in moves if m.gpu == gpu]
        gpus.append(GpuRegrades(gpu, len({m.run_id for m in mine}),
                                Spread.of([m.ratio for m in mine if m.set_by_gpu]),
                                Spread.of([m.ratio for m in mine if not m.set_by_gpu])))
    by_gpu = [m for m in moves if m.set_by_gpu]
    return Regraded(tuple(gpus), tuple(sorted(moves, key=lambda m: m.size, reverse=True)[:LARGEST]),
                    max(by_gpu, key=lambda m: m.size) if by_gpu else None)


def _move(row: dict[str, Any], linked: bool) -> Move:
    return Move(row["gpu"], row["run_id"], row["shape_idx"], row["before_median_ms"], row["before_grader"],
                row["before_set_by"], row["after_median_ms"], row["after_grader"], row["after_set_by"], linked)

"""Pure arithmetic of the scores: achieved rates, roofline fractions, speedups and geomeans.

No I/O and no silent zeros: a non-positive time or peak is an error, and a geomean never drops
a value it cannot take the log of.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def tflop_s(flops: float, ms: float) -> float:
    """Achieved TFLOP/s (10^12 FLOP per second) for `flops` done in `ms` milliseconds."""
    return flops / (_positive("time in ms", ms) * 1e-3) / 1e12


def gb_s(bytes_moved: float, ms: float) -> float:
    """Achieved GB/s (10^9 bytes per second) for `bytes_moved` in `ms` milliseconds."""
    return bytes_moved / (_positive("time in ms", ms) * 1e-3) / 1e9


def speedup(baseline_ms: float, solution_ms: float) -> float:
    """How many times faster the solution is than the baseline: baseline time / solution time."""
    return _positive("baseline time in ms", baseline_ms) / _positive("solution time in ms", solution_ms)


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive values; raises on an empty list or a non-positive value."""
    logs = [math.log(_positive("a geomean term", v)) for v in values]
    if not logs:
        raise ValueError("geomean of no values")
    return math.exp(sum(logs) / len(logs))


@dataclass(frozen=True)
class Roofline:
    """Where one timing sits against a GPU's peaks."""

    tflop_s: float
    gb_s: float
    compute_fraction: float
    memory_fraction: float
    bound: str  # the problem's regime: which fraction is the score

    @property
    def peak_fraction(self) -> float:
        return self.compute_fraction if self.bound == "compute" else self.memory_fraction


def roofline(flops: float, bytes_moved: float, ms: float, peak_tflop_s: float, peak_gb_s: float,
             regime: str) -> Roofline:
    """Achieved rates and their fractions of the peaks; `regime` picks which fraction scores.

    Fractions are not clamped at 1: a value above 1 means the peak or the byte count is wrong,
    or the timing escaped the L2 flush, and it must stay visible.
    """
    if regime not in ("compute", "memory"):
        raise ValueError(f"regime must be 'compute' or 'memory', got {regime!r}")
    t, g = tflop_s(flops, ms), gb_s(bytes_moved, ms)
    return Roofline(t, g, t / _positive("peak TFLOP/s", peak_tflop_s), g / _positive("peak GB/s", peak_gb_s),
                    regime)

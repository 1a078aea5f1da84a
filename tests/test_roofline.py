"""Score arithmetic: no silent zeros, no clamping, units as documented."""

from __future__ import annotations

import math

import pytest

from kernelboard.eval.hardware import GPUS, gpu_key
from kernelboard.eval.roofline import gb_s, geomean, roofline, speedup, tflop_s


def test_units() -> None:
    assert tflop_s(2e12, 1000.0) == pytest.approx(2.0)  # 2e12 FLOP in 1 s
    assert gb_s(4.8e9, 1.0) == pytest.approx(4800.0)  # 4.8 GB in 1 ms = 4.8 TB/s


def test_geomean_and_speedup() -> None:
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert speedup(2.0, 0.5) == 4.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_non_positive_values_raise_instead_of_scoring_zero(bad: float) -> None:
    with pytest.raises(ValueError):
        geomean([1.0, bad])
    with pytest.raises(ValueError):
        speedup(1.0, bad)


def test_roofline_is_not_clamped_and_picks_the_regime() -> None:
    h200 = GPUS["h200"]
    r = roofline(1e9, 9.6e9, 1.0, h200.peak("bf16"), h200.bandwidth_gb_s, "memory")
    assert r.peak_fraction == r.memory_fraction == pytest.approx(2.0)  # above 1 stays visible
    with pytest.raises(KeyError, match="no datasheet peak for precision 'fp4'"):
        h200.peak("fp4")


@pytest.mark.parametrize(("name", "key"), [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA B200", "b200"), ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000"),
    ("Some New GPU 9000", "some-new-gpu-9000"),
])
def test_gpu_keys(name: str, key: str) -> None:
    assert gpu_key(name) == key

"""bench/idle_latency.py: its lines name every figure it measured, and a machine without a GPU gets one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import idle_latency
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return idle_latency


def test_the_lines_give_every_gap_of_both_kernels() -> None:
    mod = _module()
    figures = {"device": "NVIDIA H200", "sm_clock_before": "345 MHz, 1980 MHz", "sm_clock_after": None,
               "two_synchronises_us": 41.2, "one_synchronise_us": 19.9, "tiny_dispatch_us": 5.1,
               "tiny_from_idle_us": 33.3}
    for name, warm in (("matmul", 29.0), ("copy", 27.5)):
        figures[f"{name}_warm_us"] = warm
        for k, gap in enumerate(mod.GAPS_MS):
            figures[f"{name}_idle_{gap:g}ms_events_us"] = warm + 10 * k
            figures[f"{name}_idle_{gap:g}ms_host_us"] = warm + 50 + 10 * k
    lines = mod.describe(figures)
    assert all(line.startswith("idle latency: ") for line in lines)
    assert "345 MHz, 1980 MHz before, ? after" in lines[0]
    assert "41.2 µs" in lines[1] and "19.9 µs" in lines[1]
    assert "5.1 µs while the GPU is busy, 33.3 µs from an idle GPU" in lines[2]
    matmul = next(line for line in lines if "matmul" in line)
    assert "29.0 µs warm" in matmul and "20 ms 59.0 µs (109.0 µs to the synchronise)" in matmul


def test_no_gpu_is_one_line() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "idle_latency.py")], capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["idle_latency.py: needs a CUDA GPU; this machine has none"]

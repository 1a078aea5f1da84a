"""bench/witness_ratios.py: the GPU witness's ratios read back from grading logs, in the words the judge writes
them (gpu_witness.describe and doubt), so a change of wording fails here rather than leave the census empty."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kernelboard.eval import gpu_witness
from kernelboard.eval.settings import WITNESS_GPU_FACTOR

ROOT = Path(__file__).resolve().parents[1]


def _line(shape: int, timed_ms: float, spans: list[float], nulls: list[float]) -> str:
    """A worker's log line for one witnessed shape, as judge._witness writes it."""
    fig = gpu_witness.figures(spans, nulls, own_ms=min(nulls))  # the null not capped
    doubt = gpu_witness.doubt(timed_ms, fig)
    text = f"shape {shape}: {gpu_witness.describe(timed_ms, fig)}" + (f"; {doubt}" if doubt else "")
    return f"[worker] {text} (+12.3 s)\n"


def test_the_census_reads_the_judges_lines_and_lists_the_lowest(tmp_path: Path) -> None:
    logs = tmp_path / "res" / "h100-sxm" / "logs"
    logs.mkdir(parents=True)
    # an honest shape (a call of 0.12 ms timed at 0.12 ms), a clock that halves its events, a short call
    (logs / "run_a.log").write_text("[worker] 4 shapes\n" + _line(0, 0.1229, [0.6289] * 5, [0.5060] * 5)
                                    + _line(1, 0.0612, [0.6289] * 5, [0.5060] * 5))
    (logs / "run_b.log").write_text(_line(0, 0.0195, [0.3809] * 5, [0.3614] * 5))
    (logs / "run_b.prebuild.log").write_text(_line(0, 0.01, [0.6289] * 5, [0.5060] * 5))  # never read
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import witness_ratios
    finally:
        sys.path.remove(str(ROOT / "bench"))
    rows = witness_ratios.read([tmp_path / "res"])
    assert sorted((r.run, r.shape) for r in rows) == [("run_a", 0), ("run_a", 1), ("run_b", 0)]
    lowest = min(rows, key=lambda r: r.ratio)
    assert (lowest.run, lowest.shape) == ("run_a", 1) and lowest.ratio < WITNESS_GPU_FACTOR

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "witness_ratios.py"), str(tmp_path / "res")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3 witnessed shapes in 2 gradings" in proc.stdout
    assert "2 shapes, min 0.50" in proc.stdout and "1 under 0.75" in proc.stdout  # the note's range
    assert "call < 0.05 ms: 1 shapes" in proc.stdout


def test_logs_without_a_witnessed_shape_say_so_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "run.log").write_text("[worker] shape 0 median 0.1 ms × 2000 (+3.0 s)\n")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "witness_ratios.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no witnessed shape" in proc.stderr and "Traceback" not in proc.stderr

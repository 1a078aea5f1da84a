"""`kernelboard eval --gpus`: one grader per device, problems spread across them, one merged folder.

The end-to-end test runs on the CPU (two child processes with their own CUDA_VISIBLE_DEVICES, as
on a two-GPU host); what a GPU adds (the per-device lock, real devices) is the same code path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from grading import REEXPORT, copy_deck, write_submission

from kernelboard.eval.parallel import child_folder, spread
from kernelboard.eval.tables import load_all

REAL = Path(__file__).resolve().parents[1] / "data" / "results"
TOPK, W4 = "05_topk_bitonic", "07_w4a16_gemm"


def test_problems_are_spread_whole_and_balanced_by_runs() -> None:
    runs = Counter({"06": 3, "01": 2, "02": 2, "03": 3, "05": 2, "07": 4})
    bins = spread(runs, 2)
    assert sorted(p for b in bins for p in b) == sorted(runs)  # each problem on exactly one device
    assert sorted(sum(runs[p] for p in b) for b in bins) == [8, 8]
    assert spread(Counter({"06": 1}), 3) == [["06"], [], []]


def test_two_devices_grade_in_parallel_into_one_folder(tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (TOPK, W4))
    runs = {f"20261130_000000_t_a_{TOPK}": TOPK, f"20261130_000000_t_b_{W4}": W4,
            f"20261130_000100_t_c_{W4}": W4}
    for run_id, problem in runs.items():
        write_submission(tmp_path / "subs" / run_id, problem, REEXPORT)
    out = tmp_path / "results"
    leftover = child_folder(out, "7")  # an interrupted run on other devices left a graded folder behind
    shutil.copytree(REAL, leftover)
    cmd = [sys.executable, "-m", "kernelboard.cli", "eval", "--device", "cpu", "--gpus", "a,b",
           "--deck", str(deck), "--submissions", str(tmp_path / "subs"), "--out", str(out),
           "--skip-baseline", "compile:max-autotune"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stderr  # read as printed: the consoles never wrap (soft_wrap), whatever the path length
    assert f"merged {leftover}," in said
    assert "GPU a: 2 runs of 07_w4a16_gemm" in said and "GPU b: 1 run of 05_topk_bitonic" in said
    tables = load_all(out)
    graded = {r["run_id"]: r["status"] for r in tables["results"].to_pylist() if r["gpu"] == "cpu"}
    assert set(graded) == set(runs), graded
    assert graded[f"20261130_000000_t_b_{W4}"] == "pass"
    committed = load_all(REAL)["results"].num_rows
    assert tables["results"].num_rows == committed + len(runs)  # the leftover's rows were kept
    assert {r["problem"] for r in tables["baselines"].to_pylist() if r["gpu"] == "cpu"} == {TOPK, W4}
    assert all((out / "cpu" / "logs" / f"{run_id}.log").exists() for run_id in runs)
    assert not any(p.name.startswith(f".{out.name}.gpu") for p in tmp_path.iterdir())  # children cleaned up

"""`kernelboard eval --gpus`: baselines measured once per GPU model, then the runs spread over one
grader per device, one merged folder.

The end-to-end tests run on the CPU (child processes with their own CUDA_VISIBLE_DEVICES, as on a
two-GPU host); what a GPU adds (the per-device lock, real devices) is the same code path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from grading import REEXPORT, copy_deck, write_submission

from kernelboard.eval.parallel import child_folder, spread, spread_runs
from kernelboard.eval.tables import load_all

REAL = Path(__file__).resolve().parents[1] / "data" / "results"
TOPK, W4 = "05_topk_bitonic", "07_w4a16_gemm"


def test_problems_are_spread_whole_and_balanced_by_runs() -> None:
    runs = Counter({"06": 3, "01": 2, "02": 2, "03": 3, "05": 2, "07": 4})
    bins = spread(runs, 2)
    assert sorted(p for b in bins for p in b) == sorted(runs)  # each problem on exactly one device
    assert sorted(sum(runs[p] for p in b) for b in bins) == [8, 8]
    assert spread(Counter({"06": 1}), 3) == [["06"], [], []]


def test_runs_of_one_problem_are_spread_over_the_devices_by_cost() -> None:
    runs = [(f"r{i}", "02", 1.0) for i in range(5)] + [("s0", "07", 4.0), ("d0", "02", 0.0)]
    bins = spread_runs(runs, 2)
    assert sorted(r for b in bins for r in b) == sorted(r for r, *_ in runs)
    assert bins == [["s0", "r4"], ["r0", "r1", "r2", "r3", "d0"]]  # costs 5 and 4; the free run to the lighter
    even = spread_runs([(f"r{i}", "02", 1.0) for i in range(4)], 2)
    assert even == [["r0", "r2"], ["r1", "r3"]]  # one problem, both devices
    whole = spread_runs(runs, 2, frozenset({"02"}))  # its baselines still to measure: one device measures them
    assert any(set(b) == {"r0", "r1", "r2", "r3", "r4", "d0"} for b in whole)


@pytest.mark.slow  # `kernelboard eval --gpus` end to end
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
    measuring = [line for line in said.splitlines() if line.startswith("measuring baselines for ")]
    assert len(measuring) == 2 and {TOPK, W4} == {line.split()[3] for line in measuring}, said  # one GPU each
    # three runs: two on one GPU, one on the other (which gets which follows the problems' costs,
    # medians of the grade times in the leftover's committed rows)
    per_gpu = dict(re.findall(r"^GPU ([ab]): (\d+) runs? \(", said, re.MULTILINE))
    assert sorted(per_gpu.values()) == ["1", "2"] and set(per_gpu) == {"a", "b"}, said
    tables = load_all(out)
    graded = {r["run_id"]: r["status"] for r in tables["results"].to_pylist() if r["gpu"] == "cpu"}
    assert set(graded) == set(runs), graded
    assert graded[f"20261130_000000_t_b_{W4}"] == "pass"
    committed = load_all(REAL)["results"].num_rows
    assert tables["results"].num_rows == committed + len(runs)  # the leftover's rows were kept
    assert {r["problem"] for r in tables["baselines"].to_pylist() if r["gpu"] == "cpu"} == {TOPK, W4}
    assert all((out / "cpu" / "logs" / f"{run_id}.log").exists() for run_id in runs)
    assert not any(p.name.startswith(f".{out.name}.gpu") for p in tmp_path.iterdir())  # children cleaned up


def _eval_on_two(tmp_path: Path, deck: Path, *more: str) -> str:
    cmd = [sys.executable, "-m", "kernelboard.cli", "eval", "--device", "cpu", "--gpus", "0,1", "--deck", str(deck),
           "--submissions", str(tmp_path / "subs"), "--out", str(tmp_path / "results"), *more]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.slow  # `kernelboard eval --gpus` end to end, twice
def test_one_problem_is_graded_on_both_devices_with_its_baselines_measured_once(tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, (TOPK,))
    first = [f"20261130_00000{i}_t_{i}_{TOPK}" for i in range(2)]
    for run_id in first:
        write_submission(tmp_path / "subs" / run_id, TOPK, REEXPORT)
    said = _eval_on_two(tmp_path, deck)
    assert said.count(f"measuring baselines for {TOPK} on GPU ") == 1, said
    assert "GPU 0: 1 run (1 of 05_topk_bitonic)" in said and "GPU 1: 1 run (1 of 05_topk_bitonic)" in said, said
    out = tmp_path / "results"
    log = next((out / "cpu" / "logs").glob(f"baselines-*{TOPK}.log")).read_text()
    assert log.count("\n=== ") + log.startswith("=== ") == 1, log  # one measuring run: none in the grading children
    stamps = {r["measured_at"] for r in load_all(out)["baselines"].to_pylist()}
    assert len(stamps) <= 2  # one run's rows (a second at most between its first and last)
    graded = {r["run_id"]: r["status"] for r in load_all(out)["results"].to_pylist()}
    assert set(graded) == set(first)  # graded (the re-exported reference uses a forbidden op: no matter)

    write_submission(tmp_path / "subs" / f"20261130_000009_t_9_{TOPK}", TOPK, REEXPORT)
    again = _eval_on_two(tmp_path, deck, "--resume")  # cached: nothing measured, the new run graded
    assert "measuring baselines" not in again and "baselines of 1 problem cached for" in again, again
    assert {r["measured_at"] for r in load_all(out)["baselines"].to_pylist()} == stamps
    assert load_all(out)["results"].num_rows == 3
    assert not any(p.name.startswith(".results.gpu") for p in tmp_path.iterdir())

"""bench/regrade_seed.py: a seed without the runs to grade again (their results and shape rows), and their list,
read from the committed boards: the passes whose figure the grading host set, or the runs named."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path

from kernelboard.eval import regrades
from kernelboard.eval.settings import graded_before
from kernelboard.eval.tables import read_table, table_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "data" / "results"
_SPEC = importlib.util.spec_from_file_location("regrade_seed", ROOT / "bench" / "regrade_seed.py")
assert _SPEC is not None and _SPEC.loader is not None
_TOOL = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_TOOL)
FLOOR_MARGIN = regrades.FLOOR_MARGIN  # a covered shape within it of its span is the GPU's own time


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "regrade_seed.py"), *args], capture_output=True,
                          text=True, timeout=300)


def test_the_host_floor_passes_leave_the_seed_and_nothing_else_does(tmp_path: Path) -> None:
    named = "20260620_144620_kimi-claude_kimi-k2.7-code_03_paged_attention"  # graded by 0.5.30
    done = _run("--seed", str(RESULTS), "--gpu", "h100-sxm", "--host-floor", "--before", "0.5.30", "--run", named,
                "--out", str(tmp_path / "seed.tgz"), "--ids", str(tmp_path / "ids.txt"))
    assert done.returncode == 0, done.stderr
    ids = (tmp_path / "ids.txt").read_text().split()
    assert ids[0] == named and len(ids) == len(set(ids)) > 20
    with tarfile.open(tmp_path / "seed.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    seed = tmp_path / "res"
    before = read_table(table_path(RESULTS, "h100-sxm", "results"), "results").to_pylist()
    after = read_table(table_path(seed, "h100-sxm", "results"), "results").to_pylist()
    assert {r["run_id"] for r in before} - {r["run_id"] for r in after} == set(ids)
    graded = {r["run_id"]: r for r in before}
    assert all(graded[i]["status"] == "pass" for i in ids)
    assert all(graded_before(graded[i]["grader_version"], "0.5.30") for i in ids[1:])  # older graders only
    shapes = read_table(table_path(seed, "h100-sxm", "shapes"), "shapes").to_pylist()
    assert not {s["run_id"] for s in shapes} & set(ids)
    for s in read_table(table_path(RESULTS, "h100-sxm", "shapes"), "shapes").to_pylist():
        if s["run_id"] in graded and graded[s["run_id"]]["status"] == "pass" and s["run_id"] not in ids \
                and graded_before(graded[s["run_id"]]["grader_version"], "0.5.30"):
            assert s["timing_method"] == "covered" and s["median_ms"] <= FLOOR_MARGIN * s["gpu_span_ms"], s["run_id"]
    for gpu in ("h200", "b200"):  # the other boards travel as they are
        assert (table_path(seed, gpu, "results").read_bytes() == table_path(RESULTS, gpu, "results").read_bytes())


def test_nothing_chosen_or_no_such_board_is_one_line(tmp_path: Path) -> None:
    none = _run("--seed", str(RESULTS), "--gpu", "h100-sxm", "--out", str(tmp_path / "s.tgz"), "--ids",
                str(tmp_path / "i.txt"))
    assert none.returncode == 1 and "no run chosen" in none.stderr and "Traceback" not in none.stderr
    board = _run("--seed", str(RESULTS), "--gpu", "nope", "--run", "a", "--out", str(tmp_path / "s.tgz"), "--ids",
                 str(tmp_path / "i.txt"))
    assert board.returncode == 1 and "no results table for 'nope'" in board.stderr
    assert not (tmp_path / "s.tgz").exists() and not (tmp_path / "i.txt").exists()

"""bench/regrade_compare.py: the figures of runs graded again, before and after, on the committed H100 SXM rows
with two of them changed as a regrade would change them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from kernelboard.eval import regrades
from kernelboard.eval.tables import read_table, table_path, write_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "data" / "results"
GPU = "h100-sxm"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "regrade_compare.py"), "--gpu", GPU, *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _copy(into: Path) -> Path:
    for name in ("results", "shapes"):
        target = table_path(into, GPU, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(table_path(RESULTS, GPU, name), target)
    return into


def test_a_faster_pass_and_a_changed_verdict_are_reported(tmp_path: Path) -> None:
    old, new = _copy(tmp_path / "old"), _copy(tmp_path / "new")
    path = table_path(new, GPU, "results")
    rows = read_table(path, "results").to_pylist()
    passes = [r for r in rows if r["status"] == "pass" and r["speedup_vs_compile"]]
    faster, failed = passes[0], passes[1]
    faster.update(speedup_vs_compile=faster["speedup_vs_compile"] * 1.5, grader_version="9.9.9")
    failed.update(status="wrong", message="shape 2: a timed call's output differs", grader_version="9.9.9",
                  speedup_vs_compile=None, speedup_vs_eager=None, peak_fraction=None, peak_fraction_measured=None,
                  speedup_vs_baseline=None)
    write_atomic(pa.Table.from_pylist(rows, schema=read_table(path, "results").schema), path)

    done = _run("--old", str(old), "--new", str(new))

    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"{faster['run_id']}: " in out and "(9.9.9), 1.50;" in out
    assert "2 runs graded again on h100-sxm, 1 with another verdict:" in out
    assert f"  {failed['run_id']}: pass (" in out and "-> wrong (9.9.9): shape 2: a timed call's output differs" in out
    assert "speedup after / before, passes 1: median 1.500, least 1.500, most 1.500;" in out
    assert "shape medians after / before, set by the GPU's span in both," in out  # its shapes' medians stayed


def test_a_revision_is_read_from_git_and_a_bad_one_is_one_line() -> None:
    same = _run("--old", "HEAD", "--new", str(RESULTS))
    assert same.returncode == 0, same.stderr
    assert re.search(r"^\d+ runs graded again on h100-sxm, 0 with another verdict$", same.stdout, re.M), same.stdout

    bad = _run("--old", "no-such-revision")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith("regrade_compare: git has no data/results/h100-sxm/results.parquet at no-such-rev")


def test_history_records_every_regrade_git_holds_each_naming_its_revision(tmp_path: Path) -> None:
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], capture_output=True, text=True, cwd=ROOT)
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone (or no git) holds no history of data/results to read")
    table = tmp_path / "regrades.parquet"
    done = _run("--history", "--record", str(table))
    assert done.returncode == 0, done.stderr
    rows = regrades.read_regrades(table)
    assert len(rows) >= 200 and {r["gpu"] for r in rows} == {GPU}
    committed = {(r["run_id"], r["shape_idx"], r["after_graded_at"]) for r in regrades.read_regrades(
        ROOT / "data" / "regrades.parquet") if r["gpu"] == GPU}
    assert {(r["run_id"], r["shape_idx"], r["after_graded_at"]) for r in rows} >= committed  # what data/ holds
    revisions = {r["before_commit"] for r in rows}
    shown = subprocess.run(["git", "cat-file", "--batch-check"], input="".join(f"{c}\n" for c in revisions),
                           capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert shown.count(" commit ") == len(revisions)  # each a commit of this repository
    again = _run("--history", "--record", str(table))
    assert again.stdout.strip().endswith(f"0 shapes graded again added, {len(rows)} in all")


def test_record_needs_a_revision_and_history_needs_record(tmp_path: Path) -> None:
    folder = _run("--old", str(RESULTS), "--record", str(tmp_path / "r.parquet"))
    assert folder.returncode == 1 and folder.stderr.strip() == (
        "regrade_compare: --record needs --old to be a git revision (each row names where its figure before came "
        "from)")
    assert not (tmp_path / "r.parquet").exists()
    bare = _run("--history")
    assert bare.returncode == 1 and "name the table with --record" in bare.stderr

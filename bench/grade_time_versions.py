"""What this grader's checks cost per submission against an earlier grader, measured in one run.

Grades the house kernels of 01 and 07 on the CPU (`kernelboard eval --device cpu`; the
baselines, measured once per grader in round 1, are not part of `grade_seconds`) with this checkout and with the
grader at REF (default: 0cdbf4b, grader 0.2.2, before the sandbox and the judge-side timing
evidence), both against this checkout's deck (the same checks, so only the grader differs),
alternating the two ROUNDS times so load on the machine falls on both alike. The
older grader runs from a copy of REF's tree laid out as the `kernelboard` package and put first
on PYTHONPATH (its editable install's finder comes after the path). Printed per problem: the
median `grade_seconds` of each and their ratio.

    python bench/grade_time_versions.py [REF] [ROUNDS]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
#: The house kernels that Triton's CPU interpreter runs correctly and quickly: 05's takes 12 s a call
#: on its first shape, and 03's returns garbage there (its GPU gradings pass).
RUNS = ["20261129_190000_house_kernelboard-house_01_fp8_gemm",
        "20261130_120000_house_kernelboard-house_07_w4a16_gemm"]


def _package_at(ref: str, root: Path) -> None:
    """REF's tree as an importable `kernelboard` package under root/pkg (package-dir mapping by hand)."""
    tree = root / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pkg = root / "pkg" / "kernelboard"
    shutil.copytree(tree / "kernelboard", pkg)
    shutil.copytree(tree / "eval", pkg / "eval")
    shutil.copytree(tree / "sitegen", pkg / "sitegen")


def _grade(python_path: str | None, deck: Path, out: Path) -> dict[str, float]:
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = python_path
    args = [sys.executable, "-m", "kernelboard.cli", "eval", "--device", "cpu", "--deck", str(deck),
            "--submissions", str(REPO / "data" / "submissions" / "hard"), "--out", str(out)]
    for run in RUNS:
        args += ["--only", run]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=out.parent)
    if proc.returncode != 0:
        raise SystemExit(f"kernelboard eval ({python_path or 'this checkout'}) exited {proc.returncode}: "
                         f"{proc.stderr.strip()[-600:]}")
    rows = pq.read_table(out / "cpu" / "results.parquet").to_pylist()
    for r in rows:
        if r["status"] != "pass":  # compared only where both graders pass
            print(f"  {r['run_id']}: {r['status']} ({r['message'][:120]}) — left out", flush=True)
    return {r["run_id"].rsplit("_house_", 1)[1]: r["grade_seconds"] for r in rows if r["status"] == "pass"}


def main(ref: str = "0cdbf4b", rounds: int = 3) -> None:
    with tempfile.TemporaryDirectory(prefix="kb-bench-") as tmp:
        root = Path(tmp)
        _package_at(ref, root)
        times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
        for r in range(rounds):
            for label, path in (("old", str(root / "pkg")), ("new", None)):
                out = root / label  # kept across rounds: baselines are measured in round 1 only
                print(f"round {r + 1}/{rounds}: grading {len(RUNS)} house kernels with the {label} grader …",
                      flush=True)
                for run, seconds in _grade(path, REPO / "eval" / "decks" / "hard", out).items():
                    times[label].setdefault(run, []).append(seconds)
        print(f"\n{'submission':<45} {ref + ' s':>10} {'this s':>10} {'ratio':>7}")
        ratios = []
        for run in sorted(set(times["new"]) & set(times["old"])):
            old, new = statistics.median(times["old"][run]), statistics.median(times["new"][run])
            ratios.append(new / old)
            print(f"{run:<45} {old:>10.2f} {new:>10.2f} {new / old:>6.3f}×")
        print(f"{'geometric mean':<45} {'':>10} {'':>10} {statistics.geometric_mean(ratios):>6.3f}×")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *[int(a) for a in sys.argv[2:3]])

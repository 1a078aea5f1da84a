"""What the bubblewrap sandbox costs per graded submission, against the same grading without it.

Grades the same committed submissions with the sandbox and with `--unsandboxed`, interleaved
(sandboxed, unsandboxed, sandboxed, …, `--rounds` times), baselines measured once beforehand and
reused, and prints per submission the median grade seconds of each way and their ratio, then the
ratio of the totals. Issue 13 asks for ≤ 1.10.

    python bench/sandbox_overhead.py                       # CPU shapes, two house submissions
    python bench/sandbox_overhead.py --device cuda --only '*house*07*' --rounds 3
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import statistics
import tempfile
from pathlib import Path

from kernelboard.eval.schedule import EvalOptions, run_eval

REPO = Path(__file__).resolve().parents[1]
DECK = REPO / "eval" / "decks" / "hard"
SUBMISSIONS = REPO / "data" / "submissions" / "hard"
DEFAULT = ("20261129_190100_house_reference_01_fp8_gemm", "20261130_031500_house_kernelboard-house_07_w4a16_gemm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", action="append", help="run-id globs (default: two house submissions)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    globs = args.only or list(DEFAULT)
    runs = sorted(p.name for p in SUBMISSIONS.iterdir() if any(fnmatch.fnmatch(p.name, g) for g in globs))
    with tempfile.TemporaryDirectory(prefix="kb-sandbox-bench-") as tmp:
        subs = Path(tmp) / "subs"
        for run in runs:
            shutil.copytree(SUBMISSIONS / run, subs / run)
        out = Path(tmp) / "out"
        common = {"deck": DECK, "submissions": subs, "out": out, "device": args.device, "prebuild": False,
                  "skip_baselines": ("compile:max-autotune",)}
        run_eval(EvalOptions(**common, unsandboxed=True))  # baselines, caches and compiled extensions warm
        seconds: dict[tuple[str, bool], list[float]] = {}
        statuses: dict[tuple[str, bool], set[str]] = {}
        for _ in range(args.rounds):
            for unsandboxed in (False, True):
                for row in run_eval(EvalOptions(**common, unsandboxed=unsandboxed)):
                    key = (row["run_id"], unsandboxed)
                    seconds.setdefault(key, []).append(row["grade_seconds"] or 0.0)
                    statuses.setdefault(key, set()).add(row["status"])
    print(f"\n{'run':60} {'sandboxed s':>12} {'unsandboxed s':>14} {'ratio':>7}  statuses")
    total = [0.0, 0.0]
    for run in runs:
        a, b = (statistics.median(seconds[(run, u)]) for u in (False, True))
        total[0] += a
        total[1] += b
        print(f"{run:60} {a:12.2f} {b:14.2f} {a / b:7.3f}  {sorted(statuses[(run, False)] | statuses[(run, True)])}")
    print(f"{'total (medians)':60} {total[0]:12.2f} {total[1]:14.2f} {total[0] / total[1]:7.3f}")


if __name__ == "__main__":
    main()

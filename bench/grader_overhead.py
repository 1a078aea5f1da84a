"""What grading one submission costs on the CPU, as ratios against baselines run beside it.

Three timings on the deck's CPU shapes, all in fresh temporary folders:
  bare     a subprocess that imports torch and runs the reference once per check the grader makes
           (the least any grader must spend: process start, torch import, the same forward calls);
  first    `kernelboard eval --device cpu` on the reference-as-submission, baselines included;
  cached   the same grading again, baselines reused from the first run's table.
Printed: seconds and the ratios first/bare and cached/bare (grader overhead), first/cached (what
caching the eager and torch.compile baselines saves).

    python bench/grader_overhead.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernelboard.eval.deck import load_problem
from kernelboard.eval.schedule import EvalOptions, run_eval

REPO = Path(__file__).resolve().parents[1]
DECK = REPO / "eval" / "decks" / "hard"
SUBMISSION = REPO / "data" / "submissions" / "hard" / "20261129_190100_house_reference_03_paged_attention"

_BARE = """
import sys, importlib.util, torch
spec = importlib.util.spec_from_file_location("reference", sys.argv[1]); ref = importlib.util.module_from_spec(spec)
sys.modules["reference"] = ref; spec.loader.exec_module(ref)
for params in eval(sys.argv[2]):
    for key, name in eval(sys.argv[3]).items():
        setattr(ref, name, params[key])
    model = ref.Model(*ref.get_init_inputs())
    for seed in range(int(sys.argv[4])):
        torch.manual_seed(seed)
        with torch.no_grad():
            model(*ref.get_inputs())
"""


def bare_seconds() -> float:
    problem = load_problem(DECK / "03_paged_attention")
    calls = len(problem.seeds) + 1  # the grader's seeds, one fresh
    calls *= 1 + len(problem.numeric_stress)
    calls += 3 + 2  # structural cases, timing sets
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", _BARE, str(problem.reference_path),
                    repr([s.params for s in problem.cpu_shapes]), repr(problem.shape_globals), str(calls)],
                   check=True)
    return time.perf_counter() - t


def graded_seconds(subs: Path, out: Path) -> float:
    t = time.perf_counter()
    rows = run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu"))
    if rows[0]["status"] != "pass":
        raise SystemExit(f"the reference did not pass: {rows[0]['message']}")
    return time.perf_counter() - t


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subs = Path(tmp) / "subs"
        shutil.copytree(SUBMISSION, subs / SUBMISSION.name)
        bare = bare_seconds()
        first = graded_seconds(subs, Path(tmp) / "out")
        cached = graded_seconds(subs, Path(tmp) / "out")
    print(f"bare {bare:.1f} s · first {first:.1f} s · cached {cached:.1f} s")
    print(f"grader overhead: first/bare {first / bare:.1f}×, cached/bare {cached / bare:.1f}×; "
          f"baseline cache saves first/cached {first / cached:.1f}×")


if __name__ == "__main__":
    main()

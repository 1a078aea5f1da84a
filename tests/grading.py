"""Grade small sets of generated submissions on the CPU: the one helper the deck and grader tests share.

Batches about their submissions' verdicts, not about measuring baselines, pass the session's
`MeasuredBaselines` (the `measured_baselines` fixture): each Hard problem's CPU baselines are measured
once per test session, by the real grader in a batch of their own (`baselines_only`), and every later
batch of that problem gets them copied into its results folder, where `run_eval` reuses them as it
reuses any cached baselines. Under pytest-xdist the workers share them (a folder and a file lock per
problem), so two workers never measure the same problem twice. Tests about measuring baselines grade
without it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kernelboard.eval.locks import hold
from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import read_table, table_path, upsert

ROOT = Path(__file__).resolve().parents[1]
HARD = ROOT / "eval" / "decks" / "hard"
REEXPORT = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"
#: Candidate code (after `import os, time`) that forks children that sleep until a fork is refused, and says how
#: far it got in `said`: the red-team suites' fork bomb, on the CPU (tests/test_redteam_sandbox.py) and the GPU.
FORK_BOMB = """
children = 0
try:
    for _ in range(5000):
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
        children += 1
except OSError as exc:
    said = f'fork refused after {children} children: {exc.strerror}'
else:
    said = f'forked {children} children'
"""


def write_submission(folder: Path, problem: str, source: str | None, outcome: str = "completed",
                     note: str | None = None) -> Path:
    """A submission folder: solution.py (unless `source` is None) and a minimal run.yaml."""
    folder.mkdir(parents=True)
    if source is not None:
        (folder / "solution.py").write_text(textwrap.dedent(source))
    meta = f"problem: {problem}\nmodel: test-{folder.name}\nharness: pytest\nagent_outcome: {outcome}\n"
    (folder / "run.yaml").write_text(meta + (f"outcome_note: {note}\n" if note else ""))
    return folder


def run_bench_tool(root: Path, tool: str, name: str, source: str, *args: str) -> tuple[dict, str]:
    """A diagnostic of bench/ (TOOL) run on SOURCE as a 07 solution named NAME, in its own process: its --json
    answer and its printout."""
    sub = write_submission(root / name, "07_w4a16_gemm", source)
    out = root / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / tool), str(sub), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def copy_deck(root: Path, problems: Iterable[str]) -> Path:
    """A deck folder under `root` holding copies of these Hard problems only."""
    deck = root / "deck"
    for name in problems:
        shutil.copytree(HARD / name, deck / name)
    return deck


class MeasuredBaselines:
    """CPU baselines of Hard problems, measured once per test session per problem, timing budget and skipped
    variants, kept as a results folder each under `folder` (shared by the session's xdist workers)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def copy_into(self, out: Path, problems: Iterable[str], rep_ms: float | None,
                  skip_baselines: tuple[str, ...] = ()) -> None:
        """Write these problems' baseline rows and logs into the results folder `out`, measuring those that
        this session has not measured yet (one at a time: a second worker waits for the first)."""
        for problem in problems:
            kept = self._measured(problem, rep_ms, skip_baselines)
            rows = read_table(table_path(kept, "cpu", "baselines"), "baselines").to_pylist()
            upsert(table_path(out, "cpu", "baselines"), "baselines", rows)
            (out / "cpu" / "logs").mkdir(parents=True, exist_ok=True)
            for log in (kept / "cpu" / "logs").glob("baselines-*.log"):
                shutil.copyfile(log, out / "cpu" / "logs" / log.name)

    def _measured(self, problem: str, rep_ms: float | None, skip_baselines: tuple[str, ...]) -> Path:
        """The results folder holding this problem's baselines, measured now unless the session has them."""
        key = "-".join([problem, f"rep{rep_ms}", *skip_baselines]).replace(":", "_")
        root = self.folder / key
        with hold(self.folder / f"{key}.lock", f"the test session measuring {key}'s CPU baselines"):
            if not (root / "done").exists():
                shutil.rmtree(root, ignore_errors=True)  # a measurement that failed half-way
                deck = copy_deck(root, (problem,))
                write_submission(root / "subs" / "any", problem, REEXPORT)  # names the problem; never graded
                run_eval(EvalOptions(deck=deck, submissions=root / "subs", out=root / "out", device="cpu",
                                     rep_ms=rep_ms, skip_baselines=skip_baselines, baselines_only=True))
                if not table_path(root / "out", "cpu", "baselines").exists():
                    raise RuntimeError(f"no baselines were measured for {problem} (see {root / 'out'})")
                (root / "done").touch()
        return root / "out"


def grade(root: Path, problems: Iterable[str], submissions: Mapping[str, tuple[str, str | None]],
          baselines: MeasuredBaselines | None = None, **options: Any) -> dict[str, dict]:
    """Grade `{run_id: (problem, source)}` on the CPU against copies of `problems`; rows by run_id.

    With `baselines`, each problem's baselines come from the session's (measured first where this session has
    not measured them yet) instead of being measured in this batch.
    """
    problems = tuple(problems)
    deck = copy_deck(root, problems)
    for run_id, (problem, source) in submissions.items():
        write_submission(root / "subs" / run_id, problem, source)
    opts = {"device": "cpu", "rep_ms": 20.0, **options}
    if baselines is not None:
        baselines.copy_into(root / "out", problems, opts["rep_ms"], tuple(opts.get("skip_baselines", ())))
    rows = run_eval(EvalOptions(deck=deck, submissions=root / "subs", out=root / "out", **opts))
    return {r["run_id"]: r for r in rows}


def judge_out_of_memory(monkeypatch: Any, free_gb: float, judge_gb: float, placed_gb: float, where: str,
                        error: str = "CUDA out of memory.") -> Any:
    """`judge._judge_oom_verdict` on an 85 GB GPU (the H100 80GB HBM3's 79.18 GiB) with the figures the judge
    would measure: `free_gb` free, the judge holding `judge_gb`, the grader's placed sets `placed_gb`."""
    import torch

    from kernelboard.eval import judge
    from kernelboard.eval.plan import ShapePlan
    from kernelboard.eval.problem import Shape

    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (int(free_gb * gb), int(85.02 * gb)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: int(judge_gb * gb))
    plans = [ShapePlan(Shape(0, "headline", {}), [], {}, kept_bytes=int(placed_gb * gb), proof_bytes=0)]
    return judge._judge_oom_verdict(torch.OutOfMemoryError(error), plans, where)

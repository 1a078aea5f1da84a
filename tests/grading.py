"""Grade small sets of generated submissions on the CPU: the one helper the deck and grader tests share.

Batches about their submissions' verdicts, not about measuring baselines, pass the session's
`MeasuredBaselines` (the `measured_baselines` fixture): the first batch of a problem measures its CPU
baselines with the real grader, later batches of that problem reuse them from their results folder as
`run_eval` reuses any cached baselines. Tests about measuring baselines grade without it.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import read_table, table_path, upsert

ROOT = Path(__file__).resolve().parents[1]
HARD = ROOT / "eval" / "decks" / "hard"
REEXPORT = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"


def write_submission(folder: Path, problem: str, source: str | None, outcome: str = "completed",
                     note: str | None = None) -> Path:
    """A submission folder: solution.py (unless `source` is None) and a minimal run.yaml."""
    folder.mkdir(parents=True)
    if source is not None:
        (folder / "solution.py").write_text(textwrap.dedent(source))
    meta = f"problem: {problem}\nmodel: test-{folder.name}\nharness: pytest\nagent_outcome: {outcome}\n"
    (folder / "run.yaml").write_text(meta + (f"outcome_note: {note}\n" if note else ""))
    return folder


def copy_deck(root: Path, problems: Iterable[str]) -> Path:
    """A deck folder under `root` holding copies of these Hard problems only."""
    deck = root / "deck"
    for name in problems:
        shutil.copytree(HARD / name, deck / name)
    return deck


class MeasuredBaselines:
    """CPU baselines measured by the session's grading batches, kept per problem, timing budget and skipped
    variants: a later batch of the same problem gets them copied into its results folder (rows and log)
    before it grades, and `run_eval` reuses them as it reuses any cached baselines."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, float | None, tuple[str, ...]], tuple[list[dict], dict[str, str]]] = {}

    def copy_into(self, out: Path, problems: Iterable[str], rep_ms: float | None,
                  skip_baselines: tuple[str, ...] = ()) -> None:
        """Write the kept baseline rows and logs of these problems (those measured so far) into `out`."""
        for problem in problems:
            if (problem, rep_ms, skip_baselines) not in self._kept:
                continue
            rows, logs = self._kept[problem, rep_ms, skip_baselines]
            upsert(table_path(out, "cpu", "baselines"), "baselines", rows)
            (out / "cpu" / "logs").mkdir(parents=True, exist_ok=True)
            for name, text in logs.items():
                (out / "cpu" / "logs" / name).write_text(text)

    def keep(self, out: Path, rep_ms: float | None, skip_baselines: tuple[str, ...] = ()) -> None:
        """Keep the baselines a batch measured into `out`, for the problems not kept yet."""
        path = table_path(out, "cpu", "baselines")
        if not path.exists():
            return
        by_problem: dict[str, list[dict]] = {}
        for row in read_table(path, "baselines").to_pylist():
            by_problem.setdefault(row["problem"], []).append(row)
        for problem, rows in by_problem.items():
            logs = {log.name: log.read_text() for log in (out / "cpu" / "logs").glob(f"baselines-*-{problem}.log")}
            self._kept.setdefault((problem, rep_ms, skip_baselines), (rows, logs))


def grade(root: Path, problems: Iterable[str], submissions: Mapping[str, tuple[str, str | None]],
          baselines: MeasuredBaselines | None = None, **options: Any) -> dict[str, dict]:
    """Grade `{run_id: (problem, source)}` on the CPU against copies of `problems`; rows by run_id.

    With `baselines`, a problem whose baselines an earlier batch measured gets them from there instead of
    measuring them again, and those this batch measures are kept for later batches.
    """
    problems = tuple(problems)
    deck = copy_deck(root, problems)
    for run_id, (problem, source) in submissions.items():
        write_submission(root / "subs" / run_id, problem, source)
    opts = {"device": "cpu", "rep_ms": 20.0, **options}
    if baselines is not None:
        baselines.copy_into(root / "out", problems, opts["rep_ms"], tuple(opts.get("skip_baselines", ())))
    rows = run_eval(EvalOptions(deck=deck, submissions=root / "subs", out=root / "out", **opts))
    if baselines is not None:
        baselines.keep(root / "out", opts["rep_ms"], tuple(opts.get("skip_baselines", ())))
    return {r["run_id"]: r for r in rows}

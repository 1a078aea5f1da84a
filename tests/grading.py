"""Grade small sets of generated submissions on the CPU: the one helper the deck and grader tests share."""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kernelboard.eval.schedule import EvalOptions, run_eval

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


def grade(root: Path, problems: Iterable[str], submissions: Mapping[str, tuple[str, str | None]],
          **options: Any) -> dict[str, dict]:
    """Grade `{run_id: (problem, source)}` on the CPU against copies of `problems`; rows by run_id."""
    deck = copy_deck(root, problems)
    for run_id, (problem, source) in submissions.items():
        write_submission(root / "subs" / run_id, problem, source)
    opts = {"device": "cpu", "rep_ms": 20.0, **options}
    rows = run_eval(EvalOptions(deck=deck, submissions=root / "subs", out=root / "out", **opts))
    return {r["run_id"]: r for r in rows}

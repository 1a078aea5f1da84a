"""Problem decks: load a problem or a whole deck, in any format formats.py reads (no torch).

A kernelboard problem folder holds `problem.yaml` (shapes, regime, formulas, tolerances, stress
cases, forbidden substrings; format_native.py), `reference.py` (the oracle, KernelBench-Hard's
module interface) and `README.md` (rendered by the site); formats.py reads two foreign formats into
the same `Problem` (problem.py). This module is the grader's and the site's one entry: the types
are re-exported here, and it depends on the formats, never the other way round.
"""

from __future__ import annotations

from pathlib import Path

from kernelboard.errors import DeckError

from .formats import load_deck_any, load_problem_any
from .problem import (
    DEFAULT_TOLERANCE,
    OUTPUT_RULES,
    Problem,
    Shape,
    StressCase,
    StructuralCase,
    StructuralStress,
    evaluate_formula,
)

__all__ = [
    "DEFAULT_TOLERANCE",
    "OUTPUT_RULES",
    "DeckError",
    "Problem",
    "Shape",
    "StressCase",
    "StructuralCase",
    "StructuralStress",
    "evaluate_formula",
    "load_deck",
    "load_problem",
]


def load_problem(path: Path) -> Problem:
    """Load one problem in any format formats.py reads (a kernelboard or KernelBench-Hard folder,
    a ScalingIntelligence KernelBench file); raise `DeckError` naming the file and key."""
    return load_problem_any(path)


def load_deck(deck_dir: Path) -> dict[str, Problem]:
    """Every problem of a deck, in any format formats.py reads, by name, in natural order (2_ before 10_)."""
    return load_deck_any(deck_dir)

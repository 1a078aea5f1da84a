"""The CUDA-graph replay of a launch-bound shape is a figure beside the latency, never a verdict: a replay
that misses the reference (an empty graph: claude-opus-4-8 07 034935 launches its kernels with `<<<…>>>`
on the legacy default stream, outside the capturing stream) leaves `graph_ms` empty with a note, and the
kernel keeps the verdict its checked and timed calls earned (grader 0.5.9)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kernelboard.eval import judge
from kernelboard.eval.deck import load_problem
from kernelboard.eval.link import Received
from kernelboard.eval.plan import import_file, make_plan
from kernelboard.eval.settings import LAUNCH_BOUND_MS, verdict_superseded

DECK = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "07_w4a16_gemm"


class _Replay:
    """A runner's reply to the "graph" request: replay samples and the graph's output."""

    def __init__(self, output: torch.Tensor) -> None:
        self.error, self.output = None, output

    def outputs(self, refs: list[Any]) -> list[Received]:
        return [Received(self.output, str(refs[0].device), None)]

    def samples(self, key: str) -> list[float]:
        return [0.012, 0.011, 0.013]


class _Link:
    def __init__(self, output: torch.Tensor) -> None:
        self.reply = _Replay(output)

    def ask(self, op: str, what: str, **fields: Any) -> _Replay:
        assert op == "graph" and fields.get("keep_error") is True
        return self.reply


@pytest.fixture(scope="module")
def plan_07() -> tuple[Any, Any]:
    saved = sys.modules.pop("reference", None)
    try:
        problem = load_problem(DECK)
        reference = import_file("reference", problem.reference_path)
        plan = make_plan(problem, reference, problem.shapes_for("cpu")[:1], [42], (1, 2), "cpu")[0]
    finally:
        sys.modules.pop("reference", None)
        if saved is not None:
            sys.modules["reference"] = saved
    return problem, plan


def test_a_replay_that_misses_the_reference_leaves_graph_ms_empty_and_fails_nothing(plan_07) -> None:
    problem, plan = plan_07
    row: dict[str, Any] = {"median_ms": LAUNCH_BOUND_MS / 2}
    empty_graph = torch.zeros_like(plan.timing_refs[0])  # what an empty graph's output holds
    judge._graph_times(_Link(empty_graph), problem, [plan], [row])  # type: ignore[arg-type]
    assert "graph_ms" not in row
    assert row["graph_note"].startswith("not capturable in a CUDA graph: the CUDA-graph replay on input set 0 "
                                        "returned a wrong output")
    assert row["graph_note"].endswith("(its call was right)")


def test_a_replay_that_gives_the_reference_is_timed(plan_07) -> None:
    problem, plan = plan_07
    row: dict[str, Any] = {"median_ms": LAUNCH_BOUND_MS / 2}
    judge._graph_times(_Link(plan.timing_refs[0].clone()), problem, [plan], [row])  # type: ignore[arg-type]
    assert row["graph_ms"] == pytest.approx(0.012) and "graph_note" not in row


def test_the_wrong_verdicts_of_earlier_graders_are_graded_again() -> None:
    message = ("shape 1: the CUDA-graph replay on input set 0 returned a wrong output: 366226 of 393216 elements "
               "out of tolerance (atol=0.1, rtol=0.1)")
    assert verdict_superseded("0.5.8", message, "07_w4a16_gemm")
    assert not verdict_superseded("0.5.9", message, "07_w4a16_gemm")

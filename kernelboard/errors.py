"""The one error hierarchy: user-facing, rendered once by Click, never a traceback for bad input."""

from __future__ import annotations

import click


class KernelboardError(click.ClickException):
    """Root of every error a user can cause; Click prints `Error: <message>` and exits 1."""

    exit_code = 1


class DataError(KernelboardError):
    """A data file breaks the contract. Each problem is one line naming file, row and field."""

    def __init__(self, problems: list[str]) -> None:
        if not problems:
            raise ValueError("DataError needs at least one problem")
        self.problems = problems
        head = problems[0] if len(problems) == 1 else f"{len(problems)} problems in the data:"
        body = "" if len(problems) == 1 else "\n" + "\n".join(f"  {p}" for p in problems)
        super().__init__(head + body)


class DeckError(KernelboardError):
    """A problem deck (problem.yaml, reference.py) is malformed."""


class SubmissionError(KernelboardError):
    """A submission folder (run.yaml, solution.py) is malformed."""


class UsageError(KernelboardError):
    """The command line asks for something that cannot be done; exits 2 like Click's own."""

    exit_code = 2

"""How an agent run ended, read from its trace's error events (never from what the model wrote).

The run's **terminal error** is the last error event after which the model never answered
(`Session.terminal_error`): an API error the harness recorded, or a failure note of the runner.
Its text and code are matched against the rules below, in order; an API error that matches none is
a `provider_error`, a runner note that matches none a `harness_error`.

| outcome | matched in the error's code or text |
| --- | --- |
| credits_exhausted | billing_error, insufficient credits / balance / quota, credit balance, payment required, 402 |
| rate_limited | rate_limit, 429, too many requests, resource exhausted, usage / session limit |
| provider_unavailable | 502 / 503 / 504 / 529, overloaded, unavailable, bad gateway, gateway timeout, |
|  | connection errors, request timed out, no endpoints / providers |
| agent_timeout (runner notes only) | timeout, timed out, exit code 124, time budget |
| early_stop (runner notes only) | max turns, interrupted, aborted, cancelled |

A run that an infrastructure error ended after the solution was already written is graded as it
stands: its outcome is `early_stop` and the note names the error. Without an error: a rebuilt
solution means `completed`; none written means `no_solution`, or `early_stop` when the trace stops
inside a tool call; a solution that cannot be rebuilt with certainty means `solution_unrecoverable`.
"""

from __future__ import annotations

import re

from kernelboard.eval.schema import DNF_OUTCOMES

from .claude_code import ErrorEvent, Session
from .recover import Recovery

_CODES = {
    "rate_limit": "rate_limited",
    "billing_error": "credits_exhausted",
    "authentication_failed": "provider_error",
    "invalid_request": "provider_error",
    "server_error": "provider_error",
}

_RULES: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    ("credits_exhausted", re.compile(
        r"insufficient[_ ]?(credits?|balance|funds|quota)|credit balance|out of credits|billing|payment required|"
        r"\b402\b|exceeded your current quota|quota exceeded|spend(ing)? limit", re.I), False),
    ("rate_limited", re.compile(
        r"rate[_ -]?limit|\b429\b|too many requests|resource[_ ]?exhausted|usage limit|session limit|"
        r"limit reached", re.I), False),
    ("provider_unavailable", re.compile(
        r"\b(502|503|504|529)\b|overloaded|unavailable|bad gateway|gateway time-?out|connection (refused|reset|"
        r"error)|econnreset|etimedout|network error|request timed out|no (endpoints|providers?|allowed providers)",
        re.I), False),
    ("agent_timeout", re.compile(r"time-?out|timed[_ ]out|exit(ed)?( with)?( code| status)? 124|time budget|"
                                 r"wall[- ]?clock limit", re.I), True),
    ("early_stop", re.compile(r"max[_ ]turns|interrupt|abort|cancell?ed", re.I), True),
)


def classify(event: ErrorEvent) -> str:
    """The outcome one error event stands for (see the module table)."""
    if event.kind in _CODES and event.source == "api":
        return _CODES[event.kind]
    text = f"{event.kind} {event.text}"
    for outcome, pattern, notes_only in _RULES:
        if (event.source == "note" or not notes_only) and pattern.search(text):
            return outcome
    return "provider_error" if event.source == "api" or "api" in event.kind.lower() else "harness_error"


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def decide(session: Session, recovery: Recovery) -> tuple[str, str | None]:
    """(agent_outcome, outcome_note) of one run (see the module docstring)."""
    error = session.terminal_error()
    if error is not None:
        outcome = classify(error)
        said = f"{outcome.replace('_', ' ')} ({error.source} event at line {error.line}: {_one_line(error.text)})"
        if recovery.status == "ok":
            if outcome in DNF_OUTCOMES:
                return "early_stop", f"{said}; solution.py was already written, so it is graded as it stands"
            return outcome, f"{said}; graded as it stands"
        if recovery.status == "unrecoverable" and outcome not in DNF_OUTCOMES:
            return "solution_unrecoverable", f"{said}; {recovery.reason}"
        return outcome, said
    if recovery.status == "ok":
        return "completed", None
    if recovery.status == "unrecoverable":
        return "solution_unrecoverable", _one_line(recovery.reason, 300)
    if session.ends_mid_tool_call():
        return "early_stop", "the trace stops inside a tool call, before any solution.py was written"
    return "no_solution", recovery.reason

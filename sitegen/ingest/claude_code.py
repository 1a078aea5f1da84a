"""Reading one agent trace in the Claude-Code session format (one JSON object per line).

What is kept is what the importers need and nothing the model could forge: tool calls with
their results (for solution recovery), token usage summed over the run, timestamps, and the
**error events** (never the model's text, thinking, tool inputs or tool output):

* native Claude Code records: the harness's API-error messages (`isApiErrorMessage`, `error`,
  model `<synthetic>`), and `system` / `result` records that report an error;
* kernelbench.com's exported traces (benchmarks/hard/scripts/traces_to_hf.py in
  Infatoshi/kernelbench.com), which drop all of those: the harness's error message survives only
  as an assistant record with all-zero usage whose one text block starts the way Claude Code's
  own error messages do (`API Error…`, `Credit balance is too low`, `… limit reached`), and a
  harness's error event as a user note `"[error] …"` (OpenCode, Droid) or `"[result] result:
  error"` (Gemini CLI). See docs/traces.md for what the export loses.

Claude Code writes one line per content block of an API message, each repeating that message's
usage. Usage is counted once per message: lines with the same message id; or, in exported lines
(whose message id and requestId the exporter makes up per line), a line whose prompt side
(uncached input, cache reads, cache writes) equals the previous usage line's, since the next API
call always sends a longer prompt. Output tokens are the largest value seen per message: Claude
Code may record a partial count on a block's line, and then the sum is a lower bound.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: Runner-note subtypes (the `[subtype]` prefix of a user line) that report a failure.
_ERROR_NOTE = re.compile(r"error|fail|limit|quota|credit|timeout|timed_out|abort|kill|fatal|unavailable|"
                         r"overload|exit|interrupt")
_NOTE = re.compile(r"^\[([A-Za-z_][\w.-]*)\]\s?(.*)", re.DOTALL)
_INIT_FIELD = re.compile(r"\b(model|effort|reasoning_effort|cwd)=(\S+)")
_SYNTHETIC_MODEL = "<synthetic>"
#: How Claude Code's own (synthetic) error messages begin; matched only on an assistant line that
#: the API did not bill (all-zero usage) and that holds a single text block.
_HARNESS_ERROR_TEXT = re.compile(
    r"^(API Error\b|Credit balance (is )?too low|Invalid API key|Prompt is too long|OAuth token|"
    r"Request timed out|Claude AI usage limit reached|[^\n]{0,40}\blimit reached\b)")
#: Gemini CLI's closing `result` record as the exporter writes it: "[result] result: <status>".
_FAILED_RESULT = re.compile(r"result: (error|failure)\b")
#: The prompt side of a usage record: equal on every line of one API message, longer on the next call.
_PROMPT_SIDE = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class TraceFormatError(ValueError):
    """A line of a trace is not what the format promises; carries the 1-based line number."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


@dataclass
class ToolCall:
    """One tool call in trace order, with the result the harness recorded (None: never answered)."""

    id: str
    name: str
    input: dict[str, Any]
    cwd: str | None
    line: int
    result_error: bool | None = None  # None until a tool_result names this call
    result_text: str = ""


@dataclass(frozen=True)
class ErrorEvent:
    """A failure reported by the harness or the runner (never by the model)."""

    source: str  # 'api' (the harness's API-error message or system/result record) or 'note' (runner)
    kind: str  # the `error` code, record subtype or note subtype
    text: str
    line: int


@dataclass
class Session:
    """Everything one trace file says that the importers use."""

    title_model: str | None = None
    title_run_id: str | None = None
    session_id: str | None = None
    cwd: str | None = None
    init: dict[str, str] = field(default_factory=dict)  # model=, effort=, cwd= of the runner's [init] note
    models: list[str] = field(default_factory=list)  # models of real assistant messages, in first-seen order
    timestamps: list[dt.datetime] = field(default_factory=list)
    timestamp_lines: list[int] = field(default_factory=list)  # the 1-based line of each timestamp
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # API message -> max per field
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ErrorEvent] = field(default_factory=list)
    last_assistant_line: int = 0  # line of the last real (non-synthetic) assistant record
    n_lines: int = 0
    _last_usage: tuple[str, tuple[int, ...], bool] | None = None  # key, prompt side, user line since

    # ---------------------------------------------------------------- derived

    def token_totals(self) -> dict[str, int | None]:
        """Tokens summed over every API message: uncached input (cache writes included), output, cache reads."""
        if not self.usage:
            return {"input_tokens": None, "output_tokens": None, "cache_read_tokens": None}
        total = {k: sum(u.get(k, 0) for u in self.usage.values())
                 for k in ("input_tokens", "cache_creation_input_tokens", "output_tokens", "cache_read_input_tokens")}
        return {
            "input_tokens": total["input_tokens"] + total["cache_creation_input_tokens"],
            "output_tokens": total["output_tokens"],
            "cache_read_tokens": total["cache_read_input_tokens"],
        }

    @property
    def exporter_clock(self) -> bool:
        """True when the timestamps are kernelbench.com's exporter's counter, not a clock.

        traces_to_hf.py stamps the record written as line N with the run id's time plus N-1
        seconds (so `timestamp - line` is constant); any other trace is taken as a clock only when
        it has two timestamps that break that pattern. One timestamp or none proves nothing.
        """
        if len(self.timestamps) < 2:
            return True
        bases = {ts - dt.timedelta(seconds=n) for ts, n in zip(self.timestamps, self.timestamp_lines, strict=True)}
        return len(bases) == 1

    @property
    def started_at(self) -> dt.datetime | None:
        """The first timestamp, when the trace has a real clock (`exporter_clock` is False)."""
        return None if self.exporter_clock else self.timestamps[0]

    def wall_seconds(self) -> float | None:
        if self.exporter_clock:
            return None
        return (self.timestamps[-1] - self.timestamps[0]).total_seconds()

    @property
    def model(self) -> str | None:
        """The model the run used: the title's, else the runner's [init] note's, else the API's."""
        init = self.init.get("model")
        return self.title_model or (init if init not in (None, "None") else None) or \
            (self.models[0] if self.models else None)

    def terminal_error(self) -> ErrorEvent | None:
        """The last error event, if the model never answered after it (so it ended the run)."""
        if not self.errors:
            return None
        last = self.errors[-1]
        return last if last.line > self.last_assistant_line else None

    def ends_mid_tool_call(self) -> bool:
        """The trace stops while a tool call is still waiting for its result."""
        return bool(self.tool_calls) and self.tool_calls[-1].result_error is None


def _timestamp(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        ts = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=dt.UTC)


def _text_of(content: Any) -> str:
    """The plain text of a message content (a string or a list of blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict):
                parts.append(str(block.get("text") or block.get("content") or ""))
            elif isinstance(block, str):
                parts.append(block)
        return "\n".join(parts)
    return "" if content is None else str(content)


def parse_lines(lines: Iterable[str]) -> Session:
    """Parse a trace; raise `TraceFormatError` naming the first line that is not a JSON object."""
    session = Session()
    by_id: dict[str, ToolCall] = {}
    for n, raw in enumerate(lines, start=1):
        session.n_lines = n
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(n, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("type"), str):
            raise TraceFormatError(n, "expected a JSON object with a string 'type'")
        _record(session, rec, n, by_id)
    return session


def _record(session: Session, rec: dict[str, Any], n: int, by_id: dict[str, ToolCall]) -> None:
    kind = rec["type"]
    session.session_id = session.session_id or rec.get("sessionId")
    if kind in ("custom-title", "ai-title"):
        title = rec.get("customTitle") or rec.get("aiTitle") or ""
        if " \u00b7 " in title and session.title_model is None:
            session.title_model, session.title_run_id = (s.strip() for s in title.split(" \u00b7 ", 1))
        return
    ts = _timestamp(rec.get("timestamp"))
    if ts is not None:
        session.timestamps.append(ts)
        session.timestamp_lines.append(n)
    if rec.get("cwd") and session.cwd is None:
        session.cwd = rec["cwd"]
    message = rec.get("message") if isinstance(rec.get("message"), dict) else {}
    if kind == "user" and session._last_usage is not None:
        session._last_usage = (*session._last_usage[:2], True)
    if kind == "assistant":
        _assistant(session, rec, message, n, by_id)
    elif kind == "user":
        _user(session, rec, message, n, by_id)
    elif kind == "system" and (rec.get("level") == "error" or "error" in str(rec.get("subtype", ""))):
        text = _text_of(rec.get("content")) or json.dumps(rec.get("error"), sort_keys=True)
        session.errors.append(ErrorEvent("api", str(rec.get("subtype") or "error"), text, n))
    elif kind == "result" and (rec.get("is_error") or str(rec.get("subtype", "")).startswith("error")):
        text = str(rec.get("result") or rec.get("error") or "")
        session.errors.append(ErrorEvent("note", str(rec.get("subtype") or "error"), text, n))


def _assistant(session: Session, rec: dict[str, Any], message: dict[str, Any], n: int,
               by_id: dict[str, ToolCall]) -> None:
    content = message.get("content")
    if rec.get("isApiErrorMessage") or message.get("model") == _SYNTHETIC_MODEL:
        if rec.get("isApiErrorMessage") or rec.get("error"):
            session.errors.append(ErrorEvent("api", str(rec.get("error") or "api_error"), _text_of(content), n))
        return
    exported_error = _exported_harness_error(message)
    if exported_error is not None:
        session.errors.append(ErrorEvent("api", "api_error", exported_error, n))
        return
    session.last_assistant_line = n
    model = message.get("model")
    if isinstance(model, str) and model and model not in session.models:
        session.models.append(model)
    _count_usage(session, rec, message, n)
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_use":
            call = ToolCall(str(block.get("id") or f"line-{n}"), str(block.get("name") or ""),
                            block.get("input") if isinstance(block.get("input"), dict) else {},
                            rec.get("cwd"), n)
            session.tool_calls.append(call)
            by_id[call.id] = call


def _exported_harness_error(message: dict[str, Any]) -> str | None:
    """The text of Claude Code's own error message as kernelbench.com's exporter leaves it, else None.

    The export drops `isApiErrorMessage`, `error` and the `<synthetic>` model, but keeps the
    message's usage, which the API never billed (all zero), and its one text block. A line is
    taken as the harness's only with both, and a text that starts like Claude Code's errors.
    """
    usage, content = message.get("usage"), message.get("content")
    if not isinstance(usage, dict) or any(usage.get(k) for k in (*_PROMPT_SIDE, "output_tokens")):
        return None
    if not (isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
            and content[0].get("type") == "text"):
        return None
    text = str(content[0].get("text") or "")
    return text if _HARNESS_ERROR_TEXT.match(text.lstrip()) else None


def _exported(rec: dict[str, Any]) -> bool:
    """Written by kernelbench.com's exporter, which makes each line's ids up: `requestId` is 'req_' + uuid[:24]."""
    return isinstance(rec.get("uuid"), str) and rec.get("requestId") == f"req_{rec['uuid'][:24]}"


def _count_usage(session: Session, rec: dict[str, Any], message: dict[str, Any], n: int) -> None:
    """Fold one line's usage into its API message's (see the module docstring)."""
    usage = message.get("usage")
    if not isinstance(usage, dict):
        return
    values = {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}
    prompt = tuple(values.get(k, 0) for k in _PROMPT_SIDE)
    identity = None if _exported(rec) else message.get("id") or rec.get("requestId")
    key = str(identity or f"line-{n}")
    last = session._last_usage
    # Without an identity: the same prompt as the previous usage line is the same API message. An
    # all-zero prompt (a provider that does not report it) proves that only when no user line came between.
    if identity is None and last is not None and last[1] == prompt and (any(prompt) or not last[2]):
        key = last[0]
    kept = session.usage.setdefault(key, {})
    for name, value in values.items():
        kept[name] = max(kept.get(name, 0), value)
    session._last_usage = (key, prompt, False)


def _user(session: Session, rec: dict[str, Any], message: dict[str, Any], n: int,
          by_id: dict[str, ToolCall]) -> None:
    content = message.get("content")
    if isinstance(content, str):
        note = _NOTE.match(content)
        if note is None:
            return
        subtype, text = note.group(1), note.group(2)
        if subtype == "init" and not session.init:
            session.init = dict(_INIT_FIELD.findall(text))
        elif _ERROR_NOTE.search(subtype.lower()) or (subtype == "result" and _FAILED_RESULT.match(text)):
            session.errors.append(ErrorEvent("note", subtype, text, n))
        return
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            call = by_id.get(str(block.get("tool_use_id")))
            if call is not None:
                call.result_error = bool(block.get("is_error"))
                call.result_text = _text_of(block.get("content"))

"""Agent traces in the Claude-Code session format, generated for the importer tests.

`Trace` writes Claude Code session lines with a real clock and real message ids: title and mode
headers, then user / assistant records with `cwd`, `uuid`, `timestamp`, `message`; assistant
messages carry `usage`, one line per content block, each repeating its message's usage.
`ExportedTrace` writes exactly what kernelbench.com's exporter (traces_to_hf.py) publishes, which
loses the clock, the message ids and the API-error markers. Everything here is made up for tests
and lives only under pytest's tmp_path.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

CWD = "/workspace/problems/03_paged_attention"
PROBLEM = "03_paged_attention"
SOLUTION = f"{CWD}/solution.py"


class Trace:
    def __init__(self, run_id: str, model: str, start: str = "2026-07-16T02:42:57", cwd: str = CWD,
                 step_seconds: float = 7.0) -> None:
        self.run_id, self.model, self.cwd = run_id, model, cwd
        self.t = dt.datetime.fromisoformat(start).replace(tzinfo=dt.UTC)
        self.step = dt.timedelta(seconds=step_seconds)
        self.n = 0
        self.lines: list[dict[str, Any]] = [
            {"type": "custom-title", "customTitle": f"{model} \u00b7 {run_id}", "sessionId": "s-" + run_id[-8:]},
            {"type": "ai-title", "aiTitle": f"{model} \u00b7 {run_id}", "sessionId": "s-" + run_id[-8:]},
            {"type": "mode", "mode": "normal", "sessionId": "s-" + run_id[-8:]},
        ]
        self.note("init", f"session start cwd={cwd} model={model} permissions=bypassPermissions")
        self.user("Write a fast paged-attention decode kernel in solution.py.")

    def _record(self, kind: str, message: dict[str, Any], **extra: Any) -> None:
        self.n += 1
        self.lines.append({
            "parentUuid": None, "isSidechain": False, "userType": "external", "cwd": self.cwd,
            "sessionId": "s-" + self.run_id[-8:], "version": "2.1.181", "gitBranch": "", "entrypoint": "cli",
            "type": kind, "message": message, "uuid": f"u{self.n}",
            "timestamp": self.t.isoformat().replace("+00:00", ".000Z"), **extra})
        self.t += self.step

    def user(self, text: str) -> None:
        self._record("user", {"role": "user", "content": text}, promptId="p1")

    def note(self, subtype: str, text: str) -> None:
        self.user(f"[{subtype}] {text}")

    def assistant(self, *blocks: dict[str, Any], usage: tuple[int, int, int] = (10, 100, 1000)) -> None:
        """One API message: one line per block, each repeating the message's usage (as Claude Code does)."""
        mid = f"msg_{self.n}"
        u = {"input_tokens": usage[0], "output_tokens": usage[1], "cache_read_input_tokens": usage[2],
             "cache_creation_input_tokens": 0}
        for block in blocks:
            self._record("assistant", {"role": "assistant", "id": mid, "model": self.model, "stop_reason": None,
                                       "type": "message", "content": [block], "usage": u}, requestId="req_" + mid)

    def say(self, text: str, usage: tuple[int, int, int] = (10, 100, 1000)) -> None:
        self.assistant({"type": "text", "text": text}, usage=usage)

    def tool(self, name: str, args: dict[str, Any], result: str = "ok", is_error: bool = False,
             usage: tuple[int, int, int] = (10, 100, 1000), answered: bool = True) -> None:
        tid = f"toolu_{self.n}"
        self.assistant({"type": "tool_use", "id": tid, "name": name, "input": args}, usage=usage)
        if answered:
            self._record("user", {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tid, "content": result, "is_error": is_error}]})

    def api_error(self, text: str, code: str | None = None) -> None:
        self.n += 1
        extra = {"error": code} if code else {}
        self._record("assistant", {"role": "assistant", "id": f"err_{self.n}", "model": "<synthetic>",
                                   "type": "message", "content": [{"type": "text", "text": text}],
                                   "usage": {"input_tokens": 0, "output_tokens": 0}},
                     isApiErrorMessage=True, **extra)

    def text(self) -> str:
        return "".join(json.dumps(line) + "\n" for line in self.lines)

    def write_to(self, folder: Path, board: str = "") -> Path:
        path = folder / board / f"{self.run_id}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text())
        return path


KERNEL_V1 = "import torch\n\nclass Model(torch.nn.Module):\n    def forward(self, q):\n        return q * 1\n"
KERNEL_V2 = KERNEL_V1.replace("q * 1", "q * 2")


def write_fixture_traces(folder: Path) -> dict[str, str]:
    """Six runs covering each way a run can end; returns run_id -> the outcome the importer must find."""
    expected = {}

    t = Trace("20260716_024257_claude_claude-fable-5_03_paged_attention", "claude-fable-5")
    t.say("Reading the problem.", usage=(5, 50, 500))
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1}, "File created successfully")
    t.tool("Edit", {"file_path": SOLUTION, "old_string": "q * 1", "new_string": "q * 3"}, "updated")
    t.tool("Edit", {"file_path": SOLUTION, "old_string": "no such text", "new_string": "x"},
           "<tool_use_error>String to replace not found</tool_use_error>", is_error=True)
    t.tool("MultiEdit", {"file_path": SOLUTION, "edits": [
        {"old_string": "q * 3", "new_string": "q * 2"},
        {"old_string": "import torch\n", "new_string": "import torch  # paged decode\n"}]}, "ok")
    t.say("Done: solution.py is written.")
    t.write_to(folder)
    expected[t.run_id] = "completed"

    t = Trace("20260716_031500_kinetic-claude_kinetic-0715_03_paged_attention", "kinetic-0715")
    t.tool("Bash", {"command": f"cd {CWD} && cat > solution.py <<'EOF'\n{KERNEL_V2}EOF\npython check.py"},
           "FAIL: shape 0", is_error=True)
    t.tool("Bash", {"command": "python check.py 2>&1 | tail -3"}, "PASS")
    t.say("It passes.")
    t.write_to(folder, "h100")
    expected[t.run_id] = "completed"

    t = Trace("20260716_040000_codex_gpt-5.6-sol_03_paged_attention", "gpt-5.6-sol")
    t.tool("apply_patch", {"input": "*** Begin Patch\n*** Add File: solution.py\n"
                           + "".join(f"+{line}\n" for line in KERNEL_V1.splitlines()) + "*** End Patch"}, "Done")
    t.tool("exec_command", {"cmd": "apply_patch <<'PATCH'\n*** Begin Patch\n*** Update File: solution.py\n@@\n"
                            "     def forward(self, q):\n-        return q * 1\n+        return q * 2\n"
                            "*** End Patch\nPATCH"}, "Done")
    t.say("Patched.")
    t.write_to(folder)
    expected[t.run_id] = "completed"

    t = Trace("20260716_050000_zai-claude_glm-5.3_03_paged_attention", "glm-5.3")
    t.say("Let me look at the reference first, then write a rate limit aware plan.")
    t.tool("Read", {"file_path": f"{CWD}/reference.py"}, "import torch ...")
    t.api_error("API Error: 429 {\"type\":\"error\",\"error\":{\"type\":\"rate_limit_error\"}}", "rate_limit")
    t.write_to(folder)
    expected[t.run_id] = "rate_limited"

    t = Trace("20260716_060000_gemini_gemini-3.5-flash_03_paged_attention", "gemini-3.5-flash")
    t.tool("Read", {"file_path": f"{CWD}/reference.py"}, "import torch ...")
    t.say("I would write echo 'rate limit exceeded' > solution.py, but I will stop here.")
    t.write_to(folder)
    expected[t.run_id] = "no_solution"

    t = Trace("20260716_070000_cursor_composer-2.5-fast_03_paged_attention", "composer-2.5-fast")
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1}, "ok")
    t.tool("Bash", {"command": "sed -i 's/q \\* 1/q * 5/' solution.py"}, "")
    t.say("Tuned it with sed.")
    t.write_to(folder)
    expected[t.run_id] = "solution_unrecoverable"
    return expected


# ------------------------------------------------------------------ kernelbench.com's exported traces


class ExportedTrace:
    """A trace as kernelbench.com's exporter writes it: benchmarks/hard/scripts/traces_to_hf.py (same
    file under benchmarks/cuda and benchmarks/mini) in Infatoshi/kernelbench.com at c7d92211, fed by
    its Claude-Code parser (benchmarks/hard/src/viewer/parsers/claude.py).

    What that code writes, and this class copies: three headers (custom-title and ai-title
    "<model> · <run_id>", mode); then one record per parsed event, keys in the exporter's order,
    `parentUuid` chaining each to the one before, a fresh uuid4 as `uuid`, `version` "2.1.181", and
    `timestamp` = the run id's time read in the exporter machine's zone plus the record's line index
    in seconds. Assistant records get a fresh uuid4 `message.id`, `requestId` "req_" + uuid[:24],
    the session's model (never "<synthetic>"), `stop_reason` None and the event's usage; user
    records a fresh `promptId`. One original Claude Code line (one content block) is one event, so
    the blocks of one API message come out as several records that repeat its usage. Harness notes
    are user records "[<subtype or role>] <text>". `isApiErrorMessage`, `error` and `result` records
    are not written at all.
    """

    def __init__(self, run_id: str, model: str, *, exporter_utc_offset_hours: float = -6, cwd: str = CWD,
                 session_id: str = "a2da6559-0b68-41bd-9506-c3382960a423") -> None:
        self.run_id, self.model, self.cwd, self.session_id = run_id, model, cwd, session_id
        local = dt.datetime.strptime(run_id[:15], "%Y%m%d_%H%M%S")
        self.base = local - dt.timedelta(hours=exporter_utc_offset_hours)  # naive UTC, as utcfromtimestamp gives
        self.parent: str | None = None
        self.lines: list[dict[str, Any]] = [
            {"type": "custom-title", "customTitle": f"{model} \u00b7 {run_id}", "sessionId": session_id},
            {"type": "ai-title", "aiTitle": f"{model} \u00b7 {run_id}", "sessionId": session_id},
            {"type": "mode", "mode": "normal", "sessionId": session_id},
        ]
        self.note("init", f"session start  cwd={cwd}  model={model}  permissions=bypassPermissions")
        self.user("I need you to write a fast paged-attention decode kernel in solution.py.")

    def _emit(self, kind: str, message: dict[str, Any]) -> None:
        u = str(uuid.uuid4())
        stamp = (self.base + dt.timedelta(seconds=len(self.lines))).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        rec = {"parentUuid": self.parent, "isSidechain": False, "userType": "external", "cwd": self.cwd,
               "sessionId": self.session_id, "version": "2.1.181", "gitBranch": "", "entrypoint": "cli",
               "type": kind, "message": message, "uuid": u, "timestamp": stamp}
        if kind == "assistant":
            rec["requestId"] = f"req_{u[:24]}"
        else:
            rec["promptId"] = str(uuid.uuid4())
        self.lines.append(rec)
        self.parent = u

    def user(self, text: str) -> None:
        self._emit("user", {"role": "user", "content": text})

    def note(self, label: str, text: str) -> None:
        self.user(f"[{label}] {text}")

    def event(self, *, reasoning: str | None = None, text: str | None = None,
              tool_calls: tuple[tuple[str, str, dict[str, Any]], ...] = (),
              usage: tuple[int, int, int, int] | None = (10, 100, 1000, 0)) -> None:
        """One parsed assistant event (one original line): usage is (input, output, cache read, cache write)."""
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text:
            blocks.append({"type": "text", "text": text})
        for call_id, name, args in tool_calls:
            blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": args})
        msg: dict[str, Any] = {"role": "assistant", "content": blocks, "id": str(uuid.uuid4()), "model": self.model,
                               "stop_reason": None, "type": "message"}
        if usage is not None:
            msg["usage"] = {"input_tokens": usage[0], "output_tokens": usage[1],
                            "cache_read_input_tokens": usage[2], "cache_creation_input_tokens": usage[3]}
        self._emit("assistant", msg)

    def result(self, call_id: str, content: str = "ok", is_error: bool = False) -> None:
        self._emit("user", {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call_id, "content": content, "is_error": is_error}]})

    def api_error(self, text: str) -> None:
        """Claude Code's synthetic error message (model '<synthetic>', usage all zero) after the export."""
        self.event(text=text, usage=(0, 0, 0, 0))

    def text(self) -> str:
        return "\n".join(json.dumps(line) for line in self.lines) + "\n"

    def write_to(self, folder: Path, board: str = "") -> Path:
        path = folder / board / f"{self.run_id}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text())
        return path

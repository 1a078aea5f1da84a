"""Solution recovery and outcome detection on single traces (`ingest.recover`, `shell`, `patch`, `outcome`)."""

from __future__ import annotations

import pytest
from ingest_fixtures import CWD, KERNEL_V1, KERNEL_V2, SOLUTION, Trace

from kernelboard.sitegen.ingest.claude_code import parse_lines
from kernelboard.sitegen.ingest.outcome import decide
from kernelboard.sitegen.ingest.recover import recover
from kernelboard.sitegen.ingest.shell import analyze

RUN = "20260716_024257_claude_claude-fable-5_03_paged_attention"


def _run(t: Trace):
    session = parse_lines(t.text().splitlines())
    recovery = recover(session)
    return session, recovery, decide(session, recovery)


def _trace() -> Trace:
    return Trace(RUN, "claude-fable-5")


def test_write_then_edits_rebuild_the_final_file() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.tool("MultiEdit", {"file_path": SOLUTION, "edits": [{"old_string": "q * 1", "new_string": "q * 7"}]})
    _, rec, (outcome, _) = _run(t)
    assert rec.status == "ok" and rec.files == {"solution.py": KERNEL_V1.replace("q * 1", "q * 7")}
    assert outcome == "completed"


def test_an_edit_the_harness_refused_changes_nothing() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.tool("Edit", {"file_path": SOLUTION, "old_string": "q * 1", "new_string": "BROKEN"}, "error", is_error=True)
    assert _run(t)[1].files["solution.py"] == KERNEL_V1


def test_an_edit_of_text_not_in_the_rebuilt_file_is_unrecoverable() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.tool("Edit", {"file_path": SOLUTION, "old_string": "q * 9", "new_string": "q * 2"})
    _, rec, (outcome, note) = _run(t)
    assert rec.status == "unrecoverable" and outcome == "solution_unrecoverable"
    assert "occurs 0 times" in note


def test_editing_a_file_never_written_in_full_is_unrecoverable() -> None:
    t = _trace()
    t.tool("Edit", {"file_path": SOLUTION, "old_string": "pass", "new_string": "return q"})
    assert "starting content is not in the trace" in _run(t)[2][1]


def test_quoted_heredoc_is_literal_and_unquoted_with_dollar_is_refused() -> None:
    t = _trace()
    t.tool("Bash", {"command": f"cat > {SOLUTION} << 'EOF'\nx = '$HOME'\nEOF"})
    assert _run(t)[1].files["solution.py"] == "x = '$HOME'\n"
    t.tool("Bash", {"command": f"cat > {SOLUTION} <<EOF\nx = '$HOME'\nEOF"})
    assert "expand" in _run(t)[1].reason


def test_a_later_full_write_makes_a_tainted_file_known_again() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.tool("Bash", {"command": "sed -i 's/1/2/' solution.py"})
    t.tool("Bash", {"command": f"cd {CWD}\ntee solution.py <<'EOF' >/dev/null\n{KERNEL_V2}EOF"})
    assert _run(t)[1].files["solution.py"] == KERNEL_V2


def test_copy_from_a_known_scratch_file_is_followed() -> None:
    t = _trace()
    t.tool("Write", {"file_path": "/tmp/try3.py", "content": KERNEL_V2})
    t.tool("Bash", {"command": "cp /tmp/try3.py solution.py && python check.py"}, "PASS")
    assert _run(t)[1].files["solution.py"] == KERNEL_V2


def test_a_generator_script_that_writes_the_solution_taints_it() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.tool("Write", {"file_path": f"{CWD}/gen.py", "content": "open('solution.py', 'w').write(src)\n"})
    t.tool("Bash", {"command": "python gen.py"})
    assert _run(t)[1].status == "unrecoverable"


def test_sidecars_named_by_the_solution_are_kept_and_scratch_files_are_not() -> None:
    t = _trace()
    t.tool("Write", {"file_path": f"{CWD}/kernel.cu", "content": "__global__ void k() {}\n"})
    t.tool("Write", {"file_path": f"{CWD}/bench_me.py", "content": "import solution\n"})
    t.tool("Write", {"file_path": SOLUTION, "content": "SRC = open('kernel.cu').read()\n"})
    assert sorted(_run(t)[1].files) == ["kernel.cu", "solution.py"]


def test_a_sidecar_the_trace_never_wrote_makes_the_solution_unrecoverable() -> None:
    t = _trace()
    t.tool("Bash", {"command": "python make_kernel.py"})
    t.tool("Write", {"file_path": SOLUTION, "content": "load(sources=['fused.cu'])\n"})
    assert "fused.cu" in _run(t)[1].reason


def test_a_write_that_never_got_a_result_is_uncertain() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1}, answered=False)
    assert _run(t)[1].status == "unrecoverable"


def test_a_solution_that_was_read_but_never_written_is_not_called_missing() -> None:
    t = _trace()
    t.tool("Bash", {"command": "python tools/make.py"})
    t.tool("Read", {"file_path": SOLUTION}, "1\timport torch")
    assert _run(t)[2][0] == "solution_unrecoverable"


def test_codex_patch_with_fuzzy_context_is_refused() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.tool("apply_patch", {"input": "*** Begin Patch\n*** Update File: solution.py\n@@\n"
                           "-    return q * 1\n+    return q * 2\n*** End Patch"})
    assert "does not apply exactly" in _run(t)[1].reason


@pytest.mark.parametrize(("record", "outcome"), [
    (("api", "API Error: 429 rate_limit_error", "rate_limit"), "rate_limited"),
    (("api", "API Error: Your credit balance is too low", "billing_error"), "credits_exhausted"),
    (("api", "API Error: 529 Overloaded", None), "provider_unavailable"),
    (("api", "API Error: 500 Internal server error", None), "provider_error"),
    (("note", "[api_error] insufficient_quota: You exceeded your current quota", None), "credits_exhausted"),
    (("note", "[error] stream disconnected: 503 Service Unavailable", None), "provider_unavailable"),
    (("note", "[timeout] harness killed the agent after 2700 s (exit code 124)", None), "agent_timeout"),
])
def test_dnf_reasons_come_from_error_events(record: tuple, outcome: str) -> None:
    t = _trace()
    t.say("Planning.")
    source, text, code = record
    t.api_error(text, code) if source == "api" else t.user(text)
    assert _run(t)[2][0] == outcome


def test_text_the_model_wrote_never_makes_a_dnf() -> None:
    t = _trace()
    t.say("API Error: 429 rate limit exceeded — just kidding, I am stopping.")
    t.tool("Bash", {"command": "echo 'Error: 529 overloaded, credit balance too low'"}, "rate limit 429")
    assert _run(t)[2][0] == "no_solution"


def test_an_error_the_model_recovered_from_is_not_the_outcome() -> None:
    t = _trace()
    t.api_error("API Error: 429 rate_limit_error", "rate_limit")
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.say("Done.")
    assert _run(t)[2] == ("completed", None)


def test_an_infrastructure_error_after_the_solution_is_graded_as_it_stands() -> None:
    t = _trace()
    t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V1})
    t.api_error("API Error: 429 rate_limit_error", "rate_limit")
    _, rec, (outcome, note) = _run(t)
    assert (rec.status, outcome) == ("ok", "early_stop") and "rate limited" in note


def test_usage_is_counted_once_per_api_message_and_summed_over_turns() -> None:
    t = _trace()
    t.assistant({"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "a"},
                usage=(3, 30, 300))  # two lines, one message
    t.say("b", usage=(4, 40, 400))
    assert parse_lines(t.text().splitlines()).token_totals() == {
        "input_tokens": 7, "output_tokens": 70, "cache_read_tokens": 700}


def test_wall_time_only_from_a_real_clock() -> None:
    t = Trace(RUN, "claude-fable-5", step_seconds=1.0)  # the exporters' synthetic one-second clock
    t.say("a")
    t.say("b")
    assert parse_lines(t.text().splitlines()).wall_seconds() is None


def test_shell_effects_after_and_and_in_the_last_list_are_guarded() -> None:
    effects = analyze("cd /w && cat > s.py <<'EOF'\nx\nEOF", "/w", ["/w/s.py"])
    assert [(e.op, e.guarded) for e in effects] == [("write", True)]
    effects = analyze("cat > s.py <<'EOF'\nx\nEOF\npython check.py", "/w", ["/w/s.py"])
    assert [(e.op, e.guarded) for e in effects] == [("write", False)]

"""`kernelboard import traces`: generated Claude-Code traces, the real samples, and the `datasets` path."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from click.testing import CliRunner
from ingest_fixtures import KERNEL_V1, KERNEL_V2, SOLUTION, ExportedTrace, Trace, write_fixture_traces

from kernelboard.eval.submission import load_submission
from kernelboard.sitegen.ingest.claude_code import parse_lines
from kernelboard.sitegen.ingest.cli import import_group
from kernelboard.sitegen.ingest.traces import (
    TraceFile,
    TraceSource,
    build_run,
    import_traces,
    read_dataset,
    read_folder,
)

if TYPE_CHECKING:
    from grading import MeasuredBaselines

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO.parent / "shared" / "samples" / "hf-traces"
SOURCE = TraceSource("hf:owner/kernel-traces@abc123", "owner/kernel-traces", "abc123")


def _import(src: Path, data: Path):
    return import_traces(read_folder(src), data_dir=data, bench="hard", source=SOURCE)


@pytest.fixture
def imported(tmp_path: Path):
    expected = write_fixture_traces(tmp_path / "src")
    report = _import(tmp_path / "src", tmp_path / "data")
    return tmp_path, expected, report


def _meta(data: Path, run_id: str) -> dict:
    return yaml.safe_load((data / "submissions" / "hard" / run_id / "run.yaml").read_text())


def test_each_fixture_run_gets_its_outcome_and_loads_as_a_submission(imported) -> None:
    tmp, expected, report = imported
    assert report.skipped == []
    for run_id, outcome in expected.items():
        sub = load_submission(tmp / "data" / "submissions" / "hard" / run_id)
        assert sub.meta["agent_outcome"] == outcome, sub.meta.get("outcome_note")
        assert sub.has_solution == (outcome == "completed")


def test_solutions_are_rebuilt_from_edits_heredocs_and_patches(imported) -> None:
    tmp, _, _ = imported
    subs = tmp / "data" / "submissions" / "hard"
    edited = (subs / "20260716_024257_claude_claude-fable-5_03_paged_attention" / "solution.py").read_text()
    assert "import torch  # paged decode\n" in edited and "q * 2" in edited
    assert (subs / "20260716_031500_kinetic-claude_kinetic-0715_03_paged_attention" / "solution.py").read_text() \
        == KERNEL_V2
    assert (subs / "20260716_040000_codex_gpt-5.6-sol_03_paged_attention" / "solution.py").read_text() == KERNEL_V2


def test_run_metadata_tokens_gpu_and_trace_link(imported) -> None:
    tmp, _, _ = imported
    meta = _meta(tmp / "data", "20260716_031500_kinetic-claude_kinetic-0715_03_paged_attention")
    assert (meta["harness"], meta["model"], meta["problem"], meta["gpu"]) == (
        "kinetic-claude", "kinetic-0715", "03_paged_attention", "h100-pcie")
    assert meta["trace_url"] == ("https://huggingface.co/datasets/owner/kernel-traces/blob/abc123/h100/"
                                 "20260716_031500_kinetic-claude_kinetic-0715_03_paged_attention.jsonl")
    meta = _meta(tmp / "data", "20260716_024257_claude_claude-fable-5_03_paged_attention")
    # six API messages: one of (5, 50, 500) tokens and five of (10, 100, 1000)
    assert (meta["input_tokens"], meta["output_tokens"], meta["cache_read_tokens"]) == (55, 550, 5500)
    assert (meta["lab"], meta["gpu"], meta["started_at"], meta["agent_seconds"]) == (
        "Anthropic", "rtx-pro-6000", "2026-07-16T02:42:57Z", 77.0)
    assert meta["source"] == "hf:owner/kernel-traces@abc123"


def test_dnf_and_unrecoverable_runs_say_why(imported) -> None:
    tmp, _, _ = imported
    rate = _meta(tmp / "data", "20260716_050000_zai-claude_glm-5.3_03_paged_attention")
    assert rate["agent_outcome"] == "rate_limited" and "429" in rate["outcome_note"]
    sed = _meta(tmp / "data", "20260716_070000_cursor_composer-2.5-fast_03_paged_attention")
    assert "`sed` may have changed it" in sed["outcome_note"]


def test_reimporting_the_same_source_changes_nothing(imported) -> None:
    tmp, expected, _ = imported
    files = sorted((tmp / "data").rglob("*"))
    stamps = {p: p.stat().st_mtime_ns for p in files}
    again = _import(tmp / "src", tmp / "data")
    assert again.written == [] and sorted(again.unchanged) == sorted(expected)
    assert sorted((tmp / "data").rglob("*")) == files
    assert {p: p.stat().st_mtime_ns for p in files} == stamps


def test_a_malformed_line_skips_that_file_with_its_name_and_line(tmp_path: Path) -> None:
    expected = write_fixture_traces(tmp_path / "src")
    bad = tmp_path / "src" / "20260716_080000_claude_claude-fable-5_03_paged_attention.jsonl"
    good = Trace(bad.stem, "claude-fable-5").text().splitlines()
    bad.write_text("\n".join([*good[:4], '{"type": "assistant", "message": {', *good[4:]]) + "\n")
    report = _import(tmp_path / "src", tmp_path / "data")
    assert report.skipped == [f"{bad}: line 5: not valid JSON (Expecting property name enclosed in double quotes "
                              "at column 35)"]
    assert sorted(report.written) == sorted(expected)


def test_a_folder_another_source_wrote_is_kept(imported) -> None:
    tmp, expected, _ = imported
    other = TraceSource("hf:someone/else@main", "someone/else", "main")
    report = import_traces(read_folder(tmp / "src"), data_dir=tmp / "data", bench="hard", source=other)
    assert report.written == [] and len(report.skipped) == len(expected)


def test_the_same_run_id_on_two_boards_gets_two_folders(tmp_path: Path) -> None:
    for board in ("", "h100"):
        t = Trace("20260716_024257_claude_claude-fable-5_03_paged_attention", "claude-fable-5")
        t.tool("Write", {"file_path": SOLUTION, "content": KERNEL_V2})
        t.write_to(tmp_path / "src", board)
    report = _import(tmp_path / "src", tmp_path / "data")
    assert sorted(report.written) == ["20260716_024257_claude_claude-fable-5_03_paged_attention",
                                      "20260716_024257_claude_claude-fable-5_03_paged_attention-h100-pcie"]
    assert _import(tmp_path / "src", tmp_path / "data").written == []


def test_cli_imports_a_local_folder(tmp_path: Path) -> None:
    expected = write_fixture_traces(tmp_path / "src")
    result = CliRunner().invoke(import_group, ["traces", str(tmp_path / "src"), "--hub", "owner/kernel-traces",
                                               "--data", str(tmp_path / "data"), "--decks", str(REPO / "eval/decks")])
    assert result.exit_code == 0, result.output
    assert f"{len(expected)} written" in result.output


# ------------------------------------------------------------------------------ datasets (offline)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    pytest.importorskip("datasets", reason="the traces extra (datasets) is not installed")
    pytest.importorskip("teich", reason="datasets needs teich to parse agent traces; it is not installed")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    from datasets import disable_progress_bars

    disable_progress_bars()


def _folder_files(data: Path) -> dict[str, bytes]:
    return {p.relative_to(data).as_posix(): p.read_bytes() for p in sorted(data.rglob("*")) if p.is_file()}


def test_loading_through_datasets_offline_gives_the_same_runs(offline, tmp_path: Path) -> None:
    from datasets import load_dataset

    write_fixture_traces(tmp_path / "src")
    _import(tmp_path / "src", tmp_path / "direct")
    paths = sorted(str(p) for p in (tmp_path / "src").rglob("*.jsonl"))
    ds = load_dataset("json", data_files={"train": paths}, split="train", cache_dir=str(tmp_path / "cache"))
    assert ds[0]["harness"] == "claude_code"  # parsed as agent traces: one row per file
    via = import_traces(read_dataset(ds, root=str(tmp_path / "src")), data_dir=tmp_path / "via", bench="hard",
                        source=SOURCE)
    assert via.skipped == []
    assert _folder_files(tmp_path / "via") == _folder_files(tmp_path / "direct")
    # A parquet conversion as the Hub keeps it (file_path relative to the repository), read back by the
    # folder reader without `datasets`.
    root = str(tmp_path / "src") + "/"
    hub_like = ds.map(lambda row: {"file_path": row["file_path"].removeprefix(root)})
    (tmp_path / "pq").mkdir()
    hub_like.to_parquet(str(tmp_path / "pq" / "train-00000.parquet"))
    pq = import_traces(read_folder(tmp_path / "pq"), data_dir=tmp_path / "pq-data", bench="hard", source=SOURCE)
    assert pq.skipped == []
    assert _folder_files(tmp_path / "pq-data") == _folder_files(tmp_path / "direct")


# ------------------------------------------------------------------------------ real samples


def _sample_traces(dataset: str) -> list[Path]:
    folder = SAMPLES / dataset
    return sorted(folder.rglob("*.DERIVED-complete-lines.jsonl")) if folder.is_dir() else []


@pytest.mark.parametrize(("dataset", "bench"), [("kernelbench-hard-traces", "hard"),
                                                ("kernelbench-mega-traces", "mega")])
def test_real_sample_traces_are_read(tmp_path: Path, dataset: str, bench: str) -> None:
    samples = _sample_traces(dataset)
    if not samples:
        pytest.skip(f"no samples of {dataset} under {SAMPLES}")
    (tmp_path / "src").mkdir()
    for sample in samples:  # saved as '<run_id>.jsonl.<view>.DERIVED-complete-lines.jsonl'
        shutil.copyfile(sample, tmp_path / "src" / f"{sample.name.split('.jsonl.')[0]}.jsonl")
    report = import_traces(read_folder(tmp_path / "src"), data_dir=tmp_path / "data", bench=bench,
                           source=TraceSource(f"hf:Infatoshi/{dataset}@main", f"Infatoshi/{dataset}"))
    runs = {p.parent.name: yaml.safe_load(p.read_text()) for p in (tmp_path / "data").rglob("run.yaml")}
    assert runs and not report.skipped
    for run_id, meta in runs.items():
        load_submission(tmp_path / "data" / "submissions" / bench / run_id)
        assert run_id.endswith(meta["problem"]) and f"_{meta['harness']}_" in run_id
        # Truncated excerpts: the traces stop before any file is written.
        assert meta["agent_outcome"] in ("no_solution", "early_stop")
        assert meta["trace_url"].startswith(f"https://huggingface.co/datasets/Infatoshi/{dataset}/blob/main/")
    kinetic = "20260715_204254_kinetic-claude_kinetic-0715_03_paged_attention"
    if kinetic in runs:
        meta = runs[kinetic]
        # Its one timestamp (2026-07-16T02:42:57Z) is the exporter's invention; the start is the run id's.
        assert (meta["harness"], meta["model"], meta["started_at"]) == (
            "kinetic-claude", "kinetic-0715", "2026-07-15T20:42:54-06:00")
        assert "agent_seconds" not in meta



# ------------------------------------------------------------------------------ kernelbench.com's exports
# Records shaped as benchmarks/hard/scripts/traces_to_hf.py (Infatoshi/kernelbench.com c7d92211) writes
# them; see `ExportedTrace`.

KINETIC = "20260715_204254_kinetic-claude_kinetic-0715_03_paged_attention"


def _build(t: ExportedTrace | Trace) -> dict:
    _, meta, _ = build_run(TraceFile(f"{t.run_id}.jsonl", t.text(), "test"), bench="hard", source=SOURCE)
    return meta


@pytest.mark.parametrize("exporter_offset", [-6, 3, 0])
def test_exported_start_is_the_run_id_and_never_the_invented_clock(exporter_offset: int) -> None:
    t = ExportedTrace(KINETIC, "kinetic-0715", exporter_utc_offset_hours=exporter_offset)
    t.event(text="Looking around.")
    t.event(tool_calls=(("toolu_1", "Bash", {"command": "ls"}),))
    t.result("toolu_1", "reference.py")
    t.event(text="Done.")
    assert parse_lines(t.text().splitlines()).exporter_clock
    meta = _build(t)
    # The exporter's clock moves with the zone of the machine that exported; the run id does not.
    assert meta["started_at"] == "2026-07-15T20:42:54-06:00"
    assert "agent_seconds" not in meta


def test_a_trace_with_a_real_clock_keeps_it() -> None:
    t = Trace(KINETIC, "kinetic-0715", start="2026-07-16T02:43:10", step_seconds=3.0)
    t.say("a")
    t.say("b")
    session = parse_lines(t.text().splitlines())
    assert not session.exporter_clock and session.wall_seconds() == 9.0
    assert _build(t)["started_at"] == "2026-07-16T02:43:10Z"


def test_exported_usage_is_counted_once_per_api_message() -> None:
    t = ExportedTrace(KINETIC, "kinetic-0715")
    # API message 1, four content blocks -> four records repeating its usage.
    first = (3, 5, 15_000, 2_000)
    t.event(reasoning="plan", usage=first)
    t.event(text="Writing it.", usage=first)
    t.event(tool_calls=(("toolu_1", "Write", {"file_path": SOLUTION, "content": KERNEL_V1}),), usage=first)
    t.event(tool_calls=(("toolu_2", "Bash", {"command": "python check.py"}),), usage=first)
    t.result("toolu_1", "File created successfully")
    t.result("toolu_2", "PASS")
    # API message 2: the output count grows on its last block's record.
    t.event(reasoning="check", usage=(2, 1, 17_000, 400))
    t.event(text="It passes.", usage=(2, 90, 17_000, 400))
    # API message 3: the next call, after a note the harness wrote.
    t.note("task_notification", "\u21b3 subagent complete")
    t.event(text="Done.", usage=(1, 7, 17_400, 50))
    meta = _build(t)
    # Summed per record it would be (4*2003 + 2*402 + 51, 4*5 + 91 + 7, 4*15000 + 2*17000 + 17400).
    assert (meta["input_tokens"], meta["output_tokens"], meta["cache_read_tokens"]) == (
        2_003 + 402 + 51, 5 + 90 + 7, 15_000 + 17_000 + 17_400)
    assert meta["agent_outcome"] == "completed"


@pytest.mark.parametrize(("text", "outcome"), [
    ('API Error: 429 {"type":"error","error":{"type":"rate_limit_error","message":"Rate limit reached"}}',
     "rate_limited"),
    ("Credit balance is too low", "credits_exhausted"),
    ("API Error: Repeated 529 Overloaded errors", "provider_unavailable"),
    ("Claude AI usage limit reached|1784160000", "rate_limited"),
    ("API Error: 500 Internal server error", "provider_error"),
])
def test_an_exported_harness_error_message_is_a_dnf(text: str, outcome: str) -> None:
    t = ExportedTrace("20260822_053629_zai-claude_glm-5.3_03_paged_attention", "glm-5.3")
    t.event(text="Reading the reference.", usage=(5, 3, 9_000, 0))
    t.event(tool_calls=(("toolu_1", "Read", {"file_path": "reference.py"}),), usage=(5, 3, 9_000, 0))
    t.result("toolu_1", "import torch")
    t.api_error(text)
    meta = _build(t)
    assert meta["agent_outcome"] == outcome and text[:20] in meta["outcome_note"]
    assert meta["input_tokens"] == 5  # the error record carries no usage to count


def test_the_model_writing_about_errors_is_not_a_dnf() -> None:
    t = ExportedTrace("20260822_053629_zai-claude_glm-5.3_03_paged_attention", "glm-5.3")
    t.event(tool_calls=(("toolu_1", "Read", {"file_path": "reference.py"}),))
    t.result("toolu_1", "import torch")
    t.event(text="API Error: 429 rate limit, so I will stop here.")  # billed: the model's text
    t.event(text="I hit a rate limit and stop.", usage=(0, 0, 0, 0))  # unbilled, but not the harness's words
    meta = _build(t)
    assert meta["agent_outcome"] == "no_solution"


@pytest.mark.parametrize(("note", "outcome"), [
    ("[error] Rate limit exceeded for model", "rate_limited"),  # OpenCode's / Droid's error event
    ("[error] AI_APICallError: Insufficient credits", "credits_exhausted"),
    ("[result] result: error", "harness_error"),  # Gemini CLI's closing record; its reason is not exported
])
def test_exported_harness_notes_are_dnfs(note: str, outcome: str) -> None:
    t = ExportedTrace("20260618_050815_gemini_gemini-3.5-flash_03_paged_attention", "gemini-3.5-flash")
    t.event(tool_calls=(("c1", "read_file", {"path": "reference.py"}),), usage=None)
    t.result("c1", "import torch")
    t.user(note)
    assert _build(t)["agent_outcome"] == outcome


def test_an_exported_run_rebuilds_its_solution(tmp_path: Path) -> None:
    t = ExportedTrace(KINETIC, "kinetic-0715")
    t.event(tool_calls=(("toolu_1", "Write", {"file_path": SOLUTION, "content": KERNEL_V1}),))
    t.result("toolu_1", "File created successfully")
    t.event(tool_calls=(("toolu_2", "Edit", {"file_path": SOLUTION, "old_string": "q * 1", "new_string": "q * 2"}),),
            usage=(1, 5, 1_500, 0))
    t.result("toolu_2", "updated")
    t.event(text="Done.", usage=(1, 5, 1_600, 0))
    t.write_to(tmp_path / "src", "h100")
    report = _import(tmp_path / "src", tmp_path / "data")
    assert report.skipped == [] and report.outcomes == {"completed": 1}
    sub = tmp_path / "data" / "submissions" / "hard" / KINETIC
    assert (sub / "solution.py").read_text() == KERNEL_V2
    assert _meta(tmp_path / "data", KINETIC)["started_at"] == "2026-07-15T20:42:54-06:00"


# ------------------------------------------------------------------------------ end to end


def test_imported_runs_are_graded_and_rendered(tmp_path: Path, measured_baselines: MeasuredBaselines) -> None:
    """import traces -> kernelboard eval (CPU) -> site build: DNFs show their reason and Hub trace links."""
    pytest.importorskip("torch", reason="grading needs the eval extra (torch)")
    from kernelboard.eval.schedule import EvalOptions, run_eval
    from kernelboard.sitegen import build_site

    src = tmp_path / "src"
    t = Trace("20260716_090000_claude_claude-fable-5_03_paged_attention", "claude-fable-5")
    t.tool("Write", {"file_path": SOLUTION, "content": "from reference import Model, get_inputs, get_init_inputs\n"})
    t.say("Submitted the reference.")
    t.write_to(src)
    t = Trace("20260716_091500_zai-claude_glm-5.3_03_paged_attention", "glm-5.3")
    t.note("api_error", "API Error: 429 Too Many Requests")
    t.write_to(src)
    t = Trace("20260716_093000_gemini_gemini-3.5-flash_03_paged_attention", "gemini-3.5-flash")
    t.say("I give up.")
    t.write_to(src)
    data = tmp_path / "data"
    assert _import(src, data).skipped == []
    measured_baselines.copy_into(data / "results", ["03_paged_attention"], rep_ms=20.0)  # the session's
    rows = run_eval(EvalOptions(deck=REPO / "eval" / "decks" / "hard", submissions=data / "submissions" / "hard",
                                out=data / "results", device="cpu", timeout_s=120.0, build_timeout_s=60.0,
                                rep_ms=20.0))
    status = {r["run_id"]: r["status"] for r in rows}
    assert status == {"20260716_090000_claude_claude-fable-5_03_paged_attention": "pass",
                      "20260716_091500_zai-claude_glm-5.3_03_paged_attention": "dnf",
                      "20260716_093000_gemini_gemini-3.5-flash_03_paged_attention": "not_graded"}
    site = build_site(data, REPO / "eval" / "decks", tmp_path / "dist").out_dir
    home = (site / "index.html").read_text()
    assert "rate limited" in home
    page = (site / "runs" / "cpu" / "20260716_091500_zai-claude_glm-5.3_03_paged_attention" / "index.html").read_text()
    assert 'href="https://huggingface.co/datasets/owner/kernel-traces/blob/abc123/' \
           '20260716_091500_zai-claude_glm-5.3_03_paged_attention.jsonl"' in page
    assert "429 Too Many Requests" in page

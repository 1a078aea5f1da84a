"""Red team: malformed input. Each test feeds one bad thing and expects one line naming the file (and
the field) — or the submission skipped with a one-line reason while the rest of the batch goes on —
never a traceback, never a row that breaks `site build`. Almost nothing here grades: submissions are
discovered and loaded, tables and annotations read; one CLI batch grades only rows that need no worker.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from site_fixtures import PASS, SiteInputs

from kernelboard.cli import main as cli
from kernelboard.errors import DataError, SubmissionError, UsageError
from kernelboard.eval.deck import load_deck
from kernelboard.eval.schedule import EvalOptions, grade_submission, select_submissions
from kernelboard.eval.submission import discover, load_submission
from kernelboard.eval.tables import load_all, read_table, rows_to_table, table_path
from kernelboard.sitegen.fingerprint import fingerprint
from kernelboard.sitegen.ingest.annotations import load_annotations
from kernelboard.sitegen.load import load_site

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "hard"
PROBLEM = "03_paged_attention"
GOOD_YAML = f"problem: {PROBLEM}\nmodel: m\nharness: h\nagent_outcome: completed\n"
SOLUTION = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"


def _sub(root: Path, name: str = "run1", run_yaml: str | bytes = GOOD_YAML, solution: str | bytes | None = SOLUTION,
         **files: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_bytes(run_yaml if isinstance(run_yaml, bytes) else run_yaml.encode())
    if solution is not None:
        (folder / "solution.py").write_bytes(solution if isinstance(solution, bytes) else solution.encode())
    for rel, text in files.items():
        (folder / rel).write_text(text)
    return folder


def _refused(folder: Path, *needles: str) -> str:
    """`load_submission` refuses `folder` with one line holding every needle; returns the line."""
    with pytest.raises(SubmissionError) as err:
        load_submission(folder)
    line = err.value.message
    assert "\n" not in line and "Traceback" not in line
    for needle in needles:
        assert needle in line, line
    return line


def _with_field(tmp_path: Path, line: str) -> Path:
    return _sub(tmp_path, run_yaml=GOOD_YAML + line + "\n")


# ------------------------------------------------------------------------------------- run.yaml itself


def test_binary_run_yaml(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=b"\x00\x01\x02ELF\x00" * 20), "run.yaml", "binary")


def test_non_utf8_run_yaml(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=GOOD_YAML.encode() + b"model_display: caf\xe9\n"), "run.yaml", "not UTF-8")


def test_run_yaml_that_is_a_list(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml="- problem\n- model\n"), "run.yaml", "expected a mapping", "list")


def test_run_yaml_that_is_a_bare_string(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml="just some words\n"), "run.yaml", "expected a mapping")


def test_zero_byte_run_yaml(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=""), "run.yaml", "expected a mapping")


def test_run_yaml_with_broken_syntax(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml="problem: [unclosed\nmodel: m\n"), "run.yaml", "not valid YAML", "line")


def test_run_yaml_with_a_key_that_is_not_text(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=GOOD_YAML + "1: one\n"), "run.yaml", "key must be text")


def test_run_yaml_as_a_symlink(tmp_path: Path) -> None:
    folder = _sub(tmp_path)
    (folder / "run.yaml").unlink()
    (folder / "run.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    _refused(folder, "run.yaml", "symbolic link")


# ------------------------------------------------------------------------------------------ its fields


def test_impossible_unquoted_date(tmp_path: Path) -> None:
    _refused(_with_field(tmp_path, "started_at: 2026-13-45"), "run.yaml", "month must be in 1..12")


def test_impossible_quoted_date(tmp_path: Path) -> None:
    _refused(_with_field(tmp_path, "started_at: '2026-02-30T10:00:00Z'"), "run.yaml", "'started_at'", "ISO-8601")


@pytest.mark.parametrize(("field", "value"), [
    ("cost_usd", ".nan"), ("cost_usd", "-0.5"), ("cost_usd", ".inf"),
    ("agent_seconds", "-12"), ("agent_seconds", ".nan"), ("agent_seconds", "-.inf"),
    ("input_tokens", "-1"), ("output_tokens", "99999999999999999999999"), ("cache_read_tokens", "-7"),
])
def test_nan_negative_or_infinite_spending(tmp_path: Path, field: str, value: str) -> None:
    _refused(_with_field(tmp_path, f"{field}: {value}"), "run.yaml", f"key '{field}'", "finite number")


def test_token_count_as_text(tmp_path: Path) -> None:
    _refused(_with_field(tmp_path, "input_tokens: many"), "run.yaml", "key 'input_tokens'", "expected int")


def test_token_count_as_a_boolean(tmp_path: Path) -> None:
    _refused(_with_field(tmp_path, "output_tokens: true"), "run.yaml", "key 'output_tokens'")


def test_unknown_key(tmp_path: Path) -> None:
    _refused(_with_field(tmp_path, "score: 100"), "run.yaml", "unknown keys", "score")


def test_missing_required_key(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=GOOD_YAML.replace("model: m\n", "")), "run.yaml", "missing key 'model'")


def test_empty_problem_name(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=GOOD_YAML.replace(PROBLEM, "''")), "run.yaml", "key 'problem'", "empty")


def test_unknown_agent_outcome(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, run_yaml=GOOD_YAML.replace("completed", "exploded")), "key 'agent_outcome'", "exploded")


def test_run_id_that_disagrees_with_the_folder(tmp_path: Path) -> None:
    _refused(_with_field(tmp_path, "run_id: someone_else"), "key 'run_id'", "run1")


def test_folder_name_unusable_as_a_run_id(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, name="my run (copy)"), "my run (copy)", "letters, digits")


# ----------------------------------------------------------------------------- the submission's files


def test_solution_symlinked_to_etc_passwd(tmp_path: Path) -> None:
    folder = _sub(tmp_path, solution=None)
    (folder / "solution.py").symlink_to("/etc/passwd")
    _refused(folder, "solution.py", "symbolic link")


def test_sidecar_symlink_loop(tmp_path: Path) -> None:
    folder = _sub(tmp_path)
    os.symlink("loop_b.cu", folder / "loop_a.cu")
    os.symlink("loop_a.cu", folder / "loop_b.cu")
    _refused(folder, "loop_a.cu", "symbolic link")


def test_symlinked_subfolder(tmp_path: Path) -> None:
    folder = _sub(tmp_path)
    (folder / "include").symlink_to("/usr/include")
    _refused(folder, "include", "symbolic link")


def test_submission_folder_that_is_a_symlink(tmp_path: Path) -> None:
    real = _sub(tmp_path / "real")
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "run1").symlink_to(real)
    found, refused = discover(subs)
    assert found == [] and len(refused) == 1 and "symbolic link" in refused[0] and "\n" not in refused[0]


def test_solution_that_is_not_utf8(tmp_path: Path) -> None:
    _refused(_sub(tmp_path, solution=b"x = '\xff\xfe'\n"), "solution.py", "not UTF-8")


def test_solution_that_is_a_folder(tmp_path: Path) -> None:
    folder = _sub(tmp_path, solution=None)
    (folder / "solution.py").mkdir()
    _refused(folder, "solution.py", "expected a file")


def test_stray_folder_without_run_yaml(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    _refused(tmp_path / "notes", "no run.yaml")


def test_stray_file_beside_the_run_folders_is_skipped_and_the_rest_loads(tmp_path: Path) -> None:
    _sub(tmp_path, "good")
    (tmp_path / "README.txt").write_text("hello")
    (tmp_path / ".DS_Store").write_bytes(b"\x00\x00")
    found, refused = discover(tmp_path)
    assert [s.run_id for s in found] == ["good"]
    assert len(refused) == 2 and all("not a run folder" in line for line in refused)


def test_many_bad_folders_each_one_line_and_the_good_one_survives(tmp_path: Path) -> None:
    _sub(tmp_path, "a_good")
    _sub(tmp_path, "b_binary", run_yaml=b"\x00" * 64)
    _sub(tmp_path, "c_list", run_yaml="- 1\n")
    _sub(tmp_path, "d_nan", run_yaml=GOOD_YAML + "cost_usd: .nan\n")
    (tmp_path / "e_stray").mkdir()
    found, refused = discover(tmp_path)
    assert [s.run_id for s in found] == ["a_good"]
    assert len(refused) == 4 and all("\n" not in line for line in refused)
    assert [Path(line.split(":")[0]).relative_to(tmp_path).parts[0] for line in refused] == \
        ["b_binary", "c_list", "d_nan", "e_stray"]


def test_unknown_problem_is_refused_at_eval_not_written(tmp_path: Path) -> None:
    _sub(tmp_path / "subs", "known")
    _sub(tmp_path / "subs", "unknown", run_yaml=GOOD_YAML.replace(PROBLEM, "99_no_such_problem"))
    opts = EvalOptions(deck=DECK, submissions=tmp_path / "subs", out=tmp_path / "out", device="cpu")
    subs = select_submissions(opts, set(load_deck(DECK)))
    assert [s.run_id for s in subs] == ["known"]
    assert not (tmp_path / "out").exists()


def test_path_traversal_as_a_problem_name_is_refused(tmp_path: Path) -> None:
    _sub(tmp_path / "subs", "evil", run_yaml=GOOD_YAML.replace(PROBLEM, "../../etc"))
    opts = EvalOptions(deck=DECK, submissions=tmp_path / "subs", out=tmp_path / "out", device="cpu")
    with pytest.raises(SubmissionError, match=r"key 'problem': '\.\./\.\./etc' is not in the deck"):
        select_submissions(opts, set(load_deck(DECK)))


def test_empty_solution_is_a_build_error_without_a_worker(tmp_path: Path) -> None:
    sub = load_submission(_sub(tmp_path / "subs", "empty", solution=b""))
    opts = EvalOptions(deck=DECK, submissions=tmp_path / "subs", out=tmp_path / "out", device="cpu")
    env = {"device_name": "CPU: test", "torch_version": "2", "python_version": "3"}
    row = grade_submission(opts, "cpu", None, load_deck(DECK)[PROBLEM], sub, env, {}, tmp_path, None)
    assert row["status"] == "build_error" and "empty" in row["message"]
    assert load_all(tmp_path / "out")["results"].num_rows == 1


def test_cli_batch_of_only_bad_folders_is_one_line_each_and_no_traceback(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    _sub(subs, "binary", run_yaml=b"\x00\xff" * 10)
    _sub(subs, "dates", run_yaml=GOOD_YAML + "started_at: 2026-13-45\n")
    (subs / "stray.txt").write_text("x")
    result = CliRunner().invoke(cli, ["eval", "--deck", str(DECK), "--submissions", str(subs),
                                      "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert "every selected submission was refused (3)" in result.output
    assert not (tmp_path / "out").exists()


def test_only_glob_keeps_unselected_bad_folders_quiet(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    _sub(subs, "good")
    _sub(subs, "bad", run_yaml="- x\n")
    opts = EvalOptions(deck=DECK, submissions=subs, out=tmp_path / "out", device="cpu", only=("good",))
    assert [s.run_id for s in select_submissions(opts)] == ["good"]


def test_exclude_globs_leave_runs_out_after_only(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    for name in ("a_fast", "b_slow", "c_fast"):
        _sub(subs, name)
    opts = EvalOptions(deck=DECK, submissions=subs, out=tmp_path / "out", device="cpu", exclude=("*slow",))
    assert [s.run_id for s in select_submissions(opts)] == ["a_fast", "c_fast"]
    opts = EvalOptions(deck=DECK, submissions=subs, out=tmp_path / "out", device="cpu", only=("*fast",),
                       exclude=("c_*",))
    assert [s.run_id for s in select_submissions(opts)] == ["a_fast"]
    opts = EvalOptions(deck=DECK, submissions=subs, out=tmp_path / "out", device="cpu", exclude=("*",))
    with pytest.raises(UsageError, match=r"match anything less \['\*'\]"):
        select_submissions(opts)


# ----------------------------------------------------------------------------------- annotations, site


def test_binary_annotation_yaml(tmp_path: Path) -> None:
    (tmp_path / f"{PASS}.yaml").write_bytes(b"\x00\x01verdict: clean\x00")
    with pytest.raises(DataError) as err:
        load_annotations(tmp_path)
    assert err.value.problems == [f"{tmp_path / PASS}.yaml: a binary file (NUL bytes); an annotation is YAML text"]


def test_non_utf8_annotation_yaml(tmp_path: Path) -> None:
    (tmp_path / f"{PASS}.yaml").write_bytes(b"verdict: clean\nsummary: caf\xe9\n")
    with pytest.raises(DataError, match="not UTF-8 text"):
        load_annotations(tmp_path)


def test_annotation_with_an_impossible_date(tmp_path: Path) -> None:
    (tmp_path / f"{PASS}.yaml").write_text("verdict: clean\nsummary: fine\nauditor: 2026-13-45\n")
    with pytest.raises(DataError) as err:
        load_annotations(tmp_path)
    assert len(err.value.problems) == 1 and f"{PASS}.yaml" in err.value.problems[0]


def test_annotation_that_is_a_symlink(tmp_path: Path) -> None:
    (tmp_path / f"{PASS}.yaml").symlink_to("/etc/passwd")
    with pytest.raises(DataError, match="symbolic link"):
        load_annotations(tmp_path)


def test_site_never_publishes_a_symlinked_solution(fresh_inputs: SiteInputs) -> None:
    solution = fresh_inputs.data_dir / "submissions" / "hard" / PASS / "solution.py"
    solution.parent.mkdir(parents=True, exist_ok=True)
    solution.unlink(missing_ok=True)
    solution.symlink_to("/etc/passwd")
    with pytest.raises(DataError) as err:
        load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir)
    assert err.value.problems == [f"{solution}: a symbolic link; a submission's files must be plain files in its "
                                  "folder (links are never followed or published)"]


def test_site_fingerprint_and_sidecars_survive_a_symlink_loop(fresh_inputs: SiteInputs) -> None:
    folder = fresh_inputs.data_dir / "submissions" / "hard" / PASS
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "solution.py").exists():
        (folder / "solution.py").write_text(SOLUTION)
    os.symlink("b.cu", folder / "a.cu")
    os.symlink("a.cu", folder / "b.cu")
    os.symlink("/etc/passwd", folder / "passwd.h")
    assert fingerprint(fresh_inputs.data_dir, fresh_inputs.decks_dir, None)
    data = load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir)
    assert not {f.name for f in data.sidecars.get(PASS, ())} & {"a.cu", "b.cu", "passwd.h"}


def test_runs_table_with_nan_cost_names_file_row_and_field(tmp_path: Path) -> None:
    path = table_path(tmp_path, "h200", "runs")
    path.parent.mkdir(parents=True)
    row = {"run_id": "r1", "bench": "hard", "problem": PROBLEM, "gpu": None, "model": "m", "model_display": "M",
           "lab": None, "harness": "h", "effort": None, "started_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
           "agent_seconds": -3.0, "input_tokens": None, "output_tokens": None, "cache_read_tokens": None,
           "cost_usd": float("nan"), "agent_outcome": "completed", "outcome_note": None, "trace_url": None,
           "solution_sha256": None, "source": "t"}
    pq.write_table(rows_to_table("runs", [row]), path)
    with pytest.raises(DataError) as err:
        read_table(path, "runs")
    assert [p.split(": field ")[1].split(":")[0] for p in err.value.problems] == ["'agent_seconds'", "'cost_usd'"]
    assert all(str(path) in p and "row 0 (run_id='r1')" in p for p in err.value.problems)


def test_a_batch_with_bad_folders_goes_on_and_its_tables_build_a_site(tmp_path: Path) -> None:
    """The CLI end to end, with rows that need no worker (a DNF, an empty solution) beside bad folders."""
    subs = tmp_path / "data" / "submissions" / "hard"
    _sub(subs, "dnf", run_yaml=GOOD_YAML.replace("completed", "rate_limited"), solution=None)
    _sub(subs, "empty", solution="\n\n")
    _sub(subs, "nan_cost", run_yaml=GOOD_YAML + "cost_usd: .nan\n")
    _sub(subs, "unknown_problem", run_yaml=GOOD_YAML.replace(PROBLEM, "42_nope"))
    link = _sub(subs, "linked", solution=None)
    (link / "solution.py").symlink_to("/etc/passwd")
    (subs / "stray.bin").write_bytes(b"\x00")
    out = tmp_path / "data" / "results"
    result = CliRunner().invoke(cli, ["eval", "--deck", str(DECK), "--submissions", str(subs), "--out", str(out),
                                      "--device", "cpu", "--unsandboxed"])
    assert result.exit_code == 0, result.output
    for name in ("nan_cost", "unknown_problem", "linked", "stray.bin"):
        assert f"skipped {subs / name}" in " ".join(result.output.split()), name
    rows = {r["run_id"]: r["status"] for r in load_all(out)["results"].to_pylist()}
    assert rows == {"dnf": "dnf", "empty": "build_error"}
    decks = tmp_path / "decks"
    shutil.copytree(DECK / PROBLEM, decks / "hard" / PROBLEM)
    site = load_site(tmp_path / "data", decks)
    assert set(site.runs) == {"dnf", "empty"}


def test_an_out_path_under_a_file_is_one_line(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    _sub(subs, "dnf", run_yaml=GOOD_YAML.replace("completed", "rate_limited"), solution=None)
    (tmp_path / "afile").write_text("x")
    result = CliRunner().invoke(cli, ["eval", "--deck", str(DECK), "--submissions", str(subs),
                                      "--out", str(tmp_path / "afile" / "out"), "--device", "cpu", "--unsandboxed"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and str(tmp_path / "afile") in error[0], result.output


"""The data contract: round trips, and bad input reported as one line naming file, row and field."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kernelboard.errors import DataError
from kernelboard.eval.schema import SCHEMA_VERSION, TABLES, record_mismatches
from kernelboard.eval.tables import load_all, read_table, rows_to_table, table_path, upsert

NOW = dt.datetime(2026, 11, 29, 19, 0, tzinfo=dt.UTC)


def run_row(run_id: str = "r1", outcome: str = "completed") -> dict:
    return {"run_id": run_id, "bench": "hard", "problem": "03_paged_attention", "gpu": None, "model": "m",
            "model_display": "M", "lab": None, "harness": "h", "effort": None, "started_at": NOW,
            "agent_seconds": None, "input_tokens": None, "output_tokens": None, "cache_read_tokens": None,
            "cost_usd": None, "agent_outcome": outcome, "outcome_note": None, "trace_url": None,
            "solution_sha256": None, "source": "test"}


def result_row(run_id: str = "r1", status: str = "pass", speedup: float | None = 2.0) -> dict:
    return {"run_id": run_id, "gpu": "h200", "status": status, "message": "m",
            "speedup_vs_compile": speedup, "speedup_vs_eager": speedup, "peak_fraction": None,
            "compile_variant": None, "n_shapes": 1, "timer": "cuda_event", "device_name": "NVIDIA H200",
            "driver_version": None, "cuda_version": None, "torch_version": None, "triton_version": None,
            "python_version": None, "graded_at": NOW, "grader_version": "0", "measured_by": "kernelboard 0",
            "seeds": [1, 2],
            "grade_seconds": 1.0, "log_path": None}


def write(results: Path, runs: list[dict], res: list[dict]) -> None:
    upsert(table_path(results, "h200", "runs"), "runs", runs)
    upsert(table_path(results, "h200", "results"), "results", res)


def test_round_trip_keeps_every_column(tmp_path: Path) -> None:
    write(tmp_path, [run_row()], [result_row()])
    tables = load_all(tmp_path)
    assert tables["results"].to_pylist()[0]["speedup_vs_compile"] == 2.0
    assert tables["results"].to_pylist()[0]["schema_version"] == SCHEMA_VERSION
    assert tables["runs"].schema == TABLES["runs"][0]


def test_upsert_replaces_by_key_and_writes_no_temp_files(tmp_path: Path) -> None:
    path = table_path(tmp_path, "h200", "runs")
    upsert(path, "runs", [run_row("a"), run_row("b")])
    upsert(path, "runs", [{**run_row("a"), "model": "changed"}])
    rows = read_table(path, "runs").to_pylist()
    assert [(r["run_id"], r["model"]) for r in rows] == [("a", "changed"), ("b", "m")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["runs.parquet"]


def test_a_pass_without_a_score_is_rejected_before_writing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"row 0 \(run_id='r1', gpu='h200'\): field 'speedup_vs_compile'"):
        upsert(table_path(tmp_path, "h200", "results"), "results", [result_row(speedup=None)])
    assert not table_path(tmp_path, "h200", "results").exists()


def test_a_failure_with_a_score_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is not a pass, so it must carry no score"):
        upsert(table_path(tmp_path, "h200", "results"), "results", [result_row(status="wrong")])


def test_a_dnf_counted_as_a_failure_is_rejected(tmp_path: Path) -> None:
    write(tmp_path, [run_row(outcome="rate_limited")], [result_row(status="wrong", speedup=None)])
    with pytest.raises(DataError) as err:
        load_all(tmp_path)
    assert "results.parquet: row 0 (run_id='r1'): field 'status': the run is a DNF (rate_limited)" in str(err.value)


def test_dnf_status_needs_a_dnf_outcome(tmp_path: Path) -> None:
    write(tmp_path, [run_row()], [result_row(status="dnf", speedup=None)])
    with pytest.raises(DataError, match="'dnf' needs a run outcome"):
        load_all(tmp_path)


def test_unknown_enum_value_names_the_allowed_ones(tmp_path: Path) -> None:
    path = table_path(tmp_path, "h200", "runs")
    path.parent.mkdir(parents=True)
    pq.write_table(rows_to_table("runs", [run_row(outcome="exploded")]), path)
    with pytest.raises(DataError) as err:
        read_table(path, "runs")
    line = str(err.value)
    assert str(path) in line and "field 'agent_outcome'" in line and "exploded" in line and "rate_limited" in line


def test_missing_column_and_wrong_version_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "runs.parquet"
    table = rows_to_table("runs", [run_row()])
    pq.write_table(table.drop_columns(["model"]), path)
    with pytest.raises(DataError, match="missing column 'model'"):
        read_table(path, "runs")
    versions = pa.array([SCHEMA_VERSION + 1], pa.int16())
    pq.write_table(table.set_column(0, "schema_version", versions), path)
    with pytest.raises(DataError, match=f"field 'schema_version': expected {SCHEMA_VERSION}"):
        read_table(path, "runs")


def test_every_problem_is_listed_not_only_the_first(tmp_path: Path) -> None:
    path = tmp_path / "results.parquet"
    rows = [result_row("a", speedup=None), result_row("b", status="wrong")]
    pq.write_table(rows_to_table("results", rows), path)
    with pytest.raises(DataError) as err:
        read_table(path, "results")
    assert len(err.value.problems) == 4  # two missing speedups on a, two scores on b
    assert str(err.value).startswith("4 problems in the data:")


def test_corrupt_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "runs.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"runs.parquet: cannot read as parquet"):
        read_table(path, "runs")


def test_committed_data_keeps_the_contract() -> None:
    tables = load_all(Path(__file__).resolve().parents[1] / "data" / "results")
    assert tables["results"].num_rows > 0


def test_every_column_is_documented_in_data_readme() -> None:
    readme = (Path(__file__).resolve().parents[1] / "data" / "README.md").read_text()
    missing = [f"{name}.{field.name}" for name, (schema, _) in TABLES.items() for field in schema
               if f"`{field.name}`" not in readme]
    assert missing == []


def test_a_result_of_an_unknown_run_and_disagreeing_run_copies_are_reported(tmp_path: Path) -> None:
    results = tmp_path / "results"
    write(results, [run_row("r1")], [result_row("r1"), result_row("r9")])
    upsert(table_path(results, "b200", "runs"), "runs", [{**run_row("r1"), "model": "other"}])
    with pytest.raises(DataError) as err:
        load_all(results)
    assert err.value.problems == [
        f"{results}: runs: run_id='r1' appears twice with different ['model']",
        f"{results / 'h200' / 'results.parquet'}: row 1 (run_id='r9'): field 'run_id': no such run in runs.parquet",
    ]


def test_a_record_that_drifts_from_the_contract_is_named_column_by_column() -> None:
    """The site's typed records are checked against eval/schema.py, the contract's one source."""
    assert record_mismatches("hardware", {"gpu": "str"}, folded=[f.name for f in TABLES["hardware"][0]
                                                                   if f.name != "gpu"]) == []
    bad = record_mismatches("runs", {"run_id": "str | None", "bench": "str", "colour": "str"},
                            folded=[f.name for f in TABLES["runs"][0] if f.name not in ("run_id", "bench", "problem")])
    assert bad == ["runs: column 'problem' (str) has no field", "runs: field 'run_id' is str | None, the column reads "
                   "as str", "runs: field 'colour' is no column of the table"]

"""The scheduler → worker job (eval/job.py): a typed record that round-trips through its file and
is refused, in one line naming the key, when the file is not one the worker can trust."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelboard.eval import worker
from kernelboard.eval.jail import Jail
from kernelboard.eval.job import Job, JobError

GRADE = Job(kind="grade", problem_path=Path("/decks/hard/01_fp8_gemm"), device="cuda", base_seed=7, rep_ms=None,
            solution_dir=Path("/tmp/x/run"), jail=Jail("/usr/bin/bwrap", "0.9", readonly=("/usr",)),
            result_path=Path("/tmp/x/run.result.json"), phase_path=Path("/tmp/x/run.phase"),
            phase_timeouts_s={"build": 600}, timeout_s=1800.0, started_unix=1.5e9, caches=("/cache/k",))
BASELINE = Job(kind="baseline", problem_path=Path("/decks/hard/05_topk"), device="cpu", base_seed=2026, rep_ms=50,
               variants=("eager", "compile:default"), todo={"0": ("eager",), "1": ()},
               checkpoint_path=Path("/tmp/x/b.checkpoint.json"), result_path=Path("/tmp/x/b.result.json"))


@pytest.mark.parametrize("job", [GRADE, BASELINE], ids=["grade", "baseline"])
def test_a_job_reads_back_as_written(job: Job) -> None:
    text = job.to_json()
    assert Job.from_json(text) == job
    assert json.loads(text)["result_path"] == str(job.result_path)  # a plain JSON object, paths as strings


def test_a_job_file_without_the_newer_keys_still_reads() -> None:
    """Keys an older scheduler did not write (a grade job's variants, a baseline job's jail) read as defaults."""
    data = {"kind": "grade", "problem_path": "/p", "device": "cpu", "base_seed": 1, "solution_dir": "/s",
            "result_path": "/r"}
    job = Job.from_json(json.dumps(data))
    assert (job.jail, job.variants, job.phase_timeouts_s, job.caches) == (None, (), {}, ())


@pytest.mark.parametrize(("change", "message"), [
    ({"kind": "bench"}, "key 'kind': expected one of grade, baseline, got 'bench'"),
    ({"device": None}, "key 'device': a value is required"),
    ({"base_seed": "7"}, "key 'base_seed': expected int, got '7'"),
    ({"base_seed": True}, "key 'base_seed': expected int, got True"),
    ({"solution_dir": None}, "key 'solution_dir': a value is required"),
    ({"result_path": ""}, "key 'result_path': expected a path, got ''"),
    ({"caches": ["/a", 3]}, "key 'caches': expected a list of strings, got ['/a', 3]"),
    ({"phase_timeouts_s": {"build": "soon"}},
     "key 'phase_timeouts_s': expected phase -> seconds, got {'build': 'soon'}"),
    ({"colour": "red"}, "unknown keys ['colour']"),
])
def test_a_bad_job_is_one_line_naming_the_key(change: dict, message: str) -> None:
    data = {**json.loads(GRADE.to_json()), **change}
    with pytest.raises(JobError) as err:
        Job.from_json(json.dumps(data))
    assert str(err.value) == message


def test_a_baseline_job_names_what_to_time() -> None:
    data = {**json.loads(BASELINE.to_json()), "todo": None, "variants": []}
    with pytest.raises(JobError, match="key 'variants'"):
        Job.from_json(json.dumps(data))


def test_the_worker_refuses_a_bad_job_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.job.json"
    path.write_text("{not json")
    assert worker.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{path}: not a usable job file: not JSON (") and "\n" not in err

"""Red team: faults of the machine and of concurrent use. Each test does one bad thing to the grader,
the merge or the site build — kill -9 at a random point, a full disk, two writers at once, a corrupt
or incomplete table — and checks that no row is lost, duplicated or orphaned, that the tables keep
the contract, and that what failed said so in one line naming the path.

Gradings are real (`kernelboard eval --device cpu` in a subprocess) but few: one module fixture
grades a seed run (with the session's baselines), and each grading test copies that folder and grades
with --resume.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from grading import MeasuredBaselines

from kernelboard.cli import main as cli
from kernelboard.eval.locks import LockWaitWarning, hold
from kernelboard.eval.merge import merge_results
from kernelboard.eval.tables import (
    finish_pending,
    load_all,
    read_table,
    results_lock,
    rows_to_table,
    table_path,
    upsert,
    write_atomic,
)

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "hard"
PROBLEM = "03_paged_attention"
CORRECT = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"
NOW = dt.datetime(2026, 11, 29, 19, 0, tzinfo=dt.UTC)


@pytest.fixture(autouse=True)
def _private_lock_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks of these tests live in a folder of their own, never shared with another checkout's grader."""
    monkeypatch.setenv("KERNELBOARD_LOCK_DIR", str(tmp_path_factory.mktemp("locks")))


# ------------------------------------------------------------------------------------------ helpers


def run_row(run_id: str, outcome: str = "completed") -> dict:
    return {"run_id": run_id, "bench": "hard", "problem": PROBLEM, "gpu": None, "model": "m", "model_display": "M",
            "lab": None, "harness": "h", "effort": None, "started_at": NOW, "agent_seconds": None,
            "input_tokens": None, "output_tokens": None, "cache_read_tokens": None, "cost_usd": None,
            "agent_outcome": outcome, "outcome_note": None, "trace_url": None, "solution_sha256": None,
            "source": "test"}


def _python(code: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, **popen)


_UPSERT_MANY = """
    import sys, datetime as dt
    from pathlib import Path
    sys.path.insert(0, "tests")
    from test_redteam_faults import run_row
    from kernelboard.eval.tables import table_path, upsert
    out, prefix, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(n):
        upsert(table_path(out, "h200", "runs"), "runs", [run_row(f"{prefix}{i:04d}")])
"""


def _run_ids(out: Path, name: str = "runs", gpu: str = "h200") -> list[str]:
    return [r["run_id"] for r in read_table(table_path(out, gpu, name), name).to_pylist()]


def _no_temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".pending" in p.parts]


def _write_sub(subs: Path, run_id: str, source: str | None = CORRECT, outcome: str = "completed") -> None:
    folder = subs / run_id
    folder.mkdir(parents=True)
    if source is not None:
        (folder / "solution.py").write_text(source)
    (folder / "run.yaml").write_text(f"problem: {PROBLEM}\nmodel: m-{run_id}\nharness: pytest\n"
                                     f"agent_outcome: {outcome}\n")


def _eval_args(subs: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kernelboard.cli", "eval", "--deck", str(DECK), "--submissions", str(subs),
            "--out", str(out), "--device", "cpu", "--timeout", "120", *extra]


def _check_consistent(out: Path, expected: set[str]) -> None:
    """Every expected run has exactly one result; shape rows exactly for the passes; tables valid."""
    tables = load_all(out)
    results = tables["results"].to_pylist()
    assert sorted(r["run_id"] for r in results) == sorted(expected)
    shapes: dict[str, int] = {}
    for s in tables["shapes"].to_pylist():
        shapes[s["run_id"]] = shapes.get(s["run_id"], 0) + 1
    assert shapes == {r["run_id"]: r["n_shapes"] for r in results if r["n_shapes"]}
    assert _no_temp_files(out) == []


# ------------------------------------------------------------------------------------ one graded seed


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> Path:
    """A results folder with the CPU baselines of the problem (the session's) and one correct run graded."""
    root = tmp_path_factory.mktemp("seed")
    _write_sub(root / "subs", "seed_correct")
    measured_baselines.copy_into(root / "out", [PROBLEM], rep_ms=20.0)
    env = {**os.environ, "KERNELBOARD_LOCK_DIR": str(root)}
    proc = subprocess.run(_eval_args(root / "subs", root / "out"), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out"


def _copy_seed(seeded: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(seeded, out)
    return out


# -------------------------------------------------------------------------------- kill -9 (grading)


@pytest.mark.slow  # real `kernelboard eval` runs, killed
def test_kill_9_of_the_worker_is_a_status_and_the_batch_goes_on(seeded: Path, tmp_path: Path) -> None:
    out = _copy_seed(seeded, tmp_path)
    subs = tmp_path / "subs"
    _write_sub(subs, "a_victim", textwrap.dedent("""
        import time
        time.sleep(60)
    """))
    _write_sub(subs, "b_after", None, "rate_limited")
    proc = subprocess.Popen(_eval_args(subs, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    killed = False
    while not killed and time.monotonic() < deadline and proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            started = b"kernelboard.eval.worker" in cmd and any(c.endswith(b"a_victim.job.json") for c in cmd)
            forked = b"kernelboard.eval.zygote" in cmd and cwd.endswith("/a_victim")  # the zygote's cwd is /
            if started or forked:
                time.sleep(1.0)
                os.kill(int(pid), signal.SIGKILL)
                killed = True
                break
        time.sleep(0.1)
    output, _ = proc.communicate(timeout=300)
    assert killed and proc.returncode == 0, output[-2000:]
    rows = {r["run_id"]: r for r in load_all(out)["results"].to_pylist()}
    assert rows["a_victim"]["status"] == "runtime_error" and "SIGKILL" in rows["a_victim"]["message"]
    assert rows["b_after"]["status"] == "dnf"
    _check_consistent(out, {"seed_correct", "a_victim", "b_after"})


@pytest.mark.slow  # real `kernelboard eval` runs, killed
def test_kill_9_of_the_scheduler_at_a_random_point_then_resume_loses_and_duplicates_nothing(
        seeded: Path, tmp_path: Path) -> None:
    out = _copy_seed(seeded, tmp_path)
    subs = tmp_path / "subs"
    names = {"c1": CORRECT, "c2": CORRECT, "d1": None, "w1": "def Model(:\n", "d2": None}
    for name, source in names.items():
        _write_sub(subs, name, source, "rate_limited" if name.startswith("d") else "completed")
    proc = subprocess.Popen(_eval_args(subs, out), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    time.sleep(random.Random(os.getpid()).uniform(3.0, 15.0))
    os.killpg(proc.pid, signal.SIGKILL)  # the scheduler and the worker it was running
    proc.wait()
    again = subprocess.run(_eval_args(subs, out, "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    _check_consistent(out, {"seed_correct", *names})


@pytest.mark.slow  # real `kernelboard eval` runs at once
def test_two_evals_on_one_results_folder_at_once_lose_no_row(seeded: Path, tmp_path: Path) -> None:
    out = _copy_seed(seeded, tmp_path)
    subs = tmp_path / "subs"
    for name in ("x1", "x2", "y1", "y2"):
        _write_sub(subs, name, CORRECT if name.endswith("1") else None,
                   "completed" if name.endswith("1") else "rate_limited")
    procs = [subprocess.Popen(_eval_args(subs, out, "--only", f"{g}*"), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for g in ("x", "y")]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    _check_consistent(out, {"seed_correct", "x1", "x2", "y1", "y2"})


@pytest.mark.slow  # a real `kernelboard eval` run
def test_an_eval_and_a_merge_into_the_same_folder_at_once_lose_no_row(seeded: Path, tmp_path: Path) -> None:
    out = _copy_seed(seeded, tmp_path)
    other = tmp_path / "other"
    for i in range(20):
        upsert(table_path(other, "cpu", "runs"), "runs", [run_row(f"m{i:02d}", "rate_limited")])
    rows = [{**_dnf_result(f"m{i:02d}")} for i in range(20)]
    upsert(table_path(other, "cpu", "results"), "results", rows)
    subs = tmp_path / "subs"
    _write_sub(subs, "e1", CORRECT)
    _write_sub(subs, "e2", None, "rate_limited")
    proc = subprocess.Popen(_eval_args(subs, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    time.sleep(2.0)
    merged = subprocess.run([sys.executable, "-m", "kernelboard.cli", "eval", "merge", str(other), "--into", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = proc.communicate(timeout=600)[0]
    assert merged.returncode == 0 and proc.returncode == 0, (merged.stderr, output[-2000:])
    _check_consistent(out, {"seed_correct", "e1", "e2", *(f"m{i:02d}" for i in range(20))})


def test_cpu_grading_does_not_wait_for_a_held_gpu_lock(tmp_path: Path) -> None:
    from kernelboard.eval.sandbox import gpu_lock

    subs = tmp_path / "subs"
    _write_sub(subs, "dnf", None, "rate_limited")
    with gpu_lock("cpu"):  # another grader "holds the machine"
        proc = subprocess.run(_eval_args(subs, tmp_path / "out", "--unsandboxed"), cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 0 and "waiting" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------- tables, locks, journal


def _dnf_result(run_id: str) -> dict:
    return {"run_id": run_id, "gpu": "cpu", "status": "dnf", "message": "did not finish", "speedup_vs_compile": None,
            "speedup_vs_eager": None, "peak_fraction": None, "compile_variant": None, "n_shapes": 0,
            "timer": "cpu_wall", "device_name": "CPU: test", "driver_version": None, "cuda_version": None,
            "torch_version": None, "triton_version": None, "python_version": None, "graded_at": NOW,
            "grader_version": "0", "measured_by": "kernelboard 0", "seeds": None, "grade_seconds": None,
            "log_path": None}


def test_two_processes_upserting_one_table_at_once_lose_no_row(tmp_path: Path) -> None:
    procs = [_python(_UPSERT_MANY, str(tmp_path), prefix, "25") for prefix in ("a", "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert _run_ids(tmp_path) == [f"{p}{i:04d}" for p in "ab" for i in range(25)]


def test_kill_9_mid_upsert_keeps_a_whole_table_and_the_next_write_clears_its_temp_file(tmp_path: Path) -> None:
    upsert(table_path(tmp_path, "h200", "runs"), "runs", [run_row("first")])
    proc = _python(_UPSERT_MANY, str(tmp_path), "k", "100000")
    time.sleep(random.Random(1).uniform(1.5, 4.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ids = _run_ids(tmp_path)  # readable, valid: the previous table or the new one, never half of one
    assert ids[0] == "first" and ids[1:] == [f"k{i:04d}" for i in range(len(ids) - 1)]
    upsert(table_path(tmp_path, "h200", "runs"), "runs", [run_row("last")])
    assert _no_temp_files(tmp_path) == []


def test_kill_9_between_the_tables_of_one_graded_run_is_finished_by_the_next_writer(tmp_path: Path) -> None:
    code = """
        import os, sys
        sys.path.insert(0, "tests")
        from pathlib import Path
        from test_redteam_faults import run_row, _dnf_result
        import kernelboard.eval.tables as t
        real, calls = t._upsert_locked, []
        def dies_after_one(*a, **k):
            if calls:
                os._exit(9)  # killed after the first table of the three was written
            calls.append(1)
            return real(*a, **k)
        t._upsert_locked = dies_after_one
        t.upsert_together(Path(sys.argv[1]), "cpu", "r1", [
            ("shapes", [], {"run_id": "r1", "gpu": "cpu"}),
            ("runs", [run_row("r1", "rate_limited")], None),
            ("results", [_dnf_result("r1")], None)])
    """
    proc = _python(code, str(tmp_path))
    assert proc.wait(timeout=60) == 9
    assert not table_path(tmp_path, "cpu", "results").exists()  # half-applied: the result is not there yet
    assert finish_pending(tmp_path) == ["r1"]
    assert _run_ids(tmp_path, "results", "cpu") == ["r1"] and _run_ids(tmp_path, "runs", "cpu") == ["r1"]
    assert _no_temp_files(tmp_path) == []


def test_a_journal_entry_killed_before_its_commit_point_is_dropped(tmp_path: Path) -> None:
    entry = tmp_path / "cpu" / ".pending" / "r1"
    write_atomic(rows_to_table("runs", [run_row("r1")]), entry / "0.parquet")  # no manifest: never applied
    assert finish_pending(tmp_path) == []
    assert not entry.exists() and not table_path(tmp_path, "cpu", "runs").exists()


def test_disk_full_during_a_table_write_is_one_line_and_the_old_table_stays(tmp_path: Path) -> None:
    upsert(table_path(tmp_path, "h200", "runs"), "runs", [run_row("kept")])
    before = table_path(tmp_path, "h200", "runs").read_bytes()
    code = """
        import resource, sys
        sys.path.insert(0, "tests")
        from pathlib import Path
        from test_redteam_faults import run_row
        from kernelboard.errors import KernelboardError
        from kernelboard.eval.tables import table_path, upsert
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))  # every file past 2 KB: EFBIG, like a full disk
        try:
            upsert(table_path(Path(sys.argv[1]), "h200", "runs"), "runs",
                   [run_row(f"r{i:05d}") for i in range(2000)])
        except KernelboardError as exc:
            print(exc.message)
            sys.exit(3)
    """
    proc = _python(code, str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr
    assert stdout.count("\n") == 1 and "File too large" in stdout
    assert stdout.startswith(str(table_path(tmp_path, "h200", "runs")))
    assert table_path(tmp_path, "h200", "runs").read_bytes() == before
    assert _no_temp_files(tmp_path) == []


def test_a_writer_that_waits_says_for_whom_and_on_which_file(tmp_path: Path) -> None:
    code = """
        import sys, time
        from pathlib import Path
        from kernelboard.eval.tables import results_lock
        with results_lock(Path(sys.argv[1]), "a slow merge for the test"):
            print("held", flush=True)
            time.sleep(3)
    """
    holder = _python(code, str(tmp_path), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with pytest.warns(LockWaitWarning, match=r"waiting for a slow merge for the test \(pid \d+.*\) holding .*\.lock"):
        upsert(table_path(tmp_path, "h200", "runs"), "runs", [run_row("after")])
    assert time.monotonic() - started > 1.0
    holder.communicate(timeout=30)


def test_a_lock_whose_holder_was_killed_is_free_at_once(tmp_path: Path) -> None:
    code = """
        import os, sys
        from pathlib import Path
        from kernelboard.eval.tables import results_lock
        with results_lock(Path(sys.argv[1]), "a doomed writer"):
            os.kill(os.getpid(), 9)
    """
    assert _python(code, str(tmp_path)).wait(timeout=30) == -9
    with results_lock(tmp_path, "the next writer"):  # no stale lock: flock dies with its holder
        pass


def test_unwritable_lock_dir_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("KERNELBOARD_LOCK_DIR", str(tmp_path / "file" / "locks"))
    from kernelboard.errors import KernelboardError

    lock = tmp_path / "file" / "locks" / "kernelboard-results-x.lock"
    with pytest.raises(KernelboardError, match=r"file/locks/kernelboard-results-x\.lock: cannot create the lock"), \
            hold(lock, "t"):
        pass


# --------------------------------------------------------------------------------------------- merge


def _folder_with(root: Path, ids: list[str]) -> Path:
    for run_id in ids:
        upsert(table_path(root, "cpu", "runs"), "runs", [run_row(run_id, "rate_limited")])
        upsert(table_path(root, "cpu", "results"), "results", [_dnf_result(run_id)])
    return root


def test_two_merges_into_one_folder_at_once_lose_no_row(tmp_path: Path) -> None:
    a = _folder_with(tmp_path / "a", [f"a{i}" for i in range(15)])
    b = _folder_with(tmp_path / "b", [f"b{i}" for i in range(15)])
    dst = tmp_path / "dst"
    procs = [subprocess.Popen([sys.executable, "-m", "kernelboard.cli", "eval", "merge", str(src), "--into", str(dst)],
                              cwd=ROOT) for src in (a, b)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert sorted(_run_ids(dst, "results", "cpu")) == sorted(f"{p}{i}" for p in "ab" for i in range(15))


def test_a_merge_killed_at_a_random_point_leaves_valid_tables_and_a_rerun_completes_it(tmp_path: Path) -> None:
    src = _folder_with(tmp_path / "src", [f"s{i:02d}" for i in range(40)])
    dst = _folder_with(tmp_path / "dst", ["d0"])
    rng = random.Random(7)
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "kernelboard.cli", "eval", "merge", str(src),
                                 "--into", str(dst)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tables = load_all(dst)  # whatever point it died at, the folder keeps the contract
        assert {r["run_id"] for r in tables["results"].to_pylist()} <= {r["run_id"] for r in tables["runs"].to_pylist()}
    merge_results(src, dst)
    assert sorted(_run_ids(dst, "results", "cpu")) == ["d0", *(f"s{i:02d}" for i in range(40))]
    assert _no_temp_files(dst) == []


def test_the_next_merge_removes_a_table_a_killed_writer_left_half_written(tmp_path: Path) -> None:
    src = _folder_with(tmp_path / "src", ["s0"])
    dst = _folder_with(tmp_path / "dst", ["d0"])
    half = dst / "cpu" / ".results.parquet.k1ll3d.tmp"  # the name write_atomic's mkstemp gives
    half.write_bytes(b"PAR1 half a table")
    merge_results(src, dst)
    assert sorted(_run_ids(dst, "results", "cpu")) == ["d0", "s0"]
    assert _no_temp_files(dst) == []


def test_merge_removes_shape_rows_of_a_run_whose_winning_result_has_none(tmp_path: Path) -> None:
    src = _folder_with(tmp_path / "src", [])
    dst = tmp_path / "dst"
    upsert(table_path(dst, "cpu", "runs"), "runs", [run_row("r1")])
    failed = {**_dnf_result("r1"), "status": "wrong", "message": "out of tolerance"}
    upsert(table_path(dst, "cpu", "results"), "results", [failed])
    shape = {"run_id": "r1", "gpu": "cpu", "shape_idx": 0, "shape_label": "s", "shape_json": "{}", "median_ms": 1.0}
    upsert(table_path(dst, "cpu", "shapes"), "shapes", [shape])  # orphaned by an old, interrupted grading
    upsert(table_path(src, "cpu", "runs"), "runs", [run_row("r1")])
    earlier = {**failed, "graded_at": NOW - dt.timedelta(hours=1)}  # loses: the folder's own result wins
    upsert(table_path(src, "cpu", "results"), "results", [earlier])
    report = merge_results(src, dst)
    assert report["shapes"]["removed"] == 1
    assert read_table(table_path(dst, "cpu", "shapes"), "shapes").num_rows == 0


def test_a_source_table_lacking_a_column_is_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    src = _folder_with(tmp_path / "src", ["s1"])
    dst = _folder_with(tmp_path / "dst", ["d1"])
    path = table_path(src, "cpu", "results")
    pq.write_table(pq.read_table(path).drop_columns(["message"]), path)
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["eval", "merge", str(src), "--into", str(dst)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: {path}: missing column 'message' (string)" in result.output
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before


def test_a_corrupt_parquet_in_out_is_one_line_naming_it(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    _write_sub(subs, "dnf", None, "rate_limited")
    out = _folder_with(tmp_path / "out", ["old"])
    table_path(out, "cpu", "results").write_bytes(b"PAR1 this is not parquet PAR1")
    result = CliRunner().invoke(cli, ["eval", "--deck", str(DECK), "--submissions", str(subs), "--out", str(out),
                                      "--device", "cpu", "--unsandboxed", "--resume"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"{table_path(out, 'cpu', 'results')}: cannot read as parquet" in errors[0]


# ---------------------------------------------------------------------------------------- site build


def test_kill_9_of_site_build_at_random_points_always_leaves_a_site(fresh_inputs, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    args = [sys.executable, "-m", "kernelboard.cli", "site", "build", "--data", str(fresh_inputs.data_dir),
            "--decks", str(fresh_inputs.decks_dir), "--out", str(dist), "--force"]
    first = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    rng = random.Random(3)
    for _ in range(4):
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert (dist / "index.html").is_file() and (dist / ".kernelboard-site").is_file()
    last = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert last.returncode == 0 and (dist / "index.html").is_file()


def test_kill_9_in_the_middle_of_the_swap_never_leaves_no_site(tmp_path: Path) -> None:
    code = """
        import sys
        from pathlib import Path
        from kernelboard.sitegen.output import Workers, new_folder, swap_in
        out = Path(sys.argv[1])
        i = 0
        print("ready", flush=True)
        while True:
            new = new_folder(out)
            (new / "index.html").write_text(f"site {i}")
            swap_in(new, out, Workers(1))
            i += 1
    """
    dist = tmp_path / "dist"
    rng = random.Random(5)
    for _ in range(5):
        proc = _python(code, str(dist), stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert (dist / "index.html").read_text().startswith("site ")

"""A run a batch was cut off in is remembered and graded last (`eval/interrupted.py`).

On the H200 on 2026-12-03 one kernel whose Triton compile runs for minutes (MiniMax-M3's 07) was
first in the queue of two GPU calls in a row and filled the second whole. These tests cut a real
`kernelboard eval` batch off with SIGINT, as a call's deadline does, and grade again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grading import MeasuredBaselines, write_submission

from kernelboard.eval.deck import load_deck
from kernelboard.eval.interrupted import (
    Interruption,
    add_interruption,
    graded_last,
    merged_records,
    read_records,
    record_of,
    records_path,
    without_graded,
    write_records,
)
from kernelboard.eval.merge import merge_results
from kernelboard.eval.schedule import (
    EvalOptions,
    QuickestPass,
    _cached_baselines,
    baselines_todo,
    no_time_for,
    quickest_passes,
    run_eval,
    too_late,
)
from kernelboard.eval.settings import HOLD_BACK_AFTER_S
from kernelboard.eval.tables import read_table, table_path, upsert

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "hard"
PROBLEM = "03_paged_attention"
GPU = "cpu"

STALLS = """\
import threading
import reference


class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        threading.Event().wait()
"""
HONEST = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"


def _record(sha: str = "s1", times: int = 1, seconds: float = 10.0) -> Interruption:
    return Interruption(sha, times, seconds, "correctness", "2026-12-03T07:21:00+00:00")


def test_interrupted_runs_go_last_least_run_first_and_the_rest_keep_their_order() -> None:
    records = {"a": _record(seconds=500.0), "c": _record(seconds=200.0), "e": _record(sha="old", seconds=300.0),
               "f": _record(seconds=200.0), "g": _record(seconds=119.0)}
    items = ["a", "b", "c", "d", "e", "f", "g"]  # every solution "s1": e's changed since its record, not held back
    assert record_of(records, "e", "s1") is None and record_of(records, "a", "s1") == records["a"]
    # g was cut within HOLD_BACK_AFTER_S (120 s): where a call's deadline fell, so it keeps its place
    assert HOLD_BACK_AFTER_S == 120.0 and not records["g"].outlasts_a_call and records["c"].outlasts_a_call

    def held(run_id: str) -> Interruption | None:  # as the batch holds runs back
        record = record_of(records, run_id, "s1")
        return record if record is not None and record.outlasts_a_call else None

    assert graded_last(items, held) == ["b", "d", "e", "g", "c", "f", "a"]


def test_a_record_counts_interruptions_of_one_solution_and_restarts_for_a_new_one() -> None:
    records = add_interruption({}, "a", "s1", 120.04, "its prebuild", "t1")
    records = add_interruption(records, "a", "s1", 30.0, "correctness", "t2")
    assert records["a"] == Interruption("s1", 2, 150.0, "correctness", "t2")
    assert add_interruption(records, "a", "s2", 5.0, "timing", "t3")["a"].times == 1
    assert records["a"].summary() == "interrupted 2 times (150 s in all; last in 'correctness')"
    assert without_graded(records, {"a": "s1"}) == {}
    assert without_graded(records, {"a": "s2"}) == records  # a grading of another solution clears nothing


def test_merging_keeps_the_record_that_saw_more_interruptions() -> None:
    seeded = {"a": _record(times=1, seconds=100.0)}
    carried_on = {"a": _record(times=2, seconds=400.0), "b": _record()}
    merged = merged_records(seeded, carried_on)
    assert merged["a"].times == 2 and merged["a"].seconds == 400.0 and "b" in merged
    assert merged_records(carried_on, seeded)["a"].times == 2


def test_an_unreadable_record_file_is_named_and_ignored(tmp_path: Path) -> None:
    path = records_path(tmp_path, GPU)
    path.parent.mkdir(parents=True)
    path.write_text('{"a": {"times": "many"}}')
    records, warning = read_records(tmp_path, GPU)
    assert records == {}
    assert warning is not None and str(path) in warning and "ignored" in warning
    write_records(tmp_path, GPU, {})
    assert not path.exists()


def _write_stalled_and_honest(subs: Path) -> None:
    """a_stalls (its forward never returns) and b_honest (the reference), run ids in that order."""
    for name, source in (("a_stalls", STALLS), ("b_honest", HONEST)):
        write_submission(subs / name, PROBLEM, source)


@pytest.fixture(scope="module")
def cut_off(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> Path:
    """A real batch (`kernelboard eval --device cpu`) of a_stalls (its forward never returns) and
    b_honest, SIGINTed while it grades a_stalls, which sorts first."""
    root = tmp_path_factory.mktemp("interrupted")
    _write_stalled_and_honest(root / "submissions")
    measured_baselines.copy_into(root / "results", [PROBLEM], rep_ms=20.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kernelboard.cli import main; main()", "eval", "--deck", str(DECK),
         "--submissions", str(root / "submissions"), "--out", str(root / "results"), "--device", "cpu",
         "--resume", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    log = root / "results" / GPU / "logs" / "a_stalls.log"
    deadline = time.monotonic() + 120
    while "Model built" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2.0)  # well inside its stalled first call
    os.kill(proc.pid, signal.SIGINT)  # the grader only, as `timeout -s INT` signals it
    out, _ = proc.communicate(timeout=60)
    (root / "first-batch.txt").write_bytes(out)
    return root


def test_the_batch_cut_off_records_the_run_it_was_grading(cut_off: Path) -> None:
    records, warning = read_records(cut_off / "results", GPU)
    assert warning is None, warning
    assert list(records) == ["a_stalls"], (cut_off / "first-batch.txt").read_text()[-2000:]
    entry = records["a_stalls"]
    assert entry.times == 1 and entry.seconds >= 2.0
    assert entry.phase != "its prebuild"  # it was in the worker, past its build
    raw = json.loads(records_path(cut_off / "results", GPU).read_text())
    assert raw["a_stalls"]["solution_sha256"] == entry.solution_sha256


def _next_batch(cut_off: Path, results: Path, stop_at: float | None = None) -> list[dict]:
    return run_eval(EvalOptions(deck=DECK, submissions=cut_off / "submissions", out=results, device="cpu",
                                resume=True, timeout_s=15.0, build_timeout_s=10.0, rep_ms=20.0, stop_at=stop_at))


def test_a_run_cut_off_soon_after_it_started_keeps_its_place(cut_off: Path, tmp_path: Path) -> None:
    """a_stalls was cut a few seconds in: where the deadline fell, not a run that outlasts a call (on an
    H100 on 2026-12-05 five of six held runs had been cut 8–58 s in, and never came up again)."""
    results = tmp_path / "results"
    shutil.copytree(cut_off / "results", results)
    assert read_records(results, GPU)[0]["a_stalls"].seconds < HOLD_BACK_AFTER_S
    rows = _next_batch(cut_off, results)
    assert [(r["run_id"], r["status"]) for r in rows] == [("a_stalls", "timeout"), ("b_honest", "pass")]
    assert read_records(results, GPU) == ({}, None)  # graded whole: its record is gone


def test_a_held_run_too_long_for_what_is_left_is_not_started_and_keeps_its_record(cut_off: Path,
                                                                                  tmp_path: Path) -> None:
    """Before the next test, which grades the shared folder in place."""
    results = tmp_path / "results"
    shutil.copytree(cut_off / "results", results)
    cut = read_records(results, GPU)[0]["a_stalls"]
    held = Interruption(cut.solution_sha256, 1, 400.0, "correctness", cut.last_at)  # a long first call's cut
    write_records(results, GPU, {"a_stalls": held})
    rows = _next_batch(cut_off, results, stop_at=time.time() + 120)  # b_honest fits; a_stalls' 400 s do not
    assert [(r["run_id"], r["status"]) for r in rows] == [("b_honest", "pass")]
    assert read_records(results, GPU) == ({"a_stalls": held}, None)  # not graded, not cut: the record stands


def test_no_run_starts_where_even_its_problems_quickest_pass_would_be_cut(cut_off: Path, tmp_path: Path) -> None:
    """A run with no record of its own is not started where the batch ends before the quickest pass of its
    problem on this GPU would have: it would be cut with its GPU time spent for nothing. It stays to grade."""
    results = tmp_path / "results"
    shutil.copytree(cut_off / "results", results)
    cut = read_records(results, GPU)[0]["a_stalls"]
    write_records(results, GPU, {"a_stalls": Interruption(cut.solution_sha256, 1, 400.0, "correctness", cut.last_at)})
    assert [r["status"] for r in _next_batch(cut_off, results, stop_at=time.time() + 120)] == ["pass"]  # b_honest
    quickest = quickest_passes(results, GPU)
    assert list(quickest) == [PROBLEM] and quickest[PROBLEM].seconds > 0 and quickest[PROBLEM].gpu == GPU
    subs = tmp_path / "submissions"
    shutil.copytree(cut_off / "submissions", subs)
    shutil.copytree(subs / "b_honest", subs / "c_honest")
    options = EvalOptions(deck=DECK, submissions=subs, out=results, device="cpu", resume=True, timeout_s=15.0,
                          build_timeout_s=10.0, rep_ms=20.0, stop_at=time.time() + quickest[PROBLEM].seconds / 2)
    assert run_eval(options) == []  # c_honest not started; a_stalls held back as before
    todo = {r["run_id"] for r in read_table(table_path(results, GPU, "results"), "results").to_pylist()}
    assert "c_honest" not in todo
    why = no_time_for(PROBLEM, QuickestPass(85.0, GPU), 1050.0, GPU, now=1000.0)
    assert why == (f"the quickest pass of {PROBLEM} here took 85 s, and this batch ends in 50 s (--stop-at): "
                   "a later call grades it")
    assert no_time_for(PROBLEM, QuickestPass(85.0, GPU), 1085.0, GPU, now=1000.0) is None
    assert no_time_for(PROBLEM, None, 1.0, GPU, now=0.0) is None
    assert no_time_for(PROBLEM, QuickestPass(85.0, GPU), None, GPU) is None
    # a problem with no pass on this GPU yet is timed by its quickest on another (on 2026-12-06 an H100 call
    # started 01, with no pass there, 86 s before its end); this GPU's own pass wins once it has one
    other = tmp_path / "other"
    shutil.copytree(results / GPU, other / "h200")
    assert quickest_passes(other, GPU)[PROBLEM] == QuickestPass(quickest[PROBLEM].seconds, "h200")
    theirs = read_table(table_path(other, "h200", "results"), "results").to_pylist()
    quicker = [{**r, "grade_seconds": 1.0} for r in theirs]
    upsert(table_path(results, "h200", "results"), "results", quicker)
    shutil.copy2(table_path(other, "h200", "runs"), table_path(results, "h200", "runs"))
    assert quickest_passes(results, GPU)[PROBLEM] == quickest[PROBLEM]
    assert quickest_passes(results, "h200")[PROBLEM] == QuickestPass(1.0, "h200")
    why = no_time_for(PROBLEM, QuickestPass(27.0, "h200"), 1010.0, GPU, now=1000.0)
    assert why == (f"the quickest pass of {PROBLEM} on h200 (none here yet) took 27 s, and this batch ends in "
                   "10 s (--stop-at): a later call grades it")


def test_the_next_batch_grades_a_long_one_last_and_forgets_it_once_graded(cut_off: Path, tmp_path: Path) -> None:
    results = cut_off / "results"
    records, _ = read_records(results, GPU)
    long = records["a_stalls"]
    write_records(results, GPU, {"a_stalls": Interruption(long.solution_sha256, long.times, HOLD_BACK_AFTER_S,
                                                          long.phase, long.last_at)})  # as a long build's cut
    before = tmp_path / "before"  # the folder as the cut-off batch left it, merged afterwards
    shutil.copytree(results, before)
    rows = _next_batch(cut_off, results)
    assert [r["run_id"] for r in rows] == ["b_honest", "a_stalls"]
    assert [r["status"] for r in rows] == ["pass", "timeout"]
    assert read_records(results, GPU) == ({}, None)  # graded whole: a timeout is a verdict
    # merging the earlier copy back brings no stale record: the merged tables hold a grading of it
    merge_results(before, results)
    assert read_records(results, GPU) == ({}, None)
    statuses = {r["run_id"]: r["status"] for r in read_table(table_path(results, GPU, "results"),
                                                              "results").to_pylist()}
    assert statuses == {"b_honest": "pass", "a_stalls": "timeout"}


def test_a_held_run_is_started_only_where_an_attempt_fits_before_the_batch_ends() -> None:
    record = Interruption("sha", 2, 700.0, "correctness", "2026-12-06T05:04:29+00:00")  # 350 s an attempt
    assert too_late(None, 1000.0, now=0.0) is None  # not held: it goes whatever is left
    assert too_late(record, None, now=0.0) is None  # no --stop-at: nothing is known of the batch's end
    assert too_late(record, 350.0, now=0.0) is None  # an attempt fits
    why = too_late(record, 1349.0, now=1000.0)
    assert why == ("interrupted 2 times (700 s in all; last in 'correctness'), 350 s an attempt, and this batch "
                   "ends in 349 s (--stop-at): a call that starts with it grades it")
    assert too_late(record, 900.0, now=1000.0).endswith("ends in 0 s (--stop-at): a call that starts with it grades it")
    assert too_late(record, 1349.0, now=1000.0, started=900.0).endswith("a call that starts with it grades it")
    # MiniMax-M3 02 064019 on an H100, 2026-12-07: one attempt of 520.7 s, and every call 495 s after its setup
    never = too_late(Interruption("sha", 1, 520.7, "correctness", "2026-12-06T07:30:44+00:00"), 1495.0, now=1000.0,
                     started=1000.0)
    assert never == ("interrupted once (521 s in all; last in 'correctness'), 521 s an attempt, more than this whole "
                     "batch had (495 s from its start to --stop-at): a batch given 521 s or more grades it "
                     "(bench/gpu_session.sh: IDS naming it alone, and a DEADLINE that leaves that much after "
                     "the setup)")


@pytest.mark.slow  # `kernelboard eval --gpus` end to end, cut off
def test_a_parallel_batch_cut_off_merges_what_its_children_finished(tmp_path: Path,
                                                                  measured_baselines: MeasuredBaselines) -> None:
    """`--gpus a,b`: one child grades an honest run, the other stalls. SIGINT to the grader (as a GPU
    call's deadline sends it) reaches each child once; --out gets the finished row and the record of the
    stalled run, where before they stayed in the children's folders, which a GPU session never packed."""
    _write_stalled_and_honest(tmp_path / "subs")
    out = tmp_path / "results"
    measured_baselines.copy_into(out, [PROBLEM], rep_ms=20.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kernelboard.cli", "eval", "--device", "cpu", "--gpus", "a,b", "--deck", str(DECK),
         "--submissions", str(tmp_path / "subs"), "--out", str(out), "--timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300

    def reached() -> bool:
        logs = [p.read_text() for p in tmp_path.glob(f".{out.name}.gpu*/{GPU}/logs/a_stalls.log")]
        finished = [p for p in tmp_path.glob(f".{out.name}.gpu*/{GPU}/results.parquet")
                    if "b_honest" in {r["run_id"] for r in read_table(p, "results").to_pylist()}]
        return any("Model built" in text for text in logs) and bool(finished)

    while not reached() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    time.sleep(2.0)
    os.kill(proc.pid, signal.SIGINT)
    said = proc.communicate(timeout=120)[0].decode(errors="replace")
    assert proc.returncode != 0 and "stopping 1 grader" in said, said[-3000:]
    statuses = {r["run_id"]: r["status"] for r in read_table(table_path(out, GPU, "results"), "results").to_pylist()}
    assert statuses == {"b_honest": "pass"}, said[-3000:]  # on the CPU the re-exported reference passes
    records, _ = read_records(out, GPU)
    assert list(records) == ["a_stalls"] and records["a_stalls"].phase != "its prebuild", said[-3000:]


def test_a_cut_off_grading_counts_its_build_too(tmp_path: Path) -> None:
    """What decides whether a run is held back is its whole cost: a build of 300 s that ended before the
    GPU took the run, plus the grading it was cut in (the same build still running when it was taken
    counts up to that moment; the wait after is the grading's)."""
    from kernelboard.eval.sandbox import Prebuild
    from kernelboard.eval.schedule import _recorded_if_cut_off
    from kernelboard.eval.submission import load_submission

    sub = load_submission(write_submission(tmp_path / "subs" / "a_built", PROBLEM, HONEST))
    now = time.monotonic()
    ended = Prebuild(None, now - 400.0, -1, ended=now - 100.0)  # type: ignore[arg-type]
    running = Prebuild(None, now - 50.0, -1)  # type: ignore[arg-type]
    for name, build, least in (("ended", ended, 300.0), ("running", running, 50.0), ("none", None, 0.0)):
        out = tmp_path / name
        with pytest.raises(KeyboardInterrupt), _recorded_if_cut_off(out, GPU, sub, now, ["timing"], build):
            raise KeyboardInterrupt
        seconds = read_records(out, GPU)[0]["a_built"].seconds
        assert least <= seconds < least + 5.0, (name, seconds)


def test_baselines_cut_off_keep_the_rows_measured_and_the_next_batch_measures_only_the_rest(tmp_path: Path) -> None:
    """A call's deadline that falls while a problem's baselines are measured keeps each row finished (an H100
    call of 2026-12-06 began 01's baselines 86 s before its end and kept none of them)."""
    write_submission(tmp_path / "submissions" / "any", PROBLEM, HONEST)
    results, scratch = tmp_path / "results", tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kernelboard.cli import main; main()", "eval", "--deck", str(DECK),
         "--submissions", str(tmp_path / "submissions"), "--out", str(results), "--device", "cpu",
         "--baselines-only"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "TMPDIR": str(scratch)})  # where the batch's worker checkpoints its rows
    log = results / GPU / "logs" / f"baselines-hard-{PROBLEM}.log"
    deadline = time.monotonic() + 240
    while not any(scratch.glob(f"*/baselines-{PROBLEM}.checkpoint.json")) \
            and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]  # still measuring the rest
    os.kill(proc.pid, signal.SIGINT)  # the grader only, as `timeout -s INT` signals it
    out, _ = proc.communicate(timeout=60)
    problem = load_deck(DECK)[PROBLEM]
    options = EvalOptions(deck=DECK, submissions=tmp_path / "submissions", out=results, device="cpu")
    every = sum(map(len, baselines_todo(options, problem, {}).values()))
    kept = read_table(table_path(results, GPU, "baselines"), "baselines").to_pylist()
    assert 1 <= len(kept) < every, out.decode()[-2000:]
    assert (0, "eager", "ok") in {(r["shape_idx"], r["variant"], r["status"]) for r in kept}  # the first measured
    assert f"[grader] interrupted: {len(kept)} of the {every} rows measured are kept" in log.read_text()
    rest = baselines_todo(options, problem, _cached_baselines(results, GPU, problem, None))
    assert sum(map(len, rest.values())) == every - len(kept)
    assert "eager" not in rest["0"]

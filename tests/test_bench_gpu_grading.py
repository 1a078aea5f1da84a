"""bench/gpu_grading.py: its figures from synthetic gradings, its one-line argument errors, and one
end-to-end run on the CPU of a tiny submission graded twice (the GPU run is the bench itself)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from grading import REEXPORT, copy_deck, write_submission
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_grading.py"

_spec = importlib.util.spec_from_file_location("gpu_grading", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["gpu_grading"] = bench  # dataclasses look their module up while the class is made
_spec.loader.exec_module(bench)


def _grading(round_: int, shape_ms: dict[int, float], headline: float | None, *, status: str = "pass",
             lane: str = "fidelity", run_id: str = "house_03", problem: str = "03_paged_attention",
             seconds: float | None = 40.0, message: str = "correct") -> bench.Grading:
    return bench.Grading(lane=lane, device="0" if lane == "fidelity" else "1", run_id=run_id, problem=problem,
                         round=round_, status=status, message=message, speedup_vs_compile=headline,
                         grade_seconds=seconds, shape_ms=shape_ms, shape_labels={i: f"s{i}" for i in shape_ms},
                         wall_s=50.0, exit_code=0, log="log")


def _render(table) -> str:
    console = Console(file=io.StringIO(), width=140, color_system=None, legacy_windows=False)
    console.print(table)
    return console.file.getvalue()


def test_spread_is_max_over_min_minus_one() -> None:
    assert bench.spread([100.0, 103.0, 101.0]) == pytest.approx(0.03)
    assert bench.spread([2.0]) is None
    assert bench.spread([]) is None
    with pytest.raises(ValueError, match=r"positive finite values, got \[0.0\]"):
        bench.spread([1.0, 0.0])


def test_only_shapes_of_20_us_or_more_are_held_to_3_percent() -> None:
    gradings = [_grading(1, {0: 0.030, 1: 0.010, 2: 0.100}, 6.00),
                _grading(2, {0: 0.031, 1: 0.012, 2: 0.101}, 6.10),
                _grading(3, {0: 0.0305, 1: 0.011, 2: 0.1005}, 6.05)]
    [fig] = bench.fidelity_figures(gradings)
    by_idx = {s.shape_idx: s for s in fig.shapes}
    assert by_idx[0].spread == pytest.approx(0.031 / 0.030 - 1) and by_idx[0].ok is False  # 3.3%: flagged
    assert by_idx[1].judged is False and by_idx[1].ok is None  # 20% but 11 µs: not judged
    assert by_idx[2].ok is True
    assert fig.headline_spread == pytest.approx(6.10 / 6.00 - 1) and fig.headline_ok is True
    text = _render(bench.fidelity_table(fig, "fidelity"))
    assert "30.00 µs" in text and "31.00 µs" in text and "3.3%" in text and "over 3%" in text
    assert "< 20 µs: not judged" in text and "6.10×" in text and "ok (≤ 2%)" in text


def test_a_grading_that_did_not_pass_is_a_finding_and_has_no_times() -> None:
    gradings = [_grading(1, {0: 0.050}, 6.0), _grading(2, {}, None, status="integrity_violation",
                                                       message="the judge's clock disagrees"),
                _grading(3, {0: 0.0502}, 6.3)]
    [fig] = bench.fidelity_figures(gradings)
    assert fig.statuses == ["pass", "integrity_violation", "pass"]
    assert fig.shapes[0].median_ms == [0.050, None, 0.0502] and fig.shapes[0].ok is True
    assert fig.headline == [6.0, None, 6.3] and fig.headline_ok is False  # 5% between the two that passed
    assert bench.findings(gradings) == ["fidelity #2 house_03 on GPU 0: integrity_violation — "
                                        "the judge's clock disagrees"]
    assert "integrity_violation" in _render(bench.fidelity_table(fig, "fidelity"))


def test_grade_time_is_the_median_per_problem_against_the_original_harness() -> None:
    gradings = [_grading(1, {}, 6.0, seconds=40.0), _grading(2, {}, 6.0, seconds=50.0),
                _grading(3, {}, 6.0, seconds=45.0),
                _grading(1, {}, 2.0, lane="load", run_id="house_06", problem="06_sonic_moe_swiglu", seconds=200.0),
                _grading(1, {}, None, lane="load", run_id="ref_05", problem="05_topk_bitonic", seconds=8.0,
                         status="wrong"),
                _grading(1, {}, None, lane="load", run_id="dnf", problem="07_w4a16_gemm", seconds=None,
                         status="dnf")]
    figures = {f.problem: f for f in bench.grade_time_figures(gradings, "cuda")}
    assert set(figures) == {"03_paged_attention", "05_topk_bitonic", "06_sonic_moe_swiglu"}  # none timed for 07
    paged = figures["03_paged_attention"]
    assert (paged.median_s, paged.original_s, paged.target_s, paged.met) == (45.0, 106.0, 53.0, True)
    assert figures["06_sonic_moe_swiglu"].target_s == 150.0 and figures["06_sonic_moe_swiglu"].met is False
    refused = figures["05_topk_bitonic"]  # 8 s, but refused: no grading that passed to hold to the target
    assert (refused.median_s, refused.passed, refused.median_pass_s, refused.met) == (8.0, 0, None, None)
    text = _render(bench.grade_time_table(list(figures.values()), "grade time"))
    assert "106" in text and "≤ 53.0" in text and "missed" in text and "≤ 150.0" in text
    on_cpu = bench.grade_time_figures(gradings, "cpu")
    assert all(f.met is None for f in on_cpu)  # CPU seconds are not held to GPU targets


def test_the_summary_is_json_with_every_figure() -> None:
    gradings = [_grading(1, {0: 0.05}, 6.0), _grading(2, {0: 0.051}, 6.1)]
    data = json.loads(json.dumps(bench.summary("cuda", ["0", "1"], gradings), sort_keys=True))
    assert data["gpus"] == ["0", "1"] and data["targets"]["headline_spread_max"] == 0.02
    assert data["fidelity"][0]["shapes"][0]["spread"] == pytest.approx(0.02)
    assert data["grade_time"][0]["median_s"] == 40.0 and len(data["gradings"]) == 2 and data["findings"] == []


def _busy_children() -> int:
    """This process's children running the busy loop (read from /proc)."""
    found = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"while True: pass" in (stat.parent / "cmdline").read_bytes():
                found += 1
    return found


def test_cpu_load_keeps_busy_processes_only_while_the_gradings_run() -> None:
    """`--cpu-load N` on a one-GPU host: N busy loops during the gradings, none left after (an
    exception inside included); the JSON summary says how many."""
    with bench.busy_host(2):
        assert _busy_children() == 2
    assert _busy_children() == 0
    with pytest.raises(RuntimeError), bench.busy_host(1):
        raise RuntimeError("a grading failed")
    assert _busy_children() == 0
    assert bench.summary("cuda", ["0"], [], cpu_load=4)["cpu_load"] == 4


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "0,0"], "--gpus: expected one or two distinct device indices like 0,1, got '0,0'"),
    (["--gradings", "1"], "1 is not in the range x>=2"),
    (["--device", "cpu", "--gpus", "0"], "--gpus is for --device cuda"),
    (["--gpus", "0", "--load-only", "*"], "--load-only needs a second GPU"),
    (["--fidelity-run", "no-such-run*"], "--fidelity-run 'no-such-run*': no submission under"),
])
def test_a_bad_argument_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("gpu_grading.py: error: ")
    assert message in proc.stderr


@pytest.mark.slow  # the bench script end to end
def test_a_cpu_run_grades_a_tiny_submission_twice_and_never_writes_into_results(tmp_path: Path) -> None:
    deck = copy_deck(tmp_path, ("07_w4a16_gemm",))
    write_submission(tmp_path / "subs" / "tiny", "07_w4a16_gemm", REEXPORT)
    results = tmp_path / "results"
    results.mkdir()
    summary = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--deck", str(deck), "--submissions",
                           str(tmp_path / "subs"), "--results", str(results), "--fidelity-run", "tiny",
                           "--gradings", "2", "--work", str(tmp_path / "work"), "--json", str(summary)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(results.iterdir()) == []  # baselines went to the seed copy
    data = json.loads(summary.read_text())
    assert [g["status"] for g in data["gradings"]] == ["pass", "pass"] and data["findings"] == []
    [fig] = data["fidelity"]
    assert fig["run_id"] == "tiny" and [s["shape_idx"] for s in fig["shapes"]] == [0, 1]
    assert all(len(s["median_ms"]) == 2 and s["spread"] is not None for s in fig["shapes"])
    assert data["grade_time"][0]["problem"] == "07_w4a16_gemm" and data["grade_time"][0]["gradings"] == 2
    assert "fidelity: tiny, 2 gradings" in proc.stdout and "grade time per submission" in proc.stdout
    assert (tmp_path / "work" / "seed" / "cpu" / "baselines.parquet").exists()
    assert sorted(p.name for p in (tmp_path / "work" / "logs").iterdir()) == [
        "fidelity-1-tiny.log", "fidelity-2-tiny.log", "seed-baselines.log"]


def _sigint_as_at_a_terminal() -> None:
    """SIGINT's default disposition in the bench: a test run started in the background by a shell without job
    control inherits SIGINT ignored, and the bench (rightly, like any program) would then ignore it too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # the bench script end to end
def test_an_interrupted_run_still_reports_the_gradings_that_finished(tmp_path: Path) -> None:
    """A device's time limit interrupts the bench (SIGINT here; SIGTERM is handled alike): the grading
    then running is stopped, the one that finished is printed and written, and the exit is 130."""
    deck = copy_deck(tmp_path, ("07_w4a16_gemm",))
    write_submission(tmp_path / "subs" / "tiny", "07_w4a16_gemm", REEXPORT)
    summary = tmp_path / "summary.json"
    (tmp_path / "results").mkdir()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--deck", str(deck), "--submissions",
                             str(tmp_path / "subs"), "--results", str(tmp_path / "results"), "--fidelity-run", "tiny",
                             "--gradings", "3", "--json", str(summary)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=_sigint_as_at_a_terminal)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # progress lines: the first grading's result, then the second one's start
        seen.append(line)
        if "grading tiny #2/3" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(seen) + err
    assert "interrupted: the calls still running are stopped; the 1 that finished are reported" in err
    data = json.loads(summary.read_text())
    assert data["interrupted"] is True and [g["status"] for g in data["gradings"]] == ["pass"]
    assert "fidelity: tiny, 1 grading on" in out and "gpu_grading.py: interrupted" in err

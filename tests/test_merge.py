"""`kernelboard eval merge`: folders graded apart become one, the later measurement winning.

Built on the committed H200 tables (real gradings) with a few rows moved in time, so every rule
is exercised on the real schema: a later regrade replaces, a stale copy is kept out, a run only
one side has is added, the merge is order-independent, and bad input changes nothing.
"""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from kernelboard.cli import main
from kernelboard.errors import DataError
from kernelboard.eval.merge import merge_results
from kernelboard.eval.tables import load_all, read_table, rows_to_table, table_path, write_atomic

REAL = Path(__file__).resolve().parents[1] / "data" / "results"
GPU = "h200"
PAGED = "20261129_190000_house_kernelboard-house_03_paged_attention"
FP8 = "20261129_190000_house_kernelboard-house_01_fp8_gemm"
W4_V3 = "20261130_031500_house_kernelboard-house_07_w4a16_gemm"
HOUR = dt.timedelta(hours=1)


def _edit(results: Path, name: str, change: Callable[[list[dict]], list[dict]]) -> None:
    path = table_path(results, GPU, name)
    write_atomic(rows_to_table(name, change(read_table(path, name).to_pylist())), path)


def _regraded(run_id: str, delta: dt.timedelta, message: str) -> Callable[[list[dict]], list[dict]]:
    """Results rows: `run_id` graded `delta` later (earlier if negative), with a telling message."""
    def change(rows: list[dict]) -> list[dict]:
        for r in rows:
            if r["run_id"] == run_id:
                r["graded_at"], r["message"] = r["graded_at"] + delta, message
        return rows
    return change


def _slower(run_id: str, factor: float) -> Callable[[list[dict]], list[dict]]:
    """Shape rows: `run_id`'s medians × `factor`."""
    def change(rows: list[dict]) -> list[dict]:
        for r in rows:
            if r["run_id"] == run_id:
                r["median_ms"] *= factor
        return rows
    return change


def _by_run(results: Path, name: str) -> dict[tuple, dict]:
    return {(r["run_id"], r.get("shape_idx")): r
            for r in read_table(table_path(results, GPU, name), name).to_pylist()}


def _all_results() -> int:
    """Result rows of every GPU folder of the committed tables (imported boards included)."""
    return load_all(REAL)["results"].num_rows


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """src: 03 regraded an hour later (shapes 10% slower), 01 a stale copy from a day before.
    dst: the committed tables without 07's v3 run."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(REAL, src)
    shutil.copytree(REAL, dst)
    _edit(src, "results", _regraded(PAGED, HOUR, "regraded later"))
    _edit(src, "shapes", _slower(PAGED, 1.1))
    _edit(src, "results", _regraded(FP8, -24 * HOUR, "stale copy"))
    for name in ("results", "shapes", "runs"):
        _edit(dst, name, lambda rows: [r for r in rows if r["run_id"] != W4_V3])
    (dst / GPU / "logs" / f"{W4_V3}.log").unlink()
    return src, dst


def test_the_later_grading_wins_and_a_run_only_one_side_has_is_added(folders: tuple[Path, Path]) -> None:
    src, dst = folders
    report = merge_results(src, dst)
    assert report["results"] == {"added": 1, "replaced": 1, "kept": _all_results() - 2}
    results, shapes = _by_run(dst, "results"), _by_run(dst, "shapes")
    assert results[(PAGED, None)]["message"] == "regraded later"
    original = _by_run(REAL, "shapes")
    assert all(shapes[(PAGED, i)]["median_ms"] == pytest.approx(original[(PAGED, i)]["median_ms"] * 1.1)
               for i in range(5))
    assert results[(FP8, None)]["message"] != "stale copy"
    assert (W4_V3, None) in results and len([k for k in shapes if k[0] == W4_V3]) == 5
    assert (dst / GPU / "logs" / f"{W4_V3}.log").exists()
    assert W4_V3 in {r["run_id"] for r in read_table(table_path(dst, GPU, "runs"), "runs").to_pylist()}


def test_the_order_of_merging_does_not_matter(folders: tuple[Path, Path], tmp_path: Path) -> None:
    src, dst = folders
    src_copy, dst_copy = tmp_path / "src2", tmp_path / "dst2"
    shutil.copytree(src, src_copy)
    shutil.copytree(dst, dst_copy)
    merge_results(src, dst)
    merge_results(dst_copy, src_copy)
    for name in ("runs", "results", "shapes", "baselines", "hardware"):
        assert read_table(table_path(dst, GPU, name), name).equals(read_table(table_path(src_copy, GPU, name), name))


def test_a_later_baseline_replaces_and_its_log_part_is_appended_once(folders: tuple[Path, Path]) -> None:
    src, dst = folders
    key = ("07_w4a16_gemm", 2, "compile:default")

    def later(rows: list[dict]) -> list[dict]:
        for r in rows:
            if (r["problem"], r["shape_idx"], r["variant"]) == key:
                r["measured_at"] += HOUR
                r["median_ms"] = 0.5
        return rows

    _edit(src, "baselines", later)
    part = "=== 2026-12-01 00:00:00 UTC, kernelboard 0.2.2 on NVIDIA H200: measuring 1 baseline rows ===\n" \
           "[baseline] shape 2 compile:default: 0.5000 ms\n"
    with (src / GPU / "logs" / "baselines-hard-07_w4a16_gemm.log").open("a") as fh:
        fh.write(part)
    assert merge_results(src, dst)["baselines"]["replaced"] == 1
    merge_results(src, dst)  # a second merge adds nothing
    rows = read_table(table_path(dst, GPU, "baselines"), "baselines").to_pylist()
    assert [r["median_ms"] for r in rows if (r["problem"], r["shape_idx"], r["variant"]) == key] == [0.5]
    log = (dst / GPU / "logs" / "baselines-hard-07_w4a16_gemm.log").read_text()
    committed = (REAL / GPU / "logs" / "baselines-hard-07_w4a16_gemm.log").read_text()
    assert log.count(part) == 1 and log.startswith(committed)


def test_a_broken_source_is_named_and_nothing_is_written(folders: tuple[Path, Path]) -> None:
    src, dst = folders
    table_path(src, GPU, "shapes").write_bytes(b"not parquet")
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    with pytest.raises(DataError) as err:
        merge_results(src, dst)
    assert str(table_path(src, GPU, "shapes")) in str(err.value) and "cannot read as parquet" in str(err.value)
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before


def test_cli_reports_counts_and_refuses_a_folder_into_itself(folders: tuple[Path, Path]) -> None:
    src, dst = folders
    runner = CliRunner()
    ok = runner.invoke(main, ["eval", "merge", str(src), "--into", str(dst)])
    assert ok.exit_code == 0, ok.output
    assert f"results 1 added, 1 replaced, {_all_results() - 2} kept" in ok.output
    assert "1 results replaced by later gradings: before committing, `bench/regrade_compare.py" in ok.output
    same = runner.invoke(main, ["eval", "merge", str(dst), "--into", str(dst)])
    assert same.exit_code == 2 and "into itself" in same.output and "Traceback" not in same.output


def test_a_gpu_folder_or_an_empty_one_is_refused_with_what_was_expected(folders: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    src, dst = folders
    runner = CliRunner()
    one_gpu = runner.invoke(main, ["eval", "merge", str(src / GPU), "--into", str(dst)])
    assert one_gpu.exit_code == 2 and "one GPU's folder" in one_gpu.output and str(src) in one_gpu.output
    (tmp_path / "empty").mkdir()
    empty = runner.invoke(main, ["eval", "merge", str(tmp_path / "empty"), "--into", str(dst)])
    assert empty.exit_code == 2 and "no results tables" in empty.output and "Traceback" not in empty.output


def test_merge_runs_outside_the_repository_root(folders: tuple[Path, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval merge` needs neither --deck nor --submissions, so their defaults must not be checked for it."""
    a, b = folders
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = CliRunner().invoke(main, ["eval", "merge", str(a), "--into", str(b)])
    assert result.exit_code == 0, result.output
    refused = CliRunner().invoke(main, ["eval", "--device", "cpu"])
    assert refused.exit_code == 2 and "'--deck'" in refused.output and "does not exist" in refused.output


def test_skipped_runs_are_left_out_whole_and_an_unknown_one_is_refused(folders: tuple[Path, Path]) -> None:
    """A grading the grader got wrong (the H200's Mega opus-4-8 rows: its own protocol bound) must
    not land, or `--resume` would keep it as graded."""
    src, dst = folders
    runner = CliRunner()
    ok = runner.invoke(main, ["eval", "merge", str(src), "--into", str(dst), "--skip", PAGED, "--skip", W4_V3])
    assert ok.exit_code == 0, ok.output
    skipped = sum(run_id in (PAGED, W4_V3) for run_id in load_all(REAL)["results"].column("run_id").to_pylist())
    assert skipped >= 2  # every GPU's row of each (the house 03 kernel is graded on the H100 SXM too)
    assert f"results 0 added, 0 replaced, {_all_results() - skipped} kept" in ok.output
    results = _by_run(dst, "results")
    assert results[(PAGED, None)]["message"] != "regraded later" and (W4_V3, None) not in results
    assert not any(k[0] == W4_V3 for k in _by_run(dst, "shapes"))
    assert W4_V3 not in {r["run_id"] for r in read_table(table_path(dst, GPU, "runs"), "runs").to_pylist()}
    assert not (dst / GPU / "logs" / f"{W4_V3}.log").exists()
    bad = runner.invoke(main, ["eval", "merge", str(src), "--into", str(dst), "--skip", "no_such_run"])
    assert bad.exit_code == 2 and "no grading of no_such_run here to skip" in bad.output
    assert "Traceback" not in bad.output and len(bad.output.strip().splitlines()) == 1


def test_a_merge_that_brings_a_problem_onto_a_board_says_so(folders: tuple[Path, Path]) -> None:
    """The first result of a problem on a GPU's board holds every model with an ungraded run of it
    unranked: merging two 06 rows into the H100 SXM board left one of its 19 AI models ranked
    (2026-12-06). The merge says which problem joins which board, and only then."""
    src, dst = folders
    for name in ("results", "shapes", "runs"):
        _edit(dst, name, lambda rows: [r for r in rows if "_03_paged_attention" not in r["run_id"]])
    for log in (dst / GPU / "logs").glob("*_03_paged_attention*"):
        log.unlink()
    joined = CliRunner().invoke(main, ["eval", "merge", str(src), "--into", str(dst)])
    assert joined.exit_code == 0, joined.output
    paged = sum(r["run_id"].endswith("_03_paged_attention") for r in read_table(
        table_path(REAL, GPU, "results"), "results").to_pylist())
    assert (f"h200: 03_paged_attention joins its hard board with {paged} results; every AI model with a published "
            "run of it not graded there is unranked until it is (`kernelboard eval todo --gpu h200` says how many "
            "are left)") in joined.output
    assert joined.output.count(" joins its ") == 1
    again = CliRunner().invoke(main, ["eval", "merge", str(src), "--into", str(dst)])
    assert again.exit_code == 0 and " joins its " not in again.output


def test_held_gradings_are_copied_whole_and_join_the_board_by_merge(tmp_path: Path) -> None:
    """bench/hold.py on the committed 06 gradings of the H100 SXM (held in data/held over five sessions, merged on
    2026-12-06): the problem's rows a results folder lacks, with their logs, land in a held folder that validates;
    merged into an empty results folder they bring 06 onto its H100 SXM board with every verdict as graded, and
    holding from a folder that already has them all is refused in one line."""
    import subprocess
    import sys

    bench = REAL.parents[1] / "bench" / "hold.py"
    gpu, problem = "h100-sxm", "06_sonic_moe_swiglu"

    def hold(committed: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(bench), str(REAL), gpu, problem, "--committed",
                               str(committed), "--held", str(tmp_path / "held")], capture_output=True, text=True)

    def rows(folder: Path, name: str) -> list[dict]:
        return read_table(table_path(folder, gpu, name), name).to_pylist()

    runs = {r["run_id"] for r in rows(REAL, "runs") if r["problem"] == problem}
    expected = {"runs": [r for r in rows(REAL, "runs") if r["run_id"] in runs],
                "results": [r for r in rows(REAL, "results") if r["run_id"] in runs],
                "shapes": [r for r in rows(REAL, "shapes") if r["run_id"] in runs],
                "baselines": [r for r in rows(REAL, "baselines") if r["problem"] == problem],
                "hardware": rows(REAL, "hardware")}
    logs = [log for log in (REAL / gpu / "logs").iterdir()
            if log.name.removesuffix(".log").removesuffix(".prebuild") in runs
            or log.name == f"baselines-hard-{problem}.log"]
    assert len(expected["results"]) == 49 and len(expected["baselines"]) == 12  # what data/README says
    done = hold(tmp_path / "none")
    assert done.returncode == 0, done.stderr
    counts = ", ".join(f"{name} {len(found)}" for name, found in expected.items())
    assert f"{counts}; {len(logs)} logs" in done.stdout
    for name, found in expected.items():  # row for row, in any order
        assert sorted(rows(tmp_path / "held", name), key=repr) == sorted(found, key=repr), name
    into = tmp_path / "results"
    into.mkdir()
    joined = CliRunner().invoke(main, ["eval", "merge", str(tmp_path / "held"), "--into", str(into)])
    assert joined.exit_code == 0, joined.output
    assert f"h100-sxm: 06_sonic_moe_swiglu joins its hard board with {len(runs)} results" in joined.output
    statuses = {r["run_id"]: r["status"] for r in rows(into, "results")}
    assert statuses == {r["run_id"]: r["status"] for r in expected["results"]}
    refused = hold(REAL)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].startswith("Error: ")
    assert "no result or baseline of 06_sonic_moe_swiglu that" in refused.stderr
    # a call cut off in 06's baselines, none of its runs graded: the rows it measured are held alone
    cut = tmp_path / "cut"
    for name in ("runs", "results", "shapes"):
        write_atomic(rows_to_table(name, []), table_path(cut, gpu, name))
    write_atomic(rows_to_table("baselines", expected["baselines"][:5]), table_path(cut, gpu, "baselines"))
    write_atomic(rows_to_table("hardware", expected["hardware"]), table_path(cut, gpu, "hardware"))
    (cut / gpu / "logs").mkdir()
    shutil.copy2(REAL / gpu / "logs" / f"baselines-hard-{problem}.log", cut / gpu / "logs")
    alone = subprocess.run([sys.executable, str(bench), str(cut), gpu, problem, "--committed", str(tmp_path / "none"),
                            "--held", str(tmp_path / "held-cut")], capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr
    assert "runs 0, results 0, shapes 0, baselines 5, hardware 1; 1 logs" in alone.stdout
    assert sorted(rows(tmp_path / "held-cut", "baselines"), key=repr) == sorted(expected["baselines"][:5], key=repr)

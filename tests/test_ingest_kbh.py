"""`kernelboard import kbh`: a generated KernelBench-Hard installation, and the real samples when present."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kernelboard.eval.submission import load_submission
from kernelboard.eval.tables import load_all
from kernelboard.sitegen.agreement import classify
from kernelboard.sitegen.ingest.cli import import_group
from kernelboard.sitegen.ingest.kbh import GRADER_VERSION, MEASURED_BY, RAN_NO_KERNEL, import_kbh

REPO = Path(__file__).resolve().parents[1]
DECKS = REPO / "eval" / "decks"
SAMPLE = REPO.parent / "shared" / "samples" / "kernelbench-com"
P = "03_paged_attention"
PASS = "20260618_170849_zai-claude_glm-5.2_03_paged_attention"
NO_DETAIL = "20260619_101010_codex_gpt-5.5_03_paged_attention"
RATE = "20260620_111111_kimi-claude_kimi-k2.7-code_03_paged_attention"
WRONG = "20260621_121212_claude_claude-opus-4-8_03_paged_attention"
HACK = "20260622_131313_or-fable_qwen_qwen3.8-max_03_paged_attention"
INCORRECT = "20260623_141414_cursor_composer-2.5-fast_03_paged_attention"
SXM = "20260624_151515_or-fable_deepseek_deepseek-v4-flash-0731_03_paged_attention"
OLDER = "20260617_090909_zai-claude_glm-5.2_03_paged_attention"
LOST = "20260625_161616_claude_claude-fable-5_03_paged_attention"
RULE = "# " + "=" * 66
CU = "__global__ void decode() {}\n// ===== not a banner =====\n"
PUBLISHED = ("import torch\nSRC = open('decode.cu').read()\n"
             f"\n\n{RULE}\n# ===== sidecar: decode.cu ({len(CU)} bytes, loaded by solution.py) =====\n{RULE}\n\n{CU}")
MISSING = (f"import torch\nSRC = open('moe.cpp').read()\n\n\n{RULE}\n# WARNING: solution loads sidecar 'moe.cpp' "
           f"but it was not found in the run archive.\n{RULE}\n")
LABELS = ["8×32×8×128×1024×16", "32×32×8×128×2048×16", "4×64×8×128×4096×16", "16×32×8×128×1535×16",
          "8×16×4×64×2000×16"]
MS = [0.069, 0.217, 0.094, 0.118, 0.057]


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) if not isinstance(data, str) else data)


def _cell(run_id: str, correct: bool, **extra: object) -> dict:
    return {"run_id": run_id, "correct": correct, "has_solution": True, "peak_fraction": 0.3 if correct else None,
            "elapsed_seconds": 3000, **extra}


def make_install(root: Path) -> Path:
    hard = root / "benchmarks" / "hard"
    models = [
        {"label": "zai-claude/glm-5.2", "harness": "zai-claude", "model": "glm-5.2", "effort": "",
         "results": {P: _cell(PASS, True, output_tokens=1234)}},
        {"label": "codex/gpt-5.5 [xhigh]", "harness": "codex", "model": "gpt-5.5", "effort": "xhigh",
         "results": {P: _cell(NO_DETAIL, True)}},
        {"label": "claude/claude-opus-4-8", "harness": "claude", "model": "claude-opus-4-8", "effort": "max",
         "results": {P: _cell(WRONG, False)}},
        {"label": "cursor/composer-2.5-fast", "harness": "cursor", "model": "composer-2.5-fast", "effort": "",
         "results": {P: _cell(INCORRECT, False)}},
        {"label": "or-fable/qwen/qwen3.8-max", "harness": "or-fable", "model": "qwen/qwen3.8-max", "effort": "",
         "results": {P: _cell(HACK, True, annotation_verdict="reward_hack", invalid_reason="reward_hack")}},
    ]
    _write(hard / "results" / "leaderboard.h100.json", {
        "schema_version": 1, "hardware": {"name": "NVIDIA H100 PCIe", "sm": "sm_90a"}, "problems": [P],
        "models": models})
    _write(hard / "results" / "leaderboard_v2.json", {"schema_version": 2})
    _write(hard / "results" / "problem_baselines.h100.json", {"problems": {P: {
        "eager": {"ms": 0.4, "n_shapes": 5}, "compiled": {"ms": 0.3, "n_shapes": 5}}}})
    shapes = [{"idx": i, "label": label, "ms": ms, "tflops": 1.0, "gbps": 500.0, "frac": 0.25 + i / 100,
               "compute_util": 0.001, "mem_util": 0.25 + i / 100, "bound": "memory"}
              for i, (label, ms) in enumerate(zip(LABELS, MS, strict=True))]
    _write(root / "public" / "data" / "rundetail" / "h100" / f"{PASS}.json", {
        "run_id": PASS, "bench": "hard", "gpu": "h100", "problem": P, "harness": "zai-claude", "model": "glm-5.2",
        "correct": True, "failure_reason": "pass", "shapes": shapes,
        "stats": {"agent_s": 2702, "output_tokens": None, "input_tokens": 0, "cost_usd": None}})
    run_dir = hard / "outputs" / "runs-h100" / RATE
    _write(run_dir / "result.json", {
        "run_id": RATE, "problem": P, "harness": "kimi-claude", "model": "kimi-k2.7-code", "reasoning_effort": "",
        "started_at": "2026-06-20T17:11:11Z", "finished_at": "2026-06-20T17:20:00Z", "has_solution": False,
        "correct": False, "failure_reason": "provider_rate_limited", "elapsed_seconds": 400,
        "usage": {"input_tokens": 1000, "output_tokens": 20, "cache_read_tokens": 0, "total_cost_usd": None}})
    wrong_dir = hard / "outputs" / "runs-h100" / WRONG
    _write(wrong_dir / "result.json", {"run_id": WRONG, "problem": P, "harness": "claude", "model": "claude-opus-4-8",
                                       "has_solution": True, "correct": False, "failure_reason": "check_failed"})
    _write(wrong_dir / "solution.py", "import torch\nSRC = open('decode.cu').read()\n")
    _write(wrong_dir / "decode.cu", "__global__ void decode() {}\n")
    _write(wrong_dir / "scratch_test.py", "print('not part of the solution')\n")
    _write(hard / "outputs" / "runs-h100" / "broken" / "result.json", '{"run_id": "broken",\n "problem": }')
    _write(hard / "results" / "annotations" / f"{PASS}.yaml", yaml.safe_dump({
        "run_id": PASS, "model": "glm-5.2", "harness": "zai-claude", "effort": "", "problem": P,
        "peak_fraction": 0.31, "verdict": "interesting", "summary": "Split-K decode with a CUDA-graph fast path.",
        "quotes": [{"file": "solution.py", "lines": [303, 314], "label": "graph replay", "text": "..."}],
        "measurement_status": "sequential_isolated"}))
    detail = root / "public" / "data" / "rundetail" / "h100"
    for run_id, reason, correct in ((INCORRECT, "incorrect", False), (SXM, "pass", True), (OLDER, "pass", True),
                                    (LOST, "pass", True)):
        _write(detail / f"{run_id}.json", {
            "run_id": run_id, "bench": "hard", "gpu": "h100", "problem": P, "correct": correct,
            "failure_reason": reason, "peak_fraction": 0.2 if correct else None, "shapes": [], "stats": {},
            "harness": run_id.split("_")[2], "model": "x", "has_solution_text": True,
            # INCORRECT's GPU-lock log: four commands that held the GPU 1 s in all; SXM's passes all the same
            **({"gpu_lock": {"wait_s": 3, "active_s": 1 if run_id == INCORRECT else 0, "acquisitions": 4}}
               if run_id in (INCORRECT, SXM) else {})})
    _write(root / "public" / "runs" / "h100" / f"{PASS}_solution.py.txt", PUBLISHED)
    _write(root / "public" / "runs" / "h100" / f"{LOST}_solution.py.txt", MISSING)
    _write(hard / "results" / "annotations" / f"{SXM}.yaml", yaml.safe_dump({
        "run_id": SXM, "verdict": "clean", "gpu": "H100 SXM5", "board_eligible": False,
        "measurement_status": "sequential_isolated_wrong_hardware_sku",
        "notes": "Correct, but graded on an H100 SXM5 worker.", "quotes": [{"file": "solution.py", "lines": [0],
                                                                            "text": "..."}]}))
    _write(root / "benchmarks" / "mega" / "results" / "leaderboard.json", {"models": [{"results": {
        "02_kimi_linear_decode": _cell("20260618_000000_codex_gpt-5.5_02_kimi_linear_decode", True)}}]})
    return root


@pytest.fixture
def imported(tmp_path: Path):
    install = make_install(tmp_path / "kbh")
    report = import_kbh(install, data_dir=tmp_path / "data", decks_dir=DECKS)
    return tmp_path, report


def _rows(data: Path) -> dict[str, dict]:
    tables = load_all(data / "results")
    runs = {r["run_id"]: r for r in tables["runs"].to_pylist()}
    return {r["run_id"]: {**runs[r["run_id"]], **r} for r in tables["results"].to_pylist()}


def test_statuses_follow_kernelbench_hard_outcomes(imported) -> None:
    tmp, _ = imported
    rows = _rows(tmp / "data")
    assert {k: (v["status"], v["agent_outcome"]) for k, v in rows.items()} == {
        PASS: ("pass", "completed"), NO_DETAIL: ("pass", "completed"), RATE: ("dnf", "rate_limited"),
        WRONG: ("wrong", "completed"), HACK: ("pass", "completed"), INCORRECT: ("wrong", "completed"),
        SXM: ("pass", "completed"), OLDER: ("pass", "completed"), LOST: ("pass", "solution_unrecoverable")}
    assert all(v["measured_by"] == MEASURED_BY and v["grader_version"] == GRADER_VERSION for v in rows.values())
    assert {v["gpu"] for v in rows.values()} == {"h100-pcie"}
    assert rows[RATE]["source"] == "kbh:benchmarks/hard/outputs/runs-h100/" + RATE + "/result.json"
    assert "incorrect" in rows[INCORRECT]["message"]  # an outcome the old importer dropped the run for


def test_a_failure_whose_gpu_lock_log_shows_no_kernel_ran_says_so(imported) -> None:
    """The source's verdict is kept, with what its run's GPU-lock log shows: every command of the run held
    the GPU about a second in all, less than check.py needs to import torch (20260719_034935's H100 sweep,
    20260719_030522's RTX PRO 6000 and B200 sweeps, one annotated "fresh .venv on the box had no torch");
    the agreement table excludes such a pair (no verdict on the kernel)."""
    tmp, _ = imported
    rows = _rows(tmp / "data")
    assert rows[INCORRECT]["status"] == "wrong"
    assert rows[INCORRECT]["message"].endswith(
        f"; {RAN_NO_KERNEL}: its run's GPU-lock log has 4 commands (the session's and the check's) holding the "
        "GPU 1 s in all, too little for check.py to import torch")
    assert RAN_NO_KERNEL not in rows[SXM]["message"]  # a pass is a pass, whatever its log
    assert classify("pass", "correct on all 80 checks", "wrong", rows[INCORRECT]["message"]).kind == "excluded"
    assert classify("pass", "correct on all 80 checks", "wrong", "check.py failed").kind == "differ"


def test_a_pass_without_derivable_speedup_keeps_its_verdict_and_score(imported) -> None:
    tmp, report = imported
    row = _rows(tmp / "data")[NO_DETAIL]
    assert row["status"] == "pass" and row["speedup_vs_compile"] is None and row["peak_fraction"] == 0.3
    assert "no speedup is shown: the run detail has no per-shape times" in row["message"]
    assert report.without_speedup == 5  # NO_DETAIL, HACK and the three detail-only runs without shapes


def test_runs_the_source_keeps_off_its_board_are_marked(imported) -> None:
    tmp, report = imported
    rows = _rows(tmp / "data")
    assert "board_eligible: false" in rows[SXM]["off_board"] and "H100 SXM5" in rows[SXM]["off_board"]
    assert "its leaderboard has no cell" in rows[OLDER]["off_board"]
    assert all(rows[k]["off_board"] is None for k in (PASS, NO_DETAIL, WRONG, HACK, INCORRECT))
    assert report.off_board == 4  # RATE, SXM, OLDER, LOST: none is a cell of the published board


def test_published_kernels_split_back_into_solution_and_sidecars(imported) -> None:
    tmp, report = imported
    folder = tmp / "data" / "submissions" / "hard" / PASS
    assert (folder / "solution.py").read_text() == "import torch\nSRC = open('decode.cu').read()\n"
    assert (folder / "decode.cu").read_text() == CU  # exactly, a banner-like line inside it included
    lost = load_submission(tmp / "data" / "submissions" / "hard" / LOST)
    assert lost.meta["agent_outcome"] == "solution_unrecoverable" and "moe.cpp" in lost.meta["outcome_note"]
    assert not (tmp / "data" / "submissions" / "hard" / LOST / "solution.py").exists()
    assert report.unrecoverable == 1


def test_split_published_refuses_a_sidecar_whose_size_disagrees() -> None:
    from kernelboard.sitegen.ingest.kbh import split_published

    files, why = split_published(PUBLISHED.replace(f"({len(CU)} bytes", f"({len(CU) + 1} bytes"))
    assert files == {} and "characters where its banner says" in why
    files, why = split_published(PUBLISHED.replace("decode.cu (", "../evil.cu ("))
    assert files == {} and "not a safe file name" in why


def test_a_pass_carries_speedups_derived_from_published_times(imported) -> None:
    tmp, _ = imported
    row = _rows(tmp / "data")[PASS]
    sol = math.exp(sum(math.log(m) for m in MS) / len(MS))
    assert row["speedup_vs_compile"] == pytest.approx(0.3 / sol)
    assert row["speedup_vs_eager"] == pytest.approx(0.4 / sol)
    assert row["n_shapes"] == 5 and row["compile_variant"] == "compile:reduce-overhead"
    shapes = load_all(tmp / "data" / "results")["shapes"].to_pylist()
    assert [s["median_ms"] for s in shapes] == MS and all(s["speedup_vs_compile"] is None for s in shapes)
    assert json.loads(shapes[0]["shape_json"])["seq_len"] == 1024
    assert row["input_tokens"] is None  # KernelBench-Hard's 0 means "not recorded"


def test_run_folders_become_submissions_with_their_sidecars(imported) -> None:
    tmp, report = imported
    subs = tmp / "data" / "submissions" / "hard"
    wrong = load_submission(subs / WRONG)
    assert sorted(p.name for p in wrong.files()) == ["decode.cu", "solution.py"]
    assert load_submission(subs / RATE).meta["agent_outcome"] == "rate_limited"
    assert report.submissions == 2  # WRONG's folder and PASS's published kernel (RATE has no kernel)


def test_refused_and_malformed_files_are_reported(imported) -> None:
    _, report = imported
    text = "\n".join(report.skipped)
    assert "leaderboard_v2.json: legacy" in text
    assert "broken/result.json: line 2: not valid JSON" in text
    assert "02_kimi_linear_decode" not in text  # another bench is not read at all


def test_annotations_are_imported_and_leaderboard_flags_kept(imported) -> None:
    tmp, _ = imported
    notes = tmp / "data" / "annotations"
    kept = yaml.safe_load((notes / f"{PASS}.yaml").read_text())
    assert kept["verdict"] == "interesting" and kept["extra"]["measurement_status"] == "sequential_isolated"
    assert yaml.safe_load((notes / f"{HACK}.yaml").read_text())["verdict"] == "reward_hack"
    sxm = yaml.safe_load((notes / f"{SXM}.yaml").read_text())  # no summary, lines [0]: read as the source writes
    assert sxm["summary"].startswith("(notes) Correct") and "lines" not in sxm["quotes"][0]
    assert sxm["extra"]["board_eligible"] is False


def test_reimport_changes_nothing(imported) -> None:
    tmp, _ = imported
    files = sorted(p for p in (tmp / "data").rglob("*") if p.is_file())
    stamps = {p: p.stat().st_mtime_ns for p in files}
    import_kbh(tmp / "kbh", data_dir=tmp / "data", decks_dir=DECKS)
    assert {p: p.stat().st_mtime_ns for p in files} == stamps


def test_imported_board_builds_with_flags(imported) -> None:
    from kernelboard.sitegen import build_site

    tmp, _ = imported
    site = build_site(tmp / "data", DECKS, tmp / "dist").out_dir
    home = (site / "index.html").read_text()
    assert "flag: reward_hack" in home  # the leaderboard's verdict, kept as an annotation
    assert (site / "runs" / "h100-pcie" / PASS / "index.html").is_file()


def test_cli(tmp_path: Path) -> None:
    install = make_install(tmp_path / "kbh")
    result = CliRunner().invoke(import_group, ["kbh", str(install), "--data", str(tmp_path / "data"),
                                               "--decks", str(DECKS)])
    assert result.exit_code == 0, result.output
    assert "9 runs imported" in result.output


@pytest.mark.parametrize("case", ["garbage", "mega", "truncated", "unknown_board"])
def test_bad_input_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    root = tmp_path / "src"
    args = ["kbh", str(root), "--data", str(tmp_path / "data"), "--decks", str(DECKS)]
    if case == "garbage":
        _write(root / "notes.txt", "not a results folder")
    elif case == "mega":
        make_install(root)
        args += ["--bench", "mega"]
    elif case == "truncated":
        make_install(root)
        _write(root / "benchmarks" / "hard" / "results" / "leaderboard.b200.json", '{"models": [{"results": ')
    else:
        make_install(root)
        _write(root / "benchmarks" / "hard" / "results" / "leaderboard.tpu-v7.json", "{}")
    result = CliRunner().invoke(import_group, args)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    if case in ("garbage", "mega"):
        assert result.exit_code != 0
        line = result.output.strip().splitlines()[-1]
        assert str(root) in line and ("no KernelBench-Hard" in line or "kernelboard import mega" in line)
        assert not (tmp_path / "data" / "results").exists()  # nothing half-written
    else:
        assert result.exit_code == 0
        name = "leaderboard.b200.json: line 1: not valid JSON" if case == "truncated" else \
            "leaderboard.tpu-v7.json: unknown board 'tpu-v7'"
        assert any(name in line for line in result.output.splitlines())


def test_a_changed_source_updates_only_what_changed(imported) -> None:
    tmp, _ = imported
    results = tmp / "data" / "results" / "h100-pcie"
    before = {p.name: p.read_bytes() for p in results.glob("*.parquet")}
    subs = tmp / "data" / "submissions" / "hard"
    kernel = (subs / WRONG / "solution.py").stat().st_mtime_ns
    detail = tmp / "kbh" / "public" / "data" / "rundetail" / "h100" / f"{INCORRECT}.json"
    data = json.loads(detail.read_text())
    _write(detail, {**data, "failure_reason": "check_timeout"})
    lb = tmp / "kbh" / "benchmarks" / "hard" / "results" / "leaderboard.h100.json"
    board = json.loads(lb.read_text())
    board["models"][3]["results"][P]["failure_reason"] = "check_timeout"
    _write(lb, board)
    import_kbh(tmp / "kbh", data_dir=tmp / "data", decks_dir=DECKS)
    rows = _rows(tmp / "data")
    assert rows[INCORRECT]["status"] == "timeout" and rows[WRONG]["status"] == "wrong"
    after = {p.name: p.read_bytes() for p in results.glob("*.parquet")}
    assert after["shapes.parquet"] == before["shapes.parquet"] and after["results.parquet"] != before["results.parquet"]
    assert (subs / WRONG / "solution.py").stat().st_mtime_ns == kernel


def test_real_kernelbench_com_samples(tmp_path: Path) -> None:
    if not (SAMPLE / "benchmarks" / "hard" / "results").is_dir():
        pytest.skip(f"no KernelBench-Hard samples under {SAMPLE}")
    from kernelboard.sitegen import build_site

    report = import_kbh(SAMPLE, data_dir=tmp_path / "data", decks_dir=DECKS)
    rows = _rows(tmp_path / "data")
    assert report.runs == len(rows) > 200
    glm = rows["20260618_170849_zai-claude_glm-5.2_03_paged_attention"]
    assert glm["status"] == "pass" and glm["gpu"] == "h100-pcie" and glm["speedup_vs_compile"] > 0
    assert {r["gpu"] for r in rows.values()} == {"h100-pcie", "b200", "rtx-pro-6000"}
    flags = {p.stem: yaml.safe_load(p.read_text())["verdict"] for p in (tmp_path / "data" / "annotations").iterdir()}
    assert flags["20260702_055037_claude_claude-fable-5_01_fp8_gemm"] == "clean"
    assert "20260513_153015_zai-claude_glm-5.1_01_fp8_gemm" not in flags  # names no run the samples publish
    site = build_site(tmp_path / "data", DECKS, tmp_path / "dist").out_dir
    assert "flag: reward_hack" in (site / "index.html").read_text()

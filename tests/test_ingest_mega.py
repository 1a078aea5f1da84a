"""`kernelboard import mega`: a small generated kernelbench.com checkout with KernelBench-Mega's published files."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kernelboard.eval.submission import load_submission
from kernelboard.eval.tables import load_all
from kernelboard.sitegen.ingest.annotations import load_annotations
from kernelboard.sitegen.ingest.cli import import_group
from kernelboard.sitegen.ingest.mega import GRADER_VERSION, MEASURED_BY, import_mega, parse_row

REPO = Path(__file__).resolve().parents[1]
DECKS = REPO / "eval" / "decks"
COMMIT = "c7d92211851a18fdba173544f703436f4032b350"
P = "02_kimi_linear_decode"
PASS = f"20260719_121747_or-fable_anthropic_claude-fable-5_{P}"
WRONG = f"20260618_211510_kimi-claude_kimi-k2.7-code_{P}"
B200 = f"20260721_103731_or-fable_anthropic_claude-fable-5_{P}"
BAD_GPU = f"20260720_000000_codex_gpt-5.5_{P}"
ONLY_KERNEL = f"20260702_113200_claude_claude-fable-5_{P}"
RL = "20260709_164856_codex_gpt-5.6-sol_01_rl_grid_ppo"
HEADER = ("gpu,harness,model,problem,correct,score,tok_s,elapsed_s,output_tokens,ctx2048,ctx8192,ctx16384,"
          "framework,kernels,megakernel,megakernel_judged,has_viewer,run_id")
CSV = "\r\n".join([
    HEADER,
    f"RTX PRO 6000 Blackwell,or-fable,anthropic/claude-fable-5,{P},true,24.609,3236,10275,,24.94,24.28,24.61,ptx,3,"
    f"pass,true,true,{PASS}",
    f"H100,kimi-claude,kimi-k2.7-code,{P},false,,,10800,,,,,triton,3,fail,false,true,{WRONG}",
    f"B200,or-fable,anthropic/claude-fable-5,{P},true,35.435,4118,13773,,34.04,35.48,36.84,ptx,4,pass,true,true,{B200}",
    f"A100,codex,gpt-5.5,{P},true,2.0,100,100,5,2,2,2,triton,1,fail,false,true,{BAD_GPU}",
    "",
])
RULE = "# " + "=" * 66
CU = "__global__ void step() {}\n"
KERNEL = ("import torch\nSRC = open('mega.cu').read()\n"
          f"\n\n{RULE}\n# ===== sidecar: mega.cu ({len(CU)} bytes, loaded by solution.py) =====\n{RULE}\n\n{CU}")


def _audit(run_id: str, verdict: str, **extra: object) -> dict:
    return {"run_id": run_id, "model": "claude-fable-5", "harness": "claude", "effort": "max", "problem": P,
            "peak_fraction": None, "verdict": verdict, "summary": f"audit of {run_id}",
            "quotes": [{"file": "x.py", "lines": [0, 0], "label": "no line", "text": "x"}], **extra}


def make_checkout(root: Path) -> Path:
    files = {
        "public/data/mega/results.csv": CSV,
        f"public/data/mega/code/{PASS}.solution.py.txt": KERNEL,
        f"public/data/mega/code/{WRONG}.solution.py.txt": "import torch\n",
        f"public/data/mega/code/{ONLY_KERNEL}.solution.py.txt": "import torch  # eager\n",
        f"public/data/mega/code/{RL}.solution.py.txt": "import torch\n",
        f"public/data/mega/code/{P}.reference.py.txt": "# the source's reference\n",
        f"benchmarks/mega/results/annotations/{PASS}.yaml": yaml.safe_dump(
            _audit(PASS, "clean", megakernel_authentic=True, authenticity_reason="one launch")),
        f"benchmarks/mega/results/annotations/{ONLY_KERNEL}.yaml": yaml.safe_dump(
            _audit(ONLY_KERNEL, "bug", megakernel_authentic=False, gpu="H100")),
        f"benchmarks/mega/results/annotations/{RL}.yaml": yaml.safe_dump(_audit(RL, "clean")),
        "benchmarks/mega/results/annotations/SCHEMA.md": "# schema\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture
def imported(tmp_path: Path) -> tuple[Path, object]:
    data = tmp_path / "data"
    report = import_mega(make_checkout(tmp_path / "src"), data_dir=data, decks_dir=DECKS, revision=COMMIT)
    return data, report


def test_rows_land_per_gpu_and_keep_the_contract(imported) -> None:
    data, report = imported
    assert (report.rows, report.passes, report.per_gpu) == (3, 2, {"b200": 1, "h100-pcie": 1, "rtx-pro-6000": 1})
    tables = load_all(data / "results")
    results = {r["run_id"]: r for r in tables["results"].to_pylist()}
    assert {r["measured_by"] for r in results.values()} == {MEASURED_BY}
    assert {r["grader_version"] for r in results.values()} == {GRADER_VERSION}
    ok = results[PASS]
    assert (ok["status"], ok["gpu"], ok["n_shapes"], ok["peak_fraction"], ok["speedup_vs_compile"]) == (
        "pass", "rtx-pro-6000", 3, None, None)
    assert "24.609× its optimised-PyTorch baseline.py" in ok["message"]
    assert "24.94× at 2048, 24.28× at 8192, 24.61× at 16384" in ok["message"]
    assert results[WRONG]["status"] == "wrong" and results[WRONG]["gpu"] == "h100-pcie"
    shapes = [s for s in tables["shapes"].to_pylist() if s["run_id"] == PASS]
    assert [s["shape_label"] for s in shapes] == ["context 2048", "context 8192", "context 16384"]
    assert '"context_len": 8192' in shapes[1]["shape_json"] and "24.28×" in shapes[1]["note"]
    # the source's score is a speedup over its own baseline.py: our column for a deck's own baseline
    assert (ok["speedup_vs_baseline"], ok["baseline_variant"]) == (24.609, "kbm:baseline.py")
    assert [s["speedup_vs_baseline"] for s in shapes] == [24.94, 24.28, 24.61]
    assert results[WRONG]["speedup_vs_baseline"] is None
    runs = {r["run_id"]: r for r in tables["runs"].to_pylist()}
    assert runs[PASS]["bench"] == "mega" and runs[PASS]["model"] == "claude-fable-5"
    assert runs[PASS]["lab"] == "Anthropic" and runs[PASS]["agent_seconds"] == 10275
    assert runs[PASS]["source"].startswith(f"github:Infatoshi/kernelbench.com@{COMMIT}:public/data/mega/results.csv;")


def test_kernels_are_split_and_carry_their_provenance(imported) -> None:
    data, report = imported
    folder = data / "submissions" / "mega" / PASS
    assert sorted(p.name for p in folder.iterdir()) == ["mega.cu", "run.yaml", "solution.py"]
    assert (folder / "mega.cu").read_text() == CU
    assert (folder / "solution.py").read_text() == "import torch\nSRC = open('mega.cu').read()\n"
    sub = load_submission(folder)
    assert f"@{COMMIT}:" in sub.meta["source"] and sub.meta["source"].endswith(f"{PASS}.solution.py.txt")
    only = load_submission(data / "submissions" / "mega" / ONLY_KERNEL)  # published kernel, no CSV row
    assert only.meta["gpu"] == "h100-pcie" and "no results.csv row" in only.meta["outcome_note"]
    assert (report.submissions, report.kernels_without_result) == (3, 1)
    assert not (data / "submissions" / "mega" / B200).joinpath("solution.py").exists()  # no published kernel
    assert any(B200 in w and "no kernel" in w for w in report.warnings)


def test_a_kernel_without_a_row_takes_the_model_its_run_id_writes(tmp_path: Path) -> None:
    """The source's harness writes 'kinetic-0715[1m]' into run ids as 'kinetic-0715_1m_': a published kernel
    with no CSV row and no audit is that model's, as its other runs are (not a model 'kinetic-0715_1m' of its
    own, which split one model's Mega runs across two board rows)."""
    src = make_checkout(tmp_path / "src")
    with_row = f"20260716_150057_kinetic-claude_kinetic-0715_1m__{P}"
    without = f"20260716_150026_kinetic-claude_kinetic-0715_1m__{P}"
    csv = src / "public/data/mega/results.csv"
    csv.write_text(csv.read_text() + f"H100,kinetic-claude,kinetic-0715[1m],{P},false,,,10800,,,,,triton,3,fail,"
                                      f"false,true,{with_row}\r\n")
    for run_id in (with_row, without):
        (src / f"public/data/mega/code/{run_id}.solution.py.txt").write_text("import torch\n")
    data = tmp_path / "data"
    import_mega(src, data_dir=data, decks_dir=DECKS, revision=COMMIT)
    metas = {r: load_submission(data / "submissions" / "mega" / r).meta for r in (with_row, without)}
    assert {m["model"] for m in metas.values()} == {"kinetic-0715-1m"}
    assert {m["model_display"] for m in metas.values()} == {"kinetic-0715[1m]"}
    assert load_submission(data / "submissions" / "mega" / ONLY_KERNEL).meta["model"] == "claude-fable-5"  # its audit


def test_nothing_is_dropped_silently(imported) -> None:
    _, report = imported
    skipped = "\n".join(report.skipped)
    assert f":5: {BAD_GPU}: column 'gpu': 'A100' is not one of" in skipped
    assert f"{RL}: problem '01_rl_grid_ppo' has no deck folder" in skipped
    assert f"{P}.reference.py.txt: the source's own problem file" in skipped
    assert f"{RL}.yaml: {RL}: no imported run" in skipped
    assert all("\n" not in line and "Traceback" not in line for line in report.skipped)
    assert len(report.skipped) == 4


def test_annotations_follow_the_sources_authenticity_rule(imported) -> None:
    data, report = imported
    notes = load_annotations(data / "annotations")
    assert set(notes) == {PASS, ONLY_KERNEL} and report.annotations == 2
    assert notes[PASS].verdict == "clean"
    assert notes[ONLY_KERNEL].verdict == "megakernel_not_authentic" and notes[ONLY_KERNEL].flags
    raw = yaml.safe_load((data / "annotations" / f"{ONLY_KERNEL}.yaml").read_text())
    assert raw["extra"]["source_verdict"] == "bug" and raw["extra"]["megakernel_authentic"] is False
    assert "lines" not in raw["quotes"][0]  # the source's [0, 0] means "no line"


def test_rows_that_do_not_parse_say_why_in_one_line() -> None:
    row = dict(zip(HEADER.split(","), ["H100", "codex", "gpt", P, "true", "", "", "", "", "", "", "", "", "",
                                       "", "false", "true", PASS], strict=True))
    with pytest.raises(ValueError, match="a correct row needs a positive speedup"):
        parse_row(row, 2)
    with pytest.raises(ValueError, match="column 'correct': expected true or false"):
        parse_row({**row, "correct": "yes"}, 2)
    with pytest.raises(ValueError, match="column 'ctx8192': expected a number"):
        parse_row({**row, "score": "2", "ctx2048": "2", "ctx8192": "fast", "ctx16384": "2"}, 2)


def test_cli_imports_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    src, data = make_checkout(tmp_path / "src"), tmp_path / "data"
    args = ["mega", str(src), "--data", str(data), "--decks", str(DECKS), "--revision", COMMIT]
    first = CliRunner().invoke(import_group, args)
    assert first.exit_code == 0, first.output
    assert "3 result rows imported (b200 1, h100-pcie 1, rtx-pro-6000 1; 2 passes)" in first.output
    before = {p: p.stat().st_mtime_ns for p in data.rglob("*") if p.is_file()}
    again = CliRunner().invoke(import_group, args)
    assert again.exit_code == 0 and {p: p.stat().st_mtime_ns for p in data.rglob("*") if p.is_file()} == before


def test_cli_refuses_a_folder_without_results(tmp_path: Path) -> None:
    result = CliRunner().invoke(import_group, ["mega", str(tmp_path), "--data", str(tmp_path / "d")])
    assert result.exit_code == 1 and "no public/data/mega/results.csv" in result.output
    assert "Traceback" not in result.output


def test_an_imported_mega_board_ranks_on_the_sources_baseline_speedup(imported) -> None:
    """The Mega board of a GPU ranks on the speedup over the deck's own baseline (as the source does),
    is labelled imported, and no pass on it reads 'no speedup'."""
    from kernelboard.sitegen.board import DECK_BASELINE_IMPORTED, build_boards, no_speedup_reason
    from kernelboard.sitegen.load import load_site

    data, _ = imported
    site = load_site(data, DECKS)
    boards = {b.gpu: b for b in build_boards(site) if b.bench == "mega"}
    assert set(boards) == {"b200", "h100-pcie", "rtx-pro-6000"}
    rtx = boards["rtx-pro-6000"]
    assert rtx.metric is DECK_BASELINE_IMPORTED and rtx.is_imported
    cells = [c for row in rtx.rows for c in row.cells if c is not None]
    assert [(c.run.run_id, c.value) for c in cells] == [(PASS, 24.609)]
    assert no_speedup_reason(cells[0].result) is None
    assert boards["b200"].rows[0].cells[0].value == 35.435


def test_the_mega_problem_page_charts_the_speedup_over_the_decks_baseline(imported) -> None:
    """Its bars and per-shape bars are the speedups over baseline.py (the source's score and its
    per-context figures), from a 1× line named after that baseline, not torch.compile."""
    from kernelboard.sitegen.load import load_site
    from kernelboard.sitegen.views import problem

    data, _ = imported
    page = problem(load_site(data, DECKS), "mega", P)
    rtx = next(g for g in page["gpus"] if g["gpu"] == "rtx-pro-6000")
    assert (rtx["speed_field"], rtx["speed_over"]) == ("speedup_vs_baseline", "baseline.py")
    assert [e.run.run_id for e in rtx["fast"]] == [PASS]
    chart = str(rtx["speedup_chart"])
    assert "Speedup over baseline.py" in chart and "baseline.py (1\\u00d7)" in chart and "torch.compile" not in chart
    assert '"customdata": [24.94, 24.28, 24.61]' in str(rtx["shape_chart"])


def test_model_and_gpu_pages_show_the_mega_speedup_over_baseline_py(imported, tmp_path: Path) -> None:
    """A Mega pass is shown on its model page (card, across GPUs, every attempt) and on its GPU page
    by the speedup its board ranks on, named as over baseline.py — never as a blank speedup over
    torch.compile, which the source did not measure."""
    from kernelboard.sitegen.render import build_site

    data, _ = imported
    site = build_site(data, DECKS, tmp_path / "dist").out_dir
    text = " ".join((site / "models" / "claude-fable-5" / "index.html").read_text().split())
    assert text.count('<p class="card-value">24.6× ') == 1 and text.count('<p class="card-value">35.4× ') == 1
    assert text.count('<p class="why">over <code>baseline.py</code>') == 2  # RTX PRO 6000 and B200 cards
    assert text.count("on this problem; over baseline.py\">") == 2  # across GPUs
    assert '24.6× <span class="sub">over baseline.py</span>' in text  # every attempt
    assert '35.4× <span class="sub">over baseline.py</span>' in text
    gpu_page = " ".join((site / "gpu" / "rtx-pro-6000" / "index.html").read_text().split())
    assert 'data-label="× baseline.py"' in gpu_page and ">24.6×</td>" in gpu_page


@pytest.mark.parametrize(("launches", "shown"), [((1, 1, 1), "1 launch/step · megakernel"),
                                                 ((1, 40, 3), "40 launches/step"), (None, None)])
def test_a_mega_cell_prints_its_launches_per_step(imported, tmp_path: Path, launches, shown) -> None:
    """Launches per step (the most on any shape) beside a Mega pass's speedup, and "megakernel" only where
    every shape's step launched one kernel; nothing where the launches were not counted (an imported row)."""
    import pyarrow.parquet as pq

    from kernelboard.eval.tables import upsert
    from kernelboard.sitegen.render import build_site

    data, _ = imported
    path = data / "results" / "rtx-pro-6000" / "shapes.parquet"
    rows = [r for r in pq.read_table(path).to_pylist() if r["run_id"] == PASS]
    if launches is not None:
        for r in rows:
            r.pop("schema_version")
            r["launches"] = launches[r["shape_idx"]]
        upsert(path, "shapes", rows)
    site = build_site(data, DECKS, tmp_path / "dist").out_dir
    page = " ".join((site / "index.html").read_text().split())  # the home page's boards hold the cells
    if shown is None:
        assert 'class="why launches"' not in page
    else:
        assert f">{shown}</span>" in page and page.count('class="why launches"') == 1

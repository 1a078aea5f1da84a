"""Fidelity of the imported kernelbench.com boards: the committed data always, the source when it is here.

The committed `data/` holds kernelbench.com's Hard boards imported at COMMIT. These tests check it
against figures read from that commit (the board's top 3 from its site index, run counts), and —
when a checkout of the repository is named by KERNELBENCH_COM — against the source's own files:
every run imported with the source's problem, model, GPU and verdict, every audit verdict kept, and
a fresh import equal to the committed tables byte for byte.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from kernelboard.sitegen.board import build_boards
from kernelboard.sitegen.ingest.kbh import MEASURED_BY, import_kbh
from kernelboard.sitegen.load import load_site

REPO = Path(__file__).resolve().parents[1]
DECKS = REPO / "eval" / "decks"
DATA = REPO / "data"
COMMIT = "c7d92211851a18fdba173544f703436f4032b350"
#: The source's boards, as files and as our GPU keys.
BOARDS = {"leaderboard.json": "rtx-pro-6000", "leaderboard.h100.json": "h100-pcie", "leaderboard.b200.json": "b200"}
#: kernelbench.com's own order at COMMIT (public/data/models.json, per board `perf`, highest first).
SOURCE_TOP3 = {
    "rtx-pro-6000": ["claude-fable-5", "claude-opus-4-8", "glm-5.2"],
    "h100-pcie": ["claude-fable-5", "kinetic-0715", "claude-opus-5"],
    "b200": ["claude-fable-5", "kinetic-0715", "claude-opus-4-8"],
}


@pytest.fixture(scope="module")
def committed():
    return load_site(DATA, DECKS)


def _imported(site) -> list:
    return [r for r in site.results if r.measured_by == MEASURED_BY]


def test_committed_import_is_whole_and_sourced(committed) -> None:
    rows = _imported(committed)
    assert len(rows) == 293 and {r.gpu for r in rows} == set(BOARDS.values())
    assert sum(r.off_board is not None for r in rows) == 15
    for r in rows:
        assert committed.runs[r.run_id].source.startswith(f"github:Infatoshi/kernelbench.com@{COMMIT}:"), r.run_id
    kernels = sum(r.run_id in committed.solutions for r in rows)
    assert kernels == 285  # 7 runs have no published kernel, 1 kernel's sidecar was never published


def test_committed_boards_rank_the_source_top_three_in_order(committed) -> None:
    boards = {b.gpu: b for b in build_boards(committed) if b.bench == "hard"}
    for gpu, top in SOURCE_TOP3.items():
        ranked = [row.model for row in boards[gpu].rows if row.rank is not None]
        assert ranked[:3] == top, gpu


def test_no_off_board_run_takes_a_cell(committed) -> None:
    for board in build_boards(committed):
        for row in board.rows:
            assert all(c is None or c.result.off_board is None for c in row.cells), (board.gpu, row.model)


def test_no_imported_pass_loses_its_cell_to_a_failure(committed) -> None:
    passes = {(committed.runs[r.run_id].model, committed.runs[r.run_id].problem, r.gpu)
              for r in _imported(committed) if r.is_pass and r.off_board is None}
    for board in build_boards(committed):
        for row in board.rows:
            for cell in row.cells:
                if cell is not None and (row.model, cell.run.problem, board.gpu) in passes:
                    assert cell.result.is_pass, (board.gpu, row.model, cell.run.problem)


# -- against the source's own files ---------------------------------------------------------------

SOURCE = Path(os.environ.get("KERNELBENCH_COM", "/nonexistent"))
needs_source = pytest.mark.skipif(
    not (SOURCE / "benchmarks" / "hard" / "results").is_dir(),
    reason="set KERNELBENCH_COM to a checkout of github.com/Infatoshi/kernelbench.com at c7d9221 to compare "
           "with the source's files")


def _source_runs() -> dict[tuple[str, str], tuple[str, str, bool]]:
    """(gpu, run_id) -> (problem, model, correct): the boards' cells, then the run details beside them."""
    runs = {}
    for name, gpu in BOARDS.items():
        for block in json.loads((SOURCE / "benchmarks" / "hard" / "results" / name).read_text())["models"]:
            for problem, cell in block["results"].items():
                runs[(gpu, cell["run_id"])] = (problem, block["model"], bool(cell.get("correct")))
    for path in glob.glob(str(SOURCE / "public" / "data" / "rundetail" / "**" / "*.json"), recursive=True):
        detail = json.loads(Path(path).read_text())
        if detail.get("bench") == "hard":
            gpu = {"h100": "h100-pcie", "b200": "b200"}.get(Path(path).parent.name, "rtx-pro-6000")
            runs.setdefault((gpu, detail["run_id"]), (detail["problem"], detail["model"], bool(detail["correct"])))
    return runs


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    data = tmp_path_factory.mktemp("kbh") / "data"
    report = import_kbh(SOURCE, data_dir=data, decks_dir=DECKS, revision=COMMIT)
    return data, report, load_site(data, DECKS)


@needs_source
def test_every_source_run_is_imported_with_its_verdict(fresh) -> None:
    _, report, site = fresh
    source = _source_runs()
    ours = {(r.gpu, r.run_id): r for r in _imported(site)}
    missing, differ = [], []
    for (gpu, run_id), (problem, model, correct) in source.items():
        row = ours.get((gpu, run_id)) or ours.get((gpu, f"{run_id}-{gpu}"))  # a run id reused on two boards
        if row is None:
            missing.append((gpu, run_id))
            continue
        run = site.runs[row.run_id]
        if (run.problem, run.model_display, row.is_pass) != (problem, model, correct):
            differ.append((gpu, run_id, (problem, model, correct), (run.problem, run.model_display, row.status)))
    assert len(missing) <= 0.01 * len(source), missing
    assert differ == []
    assert report.runs == len(source) == 293


@needs_source
def test_every_audit_verdict_of_an_imported_run_is_kept(fresh) -> None:
    _, _, site = fresh
    imported = {r.run_id for r in _imported(site)}
    for path in sorted((SOURCE / "benchmarks" / "hard" / "results" / "annotations").glob("*.yaml")):
        try:
            meta = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue  # the one malformed file names a problem outside the deck; the importer reports it
        if path.stem in imported:
            assert site.annotations[path.stem].verdict == {"contaminated": "contamination"}.get(
                meta["verdict"], meta["verdict"]), path.name


@needs_source
def test_the_source_top_three_is_what_its_site_shows() -> None:
    """SOURCE_TOP3 (used on the committed data above) is read off the source's site index."""
    removed = re.search(r"REMOVED_MODEL_SLUGS = new Set\(\[(.*?)\]\)",
                        (SOURCE / "app" / "_lib" / "models.server.ts").read_text(), re.S)
    hidden = set(re.findall(r'"([^"]+)"', removed.group(1))) if removed else set()
    index = json.loads((SOURCE / "public" / "data" / "models.json").read_text())
    for board, gpu in (("rtxpro6000", "rtx-pro-6000"), ("h100", "h100-pcie"), ("b200", "b200")):
        perf = []
        for model in index["models"]:
            hard = model["benches"].get("hard") or {}
            block = (hard.get("gpus") or {}).get(board) or (hard if board == "rtxpro6000" and hard.get("cells")
                                                             else None)
            if block and model["slug"] not in hidden:
                perf.append((-block["perf"], model["slug"]))
        assert [slug for _, slug in sorted(perf)[:3]] == SOURCE_TOP3[gpu]


@needs_source
def test_importing_again_over_the_committed_data_changes_no_byte(tmp_path) -> None:
    """As data/README.md re-makes it: over the committed folder, whose boards also hold the Mega
    import's rows and our regrades (a fresh folder holds only the Hard import's)."""
    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    import_kbh(SOURCE, data_dir=data, decks_dir=DECKS, revision=COMMIT)
    for gpu in BOARDS.values():
        for table in ("runs", "results", "shapes"):
            assert (data / "results" / gpu / f"{table}.parquet").read_bytes() == \
                (DATA / "results" / gpu / f"{table}.parquet").read_bytes(), (gpu, table)

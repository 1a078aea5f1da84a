"""Audit annotations: the schema checked on load, and a flagging verdict invalidating its cell on the site."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from site_fixtures import GPU, PASS, SiteInputs

from kernelboard.errors import DataError
from kernelboard.sitegen.board import build_boards, problem_entries
from kernelboard.sitegen.ingest.annotations import FLAG_VERDICTS, load_annotations, write_annotation
from kernelboard.sitegen.load import load_site

RUN = "20260702_055037_claude_claude-fable-5_01_fp8_gemm"
GOOD = {"run_id": RUN, "verdict": "reward_hack", "summary": "Caches the output keyed on input identity.",
        "quotes": [{"file": "solution.py", "lines": [684, 689], "label": "the cache", "text": "self._graphs = {}"}],
        "implication": "The cell is invalid."}


def _write(folder: Path, name: str, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_a_valid_annotation_loads(tmp_path: Path) -> None:
    _write(tmp_path, RUN, GOOD)
    note = load_annotations(tmp_path)[RUN]
    assert note.flags and note.verdict in FLAG_VERDICTS and note.quotes[0].lines == (684, 689)


def test_a_missing_folder_is_no_annotations(tmp_path: Path) -> None:
    assert load_annotations(tmp_path / "annotations") == {}


def test_every_problem_is_reported_with_file_and_field(tmp_path: Path) -> None:
    bad = _write(tmp_path, RUN, {**GOOD, "run_id": "other", "verdict": "hacky", "summary": "",
                                 "quotes": [{"file": "x", "text": "y", "lines": [9, 3]}], "verdit": "typo"})
    broken = _write(tmp_path, "20260101_000000_a_b_01_x", "verdict: clean\nsummary: [unclosed\n")
    with pytest.raises(DataError) as err:
        load_annotations(tmp_path)
    text = "\n".join(err.value.problems)
    assert f"{bad}: unknown key 'verdit'" in text
    assert f"{bad}: field 'run_id': expected the file name's stem" in text
    assert f"{bad}: field 'verdict': expected one of clean" in text
    assert f"{bad}: field 'summary'" in text
    assert f"{bad}: field 'quotes[0]'.lines: expected [line] or [first, last]" in text
    assert f"{broken}: line 3 not valid YAML" in text or f"{broken}: line 2 not valid YAML" in text


def test_write_validates_and_is_idempotent(tmp_path: Path) -> None:
    assert write_annotation(tmp_path, GOOD) is True
    assert write_annotation(tmp_path, GOOD) is False
    with pytest.raises(DataError):
        write_annotation(tmp_path, {**GOOD, "verdict": "great"})


def test_a_flagged_pass_is_shown_as_a_flag_and_never_scores(fresh_inputs: SiteInputs) -> None:
    before = load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir)
    _write(fresh_inputs.data_dir / "annotations", PASS, {**GOOD, "run_id": PASS})
    data = load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir)
    assert data.annotations[PASS].verdict == "reward_hack"
    board = next(b for b in build_boards(data) if b.gpu == GPU)
    row = next(r for r in board.rows if any(c and c.run.run_id == PASS for c in r.cells))
    cell = next(c for c in row.cells if c and c.run.run_id == PASS)
    assert (cell.state, cell.label, cell.tone, cell.share, cell.is_best) == (
        "flag", "flag: reward_hack", "bad", None, False)
    assert cell.reason == "Caches the output keyed on input identity."
    assert row.passes == 0 and row.score == 0.0
    entry = next(e for e in problem_entries(data, "hard", "03_paged_attention")[GPU] if e.run.run_id == PASS)
    assert entry.status_label == "flag: reward_hack"
    old_row = next(r for r in build_boards(before)[0].rows if r.model == row.model)
    assert old_row.passes == 1


def test_a_clean_verdict_changes_nothing(fresh_inputs: SiteInputs) -> None:
    _write(fresh_inputs.data_dir / "annotations", PASS, {**GOOD, "run_id": PASS, "verdict": "clean"})
    data = load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir)
    board = next(b for b in build_boards(data) if b.gpu == GPU)
    cell = next(c for r in board.rows for c in r.cells if c and c.run.run_id == PASS)
    assert cell.state == "pass" and cell.is_best


def test_the_built_site_shows_the_flag_with_its_summary(fresh_inputs: SiteInputs, tmp_path: Path) -> None:
    from kernelboard.sitegen import build_site

    _write(fresh_inputs.data_dir / "annotations", PASS, {**GOOD, "run_id": PASS})
    home = (build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, tmp_path / "dist").out_dir
            / "index.html").read_text()
    assert "flag: reward_hack" in home and "Caches the output keyed on input identity." in home


def test_annotations_of_unknown_runs_are_ignored_by_the_site(fresh_inputs: SiteInputs) -> None:
    _write(fresh_inputs.data_dir / "annotations", RUN, GOOD)
    assert load_site(fresh_inputs.data_dir, fresh_inputs.decks_dir).annotations == {}


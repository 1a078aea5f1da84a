"""Incremental rebuilds of a large site: only the pages whose inputs changed are rendered, the result is
byte for byte a fresh build of the same inputs, and the spare beside the site is hard links, not a copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from site_fixtures import GPU, PASS, WRONG, SiteInputs, make_site_inputs

from kernelboard.eval.tables import read_table, write_atomic
from kernelboard.sitegen import build_site, render
from kernelboard.sitegen.pages import page_path


def _files(site: Path) -> dict[str, bytes]:
    return {p.relative_to(site).as_posix(): p.read_bytes() for p in sorted(site.rglob("*")) if p.is_file()}


@pytest.fixture
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SiteInputs:
    """Fresh inputs, a site treated as large (a spare, page keys), and a fixed date: a regrade does not
    move the footer's date, so only what the change touches differs."""
    monkeypatch.setattr(render, "PARALLEL_MIN_PAGES", 1)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    return make_site_inputs(tmp_path / "inputs")


def _fresh(inputs: SiteInputs, where: Path) -> dict[str, bytes]:
    build_site(inputs.data_dir, inputs.decks_dir, where, jobs=1)
    return _files(where)


def _edit_solution(inputs: SiteInputs, run_id: str = PASS) -> None:
    path = inputs.data_dir / "submissions" / "hard" / run_id / "solution.py"
    path.write_text(path.read_text(encoding="utf-8") + "# one more line\n", encoding="utf-8")


def test_an_edited_solution_renders_its_run_page_alone(inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "site" / "dist"
    first = build_site(inputs.data_dir, inputs.decks_dir, out, jobs=2)
    assert first.rendered == first.pages
    _edit_solution(inputs)
    assert (out.parent / ".dist.data").is_file()  # the validated tables, read back by the next build
    again = build_site(inputs.data_dir, inputs.decks_dir, out, jobs=2)
    assert again.rendered == 1
    assert "# one more line" in (out / page_path("run", gpu=GPU, run_id=PASS)).read_text(encoding="utf-8")
    assert _files(out) == _fresh(inputs, tmp_path / "fresh" / "dist")


def test_a_changed_table_renders_the_pages_that_read_it(inputs: SiteInputs, tmp_path: Path) -> None:
    """A run's cost changed in the runs table: its run page and every aggregate page render, no other
    run page."""
    out = tmp_path / "site" / "dist"
    first = build_site(inputs.data_dir, inputs.decks_dir, out)
    path = inputs.results_dir / GPU / "runs.parquet"
    table = read_table(path, "runs")
    rows = table.to_pylist()
    row = next(r for r in rows if r["run_id"] == WRONG)
    row["cost_usd"] = 9.99
    write_atomic(type(table).from_pylist(rows, schema=table.schema), path)
    again = build_site(inputs.data_dir, inputs.decks_dir, out)
    run_pages = len(list(out.glob("runs/*/*/index.html")))
    assert again.rendered == first.pages - run_pages + 1
    assert _files(out) == _fresh(inputs, tmp_path / "fresh" / "dist")


def test_the_spare_is_hard_links_to_the_site(inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)  # the first build makes the spare
    _edit_solution(inputs)
    build_site(inputs.data_dir, inputs.decks_dir, out)  # the previous site becomes the spare, relinked
    spare = tmp_path / ".dist.spare"
    beside = sorted(p.name for p in tmp_path.iterdir() if p.name != "inputs")
    assert beside == [".dist.data", ".dist.hashes", ".dist.spare", "dist"]
    site = {p.relative_to(out): p.stat().st_ino for p in out.rglob("*") if p.is_file()}
    assert site == {p.relative_to(spare): p.stat().st_ino for p in spare.rglob("*") if p.is_file()}


def test_a_spare_file_that_is_not_the_published_one_is_rendered_again(inputs: SiteInputs, tmp_path: Path) -> None:
    """Only a spare file that is the published file itself (same inode) lets its page be skipped."""
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    tampered = tmp_path / ".dist.spare" / page_path("run", gpu=GPU, run_id=WRONG)
    tampered.unlink()
    tampered.write_text("not the published page")
    _edit_solution(inputs)
    again = build_site(inputs.data_dir, inputs.decks_dir, out)
    assert again.rendered == 2  # the edited run's page and the tampered one
    assert _files(out) == _fresh(inputs, tmp_path / "fresh" / "dist")


def test_force_renders_every_page(inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    first = build_site(inputs.data_dir, inputs.decks_dir, out)
    again = build_site(inputs.data_dir, inputs.decks_dir, out, force=True)
    assert again.rendered == first.pages


_KEYS = """
import json, sys
import json
import os
import subprocess
import sys
from pathlib import Path
from kernelboard.sitegen import fingerprint as fp, render
from kernelboard.sitegen.exports import Exports
from kernelboard.sitegen.load import load_site
from kernelboard.sitegen.page_keys import page_keys
from kernelboard.sitegen.pages import plan
data_dir, decks_dir = Path(sys.argv[1]), Path(sys.argv[2])
data = load_site(data_dir, decks_dir)
pages = plan(data, exports=Exports(data.table_files))
print(json.dumps(page_keys(pages, data, fp.digests(data_dir, decks_dir, None), render._site(data, None))[0]))
"""


def test_page_keys_are_the_same_in_every_process(inputs: SiteInputs) -> None:
    """Keys hash values, never identities or str hashes: two processes with different hash seeds agree."""
    keys = [json.loads(subprocess.run([sys.executable, "-c", _KEYS, str(inputs.data_dir), str(inputs.decks_dir)],
                                      env={**os.environ, "PYTHONHASHSEED": seed}, check=True, capture_output=True,
                                      text=True).stdout) for seed in ("1", "2")]
    assert keys[0] == keys[1] and len(keys[0]) > 10


def test_unchanged_tables_are_read_back_not_loaded_again(inputs: SiteInputs, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With the tables and decks unchanged, the validated data is read back (`load.remembered`); a kept
    file that does not read back is simply loaded again."""
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    real = render.load_site

    def not_again(*args: object) -> None:
        raise AssertionError("loaded again")

    monkeypatch.setattr(render, "load_site", not_again)
    _edit_solution(inputs)
    assert build_site(inputs.data_dir, inputs.decks_dir, out).rendered == 1
    monkeypatch.setattr(render, "load_site", real)
    kept = tmp_path / ".dist.data"
    kept.write_bytes(kept.read_bytes()[:200])  # cut short
    _edit_solution(inputs)
    assert build_site(inputs.data_dir, inputs.decks_dir, out).rendered == 1
    assert _files(out) == _fresh(inputs, tmp_path / "fresh" / "dist")

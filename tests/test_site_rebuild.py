"""No-change rebuilds: a build whose inputs all match the site in --out is skipped; any change rebuilds."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from site_fixtures import PASS, SiteInputs, make_site_inputs

from kernelboard.cli import main
from kernelboard.eval.tables import read_table, write_atomic
from kernelboard.sitegen import build_site
from kernelboard.sitegen import fingerprint as fp
from kernelboard.sitegen.render import MARKER, TEMPLATES_DIR


def _snapshot(site: Path) -> dict[str, tuple[int, int]]:
    """Every file of a built site: (inode, mtime_ns) — a rebuild writes a fresh tree, a skip touches nothing."""
    return {p.relative_to(site).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(site.rglob("*")) if p.is_file()}


@pytest.fixture
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SiteInputs:
    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    return make_site_inputs(tmp_path / "inputs")


def test_unchanged_inputs_skip_the_build_and_leave_the_site_untouched(inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    first = build_site(inputs.data_dir, inputs.decks_dir, out)
    assert not first.unchanged and first.pages > 0
    before = _snapshot(out)
    assert fp.recorded(out, MARKER) == fp.fingerprint(inputs.data_dir, inputs.decks_dir, None)
    again = build_site(inputs.data_dir, inputs.decks_dir, out)
    assert again.unchanged and again.summary().startswith("unchanged")
    assert _snapshot(out) == before


def _touch_table(inputs: SiteInputs) -> None:
    path = inputs.results_dir / "h200" / "runs.parquet"
    table = read_table(path, "runs")
    rows = table.to_pylist()
    rows[0]["cost_usd"] = 9.99
    write_atomic(type(table).from_pylist(rows, schema=table.schema), path)


def _annotate(inputs: SiteInputs) -> None:
    folder = inputs.data_dir / "annotations"
    folder.mkdir(exist_ok=True)
    (folder / f"{PASS}.yaml").write_text(f"run_id: {PASS}\nverdict: clean\nsummary: Read end to end.\n",
                                         encoding="utf-8")


def _edit_solution(inputs: SiteInputs) -> None:
    path = inputs.data_dir / "submissions" / "hard" / PASS / "solution.py"
    path.write_text(path.read_text(encoding="utf-8") + "# one more line\n", encoding="utf-8")


@pytest.mark.parametrize("change", [_touch_table, _annotate, _edit_solution],
                         ids=["parquet table", "annotation", "solution file"])
def test_a_changed_input_rebuilds(inputs: SiteInputs, tmp_path: Path, change: Callable[[SiteInputs], None]) -> None:
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    before = fp.recorded(out, MARKER)
    change(inputs)
    report = build_site(inputs.data_dir, inputs.decks_dir, out)
    assert not report.unchanged and report.pages > 0
    assert fp.recorded(out, MARKER) not in (None, before)


def test_a_changed_template_rebuilds(inputs: SiteInputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Templates are part of the fingerprint (here a copy of templates/ stands in for the checkout's)."""
    templates = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, templates)
    monkeypatch.setattr(fp, "SOURCE_INPUTS", (templates, *fp.SOURCE_INPUTS[1:]))
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    assert build_site(inputs.data_dir, inputs.decks_dir, out).unchanged
    (templates / "home.html").write_text((templates / "home.html").read_text() + "\n", encoding="utf-8")
    assert not build_site(inputs.data_dir, inputs.decks_dir, out).unchanged


def test_base_url_and_source_date_are_inputs(inputs: SiteInputs, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    assert not build_site(inputs.data_dir, inputs.decks_dir, out, base_url="https://example.org/kb/").unchanged
    assert build_site(inputs.data_dir, inputs.decks_dir, out, base_url="https://example.org/kb").unchanged
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    assert not build_site(inputs.data_dir, inputs.decks_dir, out, base_url="https://example.org/kb/").unchanged


def test_fingerprint_does_not_depend_on_where_the_inputs_are(tmp_path: Path) -> None:
    a, b = make_site_inputs(tmp_path / "a"), make_site_inputs(tmp_path / "b")
    assert fp.fingerprint(a.data_dir, a.decks_dir, None) == fp.fingerprint(b.data_dir, b.decks_dir, None)


def test_force_rebuilds_and_the_cli_reports_unchanged(inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    args = ["site", "build", "--data", str(inputs.data_dir), "--decks", str(inputs.decks_dir), "--out", str(out)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert first.output.startswith("built ")
    before = _snapshot(out)
    second = CliRunner().invoke(main, args)
    assert second.exit_code == 0, second.output
    assert second.output.startswith("unchanged: ") and "--force" in second.output
    assert _snapshot(out) == before
    forced = CliRunner().invoke(main, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert forced.output.startswith("built ")
    after = _snapshot(out)
    assert after.keys() == before.keys() and after["index.html"] != before["index.html"]
    assert (out / "index.html").read_bytes()  # the forced build is a complete site


def test_a_site_without_a_fingerprint_is_rebuilt(inputs: SiteInputs, tmp_path: Path) -> None:
    """A site built before fingerprints (marker without one) is never taken as up to date."""
    out = tmp_path / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    marker = out / MARKER
    marker.write_text(marker.read_text().split(fp.PREFIX)[0], encoding="utf-8")
    assert fp.recorded(out, MARKER) is None
    assert not build_site(inputs.data_dir, inputs.decks_dir, out).unchanged


def test_a_file_is_read_again_only_when_its_stat_changed(inputs: SiteInputs, tmp_path: Path) -> None:
    """Digests are remembered by stat beside the site; an edit (new ctime) is read again, the rest not."""
    out = tmp_path / "dist"
    first = fp.Hashes(tmp_path / "hashes")
    before = fp.digests(inputs.data_dir, inputs.decks_dir, None, first)
    first.save()
    assert first.hashed > 10
    time.sleep(0.01)
    again = fp.Hashes(tmp_path / "hashes")
    again._saved_ns += fp._RACY_NS  # as if saved two seconds after the files last changed (not racy)
    assert fp.digests(inputs.data_dir, inputs.decks_dir, None, again) == before and again.hashed == 0
    _edit_solution(inputs)
    third = fp.Hashes(tmp_path / "hashes")
    third._saved_ns += fp._RACY_NS
    after = fp.digests(inputs.data_dir, inputs.decks_dir, None, third)
    assert third.hashed == 1 and after["submissions"] != before["submissions"]
    assert {k: v for k, v in after.items() if k != "submissions"} == {k: v for k, v in before.items()
                                                                      if k != "submissions"}
    build_site(inputs.data_dir, inputs.decks_dir, out)
    assert (tmp_path / ".dist.hashes").is_file()

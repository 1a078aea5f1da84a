"""End-to-end builds of the fixture site: valid HTML, working links, same bytes, atomic failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree.ElementTree import Element

import html5lib
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from site_fixtures import DNF, GPU, HOUSE, PASS, PROBLEM, REFERENCE, WRONG, SiteInputs
from site_pages import check_internal_links
from site_pages import html_pages as _pages
from site_pages import parse as _tree
from site_pages import text as _text

from kernelboard.cli import main
from kernelboard.errors import DataError, DeckError, KernelboardError
from kernelboard.eval.tables import upsert
from kernelboard.sitegen import build_site
from kernelboard.sitegen.render import MARKER

EXPECTED_PAGES = {
    "index.html",
    f"problems/hard/{PROBLEM}/index.html",
    *(f"runs/{GPU}/{r}/index.html" for r in (HOUSE, REFERENCE, PASS, WRONG, DNF)),
    f"runs/cpu/{HOUSE}/index.html",
    *(f"gpu/{g}/index.html" for g in (GPU, "cpu")),
    "models/index.html",
    *(f"models/{m}/index.html" for m in ("kernelboard-house", "reference-eager", "fable-5", "orbit-2", "kinetic-k3")),
    "efficiency/index.html",
    "methodology/index.html",
    "downloads/index.html",
    "data/index.html",
    "runs/index.html",
}








def _snapshot(site: Path) -> dict[str, bytes]:
    return {p.relative_to(site).as_posix(): p.read_bytes() for p in sorted(site.rglob("*")) if p.is_file()}


def test_the_page_table_is_the_site(built_site: Path) -> None:
    assert set(_pages(built_site)) == EXPECTED_PAGES
    assert (built_site / "static" / "plotly.min.js").stat().st_size > 1_000_000
    assert (built_site / "static" / "favicon.ico").read_bytes()[:4] == b"\0\0\1\0"
    assert (built_site / MARKER).is_file()


@pytest.mark.parametrize("page", sorted(EXPECTED_PAGES))
def test_every_page_is_strictly_valid_html(built_site: Path, page: str) -> None:
    html5lib.HTMLParser(strict=True).parse((built_site / page).read_bytes())


def test_every_internal_link_resolves(built_site: Path) -> None:
    """href/src are relative (no leading '/'), and each names a file or a folder with index.html;
    each #fragment names an id on its target page."""
    assert check_internal_links(built_site, _pages(built_site), allow_external=True) > 40


def test_two_builds_are_byte_identical(site_inputs: SiteInputs, built_site: Path, tmp_path: Path) -> None:
    again = tmp_path / "dist"
    build_site(site_inputs.data_dir, site_inputs.decks_dir, again)
    build_site(site_inputs.data_dir, site_inputs.decks_dir, again)  # replacing a previous build
    assert _snapshot(again) == _snapshot(built_site)
    # no temporary folder left behind; the input files' digests are kept (fingerprint.Hashes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dist.hashes", "dist"]


def test_the_date_is_source_date_epoch_or_the_newest_grading(site_inputs: SiteInputs, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    build_site(site_inputs.data_dir, site_inputs.decks_dir, tmp_path / "a")
    assert "Last updated 2026-11-29 19:30 UTC" in _text(_tree(tmp_path / "a" / "index.html"))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    build_site(site_inputs.data_dir, site_inputs.decks_dir, tmp_path / "b")
    assert "Last updated 2026-01-01 00:00 UTC" in _text(_tree(tmp_path / "b" / "index.html"))
    assert oct((tmp_path / "b").stat().st_mode & 0o777) == "0o755"  # world-readable for Pages


def test_a_failed_build_leaves_the_previous_site_untouched(fresh_inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, out)
    before = _snapshot(out)
    (fresh_inputs.results_dir / GPU / "results.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError) as exc:
        build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, out)
    assert "results.parquet: cannot read as parquet" in str(exc.value)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dist.hashes", "dist", "inputs"]


def test_a_headline_that_is_not_the_geomean_of_its_shapes_is_a_data_error(fresh_inputs: SiteInputs,
                                                                          tmp_path: Path) -> None:
    path = fresh_inputs.results_dir / GPU / "results.parquet"
    row = next(r for r in pq.read_table(path).to_pylist() if r["run_id"] == PASS)
    row.pop("schema_version")
    upsert(path, "results", [{**row, "speedup_vs_compile": 9.99}])
    expected = r"row \d+ \(run_id='.*fable-5.*'.*field 'speedup_vs_compile'.*geomean"
    with pytest.raises(DataError, match=expected):
        build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


def test_a_missing_deck_is_a_clear_error(fresh_inputs: SiteInputs, tmp_path: Path) -> None:
    shutil.rmtree(fresh_inputs.decks_dir / "hard" / PROBLEM)
    with pytest.raises(DeckError, match=f"no deck folder for problem hard/{PROBLEM}"):
        build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


def test_refuses_to_replace_a_folder_that_is_not_a_site(site_inputs: SiteInputs, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(KernelboardError, match="not a kernelboard site"):
        build_site(site_inputs.data_dir, site_inputs.decks_dir, precious)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_no_results_yet_builds_the_home_page(tmp_path: Path, site_inputs: SiteInputs) -> None:
    (tmp_path / "data" / "results").mkdir(parents=True)
    report = build_site(tmp_path / "data", site_inputs.decks_dir, tmp_path / "dist")
    assert report.pages == 4  # home, methodology, downloads (the site nav links to all three) and the data page
    assert (tmp_path / "dist" / "data" / "index.html").is_file()  # every page's footer links to it
    assert "No graded results yet" in (tmp_path / "dist" / "index.html").read_text()


# ----------------------------------------------------------------------------------- what pages say


def _cell(site: Path, gpu: str, model_display: str) -> Element:
    board = _tree(site / "index.html").find(f".//div[@id='board-{gpu}-hard']")
    assert board is not None
    for row in board.iterfind(".//tbody/tr"):
        if _text(row.find("th")).startswith(model_display):
            cells = [td for td in row.iterfind("td") if "cell" in (td.get("class") or "").split()]
            assert len(cells) == 1
            return cells[0]
    raise AssertionError(f"no row for {model_display!r}")


def test_dnf_cell_says_dnf_and_why_and_has_no_number(built_site: Path) -> None:
    cell = _cell(built_site, GPU, "Kinetic K3 <beta>")
    assert "tone-dnf" in cell.get("class", "")
    assert _text(cell) == "DNF rate limited"
    assert "×" not in _text(cell) and "0" not in _text(cell)
    row_text = _text(_tree(built_site / "index.html").find(f".//div[@id='board-{GPU}-hard']"))
    assert "no score 1 DNF not counted" in row_text


def test_cells_show_speedup_failure_kind_and_house_tag(built_site: Path) -> None:
    assert _text(_cell(built_site, GPU, "Fable 5")) == "1.86× ★"  # the winner on this problem
    assert "best" in _cell(built_site, GPU, "Fable 5").get("class", "")
    wrong = _cell(built_site, GPU, "Orbit 2")
    assert _text(wrong) == "wrong" and "tone-bad" in wrong.get("class", "")
    board = _tree(built_site / "index.html").find(f".//div[@id='board-{GPU}-hard']")
    rows = [(_text(r.find("td")), _text(r.find("th"))) for r in board.iterfind(".//tbody/tr")]
    assert rows == [("1", "Fable 5 claude"), ("2", "Orbit 2 codex"), ("—", "Kinetic K3 <beta> opencode"),
                    ("—", "kernelboard house house kernel house"),
                    ("—", "Reference (eager PyTorch) calibration house")]
    reference = _cell(built_site, GPU, "Reference (eager PyTorch)")
    assert _text(reference) == "0.50×" and "best" not in reference.get("class", "")
    pips = {_text(r.find("th")): [p.get("class") for p in r.iterfind(".//span[@class='pips']/span")]
            for r in board.iterfind(".//tbody/tr")}
    assert pips["Fable 5 claude"] == ["pip pip-pass"] and pips["Orbit 2 codex"] == ["pip pip-fail"]
    assert pips["Kinetic K3 <beta> opencode"] == ["pip pip-dnf"]


def test_run_page_prints_its_arithmetic_and_provenance(built_site: Path) -> None:
    page = _text(_tree(built_site / "runs" / GPU / PASS / "index.html"))
    assert "1.86× geomean speedup over torch.compile" in page
    assert "geomean = (1.857 × 1.857 × 1.857 × 1.857 × 1.857)^(1/5) = 1.86×" in page
    assert "roofline geomean = (52.00% × 52.00% × 52.00% × 52.00% × 52.00%)^(1/5) = 52.0%" in page
    for fact in ("NVIDIA H200", "580.95.05", "12.8", "2.11.0", "3.5.0", "42, 123, 456", "cuda_event",
                 "2026-11-29 19:30 UTC", "1,843,002 in", "Anthropic", "huggingface.co/datasets/example"):
        assert fact in page
    assert "CPU timings" not in page


def test_each_shape_says_how_it_was_timed(fresh_inputs: SiteInputs, tmp_path: Path) -> None:
    """A shape row's `timing_method` is printed under its time; a GPU row of a grader before 0.4.0
    (no method recorded) was timed synchronised and says so; a CPU timing and an imported row say
    nothing (another clock, another grader's method)."""
    path = fresh_inputs.results_dir / GPU / "shapes.parquet"
    rows = [r for r in pq.read_table(path).to_pylist() if r["run_id"] == PASS]
    for r in rows:
        r.pop("schema_version")
    upsert(path, "shapes", [{**r, "timing_method": "covered" if r["shape_idx"] == 0 else None} for r in rows])
    out = build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, tmp_path / "dist").out_dir
    methods = [_text(e) for e in _tree(out / "runs" / GPU / PASS / "index.html").iter()
               if "timing-method" in (e.get("class") or "")]
    assert methods == ["covered"] + ["synchronised"] * (len(rows) - 1)
    cpu = (out / "runs" / "cpu" / HOUSE / "index.html").read_text()
    assert "timing-method" not in cpu


def test_cpu_run_page_says_cpu_timings_loudly(built_site: Path) -> None:
    tree = _tree(built_site / "runs" / "cpu" / HOUSE / "index.html")
    assert "CPU timings." in _text(tree.find(".//p[@class='alert']"))
    assert _text(tree.find(".//strong[@class='loud']")) == "CPU timings"


def test_a_failed_run_page_says_its_grader_message_once(built_site: Path) -> None:
    """A failure's reason is its grader's message: the headline says it, and the status line beneath it
    does not say it again; a pass's status line keeps its message (what it was checked on)."""
    wrong = _tree(built_site / "runs" / GPU / WRONG / "index.html")
    headline = wrong.find(".//section[@class='headline tone-bad']")
    message = _text(headline.find("p[2]")).removeprefix("did not score: ")
    assert len(message) > 20 and _text(headline).count(message) == 1
    passed = _tree(built_site / "runs" / GPU / PASS / "index.html")
    assert _text(passed.find(".//p[@class='status-line']")) == "pass passed every shape, seed and stress case"


def test_hostile_text_is_escaped_and_non_http_traces_are_not_links(built_site: Path) -> None:
    wrong = (built_site / "runs" / GPU / WRONG / "index.html").read_text()
    assert 'href="javascript:' not in wrong and "<code>javascript:alert(1)</code>" in wrong
    assert "<b>not markup</b>" not in wrong and "&lt;b&gt;" in wrong
    assert "Kinetic K3 &lt;beta&gt;" in (built_site / "index.html").read_text()


def test_plotly_loads_once_and_only_where_charts_are(built_site: Path) -> None:
    problem = (built_site / "problems" / "hard" / PROBLEM / "index.html").read_text()
    assert problem.count('<script src="../../../static/plotly.min.js"></script>') == 1
    assert 'id="chart-speedup-h200"' in problem and 'id="chart-roofline-h200"' in problem
    assert '"displaylogo": false' in problem
    for page in ("index.html", f"runs/{GPU}/{PASS}/index.html"):
        assert "plotly" not in (built_site / page).read_text()
    assert len(list(built_site.rglob("plotly*.js"))) == 1


def test_problem_page_carries_the_chart_numbers_in_a_table(built_site: Path) -> None:
    tree = _tree(built_site / "problems" / "hard" / PROBLEM / "index.html")
    table = tree.find(".//section[@id='gpu-h200']//table")
    rows = [_text(r) for r in table.iterfind(".//tbody/tr")]
    assert rows[0].startswith("kernelboard house house kernel") and "2.54×" in rows[0]
    assert any(r.startswith("Fable 5") and "1.86×" in r and "52.0%" in r for r in rows)
    assert any("DNF rate limited" in r for r in rows)
    assert tree.find(".//section[@id='readme']//h2") is not None  # README rendered, headings demoted


# --------------------------------------------------------------------------------------------- CLI


def test_cli_builds_the_site(site_inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    result = CliRunner().invoke(main, ["site", "build", "--data", str(site_inputs.data_dir),
                                       "--decks", str(site_inputs.decks_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"built {len(EXPECTED_PAGES)} pages in ") and str(out) in result.output
    assert (out / "index.html").is_file()


def test_cli_reports_bad_data_in_one_line_without_a_traceback(fresh_inputs: SiteInputs,
                                                               tmp_path: Path) -> None:
    (fresh_inputs.results_dir / GPU / "runs.parquet").write_bytes(b"garbage")
    args = ["site", "build", "--data", str(fresh_inputs.data_dir), "--decks", str(fresh_inputs.decks_dir),
            "--out", str(tmp_path / "dist")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "runs.parquet" in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "dist").exists()


def test_the_site_never_imports_torch_or_the_grader_workers(site_inputs: SiteInputs, tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from kernelboard.sitegen import build_site; "
        f"build_site(Path({str(site_inputs.data_dir)!r}), Path({str(site_inputs.decks_dir)!r}), "
        f"Path({str(tmp_path / 'dist')!r})); "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
        "'kernelboard.eval.worker', 'kernelboard.eval.timing', 'kernelboard.eval.correctness', "
        "'kernelboard.eval.schedule'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_run_pages_offer_the_raw_solution_and_problem_pages_chart_each_shape(built_site: Path) -> None:
    run_dir = built_site / "runs" / GPU / PASS
    raw = [a for a in _tree(run_dir / "index.html").iter("a") if a.get("data-raw-from") == "solution-code"]
    assert len(raw) == 1 and raw[0].get("download") == "solution.py"  # made by static/code.js from the page
    assert not (run_dir / "solution.py").exists()  # the page's text gives the file back (test_site_browser.py)
    problem_page = (built_site / "problems" / "hard" / PROBLEM / "index.html").read_text()
    assert f'id="chart-shapes-{GPU}"' in problem_page  # per-shape speedups beside the geomean
    assert "x-thin-open" in problem_page  # failed and DNF submissions are marked on the speedup chart

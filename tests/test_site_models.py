"""Per-GPU leaderboard pages, the models index and the model pages: built, ranked, escaped, linked, sortable.

The inputs are tests/site_fixtures.py's plus a second GPU (H100 SXM, where the order of two models flips),
a model whose key and name carry `<script>` (a pass on the H200, a DNF on the H100) and an audit note.
Browser tests drive the system Chromium (/usr/bin/chromium) through Playwright; never a downloaded one.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path

import html5lib
import pyarrow.parquet as pq
import pytest
import yaml
from browsing import needs_chromium, serve, watch
from site_fixtures import (
    BENCH,
    DNF,
    GPU,
    HOUSE,
    PASS,
    PROBLEM,
    WRONG,
    SiteInputs,
    _result,
    _run,
    _shape_rows,
    make_site_inputs,
)
from site_pages import check_internal_links
from site_pages import parse as _tree
from site_pages import text as _text

from kernelboard.eval.deck import load_problem
from kernelboard.eval.hardware import GPUS
from kernelboard.eval.tables import upsert
from kernelboard.sitegen import build_site
from kernelboard.sitegen.format import model_slug

H100 = "h100-sxm"
EVIL_MODEL = "evil<script>alert(1)</script>"
EVIL_DISPLAY = "Evil <script>alert('x')</script>"
EVIL_PASS = "20261128_131500_opencode_evil_03_paged_attention"
EVIL_DNF = "20261128_141500_opencode_evil_03_paged_attention"
MODELS = {"kernelboard-house", "reference-eager", "fable-5", "orbit-2", "kinetic-k3", EVIL_MODEL}



def _runs_of(inputs: SiteInputs, *run_ids: str) -> list[dict]:
    rows = pq.read_table(inputs.results_dir / GPU / "runs.parquet").to_pylist()
    out = [r for r in rows if r["run_id"] in run_ids]
    for r in out:
        r.pop("schema_version", None)
    return out


def _extend(inputs: SiteInputs) -> SiteInputs:
    """Add the H100 board, the `<script>` model and an audit note to the fixture inputs."""
    problem = load_problem(inputs.decks_dir / BENCH / PROBLEM)
    evil = dict(lab="<script>lab</script>")
    evil_pass = _run(EVIL_PASS, EVIL_MODEL, EVIL_DISPLAY, "opencode", **evil)
    evil_dnf = _run(EVIL_DNF, EVIL_MODEL, EVIL_DISPLAY, "opencode", "provider_error",
                    outcome_note="HTTP 503 <b>twice</b>", **evil)
    when = dict(graded_at=dt.datetime(2026, 11, 30, 8, 0, tzinfo=dt.UTC))

    # H200: the <script> model passes (between Fable 5 and Orbit 2's wrong kernel).
    shapes, _ = _shape_rows(problem, EVIL_PASS, GPU, 0.30)
    out = inputs.results_dir / GPU
    upsert(out / "runs.parquet", "runs", [evil_pass])
    upsert(out / "results.parquet", "results",
           [_result(EVIL_PASS, GPU, "pass", "passed every shape, seed and stress case", shapes)])
    upsert(out / "shapes.parquet", "shapes", shapes)

    # H100 SXM: Orbit 2 passes faster than Fable 5 (the order flips), the <script> model is a DNF.
    out = inputs.results_dir / H100
    hardware = {**GPUS[H100].hardware_row(), "measured_copy_gb_s": None, "measured_bf16_tflop_s": None,
                "measured_fp8_tflop_s": None, "measured_at": None}
    upsert(out / "hardware.parquet", "hardware", [hardware])
    results, shape_rows, baselines = [], [], []
    for run_id, bw in ((HOUSE, 0.61), (PASS, 0.30), (WRONG, 0.40)):
        rows, base = _shape_rows(problem, run_id, H100, bw)
        results.append(_result(run_id, H100, "pass", "passed every shape, seed and stress case", rows,
                               device_name="NVIDIA H100 80GB HBM3", **when))
        shape_rows += rows
        baselines = base
    results.append(_result(EVIL_DNF, H100, "dnf", "the provider failed; nothing to grade", [],
                           device_name="NVIDIA H100 80GB HBM3", **when))
    upsert(out / "runs.parquet", "runs", [*_runs_of(inputs, HOUSE, PASS, WRONG), evil_dnf])
    upsert(out / "results.parquet", "results", results)
    upsert(out / "shapes.parquet", "shapes", shape_rows)
    upsert(out / "baselines.parquet", "baselines", baselines)

    notes = inputs.data_dir / "annotations"
    notes.mkdir(parents=True, exist_ok=True)
    (notes / f"{EVIL_PASS}.yaml").write_text(yaml.safe_dump({
        "run_id": EVIL_PASS, "verdict": "suspect",
        "summary": "Timings look plausible; the <script> in the name is the model's own.",
        "auditor": "test fixture"}), encoding="utf-8")
    return inputs


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    inputs = _extend(make_site_inputs(tmp_path_factory.mktemp("models-inputs")))
    out = tmp_path_factory.mktemp("models-built") / "dist"
    build_site(inputs.data_dir, inputs.decks_dir, out)
    return out






def _new_pages(site: Path) -> dict[str, Path]:
    return {p.relative_to(site).as_posix(): p for p in sorted(site.rglob("index.html"))
            if p.relative_to(site).parts[0] in ("gpu", "models")}


def _gpu_rows(site: Path, gpu: str) -> list[list[str]]:
    table = _tree(site / "gpu" / gpu / "index.html").find(f".//table[@id='table-{BENCH}']")
    assert table is not None
    return [[_text(c) for c in row] for row in table.iterfind("./tbody/tr")]


def _home_order(site: Path, gpu: str) -> list[str]:
    board = _tree(site / "index.html").find(f".//div[@id='board-{gpu}-{BENCH}']")
    assert board is not None
    return [_text(row.find("th/a")) for row in board.iterfind(".//tbody/tr")]


# ------------------------------------------------------------------------------------------ build


def test_a_page_for_every_gpu_and_every_model(site: Path) -> None:
    slugs = {model_slug(m) for m in MODELS}
    assert len(slugs) == len(MODELS)
    assert set(_new_pages(site)) == {
        *(f"gpu/{g}/index.html" for g in (GPU, H100, "cpu")),
        "models/index.html",
        *(f"models/{s}/index.html" for s in slugs),
    }
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9._-]*", s) for s in slugs)
    assert model_slug("fable-5") == "fable-5" and model_slug(EVIL_MODEL).startswith("evil-script-alert-1-script-")
    index = _tree(site / "models" / "index.html")
    listed = [_text(r.find("th/a")) for r in index.iterfind(".//tbody/tr")]
    assert listed == ["Evil <script>alert('x')</script>", "Fable 5", "Kinetic K3 <beta>", "Orbit 2",
                      "kernelboard house", "Reference (eager PyTorch)"]


@pytest.mark.parametrize("gpu", [GPU, H100, "cpu"])
def test_gpu_page_rows_are_in_the_home_boards_order(site: Path, gpu: str) -> None:
    rows = _gpu_rows(site, gpu)
    assert [r[1].removesuffix(" house kernel").removesuffix(" calibration") for r in rows] == _home_order(site, gpu)


def test_gpu_page_columns_and_the_ranking_of_each_gpu(site: Path) -> None:
    h200 = _gpu_rows(site, GPU)
    assert [(r[0], r[1]) for r in h200] == [
        ("1", "Fable 5"), ("2", "Evil <script>alert('x')</script>"), ("3", "Orbit 2"), ("—", "Kinetic K3 <beta>"),
        ("—", "kernelboard house house kernel"), ("—", "Reference (eager PyTorch) calibration")]
    fable = h200[0]
    assert fable[2:] == ["Anthropic", "claude", "1/1", "0", "1.000", "1.86×", "52.0%", "61,340", "$4.12"]
    assert h200[2][4:8] == ["0/1", "0", "0.000", "—"]  # a wrong kernel scores 0 and has no speedup
    h100 = _gpu_rows(site, H100)
    assert [(r[0], r[1]) for r in h100] == [
        ("1", "Orbit 2"), ("2", "Fable 5"), ("—", "Evil <script>alert('x')</script>"),
        ("—", "kernelboard house house kernel")]
    evil = h100[2]
    assert evil[4:8] == ["0/1", "1 DNF", "no score", "—"]  # a DNF is a count, never a score of 0


def test_the_script_model_is_escaped_everywhere(site: Path) -> None:
    pages = [site / "index.html", *_new_pages(site).values(), site / "runs" / GPU / EVIL_PASS / "index.html"]
    for path in pages:
        html = path.read_text()
        assert "<script>alert" not in html and "<script>lab" not in html, path
        assert "<b>twice" not in html, path
    evil = (site / "models" / model_slug(EVIL_MODEL) / "index.html").read_text()
    assert "Evil &lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in evil
    scripts = [e.get("src") for p in pages for e in _tree(p).iter("script")]
    assert all(s is not None and s.endswith(("static/sort.js", "static/tabs.js", "static/plotly.min.js",
                                                       "static/code.js"))
               for s in scripts)


def test_every_internal_link_on_the_new_pages_resolves(site: Path) -> None:
    assert check_internal_links(site, _new_pages(site), allow_external=False) > 60


def test_the_new_pages_are_strictly_valid_html(site: Path) -> None:
    for path in _new_pages(site).values():
        html5lib.HTMLParser(strict=True).parse(path.read_bytes())


def test_model_page_cards_attempts_and_gpus(site: Path) -> None:
    fable = _tree(site / "models" / "fable-5" / "index.html")
    cards = [_text(c) for c in fable.iterfind(".//section[@id='board-h200-hard']//li")]
    assert len(cards) == 1 and cards[0].startswith("Paged Attention Decode 1.86× best over torch.compile")
    compare = fable.find(".//section[@id='across-gpus']//table")
    assert [_text(th) for th in compare.iterfind("./thead/tr/th")] == ["problem", "NVIDIA H100 SXM5", "NVIDIA H200 SXM"]
    assert [_text(td) for td in compare.iterfind("./tbody/tr/td")] == ["1.07×", "1.86×"]  # slower on the H100
    bars = [b.get("style") for b in compare.iterfind("./tbody/tr/td/span/span[@class='bar']")]
    assert bars[1] == "width: 100.0%" and float(bars[0].split()[1].rstrip("%")) < 60  # the H100 bar: shorter
    standing = [_text(td) for td in compare.iterfind("./tfoot/tr/td")]
    assert standing[1] == "1.000 rank 1 of 3" and standing[0].endswith("of 2")  # board score and rank per GPU
    attempts = [_text(r) for r in fable.iterfind(".//section[@id='attempts']//tbody/tr")]
    assert len(attempts) == 2 and all(a.startswith(PASS) for a in attempts)

    orbit = _tree(site / "models" / "orbit-2" / "index.html")
    assert "wrong shape 2 (GQA 8:1, long)" in _text(orbit.find(".//section[@id='attempts']"))
    assert "rank 3 of 3" in _text(orbit.find(".//section[@id='board-h200-hard']"))
    assert "rank 1 of 2" in _text(orbit.find(".//section[@id='board-h100-sxm-hard']"))

    kinetic = _tree(site / "models" / "kinetic-k3" / "index.html")
    assert "DNF rate limited — not counted against the model" in _text(kinetic.find(".//ul[@class='cards']"))
    assert "DNF rate limited" in _text(kinetic.find(".//section[@id='attempts']"))

    evil = _tree(site / "models" / model_slug(EVIL_MODEL) / "index.html")
    attempts = _text(evil.find(".//section[@id='attempts']"))
    assert "suspect Timings look plausible" in attempts and "DNF provider error" in attempts
    assert "not ranked" in _text(evil.find(".//section[@id='board-h100-sxm-hard']"))


def test_home_board_and_run_pages_link_to_the_model_pages(site: Path) -> None:
    board = _tree(site / "index.html").find(f".//div[@id='board-{GPU}-{BENCH}']")
    hrefs = [row.find("th/a").get("href") for row in board.iterfind(".//tbody/tr")]
    assert hrefs[0] == "models/fable-5/" and f"models/{model_slug(EVIL_MODEL)}/" in hrefs
    run = _tree(site / "runs" / GPU / DNF / "index.html")
    assert any(a.get("href") == "../../../models/kinetic-k3/" for a in run.iter("a"))


# ---------------------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    with serve(site) as url:
        yield url


def _column(page, index: int) -> list[str]:
    """The text of one column's cells, top to bottom, as shown."""
    cells = page.locator(f"#table-{BENCH} tbody tr > :nth-child({index + 1})").all_inner_texts()
    return [" ".join(c.split()) for c in cells]


@pytest.mark.browser
@needs_chromium
def test_clicking_a_header_sorts_the_table(browser, site_url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    page.goto(f"{site_url}gpu/{H100}/")
    table = page.locator(f"#table-{BENCH}")
    page.wait_for_selector(f"#table-{BENCH}.sort-ready")
    rank = table.locator("thead th").nth(0)
    speed = table.locator("thead th").nth(7)
    assert rank.get_attribute("aria-sort") == "ascending"
    assert _column(page, 7) == ["1.43×", "1.07×", "—", "2.18×"]  # rank order: the house row is last

    speed.click()
    assert speed.get_attribute("aria-sort") == "descending" and rank.get_attribute("aria-sort") is None
    assert _column(page, 7) == ["2.18×", "1.43×", "1.07×", "—"]
    speed.click()
    assert speed.get_attribute("aria-sort") == "ascending"
    assert _column(page, 7) == ["1.07×", "1.43×", "2.18×", "—"]  # missing values stay last

    table.locator("thead th").nth(1).click()  # the model name, as text
    assert _column(page, 1)[:2] == ["Evil <script>alert('x')</script>", "Fable 5"]
    rank.click()
    assert _column(page, 0) == ["1", "2", "—", "—"]
    assert problems == []
    page.close()


@pytest.mark.browser
@needs_chromium
def test_new_pages_load_without_console_errors(browser, site_url: str) -> None:
    page = browser.new_page()
    problems = watch(page)
    for path in (f"gpu/{GPU}/", f"gpu/{H100}/", "gpu/cpu/", "models/", "models/fable-5/",
                 f"models/{model_slug(EVIL_MODEL)}/"):
        page.goto(f"{site_url}{path}")
        page.wait_for_load_state("load")
    page.goto(f"{site_url}#board-{GPU}-{BENCH}")  # the home page opens the GPU tab holding the anchor
    page.locator(f"#board-{GPU}-{BENCH} tbody th a").first.click()
    page.wait_for_url("**/models/fable-5/")
    assert page.locator("h1").inner_text() == "Fable 5"
    page.goto(f"{site_url}models/")
    page.locator("table.models-table thead th").nth(3).click()  # runs, most first
    assert page.locator("table.models-table thead th").nth(3).get_attribute("aria-sort") == "descending"
    assert problems == []
    page.close()


@pytest.mark.browser
@needs_chromium
def test_the_gpu_table_reads_in_rank_order_without_javascript(browser, site_url: str) -> None:
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.goto(f"{site_url}gpu/{GPU}/")
    assert page.locator(f"#table-{BENCH} tbody tr").count() == 6
    assert _column(page, 0) == ["1", "2", "3", "—", "—", "—"]
    context.close()

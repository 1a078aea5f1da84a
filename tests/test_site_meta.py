"""The meta pages and files: methodology (settings from code and decks), downloads, sitemap, robots, CSP."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import urlsplit

import html5lib
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from site_fixtures import DNF, GPU, PASS, PROBLEM, SiteInputs
from site_pages import html_pages
from site_pages import parse as _tree
from site_pages import text as _text

from kernelboard.cli import main
from kernelboard.errors import KernelboardError
from kernelboard.eval import settings
from kernelboard.eval.hardware import GPUS
from kernelboard.sitegen import build_site
from kernelboard.sitegen.board import ORDERING_RULE
from kernelboard.sitegen.views_meta import CSP

BASE = "https://example.org/kernelboard/"
META_PAGES = ("methodology/index.html", "downloads/index.html")








@pytest.fixture(scope="module")
def site_with_base(site_inputs: SiteInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("meta") / "dist"
    build_site(site_inputs.data_dir, site_inputs.decks_dir, out, base_url=BASE.rstrip("/"))
    return out


@pytest.mark.parametrize("page", META_PAGES)
def test_meta_pages_are_strictly_valid_html(built_site: Path, page: str) -> None:
    html5lib.HTMLParser(strict=True).parse((built_site / page).read_bytes())


def test_methodology_shows_the_decks_seeds_and_tolerances(built_site: Path, site_inputs: SiteInputs) -> None:
    deck = yaml.safe_load((site_inputs.decks_dir / "hard" / PROBLEM / "problem.yaml").read_text())
    tree = _tree(built_site / "methodology" / "index.html")
    rules = tree.find(f".//section[@id='rules-hard-{PROBLEM}']")
    assert rules is not None
    text = _text(rules)
    assert ", ".join(str(s) for s in deck["seeds"]) in _text(rules.find(".//dd[@class='seeds']"))
    # The nominal bfloat16 tolerance and every stress case's, as problem.yaml spells them.
    rows = {_text(tr.find("th")): [_text(td) for td in tr.iterfind("td")] for tr in rules.iterfind(".//tbody/tr")}
    nominal = deck["tolerance"]["bfloat16"]
    assert rows["bfloat16"][0] == f"atol {nominal['atol']:g} · rtol {nominal['rtol']:g}"
    header = [_text(th) for th in rules.iterfind(".//thead/tr/th")][1:]
    for case in deck["numeric_stress"]:
        tol = case["tolerance"]["bfloat16"]
        assert rows["bfloat16"][header.index(case["name"])] == f"atol {tol['atol']:g} · rtol {tol['rtol']:g}"
        assert case["name"] in text
    assert deck["structural_stress"]["function"] in text
    for rule in (*deck["forbidden"], *deck["forbidden_ops"], *deck["forbidden_kernels"]):
        assert rule in text
    assert "own kernel requiredyes: the timed call" in text  # dt and dd text run together


def test_methodology_shows_the_graders_settings_from_code(built_site: Path) -> None:
    text = _text(_tree(built_site / "methodology" / "index.html"))
    assert f"{settings.L2_FLUSH_FACTOR}× the GPU's L2 size" in text
    assert f"below {settings.LAUNCH_BOUND_MS} ms" in text
    assert f"{settings.ESCAPE_SLACK_MS} ms + {settings.ESCAPE_FRACTION} × the event median" in text
    for variant in settings.BASELINE_VARIANTS["cuda"]:
        assert variant in text
    assert " and ".join(settings.HEADLINE_COMPILE_VARIANTS) in text
    for kind, since in settings.BASELINE_METHOD_SINCE.items():
        assert f"{kind} rows since {since}" in text
    assert f"(this grader is {settings.GRADER_VERSION})" in text
    assert ORDERING_RULE in text
    assert f"built with grader {settings.GRADER_VERSION}" in text
    assert f"a pool of {settings.TIMING_POOL_SETS} input sets" in text
    assert f"sleeps {settings.COVER_FACTOR:.0f}× the host's slowest dispatch" in text
    assert f"cover less than {settings.PROOF_CLAIM_FACTOR} of the judge's time" in text
    assert f"implies more than {100 * settings.PEAK_FRACTION_LIMIT:.1f}% of the GPU's datasheet peak" in text
    assert re.search(r"The most any pass on this site reached is \d+\.\d+% \(\S+ on the ", text)
    for spec in GPUS.values():
        assert spec.name in text and f"{spec.bandwidth_gb_s:,.0f}" in text


def test_the_grader_uses_the_settings_module() -> None:
    """The constants the page prints are the grader's own objects, not copies (source check: no torch here)."""
    root = Path(__file__).resolve().parents[1] / "eval"
    for module, names in (("judge.py", ("LAUNCH_BOUND_MS", "BASELINE_TIMING_SEEDS")),
                          ("audit.py", ("ESCAPE_FRACTION", "LIBRARY_KERNEL")),
                          ("timing.py", ("L2_FLUSH_FACTOR", "CUDA_TIMER")),
                          ("schedule.py", ("BASELINE_VARIANTS", "GRADER_VERSION")),
                          ("scoring.py", ("HEADLINE_COMPILE_VARIANTS", "PEAK_FRACTION_LIMIT"))):
        source = (root / module).read_text()
        for name in names:
            assert re.search(rf"from \.settings import \(?[^)]*\b{name}\b", source), (module, name)
            assert not re.search(rf"^{name}\s*=", source, re.M), (module, name)


def test_downloads_link_every_table_in_three_formats_with_matching_rows(built_site: Path) -> None:
    tree = _tree(built_site / "downloads" / "index.html")
    parquets = sorted(p.relative_to(built_site).as_posix() for p in (built_site / "data").rglob("*.parquet"))
    assert parquets  # h200 and cpu tables
    rows = tree.findall(".//table[@class='downloads-table']/tbody/tr")
    assert len(rows) == len(parquets)
    for row in rows:
        links = {a.get("data-format"): a.get("href") for a in row.iterfind(".//a")}
        assert set(links) == {"parquet", "csv", "json"}
        files = {fmt: (built_site / "downloads" / href).resolve() for fmt, href in links.items()}
        assert all(f.is_file() for f in files.values()), files
        n = pq.read_metadata(files["parquet"]).num_rows
        assert _text(row.find(".//td[@class='num rows']")) == f"{n:,d}"
        with files["csv"].open(encoding="utf-8") as fh:
            assert sum(1 for _ in fh) - 1 == n  # header line, no embedded newlines in the fixture
        records = json.loads(files["json"].read_text(encoding="utf-8"))
        assert len(records) == n
        assert set(records[0]) == set(pq.read_schema(files["parquet"]).names) if n else True
    results = json.loads((built_site / "data" / "results" / GPU / "results.json").read_text())
    assert results[0]["seeds"] == [42, 123, 456] and results[0]["graded_at"].startswith("2026-11-29T19:30")


def test_footer_links_downloads_and_shows_provenance(built_site: Path) -> None:
    footer = _tree(built_site / "index.html").find(".//footer")
    assert footer.find(".//a[@href='downloads/']") is not None
    text = _text(footer)
    assert "NVIDIA H200 SXM (graded on NVIDIA H200): grader 0.1.0 · driver 580.95.05 · CUDA 12.8 · torch 2.11.0" in text
    assert "x86_64 CPU: grader 0.1.0 · torch 2.11.0" in text
    assert "Last updated 2026-11-29" in text


def test_every_page_has_the_csp_nav_and_og_tags(built_site: Path) -> None:
    for rel in _pages(built_site):
        head = _tree(built_site / rel).find("head")
        metas = head.findall("meta")
        csp = [m.get("content") for m in metas if (m.get("http-equiv") or "").lower() == "content-security-policy"]
        assert csp == [CSP], rel
        og = {m.get("property"): m.get("content") for m in metas if m.get("property")}
        assert {"og:title", "og:description", "og:type"} <= set(og) and "og:url" not in og, rel
        nav = [_text(a) for a in _tree(built_site / rel).findall(".//nav[@class='site-nav']//a")]
        assert nav == ["Home", "Models", "Runs", "Efficiency", "Methodology", "Downloads"], rel


def test_pages_describe_themselves_for_link_previews(built_site: Path) -> None:
    """A shared link to a run, problem, model or GPU page previews what that page holds, not the site blurb."""
    def og(rel: str) -> str:
        head = _tree(built_site / rel).find("head")
        content = {m.get("property"): m.get("content") for m in head.findall("meta") if m.get("property")}
        assert content["og:description"] == head.find("meta[@name='description']").get("content")
        return content["og:description"]

    assert og(f"runs/{GPU}/{PASS}/index.html").startswith(
        "Fable 5 on Paged Attention Decode (Hard deck, NVIDIA H200 SXM): 1.86× over torch.compile.")
    assert og(f"runs/{GPU}/{DNF}/index.html").startswith("Kinetic K3 <beta> on Paged Attention Decode (Hard deck, "
                                                        "NVIDIA H200 SXM): DNF (rate limited).")
    assert og(f"problems/hard/{PROBLEM}/index.html").startswith("Paged Attention Decode (Hard deck): ")
    assert og("models/fable-5/index.html").startswith("Fable 5: ")
    assert og(f"gpu/{GPU}/index.html").startswith("NVIDIA H200 SXM leaderboard: ")
    assert og("index.html") != og(f"gpu/{GPU}/index.html")


def test_no_page_has_an_inline_script(built_site: Path) -> None:
    """script-src 'self': every executed script is a file; chart data blocks are JSON, never run."""
    for rel in _pages(built_site):
        for script in _tree(built_site / rel).iter("script"):
            assert script.get("src") or script.get("type") == "application/json", (rel, script.attrib)
        assert not re.search(r"<[^>]+\son[a-z]+=", (built_site / rel).read_text()), rel  # no inline handlers


def test_csp_allows_only_self() -> None:
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'self'"
    assert "'unsafe-eval'" not in CSP and "http" not in CSP and "*" not in CSP


def test_robots_without_base_url_and_no_sitemap(built_site: Path) -> None:
    assert (built_site / "robots.txt").read_text() == "User-agent: *\nAllow: /\n"
    assert not (built_site / "sitemap.xml").exists()


def test_sitemap_lists_every_page_with_the_base_url(site_with_base: Path) -> None:
    urlset = ET.fromstring((site_with_base / "sitemap.xml").read_bytes())
    ns = {"s": "http://www.sitemaps.org/schemas/sitemap/0.9"}
    locs = [loc.text for loc in urlset.iterfind("s:url/s:loc", ns)]
    expected = [BASE + rel.removesuffix("index.html") for rel in _pages(site_with_base)]
    assert sorted(locs) == sorted(expected) and len(locs) == len(set(locs))
    assert all(urlsplit(u).scheme == "https" for u in locs)
    assert f"Sitemap: {BASE}sitemap.xml" in (site_with_base / "robots.txt").read_text()
    head = _tree(site_with_base / "methodology" / "index.html").find("head")
    og = {m.get("property"): m.get("content") for m in head.findall("meta") if m.get("property")}
    assert og["og:url"] == BASE + "methodology/"


def test_cli_takes_the_base_url_from_the_environment(site_inputs: SiteInputs, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    result = CliRunner().invoke(main, ["site", "build", "--data", str(site_inputs.data_dir), "--decks",
                                       str(site_inputs.decks_dir), "--out", str(out)],
                                env={"KERNELBOARD_BASE_URL": BASE})
    assert result.exit_code == 0, result.output
    assert BASE + "downloads/" in (out / "sitemap.xml").read_text()


@pytest.mark.parametrize("bad", ["example.org", "ftp://example.org/", "/kernelboard/", "https://x.org/?a=1"])
def test_a_base_url_that_is_not_absolute_http_is_refused(site_inputs: SiteInputs, tmp_path: Path, bad: str) -> None:
    with pytest.raises(KernelboardError, match="--base-url"):
        build_site(site_inputs.data_dir, site_inputs.decks_dir, tmp_path / "dist", base_url=bad)
    assert not (tmp_path / "dist").exists()


def _pages(site: Path) -> list[str]:
    return list(html_pages(site))


def test_grader_versions_are_listed_in_release_order() -> None:
    """'0.5.9' before '0.5.11' (a string sort puts it after), named or bare; text without a version first."""
    named = ["kernelboard 0.5.13", "kernelboard 0.5.7", "kernelboard 0.5.11", "KernelBench-Hard (imported)"]
    assert sorted(named, key=settings.version_order) == [
        "KernelBench-Hard (imported)", "kernelboard 0.5.7", "kernelboard 0.5.11", "kernelboard 0.5.13"]
    bare = ["0.5.11", "0.4.9", "0.5.9", "kbh"]
    assert sorted(bare, key=settings.version_order) == ["kbh", "0.4.9", "0.5.9", "0.5.11"]


def test_the_footer_names_each_boards_gpu_and_its_graders_in_release_order(committed_site: Path) -> None:
    """On the committed data: our boards first, as the home page's tabs; each board's name, the device its
    rows name where that differs ('NVIDIA H100 80GB HBM3' on the H100 SXM5 board); grader versions in release
    order (0.5.9 before 0.5.11, which a string sort reverses); an imported board names its grader."""
    from kernelboard.eval.settings import version_order

    lines = [_text(li) for li in _tree(committed_site / "index.html").iterfind(".//footer//ul[@class='provenance']/li")]
    assert lines[0].startswith("NVIDIA H100 SXM5 (graded on NVIDIA H100 80GB HBM3): grader 0.5.")
    assert lines[1].startswith("NVIDIA H200 SXM (graded on NVIDIA H200): grader 0.2.")
    for line in lines[:2]:
        versions = line.split(": grader ", 1)[1].split(" · ", 1)[0].split(", ")
        assert versions == sorted(versions, key=version_order) and len(versions) > 3, line
    assert "NVIDIA B200: grader KernelBench-Hard (imported), KernelBench-Mega (imported)" in lines

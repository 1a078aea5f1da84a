"""The site's meta pages and files: methodology, downloads, sitemap.xml, robots.txt, footer provenance.

The methodology page prints the grader's settings as the grader runs with them: the constants come
from `eval.settings` (the torch-free module that `timing`, `judge`, `audit`, `schedule` and `scoring`
import them from), the datasheet peaks from `eval.hardware`, the per-problem rules from the loaded
decks, the measured peaks from the hardware table, the ranking rule from `board` and the table of
verdicts that differ from the original grader's from `agreement`, the verdicts of one kernel on two of our
GPUs from `reproduced`, how far a figure moves when graded again from `regraded`. Nothing here is copied by
hand, and nothing imports torch.

The downloads page lists every table as Parquet (copied as graded) plus the CSV and JSON that the
build's export step (`exports.Exports`) writes into the site from the same Parquet files; it reads
their sizes from the build's `Exports`, which the page plan hands it. The data page renders the data
folder's README.md, the tables' contract in words, which every page's footer links to.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

import pyarrow.parquet as pq

from kernelboard.errors import KernelboardError
from kernelboard.eval import settings
from kernelboard.eval.deck import DEFAULT_TOLERANCE, Problem
from kernelboard.eval.hardware import GPUS, PRECISIONS
from kernelboard.eval.regrades import FLOOR_MARGIN

from .agreement import agreement
from .board import (
    ORDERING_RULE,
    STATUS_HELP,
    STATUS_LABELS,
    STATUS_TONES,
    gpu_label,
    measured_gpus,
    tab_gpu_order,
)
from .exports import Exports
from .load import CPU_KEY, HOST_BOUND_RATIO, SiteData
from .regraded import regraded
from .reproduced import reproduced
from .views import _markdown

_SOURCE = Path(__file__).resolve().parent.parent
#: The methodology page's prose (Markdown); the settings tables are added from code.
METHODOLOGY_MD = _SOURCE / "docs" / "methodology.md"
#: The data contract as the source checkout describes it: the data page's text when the data folder built
#: has no README.md of its own (every data folder follows this contract; its other sections describe
#: the committed data).
DATA_README = _SOURCE / "data" / "README.md"

#: Every page's Content-Security-Policy (a <meta http-equiv> in base.html): scripts and everything else
#: from the site only; inline styles are allowed because plotly.js injects its own <style> and sizes
#: its chart elements with style attributes (and the score bars use a width style); images may be data:
#: URLs (Plotly's mode-bar icons). No inline script: charts are JSON data blocks drawn by charts.js.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'")

#: The description a page gets for og:description when its context sets none.
SITE_DESCRIPTION = ("GPU kernels written by coding agents, graded on real GPUs for correctness, then timed "
                    "against torch.compile; per-GPU leaderboards with every number downloadable.")

#: The environment variable `kernelboard site build --base-url` falls back to.
BASE_URL_ENV = "KERNELBOARD_BASE_URL"


# --------------------------------------------------------------------------------------- base URL


def normalize_base_url(url: str | None) -> str | None:
    """An absolute http(s) URL ending in '/', or None; anything else is a usage error."""
    if url is None or not url.strip():
        return None
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise KernelboardError(f"--base-url must be an absolute http(s) URL such as "
                               f"https://example.org/kernelboard/, got {url!r}")
    return url if url.endswith("/") else url + "/"


def page_url(base_url: str | None, path: str) -> str | None:
    """A page's absolute address ('…/runs/h200/x/' for 'runs/h200/x/index.html'), or None without a base."""
    return None if base_url is None else base_url + path.removesuffix("index.html")


def sitemap(base_url: str, paths: list[str]) -> bytes:
    """sitemap.xml listing every page (absolute URLs, as the sitemap protocol requires)."""
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">']
    lines += [f"  <url><loc>{escape(page_url(base_url, p) or '')}</loc></url>" for p in sorted(paths)]
    lines.append("</urlset>")
    return ("\n".join(lines) + "\n").encode()


def robots(base_url: str | None) -> bytes:
    """robots.txt: everything may be crawled; the sitemap is named when there is one."""
    text = "User-agent: *\nAllow: /\n"
    if base_url is not None:
        text += f"Sitemap: {base_url}sitemap.xml\n"
    return text.encode()


# ------------------------------------------------------------------------------------- provenance


@dataclass(frozen=True)
class Provenance:
    """Where the results come from, per board GPU: the devices its rows name where they are not the board's
    own name, and the software they were graded with."""

    device: str  # the board's GPU, as its tabs name it
    graders: tuple[str, ...]  # in release order
    drivers: tuple[str, ...]
    cudas: tuple[str, ...]
    torches: tuple[str, ...]
    devices: tuple[str, ...] = ()  # the device names its rows record, where any differs from `device`


def provenance(data: SiteData) -> tuple[Provenance, ...]:
    """One entry per GPU in the results, in the home page's tab order (the GPUs kernelboard graded on, then
    the imported ones, then CPU timings), with the distinct versions seen."""
    by_gpu: dict[str, dict[str, set[str]]] = {}
    names: dict[str, set[str]] = {}
    for r in data.results:
        seen = by_gpu.setdefault(r.gpu, {"grader": set(), "driver": set(), "cuda": set(), "torch": set()})
        names.setdefault(r.gpu, set()).add(r.device_name)
        grader = r.measured_by if r.is_imported else r.grader_version  # 'KernelBench-Hard (imported)', not 'kbh'
        for key, value in (("grader", grader), ("driver", r.driver_version),
                           ("cuda", r.cuda_version), ("torch", r.torch_version)):
            if value:
                seen[key].add(value)
    entries = []
    for gpu in tab_gpu_order(by_gpu, measured_gpus(data.results)):
        label = gpu_label(data, gpu) if gpu in data.hardware else ", ".join(sorted(names[gpu]))  # CPU: its own
        devices = tuple(sorted(names[gpu])) if names[gpu] != {label} else ()
        entries.append(Provenance(label, tuple(sorted(by_gpu[gpu]["grader"], key=settings.version_order)),
                                  *(tuple(sorted(by_gpu[gpu][k])) for k in ("driver", "cuda", "torch")),
                                  devices=devices))
    return tuple(entries)


# ------------------------------------------------------------------------------------ methodology


def _tol(pair: tuple[float, float]) -> str:
    atol, rtol = pair
    return "exact" if atol == 0 and rtol == 0 else f"atol {atol:g} · rtol {rtol:g}"


@dataclass(frozen=True)
class ProblemRules:
    problem: Problem
    seeds: tuple[int, ...]
    case_names: tuple[str, ...]  # "nominal", the numeric stress cases, then the structural cases
    tolerance_rows: tuple[tuple[str, tuple[str, ...]], ...]  # (dtype, one tolerance per case)
    numeric_cases: tuple[tuple[str, str], ...]  # (name, what it rescales)
    structural: tuple[tuple[str, str], ...]  # (function, description)
    forbidden: tuple[str, ...]
    forbidden_ops: tuple[str, ...]
    forbidden_kernels: tuple[str, ...]
    require_own_kernel: bool
    output_rule: str


def problem_rules(problem: Problem) -> ProblemRules:
    """The deck's correctness and audit rules, tolerances resolved as `Problem.tolerance_for` does."""
    cases = [(None, "nominal"), *((c, c.name) for c in problem.numeric_stress)]
    structural: list[tuple[str, str]] = []
    ss = problem.structural_stress
    if ss is not None:
        cases.append((ss.as_stress(), f"structural: {ss.function}"))
        canonical = "; ".join(", ".join(f"{k}={v}" for k, v in c.items()) for c in ss.canonical) or "none"
        ranges = ", ".join(f"{k} ∈ [{lo}, {hi}]" for k, (lo, hi) in sorted(ss.random_ranges.items()))
        structural.append((ss.function, f"canonical: {canonical}; plus {ss.random_count} drawn from the "
                           f"grading run's fresh seed{f' ({ranges})' if ranges else ''}"))
    dtypes = sorted({*problem.tolerance, *(k for c, _ in cases if c is not None for k in c.tolerance)})
    rows = tuple((d, tuple(_tol(problem.tolerance_for(d, c)) for c, _ in cases)) for d in dtypes)
    numeric = tuple(
        (c.name, ", ".join(f"input {pos} × {factor:g}" for pos, factor in sorted(c.scale.items())) or "—")
        for c in problem.numeric_stress
    )
    return ProblemRules(problem, problem.seeds, tuple(n for _, n in cases), rows, numeric, tuple(structural),
                        problem.forbidden, problem.forbidden_ops, problem.forbidden_kernels,
                        problem.require_own_kernel, problem.output_rule)


@dataclass(frozen=True)
class PeakRow:
    gpu: str
    name: str
    sm: str
    memory_gb: float
    l2_mb: float | None
    bandwidth_gb_s: float
    peaks: tuple[float | None, ...]  # one per PRECISIONS
    source: str


@dataclass(frozen=True)
class MeasuredRow:
    gpu: str
    label: str
    copy_gb_s: float | None
    bf16_tflop_s: float | None
    fp8_tflop_s: float | None
    measured_at: datetime | None


@dataclass(frozen=True)
class HighestPass:
    """The largest fraction of its regime's peak any pass's shape reached: how far honest kernels stay
    below the limit a pass is refused beyond (settings.PEAK_FRACTION_LIMIT)."""

    fraction: float
    run_id: str
    gpu: str
    gpu_label: str
    imported: bool


def highest_pass_fraction(data: SiteData) -> HighestPass | None:
    shapes = [(s.peak_fraction, r) for r in data.results if r.is_pass for s in r.shapes
              if s.peak_fraction is not None]
    if not shapes:
        return None
    fraction, result = max(shapes, key=lambda item: item[0])
    return HighestPass(fraction, result.run_id, result.gpu, gpu_label(data, result.gpu), result.is_imported)


def methodology(data: SiteData) -> dict[str, Any]:
    prose = METHODOLOGY_MD.read_text(encoding="utf-8") if METHODOLOGY_MD.is_file() else ""
    measured = [
        MeasuredRow(gpu, gpu_label(data, gpu), hw.measured_copy_gb_s, hw.measured_bf16_tflop_s,
                    hw.measured_fp8_tflop_s, hw.measured_at)
        for gpu, hw in sorted(data.hardware.items())
    ]
    return {
        "title": "Methodology",
        "description": "How kernelboard grades a kernel: correctness rules per problem, the timing method, "
                       "baselines, hardware peaks and the ranking rule, as the grader runs them.",
        "prose_html": _markdown(prose) if prose else None,
        "grader_version": settings.GRADER_VERSION,
        "graded_versions": sorted({r.grader_version for r in data.results}, key=settings.version_order),
        "results_comparable_since": settings.RESULTS_COMPARABLE_SINCE,
        "superseded": [(gpu_label(data, r.gpu), data.runs[r.run_id].problem, r.run_id, r.grader_version,
                        f"{r.status} under a rule a later grader changed"
                        if settings.verdict_superseded(r.grader_version, r.message, data.runs[r.run_id].problem)
                        else "a pass timed by an older method")
                       for r in sorted(data.superseded, key=lambda r: (r.gpu, data.runs[r.run_id].problem, r.run_id))],
        "problems": [problem_rules(data.problems[k]) for k in sorted(data.problems)],
        "default_tolerance": [(d, _tol(t)) for d, t in DEFAULT_TOLERANCE.items()],
        "cuda_timer": settings.CUDA_TIMER,
        "cpu_timer": settings.CPU_TIMER,
        "l2_flush_factor": settings.L2_FLUSH_FACTOR,
        "min_flush_mb": settings.MIN_FLUSH_BYTES / 2**20,
        "cpu_flush_mb": settings.CPU_FLUSH_BYTES / 2**20,
        "timing_pool_sets": settings.TIMING_POOL_SETS,
        "cover_factor": settings.COVER_FACTOR,
        "proof_claim_factor": settings.PROOF_CLAIM_FACTOR,
        "peak_fraction_limit": settings.PEAK_FRACTION_LIMIT,
        "highest_pass": highest_pass_fraction(data),
        "spin_up_ms": settings.SPIN_UP_MS,
        "launch_bound_ms": settings.LAUNCH_BOUND_MS,
        "escape_fraction": settings.ESCAPE_FRACTION,
        "escape_slack_ms": settings.ESCAPE_SLACK_MS,
        "library_kernel": settings.LIBRARY_KERNEL.pattern,
        "baseline_timing_seeds": settings.BASELINE_TIMING_SEEDS,
        "baseline_variants": sorted(settings.BASELINE_VARIANTS.items()),
        "headline_variants": settings.HEADLINE_COMPILE_VARIANTS,
        "baseline_method_since": sorted(settings.BASELINE_METHOD_SINCE.items()),
        "precisions": PRECISIONS,
        "datasheet": [PeakRow(s.key, s.name, s.sm, s.memory_gb, s.l2_mb, s.bandwidth_gb_s,
                              tuple(s.peak_tflop_s.get(p) for p in PRECISIONS), s.source)
                      for s in GPUS.values()],
        "measured": measured,
        "ordering_rule": ORDERING_RULE,
        "legend": [(STATUS_LABELS[s], STATUS_HELP[s]) for s in STATUS_LABELS],
        "agreement": (agreed := agreement(data)),
        "agreement_gpus": {g: gpu_label(data, g) for g in agreed.gpus},
        "reproduced": (again := reproduced(data)),
        "reproduced_gpus": {g: gpu_label(data, g) for g in again.gpus},
        "regraded": (timed_again := regraded(data)),
        "floor_margin": FLOOR_MARGIN,
        "host_bound_ratio": HOST_BOUND_RATIO,
        "regraded_gpus": {g.gpu: gpu_label(data, g.gpu) for g in timed_again.gpus},
        "status_labels": STATUS_LABELS,
        "status_tones": STATUS_TONES,
        "charts": False,
    }


# -------------------------------------------------------------------------------------- downloads


@dataclass(frozen=True)
class DownloadFile:
    format: str  # "Parquet", "CSV", "JSON"
    path: str  # relative to the site root
    size: int  # bytes

    @property
    def size_text(self) -> str:
        """'812 B', '14.2 KB', '3.1 MB' (powers of 1000, as file managers show them)."""
        for unit, factor in (("MB", 1e6), ("KB", 1e3)):
            if self.size >= factor:
                return f"{self.size / factor:.1f} {unit}"
        return f"{self.size} B"


@dataclass(frozen=True)
class DownloadTable:
    gpu: str
    label: str
    table: str
    rows: int
    columns: int
    files: tuple[DownloadFile, ...]


def data_page(data: SiteData) -> dict[str, Any]:
    """The data page: DATA/README.md rendered, else the source checkout's (and it says so), else nothing."""
    own = data.readme is not None
    text = data.readme if own else (DATA_README.read_text(encoding="utf-8") if DATA_README.is_file() else None)
    return {
        "title": "data/README.md",
        "description": "What the tables behind the leaderboards hold: every column, its unit and the rules "
                       "the loader enforces (data/README.md).",
        "readme_html": _markdown(text) if text is not None else None,
        "own_readme": own,
        "charts": False,
    }


#: The downloads page's GPU key of a table that spans every GPU (data/regrades.parquet).
EVERY_GPU = "all"


def downloads(data: SiteData, exports: Exports) -> dict[str, Any]:
    """The downloads page: every table as Parquet, CSV and JSON with row counts and sizes; the sizes of
    the CSV and JSON are those of `exports` (made here if the build has not made them yet)."""
    made = exports.files()
    tables = []
    for rel, path in sorted(data.table_files.items()):
        if not rel.endswith(".parquet"):
            continue
        meta = pq.read_metadata(path)
        gpu, table = (rel.split("/")[-2] if rel.count("/") > 1 else EVERY_GPU), Path(rel).stem
        stem = rel.removesuffix(".parquet")
        files = [DownloadFile("Parquet", rel, path.stat().st_size)]
        files += [DownloadFile(fmt, f"{stem}.{ext}", len(made[f"{stem}.{ext}"]))
                  for fmt, ext in (("CSV", "csv"), ("JSON", "json")) if f"{stem}.{ext}" in made]
        known = gpu == CPU_KEY or gpu in data.hardware
        label = "every GPU" if gpu == EVERY_GPU else gpu_label(data, gpu) if known else gpu
        tables.append(DownloadTable(gpu, label,
                                    table, meta.num_rows, meta.num_columns, tuple(files)))
    order = {g: i for i, g in enumerate([*tab_gpu_order({t.gpu for t in tables} - {EVERY_GPU},
                                                        measured_gpus(data.results)), EVERY_GPU])}
    tables.sort(key=lambda t: (order[t.gpu], t.table))
    logs = sorted(k for k in data.table_files if not k.endswith(".parquet"))
    return {
        "title": "Downloads",
        "description": "Every table behind the leaderboards, as Parquet, CSV and JSON, with row counts and sizes.",
        "tables": tables,
        "n_logs": len(logs),
        "charts": False,
    }

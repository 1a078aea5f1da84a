"""The runs index: every run of the data once, newest first, with what each GPU's grading made of it.

One row per run (a run graded on several GPUs — a published kernel regraded on the H200 — is still one
row, with a line per GPU), RUNS_PER_PAGE rows a page: `runs/` holds the newest, `runs/page/2/` the next,
and so on (at 10,000 runs one page of them all weighed 9 MB). Every row carries its model, problem and
per-GPU statuses as data attributes. `static/filter.js` filters in the browser: the page's own rows when
the index is one page, else every run, from `runs/runs.json` (`runs_json`: the same lines, compact),
drawn into the table in place of the page's rows. Without JavaScript each page is its part of the list,
in order, with links to the others. Statuses are the results' (`STATUS_LABELS`), except that a run an
audit flagged is 'flag' (shown as "flag: <verdict>"), as on the boards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .board import STATUS_LABELS, STATUS_TONES, flag_of, gpu_label, gpu_order, status_label
from .format import model_slug, pct, speedup, when
from .load import Result, Run, SiteData

#: The filter value and label of a run an audit invalidated (it is listed under it, not under its status).
FLAG = ("flag", "flagged by an audit")
#: Rows per page of the index: about 0.5 MB of HTML.
RUNS_PER_PAGE = 500


def page_count(data: SiteData) -> int:
    """How many pages the index has (one when there is no run at all)."""
    return max(1, -(-len(data.runs) // RUNS_PER_PAGE))


@dataclass(frozen=True)
class Grade:
    """One graded (run, GPU) as the index shows it: a link to its run page, its status and headline."""

    gpu: str
    gpu_label: str
    status: str  # a results status, or 'flag'
    label: str  # as the boards name it ('pass', 'needs sm_100a', 'flag: reward_hack')
    tone: str
    headline: str | None  # a pass's number: '2.28×', or '30.3% of roofline' where only that is known
    imported: bool


@dataclass(frozen=True)
class RunLine:
    run: Run
    slug: str
    grades: tuple[Grade, ...]  # in gpu_order; empty when the run has no result yet

    @property
    def filter_key(self) -> str:
        """'gpu:status' per grade, space-separated: what filter.js matches a GPU and a status against."""
        return " ".join(f"{g.gpu}:{g.status}" for g in self.grades)


def _headline(result: Result) -> str | None:
    if not result.is_pass:
        return None
    if result.speedup_vs_baseline is not None:
        return f"{speedup(result.speedup_vs_baseline)} vs baseline"
    if result.speedup_vs_compile is not None:
        return speedup(result.speedup_vs_compile)
    return f"{pct(result.peak_fraction)} of roofline" if result.peak_fraction is not None else None


def _grade(data: SiteData, result: Result) -> Grade:
    flag = flag_of(data.annotations.get(result.run_id))
    return Grade(result.gpu, gpu_label(data, result.gpu), FLAG[0] if flag else result.status,
                 flag or status_label(result), "bad" if flag else STATUS_TONES[result.status],
                 None if flag else _headline(result), result.is_imported)


def _lines(data: SiteData) -> list[RunLine]:
    """Every run's line, newest first (run ids start with their start time)."""
    by_run: dict[str, dict[str, Result]] = {}
    for result in data.results:
        by_run.setdefault(result.run_id, {})[result.gpu] = result
    lines = []
    for run_id in sorted(data.runs, reverse=True):
        run = data.runs[run_id]
        graded = by_run.get(run_id, {})
        lines.append(RunLine(run, model_slug(run.model),
                             tuple(_grade(data, graded[g]) for g in gpu_order(graded))))
    return lines


class RunsIndex:
    """The index's pages and runs.json, from one list of lines: made by `pages.plan`, the lines are
    built once in each process that renders one of them (not once per page: 20 pages at 10,000 runs)."""

    def __init__(self, data: SiteData) -> None:
        self.data = data

    @functools.cached_property
    def lines(self) -> list[RunLine]:
        return _lines(self.data)

    def page(self, page_no: int = 1) -> dict[str, Any]:
        return runs_index(self.data, page_no, self.lines)

    def json(self) -> dict[str, Any]:
        return runs_json(self.data, self.lines)


def runs_json(data: SiteData, lines: list[RunLine] | None = None) -> dict[str, Any]:
    """`runs/runs.json`, what the filter draws rows from when the index has several pages: per run
    [run_id, model key, model slug, model name, house tag, "bench/problem", started (ISO), started
    (as shown), [[gpu, status, label, tone, headline, imported], …]], newest first; the names of the
    problems and GPUs beside them."""
    rows = [[line.run.run_id, line.run.model, line.slug, line.run.model_display, line.run.house_tag,
             f"{line.run.bench}/{line.run.problem}",
             line.run.started_at.isoformat() if line.run.started_at else "", when(line.run.started_at),
             [[g.gpu, g.status, g.label, g.tone, g.headline, g.imported] for g in line.grades]]
            for line in (_lines(data) if lines is None else lines)]
    problems = {f"{b}/{p}": data.problems[(b, p)].display_name for b, p in {(r.bench, r.problem)
                                                                           for r in data.runs.values()}}
    gpus = {g: gpu_label(data, g) for g in gpu_order(r.gpu for r in data.results)}
    return {"payload": {"runs": rows, "problems": problems, "gpus": gpus}}


def runs_index(data: SiteData, page_no: int = 1, lines: list[RunLine] | None = None) -> dict[str, Any]:
    """Page `page_no` (from 1) of the index; `lines`, every run's, when already made."""
    every = _lines(data) if lines is None else lines
    pages = page_count(data)
    lines = every[(page_no - 1) * RUNS_PER_PAGE:page_no * RUNS_PER_PAGE]
    models = sorted({(r.model, r.model_display) for r in data.runs.values()}, key=lambda m: (m[1].lower(), m[0]))
    shared = {name for name in (d for _, d in models) if sum(1 for _, d in models if d == name) > 1}
    models = [(key, f"{name} ({key})" if name in shared else name) for key, name in models]
    problems = sorted({(r.bench, r.problem) for r in data.runs.values()})
    statuses = {g.status for line in every for g in line.grades}
    return {
        "title": "Runs" if page_no == 1 else f"Runs, page {page_no} of {pages}",
        "description": f"Every one of the {len(every)} agent runs, on every GPU it was graded on, with its "
                       "status and headline; filter by model, GPU, problem and status.",
        "lines": lines,
        "n_runs": len(every),
        "n_graded": sum(1 for line in every if line.grades),
        "page_no": page_no,
        "pages": pages,
        "first": (page_no - 1) * RUNS_PER_PAGE + 1,
        "models": models,
        "gpus": [(g, gpu_label(data, g)) for g in gpu_order(r.gpu for r in data.results)],
        "problems": [(f"{b}/{p}", data.problems[(b, p)].display_name, b) for b, p in problems],
        "problem_names": {f"{b}/{p}": data.problems[(b, p)].display_name for b, p in problems},
        "statuses": [(s, STATUS_LABELS[s]) for s in STATUS_LABELS if s in statuses]
                    + ([FLAG] if FLAG[0] in statuses else []),
        "charts": False,
    }

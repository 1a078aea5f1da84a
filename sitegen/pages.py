"""The one table of page kinds — template and output path — and the plan of every page to render.

A new page kind is a template plus one row in `PAGES` plus a context builder in `views.py`.
Output paths are directories with an `index.html`, linked as `dir/`; links are relative to
the page (`root` is "../" per directory level), so the site works at `/`, under `/REPO/` on
GitHub Pages, and from `python -m http.server`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from . import views, views_efficiency, views_meta, views_models, views_runs
from .exports import Exports
from .fastest import FastestLines
from .load import Result, SiteData


@dataclass(frozen=True)
class PageKind:
    """A kind of page: the template that renders it and its output path pattern."""

    template: str
    path: str  # relative to the output folder, with {placeholders} for the page's keys


#: Page kind -> template -> output path. The only place output paths are spelled.
PAGES: dict[str, PageKind] = {
    "home": PageKind("home.html", "index.html"),
    "problem": PageKind("problem.html", "problems/{bench}/{problem}/index.html"),
    "run": PageKind("run.html", "runs/{gpu}/{run_id}/index.html"),
    "methodology": PageKind("methodology.html", "methodology/index.html"),
    "downloads": PageKind("downloads.html", "downloads/index.html"),
    "data": PageKind("data.html", "data/index.html"),
    "runs": PageKind("runs.html", "runs/index.html"),
    "runs_page": PageKind("runs.html", "runs/page/{n}/index.html"),  # the index's pages after the first
    "runs_json": PageKind("runs.json", "runs/runs.json"),  # every run, compact: what the filter reads
    "efficiency": PageKind("efficiency.html", "efficiency/index.html"),
    "gpu": PageKind("gpu.html", "gpu/{gpu}/index.html"),
    "models": PageKind("models.html", "models/index.html"),
    "model": PageKind("model.html", "models/{model}/index.html"),
}


def page_path(kind: str, **keys: str) -> str:
    """The output file of one page: page_path('run', gpu='h200', run_id='x') = 'runs/h200/x/index.html'."""
    return PAGES[kind].path.format(**keys)


def link(kind: str, **keys: str) -> str:
    """A page's address relative to the site root, as a directory: 'runs/h200/x/' ('' for home)."""
    path = page_path(kind, **keys)
    return path.removesuffix("index.html")


def root_for(path: str) -> str:
    """The relative prefix from a page's folder back to the site root: '' or '../../../'."""
    return "../" * path.count("/")


@dataclass(frozen=True)
class Page:
    """One page to render: its kind, output path, and how to build its template context (without
    `root`). Contexts are built when the page renders, in whichever build worker renders it: ten
    thousand run contexts (source included) would otherwise be built, and held, up front."""

    kind: str
    path: str
    make_context: Callable[[], dict[str, Any]]
    result: Result | None = None  # a run page's graded run: what `page_keys` keys it by

    def context(self) -> dict[str, Any]:
        return self.make_context()

    @property
    def template(self) -> str:
        return PAGES[self.kind].template

    @property
    def root(self) -> str:
        return root_for(self.path)


#: The page kind that lists the build's exports (their sizes): the build renders it right after its
#: export step, in the same process, so the exports are made once (`render._write_site`).
LISTS_EXPORTS = "downloads"


def plan(data: SiteData, *, exports: Exports | None = None) -> list[Page]:
    """Every page of the site, in output-path order. What several pages share (the boards of
    `ModelPages`) is built here, once, before any page renders; so is what a page renders through,
    handed to it here rather than kept in a module: `exports`, the build's CSV and JSON exports, whose
    sizes the downloads page lists (a fresh one, for this plan alone, when not given). Rendering a page
    has no effect but its output and what it adds to that object."""
    exports = Exports(data.table_files) if exports is None else exports
    pages = [Page("home", page_path("home"), partial(views.home, data))]
    pages.append(Page("methodology", page_path("methodology"), partial(views_meta.methodology, data)))
    pages.append(Page(LISTS_EXPORTS, page_path(LISTS_EXPORTS), partial(views_meta.downloads, data, exports)))
    pages.append(Page("data", page_path("data"), partial(views_meta.data_page, data)))
    for bench, problem in sorted(data.problems):
        pages.append(Page("problem", page_path("problem", bench=bench, problem=problem),
                          partial(views.problem, data, bench, problem)))
    lines = FastestLines(data.baselines)  # each shape's fastest baseline, shared by every run page
    for result in data.results:
        pages.append(Page("run", page_path("run", gpu=result.gpu, run_id=result.run_id),
                          partial(views.run, data, result, lines), result))
    if data.results:  # score against spend per board; with nothing graded the site is the home page alone
        pages.append(Page("efficiency", page_path("efficiency"), partial(views_efficiency.efficiency, data)))
    if data.runs:  # every run (filterable), one leaderboard page per GPU, the models index, one page per model
        index = views_runs.RunsIndex(data)
        pages.append(Page("runs", page_path("runs"), index.page))
        pages += [Page("runs_page", page_path("runs_page", n=str(n)), partial(index.page, n))
                  for n in range(2, views_runs.page_count(data) + 1)]
        if views_runs.page_count(data) > 1:
            pages.append(Page("runs_json", page_path("runs_json"), index.json))
        models = views_models.ModelPages(data)
        pages += [Page("gpu", page_path("gpu", gpu=gpu), partial(models.gpu, gpu)) for gpu in models.gpus]
        pages.append(Page("models", page_path("models"), models.index))
        pages += [Page("model", page_path("model", model=models.slugs[m]), partial(models.model, m))
                  for m in models.models]
    return sorted(pages, key=lambda p: p.path)

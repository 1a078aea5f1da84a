"""Build the site: read and validate everything, render every page into a fresh folder, then swap it in.

`build_site` is a pure function of the data, the decks, `templates/` and `static/`: the same
inputs give the same bytes (sorted iteration, fixed chart ids, the date taken from
`SOURCE_DATE_EPOCH` or the newest `graded_at`, never the wall clock). Nothing is written until
the data has loaded and validated; the new site is written into a fresh folder beside `out_dir`
(by worker processes, see `output.py`) and renamed into place, so a failed build leaves the
previous site untouched.
"""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, pass_context, select_autoescape
from jinja2.runtime import Context

from kernelboard import __version__
from kernelboard.errors import KernelboardError

from . import fingerprint as fp
from .exports import Exports
from .format import FILTERS
from .highlight import page_gives_back
from .load import SiteData, load_site, remember, remembered
from .output import (
    PARALLEL_MIN_PAGES,
    Spare,
    Workers,
    adopt_spare,
    clear_stale,
    default_jobs,
    discard,
    mirror_spare,
    new_folder,
    swap_in,
    sweep,
    write_files,
)
from .page_keys import MANIFEST, manifest_bytes, page_keys, read_manifest
from .pages import LISTS_EXPORTS, Page, link, page_path, plan
from .repository import repository_url
from .views_meta import (
    CSP,
    SITE_DESCRIPTION,
    normalize_base_url,
    page_url,
    provenance,
    robots,
    sitemap,
)

_SOURCE = Path(__file__).resolve().parent.parent
#: Jinja templates, one per page kind plus `_partials`; shipped in the source checkout.
TEMPLATES_DIR = _SOURCE / "templates"
#: Files copied as they are into OUT/static/.
STATIC_DIR = _SOURCE / "static"
#: Written into every build; `build_site` only ever replaces a folder that holds it.
MARKER = ".kernelboard-site"
_MARKER_TEXT = "This folder is built by `kernelboard site build` and replaced whole by the next build.\n"

__all__ = ["BuildReport", "build_site", "make_env"]


@dataclass(frozen=True)
class BuildReport:
    """What a build did: how many pages, how long it took, where the site is. `unchanged`: the site in
    `out_dir` was built from the very same inputs (same fingerprint), so nothing was done."""

    out_dir: Path
    pages: int
    files: int
    seconds: float
    unchanged: bool = False
    rendered: int | None = None  # pages rendered (the others were unchanged); None: every page

    def summary(self) -> str:
        if self.unchanged:
            return (f"unchanged: {self.out_dir} was built from these exact inputs; nothing to do "
                    f"({self.seconds:.2f} s; --force rebuilds)")
        return f"built {self.pages} pages in {self.seconds:.2f} s → {self.out_dir}"


def is_unchanged(out_dir: Path, fingerprint: str) -> bool:
    """Whether `out_dir` holds a complete previous build made from inputs with this fingerprint."""
    out_dir = Path(out_dir)
    return (out_dir.is_dir() and not out_dir.is_symlink()
            and fp.recorded(out_dir, MARKER) == fingerprint and (out_dir / "index.html").is_file())


@pass_context
def _url(ctx: Context, kind: str, **keys: str) -> str:
    """A link from the page being rendered to another page (a directory ending in '/')."""
    return ctx["root"] + link(kind, **keys) or "./"


@pass_context
def _asset(ctx: Context, path: str) -> str:
    """A link from the page being rendered to a file under static/."""
    return f"{ctx['root']}static/{path}"


def make_env(templates_dir: Path = TEMPLATES_DIR) -> Environment:
    """Jinja with autoescape and StrictUndefined: a misspelled field fails the build, loudly."""
    env = Environment(
        loader=FileSystemLoader(templates_dir),
        autoescape=select_autoescape(["html"], default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(FILTERS)
    env.globals.update(url=_url, asset=_asset)
    return env


def _last_updated(data: SiteData) -> datetime | None:
    """The site's date: SOURCE_DATE_EPOCH when set (reproducible builds), else the newest graded_at."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            return datetime.fromtimestamp(int(epoch), tz=UTC)
        except ValueError:
            message = f"SOURCE_DATE_EPOCH must be whole seconds since 1970, got {epoch!r}"
            raise KernelboardError(message) from None
    return data.last_updated


def _assets(fingerprint: str | None = None) -> dict[str, bytes]:
    """static/ as is (Plotly and highlight.js are vendored there: static/plotly.README.md,
    static/highlight/README.md), plus the marker file."""
    if not TEMPLATES_DIR.is_dir() or not STATIC_DIR.is_dir():
        raise KernelboardError(f"no templates/ or static/ beside {_SOURCE / 'sitegen'}: "
                               "the site builds from a source checkout (pip install -e .)")
    files = {f"static/{p.relative_to(STATIC_DIR).as_posix()}": p.read_bytes()
             for p in sorted(STATIC_DIR.rglob("*")) if p.is_file()}
    files[MARKER] = (_MARKER_TEXT + (f"{fp.PREFIX}{fingerprint}\n" if fingerprint else "")).encode()
    return files


def _site(data: SiteData, base_url: str | None) -> dict[str, Any]:
    """What every page's base template reads."""
    return {"version": __version__, "last_updated": _last_updated(data), "csp": CSP,
            "description": SITE_DESCRIPTION, "base_url": base_url, "provenance": provenance(data),
            "repo_url": repository_url(),  # the footer's link to the source repository, or None (repository.py)
            # nav links to the pages `plan` builds only when there is something to show
            "has_models": bool(data.runs), "has_efficiency": bool(data.results)}


def _render(env: Environment, page: Page, site: dict[str, Any], base_url: str | None) -> bytes:
    html = env.get_template(page.template).render(page.context(), root=page.root, site=site, kind=page.kind,
                                                  page_url=page_url(base_url, page.path))
    return html.encode()


def render_all(data: SiteData, env: Environment | None = None, base_url: str | None = None) -> dict[str, bytes]:
    """Every page rendered in memory, in one process: output path -> bytes. `base_url` (absolute, ending
    in '/') gives pages their og:url; without it pages carry no absolute address. `build_site` renders
    the same bytes, spread over worker processes that write as they go. The exports the downloads page
    lists are made for this call alone and not returned."""
    env = env or make_env()
    site = _site(data, base_url)
    pages = plan(data, exports=Exports(data.table_files))
    return {page.path: _render(env, page, site, base_url) for page in pages}


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace anything but a previous build (or nothing, or an empty folder)."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise KernelboardError(f"{out_dir}: exists and is not a folder; refusing to replace it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).is_file():
        raise KernelboardError(f"{out_dir}: a non-empty folder that is not a kernelboard site (no {MARKER}); "
                               "refusing to replace it — pick another --out or remove it yourself")


def build_site(data_dir: Path, decks_dir: Path, out_dir: Path, base_url: str | None = None, *,
               force: bool = False, jobs: int | None = None) -> BuildReport:
    """Load, validate and render what changed, then replace `out_dir` with the new site in one rename.

    With `base_url` (the site's absolute address, see `views_meta.normalize_base_url`) the build also
    writes sitemap.xml and gives pages og:url; robots.txt is always written.

    Every input is fingerprinted (`fingerprint.digests`) into the marker file; when `out_dir` already
    holds a build with the same fingerprint, nothing is done and the report says `unchanged`. Otherwise
    each page is keyed by what it renders from (`page_keys`), and a large site (`output.PARALLEL_MIN_PAGES`
    pages or more) renders only the pages whose key changed: the others are already in its spare, hard
    links to the published files (`output.adopt_spare`). `force=True` builds anyway and renders every
    page (files whose bytes did not change are still not rewritten).

    Pages render and are written by `jobs` forked workers (`output.Workers`; default: every CPU this
    process may use when `output.PARALLEL_MIN_PAGES` pages or more are to render, else one process).
    The bytes are the same however many.

    Raises `DataError` or `DeckError` for bad input (nothing is written), and `KernelboardError`
    when `out_dir` is something other than a previous build.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    known = fp.Hashes(out_dir.parent / f".{out_dir.name}.hashes")  # the input files' digests, by stat
    kept = out_dir.parent / f".{out_dir.name}.data"  # the loaded, validated data (`load.remember`)
    if force or fp.recorded(out_dir, MARKER) is None:  # nothing to compare with: hash while loading
        hashing = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
        later = hashing.submit(fp.digests, Path(data_dir), Path(decks_dir), base_url, known)
        hashing.shutdown(wait=False)
        try:
            data = load_site(Path(data_dir), Path(decks_dir))
        finally:
            later.exception()  # waits: the thread is done before the workers fork or a load error leaves
        parts = later.result()
        fingerprint = fp.combined(parts)
        data_key = _data_key(parts, data_dir, decks_dir, known)
        remembered_data = None
    else:
        parts = fp.digests(Path(data_dir), Path(decks_dir), base_url, known)
        fingerprint = fp.combined(parts)
        if is_unchanged(out_dir, fingerprint):
            known.save()
            return BuildReport(out_dir, 0, 0, time.perf_counter() - started, unchanged=True)
        data_key = _data_key(parts, data_dir, decks_dir, known)
        remembered_data = remembered(kept, data_key, Path(data_dir))
        data = load_site(Path(data_dir), Path(decks_dir)) if remembered_data is None else remembered_data[0]
    base_url = normalize_base_url(base_url)
    _check_out_dir(out_dir)
    sweep(out_dir)
    known.save()  # after `_data_key`, which hashed the loading code
    exports = Exports(data.table_files)
    pages = plan(data, exports=exports)
    site = _site(data, base_url)
    keys, rows = page_keys(pages, data, parts, site, None if remembered_data is None else remembered_data[1])
    large = len(pages) >= PARALLEL_MIN_PAGES
    adopted = adopt_spare(out_dir, MARKER) if large else None
    new, spare = adopted if adopted is not None else (new_folder(out_dir), None)
    try:
        build = _Build(data, pages, exports, site, base_url, fingerprint, keys, new)
        todo, removed = build.plan_writes(out_dir, spare, {} if force else read_manifest(out_dir))
        if jobs is None:
            jobs = default_jobs() if len(todo) >= PARALLEL_MIN_PAGES else 1
        with Workers(jobs) as workers:
            written = build.write(todo, workers)
            swap_in(new, out_dir, workers, keep_spare=large)
    except BaseException:
        discard(new, out_dir, MARKER, keep_spare=large)
        raise
    if large:  # the previous site, now the spare, takes the new files as hard links
        mirror_spare(out_dir, written if spare is not None else None, removed)
        if remembered_data is None:  # the next build with the same tables and decks reads them back
            remember(kept, data_key, data, rows)
    return BuildReport(out_dir, len(pages), build.n_files, time.perf_counter() - started, rendered=len(todo))


def _data_key(parts: dict[str, str], data_dir: Path, decks_dir: Path, known: fp.Hashes) -> str:
    """What the loaded data depends on: the tables and decks (contents), where the submissions are read
    from, and the code that loads them (sitegen's, in the "site" digest, and the grader's table rules)."""
    where = f"{Path(data_dir).resolve()}\0{Path(decks_dir).resolve()}"
    return fp.combined({"tables": parts["tables"], "decks": parts["decks"], "site": parts["site"],
                        "loader": fp.loader_digest(known), "where": hashlib.sha256(where.encode()).hexdigest()})


class _Build:
    """One build's output: every page and file of the new site, and which of them to render and write.

    A run's solution, as the grader read it, lies beside its page (the run page's "raw solution.py" link)
    only where the page's text would not give it back (`highlight.page_gives_back`), written by the worker
    that renders the page; elsewhere the browser makes the raw file from the page. The export step (the CSV and JSON of
    `exports`, the slowest meta files to make) runs in a worker too, in parallel with the other pages,
    and right before the page that lists their sizes, so they are made once."""

    def __init__(self, data: SiteData, pages: list[Page], exports: Exports, site: dict[str, Any],
                 base_url: str | None, fingerprint: str, keys: dict[str, str], new: Path) -> None:
        self.data, self.pages, self.exports, self.site, self.base_url = data, pages, exports, site, base_url
        self.keys, self.new = keys, new
        self.raw = {page_path("run", gpu=r.gpu, run_id=r.run_id): r.run_id for r in data.results
                    if r.run_id in data.solutions and not page_gives_back(data.solutions[r.run_id])}
        tables = {rel: path.read_bytes() for rel, path in sorted(data.table_files.items())}
        meta = {"robots.txt": robots(base_url), MANIFEST: manifest_bytes(keys)}
        if base_url is not None:
            meta["sitemap.xml"] = sitemap(base_url, [p.path for p in pages if p.path.endswith(".html")])
        self.rest = {**_assets(fingerprint), **tables, **meta}
        self.n_files = len(pages) + len(self.raw) + len(self.rest) + len(exports.names)
        self.spare: Spare | None = None  # what `new` holds that this build keeps (`plan_writes`)

    def files_of(self, page: Page) -> list[str]:
        """The files one page's task writes: the page, its raw solution.py, the exports it lists."""
        own = [page.path]
        if page.path in self.raw:
            own.append(page.path.removesuffix("index.html") + "solution.py")
        if page.kind == LISTS_EXPORTS:
            own += self.exports.names
        return own

    def plan_writes(self, out_dir: Path, spare: Spare | None, previous: dict[str, str]) -> tuple[list[int], list[str]]:
        """Which pages to render (indices), and what was removed from the adopted `spare` because the new
        site lacks it. A page is skipped when its key is the one the published site was built with and
        every file it writes is already in `spare` as the published file itself (the same inode)."""
        if spare is None:
            return list(range(len(self.pages))), []
        wanted = [f for page in self.pages for f in self.files_of(page)] + [*self.rest]
        kept, removed = clear_stale(self.new, spare, wanted)
        self.spare = kept
        todo, published = [], str(out_dir)
        for i, page in enumerate(self.pages):
            if previous.get(page.path) != self.keys[page.path] or not all(
                    kept.files.get(rel) == _inode(os.path.join(published, rel)) for rel in self.files_of(page)):
                todo.append(i)
        return todo, removed

    def write(self, todo: list[int], workers: Workers) -> list[str]:
        """Render and write the pages of `todo` (spread over `workers`), then the rest of the site;
        returns the files written (new, or bytes changed)."""
        env = make_env()
        spare = self.spare
        made: set[str] = set()

        def write_page(j: int) -> list[str]:
            page = self.pages[todo[j]]
            # the export step, in the process that renders the page listing the exports (which reads them)
            files = sorted(self.exports.files().items()) if page.kind == LISTS_EXPORTS else []
            files.append((page.path, _render(env, page, self.site, self.base_url)))
            if page.path in self.raw:
                files.append((page.path.removesuffix("index.html") + "solution.py",
                              self.data.solutions[self.raw[page.path]].encode()))
            return write_files(self.new, files, made, spare)

        done = workers.map_indices(write_page, len(todo))
        rest = write_files(self.new, sorted(self.rest.items()), made, spare)
        return [rel for chunk in done for rel in chunk] + rest


def _inode(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None

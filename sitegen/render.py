"""Build the site: read and validate everything, render every page in memory, then swap it in.

`build_site` is a pure function of the data, the decks, `templates/` and `static/`: the same
inputs give the same bytes (sorted iteration, fixed chart ids, the date taken from
`SOURCE_DATE_EPOCH` or the newest `graded_at`, never the wall clock). Nothing is written until
every page has rendered; the new site is written into a fresh folder beside `out_dir` and
renamed into place, so a failed build leaves the previous site untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import plotly.offline
from jinja2 import Environment, FileSystemLoader, StrictUndefined, pass_context, select_autoescape
from jinja2.runtime import Context

from kernelboard import __version__
from kernelboard.errors import KernelboardError

from . import fingerprint as fp
from .format import FILTERS
from .highlight import HighlightCache, highlight_cache, pygments_css
from .load import SiteData, load_site
from .pages import link, plan
from .views_meta import (
    CSP,
    SITE_DESCRIPTION,
    normalize_base_url,
    page_url,
    provenance,
    robots,
    sitemap,
    table_exports,
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

    def summary(self) -> str:
        if self.unchanged:
            return (f"unchanged: {self.out_dir} was built from these exact inputs; nothing to do "
                    f"({self.seconds:.2f} s; --force rebuilds)")
        return f"built {self.pages} pages in {self.seconds:.2f} s → {self.out_dir}"


def default_cache_dir() -> Path:
    """Where highlighted sources are cached between builds: $KERNELBOARD_CACHE, else
    $XDG_CACHE_HOME/kernelboard, else ~/.cache/kernelboard (never inside the published site). Entries are
    keyed by content hash, so sites built from different data share it safely."""
    explicit = os.environ.get("KERNELBOARD_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kernelboard"


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
    """static/ as is, plus the Plotly bundle from the installed package and the Pygments CSS."""
    if not TEMPLATES_DIR.is_dir() or not STATIC_DIR.is_dir():
        raise KernelboardError(f"no templates/ or static/ beside {_SOURCE / 'sitegen'}: "
                               "the site builds from a source checkout (pip install -e .)")
    files = {f"static/{p.relative_to(STATIC_DIR).as_posix()}": p.read_bytes()
             for p in sorted(STATIC_DIR.rglob("*")) if p.is_file()}
    files["static/plotly.min.js"] = plotly.offline.get_plotlyjs().encode()
    files["static/pygments.css"] = pygments_css().encode()
    files[MARKER] = (_MARKER_TEXT + (f"{fp.PREFIX}{fingerprint}\n" if fingerprint else "")).encode()
    return files


def render_all(data: SiteData, env: Environment | None = None, base_url: str | None = None) -> dict[str, bytes]:
    """Every page rendered in memory: output path -> bytes. `base_url` (absolute, ending in '/') gives
    pages their og:url; without it pages carry no absolute address."""
    env = env or make_env()
    site = {"version": __version__, "last_updated": _last_updated(data), "csp": CSP,
            "description": SITE_DESCRIPTION, "base_url": base_url, "provenance": provenance(data),
            # nav links to the pages `plan` builds only when there is something to show
            "has_models": bool(data.runs), "has_efficiency": bool(data.results)}
    out = {}
    for page in plan(data):
        html = env.get_template(page.template).render(page.context, root=page.root, site=site, kind=page.kind,
                                                      page_url=page_url(base_url, page.path))
        out[page.path] = html.encode()
    return out


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace anything but a previous build (or nothing, or an empty folder)."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise KernelboardError(f"{out_dir}: exists and is not a folder; refusing to replace it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).is_file():
        raise KernelboardError(f"{out_dir}: a non-empty folder that is not a kernelboard site (no {MARKER}); "
                               "refusing to replace it — pick another --out or remove it yourself")


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    made: set[str] = set()
    for rel, content in sorted(files.items()):
        folder = os.path.dirname(rel)
        if folder not in made:
            (root / folder).mkdir(parents=True, exist_ok=True)
            made.add(folder)
        with open(root / rel, "wb") as f:
            f.write(content)


def _swap_in(new: Path, out_dir: Path) -> None:
    """Move the finished site to `out_dir`; the previous one is renamed aside, then deleted."""
    if not out_dir.exists():
        os.rename(new, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
    os.rename(out_dir, old / "site")
    try:
        os.rename(new, out_dir)
    except BaseException:
        os.rename(old / "site", out_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def build_site(data_dir: Path, decks_dir: Path, out_dir: Path, base_url: str | None = None, *,
               force: bool = False, cache_dir: Path | bool | None = True) -> BuildReport:
    """Load, validate and render everything, then replace `out_dir` with the new site in one rename.

    With `base_url` (the site's absolute address, see `views_meta.normalize_base_url`) the build also
    writes sitemap.xml and gives pages og:url; robots.txt is always written.

    Every input is fingerprinted (`fingerprint.fingerprint`) into the marker file; when `out_dir`
    already holds a build with the same fingerprint, nothing is done and the report says `unchanged`
    (`force=True` builds anyway). Highlighted sources are cached by content hash in `cache_dir`
    (default: `default_cache_dir()`; False: no disk cache).

    Raises `DataError` or `DeckError` for bad input (nothing is written), and `KernelboardError`
    when `out_dir` is something other than a previous build.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    fingerprint = fp.fingerprint(Path(data_dir), Path(decks_dir), base_url)
    if not force and is_unchanged(out_dir, fingerprint):
        return BuildReport(out_dir, 0, 0, time.perf_counter() - started, unchanged=True)
    data = load_site(Path(data_dir), Path(decks_dir))
    base_url = normalize_base_url(base_url)
    _check_out_dir(out_dir)
    folder = default_cache_dir() if cache_dir is True else (Path(cache_dir) if cache_dir else None)
    folder = folder / "highlight" if folder is not None else None
    cache = HighlightCache(folder)
    previous = highlight_cache(cache)
    try:
        pages = render_all(data, base_url=base_url)
    finally:
        highlight_cache(previous)
    tables = {rel: path.read_bytes() for rel, path in sorted(data.table_files.items())}
    meta = {"robots.txt": robots(base_url), **table_exports(data)}
    if base_url is not None:
        meta["sitemap.xml"] = sitemap(base_url, list(pages))
    # Each run page's solution, as the grader read it, beside the page (its "raw solution.py" link).
    raw = {f"runs/{r.gpu}/{r.run_id}/solution.py": data.solutions[r.run_id].encode()
           for r in data.results if r.run_id in data.solutions}
    files = {**_assets(fingerprint), **tables, **meta, **raw, **pages}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.new.", dir=out_dir.parent))
    try:
        new.chmod(0o755)  # mkdtemp makes 0700; a published site must be world-readable
        _write_tree(new, files)
        _swap_in(new, out_dir)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    cache.prune()
    return BuildReport(out_dir, len(pages), len(files), time.perf_counter() - started)

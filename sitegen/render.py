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

from .format import FILTERS
from .load import SiteData, load_site
from .pages import link, plan
from .views import pygments_css

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
    """What a build did: how many pages, how long it took, where the site is."""

    out_dir: Path
    pages: int
    files: int
    seconds: float

    def summary(self) -> str:
        return f"built {self.pages} pages in {self.seconds:.2f} s → {self.out_dir}"


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


def _assets() -> dict[str, bytes]:
    """static/ as is, plus the Plotly bundle from the installed package and the Pygments CSS."""
    if not TEMPLATES_DIR.is_dir() or not STATIC_DIR.is_dir():
        raise KernelboardError(f"no templates/ or static/ beside {_SOURCE / 'sitegen'}: "
                               "the site builds from a source checkout (pip install -e .)")
    files = {f"static/{p.relative_to(STATIC_DIR).as_posix()}": p.read_bytes()
             for p in sorted(STATIC_DIR.rglob("*")) if p.is_file()}
    files["static/plotly.min.js"] = plotly.offline.get_plotlyjs().encode()
    files["static/pygments.css"] = pygments_css().encode()
    files[MARKER] = _MARKER_TEXT.encode()
    return files


def render_all(data: SiteData, env: Environment | None = None) -> dict[str, bytes]:
    """Every page rendered in memory: output path -> bytes."""
    env = env or make_env()
    site = {"version": __version__, "last_updated": _last_updated(data)}
    out = {}
    for page in plan(data):
        html = env.get_template(page.template).render(page.context, root=page.root, site=site, kind=page.kind)
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
    for rel, content in sorted(files.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


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


def build_site(data_dir: Path, decks_dir: Path, out_dir: Path) -> BuildReport:
    """Load, validate and render everything, then replace `out_dir` with the new site in one rename.

    Raises `DataError` or `DeckError` for bad input (nothing is written), and `KernelboardError`
    when `out_dir` is something other than a previous build.
    """
    started = time.perf_counter()
    data = load_site(Path(data_dir), Path(decks_dir))
    pages = render_all(data)
    tables = {rel: path.read_bytes() for rel, path in sorted(data.table_files.items())}
    files = {**_assets(), **tables, **pages}
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.new.", dir=out_dir.parent))
    try:
        new.chmod(0o755)  # mkdtemp makes 0700; a published site must be world-readable
        _write_tree(new, files)
        _swap_in(new, out_dir)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    return BuildReport(out_dir, len(pages), len(files), time.perf_counter() - started)

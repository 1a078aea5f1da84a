"""Kernel source highlighted with Pygments, cached by content hash (in memory for a build, on disk
between builds): Pygments is most of a cold site build, and a graded solution never changes."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from pathlib import Path

from markupsafe import Markup
from pygments import __version__ as PYGMENTS_VERSION
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

#: Pygments settings; `pygments_css()` emits the matching stylesheet once into static/.
PYGMENTS_STYLE = "github-dark"
_FORMATTER_OPTIONS = {"style": PYGMENTS_STYLE, "cssclass": "highlight", "linenos": "table", "wrapcode": True}
_FORMATTER = HtmlFormatter(**_FORMATTER_OPTIONS)
_FORMATTER_KEY = json.dumps(_FORMATTER_OPTIONS, sort_keys=True)


def pygments_css() -> str:
    return _FORMATTER.get_style_defs(".highlight") + "\n"


class HighlightCache:
    """Highlighted Python per content hash: in memory for one build, and (with `folder`) on disk between
    builds, zlib-compressed, one file per hash. Pygments costs ~10-30 ms per solution (its lexer tries
    dozens of regexes per token); ten thousand solutions would take minutes, so a build only highlights
    the sources it has not seen. The key covers the Pygments version and the formatter's options, so the
    same bytes come out as without the cache. `prune()` drops what the last build did not use."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self.used: set[str] = set()
        self.hits = self.misses = 0
        self._memory: dict[str, Markup] = {}

    def _key(self, source: str) -> str:
        digest = hashlib.sha256(f"{PYGMENTS_VERSION}\0{_FORMATTER_KEY}\0".encode())
        digest.update(source.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()

    def html(self, source: str) -> Markup:
        key = self._key(source)
        self.used.add(key)
        if key in self._memory:
            self.hits += 1
            return self._memory[key]
        path = self.folder / key[:2] / f"{key}.html.z" if self.folder is not None else None
        if path is not None and path.is_file():
            try:
                html = Markup(zlib.decompress(path.read_bytes()).decode("utf-8"))
                self.hits += 1
            except (OSError, zlib.error, UnicodeDecodeError):
                html = None
        else:
            html = None
        if html is None:
            self.misses += 1
            html = Markup(highlight(source, PythonLexer(), _FORMATTER))
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(zlib.compress(html.encode("utf-8"), 1))
                os.replace(tmp, path)
        self._memory[key] = html
        return html

    def prune(self, max_age_s: float = 30 * 86400) -> None:
        """Remove cached entries this build did not use that are older than `max_age_s` (the cache may be
        shared by several sites; an entry another site still needs is simply made again)."""
        if self.folder is None or not self.folder.is_dir():
            return
        cutoff = time.time() - max_age_s
        for sub in self.folder.iterdir():
            if sub.is_dir():
                for entry in sub.iterdir():
                    if entry.name.split(".", 1)[0] not in self.used and entry.stat().st_mtime < cutoff:
                        entry.unlink(missing_ok=True)


#: The cache `run()` highlights through; `render.build_site` installs one per build (see `highlight_cache`).
_HIGHLIGHT = HighlightCache()


def highlight_cache(cache: HighlightCache) -> HighlightCache:
    """Install `cache` for the pages built next; returns the one it replaces."""
    global _HIGHLIGHT
    previous, _HIGHLIGHT = _HIGHLIGHT, cache
    return previous


def highlight_python(source: str) -> Markup:
    return _HIGHLIGHT.html(source)

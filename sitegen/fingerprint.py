"""A fingerprint of every input a site build reads, so that a build with nothing changed is skipped.

The fingerprint hashes the *contents* (never mtimes) of: every file under `DATA/results` (tables and
logs) and `DATA/annotations`, `DATA/README.md` (the data page), every file of `DATA/submissions` but
run.yaml (solution.py and its sidecars), every file under the decks folder, `templates/`, `static/`,
`docs/methodology.md`, the checkout's `data/README.md` and the site generator's own source, plus the
kernelboard version, the versions of the packages whose output lands in the pages (plotly.js,
Jinja2, markdown-it, pyarrow), the `--base-url` option, the repository the footer links to
(`repository.repository_url`) and `SOURCE_DATE_EPOCH`. It is written into the built site's marker file;
`build_site` compares it with the marker of the site already in `--out`.

sha256 rather than blake2b: SHA extensions make it the fastest here. Light on purpose (hashlib, os,
pathlib and the equally light `repository`): the CLI checks it before importing the rendering stack.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

from kernelboard import __version__

from .repository import repository_url

_SOURCE = Path(__file__).resolve().parent.parent
#: The site generator's inputs that live in the source checkout (render.py names the same folders).
SOURCE_INPUTS = (_SOURCE / "templates", _SOURCE / "static", _SOURCE / "docs" / "methodology.md",
                 _SOURCE / "data" / "README.md", Path(__file__).resolve().parent)
#: Packages whose version changes the bytes of the built site.
_PACKAGES = ("plotly", "jinja2", "markdown-it-py", "pyarrow")
#: The line of the marker file that carries the fingerprint.
PREFIX = "fingerprint: "

__all__ = ["GROUPS", "PREFIX", "combined", "digests", "fingerprint", "recorded"]


def _files(root: Path, skip: str | None = None) -> list[tuple[str, Path]]:
    """(name relative to `root`, path) of every file under `root` (or `root` itself), sorted; `skip`
    leaves out files of that name. os.walk (scandir) rather than Path.rglob: several times faster on
    ten thousand submission folders."""
    if root.is_file():
        return [(root.name, root)]
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(folder, root)
        for name in names:
            if name != skip:
                out.append((name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"), Path(folder, name)))
    return sorted(out)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


#: Which inputs each digest of `digests` covers: the site's own code and settings and the decks, every
#: page reads; the tables (with logs, annotations and the data README), every page but run pages reads
#: whole; the submissions, only run pages read, each its own (`page_keys` keys run pages per run).
GROUPS = {"site": ("source:*",), "decks": ("decks",), "tables": ("results", "annotations", "readme"),
          "submissions": ("submissions",)}


def digests(data_dir: Path, decks_dir: Path, base_url: str | None) -> dict[str, str]:
    """One hex digest per group of inputs (`GROUPS`; the header of versions and settings counts as
    "site"): each changes when any file of its group changes (contents, not timestamps)."""
    data_dir, decks_dir = Path(data_dir), Path(decks_dir)
    url = (base_url or "").strip()
    header = [f"kernelboard {__version__}", f"base_url {url.rstrip('/') + '/' if url else ''}",
              f"SOURCE_DATE_EPOCH {os.environ.get('SOURCE_DATE_EPOCH', '')}",
              f"repository {repository_url() or ''}",
              *(f"{p} {_version(p)}" for p in _PACKAGES)]
    hashes = {group: hashlib.sha256() for group in GROUPS}
    hashes["site"].update("\n".join(header).encode())
    roots = [("tables", "results", data_dir / "results", None),
             ("tables", "annotations", data_dir / "annotations", None),
             ("tables", "readme", data_dir / "README.md", None),
             ("submissions", "submissions", data_dir / "submissions", "run.yaml"), ("decks", "decks", decks_dir, None),
             *(("site", f"source:{p.name}", p, None) for p in SOURCE_INPUTS)]
    for group, part, root, skip in roots:
        digest = hashes[group]
        for name, path in _files(root, skip):
            if path.is_symlink():  # hashed as the link, never followed (a loop, or /etc/passwd)
                content = b"symlink\0" + os.fsencode(os.readlink(path))
            else:
                with open(path, "rb") as f:
                    content = f.read()
            digest.update(f"\0{part}\0{name}\0{len(content)}\0".encode())
            digest.update(content)
    return {group: h.hexdigest() for group, h in hashes.items()}


def combined(parts: dict[str, str]) -> str:
    """The one fingerprint of a build, from its `digests`."""
    return hashlib.sha256("".join(f"{k} {v}\n" for k, v in sorted(parts.items())).encode()).hexdigest()


def fingerprint(data_dir: Path, decks_dir: Path, base_url: str | None) -> str:
    """A hex digest that changes when any input of the build changes (contents, not timestamps)."""
    return combined(digests(data_dir, decks_dir, base_url))


def recorded(out_dir: Path, marker: str) -> str | None:
    """The fingerprint written into the marker file of the site in `out_dir`, if it has one."""
    try:
        text = (Path(out_dir) / marker).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return next((line.removeprefix(PREFIX).strip() for line in text.splitlines() if line.startswith(PREFIX)), None)

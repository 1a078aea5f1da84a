"""A fingerprint of every input a site build reads, so that a build with nothing changed is skipped.

The fingerprint hashes the *contents* (never mtimes) of: every file under `DATA/results` (tables and
logs) and `DATA/annotations`, `DATA/README.md` (the data page), every file of `DATA/submissions` but
run.yaml (solution.py and its sidecars), every file under the decks folder, `templates/`, `static/`,
`docs/methodology.md`, the checkout's `data/README.md` and the site generator's own source, plus the
kernelboard version, the versions of the packages whose output lands in the pages (plotly.js,
Jinja2, markdown-it, pyarrow), the `--base-url` option, the repository the footer links to
(`repository.repository_url`) and `SOURCE_DATE_EPOCH`. It is written into the built site's marker file;
`build_site` compares it with the marker of the site already in `--out`. Each file's digest is
remembered beside the site by its stat (`Hashes`, `.<out>.hashes`), so a build reads only the files whose
stat changed; what is compared is still their contents.

sha256 rather than blake2b: SHA extensions make it the fastest here. Light on purpose (hashlib, os,
pathlib and the equally light `repository`): the CLI checks it before importing the rendering stack.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time
from importlib import metadata
from pathlib import Path

from kernelboard import __version__

from .repository import repository_url

_SOURCE = Path(__file__).resolve().parent.parent
#: The site generator's inputs that live in the source checkout (render.py names the same folders).
SOURCE_INPUTS = (_SOURCE / "templates", _SOURCE / "static", _SOURCE / "docs" / "methodology.md",
                 _SOURCE / "data" / "README.md", Path(__file__).resolve().parent)
#: The code that reads and validates the inputs (the grader's table and deck modules among it): what
#: `loader_digest` covers, so that data remembered between builds (`load.remember`) is read again when it
#: changes.
LOADER_SOURCES = (_SOURCE / "eval", _SOURCE / "kernelboard")
#: Packages whose version changes the bytes of the built site.
_PACKAGES = ("plotly", "jinja2", "markdown-it-py", "pyarrow")
#: The line of the marker file that carries the fingerprint.
PREFIX = "fingerprint: "

__all__ = ["GROUPS", "PREFIX", "Hashes", "combined", "digests", "fingerprint", "loader_digest", "recorded"]


def _files(root: Path, skip: str | None = None) -> list[tuple[str, str, os.stat_result]]:
    """(name relative to `root`, path, lstat) of every file under `root` (or `root` itself), sorted by
    name; `skip` leaves out files of that name, and __pycache__ folders are left out. A scandir walk on
    strings: os.walk took 0.7 s over 50,000 submission folders, most of it path arithmetic; links to
    folders are listed as links, never followed."""
    if not root.is_dir() or root.is_symlink():
        return [(root.name, str(root), root.lstat())] if root.is_file() or root.is_symlink() else []
    out = []
    stack = [("", str(root))]
    while stack:
        rel, folder = stack.pop()
        with os.scandir(folder) as entries:
            for e in entries:
                name = rel + e.name
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        stack.append((name + "/", e.path))
                elif e.name != skip:
                    out.append((name, e.path, e.stat(follow_symlinks=False)))
    return sorted(out, key=lambda f: f[0])


#: A file changed this recently (ns) before its digest was remembered is hashed again next time: a write
#: in the same clock tick as the stat would not show in it (git's "racy" entries, handled the same way).
_RACY_NS = 2_000_000_000


class Hashes:
    """sha256 of each input file, remembered between builds in one file beside the site, keyed by the
    file's stat: size, mtime, ctime and inode. Hashing every file's bytes took 2 s at 50,000 runs (0.8
    GB of submissions on two cores; threads did not help: per-file work holds the GIL); a no-change
    build now reads only the stats. What is compared is still the contents: a digest is reused only
    while the stat is the one it was computed under, and an edit changes the ctime, which no program can
    set back (an edit that restores size and mtime, as tests/test_site_exports.py makes, is hashed
    again). Entries remembered less than `_RACY_NS` after their file last changed are not trusted.
    Without a `path` nothing is remembered."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._known: dict[str, list] = {}
        self._saved_ns = 0
        self._seen: dict[str, list] = {}
        self.hashed = 0  # files whose bytes this object read (the rest were known)
        if path is not None:
            try:
                state = json.loads(path.read_bytes())
                self._known, self._saved_ns = dict(state["files"]), int(state["saved_ns"])
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def digest(self, path: str, st: os.stat_result) -> bytes:
        """sha256 of one file's bytes; a link is hashed as the link, never followed (a loop, or /etc/passwd)."""
        if stat.S_ISLNK(st.st_mode):
            return hashlib.sha256(b"symlink\0" + os.fsencode(os.readlink(path))).digest()
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = self._known.get(path)
        if known is not None and known[:4] == key and max(key[1], key[2]) < self._saved_ns - _RACY_NS:
            self._seen[path] = known
            return bytes.fromhex(known[4])
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
        self.hashed += 1
        self._seen[path] = [*key, digest.hex()]
        return digest

    def save(self) -> None:
        """Remember this run's digests (only the files it saw), when it read any file: a run that only
        reused digests has nothing new to keep (and writing 10 MB at 50,000 runs would cost a no-op)."""
        if self.path is None or self.hashed == 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"saved_ns": time.time_ns(), "files": self._seen}, separators=(",", ":")))
        os.replace(tmp, self.path)


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


def digests(data_dir: Path, decks_dir: Path, base_url: str | None, known: Hashes | None = None) -> dict[str, str]:
    """One hex digest per group of inputs (`GROUPS`; the header of versions and settings counts as
    "site"): each changes when any file of its group changes (contents, not timestamps). `known`: the
    file digests remembered from earlier builds (`Hashes`), so that only files that changed are read."""
    known = Hashes() if known is None else known
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
             ("tables", "regrades", data_dir / "regrades.parquet", None),
             ("submissions", "submissions", data_dir / "submissions", "run.yaml"), ("decks", "decks", decks_dir, None),
             *(("site", f"source:{p.name}", p, None) for p in SOURCE_INPUTS)]
    for group, part, root, skip in roots:
        digest = hashes[group]
        for name, path, st in _files(root, skip):
            digest.update(f"\0{part}\0{name}\0".encode() + known.digest(path, st))
    return {group: h.hexdigest() for group, h in hashes.items()}


def loader_digest(known: Hashes | None = None) -> str:
    """A digest of the Python files under `LOADER_SOURCES` (the decks excluded) and the Python and
    pyarrow versions: what, besides the inputs and sitegen/ itself, decides what `load_site` returns."""
    known = Hashes() if known is None else known
    digest = hashlib.sha256(f"{sys.version}\0{_version('pyarrow')}\0{_version('pyyaml')}".encode())
    for root in LOADER_SOURCES:
        for name, path, st in _files(root):
            if name.endswith(".py") and not name.startswith("decks/"):
                digest.update(f"\0{root.name}/{name}\0".encode() + known.digest(path, st))
    return digest.hexdigest()


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

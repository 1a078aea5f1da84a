"""Writing what an importer produces: atomically (temp file + rename) and only when it changed.

Re-importing the same source must change nothing on disk, so every write first compares the
new bytes with what is there; a submission folder is made to hold exactly the files given
(run.yaml included), removing files an earlier import wrote that are no longer part of it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def write_if_changed(path: Path, data: bytes) -> bool:
    """Write `data` to `path` through a temporary file and `os.replace`; False if it was already so."""
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def dump_yaml(meta: Mapping[str, Any]) -> bytes:
    """run.yaml / annotation text: keys in the order given, block style, UTF-8, stable across runs."""
    return yaml.safe_dump(dict(meta), sort_keys=False, allow_unicode=True, width=100).encode()


def sync_folder(folder: Path, files: Mapping[str, bytes]) -> bool:
    """Make `folder` hold exactly `files` (relative POSIX path -> bytes); True if anything changed.

    Files written by an earlier import that are not in `files` are removed, so a run whose
    solution could no longer be recovered does not keep a stale one.
    """
    changed = False
    for rel, data in sorted(files.items()):
        changed |= write_if_changed(folder / rel, data)
    if folder.is_dir():
        for path in sorted(folder.rglob("*"), reverse=True):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and rel not in files:
                path.unlink()
                changed = True
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    return changed

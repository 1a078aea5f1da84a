"""The small files a worker hands to its parent — its phase, a baseline checkpoint, its result — written
whole or not at all: into a temporary file beside the target, then renamed over it, so a worker killed
mid-write leaves the previous version, never half a file."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

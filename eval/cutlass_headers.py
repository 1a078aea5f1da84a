"""Where the CUTLASS headers are that builds of candidate code may use (no torch; parent, worker, jail).

Many kernels `#include <cutlass/...>` or `<cute/...>` and expect CUTLASS beside them (a checkout the
agent cloned, which the published folder does not carry) or on the machine. The grading image has
none, so the grader brings one: the first of

1. `KERNELBOARD_CUTLASS`, then `CUTLASS_PATH`: a CUTLASS checkout (the folder holding `include/`),
   an include folder itself (holding `cutlass/cutlass.h`), or a folder where the `nvidia-cutlass`
   wheel was unpacked or installed (holding `cutlass_library/source/include`);
2. the installed `nvidia-cutlass` package (`cutlass_library`, whose wheel ships the headers under
   `cutlass_library/source/include`, with `cute/` beside `cutlass/`, and the `cutlass/util/...` ones
   under `source/tools/util/include`), or a `cutlass` package bundling an `include/` folder.

`sandbox.worker_env` puts the include folders first on `CPATH` and `CPLUS_INCLUDE_PATH` (gcc, and so
nvcc's preprocessing and `torch.utils.cpp_extension.load_inline`/`load`, search them for `#include
<…>`) and sets `CUTLASS_PATH` to the root; `jail.make_jail` shows the root read-only where the
sandbox would not otherwise see it; the worker's log names what was found (`describe`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Variables naming a CUTLASS root, in the order they are tried.
ENV_VARS = ("KERNELBOARD_CUTLASS", "CUTLASS_PATH")


@dataclass(frozen=True)
class Cutlass:
    """One CUTLASS the builds can see."""

    root: Path  # CUTLASS_PATH for builds: the folder holding include/ (a checkout, or the wheel's source/)
    includes: tuple[Path, ...]  # include/, then tools/util/include where present
    version: str | None
    origin: str  # where it was found: an environment variable, or the package

    def describe(self) -> str:
        """One line for the log: which CUTLASS, from where, at which include folders."""
        version = f"CUTLASS {self.version}" if self.version else "CUTLASS (version unknown)"
        return f"{version} from {self.origin}: {', '.join(map(str, self.includes))}"


def _version(include: Path) -> str | None:
    try:
        text = (include / "cutlass" / "version.h").read_text(errors="replace")
    except OSError:
        return None
    parts = [re.search(rf"#define\s+CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts if m) or None


def _has_headers(include: Path) -> bool:
    return (include / "cutlass" / "cutlass.h").is_file()


def from_folder(folder: Path, origin: str) -> Cutlass | None:
    """The CUTLASS under `folder` (a checkout root, an include folder, a wheel's unpacked or installed
    root, or its `cutlass_library` package folder), or None when it holds no `cutlass/cutlass.h`.
    Paths are resolved: the sandbox shows the folder itself, not a symlink to it."""
    folder = folder.expanduser().resolve()
    candidates = [
        (folder, folder / "include"),  # a checkout, or the wheel's source/
        (folder.parent, folder),  # an include folder itself
        (folder / "source", folder / "source" / "include"),  # the cutlass_library package folder
        (folder / "cutlass_library" / "source", folder / "cutlass_library" / "source" / "include"),  # site-packages
    ]
    for root, include in candidates:
        if _has_headers(include):
            util = root / "tools" / "util" / "include"
            includes = (include, util) if (util / "cutlass").is_dir() else (include,)
            return Cutlass(root, includes, _version(include), origin)
    return None


def _package(name: str) -> list[Path]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def find_cutlass(environ: Mapping[str, str] | None = None) -> Cutlass | None:
    """The CUTLASS builds should see (see the module docstring for the order), or None."""
    environ = os.environ if environ is None else environ
    for var in ENV_VARS:
        value = environ.get(var)
        if value and (found := from_folder(Path(value), f"${var}")) is not None:
            return found
    for name, label in (("cutlass_library", "the nvidia-cutlass package"), ("cutlass", "the cutlass package")):
        for folder in _package(name):
            if (found := from_folder(folder, f"{label} ({folder})")) is not None:
                return found
    return None

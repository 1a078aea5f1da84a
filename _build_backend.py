"""setuptools' build backend, less the one notice an editable install of this layout always prints.

pyproject.toml installs the top-level folders eval/ and sitegen/ as `kernelboard.eval` and
`kernelboard.sitegen`. setuptools can only serve such a mapping editable through an import hook,
and says so with an `InformationOnly` "Editable installation." notice ("be careful with folders in
your working directory with the same name as your package"); pip (26.3 here) shows it as a
`BuildBackendWarning` on every `pip install -e .`, so every `make site` and `make test` on a fresh
clone printed it. Here the only folder so named, kernelboard/, is the package itself, so the notice
warns of nothing. This backend drops that notice, and only it: every other warning, deprecations
included, still reaches the user, and every hook is setuptools' own.
"""

from __future__ import annotations

import warnings
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 (the PEP 517/660 hooks, re-exported as they are)


def build_editable(wheel_directory: str, config_settings: dict[str, Any] | None = None,
                   metadata_directory: str | None = None) -> str:
    """setuptools' `build_editable`, without its "Editable installation." notice (module docstring)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Editable installation\.", category=UserWarning)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)

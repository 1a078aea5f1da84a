"""The static leaderboard site: load and validate the tables, model the boards, render pages.

Never imports torch or the grader's worker modules; reads only the parquet contract
(`kernelboard.eval.schema`, `kernelboard.eval.tables`) and the torch-free deck loader.
`build_site` is the whole public surface; the CLI calls it. It is imported lazily, so that
`kernelboard eval` on a GPU machine (torch, no Plotly or Jinja2) never loads the site stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .render import BuildReport, build_site

__all__ = ["BuildReport", "build_site"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import render

        return getattr(render, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

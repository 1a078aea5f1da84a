"""The static leaderboard site: load and validate the tables, model the boards, render pages.

Never imports torch or the grader's worker modules; reads only the parquet contract
(`kernelboard.eval.schema`, `kernelboard.eval.tables`) and the torch-free deck loader.
`build_site` is the whole public surface; the CLI calls it.
"""

from .render import BuildReport, build_site

__all__ = ["BuildReport", "build_site"]

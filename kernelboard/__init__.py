"""kernelboard: grade GPU kernels written by coding agents and publish per-GPU leaderboards.

The import name holds three parts: `kernelboard.eval` (the grader, torch only inside workers),
`kernelboard.sitegen` (the static site, never imports torch) and this package's shared
`errors` and `cli`.
"""

__version__ = "0.5.31"

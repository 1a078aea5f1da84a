"""Site build cost, as ratios against reading and validating the same tables in the same run.

Generates synthetic boards of growing size into a temporary folder (never into data/), then times
three things on each: `tables.load_all` (the baseline: read + validate every parquet table),
`load_site` (plus deck and solution joins) and `build_site` (every page, charts, the swap).

    python bench/site_build.py            # prints one line per board size
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from site_fixtures import make_site_inputs, scale_site_inputs  # noqa: E402

from kernelboard.eval.tables import load_all  # noqa: E402
from kernelboard.sitegen import build_site  # noqa: E402
from kernelboard.sitegen.load import load_site  # noqa: E402


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    print(f"{'runs':>5} {'load_all s':>10} {'load_site s':>11} {'build s':>8} {'build/load_all':>14} {'ms/run':>7}")
    for n_models in (5, 50, 200):
        with tempfile.TemporaryDirectory() as tmp:
            inputs = make_site_inputs(Path(tmp) / "in")
            n_runs = scale_site_inputs(inputs, n_models)
            out = Path(tmp) / "dist"
            base = best_of(functools.partial(load_all, inputs.results_dir))
            joined = best_of(functools.partial(load_site, inputs.data_dir, inputs.decks_dir))
            build = best_of(functools.partial(build_site, inputs.data_dir, inputs.decks_dir, out))
            print(f"{n_runs:>5} {base:>10.3f} {joined:>11.3f} {build:>8.3f} {build / base:>13.1f}× "
                  f"{build / n_runs * 1e3:>7.1f}")
    print("(best of 3 per cell; ratio = full build ÷ validated table load, same run)")


if __name__ == "__main__":
    main()

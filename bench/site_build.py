"""Site build cost, as ratios against reading and validating the same tables in the same run.

Generates synthetic boards of growing size into a temporary folder (never into data/), then times
three things on each: `tables.load_all` (the baseline: read + validate every parquet table),
`load_site` (plus deck and solution joins) and `build_site` (every page, charts, the swap).

Then the large case (`--runs`, default 1,000; the recorded figures use 10,000 runs over 4 GPUs and the six Hard decks,
`site_fixtures.make_large_site_inputs`): a full build with a cold highlight cache, a full build with
a warm one (`force=True`), the no-change rebuild (fingerprint only), page weights, and a check that
pages without charts load no Plotly.

    python bench/site_build.py              # small boards, then a 1,000-run site (under a minute)
    python bench/site_build.py --runs 10000 # the recorded 10,000-run figures (about 6 minutes)
    python bench/site_build.py --runs 0     # small boards only
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from site_fixtures import make_large_site_inputs, make_site_inputs, scale_site_inputs  # noqa: E402

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


def small() -> None:
    print(f"{'runs':>5} {'load_all s':>10} {'load_site s':>11} {'build s':>8} {'build/load_all':>14} {'ms/run':>7}")
    for n_models in (5, 50, 200):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["KERNELBOARD_CACHE"] = str(Path(tmp) / "cache")
            inputs = make_site_inputs(Path(tmp) / "in")
            n_runs = scale_site_inputs(inputs, n_models)
            out = Path(tmp) / "dist"
            base = best_of(functools.partial(load_all, inputs.results_dir))
            joined = best_of(functools.partial(load_site, inputs.data_dir, inputs.decks_dir))
            build = best_of(functools.partial(build_site, inputs.data_dir, inputs.decks_dir, out, force=True))
            print(f"{n_runs:>5} {base:>10.3f} {joined:>11.3f} {build:>8.3f} {build / base:>13.1f}× "
                  f"{build / n_runs * 1e3:>7.1f}")
    print("(best of 3 per cell; ratio = full build ÷ validated table load, same run)")


_PLOTLY = re.compile(rb"<script[^>]*plotly[^>]*>")


def weights(out: Path) -> None:
    """Page weights of one page of each kind, and which pages load plotly.js."""
    def first(pattern: str) -> Path:
        return sorted(out.glob(pattern))[0]
    picks = {"home": out / "index.html", "problem": first("problems/*/*/index.html"),
             "run": first("runs/*/*/index.html"), "gpu": first("gpu/*/index.html"),
             "plotly bundle": out / "static" / "plotly.min.js"}
    print("page weights: " + ", ".join(f"{k} {p.stat().st_size / 1e3:,.0f} KB" for k, p in picks.items()))
    runs = sorted(out.glob("runs/*/*/index.html"))
    print(f"  run pages: {len(runs)}, largest {max(p.stat().st_size for p in runs) / 1e3:,.0f} KB; "
          f"problem pages: largest {max(p.stat().st_size for p in out.glob('problems/*/*/index.html')) / 1e3:,.0f} KB")
    pages = sorted(out.rglob("index.html"))
    loading = [p for p in pages if _PLOTLY.search(p.read_bytes())]
    no_chart = [p for p in loading if b'class="chart-data"' not in p.read_bytes()]
    print(f"  {len(loading)} of {len(pages)} pages load plotly.js; pages that do without a chart: {len(no_chart)}")
    if no_chart:
        raise SystemExit(f"pages without charts load Plotly: {[str(p.relative_to(out)) for p in no_chart[:5]]}")


def large(n_runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KERNELBOARD_CACHE"] = str(Path(tmp) / "cache")
        t = time.perf_counter()
        inputs = make_large_site_inputs(Path(tmp) / "in", n_runs=n_runs)
        print(f"\n{n_runs} runs over 4 GPUs, 6 problems (generated in {time.perf_counter() - t:.1f} s)")
        out = Path(tmp) / "dist"
        base = best_of(functools.partial(load_all, inputs.results_dir))
        t = time.perf_counter()
        cold = build_site(inputs.data_dir, inputs.decks_dir, out)
        cold_s = time.perf_counter() - t
        warm = best_of(functools.partial(build_site, inputs.data_dir, inputs.decks_dir, out, force=True))
        same = best_of(functools.partial(build_site, inputs.data_dir, inputs.decks_dir, out))
        assert build_site(inputs.data_dir, inputs.decks_dir, out).unchanged
        print(f"  load_all {base:.3f} s · full build, cold highlight cache {cold_s:.1f} s ({cold.pages} pages, "
              f"{cold_s / base:.0f}× load_all) · full build, warm cache {warm:.2f} s ({warm / base:.1f}×) · "
              f"no-change rebuild {same:.3f} s ({same / base:.2f}×)")
        weights(out)
    print("(warm and no-change: best of 3; cold: one build, it fills the cache)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1_000,
                        help="runs in the large case (0: skip it); the recorded figures use 10000 (~6 min)")
    parser.add_argument("--skip-small", action="store_true", help="only the large case")
    args = parser.parse_args()
    if not args.skip_small:
        small()
    if args.runs:
        large(args.runs)


if __name__ == "__main__":
    main()

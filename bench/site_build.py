"""Site build cost, as ratios against reading and validating the same tables in the same run.

Generates synthetic boards of growing size into a temporary folder (never into data/), then times
three things on each: `tables.load_all` (the baseline: read + validate every parquet table),
`load_site` (plus deck and solution joins) and `build_site` (every page, charts, the swap).

Then the large case (`--runs`, default 1,000; the recorded figures use 10,000 runs over 4 GPUs and the six Hard decks,
`site_fixtures.make_large_site_inputs`), each build in a fresh process that reports its time and peak
RSS (its own and its largest forked worker's): a cold full build (no site, no spare, nothing
remembered), a full build with `force=True` (every page rendered), a rebuild after one run changed (a
line appended to one solution.py), the no-change rebuild (fingerprint only), the bytes on disk of the
site and of everything kept beside it (spare, remembered digests; hard links counted once), page
weights, and a check that pages without charts load no Plotly.

    python bench/site_build.py                    # small boards, then a 1,000-run site (under a minute)
    python bench/site_build.py --runs 10000 --skip-small   # the recorded 10,000-run figures (~3 minutes)
    python bench/site_build.py --runs 50000 --skip-small --noop-only  # cold build and no-op at 50,000 runs
    python bench/site_build.py --runs 0           # small boards only
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import re
import subprocess
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
    runs = sorted(p for p in out.glob("runs/*/*/index.html") if p.parts[-3] != "page")  # not the index's pages
    picks = {"home": out / "index.html", "problem": first("problems/*/*/index.html"),
             "run": runs[0], "gpu": first("gpu/*/index.html"), "runs index (a page)": out / "runs" / "index.html",
             "plotly bundle": out / "static" / "plotly.min.js"}
    if (out / "runs" / "runs.json").is_file():
        picks["runs.json (the filter's)"] = out / "runs" / "runs.json"
    print("page weights: " + ", ".join(f"{k} {p.stat().st_size / 1e3:,.0f} KB" for k, p in picks.items()))
    problem = picks["problem"]
    loaded = [problem, *(problem.parent / src for src in _ASSET.findall(problem.read_text()))]
    raw = sum(f.stat().st_size for f in loaded)
    packed = sum(len(gzip.compress(f.read_bytes(), 6)) for f in loaded)
    print(f"  a problem page in total (its HTML and the {len(loaded) - 1} files it loads): {raw / 1e6:.2f} MB, "
          f"{packed / 1e6:.2f} MB gzipped (what GitHub Pages transfers, Lighthouse's 'total byte weight')")
    print(f"  run pages: {len(runs)}, largest {max(p.stat().st_size for p in runs) / 1e3:,.0f} KB; "
          f"problem pages: largest {max(p.stat().st_size for p in out.glob('problems/*/*/index.html')) / 1e3:,.0f} KB")
    pages = sorted(out.rglob("index.html"))
    loading = [p for p in pages if _PLOTLY.search(p.read_bytes())]
    no_chart = [p for p in loading if b'class="chart-data"' not in p.read_bytes()]
    print(f"  {len(loading)} of {len(pages)} pages load plotly.js; pages that do without a chart: {len(no_chart)}")
    if no_chart:
        raise SystemExit(f"pages without charts load Plotly: {[str(p.relative_to(out)) for p in no_chart[:5]]}")


_ASSET = re.compile(r'<(?:script src|link rel="stylesheet" href)="([^"]+)"')

_CHILD = """
import json, resource, sys, time
from pathlib import Path
from kernelboard.sitegen import build_site
data, decks, out, force = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
t = time.perf_counter()
report = build_site(Path(data), Path(decks), Path(out), force=force)
seconds = time.perf_counter() - t
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so it would report the bench's own size
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
rss = [hwm / 1024, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]
cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for f in ("ru_utime", "ru_stime"))  # imports included: compare CPU time between runs, not to wall
print(json.dumps({"s": seconds, "pages": report.pages, "unchanged": report.unchanged, "rss_mb": rss, "cpu": cpu}))
"""


def build_in_child(inputs, out: Path, force: bool = False) -> dict:
    """One `build_site` in a fresh process: its seconds (imports excluded) and peak RSS in MB, of the
    building process (VmHWM, imports included) and of its largest forked worker (`ru_maxrss`), so one
    measure's memory is not mixed with another's."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(inputs.data_dir), str(inputs.decks_dir), str(out),
                           "1" if force else "0"], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_child(inputs, out: Path, repeats: int = 3, force: bool = False, before=None) -> dict:
    """The fastest of `repeats` child builds (`before(i)` runs ahead of each, untimed); RSS is the most seen."""
    runs = []
    for i in range(repeats):
        if before is not None:
            before(i)
        runs.append(build_in_child(inputs, out, force))
    best = min(runs, key=lambda r: r["s"])
    return {**best, "rss_mb": [max(r["rss_mb"][k] for r in runs) for k in (0, 1)], "cpu": min(r["cpu"] for r in runs)}


def disk_bytes(*roots: Path) -> int:
    """Bytes allocated on disk under `roots` together (st_blocks), each inode once: a file hard-linked
    from two of them is counted once, as `du` does."""
    seen, total = set(), 0
    for root in roots:
        if not root.exists():
            continue
        if not root.is_dir():  # a file kept beside the site (os.walk would skip it)
            st = os.lstat(root)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
            continue
        for folder, dirs, names in os.walk(root):
            for name in [*dirs, *names, "."]:
                st = os.lstat(os.path.join(folder, name)) if name != "." else os.lstat(folder)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def edit_one_solution(inputs, i: int) -> None:
    """One run changed: a line appended to one run's solution.py (its page and raw file change)."""
    path = sorted((inputs.data_dir / "submissions").glob("*/*/solution.py"))[47 + i]
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"# edited {i}\n")


def large(n_runs: int, noop_only: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        os.environ["KERNELBOARD_CACHE"] = str(cache)
        t = time.perf_counter()
        inputs = make_large_site_inputs(Path(tmp) / "in", n_runs=n_runs)
        print(f"\n{n_runs} runs over 4 GPUs, 6 problems (generated in {time.perf_counter() - t:.1f} s)")
        out = Path(tmp) / "dist"
        base = best_of(functools.partial(load_all, inputs.results_dir))
        cold = build_in_child(inputs, out)
        print(f"  load_all {base:.3f} s · full build, cold (no site, no cache) {cold['s']:.1f} s ({cold['pages']} "
              f"pages, {cold['s'] / base:.0f}× load_all; peak RSS {cold['rss_mb'][0]:,.0f} MB, "
              f"worker {cold['rss_mb'][1]:,.0f} MB; CPU {cold['cpu']:.1f} s)", flush=True)
        if not noop_only:
            warm = best_child(inputs, out, force=True)
            print(f"  full build, warm (--force) {warm['s']:.2f} s ({warm['s'] / base:.1f}×; peak RSS "
                  f"{warm['rss_mb'][0]:,.0f} MB, worker {warm['rss_mb'][1]:,.0f} MB; CPU {warm['cpu']:.1f} s)",
                  flush=True)
            one = best_child(inputs, out, before=functools.partial(edit_one_solution, inputs))
            print(f"  one run changed (a solution.py edited) {one['s']:.2f} s ({one['s'] / base:.1f}×; "
                  f"CPU {one['cpu']:.1f} s)", flush=True)
        same = best_child(inputs, out)
        assert same["unchanged"], same
        print(f"  no-change rebuild {same['s']:.3f} s ({same['s'] / base:.2f}×; peak RSS {same['rss_mb'][0]:,.0f} MB, "
              f"children {same['rss_mb'][1]:,.0f} MB)")
        spares = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
        dist, total = disk_bytes(out), disk_bytes(out, *spares, cache)
        print(f"  on disk: dist {dist / 1e9:.3f} GB; dist + {', '.join(p.name for p in spares) or 'no spare'} + "
              f"cache {total / 1e9:.3f} GB ({total / dist:.2f}× dist)")
        if not noop_only:
            weights(out)
    print("(each build in a fresh process; warm, one-changed and no-change: best of 3; "
          "cold: the first build, nothing cached; CPU: user + system seconds of the process and its workers, "
          "imports included — steadier than wall time on a shared machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1_000,
                        help="runs in the large case (0: skip it); the recorded figures use 10000 (~3 min)")
    parser.add_argument("--skip-small", action="store_true", help="only the large case")
    parser.add_argument("--noop-only", action="store_true",
                        help="large case: only the cold build and the no-change rebuild (for --runs 50000)")
    args = parser.parse_args()
    if not args.skip_small:
        small()
    if args.runs:
        large(args.runs, args.noop_only)


if __name__ == "__main__":
    main()

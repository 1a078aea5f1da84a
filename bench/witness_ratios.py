"""The GPU witness's ratios in grading logs: per witnessed shape, the timed median over the judge's figure for
a call (eval/gpu_witness.py, logged since grader 0.5.28 where KERNELBOARD_GPU_WITNESS=1).

Why: the witness is logged, not refused, until honest gradings give the distribution a refusal rule needs
(its note of doubt is under WITNESS_GPU_FACTOR). This reads the lines `gpu_witness.describe` writes, from log
files or folders of them (a results folder's `<gpu>/logs/`), and prints the count, quantiles and the lowest
ratios with their run and shape, split at WITNESS_GPU_MIN_MS (a figure under it is left out of the note).

    .venv/bin/python bench/witness_ratios.py data/results /tmp/res1/res
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from kernelboard.eval.settings import WITNESS_GPU_FACTOR, WITNESS_GPU_MIN_MS

#: One witnessed shape's line, as gpu_witness.describe writes it after the worker's "shape N: ".
LINE = re.compile(r"shape (?P<shape>\d+): the judge's clock around (?P<calls>\d+) witnessed calls: span "
                  r"(?P<span>[\d.]+) ms, .*?so a call (?P<call>-?[\d.]+) ms; "
                  r"the timed median is (?P<ratio>[\d.]+|—) of it")


@dataclass(frozen=True)
class Witnessed:
    run: str
    shape: int
    call_ms: float
    ratio: float | None  # None where the judge's figure was not positive


def read(paths: list[Path]) -> list[Witnessed]:
    """Every witnessed shape in the grading logs under `paths` (prebuild logs have none)."""
    found: list[Witnessed] = []
    for path in paths:
        files = sorted(path.rglob("*.log")) if path.is_dir() else [path]
        for f in files:
            if f.name.endswith(".prebuild.log"):
                continue
            for m in LINE.finditer(f.read_text(errors="replace")):
                ratio = None if m["ratio"] == "—" else float(m["ratio"])
                found.append(Witnessed(f.stem, int(m["shape"]), float(m["call"]), ratio))
    return found


def summary(rows: list[Witnessed], lowest: int) -> list[str]:
    """Lines: per side of WITNESS_GPU_MIN_MS, the count and quantiles of the ratios, then the lowest."""
    lines = []
    for label, side in ((f"call ≥ {WITNESS_GPU_MIN_MS:g} ms (the note's range)", True),
                        (f"call < {WITNESS_GPU_MIN_MS:g} ms", False)):
        ratios = sorted(r.ratio for r in rows if r.ratio is not None and (r.call_ms >= WITNESS_GPU_MIN_MS) == side)
        if not ratios:
            lines.append(f"{label}: none")
            continue
        q = statistics.quantiles(ratios, n=20, method="inclusive") if len(ratios) > 1 else ratios * 19
        under = sum(r < WITNESS_GPU_FACTOR for r in ratios)
        lines.append(f"{label}: {len(ratios)} shapes, min {ratios[0]:.2f}, p5 {q[0]:.2f}, median "
                     f"{statistics.median(ratios):.2f}, p95 {q[-1]:.2f}, max {ratios[-1]:.2f}; "
                     f"{under} under {WITNESS_GPU_FACTOR:g}")
    undefined = sum(r.ratio is None for r in rows)
    if undefined:
        lines.append(f"{undefined} shapes whose figure for a call was not positive (no ratio)")
    for r in sorted((r for r in rows if r.ratio is not None), key=lambda r: r.ratio)[:lowest]:
        lines.append(f"  {r.ratio:.2f}  {r.run} shape {r.shape} (a call {r.call_ms:.4f} ms)")
    return lines


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--lowest", default=10, show_default=True, help="How many of the lowest ratios to list.")
def main(paths: tuple[Path, ...], lowest: int) -> None:
    rows = read(list(paths))
    if not rows:
        sys.exit(f"witness_ratios: no witnessed shape in {', '.join(map(str, paths))} "
                 "(graded with KERNELBOARD_GPU_WITNESS=1 on a GPU?)")
    print(f"{len(rows)} witnessed shapes in {len({r.run for r in rows})} gradings")
    print("\n".join(summary(rows, lowest)))


if __name__ == "__main__":
    main()

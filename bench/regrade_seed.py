"""A GPU call's seed without some runs' rows, and the list of those runs: what `--resume` then grades again.

Why: `kernelboard eval --resume` skips every run its results folder holds, and `--regrade` measures the
problems' baselines again too (minutes, for 06). Grading a few rows again (a change of grader that may move
their figures) takes a seed that leaves them out: their results and shape rows. Two sessions filtered seeds
by hand for this; here it is one command. `--host-floor` picks the passes whose figure the grading host set:
a shape covered at the host's floor (its median above its covered GPU span) or timed synchronised, graded
by a grader older than `--before` (2026-12-07: 68 of the H100 SXM board's 178 passes had such a shape and
19 a synchronised one; four of them graded again on a quieter host moved up to 1.7×).

    .venv/bin/python bench/regrade_seed.py --seed .carry/seed.tgz --gpu h100-sxm --host-floor \\
        --out .carry/seed-regrade.tgz --ids .carry/ids-regrade.txt
    # then: SEED=.carry/seed-regrade.tgz IDS=.carry/ids-regrade.txt bench/gpu_session.sh
"""

from __future__ import annotations

import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.compute as pc

from kernelboard import __version__
from kernelboard.eval.regrades import set_by
from kernelboard.eval.settings import graded_before
from kernelboard.eval.tables import read_table, table_path, write_atomic


def host_set(shape: dict) -> str | None:
    """How the grading host set a shape's figure (a `shapes.parquet` row): "synchronised" (timed with a
    synchronise after every call) or "floor" (covered, its median above its GPU span: the host's least dispatch);
    None where the GPU's own span set it, or its grader did not record enough to say (`regrades.set_by`)."""
    how = set_by(shape)
    return how if how in ("floor", "synchronised") else None


def host_floor_passes(results: Path, gpu: str, before: str) -> list[str]:
    """Passes on `gpu` graded by a grader older than `before` with a shape the host set (see the module's
    docstring), by problem then run id."""
    passes = {r["run_id"] for r in read_table(table_path(results, gpu, "results"), "results").to_pylist()
              if r["status"] == "pass" and r["grader_version"] and graded_before(r["grader_version"], before)}
    chosen = {s["run_id"] for s in read_table(table_path(results, gpu, "shapes"), "shapes").to_pylist()
              if s["run_id"] in passes and host_set(s) is not None}
    problem = {r["run_id"]: r["problem"] for r in read_table(table_path(results, gpu, "runs"), "runs").to_pylist()}
    return sorted(chosen, key=lambda run_id: (problem.get(run_id, ""), run_id))


def without_runs(results: Path, gpu: str, run_ids: set[str]) -> int:
    """Take the rows of `run_ids` out of `gpu`'s results and shapes tables in place; returns the results rows
    taken out."""
    taken = {}
    for name in ("results", "shapes"):
        path = table_path(results, gpu, name)
        table = read_table(path, name)
        kept = table.filter(pc.invert(pc.is_in(table["run_id"], pa.array(sorted(run_ids), pa.string()))))
        taken[name] = table.num_rows - kept.num_rows
        write_atomic(kept, path)
    return taken["results"]


@click.command()
@click.option("--seed", type=click.Path(exists=True, path_type=Path), default=Path(".carry/seed.tgz"),
              show_default=True, help="A results folder, or a .tgz of one (its top folder: res/).")
@click.option("--gpu", required=True, help="The board key whose rows to take out (h100-sxm, h200).")
@click.option("--run", "run_ids", multiple=True, help="A run id to grade again (repeatable).")
@click.option("--host-floor", is_flag=True, help="Also every pass whose figure the grading host set.")
@click.option("--before", default=__version__, show_default=True,
              help="--host-floor: only passes graded by a grader older than this.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The seed to write (.tgz, top folder res/).")
@click.option("--ids", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The run ids taken out, one a line (gpu_session.sh's IDS).")
def main(seed: Path, gpu: str, run_ids: tuple[str, ...], host_floor: bool, before: str, out: Path,
         ids: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="regrade-seed-") as tmp:
        res = Path(tmp) / "res"
        if seed.is_dir():
            shutil.copytree(seed, res)
        else:
            with tarfile.open(seed) as tar:
                tar.extractall(tmp, filter="data")
        if not table_path(res, gpu, "results").exists():
            sys.exit(f"regrade_seed: {seed} holds no results table for {gpu!r} (expected res/{gpu}/results.parquet)")
        chosen = list(dict.fromkeys([*run_ids, *(host_floor_passes(res, gpu, before) if host_floor else [])]))
        if not chosen:
            sys.exit("regrade_seed: no run chosen (--run ID, or --host-floor)")
        taken = without_runs(res, gpu, set(chosen))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            tar.add(res, arcname="res")
    ids.parent.mkdir(parents=True, exist_ok=True)
    ids.write_text("".join(f"{run_id}\n" for run_id in chosen))
    print(f"{len(chosen)} runs to grade again on {gpu} ({taken} result rows taken out of the seed) → {out}, {ids}")


if __name__ == "__main__":
    main()

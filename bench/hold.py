"""Copy one problem's new gradings on one GPU out of a call's results folder into `data/held/`.

Why: a problem joins a board whole (one result holds every model with an ungraded run of it unranked), and a
problem like 06 takes several sessions of GPU calls. Its gradings must not wait in `.carry/`, which git
ignores: they are committed to `data/held/<gpu>/`, a results folder the site does not read, and join with
`kernelboard eval merge data/held --into data/results` once the problem is whole. This writes the problem's
results, shapes and runs rows that `data/results` lacks, the problem's baseline rows, the GPU's hardware row
and their logs, replacing `data/held/<gpu>/` whole, and validates the folder as the loader does. A call cut
off while it measured the problem's baselines (none graded yet) holds those rows alone: the next session's
seed (`bench/carry.sh`) carries them, and its first call measures only the rest.

    .venv/bin/python bench/hold.py /tmp/res13/res h100-sxm 06_sonic_moe_swiglu
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from kernelboard.eval.tables import load_all, rows_to_table, table_path, table_rows, write_atomic


@click.command()
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("gpu")
@click.argument("problem")
@click.option("--committed", type=click.Path(file_okay=False, path_type=Path), default=Path("data/results"),
              show_default=True, help="The results folder whose runs are not held.")
@click.option("--held", type=click.Path(file_okay=False, path_type=Path), default=Path("data/held"),
              show_default=True, help="The held results folder (its GPU folder is replaced).")
def main(source: Path, gpu: str, problem: str, committed: Path, held: Path) -> None:
    graded = {r["run_id"] for r in table_rows(committed, gpu, "results")}
    runs = {r["run_id"]: r for r in table_rows(source, gpu, "runs") if r["problem"] == problem}
    results = [r for r in table_rows(source, gpu, "results") if r["run_id"] in runs and r["run_id"] not in graded]
    baselines = [r for r in table_rows(source, gpu, "baselines") if r["problem"] == problem]
    known = table_rows(committed, gpu, "baselines")
    if not (results or any(r not in known for r in baselines)):
        raise click.ClickException(f"{source / gpu}: no result or baseline of {problem} that {committed / gpu} lacks")
    ids = {r["run_id"] for r in results}  # none: a call cut off in the baselines, which are held alone
    tables = {
        "runs": [runs[i] for i in sorted(ids)],
        "results": results,
        "shapes": [r for r in table_rows(source, gpu, "shapes") if r["run_id"] in ids],
        "baselines": baselines,
        "hardware": table_rows(source, gpu, "hardware"),
    }
    staged = held.parent / f".{held.name}.staging"
    shutil.rmtree(staged, ignore_errors=True)
    (staged / gpu / "logs").mkdir(parents=True)
    for name, rows in tables.items():
        write_atomic(rows_to_table(name, rows), table_path(staged, gpu, name))
    found = source / gpu / "logs"  # a run's logs as `eval merge` moves them: <run_id>.log, <run_id>.prebuild.log
    logs = [log for run_id in sorted(ids) for log in found.glob(f"{run_id}.*log")]
    logs += found.glob(f"baselines-*-{problem}.log")
    for log in logs:
        shutil.copy2(log, staged / gpu / "logs" / log.name)
    load_all(staged)  # the contract, cross-table rules included, before anything replaces the held folder
    shutil.rmtree(held / gpu, ignore_errors=True)
    held.mkdir(parents=True, exist_ok=True)
    (staged / gpu).rename(held / gpu)
    shutil.rmtree(staged)
    counts = ", ".join(f"{name} {len(rows)}" for name, rows in tables.items())
    print(f"{held / gpu}: {problem}'s gradings that {committed / gpu} lacks: {counts}; {len(logs)} logs")


if __name__ == "__main__":
    sys.exit(main())

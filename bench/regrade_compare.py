"""How the figures of runs graded again moved: one GPU's results in two folders (or the committed data at
an earlier revision), run by run, then in sum.

Why: a regrade replaces a run's row (`eval merge`), so once merged the figure it had is only in git. A grader
change or another host moves speedups; a reader of the board should know by how much, and the note that
merges a regrade says it with this command's figures. Each run graded in both, by another grader or at
another time, is one line: its speedup over torch.compile before and after, their ratio, and how many of its
shapes the grading host set (`regrades.set_by`: timed synchronised, or covered at the host's floor)
before and after. A verdict that changed is listed apart: that is a finding, not noise.

    .venv/bin/python bench/regrade_compare.py --gpu h100-sxm --old HEAD~1 --new data/results
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
import pyarrow.parquet as pq

from kernelboard.eval import regrades
from kernelboard.eval.tables import read_table, table_path

REPO = Path(__file__).resolve().parents[1]
MOVED = 0.05  # a speedup that moved by more than this fraction is counted as moved


def _rows(results: Path, gpu: str, name: str, checked: bool = True) -> list[dict[str, Any]]:
    """A table's rows; unchecked for a revision of git's history, whose tables may predate columns added since
    (the ones `regrades.pairs` reads were there from the first)."""
    path = table_path(results, gpu, name)
    if not path.exists():
        sys.exit(f"regrade_compare: {path} does not exist (expected {gpu}'s {name} table)")
    return (read_table(path, name) if checked else pq.read_table(path)).to_pylist()


def _spread(ratios: list[float]) -> str:
    """A sample of ratios in a few words: its count, median, deciles (from ten on) and range."""
    ratios = sorted(ratios)
    deciles = (f", deciles {' '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=10))}"
               if len(ratios) >= 10 else "")
    return (f"{len(ratios)}: median {statistics.median(ratios):.3f}{deciles}, "
            f"least {ratios[0]:.3f}, most {ratios[-1]:.3f}")


Tables = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # a GPU's (results, shapes) rows


def _tables(results: Path, gpu: str, checked: bool = True) -> Tables:
    return _rows(results, gpu, "results", checked), _rows(results, gpu, "shapes", checked)


def _host_set_counts(shapes: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """run id -> (shapes covered at the host's floor, shapes timed synchronised)."""
    counts: dict[str, list[int]] = {}
    for shape in shapes:
        how = regrades.set_by(shape)
        tally = counts.setdefault(shape["run_id"], [0, 0])
        if how in ("floor", "synchronised"):
            tally[0 if how == "floor" else 1] += 1
    return {run_id: (floor, sync) for run_id, (floor, sync) in counts.items()}


def compare(old: Tables, new: Tables, gpu: str, shapes: list[dict[str, Any]]) -> list[str]:
    """The report's lines: one per run graded in both (results, shapes) tables by another grader or at another
    time, then the summary of the speedups' ratios (new over old) of the runs that passed in both, and of
    `shapes` (`regrades.pairs` of the two), split by what set each figure."""
    before = {r["run_id"]: r for r in old[0]}
    after = {r["run_id"]: r for r in new[0]}
    hosts_before, hosts_after = _host_set_counts(old[1]), _host_set_counts(new[1])
    again = sorted((run_id for run_id, row in after.items()
                    if run_id in before and regrades.graded_again(before[run_id], row)),
                   key=lambda run_id: (run_id.split("_", 4)[-1], run_id))
    lines, ratios, changed, passed = [], [], [], set()
    for run_id in again:
        a, b = before[run_id], after[run_id]
        if a["status"] != b["status"]:
            changed.append(f"  {run_id}: {a['status']} ({a['grader_version']}) -> {b['status']} "
                           f"({b['grader_version']}): {b['message']}")
            continue
        if a["status"] != "pass" or not a["speedup_vs_compile"] or not b["speedup_vs_compile"]:
            lines.append(f"{run_id}: {a['status']} in both")
            continue
        ratio = b["speedup_vs_compile"] / a["speedup_vs_compile"]
        ratios.append(ratio)
        passed.add(run_id)
        lines.append(f"{run_id}: {a['speedup_vs_compile']:.2f}x ({a['grader_version']}) -> "
                     f"{b['speedup_vs_compile']:.2f}x ({b['grader_version']}), {ratio:.2f}; "
                     f"host-set shapes (floor, synchronised) "
                     f"{hosts_before.get(run_id, (0, 0))} -> {hosts_after.get(run_id, (0, 0))}")
    lines.append(f"{len(again)} runs graded again on {gpu}, {len(changed)} with another verdict"
                 + ("" if not changed else ":"))
    lines.extend(changed)
    if ratios:
        floor_shapes = [sum(hosts[r][0] for r in passed if r in hosts) for hosts in (hosts_before, hosts_after)]
        sync_shapes = [sum(hosts[r][1] for r in passed if r in hosts) for hosts in (hosts_before, hosts_after)]
        lines.append(f"speedup after / before, passes {_spread(ratios)}; "
                     f"up by more than {MOVED:.0%}: {sum(r > 1 + MOVED for r in ratios)}, "
                     f"down by more than {MOVED:.0%}: {sum(r < 1 - MOVED for r in ratios)}")
        lines.append(f"shapes the host set: at its floor {floor_shapes[0]} -> {floor_shapes[1]}, "
                     f"synchronised {sync_shapes[0]} -> {sync_shapes[1]}")
        samples: dict[bool, list[float]] = {True: [], False: []}  # set by the GPU's span both times, or not
        for r in shapes:
            both_gpu = r["before_set_by"] == r["after_set_by"] == "gpu"
            samples[both_gpu].append(r["after_median_ms"] / r["before_median_ms"])
        for label, sample in (("set by the GPU's span in both", samples[True]),
                              ("set by the host in either", samples[False])):
            if sample:
                lines.append(f"shape medians after / before, {label}, {_spread(sample)}")
    return lines


def _at_revision(revision: str, gpu: str, into: Path) -> Path:
    """`gpu`'s results and shapes tables of data/results as committed at `revision`, written under `into`."""
    for name in ("results", "shapes"):
        relative = table_path(Path("data/results"), gpu, name)
        shown = subprocess.run(["git", "show", f"{revision}:{relative.as_posix()}"], cwd=REPO, capture_output=True)
        if shown.returncode != 0:
            sys.exit(f"regrade_compare: git has no {relative} at {revision}: {shown.stderr.decode().strip()}")
        target = table_path(into, gpu, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(shown.stdout)
    return into


def _revision(revision: str) -> str:
    """The commit `revision` names, in full (each recorded row names the one its "before" row came from)."""
    shown = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"], cwd=REPO,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        sys.exit(f"regrade_compare: {revision!r} is not a git revision of this repository")
    return shown.stdout.strip()


def _committed(revision: str, gpu: str) -> bool:
    """Whether `revision` holds both of `gpu`'s results and shapes tables."""
    return all(subprocess.run(["git", "cat-file", "-e", f"{revision}:{table_path(Path('data/results'), gpu, name)}"],
                              cwd=REPO, capture_output=True).returncode == 0 for name in ("results", "shapes"))


def history(gpu: str) -> list[dict[str, Any]]:
    """`regrades` rows for every pair of consecutive committed revisions of `gpu`'s results (git's history of
    data/results/<gpu>/results.parquet): each regrade merged since the board began."""
    relative = table_path(Path("data/results"), gpu, "results").as_posix()
    revisions = subprocess.run(["git", "log", "--format=%H", "--reverse", "--", relative], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split()
    rows: list[dict[str, Any]] = []
    before: tuple[str, Tables] | None = None
    for revision in revisions:
        if not _committed(revision, gpu):
            before = None
            continue
        with tempfile.TemporaryDirectory(prefix="regrade-history-") as tmp:
            after = _tables(_at_revision(revision, gpu, Path(tmp)), gpu, checked=False)
        if before is not None:
            rows.extend(regrades.pairs(before[1], after, gpu, before[0]))
        before = (revision, after)
    return rows


@click.command()
@click.option("--gpu", required=True, help="The board key (h100-sxm, h200).")
@click.option("--old", help="The results folder before the regrade, or a git revision of data/results.")
@click.option("--new", type=click.Path(exists=True, file_okay=False, path_type=Path), default=Path("data/results"),
              show_default=True, help="The results folder after it.")
@click.option("--record", "record_to", type=click.Path(dir_okay=False, path_type=Path),
              help="Also add the shapes graded again to this table (data/regrades.parquet); --old must then be a "
                   "git revision, which each row names.")
@click.option("--history", "whole_history", is_flag=True,
              help="With --record: every regrade in git's history of the GPU's results, not --old and --new.")
def main(gpu: str, old: str | None, new: Path, record_to: Path | None, whole_history: bool) -> None:
    if whole_history:
        if record_to is None:
            sys.exit("regrade_compare: --history records what it finds: name the table with --record")
        rows = history(gpu)
    else:
        if old is None:
            sys.exit("regrade_compare: name the results before the regrade with --old (a folder or a git revision)")
        if record_to is not None and Path(old).is_dir():
            sys.exit("regrade_compare: --record needs --old to be a git revision (each row names where its "
                     "figure before came from)")
        with tempfile.TemporaryDirectory(prefix="regrade-compare-") as tmp:
            before = _tables(Path(old) if Path(old).is_dir() else _at_revision(old, gpu, Path(tmp)), gpu)
        after = _tables(new, gpu)
        rows = regrades.pairs(before, after, gpu, "" if record_to is None else _revision(old))
        for line in compare(before, after, gpu, rows):
            print(line)
    if record_to is not None:
        added, total = regrades.record(record_to, rows)
        print(f"{record_to}: {added} shapes graded again added, {total} in all")


if __name__ == "__main__":
    main()

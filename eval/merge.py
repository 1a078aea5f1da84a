"""Merging a results folder graded elsewhere (another GPU of the host, another machine) into one.

Where both folders hold a row with the same key, the one measured later wins: a graded run as a
whole (its results row, its shape rows, its runs row and its log) by `graded_at`, a baseline row
by `measured_at`, a hardware row by the time of its calibration. So folders can be merged in any
order, and a stale copy never overwrites a fresh grading. Both folders are validated before
anything is written and the merged tables after; each table is replaced atomically, results
last, so an interruption never leaves a result whose run or shape rows are missing. Shape rows
follow their result: those of a run whose winning result has none (a failure, or a result the
shapes lost to) are removed, and so are shape rows with no result at all (left by an old,
interrupted grading).

The merge holds the destination's lock (`tables.results_lock`) from its first read to its last
write, and reads the source under the source's lock, so an eval writing either folder meanwhile
loses nothing; journal entries a killed eval left in either folder are finished first.
"""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from kernelboard.errors import UsageError

from .interrupted import merged_records, read_records, without_graded, write_records
from .schema import TABLES
from .tables import (
    finish_pending,
    load_all,
    results_lock,
    rows_to_table,
    table_path,
    table_rows,
    write_atomic,
)

#: Write order: a results row lands only after the run and shape rows it refers to.
_ORDER = ("runs", "shapes", "baselines", "hardware", "results")
_HEADER = "=== "


def _later(mine: dt.datetime | None, theirs: dt.datetime | None) -> bool:
    """Is `mine` strictly later than `theirs` (a missing time is never later)?"""
    return mine is not None and (theirs is None or mine > theirs)


def _newer_rows(src: list[dict], dst: list[dict], key: tuple[str, ...], stamp: str,
                tally: Counter) -> tuple[list[dict], set[tuple]]:
    """`dst` with every `src` row that is new or measured later put in its place, and the keys
    of the rows taken from `src`."""
    merged = {tuple(r[k] for k in key): r for r in dst}
    taken = set()
    for row in src:
        k = tuple(row[c] for c in key)
        old = merged.get(k)
        if old is None or _later(row[stamp], old[stamp]):
            tally["added" if old is None else "replaced"] += 1
            merged[k] = row
            taken.add(k)
        else:
            tally["kept"] += 1
    return list(merged.values()), taken


def _merge_gpu(theirs: dict[str, list[dict]], dst: Path, gpu: str,
               report: dict[str, Counter]) -> tuple[dict[str, list[dict]], set[str]]:
    """The merged tables of one GPU folder (`theirs`: the source's rows), and the run_ids whose
    grading came from the source."""
    tables = {name: table_rows(dst, gpu, name) for name in _ORDER}
    tables["results"], taken = _newer_rows(theirs["results"], tables["results"], TABLES["results"][1],
                                           "graded_at", report["results"])
    won = {run_id for run_id, _ in taken}  # a run moves as a whole: its shapes and runs row follow
    tables["shapes"] = [r for r in tables["shapes"] if r["run_id"] not in won] + \
        [r for r in theirs["shapes"] if r["run_id"] in won]
    with_shapes = {r["run_id"] for r in tables["results"] if r["n_shapes"]}
    dropped = [r for r in tables["shapes"] if r["run_id"] not in with_shapes]
    if dropped:  # the winning result has no shapes, or there is no result at all
        report["shapes"]["removed"] += len(dropped)
        tables["shapes"] = [r for r in tables["shapes"] if r["run_id"] in with_shapes]
    known = {r["run_id"] for r in tables["runs"]}
    incoming = [r for r in theirs["runs"] if r["run_id"] in won or r["run_id"] not in known]
    replaced = {r["run_id"] for r in incoming}
    tables["runs"] = [r for r in tables["runs"] if r["run_id"] not in replaced] + incoming
    for name in ("baselines", "hardware"):
        stamp = "measured_at"  # a baseline's measurement; the hardware row's calibration
        tables[name], _ = _newer_rows(theirs[name], tables[name], TABLES[name][1], stamp, report[name])
    return tables, won


def _log_parts(text: str) -> list[str]:
    """A baseline log split into its headed parts (one per measuring run)."""
    parts: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(_HEADER) or not parts:
            parts.append(line)
        else:
            parts[-1] += line
    return parts


def _merge_logs(src: Path, dst: Path, gpu: str, won: Iterable[str]) -> None:
    """Run logs follow the grading that won; baseline logs gain the parts they do not have yet."""
    src_logs, dst_logs = src / gpu / "logs", dst / gpu / "logs"
    if not src_logs.is_dir():
        return
    dst_logs.mkdir(parents=True, exist_ok=True)
    for run_id in won:
        for log in src_logs.glob(f"{run_id}.*log"):
            shutil.copy2(log, dst_logs / log.name)
    for log in src_logs.glob("baselines-*.log"):
        target = dst_logs / log.name
        have = target.read_text() if target.exists() else ""
        missing = [p for p in _log_parts(log.read_text()) if p not in have]
        if missing:
            with target.open("a") as fh:
                fh.write(("" if not have or have.endswith("\n") else "\n") + "".join(missing))


def problems_on_boards(results_dir: Path) -> Counter:
    """(gpu, bench, problem) -> how many results of it a folder holds on its boards (`off_board` rows are not
    shown there). A problem joins a GPU's board with its first result, and the site then holds every AI model
    with an ungraded run of it unranked until all are graded, which `eval merge` says (sitegen/board.py)."""
    held: Counter = Counter()
    if not has_tables(results_dir):
        return held
    for gpu_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        runs = {r["run_id"]: r for r in table_rows(results_dir, gpu_dir.name, "runs")}
        for result in table_rows(results_dir, gpu_dir.name, "results"):
            run = runs.get(result["run_id"])
            if run is not None and not result.get("off_board"):
                held[gpu_dir.name, run["bench"], run["problem"]] += 1
    return held


def has_tables(results_dir: Path) -> bool:
    """Does this folder hold results tables, in <gpu>/ folders?"""
    return any(results_dir.glob("*/*.parquet"))


def merge_results(src: Path, dst: Path, skip: frozenset[str] = frozenset()) -> dict[str, Counter]:
    """Merge every GPU folder of `src` into `dst`; returns added / replaced / kept counts per table.
    The runs in `skip` are left out of the source whole (their results, shape and runs rows, logs):
    gradings the grader itself got wrong, which `--resume` must grade again rather than keep."""
    if src.resolve() == dst.resolve():
        raise UsageError(f"{src}: merging a results folder into itself")
    if any(src.glob("*.parquet")):
        raise UsageError(f"{src}: this is one GPU's folder; merge the results folder that holds it ({src.parent})")
    if not has_tables(src):
        raise UsageError(f"{src}: no results tables in <gpu>/ folders here (e.g. {src / 'h200' / 'results.parquet'})")
    with results_lock(src, f"kernelboard eval merge reading {src}"):
        finish_pending(src)
        load_all(src)  # every table of both sides valid before anything is written
        gpus = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
        theirs = {gpu: {name: table_rows(src, gpu, name) for name in _ORDER} for gpu in gpus}
    unknown = skip - {r["run_id"] for tables in theirs.values() for r in tables["results"]}
    if unknown:
        raise UsageError(f"{src}: no grading of {', '.join(sorted(unknown))} here to skip")
    for tables in theirs.values():
        for name in ("results", "shapes", "runs"):
            tables[name] = [r for r in tables[name] if r["run_id"] not in skip]
    with results_lock(dst, f"kernelboard eval merge writing {dst}"):
        finish_pending(dst)
        return _merge_into(src, dst, theirs)


def _merge_into(src: Path, dst: Path, theirs: dict[str, dict[str, list[dict]]]) -> dict[str, Counter]:
    if has_tables(dst):
        load_all(dst)
    report: dict[str, Counter] = {name: Counter() for name in ("results", "shapes", "baselines", "hardware")}
    merged = {gpu: _merge_gpu(rows, dst, gpu, report) for gpu, rows in theirs.items()}
    with tempfile.TemporaryDirectory(prefix="kernelboard-merge-") as tmp:
        staged = Path(tmp) / "results"
        if dst.exists():
            for gpu_dir in (p for p in dst.iterdir() if p.is_dir()):
                for table in gpu_dir.glob("*.parquet"):
                    (staged / gpu_dir.name).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(table, staged / gpu_dir.name / table.name)
        written = {}
        for gpu, (tables, _) in merged.items():
            for name in _ORDER:
                if tables[name] or table_path(dst, gpu, name).exists():
                    table = rows_to_table(name, tables[name]).sort_by([(k, "ascending") for k in TABLES[name][1]])
                    write_atomic(table, table_path(staged, gpu, name))
                    written[gpu, name] = table
        load_all(staged)  # the merged whole keeps the contract (cross-table rules included)
    for (gpu, name), table in written.items():  # in _ORDER within each GPU: results last
        write_atomic(table, table_path(dst, gpu, name))
    for gpu, (tables, won) in merged.items():
        _merge_logs(src, dst, gpu, won)
        _merge_interruptions(src, dst, gpu, tables)
    return report


def _merge_interruptions(src: Path, dst: Path, gpu: str, tables: dict[str, list[dict]]) -> None:
    """Both sides' records of interrupted runs (`interrupted.py`), less the runs the merged tables now
    hold a grading of, with the same solution. A record that cannot be read is said and left out."""
    theirs, bad_src = read_records(src, gpu)
    ours, bad_dst = read_records(dst, gpu)
    for warning in (bad_src, bad_dst):
        if warning:
            print(warning, file=sys.stderr)
    if not (theirs or ours):
        return
    solutions = {r["run_id"]: r["solution_sha256"] for r in tables["runs"]}
    graded = {r["run_id"]: solutions.get(r["run_id"]) for r in tables["results"]}
    write_records(dst, gpu, without_graded(merged_records(ours, theirs), graded))

"""The shapes of passes graded again, before and after: `data/regrades.parquet`.

Why: `eval merge` replaces a run's rows when it is graded again, so the figure it had before lives on only in
git, and a reader cannot see how far a figure moves when the same kernel is timed again on another host, day
or grader. That is the board's fidelity, measured on the kernels it shows. Each row is one shape of a run that
passed in two consecutive gradings on one GPU: both medians, both graders and times, and what set each figure
(`set_by`): the GPU's own span ("gpu"), the host's least dispatch in the covered loop ("floor": the median
above the covered GPU span by more than FLOOR_MARGIN) or a synchronise after every call ("synchronised"). A
shape whose grader recorded no timing method or no GPU span is left out: what set it cannot be told.

Rows are made from two committed revisions of a GPU's results (`bench/regrade_compare.py --record`, or
`--history` for every pair of consecutive revisions in git), so each names the revision its "before" row was
read from (`before_commit`): the figure it replaced can be checked there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kernelboard.errors import DataError

from .tables import write_atomic

#: A covered shape whose median passes its covered GPU span by more than this was timed at the host's floor.
FLOOR_MARGIN = 1.02
SET_BY = ("gpu", "floor", "synchronised")

_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema([
    pa.field("gpu", pa.string(), False),
    pa.field("run_id", pa.string(), False),
    pa.field("shape_idx", pa.int32(), False),
    pa.field("before_grader", pa.string(), False),
    pa.field("before_graded_at", _TS, False),
    pa.field("before_median_ms", pa.float64(), False),
    pa.field("before_set_by", pa.string(), False),
    pa.field("after_grader", pa.string(), False),
    pa.field("after_graded_at", _TS, False),
    pa.field("after_median_ms", pa.float64(), False),
    pa.field("after_set_by", pa.string(), False),
    pa.field("before_commit", pa.string(), False),  # the git revision the "before" row was read from
])
KEY = ("gpu", "run_id", "shape_idx", "before_graded_at", "after_graded_at")


def set_by(shape: Mapping[str, Any]) -> str | None:
    """What set a `shapes.parquet` row's figure (SET_BY), or None where its grader did not record enough to say."""
    method, span = shape.get("timing_method"), shape.get("gpu_span_ms")
    if method == "synchronised":
        return "synchronised"
    if method != "covered" or not span:
        return None
    return "floor" if shape["median_ms"] > FLOOR_MARGIN * span else "gpu"


def graded_again(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether two results rows of one run are two gradings (another grader, or another time)."""
    return (before["grader_version"], before["graded_at"]) != (after["grader_version"], after["graded_at"])


def pairs(before: tuple[list[dict], list[dict]], after: tuple[list[dict], list[dict]], gpu: str,
          before_commit: str) -> list[dict[str, Any]]:
    """The rows for every shape of a run that passed in both (results, shapes) tables of `gpu`, graded again in
    between (`graded_again`)."""
    old = {r["run_id"]: r for r in before[0]}
    again = {r["run_id"]: (old[r["run_id"]], r) for r in after[0] if r["run_id"] in old and r.get("grader_version")
             and old[r["run_id"]]["status"] == r["status"] == "pass" and graded_again(old[r["run_id"]], r)}
    old_shapes = {(s["run_id"], s["shape_idx"]): s for s in before[1] if s["run_id"] in again}
    rows = []
    for shape in after[1]:
        earlier = old_shapes.get((shape["run_id"], shape["shape_idx"]))
        if earlier is None or not earlier.get("median_ms") or not shape.get("median_ms"):
            continue
        was, now = set_by(earlier), set_by(shape)
        if was is None or now is None:
            continue
        a, b = again[shape["run_id"]]
        rows.append({"gpu": gpu, "run_id": shape["run_id"], "shape_idx": shape["shape_idx"],
                     "before_grader": a["grader_version"], "before_graded_at": a["graded_at"],
                     "before_median_ms": earlier["median_ms"], "before_set_by": was,
                     "after_grader": b["grader_version"], "after_graded_at": b["graded_at"],
                     "after_median_ms": shape["median_ms"], "after_set_by": now, "before_commit": before_commit})
    return rows


def read_regrades(path: Path) -> list[dict[str, Any]]:
    """The rows of `path` (none where it does not exist), checked: one `DataError` line per problem, naming the
    file, the row and the field."""
    if not path.exists():
        return []
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError([f"{path}: cannot read as parquet ({exc})"]) from None
    missing = [f.name for f in SCHEMA if f.name not in table.column_names]
    if missing:
        raise DataError([f"{path}: missing columns {', '.join(missing)} (expected {', '.join(SCHEMA.names)})"])
    try:
        rows = table.select(SCHEMA.names).cast(SCHEMA).to_pylist()
    except (pa.ArrowException, ValueError) as exc:
        raise DataError([f"{path}: columns not of the expected types ({exc})"]) from None
    problems = []
    for i, row in enumerate(rows):
        where = f"{path}: row {i} (run_id={row['run_id']!r}, gpu={row['gpu']!r}, shape_idx={row['shape_idx']})"
        for field in SCHEMA:
            if row[field.name] is None:
                problems.append(f"{where}: field {field.name!r} is empty")
        for side in ("before", "after"):
            median = row[f"{side}_median_ms"]
            if median is not None and not (math.isfinite(median) and median > 0):
                problems.append(f"{where}: field '{side}_median_ms': expected a positive time, got {median}")
            if row[f"{side}_set_by"] is not None and row[f"{side}_set_by"] not in SET_BY:
                problems.append(f"{where}: field '{side}_set_by': expected one of {', '.join(SET_BY)}, "
                                f"got {row[f'{side}_set_by']!r}")
    if problems:
        raise DataError(problems)
    return rows


def record(path: Path, rows: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """Add `rows` to `path` (a row of the same KEY is replaced); returns (added, total)."""
    kept = {tuple(r[k] for k in KEY): r for r in read_regrades(path)}
    before = len(kept)
    for row in rows:
        kept[tuple(row[k] for k in KEY)] = dict(row)
    ordered = sorted(kept.values(), key=lambda r: (r["gpu"], r["run_id"], r["after_graded_at"], r["shape_idx"]))
    write_atomic(pa.Table.from_pylist(ordered, schema=SCHEMA), path)
    return len(kept) - before, len(kept)

"""Writing imported rows into `data/results/<gpu>/*.parquet`, through `eval.tables`, idempotently.

Rows replace those with the same key; an imported run's old shape rows are dropped first (its
shape count may have changed). The merged table is validated like every other write, and a file
is only rewritten when its rows change, so a second import of the same source touches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from kernelboard.errors import DataError
from kernelboard.eval.hardware import GpuSpec
from kernelboard.eval.schema import TABLES
from kernelboard.eval.tables import read_table, results_lock, rows_to_table, table_path, validate, write_atomic

_MEASURED = ("measured_copy_gb_s", "measured_bf16_tflop_s", "measured_fp8_tflop_s", "measured_at")


def merge_rows(path: Path, name: str, rows: list[Mapping[str, Any]], drop_runs: set[str] = frozenset()) -> bool:
    """Upsert `rows` into one table (dropping `drop_runs`' old rows first); False when nothing changed."""
    new = rows_to_table(name, rows)
    problems = validate(name, new, f"{path} (new rows)")
    if problems:
        raise DataError(problems)
    with results_lock(path.parent.parent, f"kernelboard import writing {path}"):  # an eval may write it too
        return _merge_locked(path, name, new, drop_runs)


def _merge_locked(path: Path, name: str, new: pa.Table, drop_runs: set[str]) -> bool:
    keys = TABLES[name][1]
    old = read_table(path, name) if path.exists() else new.schema.empty_table()
    new_keys = {tuple(r[k] for k in keys) for r in new.to_pylist()}
    kept = [r for r in old.to_pylist()
            if tuple(r[k] for k in keys) not in new_keys and r.get("run_id") not in drop_runs]
    merged = pa.concat_tables([pa.Table.from_pylist(kept, schema=new.schema), new])
    merged = merged.sort_by([(k, "ascending") for k in keys])
    if path.exists() and merged.to_pylist() == old.sort_by([(k, "ascending") for k in keys]).to_pylist():
        return False
    write_atomic(merged, path)
    return True


def write_rows(results_dir: Path, gpu: str, tables: Mapping[str, list[dict[str, Any]]], spec: GpuSpec | None) -> None:
    """The runs, results and shapes rows of one GPU, plus its datasheet hardware row when it has none."""
    runs = {r["run_id"] for r in tables.get("runs", [])}
    for name in ("runs", "results", "shapes"):
        merge_rows(table_path(results_dir, gpu, name), name, tables.get(name, []),
                   drop_runs=runs if name == "shapes" else set())
    hardware = table_path(results_dir, gpu, "hardware")
    if spec is not None and not hardware.exists():
        merge_rows(hardware, "hardware", [{**spec.hardware_row(), **dict.fromkeys(_MEASURED)}])

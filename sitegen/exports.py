"""The CSV and JSON copies of every Parquet table the site publishes ('data/results/h200/runs.csv').

An `Exports` is one build's plan of them: their names are known from the loaded data without making
anything (the build needs them to clear a recycled site), and their bytes are made once, by the build's
export step, which `render.build_site` runs as a step of its own. The downloads page lists their sizes,
so it reads them from the same object; nothing here is kept between builds.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from datetime import date, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

__all__ = ["Exports"]


class Exports:
    """The exports of one build: a CSV and a JSON file beside each Parquet table of `table_files`
    (site path -> file, as `SiteData.table_files`). `names` costs nothing; `files()` reads and converts
    every table on its first call (the slowest meta file of a build) and keeps the bytes on this object,
    so the page that lists them and the step that writes them share one making. Each build plans its own:
    a table rewritten between two builds is read again, whatever its size and timestamps."""

    def __init__(self, table_files: Mapping[str, Path]) -> None:
        self.tables: tuple[tuple[str, Path], ...] = tuple(
            sorted((rel, Path(path)) for rel, path in table_files.items() if rel.endswith(".parquet")))
        self._files: Mapping[str, bytes] | None = None

    @property
    def names(self) -> list[str]:
        """The files `files()` makes, without making them, in the order it makes them."""
        return [f"{rel.removesuffix('.parquet')}.{ext}" for rel, _ in self.tables for ext in ("csv", "json")]

    def files(self) -> Mapping[str, bytes]:
        """Site path -> bytes of every export, made on the first call (read-only)."""
        if self._files is None:
            made: dict[str, bytes] = {}
            for rel, path in self.tables:
                made.update(_exports_of(rel, path))
            self._files = MappingProxyType(made)
        return self._files


def _plain(value: Any) -> Any:
    """A cell as JSON: datetimes in ISO 8601, NaN/inf as null, lists and dicts cell by cell."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _csv_ready(table: pa.Table) -> pa.Table:
    """CSV has no lists or structs: such columns are written as JSON text."""
    columns = []
    for column in table.columns:
        if pa.types.is_nested(column.type):
            text = [None if v is None else json.dumps(_plain(v), sort_keys=True) for v in column.to_pylist()]
            column = pa.chunked_array([pa.array(text, pa.string())])
        columns.append(column)
    return pa.table(columns, names=table.column_names)


def _exports_of(rel: str, path: Path) -> dict[str, bytes]:
    table = pq.read_table(path)
    stem = rel.removesuffix(".parquet")
    buffer = io.BytesIO()
    pacsv.write_csv(_csv_ready(table), buffer)
    return {f"{stem}.csv": buffer.getvalue(), f"{stem}.json": _records_json(table).encode()}


def _json_column(column: pa.ChunkedArray) -> list[Any]:
    """One column's cells as JSON values (see `_plain`), converted by the column's type rather than
    cell by cell: a hundred thousand rows would otherwise take seconds of isinstance checks."""
    values = column.to_pylist()
    kind = column.type
    if pa.types.is_timestamp(kind) or pa.types.is_date(kind):
        return [None if v is None else v.isoformat() for v in values]
    if pa.types.is_floating(kind):
        return [v if v is None or math.isfinite(v) else None for v in values]
    if pa.types.is_nested(kind):
        return [_plain(v) for v in values]
    return values


def _records_json(table: pa.Table) -> str:
    """The table as a JSON array of row objects (columns in table order), one row per line: readable,
    diffable, and written by json's C encoder (which an `indent` would turn off)."""
    names = table.column_names
    columns = [_json_column(c) for c in table.columns]
    dump = json.JSONEncoder(ensure_ascii=False, allow_nan=False).encode
    rows = [dump(dict(zip(names, cells, strict=True))) for cells in zip(*columns, strict=True)]
    return "[\n" + ",\n".join(rows) + "\n]\n" if rows else "[]\n"

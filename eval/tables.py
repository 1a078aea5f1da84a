"""Reading, validating and atomically writing the parquet tables of `eval/schema.py`.

Validation collects every problem in a table and raises one `DataError` whose lines each name
the file, the row and the field. Writes go to a temporary file beside the target, then
`os.replace` — an interrupted run leaves the previous table whole; a write that fails (a full
disk, a read-only folder) is one line naming the file, and leaves no temporary file.

Every read-modify-write of a results folder (`upsert`, `eval merge`, an import) holds that
folder's lock (`results_lock`), so two writers on one folder queue instead of losing each
other's rows. Rows that belong together (a graded run's shapes, runs and results rows) are
written through a journal (`upsert_together`): a process killed half-way leaves a complete entry
that the next writer of the folder finishes (`finish_pending`), so no result ever lacks its shape
rows and no shape rows are left without their result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kernelboard.errors import DataError, KernelboardError

from .locks import hold, lock_dir
from .schema import ADDED_COLUMNS, DNF_OUTCOMES, ENUMS, IMPORTED_SUFFIX, SCHEMA_VERSION, TABLES, TIMES_MS

#: Columns of the runs table that count something an agent spent: never negative, NaN or infinite.
_SPENT = ("agent_seconds", "cost_usd", "input_tokens", "output_tokens", "cache_read_tokens")


def table_path(results_dir: Path, gpu: str, name: str) -> Path:
    return results_dir / gpu / f"{name}.parquet"


def table_rows(results_dir: Path, gpu: str, name: str) -> list[dict[str, Any]]:
    """One GPU folder's table as rows; none where the folder has no such table yet."""
    path = table_path(results_dir, gpu, name)
    return read_table(path, name).to_pylist() if path.exists() else []


def results_lock_path(results_dir: Path) -> Path:
    """The lock file of one results folder: in `locks.lock_dir()`, named by a hash of the folder's real
    path, so the folder itself (committed data, fingerprinted by the site) never changes for it."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(results_dir))).hexdigest()[:16]
    return lock_dir() / f"kernelboard-results-{key}.lock"


@contextlib.contextmanager
def results_lock(results_dir: Path, what: str) -> Iterator[None]:
    """Hold the write lock of one results folder for the block: every writer of that folder reads,
    merges and writes its tables under it. Says on stderr what it waits for."""
    with hold(results_lock_path(results_dir), what):
        yield


def _row_label(name: str, i: int, row: Mapping[str, Any]) -> str:
    keys = TABLES[name][1]
    ident = ", ".join(f"{k}={row.get(k)!r}" for k in keys if k in row)
    return f"row {i} ({ident})"


def _with_added_columns(name: str, table: pa.Table) -> pa.Table:
    """`table` with every column added to the schema since it was written, as nulls."""
    schema, _ = TABLES[name]
    for column in ADDED_COLUMNS.get(name, ()):
        if column not in table.column_names:
            table = table.append_column(schema.field(column), pa.nulls(table.num_rows, schema.field(column).type))
    return table


def _check_columns(name: str, table: pa.Table, where: str) -> list[str]:
    schema, _ = TABLES[name]
    problems = []
    for field in schema:
        if field.name not in table.column_names:
            problems.append(f"{where}: missing column '{field.name}' ({field.type})")
            continue
        got = table.schema.field(field.name).type
        if got != field.type and not (pa.types.is_null(got) and field.nullable):
            problems.append(f"{where}: column '{field.name}' has type {got}, expected {field.type}")
    return problems


def _finite_positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _check_row(name: str, row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Field-level rules for one row: (field, what was expected) pairs."""
    schema, _ = TABLES[name]
    bad: list[tuple[str, str]] = []
    if row.get("schema_version") != SCHEMA_VERSION:
        bad.append(("schema_version", f"expected {SCHEMA_VERSION}, got {row.get('schema_version')!r}"))
    for field in schema:
        if not field.nullable and row.get(field.name) is None:
            bad.append((field.name, "a value is required, got null"))
    for (table, column), allowed in ENUMS.items():
        value = row.get(column)
        if table == name and value is not None and value not in allowed:
            bad.append((column, f"expected one of {', '.join(allowed)}; got {value!r}"))
    for column in TIMES_MS:
        value = row.get(column)
        if column in row and value is not None and not _finite_positive(value):
            bad.append((column, f"a time must be a positive finite number of ms, got {value!r}"))
    if name == "runs":
        for column in _SPENT:
            value = row.get(column)
            if value is not None and not (math.isfinite(value) and value >= 0):
                bad.append((column, f"expected a finite number that is not negative, got {value!r}"))
    if name == "results":
        bad.extend(_check_result_score(row))
    return bad


def _check_result_score(row: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A pass carries a score; anything else carries none (a failure is not a score of 0).

    The score is the speedups over compile and eager; a pass imported from another grader that
    published no baselines to derive them from (`measured_by` ends in IMPORTED_SUFFIX, both speedups
    null) carries that grader's own score instead, a positive `peak_fraction` — or none, where that
    grader passed the run but published no score (the verdict is kept; the board counts it as 0).
    """
    scores = ("speedup_vs_compile", "speedup_vs_eager", "peak_fraction", "peak_fraction_measured")
    if row.get("status") == "pass":
        bad = []
        speedups = ("speedup_vs_compile", "speedup_vs_eager")
        fraction_only = (str(row.get("measured_by") or "").endswith(IMPORTED_SUFFIX)
                         and all(row.get(c) is None for c in speedups))
        pf = row.get("peak_fraction")
        if fraction_only and pf is not None and not _finite_positive(pf):
            bad.append(("peak_fraction", "an imported pass without speedups carries its grader's positive "
                                         f"peak fraction or none, got {pf!r}"))
        for column in () if fraction_only else speedups:
            if not _finite_positive(row.get(column)):
                bad.append((column, f"a pass needs a positive speedup, got {row.get(column)!r}"))
        if not fraction_only and not (row.get("n_shapes") or 0) > 0:
            bad.append(("n_shapes", "a pass must have graded at least one shape"))
        pf = row.get("peak_fraction")
        if pf is not None and not _finite_positive(pf):
            bad.append(("peak_fraction", f"expected a positive fraction or null, got {pf!r}"))
        return bad
    return [
        (column, f"status {row.get('status')!r} is not a pass, so it must carry no score; got {row[column]!r}")
        for column in scores
        if row.get(column) is not None
    ]


def validate(name: str, table: pa.Table, where: str) -> list[str]:
    """Every problem in `table` as one line each; an empty list means the table keeps the contract."""
    problems = _check_columns(name, table, where)
    if problems:
        return problems
    seen: dict[tuple, int] = {}
    keys = TABLES[name][1]
    for i, row in enumerate(table.to_pylist()):
        for field, expected in _check_row(name, row):
            problems.append(f"{where}: {_row_label(name, i, row)}: field '{field}': {expected}")
        key = tuple(row.get(k) for k in keys)
        if key in seen:
            problems.append(f"{where}: {_row_label(name, i, row)}: duplicates row {seen[key]} (key {keys})")
        seen[key] = i
    return problems


def read_table(path: Path, name: str) -> pa.Table:
    """Read and validate one table file; raise `DataError` listing every problem."""
    try:
        table = _with_added_columns(name, pq.read_table(path))
    except (OSError, pa.ArrowException) as exc:
        raise DataError([f"{path}: cannot read as parquet ({exc})"]) from None
    problems = validate(name, table, str(path))
    if problems:
        raise DataError(problems)
    return table.select([f.name for f in TABLES[name][0]]).cast(TABLES[name][0])


def rows_to_table(name: str, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    schema = TABLES[name][0]
    full = [{"schema_version": SCHEMA_VERSION, **row} for row in rows]
    unknown = {k for row in full for k in row} - set(schema.names)
    if unknown:
        raise ValueError(f"{name}: unknown columns {sorted(unknown)}")
    return pa.Table.from_pylist(full, schema=schema)


def write_atomic(table: pa.Table, path: Path) -> None:
    """Write a parquet file so that readers see the old file or the new one, never half of one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise KernelboardError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        os.close(fd)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; published tables are world-readable
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # pyarrow's IO errors are OSErrors too
            raise KernelboardError(f"{path}: cannot write ({exc.strerror or exc}); the previous table is "
                                   "unchanged") from None
        raise


def upsert(path: Path, name: str, rows: Iterable[Mapping[str, Any]],
           replace_matching: Mapping[str, Any] | None = None) -> pa.Table:
    """Replace rows with the same key (or add them), validate, and write the table atomically.

    `replace_matching` also drops every old row whose columns equal those values — e.g. all
    shape rows of a run that is graded again, however many shapes it had before.
    """
    new = rows_to_table(name, rows)
    problems = validate(name, new, f"{path} (new rows)")
    if problems:
        raise DataError(problems)
    with results_lock(path.parent.parent, f"a writer of {path.name}"):
        return _upsert_locked(path, name, new, replace_matching)


def _upsert_locked(path: Path, name: str, new: pa.Table, replace_matching: Mapping[str, Any] | None) -> pa.Table:
    keys = TABLES[name][1]
    remove_stale_writes(path.parent, path.name)
    if path.exists():
        old = read_table(path, name)
        new_keys = {tuple(r[k] for k in keys) for r in new.select(list(keys)).to_pylist()}
        match = dict(replace_matching or {})
        kept = [
            r for r in old.to_pylist()
            if tuple(r[k] for k in keys) not in new_keys
            and not (match and all(r.get(k) == v for k, v in match.items()))
        ]
        merged = pa.concat_tables([pa.Table.from_pylist(kept, schema=new.schema), new])
    else:
        merged = new
    merged = merged.sort_by([(k, "ascending") for k in keys])
    write_atomic(merged, path)
    return merged


#: Journal entries of `upsert_together`, one folder each, inside the GPU folder they write to.
_PENDING = ".pending"
_MANIFEST = "manifest.json"


def upsert_together(results_dir: Path, gpu: str, label: str,
                    writes: Iterable[tuple[str, Iterable[Mapping[str, Any]], Mapping[str, Any] | None]]) -> None:
    """Upsert rows into several tables of one GPU folder as one change: every table or, after a
    kill, every table once the next writer of the folder has run (`finish_pending`).

    `writes` is (table name, rows, replace_matching) in the order they are applied. The rows are
    validated, written whole into a journal entry `<gpu>/.pending/<label>/` whose manifest is
    written last (the commit point), applied, and the entry removed.
    """
    staged = []
    for name, rows, match in writes:
        table = rows_to_table(name, rows)
        problems = validate(name, table, f"{table_path(results_dir, gpu, name)} (new rows)")
        if problems:
            raise DataError(problems)
        staged.append((name, table, dict(match or {})))
    with results_lock(results_dir, f"a writer of {results_dir / gpu} ({label})"):
        finish_pending(results_dir)
        entry = results_dir / gpu / _PENDING / label
        if entry.exists():
            shutil.rmtree(entry)
        for i, (_, table, _) in enumerate(staged):
            write_atomic(table, entry / f"{i}.parquet")
        manifest = [{"name": name, "replace_matching": match} for name, _, match in staged]
        _write_text_atomic(entry / _MANIFEST, json.dumps(manifest, sort_keys=True))
        _apply(results_dir, gpu, entry)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise KernelboardError(f"{path}: cannot write ({exc.strerror or exc})") from None


def _apply(results_dir: Path, gpu: str, entry: Path) -> None:
    manifest = json.loads((entry / _MANIFEST).read_text())
    for i, step in enumerate(manifest):
        name = step["name"]
        rows = read_table(entry / f"{i}.parquet", name)
        _upsert_locked(table_path(results_dir, gpu, name), name, rows, step["replace_matching"] or None)
    shutil.rmtree(entry)
    with contextlib.suppress(OSError):  # the last entry: no empty folder left behind
        entry.parent.rmdir()


def remove_stale_writes(gpu_dir: Path, table_file: str = "*.parquet") -> None:
    """Remove the temporary files `write_atomic` leaves when its writer is killed mid-write.
    Only a holder of the folder's results lock may call this: no other writer is then alive."""
    for stale in gpu_dir.glob(f".{table_file}.*.tmp"):
        stale.unlink(missing_ok=True)


def finish_pending(results_dir: Path) -> list[str]:
    """Finish the journal entries a killed writer left in `results_dir` (entries without their
    manifest were never applied and are dropped), and remove a killed writer's half-written
    tables; returns the labels finished."""
    finished = []
    with results_lock(results_dir, f"a writer of {results_dir}"):
        for gpu_dir in (p for p in results_dir.glob("*") if p.is_dir() and not p.name.startswith(".")):
            remove_stale_writes(gpu_dir)
        for entry in sorted(results_dir.glob(f"*/{_PENDING}/*")):
            if (entry / _MANIFEST).is_file():
                _apply(results_dir, entry.parent.parent.name, entry)
                finished.append(entry.name)
            else:
                shutil.rmtree(entry, ignore_errors=True)
                with contextlib.suppress(OSError):
                    entry.parent.rmdir()
    return finished


def load_all(results_dir: Path) -> dict[str, pa.Table]:
    """Every table of every GPU folder, concatenated and cross-checked.

    Cross-table rules: each result names a known run; a run whose outcome is a DNF has the
    status `dnf` and nothing else, and only such runs may be `dnf`.
    """
    if not results_dir.is_dir():
        raise DataError([f"{results_dir}: no such results folder"])
    parts: dict[str, list[pa.Table]] = {name: [] for name in TABLES}
    problems: list[str] = []
    for gpu_dir in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        for name in TABLES:
            path = gpu_dir / f"{name}.parquet"
            if path.exists():
                try:
                    parts[name].append(read_table(path, name))
                except DataError as exc:
                    problems.extend(exc.problems)
    if problems:
        raise DataError(problems)
    tables = {
        name: pa.concat_tables(ts) if ts else TABLES[name][0].empty_table() for name, ts in parts.items()
    }
    tables["runs"] = _merge_runs(tables["runs"], results_dir, problems)
    problems.extend(_cross_check(tables, results_dir))
    if problems:
        raise DataError(problems)
    return tables


def _merge_runs(runs: pa.Table, results_dir: Path, problems: list[str]) -> pa.Table:
    """The same run may be listed under several GPU folders; the copies must agree."""
    if pc.count_distinct(runs.column("run_id")).as_py() == runs.num_rows:  # each run listed once
        return runs
    by_id: dict[str, dict] = {}
    for row in runs.to_pylist():
        prior = by_id.setdefault(row["run_id"], row)
        if prior != row:
            diff = sorted(k for k in row if row[k] != prior[k])
            problems.append(
                f"{results_dir}: runs: run_id={row['run_id']!r} appears twice with different {diff}"
            )
    return pa.Table.from_pylist(list(by_id.values()), schema=runs.schema)


def _cross_check(tables: Mapping[str, pa.Table], results_dir: Path) -> list[str]:
    outcome = {r["run_id"]: r["agent_outcome"] for r in tables["runs"].to_pylist()}
    problems = []
    for i, row in enumerate(tables["results"].to_pylist()):
        where = f"{results_dir / row['gpu'] / 'results.parquet'}: row {i} (run_id={row['run_id']!r})"
        if row["run_id"] not in outcome:
            problems.append(f"{where}: field 'run_id': no such run in runs.parquet")
            continue
        is_dnf_run = outcome[row["run_id"]] in DNF_OUTCOMES
        if is_dnf_run and row["status"] != "dnf":
            problems.append(
                f"{where}: field 'status': the run is a DNF ({outcome[row['run_id']]}), "
                f"so its status must be 'dnf', not {row['status']!r}"
            )
        if row["status"] == "dnf" and not is_dnf_run:
            problems.append(
                f"{where}: field 'status': 'dnf' needs a run outcome in {sorted(DNF_OUTCOMES)}, "
                f"got {outcome[row['run_id']]!r}"
            )
    return problems

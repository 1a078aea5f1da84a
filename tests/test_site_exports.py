"""The CSV and JSON exports: one build's own step, made from the Parquet tables as they are at that build."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from site_fixtures import SiteInputs

from kernelboard.sitegen import build_site
from kernelboard.sitegen.exports import Exports


def _messages(out: Path) -> tuple[set[str], set[str]]:
    """The h200 results' messages as the site's results.csv and results.json give them."""
    stem = out / "data" / "results" / "h200" / "results"
    rows = csv.DictReader(io.StringIO(stem.with_suffix(".csv").read_text(encoding="utf-8")))
    records = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    return {r["message"] for r in rows}, {r["message"] for r in records}


def _with_messages(table: pa.Table, old: str, new: str) -> pa.Table:
    index = table.schema.get_field_index("message")
    column = pc.replace_substring(table["message"], old, new)
    return table.set_column(index, table.schema.field(index), column)


def test_a_table_rewritten_with_the_same_size_and_mtime_gets_fresh_exports(fresh_inputs: SiteInputs,
                                                                           tmp_path: Path) -> None:
    """Two builds in one process, a table's contents changed between them but not its size, inode or
    modification time (rewritten in place, its timestamps put back, as `cp -p` or `rsync -t` do). The
    exports used to be cached in a module global keyed by exactly those, so the second build published
    the new Parquet beside the first build's CSV and JSON; each build now makes its own."""
    path = fresh_inputs.results_dir / "h200" / "results.parquet"
    table = pq.read_table(path)
    pq.write_table(table, path, compression="none")  # uncompressed: an edit of the same length keeps the size
    out = tmp_path / "dist"
    build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, out)
    csv_messages, json_messages = _messages(out)
    assert csv_messages == json_messages and any("stress case" in m for m in csv_messages)

    before = path.stat()
    changed = io.BytesIO()
    pq.write_table(_with_messages(table, "stress case", "stress test"), changed, compression="none")
    assert len(changed.getvalue()) == before.st_size  # only the contents tell the two tables apart
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(changed.getvalue())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)

    report = build_site(fresh_inputs.data_dir, fresh_inputs.decks_dir, out)
    assert not report.unchanged  # the fingerprint hashes contents, so the change is seen
    published = set(pq.read_table(out / "data" / "results" / "h200" / "results.parquet")["message"].to_pylist())
    assert any("stress test" in m for m in published)
    assert _messages(out) == (published, published)


def test_exports_name_their_files_without_making_them_and_make_them_once(site_inputs: SiteInputs,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    tables = {"data/results/h200/runs.parquet": site_inputs.results_dir / "h200" / "runs.parquet",
              "data/results/h200/run.log": site_inputs.results_dir / "h200" / "runs.parquet"}
    exports = Exports(tables)
    read: list[Path] = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda p, *a, **k: read.append(Path(p)) or real(p, *a, **k))
    assert exports.names == ["data/results/h200/runs.csv", "data/results/h200/runs.json"]
    assert read == []
    first = exports.files()
    assert sorted(first) == exports.names and read == [tables["data/results/h200/runs.parquet"]]
    assert exports.files() is first and len(read) == 1  # made once per object …
    assert Exports(tables).files() == first and len(read) == 2  # … and again for another build's

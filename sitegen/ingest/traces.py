"""`kernelboard import traces`: agent-trace datasets -> submission folders (solution + run.yaml).

One run per trace file. Files come from a local folder (`*.jsonl`, or `*.parquet` as the Hub's
conversion writes them, a `trace` and a `file_path` column) or from a Hub dataset loaded with
`datasets` (which needs `teich` to parse agent traces). The folder a file sits in names the GPU
board (`h100/` -> h100-pcie; the root -> `root_gpu`). For each run the importer reads identity,
the start time, token totals (summed over API messages), the outcome (`outcome.decide`) and
rebuilds the solution (`recover.recover`); `kernelboard eval` then grades the folders.

The start time is the trace's first timestamp only when the trace has a real clock. The traces
kernelbench.com publishes do not: its exporter invents one timestamp per line (run id + line
number seconds, `Session.exporter_clock`). Then the start is the run id's `YYYYMMDD_HHMMSS`, the
runner's local wall clock (`date +%Y%m%d_%H%M%S` in its scripts/lib/run_harness.sh), read at
`runner_utc_offset`, and the agent time is left unknown. See docs/traces.md.

Writes are atomic and skipped when the bytes are the same, so importing a source twice changes
nothing. A file with a malformed line is reported with its name and line and skipped whole (a
missing line could hide an edit); the rest are imported. A folder that another source wrote is
never overwritten.
"""

from __future__ import annotations

import datetime as dt
import json
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from kernelboard.eval.submission import RUN_ID_PATTERN

from ._files import dump_yaml, sync_folder
from .claude_code import TraceFormatError, parse_lines
from .naming import BOARD_GPUS, ROOT_GPU, RUNNER_UTC_OFFSET, lab_of, model_slug, split_run_id
from .outcome import decide
from .recover import recover


@dataclass(frozen=True)
class TraceFile:
    """One trace: its path inside the dataset (POSIX, e.g. 'h100/<run_id>.jsonl') and its text."""

    path: str
    text: str
    origin: str  # where it was read, for messages: a local file, or 'OWNER/NAME:path'


@dataclass
class ImportReport:
    """What an import did, for the command's summary and for tests."""

    written: list[str] = field(default_factory=list)  # run ids whose folder changed
    unchanged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # one line each: file, line, why
    outcomes: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())) or "none"
        return (f"{len(self.written)} written, {len(self.unchanged)} unchanged, {len(self.skipped)} skipped "
                f"· outcomes: {outcomes}")


@dataclass(frozen=True)
class TraceSource:
    """Where the traces come from, for run.yaml's `source` and the trace links."""

    label: str  # e.g. 'hf:Infatoshi/kernelbench-hard-traces@<rev>'
    hub_id: str | None = None  # OWNER/NAME, when the traces are (a copy of) a Hub dataset
    revision: str = "main"

    def trace_url(self, path: str) -> str | None:
        if self.hub_id is None:
            return None
        return f"https://huggingface.co/datasets/{self.hub_id}/blob/{quote(self.revision)}/{quote(path)}"


# ------------------------------------------------------------------------------------- sources


def read_folder(folder: Path) -> Iterator[TraceFile]:
    """Every `*.jsonl` (one trace each) and every row of every `*.parquet` under `folder`, sorted."""
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".jsonl" and path.is_file():
            yield TraceFile(path.relative_to(folder).as_posix(), path.read_text(encoding="utf-8", errors="replace"),
                            str(path))
        elif path.suffix == ".parquet" and path.is_file():
            import pyarrow.parquet as pq

            table = pq.read_table(path, columns=["file_path", "trace"])
            for i, row in enumerate(table.to_pylist()):
                yield from _row_file(row, f"{path} row {i}", None)


def read_dataset(rows: Iterable[dict[str, Any]], root: str | None = None, name: str = "dataset") -> Iterator[TraceFile]:
    """Traces from `datasets` rows (`trace`: the raw JSONL, `file_path`); local paths made relative to `root`."""
    for i, row in enumerate(rows):
        yield from _row_file(row, f"{name} row {i}", root)


def _row_file(row: dict[str, Any], origin: str, root: str | None) -> Iterator[TraceFile]:
    text, path = row.get("trace"), str(row.get("file_path") or "")
    if isinstance(text, str) and text.startswith('"'):  # a Json column read without its decoder
        text = json.loads(text)
    if root and path.startswith(root.rstrip("/") + "/"):
        path = path[len(root.rstrip("/")) + 1:]
    if isinstance(text, str) and path:
        yield TraceFile(path.lstrip("/"), text, f"{origin} ({path})")


# ------------------------------------------------------------------------------------- import


def import_traces(files: Iterable[TraceFile], *, data_dir: Path, bench: str, source: TraceSource,
                  root_gpu: str = ROOT_GPU, problems: frozenset[str] = frozenset(),
                  advance: Callable[[str], None] = lambda _: None,
                  runner_utc_offset: dt.timedelta = RUNNER_UTC_OFFSET) -> ImportReport:
    """Write one submission folder per trace under DATA/submissions/<bench>/ (see the module docstring)."""
    report = ImportReport()
    base = data_dir / "submissions" / bench
    for trace in files:
        advance(trace.path)
        try:
            run_id, meta, solution = build_run(trace, bench=bench, source=source, root_gpu=root_gpu,
                                               problems=problems, runner_utc_offset=runner_utc_offset)
        except _Skip as exc:
            report.skipped.append(f"{trace.origin}: {exc}")
            continue
        folder = base / run_id
        prior = _existing(folder)
        if prior is not None and prior.get("source") != meta["source"]:
            report.skipped.append(f"{trace.origin}: {folder} was imported from {prior.get('source')!r}; kept as is")
            continue
        if prior is not None and prior.get("gpu") != meta["gpu"]:  # the same run id on another board
            run_id = f"{run_id}-{meta['gpu']}"
            folder, meta["run_id"] = base / run_id, run_id
        files_out = {"run.yaml": dump_yaml(meta), **{k: v.encode() for k, v in solution.items()}}
        (report.written if sync_folder(folder, files_out) else report.unchanged).append(run_id)
        report.outcomes[meta["agent_outcome"]] += 1
    return report


class _Skip(Exception):
    """This trace cannot become a run; the message says why."""


def _existing(folder: Path) -> dict[str, Any] | None:
    try:
        meta = yaml.safe_load((folder / "run.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return meta if isinstance(meta, dict) else None


def _run_id_start(stamp: str, offset: dt.timedelta) -> str | None:
    """The run id's `YYYYMMDD_HHMMSS` as an ISO time at the runner's UTC offset (kept, not converted)."""
    try:
        when = dt.datetime.strptime(stamp, "%Y%m%d_%H%M%S")
    except ValueError:
        return None
    return when.replace(tzinfo=dt.timezone(offset)).isoformat().replace("+00:00", "Z")


def build_run(trace: TraceFile, *, bench: str, source: TraceSource, root_gpu: str = ROOT_GPU,
              problems: frozenset[str] = frozenset(), runner_utc_offset: dt.timedelta = RUNNER_UTC_OFFSET,
              ) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(run_id, run.yaml mapping, solution files) of one trace; raises `_Skip` with the reason."""
    name = posixpath.basename(trace.path)
    if not name.endswith(".jsonl"):
        raise _Skip("not a .jsonl trace")
    run_id = name[: -len(".jsonl")]
    if not RUN_ID_PATTERN.match(run_id):
        raise _Skip(f"{run_id!r} is not a usable run id (letters, digits, '.', '_', '-')")
    folder = posixpath.dirname(trace.path)
    gpu = root_gpu if folder == "" else BOARD_GPUS.get(folder.split("/")[-1].lower())
    if gpu is None:
        raise _Skip(f"unknown board folder {folder!r} (known: {', '.join(sorted(BOARD_GPUS))})")
    try:
        session = parse_lines(trace.text.splitlines())
    except TraceFormatError as exc:
        raise _Skip(str(exc)) from None
    if session.n_lines == 0 or (not session.tool_calls and session.model is None and not session.errors):
        raise _Skip("no session records (is this a Claude-Code session trace?)")
    parts = split_run_id(run_id, session.model, problems)
    if parts is None:
        raise _Skip("the run id does not read as YYYYMMDD_HHMMSS_<harness>_<model>_<NN>_<problem>")
    model = session.model or parts.model
    recovery = recover(session)
    outcome, note = decide(session, recovery)
    started = session.started_at
    started_at = started.astimezone(dt.UTC).isoformat().replace("+00:00", "Z") if started else \
        _run_id_start(parts.stamp, runner_utc_offset)
    meta: dict[str, Any] = {
        "run_id": run_id,
        "problem": parts.problem,
        "model": model_slug(model),
        "model_display": model,
        "lab": lab_of(model),
        "harness": parts.harness,
        "effort": session.init.get("effort") or session.init.get("reasoning_effort"),
        "gpu": gpu,
        "agent_outcome": outcome,
        "outcome_note": note,
        "trace_url": source.trace_url(trace.path),
        "started_at": started_at,
        "agent_seconds": session.wall_seconds(),
        **session.token_totals(),
        "source": source.label,
    }
    meta = {k: v for k, v in meta.items() if v is not None}
    return run_id, meta, recovery.files if recovery.status == "ok" else {}

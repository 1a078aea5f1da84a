"""`kernelboard import mega PATH`: KernelBench-Mega's published results into our tables, marked as imported.

The source (a checkout of kernelbench.com's repository) publishes three things for its Mega bench:
`public/data/mega/results.csv` (one row per board cell, on the RTX PRO 6000, H100 PCIe and B200),
the kernels under `public/data/mega/code/<run_id>.solution.py.txt` (board cells and the audited
runs beside them) and the audits under `benchmarks/mega/results/annotations/`.

Each CSV row becomes a runs row and a results row under `data/results/<gpu>/` (`measured_by`
"KernelBench-Mega (imported)", `grader_version` "kbm"), three shape rows for a pass, and its kernel
a submission folder, split back into `solution.py` and sidecars exactly as the Hard import does. A
kernel the source publishes without a CSV row becomes a submission folder only (so `kernelboard
eval` can grade it; the source gives it no result). Runs of problems kernelboard has no deck for,
and annotations naming no imported run, are reported one line each; so is every CSV row that does
not parse. Nothing is dropped silently.

The source's score is a speedup over its own optimised-PyTorch `baseline.py` (not torch.compile,
not eager), geomean over contexts 2048, 8192 and 16384: a pass's `speedup_vs_baseline`, with
`baseline_variant` "kbm:baseline.py" (the source's baseline, not the deck's `library:tuned` line),
and each context's speedup in its shape row (the source publishes no times). Its speedups over
torch.compile and eager and its roofline fraction stay null: the source measures none of them.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import DataError
from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.hardware import GPUS
from kernelboard.eval.submission import RUN_ID_PATTERN, Submission

from ._files import dump_yaml, sync_folder
from .annotations import write_annotation
from .kbh import DEFAULT_REPO, Provenance, git_revision, split_published
from .kbh_tables import write_rows
from .naming import RUNNER_UTC_OFFSET, lab_of, model_slug, split_run_id

BENCH = "mega"
MEASURED_BY = "KernelBench-Mega (imported)"
GRADER_VERSION = "kbm"
#: results.baseline_variant of an imported pass: the source's own baseline.py (not kernelboard's line).
BASELINE_VARIANT = "kbm:baseline.py"
RESULTS_CSV = "public/data/mega/results.csv"
CODE_DIR = "public/data/mega/code"
ANNOTATIONS_DIR = "benchmarks/mega/results/annotations"
CODE_SUFFIX = ".solution.py.txt"
#: The CSV's `gpu` values -> our GPU keys. Its H100 is the PCIe card (2039 GB/s, the source's
#: hardware table), like KernelBench-Hard's `h100` board.
CSV_GPUS: dict[str, str] = {"RTX PRO 6000 Blackwell": "rtx-pro-6000", "H100": "h100-pcie", "B200": "b200"}
CONTEXTS = (2048, 8192, 16384)
COLUMNS = ("gpu", "harness", "model", "problem", "correct", "score", "tok_s", "elapsed_s", "output_tokens",
           "ctx2048", "ctx8192", "ctx16384", "framework", "kernels", "megakernel", "megakernel_judged",
           "has_viewer", "run_id")
#: How the source timed (benchmarks/mega/problems/02_kimi_linear_decode/benchmark.py at c7d9221).
TIMING = ("host wall-clock around `steps` chained decode steps and a synchronize, best of 3, its baseline.py "
          "timed the same way")


@dataclass(frozen=True)
class MegaRow:
    """One parsed line of results.csv."""

    line: int
    gpu: str
    harness: str
    model: str
    problem: str
    correct: bool
    score: float | None
    tok_s: float | None
    elapsed_s: float | None
    output_tokens: int | None
    ctx_speedups: tuple[float, ...] | None
    framework: str
    kernels: int | None
    megakernel: str
    megakernel_judged: bool
    run_id: str


def _number(raw: dict[str, str], key: str, kind: type = float) -> Any:
    text = (raw.get(key) or "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"column {key!r}: expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"column {key!r}: expected a finite number that is not negative, got {text!r}")
    return value


def _flag(raw: dict[str, str], key: str) -> bool:
    text = (raw.get(key) or "").strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"column {key!r}: expected true or false, got {raw.get(key)!r}")
    return text == "true"


def parse_row(raw: dict[str, str], line: int) -> MegaRow:
    """A checked CSV row; ValueError (one line, naming the column) when it cannot be used."""
    run_id = (raw.get("run_id") or "").strip()
    if not RUN_ID_PATTERN.match(run_id):
        raise ValueError(f"column 'run_id': not a usable run id ({run_id!r})")
    gpu = CSV_GPUS.get((raw.get("gpu") or "").strip())
    if gpu is None:
        raise ValueError(f"column 'gpu': {raw.get('gpu')!r} is not one of {', '.join(CSV_GPUS)}")
    for key in ("harness", "model", "problem"):
        if not (raw.get(key) or "").strip():
            raise ValueError(f"column {key!r}: empty")
    correct = _flag(raw, "correct")
    score = _number(raw, "score")
    ctx = [_number(raw, f"ctx{c}") for c in CONTEXTS]
    if correct and not (score and score > 0):
        raise ValueError(f"column 'score': a correct row needs a positive speedup, got {raw.get('score')!r}")
    if not correct and score is not None:
        raise ValueError(f"column 'score': a row that is not correct carries no score, got {score!r}")
    speedups = tuple(ctx) if all(v is not None and v > 0 for v in ctx) else None
    if correct and speedups is None:
        raise ValueError("columns ctx2048/ctx8192/ctx16384: a correct row needs three positive speedups")
    return MegaRow(line, gpu, raw["harness"].strip(), raw["model"].strip(), raw["problem"].strip(), correct, score,
                   _number(raw, "tok_s"), _number(raw, "elapsed_s"), _number(raw, "output_tokens", int),
                   speedups, (raw.get("framework") or "").strip(), _number(raw, "kernels", int),
                   (raw.get("megakernel") or "").strip(), _flag(raw, "megakernel_judged"), run_id)


def read_rows(path: Path) -> tuple[list[MegaRow], list[str]]:
    """Every parsed row of results.csv, and one line per row that does not parse."""
    text = path.read_text(encoding="utf-8")
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise DataError([f"{path}: header lacks {', '.join(missing)} (expected {','.join(COLUMNS)})"])
    rows, bad = [], []
    for raw in reader:
        line = reader.line_num
        try:
            rows.append(parse_row(raw, line))
        except ValueError as exc:
            bad.append(f"{path}:{line}: {(raw.get('run_id') or '?').strip()}: {exc}; not imported")
    return rows, bad


@dataclass
class MegaReport:
    rows: int = 0
    passes: int = 0
    per_gpu: dict[str, int] = field(default_factory=dict)
    submissions: int = 0
    kernels_without_result: int = 0
    unrecoverable: int = 0
    annotations: int = 0
    skipped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        gpus = ", ".join(f"{g} {n}" for g, n in sorted(self.per_gpu.items()))
        return (f"{self.rows} result rows imported ({gpus}; {self.passes} passes), {self.submissions} kernels "
                f"({self.kernels_without_result} without a result row, {self.unrecoverable} not recoverable), "
                f"{self.annotations} annotations, {len(self.warnings)} warnings, {len(self.skipped)} skipped")


def import_mega(root: Path, *, data_dir: Path, decks_dir: Path | None = None, repo: str | None = DEFAULT_REPO,
                revision: str | None = None, traces_dataset: str | None = None) -> MegaReport:
    """Read the source under `root` and write rows, submissions and annotations under `data_dir`.

    Raises DataError (one line each) when the bench has no deck here or the source has no results.csv.
    """
    if decks_dir is not None and not (decks_dir / BENCH).is_dir():
        raise DataError([f"{root}: the Mega results are not imported: kernelboard has no {BENCH!r} deck "
                         f"({decks_dir / BENCH} does not exist)"])
    csv_path = root / RESULTS_CSV
    if not csv_path.is_file():
        raise DataError([f"{root}: no {RESULTS_CSV}: not a checkout of kernelbench.com with Mega results"])
    prov = Provenance(root, repo, revision or git_revision(root))
    report = MegaReport()
    if prov.revision is None:
        report.warnings.append(f"{root}: not a git checkout and no --revision given: sources are recorded "
                               "without the commit they were read at")
    rows, report.skipped = read_rows(csv_path)
    code = _published_code(root / CODE_DIR, report)
    problems: dict[str, Problem | None] = {}
    tables: dict[str, dict[str, list[dict[str, Any]]]] = {}
    imported: set[str] = set()
    seen: set[str] = set()
    for row in rows:
        if row.run_id in seen:
            report.skipped.append(f"{csv_path}:{row.line}: {row.run_id}: a second row for this run id; not imported")
            continue
        seen.add(row.run_id)
        problem = _problem(row.problem, decks_dir, problems)
        if problem is False:
            report.skipped.append(f"{csv_path}:{row.line}: {row.run_id}: problem {row.problem!r} has no deck folder "
                                  f"{decks_dir / BENCH / row.problem if decks_dir else ''}; not imported")
            continue
        files, meta = _submission(row.run_id, code, report, {
            "problem": row.problem, "model": model_slug(row.model), "model_display": row.model,
            "lab": lab_of(row.model), "harness": row.harness, "gpu": row.gpu, "agent_outcome": "completed",
            "trace_url": _trace(row, traces_dataset), "started_at": _start(row.run_id).isoformat(),
            "agent_seconds": row.elapsed_s, "output_tokens": row.output_tokens or None,
        }, prov, [csv_path])
        folder = data_dir / "submissions" / BENCH / row.run_id
        sync_folder(folder, {"run.yaml": dump_yaml(meta), **files})
        per = tables.setdefault(row.gpu, {"runs": [], "results": [], "shapes": []})
        per["runs"].append(Submission(row.run_id, folder, meta).run_row(BENCH))
        result, shapes = _result(row, problem or None)
        per["results"].append(result)
        per["shapes"] += shapes
        imported.add(row.run_id)
        report.rows += 1
        report.passes += result["status"] == "pass"
        report.per_gpu[row.gpu] = report.per_gpu.get(row.gpu, 0) + 1
    for run_id in sorted(set(code) - imported):
        _kernel_only(run_id, code, data_dir, decks_dir, problems, prov, root, report, imported,
                     {row.model for row in rows})
    for gpu, per in sorted(tables.items()):
        write_rows(data_dir / "results", gpu, per, GPUS.get(gpu))
    report.annotations = _annotations(root / ANNOTATIONS_DIR, data_dir / "annotations", prov, imported, report)
    return report


def _problem(name: str, decks_dir: Path | None, cache: dict[str, Problem | None]) -> Problem | bool | None:
    """The deck's problem; None without a decks folder to check; False when the deck has no such problem."""
    if decks_dir is None:
        return None
    if name not in cache:
        folder = decks_dir / BENCH / name
        cache[name] = load_problem(folder) if folder.is_dir() else None
    return cache[name] if cache[name] is not None else False


def _published_code(folder: Path, report: MegaReport) -> dict[str, Path]:
    """run_id -> its published kernel file; the source's own reference and baseline are not submissions."""
    code: dict[str, Path] = {}
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        run_id = path.name.removesuffix(CODE_SUFFIX)
        if path.name.endswith(CODE_SUFFIX) and RUN_ID_PATTERN.match(run_id) and run_id[:8].isdigit():
            code[run_id] = path
        else:
            report.skipped.append(f"{path}: the source's own problem file, not a run's kernel; not imported "
                                  "(kernelboard's deck has its own reference and baseline)")
    return code


def _submission(run_id: str, code: dict[str, Path], report: MegaReport, meta: dict[str, Any], prov: Provenance,
                read: list[Path]) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The submission's files and its run.yaml (a kernel that cannot be split is `solution_unrecoverable`)."""
    files: dict[str, bytes] = {}
    path = code.get(run_id)
    if path is not None:
        split, why = split_published(path.read_text(encoding="utf-8", errors="replace"))
        if why:
            meta.update(agent_outcome="solution_unrecoverable", outcome_note=why)
            report.unrecoverable += 1
        files = {k: v.encode() for k, v in split.items()} if not why else {}
        report.submissions += bool(files)
        read = [*read, path]
    else:
        report.warnings.append(f"{run_id}: the source publishes a result but no kernel ({CODE_DIR}/{run_id}"
                               f"{CODE_SUFFIX} does not exist); imported with its run.yaml only")
    meta = {"run_id": run_id, **meta, "source": prov.source(read)}
    return files, {k: v for k, v in meta.items() if v is not None}


def _run_id_form(model: str) -> str:
    """How the source's harness writes a model name into a run id: every character but letters, digits, '.'
    and '-' as '_' ('kinetic-0715[1m]' -> 'kinetic-0715_1m_', 'anthropic/claude-fable-5' -> 'anthropic_claude-…')."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", model)


def _kernel_only(run_id: str, code: dict[str, Path], data_dir: Path, decks_dir: Path | None,
                 problems: dict[str, Problem | None], prov: Provenance, root: Path, report: MegaReport,
                 imported: set[str], models: set[str]) -> None:
    """A published kernel without a CSV row: its submission folder (run.yaml from its id and audit). Its model
    is its audit's, else the CSV's model whose run-id form its id names (so kinetic-0715_1m_'s kernel is
    kinetic-0715[1m]'s, the model of its other runs), else the name as its id writes it."""
    path = code[run_id]
    audit = _read_yaml(root / ANNOTATIONS_DIR / f"{run_id}.yaml")
    parts = split_run_id(run_id, str(audit.get("model") or "") or None)
    if parts is None:
        report.skipped.append(f"{path}: {run_id}: the run id does not name harness, model and problem; not imported")
        return
    if _problem(parts.problem, decks_dir, problems) is False:
        report.skipped.append(f"{path}: {run_id}: problem {parts.problem!r} has no deck folder (the source removed "
                              "it from its board too); not imported")
        return
    model = str(audit.get("model") or next((m for m in sorted(models) if _run_id_form(m) == parts.model),
                                            parts.model))
    gpu = {"RTX_PRO_6000": "rtx-pro-6000", **CSV_GPUS}.get(str(audit.get("gpu") or ""))
    files, meta = _submission(run_id, code, report, {
        "problem": parts.problem, "model": model_slug(model), "model_display": model, "lab": lab_of(model),
        "harness": str(audit.get("harness") or parts.harness), "gpu": gpu, "agent_outcome": "completed",
        "outcome_note": "KernelBench-Mega publishes this kernel but no results.csv row for it",
        "started_at": _start(run_id).isoformat(),
    }, prov, [])
    sync_folder(data_dir / "submissions" / BENCH / run_id, {"run.yaml": dump_yaml(meta), **files})
    report.kernels_without_result += 1
    imported.add(run_id)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _start(run_id: str) -> dt.datetime:
    """When the run started, as its id says, in the clock of kernelbench.com's runner (RUNNER_UTC_OFFSET)."""
    return dt.datetime.strptime(run_id[:15], "%Y%m%d_%H%M%S").replace(tzinfo=dt.timezone(RUNNER_UTC_OFFSET))


def _trace(row: MegaRow, dataset: str | None) -> str | None:
    if dataset is None:
        return None
    board = {"h100-pcie": "h100/", "b200": "b200/"}.get(row.gpu, "")
    return f"https://huggingface.co/datasets/{dataset}/blob/main/{board}{row.run_id}.jsonl"


def _mega_notes(row: MegaRow) -> str:
    parts = [f"framework {row.framework or 'not recorded'}"]
    if row.kernels is not None:
        parts.append(f"{row.kernels} custom kernels")
    judged = "judged" if row.megakernel_judged else "provisional"
    parts.append(f"megakernel {row.megakernel or 'not recorded'} ({judged})")
    return ", ".join(parts)


def _result(row: MegaRow, problem: Problem | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    start = _start(row.run_id)
    graded = start + dt.timedelta(seconds=row.elapsed_s or 0)
    result: dict[str, Any] = {
        "run_id": row.run_id, "gpu": row.gpu, "n_shapes": 0, "timer": "cuda_event",
        "device_name": GPUS[row.gpu].name, "graded_at": graded, "grader_version": GRADER_VERSION,
        "measured_by": MEASURED_BY,
    }
    if not row.correct:
        result.update(status="wrong", message=(
            f"KernelBench-Mega (results.csv): correct false — check.py failed (wrong output, build and run-time "
            f"errors are not told apart); {_mega_notes(row)}"))
        return result, []
    if row.score is None or row.ctx_speedups is None:  # parse_row refuses such a row; kept for the types
        raise ValueError(f"{row.run_id}: a correct row without its speedups")
    per_ctx = ", ".join(f"{s:.2f}× at {c}" for s, c in zip(row.ctx_speedups, CONTEXTS, strict=True))
    tok = f", {row.tok_s:g} tok/s at best" if row.tok_s else ""
    result.update(status="pass", n_shapes=len(CONTEXTS), speedup_vs_baseline=row.score,
                  baseline_variant=BASELINE_VARIANT, message=(
        f"KernelBench-Mega pass at {row.score:.3f}× its optimised-PyTorch baseline.py (its score: geomean of "
        f"{per_ctx}{tok}; {TIMING}); {_mega_notes(row)}. Not a speedup over torch.compile"))
    shapes = []
    for i, (ctx, speedup) in enumerate(zip(CONTEXTS, row.ctx_speedups, strict=True)):
        deck = problem.shapes if problem else ()
        params = next((s.params for s in deck if s.params.get("context_len") == ctx), {"context_len": ctx})
        shapes.append({
            "run_id": row.run_id, "gpu": row.gpu, "shape_idx": i, "shape_label": f"context {ctx}",
            "shape_json": json.dumps(params, sort_keys=True),
            "bound": problem.regime if problem else None,
            "speedup_vs_baseline": speedup,
            "note": f"imported from KernelBench-Mega: {speedup:.2f}× its baseline.py at context {ctx} "
                    "(no times published)",
        })
    return result, shapes


def _annotations(folder: Path, out: Path, prov: Provenance, imported: set[str], report: MegaReport) -> int:
    """The source's audits of imported runs; its `megakernel_authentic: false` is our flagging verdict
    `megakernel_not_authentic` (the source invalidates such cells), its own verdict kept under extra."""
    written = 0
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        meta = _read_yaml(path)
        run_id = path.stem
        if not meta or not RUN_ID_PATTERN.match(run_id):
            report.skipped.append(f"{path}: not an annotation mapping named by a run id; not imported")
            continue
        if run_id not in imported:
            report.skipped.append(f"{path}: {run_id}: no imported run (no results.csv row, no published kernel, or "
                                  "a problem without a deck); not imported")
            continue
        verdict = {"contaminated": "contamination"}.get(meta.get("verdict"), meta.get("verdict"))
        extra = {k: v for k, v in meta.items() if k not in ("run_id", "verdict", "summary", "quotes", "implication",
                                                            "auditor", "model", "harness", "effort", "problem", "gpu")}
        if meta.get("megakernel_authentic") is False and verdict != "megakernel_not_authentic":
            extra["source_verdict"] = verdict
            verdict = "megakernel_not_authentic"
        summary = meta.get("summary") if isinstance(meta.get("summary"), str) and meta["summary"].strip() else (
            f"KernelBench-Mega's audit gives the verdict '{verdict}' without a summary.")
        core = {"run_id": run_id, "verdict": verdict, "summary": summary,
                "quotes": [_quote(q) for q in meta.get("quotes") or [] if isinstance(q, dict)],
                **{k: str(meta[k]) for k in ("implication", "auditor", "model", "harness", "effort", "problem", "gpu")
                   if meta.get(k) not in (None, "")},
                "source": prov.source([path]), **({"extra": extra} if extra else {})}
        try:
            write_annotation(out, core)
            written += 1
        except DataError as exc:
            report.skipped.append(f"{path}: {'; '.join(exc.problems)}")
    return written


def _quote(q: dict[str, Any]) -> dict[str, Any]:
    """A quote as our schema holds it: 1-based line ranges only (the source writes [0, 0] for 'no line')."""
    out: dict[str, Any] = {"file": str(q.get("file", "solution.py")), "text": str(q.get("text", ""))}
    if q.get("label") is not None:
        out["label"] = str(q["label"])
    lines = q.get("lines")
    if isinstance(lines, list) and 1 <= len(lines) <= 2 and all(isinstance(n, int) and n >= 1 for n in lines):
        out["lines"] = sorted(lines)
    return out

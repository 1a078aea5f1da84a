"""`kernelboard import kbh PATH`: KernelBench-Hard's published boards into our tables, marked as imported.

Each run the source publishes — every cell of its leaderboards and every run detail beside them —
becomes a runs row and a results row under `data/results/<gpu>/` with `measured_by`
"KernelBench-Hard (imported)" and `grader_version` "kbh", and its kernel a submission folder
(`solution.py` plus the sidecars the published text appends under banners, split back exactly), so
`kernelboard eval` can regrade it. `runs.source` names every file a row was read from, at the
source's commit (`github:OWNER/NAME@COMMIT:path;path`).

The verdict is the source's (`STATUS`, from its `failure_reason`; a value we do not know is kept,
with a warning, and judged by the source's `correct`). A pass keeps its score as the source gave it,
the fraction of the roofline it ranks on, and carries speedups only where they can be derived, never
invented: per shape from the root board's per-shape baselines, else as geomean ms ÷ geomean ms when
`problem_baselines` covers the same shapes; otherwise the row says why no speedup is shown. A run the
source graded but keeps off its board (graded on other hardware, not in its allowlist, superseded)
is imported with `off_board` saying so, and never takes a board cell.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelboard.errors import DataError
from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.hardware import GPUS
from kernelboard.eval.roofline import geomean
from kernelboard.eval.schema import IMPORTED_SUFFIX
from kernelboard.eval.submission import RUN_ID_PATTERN, Submission

from ._files import dump_yaml, sync_folder
from .annotations import FLAG_VERDICTS, VERDICTS, write_annotation
from .kbh_read import KbhInstall, KbhRun, read_install
from .kbh_tables import write_rows
from .naming import RUNNER_UTC_OFFSET, lab_of, model_slug, split_run_id
from .recover import SOLUTION, names_file

MEASURED_BY = f"KernelBench-Hard {IMPORTED_SUFFIX}"
GRADER_VERSION = "kbh"
#: KernelBench-Hard timed its compiled baseline with torch.compile(mode="reduce-overhead").
COMPILE_VARIANT = "compile:reduce-overhead"
#: The public repository kernelbench.com is built from (MIT).
DEFAULT_REPO = "Infatoshi/kernelbench.com"

#: The most GPU time, in whole seconds as the run detail rounds it, that a run's GPU-lock log may record over
#: all its commands (the agent's and the check's together) for the check to have run no kernel: check.py
#: imports torch and initialises CUDA before its first call, which takes longer. KernelBench-Hard's harness
#: wraps python, uv and nvcc in that lock (its AGENTS.md), and its run detail sums the `elapsed_s` of every
#: `end` line and rounds (scripts/build_run_detail.py); the same sweep's annotation of one such run
#: (20260719_030522 grok-4.5 01) says why: "fresh .venv on the box had no torch".
NO_KERNEL_GPU_SECONDS = 1
#: What a failing row's message says when its run's GPU-lock log shows the check never ran a kernel; the
#: agreement table reads it (sitegen/agreement.py): such a published failure is no verdict on the kernel.
RAN_NO_KERNEL = "its check ran no kernel"

#: A failing row's message where its check ran past KernelBench-Hard's check timeout (failure_reason
#: check_timeout; 180 s in the kinetic-0715 01 run of 2026-07-16, which its operator regraded with 1800 s to a
#: pass, its annotation says). Its own classifier marks a check timeout a retryable infrastructure failure
#: (`retryable_infra_failure`, src/harness/classification.py), though its board counts the run not correct:
#: the agreement table reads it as no verdict on the kernel (sitegen/agreement.py).
CHECK_TIMED_OUT = "check.py timed out"

#: failure_reason -> (agent outcome; None: completed, or no_solution without one), status (None: the
#: source's `correct` decides), message.
STATUS: dict[str, tuple[str | None, str | None, str]] = {
    "pass": (None, "pass", "passed check.py"),
    "incorrect": (None, "wrong", "check.py: the output is incorrect"),
    "audit_empirical_failed": (None, "wrong", "failed the audit's empirical recompute test (correct: false)"),
    "benchmark_timeout": (None, "timeout", "correct, but benchmark.py timed out"),
    "benchmark_failed": (None, "runtime_error", "correct, but benchmark.py failed"),
    "template_mutated": (None, "integrity_violation", "the run changed the problem's files"),
    "provider_insufficient_credits": ("credits_exhausted", "dnf", "provider credits exhausted"),
    "provider_rate_limited": ("rate_limited", "dnf", "provider rate limit"),
    "provider_unavailable": ("provider_unavailable", "dnf", "provider unavailable"),
    "harness_error": ("harness_error", "dnf", "harness error"),
    "timeout": ("agent_timeout", None, "the agent ran out of time"),
    "incomplete_session": ("early_stop", None, "the session ended early"),
    "provider_early_stop": ("early_stop", None, "the agent stopped early"),
    "no_solution": ("no_solution", "not_graded", "the agent wrote no solution"),
    "check_timeout": (None, "timeout", CHECK_TIMED_OUT),
    "check_failed": (None, "wrong", "check.py failed (build and import errors are not told apart)"),
}

#: The banners kernelbench.com's publisher (scripts/kernel_sidecars.py) puts between solution.py and
#: each sidecar it appends, or where it could not append one.
_RULE = "# " + "=" * 66
_BANNER = re.compile(
    r"\n\n" + re.escape(_RULE) + r"\n# (?:"
    r"===== sidecar: (?P<name>\S+) \((?P<size>\d+) bytes, loaded by solution\.py\) =====\n" + re.escape(_RULE) + r"\n\n"
    r"|WARNING: solution loads sidecar '(?P<missing>[^']+)' but it was not found in the run archive\.\n"
    + re.escape(_RULE) + r"\n"
    r"|sidecar '(?P<capped>[^']+)' omitted: size cap reached\n" + re.escape(_RULE) + r"\n)")


@dataclass
class KbhReport:
    runs: int = 0
    passes: int = 0
    without_speedup: int = 0
    off_board: int = 0
    submissions: int = 0
    unrecoverable: int = 0
    annotations: int = 0
    skipped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.runs} runs imported ({self.passes} passes, {self.without_speedup} of them without a "
                f"derivable speedup; {self.off_board} off the source's boards), {self.submissions} kernels "
                f"({self.unrecoverable} not recoverable), {self.annotations} annotations, "
                f"{len(self.warnings)} warnings, {len(self.skipped)} skipped")


@dataclass(frozen=True)
class Provenance:
    """Where the rows come from: a repository at a commit, or a folder without one."""

    root: Path
    repo: str | None
    revision: str | None

    def source(self, files: list[Path]) -> str:
        paths = ";".join(dict.fromkeys(f.relative_to(self.root).as_posix() for f in files))
        return f"github:{self.repo}@{self.revision}:{paths}" if self.repo and self.revision else f"kbh:{paths}"


def git_revision(root: Path) -> str | None:
    """The commit the checkout at `root` is at, or None when it is not a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=False)
    except OSError:
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else None


def import_kbh(root: Path, *, data_dir: Path, bench: str = "hard", decks_dir: Path | None = None,
               traces_dataset: str | None = None, repo: str | None = DEFAULT_REPO,
               revision: str | None = None) -> KbhReport:
    """Read the source under `root` and write rows, submissions and annotations under `data_dir`.

    Raises DataError (one line) when the bench has no deck here or the folder holds no results.
    """
    if decks_dir is not None and not (decks_dir / bench).is_dir():
        raise DataError([f"{root}: the {bench!r} results are not imported: kernelboard has no {bench!r} deck "
                         f"({decks_dir / bench} does not exist), so its runs could not be graded or shown"])
    install = read_install(root, bench)
    if not install.runs:
        seen = f" (it holds results of {', '.join(sorted(install.other_benches))})" if install.other_benches else ""
        raise DataError([f"{root}: no KernelBench-Hard {bench!r} results found{seen}: expected "
                         "results/leaderboard*.json, rundetail/ or outputs/runs*/result.json"])
    prov = Provenance(root, repo, revision or git_revision(root))
    report = KbhReport(skipped=list(install.skipped))
    if install.other_benches:
        report.skipped.append(f"{root}: results of other benches ({', '.join(sorted(install.other_benches))}) are "
                              f"not read by --bench {bench}; each needs its own deck in kernelboard first")
    if prov.revision is None:
        report.warnings.append(f"{root}: not a git checkout and no --revision given: sources are recorded "
                               "without the commit they were read at")
    problems: dict[str, Problem] = {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    imported: set[str] = set()
    boards: dict[str, list[str]] = {}
    for gpu, run_id in sorted(install.runs, key=lambda k: (install.runs[k].cell is None, k)):
        boards.setdefault(run_id, []).append(gpu)
    for (gpu, run_id), run in sorted(install.runs.items()):
        if boards[run_id][0] != gpu:  # the same run id names another session on another board
            run.run_id = run_id = f"{run_id}-{gpu}"
        where = run.files[0] if run.files else root
        try:
            meta = _meta(run, bench, traces_dataset, report)
        except ValueError as exc:
            report.skipped.append(f"{where}: {run_id}: {exc}")
            continue
        deck = decks_dir / bench / meta["problem"] if decks_dir else None
        if deck is not None and not deck.is_dir():
            report.skipped.append(f"{where}: {run_id}: problem {meta['problem']!r} has no deck folder {deck}; "
                                  "not imported")
            continue
        if deck is not None and meta["problem"] not in problems:
            problems[meta["problem"]] = load_problem(deck)
        files, unrecoverable = _kernel_files(run)
        if unrecoverable:
            meta.update(agent_outcome="solution_unrecoverable", outcome_note=unrecoverable)
            report.unrecoverable += 1
        meta["source"] = prov.source(run.files)
        folder = data_dir / "submissions" / bench / run_id
        if files or run.run_dir is not None or run.published_solution is not None:
            sync_folder(folder, {"run.yaml": dump_yaml(meta), **files})
            report.submissions += bool(files)
        run_row = Submission(run_id, folder if files else root / ".no-folder", meta).run_row(bench)
        result, shapes = _result(run, meta, problems.get(meta["problem"]), install)
        result["off_board"] = _off_board(run, install, meta)
        report.runs += 1
        report.passes += result["status"] == "pass"
        report.without_speedup += result["status"] == "pass" and result.get("speedup_vs_compile") is None
        report.off_board += result["off_board"] is not None
        imported.add(run_id)
        per = rows.setdefault(gpu, {"runs": [], "results": [], "shapes": []})
        per["runs"].append(run_row)
        per["results"].append(result)
        per["shapes"] += shapes
    for gpu, tables in sorted(rows.items()):
        write_rows(data_dir / "results", gpu, tables, GPUS.get(gpu))
    report.annotations = _annotations(install, data_dir / "annotations", prov, imported, report)
    return report


def _reason(run: KbhRun) -> tuple[str, str]:
    """(failure reason, where it was read)."""
    for source, name in ((run.result, "result.json"), (run.detail, "run detail"), (run.cell, "leaderboard")):
        if source and isinstance(source.get("failure_reason"), str) and source["failure_reason"]:
            return source["failure_reason"], name
    correct = _correct(run)
    if correct is True:
        return "pass", "correct: true"
    if not _has_solution(run):
        return "no_solution", "has_solution: false"
    return ("check_failed", "correct: false") if correct is False else ("", "")


def _correct(run: KbhRun) -> bool | None:
    """The source's verdict: the board cell's `correct`, else the run detail's (result.json's)."""
    for record in (run.cell, run.detail, run.result):
        if record and isinstance(record.get("correct"), bool):
            return record["correct"]
    return None


def _meta(run: KbhRun, bench: str, traces_dataset: str | None, report: KbhReport) -> dict[str, Any]:
    """run.yaml for the run (what the runs row is made from)."""
    if not RUN_ID_PATTERN.match(run.run_id):
        raise ValueError("not a usable run id")
    res, det, cell, block = run.result or {}, run.detail or {}, run.cell or {}, run.block or {}
    model = res.get("model") or block.get("model") or det.get("model")
    parts = split_run_id(run.run_id, model)
    problem = res.get("problem") or cell.get("problem") or det.get("problem") or (parts and parts.problem)
    harness = res.get("harness") or block.get("harness") or det.get("harness") or (parts and parts.harness)
    model = model or (parts and parts.model)
    if not (problem and harness and model):
        raise ValueError("problem, harness or model is not recorded")
    reason, _ = _reason(run)
    if not reason:
        raise ValueError("no outcome recorded (no failure_reason and no correct flag)")
    if reason not in STATUS:
        report.warnings.append(f"{run.files[0] if run.files else run.run_id}: {run.run_id}: failure_reason "
                               f"{reason!r} is not one kernelboard knows; imported as the source's correct "
                               f"({_correct(run)}) says, with the raw value in its message")
    outcome = STATUS.get(reason, (None,))[0] or ("completed" if _has_solution(run) else "no_solution")
    usage, stats = res.get("usage") or {}, det.get("stats") or {}
    tokens = {k: usage.get(k, stats.get(k)) for k in ("input_tokens", "output_tokens", "cache_read_tokens")}
    tokens["output_tokens"] = tokens["output_tokens"] or cell.get("output_tokens")
    if not tokens["input_tokens"]:  # KernelBench-Hard writes 0 where it did not record input tokens
        tokens["input_tokens"] = None
    effort = res.get("reasoning_effort", block.get("effort")) or None
    trace = run.trace_url or (_dataset_trace(run, traces_dataset) if traces_dataset else None)
    meta = {
        "run_id": run.run_id, "problem": problem, "model": model_slug(model), "model_display": model,
        "lab": lab_of(model), "harness": harness, "effort": effort, "gpu": run.gpu, "agent_outcome": outcome,
        "outcome_note": f"KernelBench-Hard: {reason}" if outcome != "completed" else None,
        "trace_url": trace, "started_at": res.get("started_at") or _run_id_start(run.run_id).isoformat(),
        "agent_seconds": res.get("elapsed_seconds", stats.get("agent_s", cell.get("elapsed_seconds"))),
        **tokens,
        "cost_usd": usage.get("total_cost_usd", stats.get("cost_usd")),
    }
    return {k: v for k, v in meta.items() if v is not None}


def _run_id_start(run_id: str) -> dt.datetime:
    """When the run started, as its id says, in the runner's clock (see RUNNER_UTC_OFFSET)."""
    return dt.datetime.strptime(run_id[:15], "%Y%m%d_%H%M%S").replace(tzinfo=dt.timezone(RUNNER_UTC_OFFSET))


def _dataset_trace(run: KbhRun, dataset: str) -> str:
    board = {"h100-pcie": "h100/", "b200": "b200/"}.get(run.gpu, "")
    return f"https://huggingface.co/datasets/{dataset}/blob/main/{board}{run.run_id.removesuffix('-' + run.gpu)}.jsonl"


def _has_solution(run: KbhRun) -> bool:
    record = run.result or run.detail or run.cell or {}
    return bool(record.get("has_solution", record.get("has_solution_text", True)))


def split_published(text: str) -> tuple[dict[str, str], str | None]:
    """solution.py and its sidecars from a published `_solution.py.txt`, exactly; or the reason they
    cannot be (a sidecar the publisher could not find or left out, a size that does not match)."""
    marks = list(_BANNER.finditer(text))
    files = {SOLUTION: text[: marks[0].start()] if marks else text}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        if mark.group("missing") or mark.group("capped"):
            name = mark.group("missing") or mark.group("capped")
            why = "was not in the run's archive" if mark.group("missing") else "was left out at the size cap"
            return {}, f"the published kernel loads sidecar {name!r}, which {why}; not regradable from kernelbench.com"
        name, body = mark.group("name"), text[mark.end():end]
        if name.startswith(("/", ".")) or ".." in name.split("/") or name in files:
            return {}, f"the published kernel appends a sidecar named {name!r}, not a safe file name"
        if len(body) != int(mark.group("size")):
            return {}, (f"the published sidecar {name!r} has {len(body)} characters where its banner says "
                        f"{mark.group('size')}; not split with certainty")
        files[name] = body
    return files, None


def _kernel_files(run: KbhRun) -> tuple[dict[str, bytes], str | None]:
    """The submission's files (kernel and sidecars), or why the kernel cannot be recovered."""
    if run.published_solution is not None:
        text = run.published_solution.read_text(encoding="utf-8", errors="replace")
        files, why = split_published(text)
        return {k: v.encode() for k, v in files.items()}, why
    if run.run_dir is not None:
        return _solution(run.run_dir), None
    return {}, None


def _solution(run_dir: Path) -> dict[str, bytes]:
    """solution.py of an installation's run folder and the files beside it that it names."""
    path = run_dir / SOLUTION
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8", errors="replace")
    files = {SOLUTION: path.read_bytes()}
    for other in sorted(p for p in run_dir.iterdir() if p.is_file() and p.suffix in (".cu", ".cuh", ".cpp", ".h",
                                                                                    ".hpp", ".py")):
        if other.name not in (SOLUTION, "check.py", "benchmark.py", "reference.py", "shapes.py") and \
                names_file(text, other.name):
            files[other.name] = other.read_bytes()
    return files


def _lock_evidence(run: KbhRun, status: str) -> str:
    """For a failed check whose run's GPU-lock log shows no command held the GPU long enough to import
    torch (NO_KERNEL_GPU_SECONDS), what the log says: the failure was the environment's, not the kernel's."""
    lock = (run.detail or {}).get("gpu_lock")
    if status in ("pass", "not_graded", "dnf") or not _has_solution(run) or not isinstance(lock, dict):
        return ""
    held, commands = lock.get("active_s"), lock.get("acquisitions")
    if not (isinstance(held, int | float) and isinstance(commands, int) and commands >= 1
            and held <= NO_KERNEL_GPU_SECONDS):
        return ""
    return (f"; {RAN_NO_KERNEL}: its run's GPU-lock log has {commands} commands (the session's and the "
            f"check's) holding the GPU {held:g} s in all, too little for check.py to import torch")


def _board_name(run: KbhRun) -> str:
    """The GPU the source's board names, else our datasheet name for its key."""
    return run.board_name or (GPUS[run.gpu].name if run.gpu in GPUS else run.gpu)


def _off_board(run: KbhRun, install: KbhInstall, meta: dict[str, Any]) -> str | None:
    """Why the source keeps this graded run off its board, or None when it is a board cell."""
    note = (install.annotations.get(run.run_id.removesuffix("-" + run.gpu)) or (None, None))[1]
    if isinstance(note, dict) and note.get("board_eligible") is False:
        where = f" on an {note['gpu']}" if note.get("gpu") else ""
        return (f"KernelBench-Hard's audit marks this run board_eligible: false (graded{where}, not the board's "
                f"{_board_name(run)}; "
                f"{note.get('measurement_status') or 'not a board measurement'})")
    if run.cell is not None or run.gpu not in install.boards:
        return None
    allow = install.allowlists.get(run.gpu)
    why = [f"not in its allowlist ({allow[0].name})"] if allow is not None and run.run_id not in allow[1] else []
    shown = sorted(r.run_id for r in install.runs.values() if r.gpu == run.gpu and r.cell is not None
                   and (r.block or {}).get("model") == meta["model_display"] and r.cell["problem"] == meta["problem"])
    why += [f"the board shows run {shown[0]} for this model and problem"] if shown else []
    return f"not on KernelBench-Hard's published board ({'; '.join(why or ['its leaderboard has no cell for it'])})"


def _shape_match(labels: list[str], problem: Problem | None) -> list[str] | None:
    """The deck's shape parameters (JSON) per detail shape, when the labels name the deck's shapes in order."""
    if problem is None or len(problem.shapes) != len(labels):
        return None
    out = []
    for label, shape in zip(labels, problem.shapes, strict=True):
        numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", label)]
        if numbers != [float(v) for v in shape.params.values()]:
            return None
        out.append(json.dumps(shape.params, sort_keys=True))
    return out


def _positive(values: list[Any]) -> bool:
    return bool(values) and all(isinstance(v, int | float) and v > 0 for v in values)


def _headline_fraction(run: KbhRun, shapes: list[dict[str, Any]]) -> float | None:
    """The source's score: the board cell's peak fraction, else the run detail's, else its shapes' geomean."""
    for record in (run.cell, run.detail, run.result):
        value = (record or {}).get("peak_fraction")
        if isinstance(value, int | float) and value > 0:
            return float(value)
    fracs = [s.get("frac") for s in shapes]
    return geomean(fracs) if _positive(fracs) else None  # type: ignore[arg-type]


def _result(run: KbhRun, meta: dict[str, Any], problem: Problem | None,
            install: KbhInstall) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reason, where = _reason(run)
    _, status, said = STATUS.get(reason, (None, None, f"failure_reason {reason!r} (not a value kernelboard knows)"))
    correct = _correct(run)
    if status is None:
        status = "pass" if correct is True else "wrong" if correct is False and _has_solution(run) else "not_graded"
    message = f"KernelBench-Hard ({where}): {said}{_lock_evidence(run, status)}"
    row: dict[str, Any] = {
        "run_id": run.run_id, "gpu": run.gpu, "status": status, "message": message, "n_shapes": 0,
        "timer": "cuda_event", "device_name": _board_name(run),
        "graded_at": _graded_at(run), "grader_version": GRADER_VERSION, "measured_by": MEASURED_BY,
    }
    if status != "pass":
        return row, []
    shapes = [s for s in (run.detail or {}).get("shapes") or [] if isinstance(s, dict)]
    ms = [s.get("ms") for s in shapes]
    fraction = _headline_fraction(run, shapes)
    labels = [str(s.get("label", i)) for i, s in enumerate(shapes)]
    params = _shape_match(labels, problem) if _positive(ms) else None
    per_shape = _shape_baselines(install, run.gpu, meta["problem"], len(shapes))
    entry = install.baselines.get(run.gpu, {}).get(meta["problem"]) or {}
    eager, compiled = (entry.get(v) or {} for v in ("eager", "compiled"))
    why = None
    if not _positive(ms):
        why = "the run detail has no per-shape times"
    elif per_shape is None and not all(isinstance(b.get("ms"), int | float) and b.get("n_shapes") == len(shapes)
                                       for b in (eager, compiled)):
        covered = sorted({b.get("n_shapes") for b in (eager, compiled) if b}, key=str)
        why = (f"its baselines cover {', '.join(map(str, covered)) or 'no'} of the {len(shapes)} shapes "
               f"(problem_baselines)")
    shape_rows = [{
        "run_id": run.run_id, "gpu": run.gpu, "shape_idx": i, "shape_label": labels[i],
        "shape_json": params[i] if params else json.dumps({"label": labels[i]}, ensure_ascii=False),
        "median_ms": float(s["ms"]) if isinstance(s.get("ms"), int | float) and s["ms"] > 0 else None,
        "tflop_s": s.get("tflops"), "gb_s": s.get("gbps"), "compute_fraction": s.get("compute_util"),
        "memory_fraction": s.get("mem_util"), "peak_fraction": s.get("frac"),
        "bound": s.get("bound") if s.get("bound") in ("compute", "memory") else (problem.regime if problem else None),
    } for i, s in enumerate(shapes)]
    if why is not None:
        if fraction is None:
            row.update(message=f"KernelBench-Hard passed this run but published no score for it; no speedup "
                               f"is shown: {why}")
            return row, []
        row.update(peak_fraction=fraction, n_shapes=len(shape_rows), message=(
            f"KernelBench-Hard pass at {fraction:.2%} of the roofline (its score); no speedup is shown: {why}"))
        note = "imported from KernelBench-Hard: no baseline to derive a speedup from"
        return row, [{**r, "note": note} for r in shape_rows]
    sol = geomean(ms)  # type: ignore[arg-type]
    row.update(peak_fraction=fraction, n_shapes=len(shapes), compile_variant=COMPILE_VARIANT)
    if per_shape is not None:
        for r, c_ms, e_ms in zip(shape_rows, per_shape["compiled"], per_shape["eager"], strict=True):
            r.update(compile_ms=c_ms, eager_ms=e_ms, speedup_vs_compile=c_ms / r["median_ms"],
                     speedup_vs_eager=e_ms / r["median_ms"],
                     note="imported from KernelBench-Hard: per-shape baselines from results/raw_baselines")
        vs_compile = geomean([r["speedup_vs_compile"] for r in shape_rows])
        vs_eager = geomean([r["speedup_vs_eager"] for r in shape_rows])
        row.update(speedup_vs_compile=vs_compile, speedup_vs_eager=vs_eager, message=(
            f"KernelBench-Hard pass at {fraction or 0:.2%} of the roofline; speedup = geomean over {len(shapes)} "
            f"shapes of compiled ms ÷ solution ms = {vs_compile:.3f}× (eager {vs_eager:.3f}×); per-shape "
            "baselines from results/raw_baselines, solution ms from the run detail"))
        return row, shape_rows
    row.update(
        speedup_vs_compile=compiled["ms"] / sol, speedup_vs_eager=eager["ms"] / sol,
        message=f"KernelBench-Hard pass at {fraction or 0:.2%} of the roofline; speedup = compiled {compiled['ms']} "
                f"ms ÷ solution geomean {sol:.4g} ms over {len(shapes)} shapes = {compiled['ms'] / sol:.3f}× "
                f"(eager {eager['ms']} ms → {eager['ms'] / sol:.3f}×); geomeans from problem_baselines, "
                "per-shape ms from the run detail",
    )
    note = "imported from KernelBench-Hard: per-shape baselines are not published, only their geomeans"
    return row, [{**r, "note": note} for r in shape_rows]


def _shape_baselines(install: KbhInstall, gpu: str, problem: str, n_shapes: int) -> dict[str, list[float]] | None:
    """Per-shape eager and compiled ms for this board, when published for exactly these shapes and they
    reproduce the board's published geomeans (to the 4 digits those are rounded to)."""
    per = install.shape_baselines.get(gpu, {}).get(problem) or {}
    entry = install.baselines.get(gpu, {}).get(problem) or {}
    if not n_shapes or not all(len(per.get(v) or []) == n_shapes and _positive(per[v]) for v in ("eager", "compiled")):
        return None
    for variant in ("eager", "compiled"):
        published = (entry.get(variant) or {}).get("ms")
        if not isinstance(published, int | float) or abs(geomean(per[variant]) - published) > 5e-4 * published + 1e-4:
            return None
    return {v: per[v] for v in ("eager", "compiled")}


def _graded_at(run: KbhRun) -> dt.datetime:
    """When it was graded: the regrade's or the run's finish time; else the run id's stamp (in the
    runner's clock, RUNNER_UTC_OFFSET) plus the run detail's total seconds."""
    res = run.result or {}
    for value in ((res.get("regrade") or {}).get("at"), res.get("finished_at")):
        if isinstance(value, str):
            try:
                ts = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
                return ts if ts.tzinfo else ts.replace(tzinfo=dt.UTC)
            except ValueError:
                pass
    stats = (run.detail or {}).get("stats") or {}
    start = _run_id_start(run.run_id)
    total = stats.get("total_s")
    return start + dt.timedelta(seconds=total) if isinstance(total, int | float) and total > 0 else start


def _annotation_summary(meta: dict[str, Any]) -> str:
    """The source's summary, or the first prose field it wrote instead (some audits have no summary)."""
    for key in ("summary", "implication", "publication_note", "notes", "evidence", "reward_hack", "contamination"):
        value = meta.get(key)
        if isinstance(value, str) and value.strip():
            return value if key == "summary" else f"({key}) {value}"
    return f"KernelBench-Hard's audit gives the verdict '{meta.get('verdict')}' without a summary."


def _quote(q: dict[str, Any]) -> dict[str, Any]:
    """A quote as our schema holds it: 1-based line ranges only (the source writes [0] for 'no line')."""
    out = {k: q[k] for k in ("file", "label", "text") if k in q}
    lines = q.get("lines")
    if isinstance(lines, list) and 1 <= len(lines) <= 2 and all(isinstance(n, int) and n >= 1 for n in lines):
        out["lines"] = sorted(lines)
    if not isinstance(out.get("text"), str):
        out["text"] = str(out.get("text", ""))
    if not isinstance(out.get("file"), str):
        out["file"] = str(out.get("file", "solution.py"))
    return out


def _annotations(install: KbhInstall, folder: Path, prov: Provenance, imported: set[str],
                 report: KbhReport) -> int:
    written, orphans = 0, []
    seen = set()
    for run_id, (path, meta) in sorted(install.annotations.items()):
        if not isinstance(meta, dict) or not RUN_ID_PATTERN.match(run_id):
            report.skipped.append(f"{path}: not an annotation mapping named by a run id; skipped")
            continue
        if run_id not in imported:
            orphans.append(path)
            continue
        verdict = {"contaminated": "contamination"}.get(meta.get("verdict"), meta.get("verdict"))
        core = {"run_id": run_id, "verdict": verdict, "summary": _annotation_summary(meta),
                "quotes": [_quote(q) for q in meta.get("quotes") or [] if isinstance(q, dict)],
                **{k: str(meta[k]) for k in ("implication", "auditor", "model", "harness", "effort", "problem", "gpu")
                   if meta.get(k) not in (None, "")},
                "source": prov.source([path])}
        extra = {k: v for k, v in meta.items() if k not in core and k != "verdict"}
        try:
            write_annotation(folder, {**core, **({"extra": extra} if extra else {})})
            written += 1
            seen.add(run_id)
        except DataError as exc:
            report.skipped.append(f"{path}: {exc}")
    if orphans:
        flagging = sum(1 for p in orphans if isinstance(install.annotations[p.stem][1], dict)
                       and install.annotations[p.stem][1].get("verdict") in FLAG_VERDICTS)
        report.skipped.append(f"{orphans[0].parent}: {len(orphans)} annotations ({flagging} flagging) name runs "
                              "with no board cell and no run detail in the source (other problems, earlier "
                              "campaigns): no graded run to attach them to; not imported")
    for run in install.runs.values():  # verdicts the leaderboard carries without an annotation file
        verdict = (run.cell or {}).get("annotation_verdict")
        if verdict in VERDICTS and verdict != "clean" and run.run_id not in seen and run.run_id in imported:
            seen.add(run.run_id)
            written += 1
            write_annotation(folder, {
                "run_id": run.run_id, "verdict": verdict, "source": prov.source([run.files[0]]),
                "summary": f"The KernelBench-Hard leaderboard marks this run '{verdict}'"
                           + (f" (invalid: {run.cell['invalid_reason']})" if (run.cell or {}).get("invalid_reason")
                              else "") + "; no annotation file with the auditor's reasons was found."})
    return written

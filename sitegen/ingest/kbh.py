"""`kernelboard import kbh PATH`: a KernelBench-Hard board into our tables, marked as imported.

Each run becomes a runs row and a results row under `data/results/<gpu>/` with `measured_by`
"KernelBench-Hard (imported)" and `grader_version` "kbh", so a board can be republished as it
stands; where the installation keeps the run's folder (`result.json`, `solution.py`) a submission
folder is written too, so `kernelboard eval` can regrade it (which replaces the imported row).

Statuses follow KernelBench-Hard's `classify_run` (`STATUS`). A pass keeps its place only when
its speedups can be derived, never invented: the run detail's per-shape ms (one per deck shape,
the labels matching the deck's shapes) against `problem_baselines` eager and compiled geomean ms
over the same number of shapes, speedup = baseline geomean ms ÷ solution geomean ms, the
arithmetic written into the message. Otherwise the row is `not_graded` and says what was missing.
Per-shape speedups stay null: the baselines are published as geomeans only.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelboard.eval.deck import Problem, load_problem
from kernelboard.eval.hardware import GPUS
from kernelboard.eval.roofline import geomean
from kernelboard.eval.submission import RUN_ID_PATTERN, Submission

from ._files import dump_yaml, sync_folder
from .annotations import VERDICTS, write_annotation
from .kbh_read import KbhInstall, KbhRun, read_install
from .kbh_tables import write_rows
from .naming import ROOT_GPU, lab_of, model_slug, split_run_id
from .recover import SOLUTION, names_file

MEASURED_BY = "KernelBench-Hard (imported)"
GRADER_VERSION = "kbh"
#: KernelBench-Hard timed its compiled baseline with torch.compile(mode="reduce-overhead").
COMPILE_VARIANT = "compile:reduce-overhead"

#: failure_reason -> (agent outcome; None: completed, or no_solution without one), status (None: from the
#: solution), message.
STATUS: dict[str, tuple[str | None, str | None, str]] = {
    "pass": (None, "pass", "passed check.py"),
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
    "check_timeout": (None, "timeout", "check.py timed out"),
    "check_failed": (None, "wrong", "check.py failed (build and import errors are not told apart)"),
}


@dataclass
class KbhReport:
    runs: int = 0
    passes: int = 0
    not_derivable: int = 0
    submissions: int = 0
    annotations: int = 0
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.runs} runs imported ({self.passes} passes, {self.not_derivable} passes without derivable "
                f"speedups → not_graded), {self.submissions} submission folders, {self.annotations} annotations, "
                f"{len(self.skipped)} skipped")


def import_kbh(root: Path, *, data_dir: Path, bench: str = "hard", decks_dir: Path | None = None,
               traces_dataset: str | None = None) -> KbhReport:
    """Read the installation under `root` and write rows, submissions and annotations under `data_dir`."""
    install = read_install(root, bench)
    report = KbhReport(skipped=list(install.skipped))
    problems: dict[str, Problem] = {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    boards: dict[str, list[str]] = {}
    for gpu, run_id in sorted(install.runs, key=lambda k: (k[0] != ROOT_GPU, k)):
        boards.setdefault(run_id, []).append(gpu)
    for (gpu, run_id), run in sorted(install.runs.items()):
        if boards[run_id][0] != gpu:  # the same run id names another session on another board
            run.run_id = run_id = f"{run_id}-{gpu}"
        try:
            meta = _meta(run, root, bench, traces_dataset)
        except ValueError as exc:
            report.skipped.append(f"{run.files[0] if run.files else root}: {run_id}: {exc}")
            continue
        deck = decks_dir / bench / meta["problem"] if decks_dir else None
        if deck is not None and not deck.is_dir():
            report.skipped.append(f"{run.files[0]}: {run_id}: problem {meta['problem']!r} has no deck folder "
                                  f"{deck}; not imported")
            continue
        if deck is not None and meta["problem"] not in problems:
            problems[meta["problem"]] = load_problem(deck)
        folder = data_dir / "submissions" / bench / run_id
        if run.run_dir is not None:
            sync_folder(folder, {"run.yaml": dump_yaml(meta), **_solution(run.run_dir)})
            report.submissions += 1
        run_row = Submission(run_id, folder if run.run_dir else root / ".no-folder", meta).run_row(bench)
        result, shapes = _result(run, meta, problems.get(meta["problem"]), install.baselines.get(gpu, {}))
        report.runs += 1
        report.passes += result["status"] == "pass"
        report.not_derivable += result["status"] == "not_graded" and _reason(run)[0] == "pass"
        per = rows.setdefault(gpu, {"runs": [], "results": [], "shapes": []})
        per["runs"].append(run_row)
        per["results"].append(result)
        per["shapes"] += shapes
    for gpu, tables in sorted(rows.items()):
        write_rows(data_dir / "results", gpu, tables, GPUS.get(gpu))
    report.annotations = _annotations(install, data_dir / "annotations", root, report)
    return report


def _reason(run: KbhRun) -> tuple[str, str]:
    """(failure reason, where it was read)."""
    for source, name in ((run.result, "result.json"), (run.detail, "run detail"), (run.cell, "leaderboard")):
        if source and isinstance(source.get("failure_reason"), str) and source["failure_reason"]:
            return source["failure_reason"], name
    record = run.result or run.detail or run.cell or {}
    if record.get("correct") is True:
        return "pass", "correct: true"
    if record.get("has_solution") is False:
        return "no_solution", "has_solution: false"
    return ("check_failed", "correct: false") if record.get("correct") is False else ("", "")


def _meta(run: KbhRun, root: Path, bench: str, traces_dataset: str | None) -> dict[str, Any]:
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
    if reason not in STATUS:
        raise ValueError(f"unknown KernelBench-Hard outcome {reason!r}" if reason else "no outcome recorded")
    outcome = STATUS[reason][0] or ("completed" if _has_solution(run) else "no_solution")
    usage, stats = res.get("usage") or {}, det.get("stats") or {}
    tokens = {k: usage.get(k, stats.get(k)) for k in ("input_tokens", "output_tokens", "cache_read_tokens")}
    tokens["output_tokens"] = tokens["output_tokens"] or cell.get("output_tokens")
    if not tokens["input_tokens"]:  # KernelBench-Hard writes 0 where it did not record input tokens
        tokens["input_tokens"] = None
    effort = res.get("reasoning_effort", block.get("effort")) or None
    board = "" if run.gpu == ROOT_GPU else f"{_board_folder(run)}/"
    trace_name = run.run_id.removesuffix("-" + run.gpu)
    meta = {
        "run_id": run.run_id, "problem": problem, "model": model_slug(model), "model_display": model,
        "lab": lab_of(model), "harness": harness, "effort": effort, "gpu": run.gpu, "agent_outcome": outcome,
        "outcome_note": f"KernelBench-Hard: {reason}" if outcome != "completed" else None,
        "trace_url": f"https://huggingface.co/datasets/{traces_dataset}/blob/main/{board}{trace_name}.jsonl"
        if traces_dataset else None,
        "started_at": res.get("started_at"),
        "agent_seconds": res.get("elapsed_seconds", stats.get("agent_s")),
        **tokens,
        "cost_usd": usage.get("total_cost_usd", stats.get("cost_usd")),
        "source": f"kbh:{run.files[0].relative_to(root).as_posix()}" if run.files else "kbh",
    }
    return {k: v for k, v in meta.items() if v is not None}


def _board_folder(run: KbhRun) -> str:
    return {"h100-pcie": "h100", "b200": "b200"}.get(run.gpu, run.gpu)


def _has_solution(run: KbhRun) -> bool:
    record = run.result or run.detail or run.cell or {}
    return bool(record.get("has_solution", record.get("has_solution_text", True)))


def _solution(run_dir: Path) -> dict[str, bytes]:
    """solution.py of the run folder and the files beside it that it names."""
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


def _shape_match(labels: list[str], problem: Problem) -> list[str] | None:
    """The deck's shape parameters (JSON) per detail shape, when the labels name the deck's shapes in order."""
    import json

    shapes = problem.shapes
    if len(shapes) != len(labels):
        return None
    out = []
    for label, shape in zip(labels, shapes, strict=True):
        numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", label)]
        if numbers != [float(v) for v in shape.params.values()]:
            return None
        out.append(json.dumps(shape.params, sort_keys=True))
    return out


def _result(run: KbhRun, meta: dict[str, Any], problem: Problem | None,
            baselines: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reason, where = _reason(run)
    _, status, said = STATUS[reason]
    if status is None:
        status = "wrong" if _has_solution(run) and (run.result or run.cell or {}).get("correct") is False \
            else "not_graded"
    message = f"KernelBench-Hard ({where}): {said}"
    row: dict[str, Any] = {
        "run_id": run.run_id, "gpu": run.gpu, "status": status, "message": message, "n_shapes": 0,
        "timer": "cuda_event", "device_name": run.board_name or (GPUS[run.gpu].name if run.gpu in GPUS else run.gpu),
        "graded_at": _graded_at(run), "grader_version": GRADER_VERSION, "measured_by": MEASURED_BY,
    }
    if status != "pass":
        return row, []
    shapes = [s for s in (run.detail or {}).get("shapes") or [] if isinstance(s, dict)]
    entry = baselines.get(meta["problem"]) or {}
    eager, compiled = (entry.get(v) or {} for v in ("eager", "compiled"))
    ms = [s.get("ms") for s in shapes]
    why = None
    if not shapes or not all(isinstance(m, int | float) and m > 0 for m in ms):
        why = "no per-shape times in a run detail file"
    elif not all(isinstance(b.get("ms"), int | float) and b.get("n_shapes") == len(shapes) for b in (eager, compiled)):
        why = f"problem_baselines has no eager and compiled ms over the same {len(shapes)} shapes"
    elif problem is None or (params := _shape_match([str(s.get("label", "")) for s in shapes], problem)) is None:
        why = "the detail's shapes are not the deck's shapes"
    if why is not None:
        row.update(status="not_graded", message=f"KernelBench-Hard passed this run, but its speedups cannot be "
                                                f"derived: {why} (imported without a score)")
        return row, []
    sol = geomean(ms)  # type: ignore[arg-type]
    fracs = [s.get("frac") for s in shapes]
    row.update(
        speedup_vs_compile=compiled["ms"] / sol, speedup_vs_eager=eager["ms"] / sol, n_shapes=len(shapes),
        peak_fraction=geomean(fracs) if all(isinstance(f, int | float) and f > 0 for f in fracs) else None,  # type: ignore[arg-type]
        compile_variant=COMPILE_VARIANT,
        message=f"KernelBench-Hard pass; speedup = compiled {compiled['ms']} ms ÷ solution geomean {sol:.4g} ms "
                f"over {len(shapes)} shapes = {compiled['ms'] / sol:.3f}× (eager {eager['ms']} ms → "
                f"{eager['ms'] / sol:.3f}×); geomeans from problem_baselines, per-shape ms from the run detail",
    )
    shape_rows = [{
        "run_id": run.run_id, "gpu": run.gpu, "shape_idx": i, "shape_label": str(s.get("label", i)),
        "shape_json": params[i], "median_ms": float(s["ms"]), "tflop_s": s.get("tflops"), "gb_s": s.get("gbps"),
        "compute_fraction": s.get("compute_util"), "memory_fraction": s.get("mem_util"),
        "bound": problem.regime, "peak_fraction": s.get("frac"),  # type: ignore[union-attr]
        "note": "imported from KernelBench-Hard: per-shape baselines are not published, only their geomeans",
    } for i, s in enumerate(shapes)]
    return row, shape_rows


def _graded_at(run: KbhRun) -> dt.datetime:
    """When it was graded: the regrade's or the run's finish time; else the run id's start stands in."""
    res = run.result or {}
    for value in ((res.get("regrade") or {}).get("at"), res.get("finished_at")):
        if isinstance(value, str):
            try:
                ts = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
                return ts if ts.tzinfo else ts.replace(tzinfo=dt.UTC)
            except ValueError:
                pass
    return dt.datetime.strptime(run.run_id[:15], "%Y%m%d_%H%M%S").replace(tzinfo=dt.UTC)


def _annotations(install: KbhInstall, folder: Path, root: Path, report: KbhReport) -> int:
    written = 0
    seen = set()
    for run_id, (path, meta) in sorted(install.annotations.items()):
        if not isinstance(meta, dict) or not RUN_ID_PATTERN.match(run_id):
            report.skipped.append(f"{path}: not an annotation mapping named by a run id; skipped")
            continue
        verdict = {"contaminated": "contamination"}.get(meta.get("verdict"), meta.get("verdict"))
        core = {"run_id": run_id, "verdict": verdict, "summary": meta.get("summary"),
                "quotes": [{k: q[k] for k in ("file", "lines", "label", "text") if k in q}
                           for q in meta.get("quotes") or [] if isinstance(q, dict)],
                **{k: str(meta[k]) for k in ("implication", "auditor", "model", "harness", "effort", "problem", "gpu")
                   if meta.get(k) not in (None, "")},
                "source": f"kbh:{path.relative_to(root).as_posix()}"}
        extra = {k: v for k, v in meta.items() if k not in core and k != "verdict"}
        try:
            write_annotation(folder, {**core, **({"extra": extra} if extra else {})})
            written += 1
            seen.add(run_id)
        except Exception as exc:  # a DataError: report it, keep the rest
            report.skipped.append(f"{path}: {exc}")
    for run in install.runs.values():  # verdicts the leaderboard carries without an annotation file
        verdict = (run.cell or {}).get("annotation_verdict")
        if verdict in VERDICTS and verdict != "clean" and run.run_id not in seen:
            seen.add(run.run_id)
            written += 1
            write_annotation(folder, {
                "run_id": run.run_id, "verdict": verdict, "source": f"kbh:{run.files[-1].relative_to(root).as_posix()}",
                "summary": f"The KernelBench-Hard leaderboard marks this run '{verdict}'"
                           + (f" (invalid: {run.cell['invalid_reason']})" if (run.cell or {}).get("invalid_reason")
                              else "") + "; no annotation file with the auditor's reasons was found."})
    return written

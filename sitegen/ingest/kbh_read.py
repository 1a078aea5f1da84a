"""Finding and reading KernelBench-Hard result files: kernelbench.com's public repository, or an installation.

Recognised for one bench (landscape §2; kernelbench.com at c7d9221 lays them out this way):
  `results/leaderboard.json`, `leaderboard.<board>.json`   the published board: one cell per (model, problem)
  `results/problem_baselines[.<board>].json`              eager / compiled geomean ms per problem
  `results/raw_baselines/<problem>.txt`                   per-shape ms of the root board's baselines
  `results/published_runs.json`                           the root board's curation allowlist
  `results/annotations/<run_id>.yaml`                     audit verdicts (kept as the source writes them)
  `public/data/rundetail/[<board>/]<run_id>.json`         per-shape ms, fractions, failure reason, run stats
  `public/runs/[<board>/]<run_id>_solution.py.txt`        the final kernel, sidecars appended under banners
  `public/data/models.json`                               the site's board index: each run's trace link
  `outputs/runs[-<board>]/<run_id>/result.json`            an installation's runner record (+ solution.py)
Refused with a line each: `leaderboard_v*.json` (legacy copies of the same cells), preview boards, and
files of another bench. A file that is not valid JSON or YAML is reported with its name and line.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kernelboard.eval.hardware import GPUS, gpu_key

from .naming import BOARD_GPUS, ROOT_GPU

_BOARD_SUFFIX = re.compile(r"^(leaderboard|problem_baselines)(?:\.([a-z0-9-]+))?\.json$")
_RAW_BASELINE = re.compile(r"^shape=(\d+) variant=(\w+) .*?\bms=([0-9.]+)\s*$", re.MULTILINE)
_SOLUTION_SUFFIX = "_solution.py.txt"
#: Key for a trace link whose board the model index does not say (used when the run id is on one board only).
ANY_BOARD = "*"


@dataclass
class KbhRun:
    """Everything the source says about one run on one board."""

    run_id: str
    gpu: str
    cell: dict[str, Any] | None = None  # the leaderboard cell (None: the run is not on the published board)
    block: dict[str, Any] | None = None  # its model block: harness, model, effort, label
    result: dict[str, Any] | None = None  # result.json (installations only)
    detail: dict[str, Any] | None = None  # rundetail
    run_dir: Path | None = None
    published_solution: Path | None = None  # public/runs/…_solution.py.txt
    trace_url: str | None = None  # from the site's models.json
    files: list[Path] = field(default_factory=list)  # where it was read, first = primary
    board_name: str | None = None  # the leaderboard's hardware name


@dataclass
class KbhInstall:
    runs: dict[tuple[str, str], KbhRun] = field(default_factory=dict)  # (gpu, run_id) -> run
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # gpu -> problem -> entry
    #: gpu -> problem -> variant -> per-shape ms
    shape_baselines: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    shape_baseline_files: dict[str, dict[str, Path]] = field(default_factory=dict)  # gpu -> problem -> file
    baseline_files: dict[str, Path] = field(default_factory=dict)  # gpu -> problem_baselines file
    allowlists: dict[str, tuple[Path, frozenset[str]]] = field(default_factory=dict)  # gpu -> (file, run ids)
    annotations: dict[str, tuple[Path, Any]] = field(default_factory=dict)  # run_id -> (file, mapping)
    boards: dict[str, Path] = field(default_factory=dict)  # gpu -> leaderboard file
    other_benches: set[str] = field(default_factory=set)  # benches seen beside this one (not read)
    skipped: list[str] = field(default_factory=list)

    def run(self, gpu: str, run_id: str) -> KbhRun:
        return self.runs.setdefault((gpu, run_id), KbhRun(run_id, gpu))


def _board_gpu(board: str | None) -> str | None:
    return ROOT_GPU if board is None else BOARD_GPUS.get(board)


def _other_bench(path: Path, root: Path, bench: str) -> str | None:
    parts = path.relative_to(root).parts
    return next((b for a, b in itertools.pairwise(parts) if a == "benchmarks" and b != bench), None)


def _load_json(path: Path, skipped: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        skipped.append(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg}); file skipped")
    except (OSError, UnicodeDecodeError) as exc:
        skipped.append(f"{path}: cannot read ({exc}); file skipped")
    return None


def _board_of(path: Path, anchor: str) -> tuple[bool, str | None]:
    """(recognised, board folder) for a file directly in `anchor/` or in `anchor/<board>/`."""
    if path.parent.name == anchor:
        return True, None
    if path.parent.parent.name == anchor:
        return True, path.parent.name
    return False, None


def read_install(root: Path, bench: str = "hard") -> KbhInstall:
    """Read every recognised file under `root` (see the module docstring)."""
    found = KbhInstall()
    paths = sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts)
    solutions: dict[tuple[str, str], Path] = {}
    traces: dict[tuple[str, str], str] = {}
    for path in paths:
        other = _other_bench(path, root, bench)
        if other is not None:
            found.other_benches.add(other)
            continue
        name = path.name
        if name.startswith("leaderboard_v") and name.endswith(".json"):
            found.skipped.append(f"{path}: legacy / pre-reshape leaderboard copy; refused (read leaderboard*.json)")
        elif (m := _BOARD_SUFFIX.match(name)) and path.parent.name == "results":
            _board_file(found, path, m.group(1), m.group(2))
        elif name.endswith(".txt") and path.parent.name == "raw_baselines" and path.parent.parent.name == "results":
            _raw_baselines(found, path)
        elif name == "published_runs.json" and path.parent.name == "results":
            data = _load_json(path, found.skipped)
            if isinstance(data, dict) and isinstance(data.get("run_ids"), list):
                found.allowlists[ROOT_GPU] = (path, frozenset(str(r) for r in data["run_ids"]))
        elif path.suffix == ".json" and (hit := _board_of(path, "rundetail"))[0]:
            _detail(found, path, hit[1], bench)
        elif name.endswith(_SOLUTION_SUFFIX) and (hit := _board_of(path, "runs"))[0] and \
                path.parent.name != "outputs" and (gpu := _board_gpu(hit[1])):
            solutions[(gpu, name[: -len(_SOLUTION_SUFFIX)])] = path
        elif name == "models.json" and path.parent.name == "data":
            traces.update(_trace_urls(path, bench, found.skipped))
        elif name == "result.json" and path.parent.parent.name.startswith("runs") and \
                path.parent.parent.parent.name == "outputs":
            board = path.parent.parent.name.removeprefix("runs").lstrip("-") or None
            data = _load_json(path, found.skipped)
            gpu = _board_gpu(board)
            if isinstance(data, dict) and gpu:
                run = found.run(gpu, path.parent.name)
                run.result, run.run_dir = data, path.parent
                run.files.insert(0, path)
        elif path.suffix in (".yaml", ".yml") and path.parent.name == "annotations":
            try:
                found.annotations[path.stem] = (path, yaml.safe_load(path.read_text(encoding="utf-8")))
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                found.skipped.append(f"{path}: line {mark.line + 1 if mark else '?'}: not valid YAML; file skipped")
    for key, run in found.runs.items():
        run.published_solution = solutions.get(key)
        run.trace_url = traces.get(key) or (traces.get((ANY_BOARD, key[1]))
                                            if sum(r == key[1] for _, r in found.runs) == 1 else None)
        if run.published_solution is not None:
            run.files.append(run.published_solution)
    return found


def _board_file(found: KbhInstall, path: Path, kind: str, board: str | None) -> None:
    if board is not None and board not in BOARD_GPUS:
        why = "a preview board, not a published one" if "preview" in board else f"unknown board {board!r}"
        found.skipped.append(f"{path}: {why}; file skipped")
        return
    gpu = _board_gpu(board)
    data = _load_json(path, found.skipped)
    if not isinstance(data, dict) or gpu is None:
        if data is not None:
            found.skipped.append(f"{path}: expected a JSON object; file skipped")
        return
    if kind == "leaderboard":
        _leaderboard(found, path, data, gpu)
    elif isinstance(data.get("problems"), dict):
        found.baselines[gpu] = data["problems"]
        found.baseline_files[gpu] = path
    else:
        found.skipped.append(f"{path}: no 'problems' mapping; file skipped")


def _raw_baselines(found: KbhInstall, path: Path) -> None:
    """Per-shape baseline ms of the root board (the files carry no GPU; the root board is the one
    whose geomeans they reproduce, which the importer checks before using them)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        found.skipped.append(f"{path}: cannot read ({exc}); file skipped")
        return
    by_variant: dict[str, dict[int, float]] = {}
    for shape, variant, ms in _RAW_BASELINE.findall(text):
        by_variant.setdefault(variant, {})[int(shape)] = float(ms)
    out = {v: [ms[i] for i in sorted(ms)] for v, ms in by_variant.items() if sorted(ms) == list(range(len(ms)))}
    if out:
        found.shape_baselines.setdefault(ROOT_GPU, {})[path.stem] = out
        found.shape_baseline_files.setdefault(ROOT_GPU, {})[path.stem] = path


def _detail(found: KbhInstall, path: Path, board: str | None, bench: str) -> None:
    gpu = _board_gpu(board)
    if gpu is None:
        found.skipped.append(f"{path}: unknown board folder {board!r}; file skipped")
        return
    data = _load_json(path, found.skipped)
    if isinstance(data, dict) and data.get("bench", bench) == bench:
        run = found.run(gpu, str(data.get("run_id") or path.stem))
        run.detail = data
        run.files.append(path)


def _trace_urls(path: Path, bench: str, skipped: list[str]) -> dict[tuple[str, str], str]:
    """(gpu, run_id) -> trace URL, from every cell and outcome of the site's model index."""
    data = _load_json(path, skipped)
    out: dict[tuple[str, str], str] = {}
    if not isinstance(data, dict):
        return out
    for model in data.get("models") or []:
        entry = ((model or {}).get("benches") or {}).get(bench) or {}
        per_gpu = {None: entry, **{g: v for g, v in (entry.get("gpus") or {}).items()}}
        for board, block in per_gpu.items():
            gpu = _board_gpu(board if board not in (None, "rtxpro6000") else None)
            for cell in ((block or {}).get("cells") or {}).values():
                if isinstance(cell, dict) and gpu and cell.get("run_id") and cell.get("trace_url"):
                    out[(gpu, cell["run_id"])] = cell["trace_url"]
        for outcome in entry.get("outcomes") or []:  # every audited run, its board not reliably named
            if isinstance(outcome, dict) and outcome.get("run_id") and outcome.get("trace_url"):
                out.setdefault((ANY_BOARD, outcome["run_id"]), outcome["trace_url"])
    return out


def _leaderboard(found: KbhInstall, path: Path, data: dict[str, Any], gpu: str) -> None:
    name = (data.get("hardware") or {}).get("name")
    if isinstance(name, str) and gpu_key(name) in GPUS and gpu_key(name) != gpu:
        found.skipped.append(f"{path}: hardware {name!r} is not the {gpu} board its name says; file skipped")
        return
    found.boards[gpu] = path
    for block in data.get("models") or []:
        if not isinstance(block, dict):
            continue
        for problem, cell in (block.get("results") or {}).items():
            if isinstance(cell, dict) and isinstance(cell.get("run_id"), str):
                run = found.run(gpu, cell["run_id"])
                run.cell = {**cell, "problem": problem}
                run.block = {k: block.get(k) for k in ("label", "harness", "model", "effort")}
                run.board_name = name
                run.files.insert(0, path)


def geomean_of(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))

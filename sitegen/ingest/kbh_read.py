"""Finding and reading a KernelBench-Hard installation's result files (the formats of landscape §2).

Recognised, anywhere under the given folder, for one bench:
  `results/leaderboard.json`, `leaderboard.<board>.json`   one cell per (model, problem) per board
  `results/problem_baselines[.<board>].json`              eager / compiled geomean ms per problem
  `rundetail/[<board>/]<run_id>.json`                     per-shape ms, fractions and run stats
  `outputs/runs[-<board>]/<run_id>/result.json`            the runner's record (+ solution.py beside it)
  `results/annotations/<run_id>.yaml`                     audit verdicts
Refused: `leaderboard_v*.json` (legacy and pre-reshape copies of the same cells) and files of
another bench. A file that is not valid JSON or YAML is reported with its name and line and skipped.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kernelboard.eval.hardware import GPUS, gpu_key

from .naming import BOARD_GPUS, ROOT_GPU

_BOARD_SUFFIX = re.compile(r"^(leaderboard|problem_baselines)(?:\.([a-z0-9-]+))?\.json$")


@dataclass
class KbhRun:
    """Everything the installation says about one run on one board."""

    run_id: str
    gpu: str
    cell: dict[str, Any] | None = None  # the leaderboard cell
    block: dict[str, Any] | None = None  # its model block: harness, model, effort, label
    result: dict[str, Any] | None = None  # result.json
    detail: dict[str, Any] | None = None  # rundetail
    run_dir: Path | None = None
    files: list[Path] = field(default_factory=list)  # where it was read, first = primary
    board_name: str | None = None  # the leaderboard's hardware name


@dataclass
class KbhInstall:
    runs: dict[tuple[str, str], KbhRun] = field(default_factory=dict)  # (gpu, run_id) -> run
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # gpu -> problem -> entry
    annotations: dict[str, tuple[Path, Any]] = field(default_factory=dict)  # run_id -> (file, mapping)
    skipped: list[str] = field(default_factory=list)

    def run(self, gpu: str, run_id: str) -> KbhRun:
        return self.runs.setdefault((gpu, run_id), KbhRun(run_id, gpu))


def _board_gpu(board: str | None) -> str | None:
    return ROOT_GPU if board is None else BOARD_GPUS.get(board)


def _other_bench(path: Path, root: Path, bench: str) -> bool:
    parts = path.relative_to(root).parts
    return any(a == "benchmarks" and b != bench for a, b in itertools.pairwise(parts))


def _load_json(path: Path, skipped: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        skipped.append(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg}); file skipped")
    except (OSError, UnicodeDecodeError) as exc:
        skipped.append(f"{path}: cannot read ({exc}); file skipped")
    return None


def read_install(root: Path, bench: str = "hard") -> KbhInstall:
    """Read every recognised file under `root` (see the module docstring)."""
    found = KbhInstall()
    paths = sorted(p for p in root.rglob("*") if p.is_file() and not _other_bench(p, root, bench))
    for path in paths:
        name = path.name
        if name.startswith("leaderboard_v") and name.endswith(".json"):
            found.skipped.append(f"{path}: legacy / pre-reshape leaderboard copy; refused (read leaderboard*.json)")
        elif (m := _BOARD_SUFFIX.match(name)) and path.parent.name == "results":
            gpu = _board_gpu(m.group(2))
            data = _load_json(path, found.skipped)
            if gpu is None:
                found.skipped.append(f"{path}: unknown board {m.group(2)!r}; file skipped")
            elif isinstance(data, dict) and m.group(1) == "leaderboard":
                _leaderboard(found, path, data, gpu)
            elif isinstance(data, dict):
                found.baselines[gpu] = data.get("problems") or {}
        elif path.suffix == ".json" and "rundetail" in path.parts:
            data = _load_json(path, found.skipped)
            board = path.parent.name if path.parent.name != "rundetail" else None
            gpu = _board_gpu(board)
            if isinstance(data, dict) and gpu and data.get("bench", bench) == bench:
                run = found.run(gpu, str(data.get("run_id") or path.stem))
                run.detail = data
                run.files.append(path)
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
    return found


def _leaderboard(found: KbhInstall, path: Path, data: dict[str, Any], gpu: str) -> None:
    name = (data.get("hardware") or {}).get("name")
    if isinstance(name, str) and gpu_key(name) in GPUS and gpu_key(name) != gpu:
        found.skipped.append(f"{path}: hardware {name!r} is not the {gpu} board its name says; file skipped")
        return
    for block in data.get("models") or []:
        if not isinstance(block, dict):
            continue
        for problem, cell in (block.get("results") or {}).items():
            if isinstance(cell, dict) and isinstance(cell.get("run_id"), str):
                run = found.run(gpu, cell["run_id"])
                run.cell = {**cell, "problem": problem}
                run.block = {k: block.get(k) for k in ("label", "harness", "model", "effort")}
                run.board_name = name
                run.files.append(path)

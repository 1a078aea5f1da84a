"""What the foreign deck formats share: reading yaml and Python source with `ast` (never importing it),
and the problem.yaml fields both read the same way."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import DeckError

from .format_native import Fields
from .hardware import PRECISIONS
from .schema import REGIMES

#: KernelBench-Hard's check.py seeds (§A.4), used for KernelBench files too. (Its benchmark seed 2026
#: draws timing inputs; kernelboard adds a fresh seed per grading run anyway.)
SEEDS = (42, 123, 456)

# ------------------------------------------------------------------------------ shared


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DeckError(f"{path}: not valid YAML ({exc})") from None


def parse(path: Path) -> ast.Module:
    if not path.is_file():
        raise DeckError(f"{path}: no such file")
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise DeckError(f"{path}: line {exc.lineno}: not valid Python ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DeckError(f"{path}: cannot read ({exc})") from None


def targets(node: ast.stmt) -> list[tuple[ast.expr, ast.expr | None]]:
    """(target, value) of a top-level assignment; value None for `x += 1` and a bare `x: int`."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, ast.AnnAssign):
        return [(node.target, node.value)]
    if isinstance(node, ast.AugAssign):
        return [(node.target, None)]
    return []


def assigned_by(node: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    """Names one statement assigns, each with its value when it can be told (`M, N = 1, 2` can)."""
    out: list[tuple[str, ast.expr | None]] = []
    for target, value in targets(node):
        if isinstance(target, ast.Name):
            out.append((target.id, value))
        elif isinstance(target, ast.Tuple | ast.List):
            values = value.elts if isinstance(value, ast.Tuple | ast.List) and \
                len(value.elts) == len(target.elts) else [None] * len(target.elts)
            out += [(e.id, v) for e, v in zip(target.elts, values, strict=True) if isinstance(e, ast.Name)]
    return out


def bound_names(node: ast.stmt) -> list[str]:
    return [name for name, _ in assigned_by(node)]


def assignments(tree: ast.Module) -> dict[str, ast.expr | None]:
    """Names a module's own top-level statements assign -> the value last assigned (or None)."""
    return {name: value for node in tree.body for name, value in assigned_by(node)}


def regime(f: Fields, default: Any = ...) -> str:
    regime = f.get("regime", str, default)
    if regime not in REGIMES:
        raise DeckError(f"{f.where}: key 'regime': expected one of {', '.join(REGIMES)}, got {regime!r}")
    return regime


def peak_key(f: Fields, default: Any = ...) -> str:
    key = f.get("peak_tflops_key", str, default)
    if key not in PRECISIONS:
        raise DeckError(f"{f.where}: key 'peak_tflops_key': expected one of {', '.join(PRECISIONS)}, got {key!r}")
    return key


def strings(f: Fields, key: str) -> tuple[str, ...]:
    items = f.get(key, list, [])
    bad = [x for x in items if not isinstance(x, str) or not x]
    if bad:
        raise DeckError(f"{f.where}: key '{key}': expected non-empty strings, got {bad[0]!r}")
    return tuple(items)


def seed_list(f: Fields, key: str) -> list[int]:
    items = f.get(key, list)
    bad = [x for x in items if not isinstance(x, int) or isinstance(x, bool) or x < 0]
    if bad or not items:
        raise DeckError(f"{f.where}: key '{key}': expected a non-empty list of non-negative integers, got {items!r}")
    return items

"""Audit annotations: `data/annotations/<run_id>.yaml`, one verdict per audited run, checked on load.

    run_id: <the file name's stem>
    verdict: clean | interesting | bug | harness_limited | suspect | fail | timeout_unverified
             | reward_hack | rubric_leak | contamination | megakernel_not_authentic
    summary: one paragraph for a leaderboard reader
    quotes:  [{file, lines: [n] or [first, last], label, text}]   (optional)
    implication, auditor, model, harness, effort, problem, gpu, source  (optional text)
    extra:   {…}  anything else a source recorded, kept verbatim (optional mapping)

A **flagging** verdict (`FLAG_VERDICTS`) invalidates the run's cell: it is shown as
"flag: <verdict>" with the summary and never scores. The schema follows KernelBench-Hard's
annotation SCHEMA.md; `load_annotations` reports every problem as one `DataError` line naming
the file and the field, as `eval/tables.py` does for the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kernelboard.errors import DataError
from kernelboard.eval.submission import RUN_ID_PATTERN

from ._files import dump_yaml, write_if_changed

#: Verdicts that make a cell invalid (KernelBench-Hard's FLAG_VERDICTS).
FLAG_VERDICTS = ("reward_hack", "rubric_leak", "contamination", "megakernel_not_authentic")
#: Verdicts that comment on a run without invalidating it.
NOTE_VERDICTS = ("clean", "interesting", "bug", "harness_limited", "suspect", "fail", "timeout_unverified")
VERDICTS = NOTE_VERDICTS + FLAG_VERDICTS

_TEXT_KEYS = ("implication", "auditor", "model", "harness", "effort", "problem", "gpu", "source")
_KEYS = ("run_id", "verdict", "summary", "quotes", *_TEXT_KEYS, "extra")
_QUOTE_KEYS = {"file", "lines", "label", "text"}


@dataclass(frozen=True)
class Quote:
    file: str
    lines: tuple[int, ...]
    label: str | None
    text: str


@dataclass(frozen=True)
class Annotation:
    run_id: str
    verdict: str
    summary: str
    quotes: tuple[Quote, ...] = ()
    implication: str | None = None
    auditor: str | None = None
    source: str | None = None

    @property
    def flags(self) -> bool:
        """True when the verdict invalidates the run's cell."""
        return self.verdict in FLAG_VERDICTS


def check(meta: Any, where: str, stem: str) -> list[str]:
    """Every problem of one annotation mapping, one line each (empty: it keeps the schema)."""
    if not isinstance(meta, dict):
        return [f"{where}: expected a mapping of keys"]
    bad = [f"{where}: unknown key '{k}' (known: {', '.join(_KEYS)})" for k in meta if k not in _KEYS]
    if meta.get("run_id", stem) != stem:
        bad.append(f"{where}: field 'run_id': expected the file name's stem {stem!r}, got {meta['run_id']!r}")
    if meta.get("verdict") not in VERDICTS:
        bad.append(f"{where}: field 'verdict': expected one of {', '.join(VERDICTS)}, got {meta.get('verdict')!r}")
    if not isinstance(meta.get("summary"), str) or not meta["summary"].strip():
        bad.append(f"{where}: field 'summary': a non-empty paragraph is required")
    for key in _TEXT_KEYS:
        if meta.get(key) is not None and not isinstance(meta[key], str):
            bad.append(f"{where}: field '{key}': expected text, got {meta[key]!r}")
    if meta.get("extra") is not None and not isinstance(meta["extra"], dict):
        bad.append(f"{where}: field 'extra': expected a mapping")
    quotes = meta.get("quotes") or []
    if not isinstance(quotes, list):
        return [*bad, f"{where}: field 'quotes': expected a list"]
    for i, q in enumerate(quotes):
        at = f"{where}: field 'quotes[{i}]'"
        if not isinstance(q, dict):
            bad.append(f"{at}: expected a mapping with file, lines, label, text")
            continue
        bad += [f"{at}: unknown key '{k}'" for k in q if k not in _QUOTE_KEYS]
        if not isinstance(q.get("file"), str) or not isinstance(q.get("text"), str):
            bad.append(f"{at}: 'file' and 'text' must be text")
        lines = q.get("lines")
        if lines is not None and not (isinstance(lines, list) and 1 <= len(lines) <= 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lines)
                and lines == sorted(lines)):
            bad.append(f"{at}.lines: expected [line] or [first, last], 1-based, got {lines!r}")
    return bad


def _annotation(meta: dict[str, Any], stem: str) -> Annotation:
    quotes = tuple(Quote(q["file"], tuple(q.get("lines") or ()), q.get("label"), q["text"])
                   for q in meta.get("quotes") or [])
    return Annotation(stem, meta["verdict"], " ".join(meta["summary"].split()), quotes,
                      meta.get("implication"), meta.get("auditor"), meta.get("source"))


def load_annotations(folder: Path) -> dict[str, Annotation]:
    """Every `<run_id>.yaml` in `folder` (none when it does not exist); raise `DataError` listing every problem."""
    if not folder.is_dir():
        return {}
    found, bad = {}, []
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".yaml", ".yml"):
            continue
        if path.is_symlink():
            bad.append(f"{path}: a symbolic link; an annotation must be a plain file (links are never followed)")
            continue
        if not path.is_file():
            continue
        if not RUN_ID_PATTERN.match(path.stem):
            bad.append(f"{path}: the file name must be a run id (letters, digits, '.', '_', '-')")
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append(f"{path}: not UTF-8 text (byte {exc.start}); an annotation is YAML text")
            continue
        if "\0" in text:
            bad.append(f"{path}: a binary file (NUL bytes); an annotation is YAML text")
            continue
        try:
            meta = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark is not None else ""
            bad.append(f"{path}:{line} not valid YAML ({getattr(exc, 'problem', None) or exc})")
            continue
        except (ValueError, OverflowError, RecursionError) as exc:  # e.g. a date that does not exist
            bad.append(f"{path}: a value YAML cannot read ({' '.join(str(exc).split())})")
            continue
        problems = check(meta, str(path), path.stem)
        if problems:
            bad += problems
        else:
            found[path.stem] = _annotation(meta, path.stem)
    if bad:
        raise DataError(bad)
    return found


def write_annotation(folder: Path, meta: dict[str, Any]) -> bool:
    """Validate and write one annotation atomically; False when the file already held these bytes."""
    problems = check(meta, f"{folder / str(meta.get('run_id'))}.yaml (new)", str(meta.get("run_id")))
    if problems:
        raise DataError(problems)
    ordered = {k: meta[k] for k in _KEYS if meta.get(k) not in (None, [], {})}
    return write_if_changed(folder / f"{meta['run_id']}.yaml", dump_yaml(ordered))

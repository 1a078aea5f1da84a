"""Foreign deck formats read into problem.py's `Problem`, so the grader never sees the difference (no torch).

`detect_format` tells three formats apart; `load_problem_any` and `load_deck_any` (behind deck.py's
`load_problem` and `load_deck`) load any of them. Nothing here imports a problem's code: Python
files are read with `ast`, so a deck loads without torch and without running anything.

- **kernelboard**: a folder whose `problem.yaml` has `shapes:` and `shape_globals:` (format_native.py).
- **KernelBench-Hard** (`kernelbench-hard`): a folder with `reference.py`, `shapes.py` and
  `problem.yaml` (hard-deck-interface.md §A.1). `SHAPES` must be a literal list of dicts; each
  key sets the reference global `KEY.upper()` if reference.py assigns it at top level, else the
  global spelled like the key (§B.x.1). A dict's trailing comment becomes its label. Tolerances
  follow §A.7: a scalar or `{atol, rtol}` (missing = 0, numeric strings coerced), and a
  `torch.<dtype>` key beats `<dtype>`, for stress cases too. Seeds 42, 123, 456. `check.py`,
  `benchmark.py`, `sota.py` and `PROMPT.txt` are ignored, as are the yaml's informational keys
  (`hardware`, `peak_bandwidth_key`, `num_perf_trials`, `sota`, …). The problem is the folder's
  name; its bench is the deck folder's name, or `hard` for `problems` and `problems-<gpu>`.
  Three kernelboard keys may be added to its problem.yaml: `cpu_shapes` (none otherwise, so
  `--device cpu` reports it not graded), `numeric_stress` (none otherwise: KernelBench-Hard keeps
  its cases in check.py) and `shape_globals` (instead of the inference).
- **ScalingIntelligence KernelBench** (`kernelbench`): one level file per problem in the deck
  folder, e.g. `19_ReLU.py` with `class Model`, top-level size constants, `get_inputs()` and
  `get_init_inputs()`; the candidate defines `ModelNew` with the same constructor and both models
  are built right after the same `torch.manual_seed`. One shape, "default", the file's own
  constants; problem.py's `DEFAULT_TOLERANCE` (fp32 1e-4, fp16 and bf16 1e-2); no roofline; regime
  `compute`, precision and peak key `fp32`; name the stem, display name the stem without its
  number, underscores as spaces; bench the deck folder's name. A sibling `<stem>.yaml` in
  kernelboard's format may add the keys in `SI_KB_OVERLAY_KEYS`: notably `cpu_shapes` (none
  otherwise), and `shape_globals` naming constants of the file, whose literal values then make
  the default shape. Such a problem's `folder` is its file (see `Problem.reference_path`), so a
  grading worker can reload it from `folder` alone; `deck/<stem>` also names it.

Refused, each with a `DeckError` naming the file: a `SHAPES` that is not a literal; a shape key
that sets no reference global (a key only check.py reads, like 04_kahan_softmax's `extreme`); a
non-integer or non-positive size; kernelboard keys a KernelBench-Hard folder cannot honour
(`seeds`, `structural_stress`, …); an overlay key outside `SI_KB_OVERLAY_KEYS`; a folder or file
that matches no format. Not modelled: KernelBench-Hard's state scaling (01's `small_weight`), its
property stress and tuple outputs (05) — they live in its check.py, not in the folder.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from kernelboard.errors import DeckError

from .format_kbh import load_kb_hard_problem
from .format_native import load_native_problem
from .format_sikb import load_si_kb_problem
from .format_source import read_yaml
from .problem import Problem

NATIVE, KB_HARD, SI_KB = "kernelboard", "kernelbench-hard", "kernelbench"
FORMATS = (NATIVE, KB_HARD, SI_KB)

# ------------------------------------------------------------------------------ detection


def detect_format(path: Path) -> str:
    """Which of `FORMATS` the problem at `path` is in (a folder, a `.py` file, or `deck/<stem>`)."""
    if path.is_file():
        if path.suffix == ".py":
            return SI_KB
        raise DeckError(f"{path}: a problem is a folder or a KernelBench level file (.py), not this file")
    if not path.exists():
        if _si_kb_file(path).is_file():
            return SI_KB
        raise DeckError(f"{path}: no such problem folder or file")
    yaml_path = path / "problem.yaml"
    data = read_yaml(yaml_path) if yaml_path.is_file() else {}
    if not isinstance(data, dict):
        raise DeckError(f"{yaml_path}: expected a mapping, got {type(data).__name__}")
    has_ref, has_shapes = (path / "reference.py").is_file(), (path / "shapes.py").is_file()
    native = [k for k in ("shapes", "shape_globals") if k in data]
    if len(native) == 2:
        return NATIVE
    if has_ref and has_shapes:
        if "shapes" in data:
            raise DeckError(f"{yaml_path}: key 'shapes' is kernelboard's format but shapes.py is KernelBench-Hard's: "
                            "add 'shape_globals' (kernelboard) or remove 'shapes' (KernelBench-Hard)")
        return KB_HARD
    lacks = " or ".join(f"'{k}'" for k in ("shapes", "shape_globals") if k not in data) + " in problem.yaml" \
        if yaml_path.is_file() else "problem.yaml"
    raise DeckError(
        f"{path}: matches no deck format: not kernelboard's (no {lacks}), not KernelBench-Hard's "
        f"(no {' and '.join(n for n, ok in (('reference.py', has_ref), ('shapes.py', has_shapes)) if not ok)}), "
        "and not a KernelBench level file (N_Name.py)")


def load_problem_any(path: Path) -> Problem:
    """Load one problem in whichever format `detect_format` finds."""
    fmt = detect_format(path)
    if fmt == NATIVE:
        return load_native_problem(path)
    if fmt == KB_HARD:
        return load_kb_hard_problem(path)
    return load_si_kb_problem(_si_kb_file(path))


def load_deck_any(deck_dir: Path) -> dict[str, Problem]:
    """Every problem of a deck by name, in natural order: problem folders (kernelboard or
    KernelBench-Hard) and KernelBench level files may mix. Every bad problem is listed in one error."""
    if not deck_dir.is_dir():
        raise DeckError(f"{deck_dir}: no such deck folder")
    if (deck_dir / "reference.py").is_file():
        raise DeckError(f"{deck_dir}: this is a problem folder, not a deck: pass the folder that holds it")
    entries = sorted((p for p in deck_dir.iterdir() if not p.name.startswith((".", "_"))), key=_natural)
    files = [p for p in entries if p.is_file() and p.suffix == ".py"]
    folders = [p for p in entries if p.is_dir() and any((p / n).is_file() for n in
                                                         ("problem.yaml", "reference.py", "shapes.py"))]
    errors = [f"{p}: an overlay for {p.stem}.py, which is not in the deck" for p in entries
              if files and p.suffix == ".yaml" and p.is_file() and not p.with_suffix(".py").is_file()]
    problems: dict[str, Problem] = {}
    for path in sorted(folders + files, key=_natural):
        try:
            problem = load_problem_any(path)
        except DeckError as exc:
            errors.append(exc.message)
            continue
        if problem.name in problems:
            errors.append(f"{path}: problem {problem.name!r} is also {problems[problem.name].folder}")
        problems[problem.name] = problem
    if errors:
        head = errors[0] if len(errors) == 1 else f"{len(errors)} problems in the deck {deck_dir}:"
        raise DeckError(head if len(errors) == 1 else head + "\n" + "\n".join(f"  {e}" for e in errors))
    if not problems:
        raise DeckError(f"{deck_dir}: no problem folders (kernelboard or KernelBench-Hard) "
                        "and no KernelBench level files (N_Name.py)")
    return problems


def _natural(path: Path) -> tuple[float, str]:
    """'2_x' before '10_x': KernelBench's level files are not zero-padded."""
    m = re.match(r"\d+", path.name)
    return (int(m.group()) if m else math.inf, path.name)


def _si_kb_file(path: Path) -> Path:
    return path if path.suffix == ".py" else path.with_name(path.name + ".py")



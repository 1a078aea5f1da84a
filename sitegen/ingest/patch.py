"""Codex's `apply_patch` envelope, applied exactly or not at all.

    *** Begin Patch
    *** Add File: path          (+ lines: the whole new file)
    *** Update File: path       (optional `*** Move to: new path`, then `@@ anchor` hunks of ' ', '-', '+' lines)
    *** Delete File: path
    *** End Patch

As Codex does, a hunk's old lines (context and '-') are sought from just past the previous hunk
and the hunk's `@@` anchor line, and the first exact occurrence is replaced. An anchor must name
exactly one line (compared without surrounding whitespace). Codex retries a hunk that has no
exact occurrence with trailing, then all, whitespace ignored; such a patch did change the file,
but not in a way this importer reproduces with certainty, so `PatchError` is raised instead.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field


class PatchError(ValueError):
    """The patch is malformed, or does not apply exactly to the content it was given."""


@dataclass
class FilePatch:
    op: str  # 'add' | 'update' | 'delete'
    path: str
    move_to: str | None = None
    lines: list[str] = field(default_factory=list)  # 'add': the + lines; 'update': the raw hunk lines


def parse(text: str) -> list[FilePatch]:
    lines = text.strip("\n").split("\n")
    if not lines or lines[0].strip() != "*** Begin Patch" or lines[-1].strip() != "*** End Patch":
        raise PatchError("not an apply_patch envelope (*** Begin Patch … *** End Patch)")
    patches: list[FilePatch] = []
    for line in lines[1:-1]:
        for op, head in (("add", "*** Add File: "), ("update", "*** Update File: "), ("delete", "*** Delete File: ")):
            if line.startswith(head):
                patches.append(FilePatch(op, line[len(head):].strip()))
                break
        else:
            if not patches:
                raise PatchError(f"a line before any file header: {line[:60]!r}")
            current = patches[-1]
            if line.startswith("*** Move to: "):
                current.move_to = line[len("*** Move to: "):].strip()
            elif current.op == "add":
                if not line.startswith("+"):
                    raise PatchError(f"{current.path}: an added file's line must start with '+'")
                current.lines.append(line[1:])
            elif current.op == "update":
                current.lines.append(line)
            else:
                raise PatchError(f"{current.path}: a deleted file has no body")
    return patches


def _hunks(lines: list[str]) -> list[tuple[str | None, list[str], list[str]]]:
    """(anchor, old lines, new lines) per hunk."""
    hunks: list[tuple[str | None, list[str], list[str]]] = []
    anchor: str | None = None
    old: list[str] = []
    new: list[str] = []
    for line in lines:
        if line.startswith("@@"):
            if old or new:
                hunks.append((anchor, old, new))
            anchor, old, new = line[2:].strip() or None, [], []
        elif line == "*** End of File":
            continue
        elif line[:1] in (" ", "-", "+") or line == "":
            mark, body = (line[:1] or " "), line[1:]
            if mark in (" ", "-"):
                old.append(body)
            if mark in (" ", "+"):
                new.append(body)
        else:
            raise PatchError(f"unexpected patch line {line[:60]!r}")
    if old or new:
        hunks.append((anchor, old, new))
    return hunks


def _find(lines: list[str], seq: list[str], start: int) -> int:
    for i in range(start, len(lines) - len(seq) + 1):
        if lines[i:i + len(seq)] == seq:
            return i
    raise PatchError(f"a hunk's old lines do not occur exactly: {(seq[0] if seq else '')[:60]!r}")


def _anchor(lines: list[str], anchor: str, start: int) -> int:
    hits = [i for i in range(start, len(lines)) if lines[i].strip() == anchor.strip()]
    if len(hits) != 1:
        raise PatchError(f"the anchor {anchor[:60]!r} names {len(hits)} lines (exactly one is needed)")
    return hits[0]


def apply_update(content: str, patch: FilePatch) -> str:
    """The file after an Update hunk list; raises `PatchError` unless every hunk applies exactly once."""
    lines = content.split("\n")
    trailing_newline = content.endswith("\n")
    if trailing_newline:
        lines = lines[:-1]
    pos = 0
    for anchor, old, new in _hunks(patch.lines):
        if anchor is not None:
            pos = _anchor(lines, anchor, pos) + 1
        if not old:
            raise PatchError(f"{patch.path}: a hunk with no context cannot be placed with certainty")
        at = _find(lines, old, pos)
        lines[at:at + len(old)] = new
        pos = at + len(new)
    return "\n".join(lines) + ("\n" if trailing_newline or not lines else "")


def added_content(patch: FilePatch) -> str:
    return "".join(f"{line}\n" for line in patch.lines)


def resolve_in(path: str, cwd: str | None) -> str | None:
    if path.startswith("/"):
        return posixpath.normpath(path)
    return posixpath.normpath(posixpath.join(cwd, path)) if cwd else None

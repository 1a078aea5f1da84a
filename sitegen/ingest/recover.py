"""Rebuild the final solution.py (and its sidecar files) by replaying a trace's tool calls.

The replay keeps a small file system of what is known for certain: the content of every file a
recognised call wrote. Recognised calls: whole-file writes (`Write`, `write_file`, `create_file`),
exact edits (`Edit`, `MultiEdit`, Gemini's `replace`, `str_replace`), Codex's `apply_patch`, and
shell commands as `shell.analyze` reads them (heredocs, `cp`, `mv`, `rm`). A call whose result the
harness recorded as an error did not happen; a call that never got a result, or any other call
that may have written a file, makes that file's content unknown until a later whole write.

The run's solution is `solution.py` in the problem folder (the trace's first working directory)
plus the files of that folder it names, transitively (`kernel.cu`, `import helpers`). Nothing is
guessed: an unknown solution.py, an edit whose old text is not in the file as rebuilt, or a
named sidecar the trace never wrote gives `Recovery.unrecoverable` with the reason.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from . import patch as patches
from .claude_code import Session, ToolCall
from .shell import Effect, analyze, resolve

SOLUTION = "solution.py"
_WRITE = {"write", "write_file", "create_file", "create"}
_EDIT = {"edit", "replace", "str_replace", "edit_file", "search_replace"}
_MULTI = {"multiedit", "multi_edit"}
_PATCH = {"apply_patch", "applypatch"}
_SHELL = {"bash", "shell", "exec_command", "local_shell", "run_shell_command", "execute_command",
          "run_terminal_cmd", "terminal", "container.exec"}
_READ = {"read", "read_file", "view", "glob", "grep", "ls", "list", "list_directory", "todowrite", "todoread",
         "webfetch", "websearch", "web_search", "search_file_content", "bashoutput", "killshell", "killbash",
         "exitplanmode", "update_plan", "task", "agent", "read_many_files", "notebookread"}
_PATH_KEYS = ("file_path", "filePath", "path", "absolute_path", "target_file", "filename")
_SIDECAR_REF = re.compile(r"""["']([\w./-]+\.(?:cu|cuh|cpp|cc|cxx|ptx|cubin))["']""")


@dataclass
class Recovery:
    """What the replay found: the solution's files, or why there are none."""

    status: str  # 'ok', 'none' (never written), 'unrecoverable'
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text; solution.py first
    reason: str = ""
    writes: int = 0  # recognised calls that changed solution.py


@dataclass
class _FS:
    known: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)  # path -> why its content is not known
    solution: str = ""
    writes: int = 0

    def set(self, path: str, content: str) -> None:
        self.known[path] = content
        self.unknown.pop(path, None)
        self.writes += path == self.solution

    def taint(self, path: str, why: str) -> None:
        self.known.pop(path, None)
        self.unknown[path] = why

    def delete(self, path: str) -> None:
        self.known.pop(path, None)
        self.unknown.pop(path, None)

    def watched(self) -> set[str]:
        return set(self.known) | set(self.unknown) | {self.solution}


def _get(args: dict[str, Any], *keys: str) -> Any:
    return next((args[k] for k in keys if k in args), None)


def _command(args: dict[str, Any]) -> str | None:
    cmd = _get(args, "command", "cmd", "script")
    if isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd):
        return cmd[-1] if len(cmd) >= 3 and cmd[-2] in ("-c", "-lc") else " ".join(cmd)
    return cmd if isinstance(cmd, str) else None


def recover(session: Session) -> Recovery:
    """Replay every tool call of `session` (see the module docstring)."""
    folder = session.init.get("cwd") or session.cwd
    if not folder or not folder.startswith("/"):
        if not session.tool_calls:
            return Recovery("none", reason=f"the trace never wrote {SOLUTION} (it has no tool calls)")
        return Recovery("unrecoverable", reason="the trace does not name its working directory")
    fs = _FS(solution=posixpath.join(posixpath.normpath(folder), SOLUTION))
    for call in session.tool_calls:
        _replay(fs, call, call.cwd or folder)
        if call.name.lower() in ("read", "read_file", "view") and call.result_error is False:
            path = resolve(str(_get(call.input, *_PATH_KEYS) or ""), call.cwd or folder)
            if path == fs.solution and path not in fs.known and path not in fs.unknown:
                fs.taint(path, f"it was read (line {call.line}) but no write this importer recognises made it")
    return _collect(fs, posixpath.dirname(fs.solution))


def _replay(fs: _FS, call: ToolCall, cwd: str) -> None:
    name, args = call.name.lower(), call.input
    if call.result_error is True and name not in _SHELL:
        return  # the harness refused the call: nothing changed
    pending = call.result_error is None
    if name in _WRITE | _EDIT | _MULTI:
        path = resolve(str(_get(args, *_PATH_KEYS) or ""), cwd)
        if path is None:
            _taint_mentions(fs, args, f"a {call.name} call on a path this importer cannot resolve")
        elif pending:
            fs.taint(path, f"the {call.name} call at line {call.line} never got a result")
        elif name in _WRITE:
            content = _get(args, "content", "contents", "file_text", "text")
            if isinstance(content, str):
                fs.set(path, content)
            else:
                fs.taint(path, f"the {call.name} call at line {call.line} has no text content")
        else:
            edits = args.get("edits") if name in _MULTI else [args]
            _edit(fs, path, edits if isinstance(edits, list) else [], call)
    elif name in _PATCH:
        text = _get(args, "input", "patch", "command")
        _apply_patch(fs, text if isinstance(text, str) else None, cwd, call, pending)
    elif name in _SHELL:
        command = _command(args)
        if command is None:
            return
        effects = analyze(command, cwd, fs.watched(), fs.known.get)
        for effect in effects:
            uncertain = pending or (call.result_error and effect.guarded)
            _effect(fs, effect, call, uncertain)
    elif name not in _READ:
        _taint_mentions(fs, args, f"the unrecognised tool call {call.name!r} at line {call.line} names it")


def _taint_mentions(fs: _FS, args: Any, why: str) -> None:
    text = repr(args)
    for path in fs.watched():
        if re.search(rf"(?<![\w.-]){re.escape(posixpath.basename(path))}(?![\w-])", text):
            fs.taint(path, why)


def _edit(fs: _FS, path: str, edits: list[Any], call: ToolCall) -> None:
    where = f"the {call.name} call at line {call.line}"
    content = fs.known.get(path)
    if content is None and path in fs.unknown:
        return fs.taint(path, fs.unknown[path])
    for edit in edits:
        old = _get(edit, "old_string", "oldString", "old_str") if isinstance(edit, dict) else None
        new = _get(edit, "new_string", "newString", "new_str") if isinstance(edit, dict) else None
        if not isinstance(old, str) or not isinstance(new, str):
            return fs.taint(path, f"{where} has no old/new text")
        if content is None:
            if old == "":
                content = new
                continue
            return fs.taint(path, f"{where} edits a file whose starting content is not in the trace")
        count = content.count(old) if old else 0
        expected = edit.get("expected_replacements")
        every = bool(_get(edit, "replace_all", "replaceAll")) or isinstance(expected, int)
        if count == 0 or (not every and count != 1) or (isinstance(expected, int) and count != expected):
            return fs.taint(path, f"{where} succeeded, but its old text occurs {count} times in the file "
                                  "as rebuilt (so the rebuilt file is not the agent's)")
        content = content.replace(old, new) if every else content.replace(old, new, 1)
    fs.set(path, content)


def _apply_patch(fs: _FS, text: str | None, cwd: str, call: ToolCall, pending: bool) -> None:
    where = f"the apply_patch at line {call.line}"
    try:
        if text is None:
            raise patches.PatchError("no patch text")
        parsed = patches.parse(text)
    except patches.PatchError as exc:
        return _taint_mentions(fs, {"patch": text}, f"{where} cannot be read ({exc})")
    for fp in parsed:
        path = patches.resolve_in(fp.path, cwd)
        if path is None:
            continue
        if pending:
            fs.taint(path, f"{where} never got a result")
        elif fp.op == "add":
            fs.set(path, patches.added_content(fp))
        elif fp.op == "delete":
            fs.delete(path)
        elif path not in fs.known:
            fs.taint(path, fs.unknown.get(path, f"{where} updates a file whose starting content is not in the trace"))
        else:
            try:
                content = patches.apply_update(fs.known[path], fp)
            except patches.PatchError as exc:
                fs.taint(path, f"{where} does not apply exactly ({exc})")
                continue
            target = patches.resolve_in(fp.move_to, cwd) if fp.move_to else path
            if target != path:
                fs.delete(path)
            fs.set(target or path, content)


def _effect(fs: _FS, effect: Effect, call: ToolCall, uncertain: bool) -> None:
    where = f"the shell command at line {call.line}"
    if effect.op == "patch":
        if effect.content is None:
            return _taint_mentions(fs, {"cwd": effect.path}, effect.reason)
        return _apply_patch(fs, effect.content, effect.path, call, uncertain)
    if uncertain and effect.op != "taint":
        return fs.taint(effect.path, f"{where} failed or never finished, so its write may not have happened")
    if effect.op == "write":
        fs.set(effect.path, effect.content or "")
    elif effect.op == "append":
        if effect.path in fs.known:
            fs.set(effect.path, fs.known[effect.path] + (effect.content or ""))
        else:
            fs.taint(effect.path, f"{where} appends to a file whose content is not known")
    elif effect.op in ("copy", "move"):
        source = effect.source or ""
        if source in fs.known:
            fs.set(effect.path, fs.known[source])
        else:
            fs.taint(effect.path, fs.unknown.get(source, f"{where} copies a file whose content is not in the trace"))
        if effect.op == "move":
            fs.delete(source)
    elif effect.op == "delete":
        pattern = effect.path
        for path in list(fs.known) + list(fs.unknown):
            if path == pattern or (posixpath.dirname(path) == posixpath.dirname(pattern) and \
                    re.fullmatch(_glob(posixpath.basename(pattern)), posixpath.basename(path))) or \
                    path.startswith(pattern.rstrip("/") + "/"):
                fs.delete(path)
    else:
        fs.taint(effect.path, f"{where}: {effect.reason}")


def _glob(pattern: str) -> str:
    return "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)


def _collect(fs: _FS, folder: str) -> Recovery:
    """solution.py and the files of its folder it names (transitively), or why not."""
    if fs.solution in fs.unknown:
        return Recovery("unrecoverable", reason=f"{SOLUTION}: {fs.unknown[fs.solution]}", writes=fs.writes)
    if fs.solution not in fs.known:
        return Recovery("none", reason=f"the trace never wrote {SOLUTION}", writes=fs.writes)
    inside = {p: posixpath.relpath(p, folder) for p in fs.watched()
              if p.startswith(folder + "/") and p != fs.solution}
    files, queue = {SOLUTION: fs.known[fs.solution]}, [fs.known[fs.solution]]
    while queue:
        text = queue.pop()
        for path, rel in sorted(inside.items()):
            if rel in files or not names_file(text, rel):
                continue
            if path not in fs.known:
                return Recovery("unrecoverable", reason=f"{rel} (used by the solution): {fs.unknown[path]}",
                                writes=fs.writes)
            files[rel] = fs.known[path]
            queue.append(fs.known[path])
    for text in list(files.values()):
        for ref in _SIDECAR_REF.findall(text):
            rel = posixpath.normpath(ref)
            if rel not in files and posixpath.basename(rel) not in {posixpath.basename(f) for f in files}:
                return Recovery("unrecoverable", writes=fs.writes,
                                reason=f"the solution uses {ref!r}, which the trace never wrote with a "
                                       "call this importer recognises")
    return Recovery("ok", files=files, writes=fs.writes)


def names_file(text: str, rel: str) -> bool:
    """Does `text` name the file `rel` (its path, its file name, or `import <module>` for a .py)?"""
    base = posixpath.basename(rel)
    if re.search(rf"(?<![\w.-]){re.escape(base)}(?![\w-])", text) or rel in text:
        return True
    if base.endswith(".py"):
        module = re.escape(base[:-3])
        return bool(re.search(rf"^\s*(from\s+\.?{module}\s+import|import\s+{module}\b)", text, re.MULTILINE))
    return False

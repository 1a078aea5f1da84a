"""What a shell command from a trace did to files, as far as it can be known for certain.

Recognised with certainty: heredocs into a file (`cat > f <<'EOF'`, `cat <<EOF >> f`, `tee [-a] f
<<EOF`; an unquoted delimiter only when the body has no `$`, backquote or backslash, which the
shell would expand), `apply_patch <<'EOF'` (Codex), `cp`/`mv` of one file, `rm`, and `cd`.
Everything else that may write a watched file is reported as a **taint** — the file's content is
no longer known: any other redirect into it, `sed -i`, `perl -i`, `git checkout`, `patch`, an
unknown command naming it, and inline code (`python -c`, a `python - <<EOF` body, a script the
trace wrote) that names it next to a write (`open(…, 'w')`, `.write(`, `shutil`, …). A command
the tokenizer cannot read taints every watched file it names. Commands that name no watched file
are assumed to leave watched files alone.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

_HEREDOC = re.compile(r"(?<!<)<<(?!<)(-?)\s*(?:'([^'\n]+)'|\"([^\"\n]+)\"|\\?([A-Za-z_][\w.-]*))")
_SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "|&", ";;"}
_OUT = {">", ">>", ">|", "&>", "&>>"}
_APPEND = {">>", "&>>"}
_IN = {"<", "<<<", "<&"}
_DEVICES = ("/dev/",)
_PREFIXES = {"sudo", "command", "exec", "time", "nohup", "builtin", "stdbuf", "nice"}
_READ_ONLY = {
    "cat", "head", "tail", "less", "more", "wc", "grep", "egrep", "fgrep", "rg", "ag", "diff", "cmp", "ls",
    "stat", "file", "sha256sum", "sha1sum", "md5sum", "nl", "sort", "uniq", "cut", "tr", "xxd", "od",
    "hexdump", "echo", "printf", "pwd", "which", "nvidia-smi", "chmod", "realpath", "readlink", "basename",
    "dirname", "du", "df", "ps", "sleep", "true", "false", "test", "[", "ruff", "pyflakes", "mypy", "pylint",
    "nvcc", "gcc", "g++", "c++", "cc", "clang", "clang++", "cuobjdump", "nvdisasm", "ncu", "nsys", "tree",
    "column", "jq", "export", "source", ".", "set", "unset", "mkdir", "env", "timeout", "watch", "strings",
}
_INTERPRETERS = {"python", "python3", "python3.11", "python3.12", "python3.13", "bash", "sh", "perl", "ruby",
                 "node", "uv", "pytest"}
_WRITE_IN_CODE = re.compile(r"""open\([^)]*['"][wax+]|write_text|write_bytes|\.write\(|shutil\.|"""
                            r"""os\.(rename|replace|remove|unlink)|"""
                            r""">\s*\S|\bsed\s+-i|\bcp\s|\bmv\s|\brm\s""")
_COPY_OPTIONS = {"-f", "-v", "-p", "--force", "--verbose", "--preserve", "-fv", "-vf"}


@dataclass(frozen=True)
class Effect:
    """One file effect of a command: write, append, copy, move, delete, patch or taint."""

    op: str
    path: str  # absolute; for 'patch' the cwd the patch's relative paths resolve against
    content: str | None = None
    source: str | None = None
    reason: str = ""
    guarded: bool = False  # a failure of the command may mean this never happened (see `analyze`)


@dataclass(frozen=True)
class _Heredoc:
    delimiter: str
    quoted: bool
    body: str
    closed: bool

    def certain(self) -> bool:
        return self.closed and (self.quoted or not any(c in self.body for c in "$`\\"))


def resolve(path: str, cwd: str | None) -> str | None:
    """An absolute, normalised path; None when it depends on the shell (`~`, `$VAR`) or cwd is unknown."""
    if not path or any(c in path for c in "$`~{}"):
        return None
    if not path.startswith("/"):
        if cwd is None:
            return None
        path = posixpath.join(cwd, path)
    return posixpath.normpath(path)


def _mentions(text: str, watched: Iterable[str]) -> list[str]:
    """Watched paths whose file name occurs in `text` as a word of its own."""
    return [p for p in watched
            if re.search(rf"(?<![\w.-]){re.escape(posixpath.basename(p))}(?![\w-])", text)]


def _logical_lines(command: str) -> list[tuple[str, list[_Heredoc]]]:
    """Lines joined where quotes or a trailing backslash continue them, each with its heredoc bodies."""
    lines, out, i = command.split("\n"), [], 0
    while i < len(lines):
        text = lines[i]
        i += 1
        while i < len(lines) and not _complete(text):
            text += "\n" + lines[i]
            i += 1
        docs = []
        for m in _HEREDOC.finditer(text):
            dash, word = m.group(1) == "-", m.group(2) or m.group(3) or m.group(4)
            body, closed = [], False
            while i < len(lines):
                line = lines[i].lstrip("\t") if dash else lines[i]
                i += 1
                if line == word:
                    closed = True
                    break
                body.append(line)
            docs.append(_Heredoc(word, m.group(4) is None, "".join(f"{b}\n" for b in body), closed))
        out.append((text, docs))
    return out


def _complete(text: str) -> bool:
    try:
        shlex.split(text)
    except ValueError:
        return False
    return True


def _tokens(text: str) -> list[str] | None:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:
        return None


def _simple_commands(tokens: list[str]) -> list[tuple[list[str], bool]]:
    """Simple commands, each with whether it sits after `&&`/`||` in its list (it may not have run)."""
    commands, current, gated = [], [], False
    for tok in tokens:
        if tok in _SEPARATORS:
            if current:
                commands.append((current, gated))
            current = []
            gated = tok in ("&&", "||") or (gated and tok in ("|", "|&", "(", ")"))
        else:
            current.append(tok)
    if current:
        commands.append((current, gated))
    return commands


def analyze(command: str, cwd: str | None, watched: Iterable[str],
            content_of: Callable[[str], str | None] = lambda _: None) -> list[Effect]:
    """The file effects of one shell command run in `cwd`, in order (see the module docstring)."""
    watched = sorted(set(watched))
    effects: list[Effect] = []
    errexit, lists, flags = False, 0, []  # flags: per effect, (and-or list number, gated, errexit)
    for text, docs in _logical_lines(command):
        tokens = _tokens(text)
        if tokens is None or any(not d.closed for d in docs):
            effects += [Effect("taint", p, reason="a shell command that could not be parsed names it")
                        for p in _mentions(text + "".join(d.body for d in docs), watched)]
            flags += [(lists, False, errexit)] * (len(effects) - len(flags))
            continue
        pending = list(docs)
        for words, gated in _simple_commands(tokens):
            lists += not gated
            cwd = _simple(words, cwd, pending, watched, content_of, effects)
            flags += [(lists, gated, errexit)] * (len(effects) - len(flags))
            errexit = errexit or (words[:1] == ["set"] and any(w.startswith("-") and "e" in w for w in words[1:]))
    # A failed command reports the status of its last and-or list: only there, or under `set -e`,
    # may the failure have skipped a write that followed `&&` / `||`.
    return [replace(e, guarded=(gated and n == lists) or ee) for e, (n, gated, ee) in zip(effects, flags, strict=True)]


def _split_redirects(tokens: list[str], pending: list[_Heredoc]):
    words, outs, heredoc = [], [], None
    j = 0
    while j < len(tokens):
        tok = tokens[j]
        nxt = tokens[j + 1] if j + 1 < len(tokens) else ""
        if tok.isdigit() and nxt in _OUT | _IN | {">&", "<<"}:
            j += 1
            continue
        if tok in _OUT:
            outs.append((nxt, tok in _APPEND))
            j += 2
        elif tok == ">&":
            if not nxt.isdigit() and nxt != "-":
                outs.append((nxt, False))
            j += 2
        elif tok == "<<":
            heredoc = pending.pop(0) if pending else None
            j += 2
        elif tok in _IN:
            j += 2
        else:
            words.append(tok)
            j += 1
    return words, outs, heredoc


def _simple(tokens: list[str], cwd: str | None, pending: list[_Heredoc], watched: list[str],
            content_of: Callable[[str], str | None], effects: list[Effect]) -> str | None:
    """Interpret one simple command; returns the cwd after it."""
    words, outs, heredoc = _split_redirects(tokens, pending)
    while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] in _PREFIXES):
        words = words[1:]
    if words and words[0] == "timeout" and len(words) > 2:
        words = words[2:]
    name = posixpath.basename(words[0]) if words else ""
    args = words[1:]
    targets = [(resolve(t, cwd), t, append) for t, append in outs if not t.startswith(_DEVICES)]
    if name == "cd":
        return resolve(args[0], cwd) if args else None
    if heredoc is not None and ((name == "cat" and targets) or name == "tee"):
        _heredoc_write(name, args, targets, heredoc, cwd, effects)
        return cwd
    if heredoc is not None and name != "apply_patch" and _WRITE_IN_CODE.search(heredoc.body):
        effects += [Effect("taint", p, reason=f"a heredoc fed to `{name}` names it next to a write")
                    for p in _mentions(heredoc.body, watched)]
    for path, raw, _ in targets:
        effects.append(Effect("taint", path or raw, reason=f"written by a shell redirect of `{name or '?'}`"))
    if name == "apply_patch" and heredoc is not None:
        effects.append(Effect("patch", cwd or "", content=heredoc.body if heredoc.certain() else None,
                              reason="" if heredoc.certain() else "an apply_patch heredoc with shell expansions"))
        return cwd
    if name in ("cp", "mv", "install"):
        _copy(name, args, cwd, watched, effects)
    elif name == "rm":
        for arg in (a for a in args if not a.startswith("-")):
            path = resolve(arg, cwd)
            effects.append(Effect("delete", path) if path else Effect("taint", arg, reason="rm of an unresolved path"))
    elif name in _INTERPRETERS:
        code = " ".join(args)
        for arg in args:
            path = resolve(arg, cwd)
            script = content_of(path) if path else None
            if script is not None:
                code += "\n" + script
        if _WRITE_IN_CODE.search(code):
            effects += [Effect("taint", p, reason=f"may be written by a `{name}` command or script that names it")
                        for p in _mentions(code, watched)]
    elif name in ("sed", "perl", "awk") and not any(a.startswith("-i") or a == "inplace" for a in args):
        pass
    elif name in _READ_ONLY:
        for i, arg in enumerate(args[:-1]):
            if arg == "-o" and (path := resolve(args[i + 1], cwd)) in watched:
                effects.append(Effect("taint", path, reason=f"the output of `{name}`"))
    elif (name == "find" and not any(a in ("-delete", "-exec", "-execdir") for a in args)) or \
            (name == "git" and args[:1] and args[0] in ("status", "diff", "log", "show", "ls-files", "rev-parse")):
        pass
    else:
        named = {resolve(a, cwd) for a in args} | set(_mentions(" ".join(args), watched))
        effects += [Effect("taint", p, reason=f"`{name}` may have changed it") for p in watched if p in named]
    return cwd


def _heredoc_write(name: str, args: list[str], targets: list, doc: _Heredoc, cwd: str | None,
                   effects: list[Effect]) -> None:
    append_all = name == "tee" and any(a in ("-a", "--append") for a in args)
    files = [(resolve(a, cwd), a, append_all) for a in args if name == "tee" and not a.startswith("-")]
    if name == "cat" and [a for a in args if a != "-"]:
        for path, raw, _ in targets:
            effects.append(Effect("taint", path or raw, reason="`cat` of files and a heredoc"))
        return
    for path, raw, append in targets + files:
        if path is None or not doc.certain():
            why = "an unquoted heredoc whose body the shell would expand" if doc.closed else "an unclosed heredoc"
            effects.append(Effect("taint", path or raw, reason=why))
        else:
            effects.append(Effect("append" if append else "write", path, content=doc.body))


def _copy(name: str, args: list[str], cwd: str | None, watched: list[str], effects: list[Effect]) -> None:
    options = [a for a in args if a.startswith("-")]
    paths = [a for a in args if not a.startswith("-")]
    dest = resolve(paths[-1], cwd) if paths else None
    if len(paths) < 2 or dest is None or set(options) - _COPY_OPTIONS or name == "install":
        for p in [resolve(a, cwd) for a in paths] + _mentions(" ".join(paths), watched):
            if p in watched:
                effects.append(Effect("taint", p, reason=f"an `{name}` this importer does not follow"))
        return
    sources = paths[:-1]
    is_dir = paths[-1] in (".", "..") or paths[-1].endswith("/") or len(sources) > 1 or \
        any(w.startswith(dest + "/") for w in watched)
    for src in sources:
        source = resolve(src, cwd)
        target = posixpath.join(dest, posixpath.basename(src)) if is_dir else dest
        if source is None or any(c in src for c in "*?["):
            effects.append(Effect("taint", target, reason=f"`{name}` from a path this importer cannot resolve"))
        else:
            effects.append(Effect("copy" if name == "cp" else "move", target, source=source))

"""A sandboxed process's output, carried into its log: bounded, and never passing for the trusted side's lines.

The runner (`worker.start_runner`) and the prebuild (`sandbox.start_prebuild`) run candidate code, and their
logs are published for readers to audit, beside the lines the grader and the judge write themselves
(TRUSTED_TAGS: `[grader] …`, `[worker] …`). Until grader 0.5.22 they wrote to the log file directly: a
solution could print a line that read as the judge's (`[worker] shape 0: covered loop: GPU span 0.0001 ms`),
or fill the log, and the grading host's disk, up to the sandbox's file-size limit (8 GiB).

Now their stdout and stderr are one pipe, and an `OutputPump` thread in the trusted process that started
them (the judge; the scheduler, for a prebuild) carries it into the log:

- in whole lines, each batch of them one `os.write`, so that no line of theirs splits one the trusted side
  writes to the same file (a partial line waits for its newline; a line longer than the tail's size is
  written in pieces of that size);
- a line is cut wherever a browser or Python's `str.splitlines` would start a new one (a carriage return,
  a form feed, U+2028, …), so that no part of it shows as a line of its own unexamined; control characters
  are written visibly, `^H` and `^[` as `cat -v` does (a backspace or an escape sequence could rub out or
  overwrite what a terminal shows), and bidirectional-text controls as `<U+202E>` (they can show a line's
  text reversed, a tag read from its end);
- a line that starts like a tagged line — a word between square brackets, as seen: fullwidth or other
  compatibility forms folded, accents and invisible characters dropped — other than with the process's own
  tag is prefixed `[runner printed] ` (`[prebuild printed] `), so it cannot pass for the trusted side's,
  not even spelled with look-alike letters; its own `[runner]` lines and untagged ones (ninja's
  `[1/2] c++ …` among them: `1/2` is no word) pass unchanged;
- the first `LOG_HEAD_BYTES` of what it writes pass as they come; past them, a line of the trusted side's
  says so at once (a worker killed at a phase's timeout writes nothing more), bytes and lines are counted
  and only the last `LOG_TAIL_BYTES` kept in memory. When the pipe ends (every process holding it has
  exited), one line of the trusted side's gives the count, and the kept tail follows.

Its owner calls `finish` once the process tree is killed: a process the candidate left behind that still
holds the pipe (out of reach of the kill, where there is no sandbox) costs a bounded wait and one line, never
a hang or an exception in the grading.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import threading
import unicodedata
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .failure import one_line
from .settings import LOG_HEAD_BYTES, LOG_TAIL_BYTES

#: The tags that start the lines the trusted side writes into a log: the grader's and the scheduler's
#: (sandbox.py, schedule.py, zygote.py, jail.py), the judge's (judge.log, worker.py) and the baseline worker's.
#: A pump writes its own lines under one of them; a sandboxed process's line that starts like any of them,
#: or like any other tag but its own, is marked (`reads_as_tagged`).
TRUSTED_TAGS = ("grader", "worker", "baseline")

T = TypeVar("T")

#: Bytes read from the pipe at a time.
READ_BYTES = 64 << 10
#: How long `finish` waits for the thread once it was told to stop (it only writes what it holds by then).
STOP_WAIT_S = 5.0

#: Where a browser (CR, CRLF) or `str.splitlines` (VT, FF, FS, GS, RS, NEL, U+2028, U+2029) starts a new line.
LINE_BREAKS = re.compile(rb"\r\n|[\r\x0b\x0c\x1c-\x1e]|\xc2\x85|\xe2\x80[\xa8\xa9]")
#: The C0 control characters left once lines are cut (a tab stays), and DEL: written `^X`.
CONTROLS = re.compile(rb"[\x00-\x08\x0e-\x1b\x1f\x7f]")
#: C1 controls (a terminal may take U+009B for an escape) and bidirectional-text controls: written `<U+XXXX>`.
HIDDEN_CONTROLS = re.compile(rb"\xc2[\x80-\x84\x86-\x9f]|\xe2\x80[\x8e\x8f\xaa-\xae]|\xe2\x81[\xa6-\xa9]|\xd8\x9c")
#: Characters a reader does not see at the start of a line (or inside a tag): format characters (zero-width
#: spaces, joiners, a byte-order mark), combining marks (the accent of a decomposed `ö`), controls.
INVISIBLE_CATEGORIES = frozenset({"Cf", "Mn", "Me", "Cc", "Zl", "Zp"})
#: The longest word between brackets taken for a tag.
TAG_WORD_CHARS = 24


def _caret(match: re.Match[bytes]) -> bytes:
    return b"^" + bytes([match[0][0] ^ 0x40])


def _code_point(match: re.Match[bytes]) -> bytes:
    return f"<U+{ord(match[0].decode()):04X}>".encode()


def _visible(text: str) -> Iterator[str]:
    """`text`'s characters as a reader sees them: compatibility forms folded, invisible ones left out."""
    for char in text:
        for part in unicodedata.normalize("NFKD", char):
            if unicodedata.category(part) not in INVISIBLE_CATEGORIES:
                yield part


def reads_as_tagged(line: bytes, own_tag: bytes) -> bool:
    """Whether a reader could take `line` for one the trusted side wrote: it starts like a tagged line, with a
    word of letters, digits, spaces, '-' or '_' between square brackets, other than the process's own `own_tag`.
    Any such word, not only TRUSTED_TAGS: a look-alike (`[wоrker]`, a Cyrillic о) reads as the real one. What
    starts the line is what a reader sees there: invisible characters and marks dropped, compatibility forms
    folded (`［worker］`), leading blanks skipped."""
    start = line.lstrip(b" \t")
    if line.startswith(own_tag) or not start or (start[0] < 0x80 and start[0] != ord("[")):
        return False  # the common case, at once: a visible ASCII character other than "[" comes first
    seen = ""
    for char in _visible(start.decode("utf-8", errors="replace")):
        if not seen and char.isspace():
            continue
        seen += char
        if len(seen) > TAG_WORD_CHARS + 1 or (len(seen) > 1 and unicodedata.category(char) == "Pe"):
            break
    opening, word, closing = seen[:1], seen[1:-1], seen[-1:]
    return (opening not in ("", "(", "{") and unicodedata.category(opening) == "Ps"
            and closing != "" and unicodedata.category(closing) == "Pe" and 0 < len(word) <= TAG_WORD_CHARS
            and all(c.isalnum() or c in " -_" for c in word) and any(c.isalpha() for c in word))


def shown(raw: bytes, own_tag: bytes, marker: bytes) -> bytes:
    """How one line a sandboxed process printed (`raw`, without its newline) is written into the log: a line
    for each line a reader would see in it, each ending in a newline, controls made visible, and `marker`
    before each that starts like a tagged line other than with the process's `own_tag`."""
    if raw.endswith(b"\r"):  # the line's own CRLF ending, not a break within it
        raw = raw[:-1]
    parts = []
    for part in LINE_BREAKS.split(raw):
        visible = HIDDEN_CONTROLS.sub(_code_point, CONTROLS.sub(_caret, part))
        parts.append(marker + visible if reads_as_tagged(visible, own_tag) else visible)
    return b"\n".join(parts) + b"\n"


def _size(n: int) -> str:
    """'1 MiB', '64 KiB', or '1,000 bytes'."""
    if n and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n:,} bytes"


class _Overflow:
    """What a process printed past the log's head: counted, and its last `keep` bytes held."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.bytes = 0
        self.newlines = 0
        self.tail = bytearray()
        self.tail_starts_a_line = True  # whether the byte before the held tail ended a line
        self.ends_a_line = True

    def add(self, data: bytes) -> None:
        if not data:
            return
        self.bytes += len(data)
        self.newlines += data.count(b"\n")
        self.ends_a_line = data.endswith(b"\n")
        self.tail += data
        if len(self.tail) > 2 * self.keep:  # trimmed now and then, not on every read
            self._trim()

    def _trim(self) -> None:
        cut = len(self.tail) - self.keep
        if cut > 0:
            self.tail_starts_a_line = self.tail[cut - 1] == ord("\n")
            del self.tail[:cut]

    @property
    def lines(self) -> int:
        """Lines as printed: one per newline, and an unfinished last one."""
        return self.newlines + (0 if self.ends_a_line else 1)

    def last_lines(self) -> list[bytes]:
        """The held tail's lines (without newlines), less a first one cut short where a whole one follows."""
        self._trim()
        lines = bytes(self.tail).split(b"\n")
        if self.ends_a_line:
            lines.pop()
        if not self.tail_starts_a_line and len(lines) > 1:
            lines.pop(0)
        return lines


class OutputPump:
    """A sandboxed process's stdout and stderr, carried into a log by a daemon thread.

    `process` names it in what the log says ("runner", "prebuild"); `writer` is the tag of the trusted side
    that owns the log ("worker" in the judge, "grader" in the scheduler), for the lines the pump writes
    itself. Hand `write_end` to its Popen (`stdout=`, with `stderr=subprocess.STDOUT`), call `start` once it
    has started (no thread runs while Popen forks), and `finish` once it and everything it started was
    killed. The log's descriptor is duplicated: the caller may close its own."""

    def __init__(self, log_fd: int, process: str, writer: str, head_bytes: int = LOG_HEAD_BYTES,
                 tail_bytes: int = LOG_TAIL_BYTES) -> None:
        if writer not in TRUSTED_TAGS:
            raise ValueError(f"the pump writes its own lines as the trusted side's, not as [{writer}]")
        self.process, self.writer = process, writer
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self.own_tag, self.marker = f"[{process}]".encode(), f"[{process} printed] ".encode()
        self._log = os.dup(log_fd)
        self._read_end, self.write_end = os.pipe()
        self._wake_read, self._wake_write = os.pipe()
        self._head_left = head_bytes
        self._partial = bytearray()  # the line being printed, while the head has room
        self._overflow: _Overflow | None = None
        self._log_broken = False
        self._held_open_s = 0.0  # set by `finish` before it stops a thread that never saw the pipe end
        self._thread: threading.Thread | None = None
        self._finished = False

    def launch(self, start: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`start(*args, **kwargs)` with the pipe as the process's stdout and stderr (`jail.start`, say), then
        `start` this side; where it raises, the pump is finished and nothing stays open."""
        try:
            launched = start(*args, stdout=self.write_end, stderr=subprocess.STDOUT, **kwargs)
        except BaseException:
            self.finish(0)
            raise
        self.start()
        return launched

    def start(self) -> None:
        """Read the pipe from now on; the process holds its write end, so this side's copy is closed."""
        os.close(self.write_end)
        self._thread = threading.Thread(target=self._pump, name=f"{self.process}-output", daemon=True)
        self._thread.start()

    def finish(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the pipe's end, then stop the thread (a process left behind holds the
        pipe open: the log says so); close this side's descriptors. Never raises, never waits much longer
        than `timeout_s` (STOP_WAIT_S at most, for a thread that was told to stop); a second call does
        nothing."""
        if self._finished:
            return
        self._finished = True
        thread = self._thread
        if thread is None:  # never started: its process did not start either
            self._close(self.write_end)
        else:
            thread.join(max(timeout_s, 0.0))
            if thread.is_alive():
                self._held_open_s = timeout_s
                with contextlib.suppress(OSError):
                    os.write(self._wake_write, b"\0")
                thread.join(STOP_WAIT_S)
            if thread.is_alive():  # stuck writing the log: its descriptors stay with it
                return
        self._close(self._read_end, self._wake_read, self._wake_write, self._log)

    @staticmethod
    def _close(*fds: int) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _pump(self) -> None:
        """The thread: read until the pipe ends or `finish` wakes it, then write what is left and the count."""
        woken, failure = False, None
        try:
            poller = select.poll()
            poller.register(self._read_end, select.POLLIN)
            poller.register(self._wake_read, select.POLLIN)
            while True:
                if self._wake_read in dict(poller.poll()):
                    woken = True
                    break
                chunk = os.read(self._read_end, READ_BYTES)
                if not chunk:
                    break
                self._take(chunk)
        except Exception as exc:  # said in the log, never raised into the grading
            failure = one_line(type(exc).__name__, str(exc))
        with contextlib.suppress(Exception):
            self._write(self._ending(woken, failure))

    def _take(self, chunk: bytes) -> None:
        """One read: lines written while the head has room; past it, counted and the tail kept."""
        if self._overflow is not None:
            self._overflow.add(chunk)
            return
        self._partial += chunk
        printed, start = [], 0
        while True:  # whole lines, and pieces of `tail_bytes` of a longer one: what the head and the tail hold
            newline = self._partial.find(b"\n", start, start + self.tail_bytes + 1)
            if newline >= 0:
                end = newline + 1
            elif len(self._partial) - start > self.tail_bytes:
                end = start + self.tail_bytes
            else:
                break
            printed.append(bytes(self._partial[start:end]))
            start = end
        del self._partial[:start]
        self._write(self._head(printed))

    def _head(self, printed: list[bytes]) -> bytes:
        """What of `printed` (lines as printed, each with its newline if it had one) the head has room for,
        shown; the rest, and the partial line after it, start the overflow."""
        out = bytearray()
        for i, raw in enumerate(printed):
            line = shown(raw.removesuffix(b"\n"), self.own_tag, self.marker)
            if len(line) > self._head_left:
                self._overflow = _Overflow(self.tail_bytes)
                self._overflow.add(b"".join(printed[i:]) + bytes(self._partial))
                self._partial.clear()
                out += self._cut_notice()
                break
            out += line
            self._head_left -= len(line)
        return bytes(out)

    def _cut_notice(self) -> bytes:
        """Said the moment the head is full: a grader killed before the pipe ends (a phase's timeout) never
        writes the count and tail, and its log then still says that output went on past this point."""
        return (f"[{self.writer}] the {self.process}'s output goes on past the {_size(self.head_bytes)} this log "
                f"holds as it comes: the rest is counted, and its last {_size(self.tail_bytes)} follow once the "
                f"{self.process} ends\n").encode()

    def _ending(self, woken: bool, failure: str | None) -> bytes:
        """What the log gets once the pipe ends: the unfinished last line, why it ended early if it did, and
        the count of what the head had no room for, with its tail."""
        out = bytearray()
        if self._partial and self._overflow is None:
            last = bytes(self._partial)
            self._partial.clear()
            out += self._head([last])
        tag = f"[{self.writer}]"
        if woken:
            out += (f"{tag} a process the {self.process} left behind still held its output open "
                    f"{self._held_open_s:.1f} s after it ended: what it printed later is not in this log\n").encode()
        if failure is not None:
            out += f"{tag} the {self.process}'s output could not be read to its end ({failure})\n".encode()
        over = self._overflow
        if over is not None and over.bytes:
            tail, count = self._tail(over)
            out += (f"{tag} the {self.process} printed {over.bytes:,} bytes ({over.lines:,} lines) beyond the "
                    f"{_size(self.head_bytes)} of its output this log holds above; the last {count:,} of those "
                    f"lines follow:\n").encode()
            out += tail
        return bytes(out)

    def _tail(self, over: _Overflow) -> tuple[bytes, int]:
        """The overflow's last lines as shown, `tail_bytes` of the log at most, and how many they are."""
        kept: list[bytes] = []
        size = 0
        for raw in reversed(over.last_lines()):
            line = shown(raw, self.own_tag, self.marker)
            if size + len(line) > self.tail_bytes:
                if not kept:  # one line longer than the tail: its end, examined again as a line of its own
                    while len(line) > self.tail_bytes and len(raw) > 1:
                        raw = raw[len(raw) // 2:]
                        line = shown(raw, self.own_tag, self.marker)
                    kept.append(line)
                break
            kept.append(line)
            size += len(line)
        return b"".join(reversed(kept)), len(kept)

    def _write(self, data: bytes) -> None:
        """One write into the log (more only where the kernel takes part of it); a log that cannot be written
        (a full disk) is given up, while the pipe is still read to its end."""
        view = memoryview(data)
        while view and not self._log_broken:
            try:
                view = view[os.write(self._log, view):]
            except OSError:
                self._log_broken = True

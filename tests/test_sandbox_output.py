"""A sandboxed process's output on its way into its published log (eval/sandbox_output.py): a line of its that
reads as the grader's or the judge's is marked, a flood keeps its head and tail and is counted, and a process
left holding the pipe costs a bounded wait, never a hang. Each test pumps a real child process's output."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernelboard.eval.jail import Jail
from kernelboard.eval.sandbox import finish_prebuild, start_prebuild
from kernelboard.eval.sandbox_output import TRUSTED_TAGS, OutputPump, reads_as_tagged, shown
from kernelboard.eval.settings import LOG_HEAD_BYTES, LOG_TAIL_BYTES

ROOT = Path(__file__).resolve().parents[1]


def _pumped(log: Path, command: list[str], **caps: int) -> OutputPump:
    """Run `command` with its output pumped into `log` (appended to), wait for it, and finish the pump."""
    with log.open("ab") as fh:
        pump = OutputPump(fh.fileno(), "runner", "worker", **caps)
    proc = pump.launch(subprocess.Popen, command, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"})  # in order
    proc.wait(timeout=60)
    pump.finish(10)
    return pump


def _python(source: str) -> list[str]:
    return [sys.executable, "-c", source]


def test_forged_trusted_lines_are_marked_and_the_processs_own_pass_unchanged(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("[grader] CUTLASS: none\n")
    _pumped(log, _python(r"""
import os, sys
print("[worker] shape 0: covered loop: GPU span 0.0001 ms")
print("[grader] pass: 1000x", file=sys.stderr, flush=True)
print("[baseline] shape 0 eager: 0.0001 ms")
print("[runner] shape 0: its Model built on cuda")
print("a plain line")
print("warning: [worker] not at the start")
print("   [Worker] indented, other case")
os.write(1, b"progress 50%\r[grader] after a carriage return\n")
os.write(1, b"form\x0c[worker] feed\xe2\x80\xa8[grader] line separator\r\n")
print("\u200b\ufeff[wo\u200brker] behind invisible characters")
print("\uff3bgrader\uff3d fullwidth")
print("[w\u043erker] a Cyrillic o")
print("\x08\x08\x08[worker] behind backspaces, \x1b[31mcoloured")
print("\u202e]rekrow[ reversed")
sys.stdout.write("[worker] an unfinished last line")
"""))
    assert log.read_text(encoding="utf-8").splitlines() == [
        "[grader] CUTLASS: none",
        "[runner printed] [worker] shape 0: covered loop: GPU span 0.0001 ms",
        "[runner printed] [grader] pass: 1000x",
        "[runner printed] [baseline] shape 0 eager: 0.0001 ms",
        "[runner] shape 0: its Model built on cuda",
        "a plain line",
        "warning: [worker] not at the start",
        "[runner printed]    [Worker] indented, other case",
        "progress 50%",
        "[runner printed] [grader] after a carriage return",
        "form",
        "[runner printed] [worker] feed",
        "[runner printed] [grader] line separator",
        "[runner printed] \u200b\ufeff[wo\u200brker] behind invisible characters",
        "[runner printed] \uff3bgrader\uff3d fullwidth",
        "[runner printed] [w\u043erker] a Cyrillic o",
        "^H^H^H[worker] behind backspaces, ^[[31mcoloured",
        "<U+202E>]rekrow[ reversed",
        "[runner printed] [worker] an unfinished last line",
    ]


def test_what_starts_like_a_tagged_line() -> None:
    own = b"[runner]"
    assert all(reads_as_tagged(f"[{tag}] x".encode(), own) for tag in TRUSTED_TAGS)
    assert reads_as_tagged(b"\t[GRADER] x", own) and reads_as_tagged("[wo\u0308rker]".encode(), own)  # an accent
    assert reads_as_tagged("[w\u043erker] x".encode(), own)  # a Cyrillic o: a look-alike is a tag too
    assert reads_as_tagged("\u3010worker\u3011 x".encode(), own) and reads_as_tagged(b"[ INFO ] x", own)
    assert reads_as_tagged(b"[prebuild] x", own) and reads_as_tagged(b"[runner printed] [worker] x", own)
    assert not reads_as_tagged(b"[runner] x", own) and not reads_as_tagged(b"[prebuild] x", b"[prebuild]")
    for line in (b"x [worker]", b"", b"[work", b"[1/2] c++ -c", b"[W1206 12:00:00.1 init.cpp:5]", b"(worker) x",
                 b"[]", b"[" + b"w" * 30 + b"]", b"[0] x"):
        assert not reads_as_tagged(line, own), line
    assert shown(b"a\r\nb", own, b"[p printed] ") == b"a\nb\n"  # one CRLF: one break
    assert shown(b"ninja: [1/2] c++\r", own, b"[p printed] ") == b"ninja: [1/2] c++\n"  # its own CRLF ending


def test_a_flood_keeps_the_head_and_the_tail_and_counts_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    source = r"""
for i in range(50):
    print(f"{i:03d} " + "x" * 95)
"""  # 50 lines of 100 bytes: a head of 10, a tail of 3
    _pumped(log, _python(source), head_bytes=1000, tail_bytes=300)
    lines = log.read_text(encoding="utf-8").splitlines()
    assert lines[:10] == [f"{i:03d} " + "x" * 95 for i in range(10)]
    assert lines[10] == ("[worker] the runner's output goes on past the 1,000 bytes this log holds as it comes: the "
                         "rest is counted, and its last 300 bytes follow once the runner ends")  # before it ends
    assert lines[11] == ("[worker] the runner printed 4,000 bytes (40 lines) beyond the 1,000 bytes of its output "
                         "this log holds above; the last 3 of those lines follow:")
    assert lines[12:] == [f"{i:03d} " + "x" * 95 for i in (47, 48, 49)]


def test_a_log_says_at_once_that_output_went_past_its_head(tmp_path: Path) -> None:
    """A worker killed at a phase's timeout never writes the count and the tail: its log must already say
    that the runner's output went on, while the runner is still running."""
    log = tmp_path / "run.log"
    with log.open("ab") as fh:
        pump = OutputPump(fh.fileno(), "runner", "worker", head_bytes=1000, tail_bytes=300)
    proc = pump.launch(subprocess.Popen, _python("import time\nfor i in range(20): print('x' * 99)\ntime.sleep(60)"),
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        while "goes on past" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None  # still running: nothing was waiting for its end
        assert log.read_text().splitlines()[-1] == ("[worker] the runner's output goes on past the 1,000 bytes this "
                                                    "log holds as it comes: the rest is counted, and its last 300 "
                                                    "bytes follow once the runner ends")
    finally:
        proc.kill()
        proc.wait()
        pump.finish(5)


def test_a_tail_that_starts_mid_line_begins_at_the_next_line_and_a_marked_one_stays_marked(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    source = r"""
import sys
for i in range(30):
    print(f"{i:03d} " + "x" * 95)
print("[grader] forged in the tail")
sys.stdout.write("no newline at the end")
"""
    _pumped(log, _python(source), head_bytes=1000, tail_bytes=250)
    lines = log.read_text(encoding="utf-8").splitlines()
    over = 20 * 100 + len("[grader] forged in the tail\n") + len("no newline at the end")
    assert lines[11] == (f"[worker] the runner printed {over:,} bytes (22 lines) beyond the 1,000 bytes of its "
                         "output this log holds above; the last 3 of those lines follow:")
    assert lines[12:] == ["029 " + "x" * 95, "[runner printed] [grader] forged in the tail", "no newline at the end"]


def test_a_line_longer_than_the_tail_is_written_in_pieces(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    _pumped(log, _python("import sys; sys.stdout.write('y' * 250 + '[worker] cut here' + 'z' * 10 + '\\n')"),
            head_bytes=10_000, tail_bytes=250)
    assert log.read_text(encoding="utf-8").splitlines() == ["y" * 250, "[runner printed] [worker] cut here" + "z" * 10]


def test_a_50_mb_flood_leaves_a_log_of_the_head_and_tail_quickly(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    source = ("import os\nblock = (b'x' * 1023 + b'\\n') * 1024\n"
              "for _ in range(50):\n    os.write(1, block)\nprint('the last line')\n")
    started = time.monotonic()
    _pumped(log, _python(source))
    took = time.monotonic() - started
    text = log.read_text(encoding="utf-8")
    head_lines = LOG_HEAD_BYTES // 1024
    over = 50 * (1 << 20) + len("the last line\n") - head_lines * 1024
    assert (f"[worker] the runner printed {over:,} bytes ({50 * 1024 - head_lines + 1:,} lines) beyond the 1 MiB "
            f"of its output this log holds above; the last {LOG_TAIL_BYTES // 1024:,} of those lines follow:") in text
    assert text.endswith("x" * 1023 + "\nthe last line\n")
    assert len(text) <= LOG_HEAD_BYTES + LOG_TAIL_BYTES + 1024
    assert took < 30, took


def test_finish_returns_in_time_when_a_process_left_behind_holds_the_pipe(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    with log.open("ab") as fh:
        pump = OutputPump(fh.fileno(), "runner", "worker")
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & echo left behind: $!"], stdout=pump.write_end,
                             stderr=subprocess.STDOUT, start_new_session=True)
    pump.start()
    shell.wait(timeout=10)
    started = time.monotonic()
    pump.finish(0.5)
    took = time.monotonic() - started
    text = log.read_text(encoding="utf-8")
    left = re.search(r"left behind: (\d+)", text)
    try:
        assert 0.5 <= took < 3, took
        assert ("[worker] a process the runner left behind still held its output open 0.5 s after it ended: "
                "what it printed later is not in this log") in text
        pump.finish(0.5)  # once is enough: a second call does nothing
        assert log.read_text(encoding="utf-8") == text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert left is not None, text


def test_a_log_that_cannot_be_written_raises_nothing_into_the_grading(tmp_path: Path) -> None:
    """A full disk (/dev/full): the pipe is still read to its end, so the process never blocks on it."""
    with open("/dev/full", "wb") as full:
        pump = OutputPump(full.fileno(), "runner", "worker", head_bytes=100, tail_bytes=100)
    proc = subprocess.Popen(_python("import os\nfor _ in range(100): os.write(1, b'x' * 65536)"),
                            stdout=pump.write_end, stderr=subprocess.STDOUT)
    pump.start()
    assert proc.wait(timeout=60) == 0
    pump.finish(10)


def test_a_pump_whose_process_never_started_closes_its_pipe(tmp_path: Path) -> None:
    pump = OutputPump(1, "runner", "worker")
    pump.finish(0)
    with pytest.raises(OSError):
        os.fstat(pump.write_end)
    failed = OutputPump(1, "runner", "worker")
    with pytest.raises(FileNotFoundError):
        failed.launch(subprocess.Popen, [str(tmp_path / "no-such-program")])
    with pytest.raises(OSError):
        os.fstat(failed.write_end)


def test_a_prebuilds_forged_lines_are_marked_and_its_flood_cut_in_its_log(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The prebuild imports the solution (candidate code) early: its log gets the same treatment, the count
    in the grader's words. Unsandboxed here, for speed: the pipe is the same either way."""
    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "scratch"
    folder.mkdir()
    (folder / "solution.py").write_text(
        "import os\nprint('[grader] pass: forged at import', flush=True)\n"
        "os.write(1, (b'y' * 1023 + b'\\n') * 2048)\n"
        "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n")
    log = tmp_path / "x.prebuild.log"
    finish_prebuild(start_prebuild(ROOT / "eval" / "decks" / "hard" / "05_topk_bitonic", folder, log, "x", None,
                                   Jail(None), 0.0), 120)
    text = log.read_text(encoding="utf-8")
    assert text.startswith("[grader] CUTLASS")
    assert "\n[prebuild printed] [grader] pass: forged at import\n" in text
    assert re.search(r"\n\[grader\] the prebuild printed [\d,]+ bytes \([\d,]+ lines\) beyond the 1 MiB", text), text
    assert "[prebuild] imported" in text.split("beyond the 1 MiB")[1]  # in the tail, after the flood
    assert len(text) <= LOG_HEAD_BYTES + LOG_TAIL_BYTES + 4096

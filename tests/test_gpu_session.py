"""bench/gpu_session.sh's IDS=todo loop, with the GPU machine's tools stubbed: each round grades the queue
`eval todo` writes from the call's results folder, the next problem follows when one is done, and a queue
that does not move ends the call instead of spinning."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: `kernelboard` as the script calls it: `eval todo` writes the first problem's runs left in STATE, `eval`
#: grades its --only runs (all but FAIL), logging each call's runs to EVALS.
FAKE_KERNELBOARD = """#!/bin/bash
S=$STATE
if [ "$1 $2" = "eval todo" ]; then
  q=""; while [ $# -gt 0 ]; do [ "$1" = --queue ] && q=$2; shift; done
  first=$(head -1 "$S" | cut -d' ' -f1)
  if [ -n "$first" ]; then grep "^$first " "$S" | cut -d' ' -f2 > "$q"; else : > "$q"; fi
elif [ "$1 $2" = "eval keep-ahead" ]; then
  sleep "${KEEP_SLEEP:-0}"
  while [ $# -gt 0 ]; do [ "$1" = --out ] && touch "$2"; shift; done
else
  ids=(); ex=()
  while [ $# -gt 0 ]; do [ "$1" = --only ] && ids+=("$2"); [ "$1" = --exclude ] && ex+=("$2"); shift; done
  echo "${ids[*]} | ${ex[*]}" >> "$EVALS"
  for id in "${ids[@]}"; do [ "$id" = "${FAIL:-}" ] && continue; grep -v " $id\\$" "$S" > "$S.n"; mv "$S.n" "$S"; done
fi
"""
STUBS = {
    "bin/nvidia-smi": '#!/bin/bash\necho "NVIDIA H100 80GB HBM3, 580.159.04, 0 MiB, 30, 1980 MHz"\n',
    "bin/dpkg": "#!/bin/bash\nexit 0\n",  # unpacks nothing: the stub bwrap below is on PATH (no shared /tmp/bw)
    "bin/bwrap": '#!/bin/bash\necho "bubblewrap 0.8.0"\n',
    "bin/make": "#!/bin/bash\nexit 0\n",
    "root/.venv-eval/bin/pip": "#!/bin/bash\nexit 0\n",
    "root/.venv-eval/bin/python": '#!/bin/bash\ncase "$2" in *gpu_key*) echo h100-sxm;; *) echo torch;; esac\n',
    "root/.venv-eval/bin/kernelboard": FAKE_KERNELBOARD,
}


def _session(tmp_path: Path, left: str, fail: str = "", **more_env: str) -> tuple[str, list[str], str]:
    for name, text in STUBS.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    root = tmp_path / "root"
    (root / "bench").mkdir()
    shutil.copy(ROOT / "bench" / "gpu_session.sh", root / "bench")
    (root / ".carry" / "whl").mkdir(parents=True)
    (root / ".carry" / "bubblewrap_0.8.0_amd64.deb").touch()
    (root / ".carry" / "whl" / "x.whl").touch()
    (tmp_path / "seed").mkdir()
    state, evals = tmp_path / "state", tmp_path / "evals"
    state.write_text(left)
    evals.touch()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "STATE": str(state),
           "EVALS": str(evals), "FAIL": fail, "IDS": "todo", "SEED": str(tmp_path / "seed"),
           "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "DEADLINE": "60",
           "TODO_MIN_LEFT": "5", "EXCLUDE": "*kinetic*", **more_env}
    log = tmp_path / "session.out"
    with log.open("w") as sink:  # a file, not a pipe: the script's 30 s packer loop's sleep would hold a pipe open
        subprocess.run(["bash", "bench/gpu_session.sh"], cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT,
                       timeout=120, check=True)
    for _ in range(100):  # the script writes through `tee`, which may finish a moment after it
        if "== done at" in log.read_text():
            break
        time.sleep(0.1)
    return log.read_text(), evals.read_text().splitlines(), state.read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_todo_rounds_go_on_to_the_next_problem_until_nothing_is_left(tmp_path: Path) -> None:
    out, evals, left = _session(tmp_path, "07 a\n07 b\n01 c\n01 d\n06 e\n")
    assert evals == ["a b | *kinetic*", "c d | *kinetic*", "e | *kinetic*"]
    assert left == ""
    assert "nothing left to grade on h100-sxm" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_queue_that_does_not_move_ends_the_call(tmp_path: Path) -> None:
    out, evals, left = _session(tmp_path, "07 a\n07 b\n01 c\n", fail="a")
    assert evals == ["a b | *kinetic*", "a | *kinetic*"]
    assert left == "07 a\n01 c\n"
    assert "the queue is what the last round was given: stopping" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_keep_ahead_is_cut_short_at_the_call_limit_and_says_so(tmp_path: Path) -> None:
    """A device call killed at its limit returns none of its output: an H100 call of 2026-12-07 went past its 600 s
    while keep-ahead archived 1,081 Triton variants. The archive gets what is left before CALL_LIMIT."""
    started = time.monotonic()
    out, _, left = _session(tmp_path, "07 a\n", KEEP_SLEEP="60", CALL_LIMIT="20")
    assert left == "" and time.monotonic() - started < 50
    said = [line for line in out.splitlines() if "keep-ahead" in line and "CALL_LIMIT 20" in line]
    assert said and ("did not end within the call's last" in said[0] or "no time left" in said[0]), out[-1500:]
    assert "== done at" in out
    assert not (tmp_path / "out" / "triton-kept.tgz").exists()

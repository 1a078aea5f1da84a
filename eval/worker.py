"""The worker process (trusted): `python -m kernelboard.eval.worker JOB.json`, started by
schedule.py through sandbox.py, grades one submission (or times one problem's baselines) and
writes one JSON result atomically to the job's `result_path`.

To grade, it first starts the runner (runner.py), the one process that imports and runs candidate
code, with multiprocessing's spawn context — before it imports torch itself, so that the two
interpreters boot side by side — and then the judge (judge.py) grades through it (link.py). The
runner's process group is killed before the result is written: the result is written last, over
anything the runner put at that path (a forged pass followed by `os._exit`, say). This module
stays light (no torch at import), since the spawned runner imports it again as its main module.

The spawn context is the standard library's, which `torch.multiprocessing` re-exports: its tensor
reductions are not used on purpose. Nothing the runner sends is unpickled (protocol.py), and
inputs reach the runner through a memfd arena rather than pickled shared-memory tensors.

A crash, hang or `os._exit` of this process ends it without a result; the parent turns that into
a status. Speedups and roofline fractions are computed by the parent, not here.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import traceback
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from .atomic import write_text_atomic
from .failure import Failure, one_line
from .phases import Phases


def _run_runner(sock: socket.socket, setup: dict[str, Any]) -> None:
    """The runner process's entry: torch and the candidate's code are imported there only."""
    from .runner import serve

    serve(sock, setup)


def start_runner(job: dict[str, Any]) -> tuple[BaseProcess, socket.socket]:
    """Spawn the runner for a grading job; returns it and the judge's end of its socket. It
    imports nothing of the candidate's until the judge asks."""
    os.environ["PYTHONSAFEPATH"] = "1"  # its interpreter starts without the cwd (the submission) on sys.path
    mine, theirs = socket.socketpair()
    setup = {"problem_path": job["problem_path"], "device": job["device"], "solution_dir": job["solution_dir"],
             "rep_ms": job.get("rep_ms"), "judge_pid": os.getpid()}
    proc = multiprocessing.get_context("spawn").Process(target=_run_runner, args=(theirs, setup),
                                                        name="kernelboard-runner")
    proc.start()
    theirs.close()  # only the runner holds that end now: its death is an end of stream here
    return proc, mine


def _write_result(path: Path, result: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(result, sort_keys=True, default=str))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kernelboard.eval.worker JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    result_path = Path(job["result_path"])
    started = start_runner(job) if job["kind"] == "grade" else None
    result: dict[str, Any] = {}
    phases = Phases(job, result)
    link = None
    try:
        import torch  # while the runner boots

        from . import judge
        from .link import RunnerLink

        link = None if started is None else RunnerLink(*started, phases)
        if job["device"] == "cuda" and not torch.cuda.is_available():
            result.update(status="not_graded", message="no CUDA device visible to the worker")
        elif link is not None:
            judge.grade(job, result, phases, link)
        else:
            judge.baselines(job, result)
    except Failure as failure:
        result.update(status=failure.status, message=failure.message)
        if failure.__cause__ is not None:
            traceback.print_exception(failure.__cause__)
    except Exception as exc:  # escaped our wrappers: the grader's fault before candidate code ran
        traceback.print_exc()
        status = "runtime_error" if result.get("phase") == "candidate" else "not_graded"
        result.update(status=status, message=f"grader error in phase {result.get('phase')}: "
                                             f"{one_line(type(exc).__name__, str(exc))}")
    finally:
        if link is not None:
            link.close()  # the runner and all it started, before the result is written
        elif started is not None:
            started[0].kill()
    print(f"[worker] {result.get('status')}: {result.get('message')}", flush=True)
    _write_result(result_path, result)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The worker process (trusted): `python -m kernelboard.eval.worker JOB.json`, started by
schedule.py through sandbox.py (forked from the zygote, zygote.py, which calls `main` as this
command line would), grades one submission (or times one problem's baselines) and writes one JSON
result atomically to the job's `result_path`.

To grade, it first starts the runner (runner.py), the one process that imports and runs candidate
code, as `python -m kernelboard.eval.runner` inside the job's sandbox (jail.py: bubblewrap, limits) —
before it imports torch itself, so that the two interpreters boot side by side — and then the judge
(judge.py) grades through it (link.py). The
runner's process group is killed before the result is written: the result is written last, over
anything the runner put at that path (a forged pass followed by `os._exit`, say). This module
stays light (no torch at import).

The runner inherits one end of a socket pair and nothing else of the judge's; nothing it sends is
unpickled (protocol.py), and inputs reach it through a memfd arena passed over that socket. Its stdout
and stderr are a pipe the judge carries into this worker's log (sandbox_output.py): bounded, and with any
line of its that reads as the judge's own marked `[runner printed]`.

A crash, hang or `os._exit` of this process ends it without a result; the parent turns that into
a status. Speedups and roofline fractions are computed by the parent, not here.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import jail, proctree
from .atomic import write_text_atomic
from .failure import Failure, one_line
from .job import Job, JobError
from .phases import Phases
from .sandbox_output import OutputPump

_ERROR_TEXT = 16_000  # characters of a failure's error text kept in the result (the runner sends ≤ 4000)
#: The least `RunnerProcess.join` waits for the runner's output to end once its tree has exited (or was waited
#: for as long as the join's timeout allowed): where nothing is left holding the pipe, it ends at once.
OUTPUT_WAIT_MIN_S = 1.0
#: How long `RunnerProcess.join` without a timeout waits for the runner's tree, once the runner has exited.
TREE_WAIT_S = 30.0


class RunnerProcess:
    """The runner as the judge holds it: a process (bwrap's, when sandboxed) with the pid, kill,
    join and exit code that link.py uses; its cgroup is removed once it is reaped. `kill` kills the
    runner's whole tree, bwrap's session and pid namespace included, and `join` waits until every
    process of it has exited (proctree.py), so its GPU memory is free before the next grading, and
    then carries the last of its `output` into the log."""

    def __init__(self, confined: jail.Confined, output: OutputPump | None = None) -> None:
        self.confined, self.pid, self.output = confined, confined.proc.pid, output
        self.sandboxed = confined.description != jail.UNSANDBOXED
        self.tree: list[int] = []  # the processes below it, as found when it was killed

    def kill(self) -> None:
        if self.confined.proc.poll() is None:  # while it lives, its tree hangs below it
            self.tree += [pid for pid in proctree.descendants(self.pid) if pid not in self.tree]
        proctree.kill(self.tree)
        with contextlib.suppress(ProcessLookupError):
            self.confined.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        started = time.monotonic()
        deadline = started + (timeout or TREE_WAIT_S)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.confined.proc.wait(timeout=timeout)
        if self.confined.proc.returncode is None:
            return
        left = proctree.wait_exited(self.tree, max(0.0, deadline - time.monotonic()))
        if left:
            print(f"[worker] {len(left)} process(es) of the runner still ran {time.monotonic() - started:.0f} s "
                  f"after it was killed (pids {', '.join(map(str, left))})", flush=True)
        self.confined.release()
        if self.output is not None:  # its pipe ends once every process holding it has exited: by now, in a sandbox
            self.output.finish(max(OUTPUT_WAIT_MIN_S, deadline - time.monotonic()))

    @property
    def exitcode(self) -> int | None:
        code = self.confined.proc.poll()
        if code is not None and self.sandboxed and code > 128:  # bwrap reports a signal as 128 + its number
            return -(code - 128)
        return code


def start_runner(job: Job) -> tuple[RunnerProcess, socket.socket]:
    """Start the runner for a grading job in the job's jail; returns it and the judge's end of its
    socket. It gets a private copy of the problem folder (the decks are hidden from it) and imports
    nothing of the candidate's until the judge asks."""
    if job.solution_dir is None:
        raise ValueError("a grading job names no solution_dir")
    solution_dir = job.solution_dir
    problem = jail.problem_copy(job.problem_path, solution_dir)
    mine, theirs = socket.socketpair()
    setup = {"problem_path": str(problem), "device": job.device, "solution_dir": str(solution_dir),
             "rep_ms": job.rep_ms, "parent_pid": os.getpid() if job.jail is None else None}
    command = [sys.executable, "-m", "kernelboard.eval.runner", str(theirs.fileno()), json.dumps(setup)]
    cell = job.jail if job.jail is not None else jail.Jail(None)
    owner = Path(job.caches[0]).name if job.caches else str(solution_dir)  # the cache key: the prebuild's uid
    output = OutputPump(1, "runner", "worker")  # fd 1 is this worker's log
    confined = output.launch(jail.start, cell, command, writable=[solution_dir, *job.caches], owner=owner,
                             cwd=solution_dir, env={**os.environ, "PYTHONSAFEPATH": "1"}, device=job.device,
                             readable=[jail.problem_root(solution_dir)], pass_fds=(theirs.fileno(),))
    theirs.close()  # only the runner holds that end now: its death is an end of stream here
    return RunnerProcess(confined, output), mine


def _write_result(path: Path, result: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(result, sort_keys=True, default=str))


def main(argv: list[str]) -> int:
    clock_started = time.monotonic()
    if len(argv) != 1:
        print("usage: python -m kernelboard.eval.worker JOB.json", file=sys.stderr)
        return 2
    try:
        job = Job.from_json(Path(argv[0]).read_text())
        result_path = job.result_path
        if result_path is None:  # from_json requires one; said again for the type checker
            raise JobError("key 'result_path': a value is required")
    except (OSError, UnicodeDecodeError, JobError) as exc:  # no result path to trust: the parent reports it
        print(f"{argv[0]}: not a usable job file: {exc}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {}
    try:
        started = start_runner(job) if job.kind == "grade" else None
    except (OSError, ValueError) as exc:  # the sandbox could not be made: the grader's problem, not the kernel's
        traceback.print_exc()
        _write_result(result_path, {"status": "not_graded", "message": f"could not start the runner's sandbox: "
                                                                       f"{one_line(type(exc).__name__, str(exc))}"})
        return 0
    phases = Phases.for_job(job, result)
    link = None
    try:
        import torch  # while the runner boots

        from . import judge

        judge.start_clock(clock_started)
        from .link import RunnerLink

        link = None if started is None else RunnerLink(*started, phases)
        if job.device == "cuda" and not torch.cuda.is_available():
            result.update(status="not_graded", message="no CUDA device visible to the worker")
        elif link is not None:
            judge.grade(job, result, phases, link)
        else:
            judge.baselines(job, result)
    except Failure as failure:
        result.update(status=failure.status, message=failure.message)
        if failure.detail:  # the whole error text, for reproducible.classify in the parent
            result["error_text"] = failure.detail[:_ERROR_TEXT]
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
            started[0].join(timeout=10)
    if started is not None:
        result["sandbox"] = started[0].confined.description
    print(f"[worker] {result.get('status')}: {result.get('message')}", flush=True)
    _write_result(result_path, result)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

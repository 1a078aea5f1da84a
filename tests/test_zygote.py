"""Judges forked from the zygote (eval/zygote.py) against judges started as fresh interpreters.

A baseline job with nothing to time is the cheapest real judge: it imports `triton` (probe_environment),
then the problem's reference.py, whose copy here reports from inside the judge what a candidate's folder
could have changed (sys.path, planted modules) and what must be as in a fresh judge (session, stdio, working
folder, environment, interpreter flags, torch's thread count) — or dies, where its working folder says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kernelboard.errors import UsageError
from kernelboard.eval import sandbox, zygote
from kernelboard.eval.job import Job

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = ROOT / "eval" / "decks" / "hard" / "03_paged_attention"

PROBE = '''

import json as _json
import os as _os
import signal as _signal
import sys as _sys

if _os.path.exists("die-by-kill"):
    _os.kill(_os.getpid(), _signal.SIGKILL)
if _os.path.exists("die-by-segv"):
    import ctypes as _ctypes
    _ctypes.string_at(0)
if _os.path.exists("die-by-exit"):
    _os._exit(3)
try:
    import planted_probe as _planted
    _planted_file = _planted.__file__
except ImportError:
    _planted_file = None
import numpy as _numpy  # noqa: F401
import yaml as _yaml  # noqa: F401

print("PROBE " + _json.dumps({
    "ppid": _os.getppid(),
    "leads_session": _os.getsid(0) == _os.getpid(), "leads_group": _os.getpgid(0) == _os.getpid(),
    "cwd": _os.getcwd(), "path": _sys.path, "argv": _sys.argv, "env": dict(_os.environ),
    "stdio": [_os.readlink(f"/proc/self/fd/{fd}") for fd in range(3)],
    "safe_path": _sys.flags.safe_path, "dont_write_bytecode": _sys.dont_write_bytecode,
    "unbuffered": [_sys.stdout.write_through, type(_sys.stdout.buffer).__name__],
    "threads": torch.get_num_threads(), "cuda_initialized": torch.cuda.is_initialized(),
    "sigint": repr(_signal.getsignal(_signal.SIGINT)), "planted": _planted_file,
    "modules": {name: getattr(_sys.modules.get(name), "__file__", None)
                for name in ("triton", "numpy", "yaml", "planted_probe")},
}), flush=True)
'''

PLANTED = "import os, sys\nprint(f'PLANTED {__name__} imported by pid {os.getpid()}', flush=True)\n"


@pytest.fixture(scope="module")
def problem(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deck") / PROBLEM.name
    shutil.copytree(PROBLEM, folder, ignore=shutil.ignore_patterns("__pycache__"))
    with (folder / "reference.py").open("a") as fh:
        fh.write(PROBE)
    return folder


def _judge(problem: Path, root: Path, name: str, *, fate: str | None = None) -> tuple[sandbox.WorkerOutcome, str]:
    """Run a baseline job with nothing to time in a fresh working folder holding planted modules."""
    workdir = root / name
    workdir.mkdir(parents=True)
    for planted in ("planted_probe", "triton", "numpy", "yaml"):
        (workdir / f"{planted}.py").write_text(PLANTED)
    if fate:
        (workdir / f"die-by-{fate}").touch()
    job = Job(kind="baseline", problem_path=problem, device="cpu", base_seed=1, variants=("eager",), todo={})
    outcome = sandbox.run_worker(job, workdir, root / f"{name}.log", 120.0, "zygote-probe")
    return outcome, outcome.log_path.read_text()


def _probe(log: str) -> dict[str, Any]:
    lines = [line for line in log.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, log[-3000:]
    return json.loads(lines[0].removeprefix("PROBE "))


def test_a_forked_judge_sees_what_a_fresh_one_sees_and_no_planted_module(problem: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    outcome, log = _judge(problem, tmp_path, "forked")
    forked = _probe(log)
    assert outcome.result["status"] == "ok", log[-3000:]
    shared = zygote.SHARED.zygote
    assert shared is not None and forked["ppid"] == shared.proc.pid  # it did come from the zygote

    monkeypatch.setenv("KERNELBOARD_ZYGOTE", "0")
    outcome, fresh_log = _judge(problem, tmp_path, "fresh")
    fresh = _probe(fresh_log)
    assert outcome.result["status"] == "ok", fresh_log[-3000:]
    assert fresh["ppid"] == os.getpid()
    del fresh["env"]["KERNELBOARD_ZYGOTE"]

    # the planting works: a plain `python -c` in that folder imports them
    said = subprocess.run([sys.executable, "-c", "import planted_probe, yaml"], cwd=tmp_path / "fresh",
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                               if k != "PYTHONSAFEPATH"}).stdout
    assert said.count("PLANTED") == 2
    for probe, text, name in ((forked, log, "forked"), (fresh, fresh_log, "fresh")):
        workdir = str((tmp_path / name).resolve())
        assert "PLANTED" not in text and probe["planted"] is None
        assert all(module and not module.startswith(workdir) for module in probe["modules"].values()
                   if module != probe["modules"]["planted_probe"])
        assert "" not in probe["path"] and not any(p.startswith(workdir) for p in probe["path"])
        assert probe["leads_session"] and probe["leads_group"]
        assert probe["cwd"] == workdir
        assert probe["stdio"] == ["/dev/null", str(tmp_path / f"{name}.log"), str(tmp_path / f"{name}.log")]
        assert probe["safe_path"] and probe["dont_write_bytecode"] and probe["unbuffered"] == [True, "FileIO"]
        assert probe["env"]["TRITON_INTERPRET"] == "1" and probe["env"]["PYTHONSAFEPATH"] == "1"
        assert not probe["cuda_initialized"]
    for key in ("path", "env", "safe_path", "dont_write_bytecode", "unbuffered", "threads", "sigint", "modules"):
        assert forked[key] == fresh[key], key
    assert forked["argv"][0] == fresh["argv"][0] and Path(fresh["argv"][0]).name == "worker.py"
    assert [Path(forked["argv"][1]).name, Path(fresh["argv"][1]).name] == ["forked.job.json", "fresh.job.json"]


@pytest.mark.parametrize(("fate", "said"), [("kill", "the worker died from SIGKILL"),
                                           ("segv", "the worker died from SIGSEGV"),
                                           ("exit", "the worker exited with code 3 without writing a result")])
def test_a_judge_that_dies_is_a_status_and_the_zygote_serves_on(problem: Path, tmp_path: Path, fate: str,
                                                                said: str) -> None:
    _judge(problem, tmp_path, "before")
    before = zygote.SHARED.zygote
    assert before is not None
    outcome, log = _judge(problem, tmp_path, "dies", fate=fate)
    assert outcome.result["status"] == "runtime_error" and said in outcome.result["message"], log[-2000:]
    assert before.alive()
    outcome, log = _judge(problem, tmp_path, "after")
    assert outcome.result["status"] == "ok" and zygote.SHARED.zygote is before, log[-2000:]


def test_torch_threads_follow_the_environment_through_a_new_zygote(problem: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _judge(problem, tmp_path, "first")
    first = zygote.SHARED.zygote
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads + 1))  # read as torch loads: a zygote of its own
    _, log = _judge(problem, tmp_path, "more")
    assert _probe(log)["threads"] == threads + 1, log[-2000:]
    assert zygote.SHARED.zygote is not first and first is not None and not first.alive()


def test_a_zygote_that_died_is_started_again(problem: Path, tmp_path: Path) -> None:
    _judge(problem, tmp_path, "first")
    first = zygote.SHARED.zygote
    assert first is not None
    first.proc.kill()
    first.proc.wait()
    outcome, log = _judge(problem, tmp_path, "again")
    assert outcome.result["status"] == "ok", log[-2000:]
    assert zygote.SHARED.zygote is not None and zygote.SHARED.zygote is not first
    assert "no zygote" not in log


def test_without_a_zygote_judges_start_fresh_and_the_first_log_says_so(problem: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote, "PRELOAD", ("kernelboard_has_no_such_module",))
    monkeypatch.setattr(zygote, "SHARED", zygote._Shared())
    logs = []
    for name in ("one", "two"):
        outcome, log = _judge(problem, tmp_path, name)
        assert outcome.result["status"] == "ok" and _probe(log)["ppid"] == os.getpid(), log[-2000:]
        logs.append(log)
    assert zygote.SHARED.zygote is None
    said = "[grader] no zygote to fork judges from (importing kernelboard_has_no_such_module failed"
    assert said in logs[0] and "no zygote" not in logs[1]


def test_the_zygote_refuses_imports_that_read_what_each_judge_sets(tmp_path: Path) -> None:
    (tmp_path / "reads_lazily.py").write_text("import os\nos.environ.get('TORCH_EXTENSIONS_DIR')\n")
    env = {**sandbox.worker_env("key"), "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                                                    os.environ.get("PYTHONPATH")]))}
    with pytest.raises(zygote.ZygoteError, match="read TORCH_EXTENSIONS_DIR"):
        zygote.Zygote(env, preload=("reads_lazily",))
    with pytest.raises(zygote.ZygoteError, match="imported triton"):
        zygote.Zygote(env, preload=("triton",))


def test_the_grading_process_imports_no_torch_while_it_forks_judges(tmp_path: Path) -> None:
    script = f"""
import sys
from pathlib import Path
from kernelboard.eval import sandbox, schedule, zygote
env = sandbox.worker_env("key")
z = zygote.Zygote(env)
with open({str(tmp_path / "log")!r}, "w") as log:
    judge = z.fork([{str(tmp_path / "no.job.json")!r}], Path({str(tmp_path)!r}), env, log.fileno())
print("rc", judge.wait(60))
z.close()
assert not [m for m in sys.modules if m.split(".")[0] == "torch"], "torch in the grader"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "rc 2" in done.stdout, done.stderr[-2000:]
    assert "not a usable job file" in (tmp_path / "log").read_text()


def test_a_forked_judge_keeps_no_descriptor_of_the_zygote(tmp_path: Path) -> None:
    """A judge blocked opening its job (a FIFO): its descriptors, its session; then killed, it is reaped."""
    env = sandbox.worker_env("key")
    held = zygote.Zygote(env)
    try:
        fifo = tmp_path / "job.fifo"
        os.mkfifo(fifo)
        judges = []
        with open(tmp_path / "log", "w") as log:
            for _ in range(2):
                judges.append(held.fork([str(fifo)], tmp_path, env, log.fileno()))
        time.sleep(0.5)
        for judge in judges:
            assert sorted(os.listdir(f"/proc/{judge.pid}/fd"), key=int) == ["0", "1", "2"]
            assert os.getsid(judge.pid) == judge.pid
        os.killpg(judges[0].pid, signal.SIGKILL)
        assert judges[0].wait(30) == -signal.SIGKILL
        os.kill(judges[1].pid, signal.SIGSEGV)
        assert judges[1].wait(30) == -signal.SIGSEGV
        assert held.alive()
    finally:
        held.close()
    assert held.proc.returncode == 0


def test_the_device_probe_forked_from_the_zygote_says_what_a_fresh_one_says(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = Path("/dev/nvidia0").exists()
    forked = sandbox.probe_device("cpu")
    assert zygote.SHARED.zygote is not None and forked["triton_version"]
    if not gpu:
        with pytest.raises(UsageError, match="--device cuda: no CUDA device"):
            sandbox.probe_device("cuda")
    monkeypatch.setenv("KERNELBOARD_ZYGOTE", "0")
    assert sandbox.probe_device("cpu") == forked
    if not gpu:
        with pytest.raises(UsageError, match="--device cuda: no CUDA device"):
            sandbox.probe_device("cuda")

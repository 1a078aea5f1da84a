"""The next solution's build overlaps the current grading, and the worker reuses what it built."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from grading import MeasuredBaselines

from kernelboard.eval.cutlass_headers import find_cutlass
from kernelboard.eval.sandbox import worker_env
from kernelboard.eval.schedule import EvalOptions, run_eval

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "hard"

# A stand-in for a `load_inline` build: slow the first time, cached in the solution's private
# TORCH_EXTENSIONS_DIR afterwards. It says which happened on stdout (the worker's log).
SLOW_BUILD = """
import os, pathlib, time
build = pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "fake_extension"
if build.exists():
    print("BUILD CACHE HIT", flush=True)
else:
    time.sleep(3)
    build.mkdir(parents=True)
    print("BUILT", flush=True)
from reference import Model, get_inputs, get_init_inputs  # noqa: F401
"""


# A stand-in for `load(..., build_directory=<its own folder>/build/ext)` (deepseek-v4-flash-0731 07 021705):
# a build beside solution.py, found again only at the path it ran at. Its prebuild also leaves a config and
# a build lock behind; the worker says what it finds.
BUILD_BESIDE = """
import os, pathlib
here = pathlib.Path(__file__).resolve().parent
build = here / "build" / "ext"
if (build / "ext.so").exists():
    print(f"FOUND BESIDE config={(here / 'tuned.json').exists()} lock={(build / 'lock').exists()}", flush=True)
else:
    build.mkdir(parents=True)
    (build / "build.ninja").write_text("rule cc\\n")
    (build / "ext.so").write_bytes(b"ELF")
    (build / "lock").write_text("")
    (here / "tuned.json").write_text("{}")
    print("BUILT BESIDE", flush=True)
from reference import Model, get_inputs, get_init_inputs  # noqa: F401
"""


def test_prebuild_compiles_the_next_solution_while_the_current_one_grades(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines) -> None:
    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    subs = tmp_path / "subs"
    for name, source in (("a_plain", "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"),
                         ("b_slow_build", SLOW_BUILD), ("c_build_beside", BUILD_BESIDE)):
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(source)
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    out = tmp_path / "out"
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)  # the session's: not what this is about
    rows = run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", rep_ms=20.0, prebuild=True))
    assert [r["status"] for r in rows] == ["pass", "pass", "pass"]
    logs = out / "cpu" / "logs"
    assert "BUILT BESIDE" in (logs / "c_build_beside.prebuild.log").read_text()
    beside = (logs / "c_build_beside.log").read_text()
    assert "FOUND BESIDE config=False lock=False" in beside  # its build kept; the rest of the prebuild's gone
    assert "keeping what its builds left there: 2 built files (1 build folder)" in beside
    assert "built while grading: 0 Triton kernel variants, 0 extensions (found built before: 0 and 1)" in beside
    assert "BUILT" in (logs / "b_slow_build.prebuild.log").read_text()
    assert "[prebuild] imported" in (logs / "b_slow_build.prebuild.log").read_text()
    assert "BUILD CACHE HIT" in (logs / "b_slow_build.log").read_text()
    assert "[prebuild] imported" in (logs / "a_plain.prebuild.log").read_text()  # the first one is built ahead too



# SLOW_BUILD, stamping when its build started (seconds since the epoch) in the prebuild's log.
STAMPED_BUILD = SLOW_BUILD.replace("    time.sleep(3)", "    print(f'BUILD STARTED {time.time()}', flush=True)\n"
                                   "    time.sleep(3)")


PLAIN = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"


def _batch_of_03(subs: Path, out: Path, measured_baselines: MeasuredBaselines,
                 sources: dict[str, str]) -> list[dict[str, Any]]:
    """These 03 solutions graded in one CPU batch into `out`, two builds ahead, on the session's baselines."""
    for name, source in sources.items():
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(source)
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)
    return run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", rep_ms=20.0, prebuild=True,
                                build_ahead=2))


def test_builds_run_several_ahead_of_the_grading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 measured_baselines: MeasuredBaselines) -> None:
    """With a depth of 2, the third submission's build starts while the first one grades (with one
    ahead, the GPU waited out most of each 50–60 s build on the H200), and every worker finds its build.
    The depth is `--build-ahead`'s here (this host's own would be 1)."""
    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rows = _batch_of_03(tmp_path / "subs", out, measured_baselines,
                        {"a_plain": PLAIN, "b_build": STAMPED_BUILD,
                         "c_build": STAMPED_BUILD.replace("fake_extension", "other_extension")})
    assert [r["status"] for r in rows] == ["pass", "pass", "pass"]
    logs = out / "cpu" / "logs"
    first_graded = rows[0]["graded_at"].timestamp()  # when its grading ended
    for name in ("b_build", "c_build"):
        started = [line for line in (logs / f"{name}.prebuild.log").read_text().splitlines()
                   if line.startswith("BUILD STARTED")]
        assert started and float(started[0].split()[-1]) < first_graded, name
        assert "BUILD CACHE HIT" in (logs / f"{name}.log").read_text()


# A build (the prebuild: its folder is `<run_id>.prebuild`) that ends only once the file `go` appears there
# (at most 60 s): the test decides when. The worker's import, in a folder of its own, does not wait.
GATED_BUILD = """
import pathlib, time
if pathlib.Path.cwd().name.endswith(".prebuild"):
    for _ in range(600):
        if pathlib.Path("go").exists():
            break
        time.sleep(0.1)
    print("GATE PASSED", flush=True)
from reference import Model, get_inputs, get_init_inputs  # noqa: F401
"""


def test_every_problems_baselines_are_timed_before_any_build_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines) -> None:
    """Two 03 submissions, then a 01 one: 01's baselines (eager lines are host-bound) are timed before any
    build loads the host, not when the batch reaches 01 with builds running."""
    from kernelboard.eval import schedule

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(schedule, "prebuild_depth", lambda cpus: 2)
    subs, out = tmp_path / "subs", tmp_path / "out"
    plain = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"
    for name, problem in (("a_plain", "03_paged_attention"), ("b_plain", "03_paged_attention"),
                          ("c_plain", "01_fp8_gemm")):
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(plain)
        (subs / name / "run.yaml").write_text(f"problem: {problem}\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)
    real, builds_seen = schedule.ensure_baselines, {}

    def ensure(opts, gpu, problem, env, scratch):  # type: ignore[no-untyped-def]
        builds_seen[problem.name] = sorted(p.name for p in scratch.glob("*.prebuild"))
        return real(opts, gpu, problem, env, scratch) if problem.name != "01_fp8_gemm" else {}

    monkeypatch.setattr(schedule, "ensure_baselines", ensure)
    rows = run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", rep_ms=20.0, prebuild=True))
    assert [r["status"] for r in rows] == ["pass", "pass", "not_graded"]  # no 01 baselines in this session
    assert "baselines are missing" in rows[2]["message"]
    assert builds_seen == {"03_paged_attention": [], "01_fp8_gemm": []}
    assert "[prebuild] imported" in (out / "cpu" / "logs" / "c_plain.prebuild.log").read_text()


def test_the_gpu_grades_a_run_whose_build_ended_before_one_still_building(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines,
        capsys: pytest.CaptureFixture[str]) -> None:
    """a's build runs until b has been graded (a CUTLASS build takes minutes): b, whose build ended, is graded
    first, and a once its own build ends; neither waits for the other's build on the GPU's time."""
    from kernelboard.eval import schedule

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(schedule, "prebuild_depth", lambda cpus: 2)
    subs, out = tmp_path / "subs", tmp_path / "out"
    for name, source in (("a_gated", GATED_BUILD),
                         ("b_plain", "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n")):
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(source)
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)
    real = schedule.grade_submission

    def grade(opts, gpu, spec, problem, sub, env, baselines, scratch, *rest):  # type: ignore[no-untyped-def]
        row = real(opts, gpu, spec, problem, sub, env, baselines, scratch, *rest)
        if sub.run_id == "b_plain":
            (scratch / "a_gated.prebuild" / "go").touch()
        return row

    monkeypatch.setattr(schedule, "grade_submission", grade)
    rows = run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", rep_ms=20.0, prebuild=True))
    assert [(r["run_id"], r["status"]) for r in rows] == [("b_plain", "pass"), ("a_gated", "pass")]
    assert "GATE PASSED" in (out / "cpu" / "logs" / "a_gated.prebuild.log").read_text()
    assert "b_plain: graded ahead of a_gated, whose build is still running" in capsys.readouterr().err


def _build(ended: bool | Callable[[], bool], age_s: float = 1.0) -> Any:
    """A `Prebuild` of a stand-in process, running or finished (`ended`, or as it says when asked), started
    `age_s` ago."""
    from kernelboard.eval.sandbox import Prebuild

    done = ended if callable(ended) else (lambda: ended)
    return Prebuild(SimpleNamespace(poll=lambda: 0 if done() else None), time.monotonic() - age_s,  # type: ignore[arg-type]
                    -1)


def test_a_held_runs_ended_build_does_not_stop_the_builds_behind_it() -> None:
    """The H100 call of 2026-12-05: a held run built in 7 s and waited to be graded last, and with it in
    the window behind two slow builds the GPU idled about 290 s. An ended build frees its slot."""
    from kernelboard.eval.schedule import BuildQueue

    ended: dict[str, bool] = {}
    started: list[str] = []

    def start(sub: Any, problem: Any) -> Any:
        started.append(sub.run_id)
        ended[sub.run_id] = False
        return _build(lambda: ended[sub.run_id], age_s=0.0)

    queue = [(SimpleNamespace(run_id=r), object()) for r in ("a", "b", "c", "h1")]
    builds = BuildQueue(queue, {"a", "b", "c", "h1"}, {"h1"}, 2, start)  # type: ignore[arg-type]
    assert builds.take(600.0) is None and started == ["h1", "a"]  # the held run builds early
    ended["h1"] = True  # built; it still goes last
    assert builds.take(600.0) is None and started == ["h1", "a", "b"]  # b builds beside a
    ended["b"] = True
    sub, _, ahead_of, build = builds.take(600.0)  # type: ignore[misc]
    assert (sub.run_id, ahead_of, build is not None) == ("b", "a", True) and started == ["h1", "a", "b", "c"]


def test_runs_too_late_to_start_leave_the_queue_before_their_builds_end() -> None:
    """Where the batch cannot finish a run, it is taken out at once, its build ended: the batch does not wait
    for that build only to say "not started" (an H100 call of 2026-12-07 waited so until its deadline)."""
    from kernelboard.eval.schedule import BuildQueue

    killed: list[str] = []
    started: list[str] = []

    def start(sub: Any, problem: Any) -> Any:
        started.append(sub.run_id)
        build = _build(False, age_s=0.0)
        build.run_id = sub.run_id  # which build finish_prebuild was given, for the check below
        return build

    queue = [(SimpleNamespace(run_id=r, problem=p), object()) for r, p in (("a", "01"), ("b", "06"), ("c", "01"))]
    builds = BuildQueue(queue, {"a", "b", "c"}, set(), 2, start)  # type: ignore[arg-type]
    assert builds.take(600.0) is None and started == ["a", "b"]  # both still building
    with mock.patch("kernelboard.eval.schedule.finish_prebuild", lambda build, wait: killed.append(build.run_id)):
        dropped = builds.drop_late(lambda sub: "06 takes longer than is left" if sub.problem == "06" else None)
    assert [(sub.run_id, why) for sub, why in dropped] == [("b", "06 takes longer than is left")]
    assert killed == ["b"] and [sub.run_id for sub, _ in builds.pending] == ["a", "c"]
    assert "b" not in builds.prebuilds and builds.take(600.0) is None and started == ["a", "b", "c"]  # c builds
    assert builds.drop_late(lambda sub: None) == [] and len(builds.pending) == 2


def test_a_pass_graded_here_replaces_another_gpus_stand_in_and_only_a_quicker_one_replaces_it() -> None:
    from kernelboard.eval.schedule import QuickestPass, with_pass

    assert with_pass(None, 52.5, "h100-sxm") == QuickestPass(52.5, "h100-sxm")
    # the H200's 27 s stood in for 01 on the H100 until the first pass there (45–101 s on 2026-12-07)
    assert with_pass(QuickestPass(27.0, "h200"), 52.5, "h100-sxm") == QuickestPass(52.5, "h100-sxm")
    assert with_pass(QuickestPass(52.5, "h100-sxm"), 101.2, "h100-sxm") == QuickestPass(52.5, "h100-sxm")
    assert with_pass(QuickestPass(52.5, "h100-sxm"), 45.3, "h100-sxm") == QuickestPass(45.3, "h100-sxm")


def test_the_build_window_is_the_queue_head_with_held_runs_built_early() -> None:
    from kernelboard.eval.schedule import build_window

    queue, gradeable = ["a", "b", "skip", "c", "d", "h1", "h2"], {"a", "b", "c", "d", "h1", "h2"}
    assert build_window(queue, gradeable, set(), 3) == ["a", "b", "c"]  # a skipped run needs no build
    assert build_window(queue, gradeable, {"h1"}, 3) == ["h1", "a", "b"]  # graded last, built first
    # one held run builds early at most: the runs this call grades keep the other places (on an H100's host
    # two of three went to held runs' builds of 280–430 s in each of three calls, none of them graded)
    assert build_window(queue, gradeable, {"h1", "h2"}, 3) == ["h1", "a", "b"]
    assert build_window(queue, gradeable, {"h1", "h2"}, 5) == ["h1", "a", "b", "c", "d"]
    assert build_window(queue, gradeable, {"h1", "h2"}, 2) == ["h1", "a"]  # never all of them: the GPU waits
    assert build_window(queue, gradeable, {"h1"}, 1) == ["a"]
    assert build_window(queue, gradeable, set(), 0) == []  # no prebuilds (the CPU)
    assert build_window(["h1"], gradeable, {"h1"}, 1) == ["h1"]  # the last run left
    # an ended build keeps no slot: a held run built early waits to go last while the others build on
    assert build_window(queue, gradeable, {"h1"}, 3, built={"h1"}) == ["a", "b", "c"]
    assert build_window(queue, gradeable, {"h1", "h2"}, 3, built={"h1", "a"}) == ["h2", "b", "c"]


def test_next_to_grade_takes_the_first_run_that_is_ready_and_keeps_held_runs_last() -> None:
    from kernelboard.eval.schedule import next_to_grade

    def pick(builds: dict[str, Any], held: tuple[str, ...] = (), order: tuple[str, ...] = ("a", "b", "c"),
             timeout_s: float = 600.0) -> int | None:
        return next_to_grade(list(order), builds, set(held), timeout_s, needs_build=lambda run_id: run_id != "c")

    assert pick({"a": _build(True), "b": _build(True)}) == 0  # queue order among the ready
    assert pick({"a": _build(False), "b": _build(True)}) == 1  # a still builds: b goes
    assert pick({"a": _build(False), "b": _build(False)}) == 2  # c needs no build (a skipped run, say)
    assert pick({"a": _build(False), "b": _build(False)}, order=("a", "b")) is None  # wait
    assert pick({"a": _build(False)}, order=("a", "b")) is None  # b's build has not started: not ready
    assert pick({"a": _build(False, age_s=700), "b": _build(True)}) == 0  # a's build is over its time: cut off
    assert pick({"a": _build(False), "b": _build(True)}, held=("b",)) is None  # a held run never jumps the queue
    assert pick({"a": _build(False)}, held=("a",)) == 0  # it goes once it is first


def test_the_depth_is_one_build_per_four_cores_at_most_three() -> None:
    from kernelboard.eval.schedule import prebuild_depth

    assert [prebuild_depth(n) for n in (None, 1, 2, 4, 8, 16, 128)] == [1, 1, 1, 1, 2, 3, 3]


def test_build_ahead_reaches_every_gpus_grader() -> None:
    """`eval --gpus 0,1 --build-ahead 5`: each GPU's child grader builds 5 ahead too."""
    from kernelboard.eval.parallel import _child_args

    args = _child_args(EvalOptions(deck=DECK, submissions=DECK, out=DECK, build_ahead=5), DECK, ["a"])
    assert args[args.index("--build-ahead") + 1] == "5"
    assert "--build-ahead" not in _child_args(EvalOptions(deck=DECK, submissions=DECK, out=DECK), DECK, ["a"])

def test_cutlass_headers_are_exported_when_the_package_is_installed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "site" / "cutlass_library"
    (package / "source" / "include" / "cutlass").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "source" / "include" / "cutlass" / "cutlass.h").write_text("// header\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    found = find_cutlass()
    include = found.includes[0] if found is not None else None
    assert include == package / "source" / "include"
    env = worker_env("key", arch="9.0")
    assert env["CPLUS_INCLUDE_PATH"].split(":")[0] == str(include)
    assert env["CUTLASS_PATH"] == str(package / "source")
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0"  # builds target the grading GPU, in prebuild and worker alike


# A build as torch's `cpp_extension` makes one (`_jit_compile`): under a `FileBaton` in the extension's build
# folder, or waiting for whoever holds it, forever.
BATON_BUILD = """
import os, pathlib
from torch.utils.file_baton import FileBaton
build = pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "baton_extension"
build.mkdir(parents=True, exist_ok=True)
baton = FileBaton(str(build / "lock"))
if baton.try_acquire():
    (build / "built").write_text("{tag}")
    baton.release()
    print("BUILT UNDER THE BATON", flush=True)
else:
    baton.wait()
    print("WAITED FOR THE BATON", flush=True)
from reference import Model, get_inputs, get_init_inputs  # noqa: F401
"""


def test_a_baton_left_by_a_killed_build_is_removed_before_the_next_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines) -> None:
    """A build killed mid-way (a timeout, an interrupt, the end of a device call) leaves torch's baton in the
    solution's cache, and every later build of that solution waited for it forever (a 03 prebuild on the
    H200: 6 minutes, to the call's end). Both build paths clear it first: the worker's (a batch without
    prebuilds) and the prebuild's (a batch with them)."""
    from kernelboard.eval.sandbox import cache_dir
    from kernelboard.eval.submission import discover

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    subs = tmp_path / "subs"
    for name in ("a_worker_builds", "b_prebuild_builds"):
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(BATON_BUILD.replace("{tag}", name))
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    for sub in discover(subs)[0]:
        stale = cache_dir(sub.solution_sha256() or sub.run_id) / "torch_extensions" / "baton_extension" / "lock"
        stale.parent.mkdir(parents=True)
        stale.write_text("")  # what a killed build leaves: torch's O_EXCL file, nobody to remove it
    out = tmp_path / "out"
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)
    rows = [row for name, prebuild in (("a_worker_builds", False), ("b_prebuild_builds", True))
            for row in run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", only=(name,),
                                            rep_ms=20.0, prebuild=prebuild, build_timeout_s=30.0, timeout_s=120.0))]
    assert [r["status"] for r in rows] == ["pass", "pass"], [r["message"] for r in rows]
    logs = out / "cpu" / "logs"
    worker = (logs / "a_worker_builds.log").read_text()
    assert "baton_extension/lock: torch's build lock, left by a build that was killed" in worker
    assert "BUILT UNDER THE BATON" in worker
    prebuild = (logs / "b_prebuild_builds.prebuild.log").read_text()
    assert "baton_extension/lock: torch's build lock, left by a build that was killed" in prebuild
    assert "BUILT UNDER THE BATON" in prebuild and "[prebuild] imported" in prebuild
    assert "removed" not in (logs / "b_prebuild_builds.log").read_text()  # the prebuild's baton was its own


# A kernel that builds its extension on its first call (10 of 28 published 05 kernels on the H200, each
# build about 50 s of the GPU's time): a `_get_mod()` in `forward`, before any read of the data.
LAZY_BUILD = """
import os, pathlib, time
from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401
_mod = None
def _get_mod():
    global _mod
    if _mod is None:
        build = pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "lazy_extension"
        if build.exists():
            print("BUILD CACHE HIT", flush=True)
        else:
            time.sleep(1)
            build.mkdir(parents=True)
            print("BUILT", flush=True)
        _mod = build
    return _mod
class Model(_Reference):
    def forward(self, *args):
        _get_mod()
        return super().forward(*args)
"""

# A first call that never returns on meta tensors (the prebuild's warm call), and swallows every exception.
STUCK_ON_META = """
import time
from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401
class Model(_Reference):
    def forward(self, *args):
        while any(getattr(a, "is_meta", False) for a in args):
            try:
                time.sleep(0.05)
            except BaseException:
                pass
        return super().forward(*args)
"""


def test_the_warm_call_builds_what_a_kernel_builds_on_its_first_call_and_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines) -> None:
    """The prebuild calls the Model once on meta tensors: b's lazy build happens there and its worker finds
    it cached; c's call never ends, and its prebuild leaves at the warm call's limit, not the build timeout."""
    from kernelboard.eval import schedule

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(schedule, "prebuild_depth", lambda cpus: 2)
    monkeypatch.setattr(schedule, "PREBUILD_WARM_CALL_S", 8)  # a loaded 2-core machine: 3 s was tight
    subs, out = tmp_path / "subs", tmp_path / "out"
    sources = {"a_plain": "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n",
               "b_lazy": LAZY_BUILD, "c_stuck": STUCK_ON_META}
    for name, source in sources.items():
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(source)
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)
    rows = run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", rep_ms=20.0, prebuild=True,
                                build_timeout_s=120.0))
    assert [r["status"] for r in rows] == ["pass", "pass", "pass"]
    logs = out / "cpu" / "logs"
    lazy = (logs / "b_lazy.prebuild.log").read_text()
    assert "[prebuild] warm call: its Model built on meta" in lazy and "BUILT" in lazy
    assert "[prebuild] warm call returned" in lazy  # the reference's forward runs on meta tensors
    assert "BUILD CACHE HIT" in (logs / "b_lazy.log").read_text()
    assert "[grader] built while grading: 0 Triton kernel variants, 0 extensions" in (logs / "b_lazy.log").read_text()
    assert "[prebuild] warm call stopped at its limit of 8 s" in (logs / "c_stuck.prebuild.log").read_text()


def test_the_warm_call_draws_on_the_cpu_what_meta_cannot_and_answers_the_grading_arch() -> None:
    """06's reference routes by its logits' values, which meta tensors lack: its Model is built at the first CPU
    shape and called on meta inputs. A kernel that asks torch for the GPU's capability to pick its flags gets
    the grading GPU's (TORCH_CUDA_ARCH_LIST), in the prebuild only."""
    import torch

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file
    from kernelboard.eval.prebuild import _answering_capability, _warm_calls, grading_capability

    hard = load_problem(DECK / "05_topk_bitonic")
    reference = import_file("reference", hard.reference_path)
    calls = list(_warm_calls(hard, reference, reference))
    assert [where for _, _, where in calls] == [f"on meta at {s.label}" for s in hard.shapes]  # one per shape
    assert all(x.is_meta for _, inputs, _ in calls for x in inputs)
    for (model, inputs, _), shape in zip(calls, hard.shapes, strict=True):
        assert model(*inputs)[0].shape == (shape.params["batch"], shape.params["k"])

    moe = load_problem(DECK / "06_sonic_moe_swiglu")
    reference = import_file("reference", moe.reference_path)
    [(model, inputs, where)] = _warm_calls(moe, reference, reference)
    assert where.startswith("on the CPU at the first CPU shape") and all(
        x.is_meta for x in inputs if isinstance(x, torch.Tensor))
    assert not any(p.is_meta for p in model.parameters())

    real = torch.cuda.get_device_capability
    with _answering_capability((9, 0)):
        assert torch.cuda.get_device_capability() == (9, 0)
    assert torch.cuda.get_device_capability is real
    # the grader's list, one arch (solutions often set "9.0a" themselves: the prebuild reads it before them)
    lists = ("9.0", "9.0a", "12.0+PTX", " 10.0 ", "8.0;9.0", "8.0 9.0", "", "sm_90")
    assert [grading_capability(a) for a in lists] == [(9, 0), (9, 0), (12, 0), (10, 0), None, None, None, None]


def test_the_prebuild_answers_the_grading_gpus_properties_from_import_on(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Six published Hard kernels whose builds no warm call reached ask torch for the GPU's properties first
    (`NUM_SM = torch.cuda.get_device_properties(0).multi_processor_count` at import, `-arch=sm_{major}{minor}`):
    given the grading GPU's identity as the probe reads it, the prebuild (in its sandbox, whose environment
    is scrubbed) answers them, at import too. Without it, the query fails as it did."""
    from kernelboard.eval.jail import make_jail
    from kernelboard.eval.sandbox import finish_prebuild, start_prebuild

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    cell = make_jail(sandboxed=True, device="cpu", hide=[])
    source = ("import torch\n"
              "_props = torch.cuda.get_device_properties(torch.cuda.current_device())\n"
              "print(f'AT IMPORT sm_{_props.major}{_props.minor} {_props.multi_processor_count} SMs {_props.name}')\n"
              "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n")
    gpu = {"device_name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "memory_bytes": 85_000_000_000,
           "l2_bytes": 52_428_800}
    carried = tmp_path / "cache" / "named" / "triton" / "KEY"  # a variant an archive compiled ahead left there
    carried.mkdir(parents=True)
    (carried / "kernel.cubin").write_bytes(b"\0")
    said = {}
    for name, identity in (("named", gpu), ("unnamed", None)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "solution.py").write_text(source)
        log = tmp_path / f"{name}.prebuild.log"
        finish_prebuild(start_prebuild(DECK / "07_w4a16_gemm", folder, log, name, "9.0", cell, 0.0, True, identity),
                        120)
        said[name] = log.read_text()
    assert "AT IMPORT sm_90 132 SMs NVIDIA H100 80GB HBM3" in said["named"], said["named"]
    assert "[prebuild] imported" in said["named"]
    assert "[grader] in its compile caches before this prebuild: 1 Triton kernel variants, 0 ext" in said["named"]
    assert "before this prebuild: 0 Triton kernel variants, 0 extensions" in said["unnamed"]
    assert "[prebuild] import failed" in said["unnamed"] and "AT IMPORT" not in said["unnamed"], said["unnamed"]


def test_the_warm_call_of_a_stateful_problem_calls_its_entry(capsys: pytest.CaptureFixture[str]) -> None:
    """A Mega solution's Model has `step(hidden, state)`, no forward: the warm call calls the deck's entry
    (15 of 62 published Mega kernels reached no build before it did; 8 of them now reach it there)."""
    import types

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file
    from kernelboard.eval.prebuild import warm_call

    mega = load_problem(ROOT / "eval" / "decks" / "mega" / "02_kimi_linear_decode")
    reference = import_file("reference", mega.reference_path)

    class Model(torch.nn.Module):
        def __init__(self, *args: object) -> None:
            super().__init__()

        def step(self, hidden: torch.Tensor, state: list[dict[str, torch.Tensor]]) -> None:
            raise RuntimeError(f"step reached with a {tuple(hidden.shape)} {hidden.device} hidden")

    warm_call(mega, reference, types.SimpleNamespace(Model=Model), 60, None)
    said = capsys.readouterr().out
    assert "[prebuild] warm call: its Model built on meta" in said
    assert "RuntimeError: step reached with a (2304,) meta hidden" in said


def test_the_warm_call_runs_again_on_fake_cuda_tensors_for_a_build_behind_is_cuda(
        capsys: pytest.CaptureFixture[str]) -> None:
    """kinetic-0715's 07 of 2026-07-16 builds its extension only where `x.is_cuda` (and its data pointer is
    aligned); on meta its PyTorch fallback returns, and the H100 spent 74 s of its time on that build. For
    a GPU grading (an arch to answer), every shape is called again on fake CUDA tensors, which reach it."""
    import types

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file
    from kernelboard.eval.prebuild import warm_call

    problem = load_problem(DECK / "07_w4a16_gemm")
    reference = import_file("reference", problem.reference_path)

    class Model(torch.nn.Module):  # its shape: a packed weight built at init, a fallback that returns on meta
        def __init__(self, M: int, N: int, K: int) -> None:
            super().__init__()
            self.register_buffer("w_q", torch.zeros(K // 2, N, dtype=torch.uint8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.is_cuda and x.data_ptr() % 32 == 0:
                print(f"BUILD REACHED at {tuple(x.shape)} on {x.device}, weights on {self.w_q.device}", flush=True)
                raise RuntimeError("its own kernel's launch")
            return x.new_empty(x.shape[0], self.w_q.shape[1])

    warm_call(problem, reference, types.SimpleNamespace(Model=Model), 120, (9, 0))
    said = capsys.readouterr().out
    shapes = [(s.params["M"], s.params["K"]) for s in problem.shapes]
    assert said.count("[prebuild] warm call returned") == len(shapes)  # on meta: the fallback
    for m, k in shapes:
        assert f"BUILD REACHED at ({m}, {k}) on cuda:0, weights on cuda:0" in said, said
    assert said.count("warm call: its Model built on fake CUDA tensors at") == len(shapes)
    assert "RuntimeError: its own kernel's launch" in said
    warm_call(problem, reference, types.SimpleNamespace(Model=Model), 120, None)  # a CPU grading: no such call
    assert "fake CUDA" not in capsys.readouterr().out


def test_a_model_built_on_the_gpu_itself_that_captures_a_graph_reaches_its_build_on_fake_cuda(
        capsys: pytest.CaptureFixture[str]) -> None:
    """deepseek-v4-flash-0731's 05 of 2026-08-01 allocates its buffers on `torch.device("cuda:0")` in its
    constructor (no meta Model, no CPU one either), then warms up on a side stream and captures its first
    launch in a CUDA graph, where its extension builds: the H100 built it on its own time. On fake CUDA
    tensors, with streams, events and graphs standing in for the GPU's, every shape reaches the build."""
    import types

    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.plan import import_file
    from kernelboard.eval.prebuild import warm_call

    problem = load_problem(DECK / "05_topk_bitonic")
    reference = import_file("reference", problem.reference_path)
    real_stream = torch.cuda.Stream

    class Model(torch.nn.Module):
        def __init__(self, batch: int, n: int, k: int) -> None:
            super().__init__()
            self.out = torch.empty(batch, k, device=torch.device("cuda:0"))
            self.graph = None

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self.graph is None:
                graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda.synchronize()
                    assert not torch.cuda.is_current_stream_capturing()
                    with torch.cuda.graph(graph):
                        print(f"BUILD REACHED at {tuple(x.shape)} on {x.device}", flush=True)
                self.graph = graph
            self.graph.replay()
            return self.out, self.out.long()

    warm_call(problem, reference, types.SimpleNamespace(Model=Model), 120, (9, 0))
    said = capsys.readouterr().out
    assert "[prebuild] warm call on meta and the CPU not made" in said, said
    for shape in problem.shapes:
        assert f"BUILD REACHED at ({shape.params['batch']}, {shape.params['n']}) on cuda:0" in said, said
    assert torch.cuda.Stream is real_stream  # the stand-ins are gone after the call


def test_a_thread_the_solution_leaves_running_does_not_keep_the_prebuild_alive(tmp_path: Path) -> None:
    """A non-daemon thread started at import would hold the prebuild's exit, and the GPU's next grading with
    it, until the build timeout; the prebuild leaves once its import and warm call are done."""
    import subprocess
    import sys

    (tmp_path / "solution.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n")
    done = subprocess.run([sys.executable, "-m", "kernelboard.eval.prebuild", str(DECK / "05_topk_bitonic"),
                           str(tmp_path), "30"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[prebuild] imported" in done.stdout and "[prebuild] warm call returned" in done.stdout


def test_the_log_counts_what_was_built_during_grading_apart_from_what_was_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measure of the prebuild's aim (nothing built on GPU time): cubins and shared objects that
    appeared in the solution's caches while its worker ran, beside those it found there."""
    from kernelboard.eval.sandbox import built_kernels, built_line, cache_dir

    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path))
    root = cache_dir("k")
    for path in ("triton/A/k1.cubin", "triton/B/k2.cubin", "torch_extensions/ext/ext.so", "triton/A/k1.ptx"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(b"")
    before = built_kernels("k")
    (root / "triton" / "C").mkdir()
    (root / "triton" / "C" / "k3.cubin").write_bytes(b"")
    assert built_line(before, built_kernels("k")) == (
        "[grader] built while grading: 1 Triton kernel variants, 0 extensions (found built before: 2 and 1)")


def test_the_graded_copy_keeps_only_builds_and_never_writes_through_a_link(tmp_path: Path) -> None:
    """What a prebuild's calls left in its copy is candidate-made: a link there could point the grader's
    own writes outside (it writes the published files back), so links go before anything is written."""
    from kernelboard.eval.schedule import graded_copy
    from kernelboard.eval.submission import load_submission

    published = tmp_path / "subs" / "r1"
    (published / "kernels").mkdir(parents=True)
    (published / "solution.py").write_text("print('published')\n")
    (published / "kernels" / "k.cu").write_text("// published\n")
    (published / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: h\nagent_outcome: completed\n")
    sub = load_submission(published)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert graded_copy(sub, scratch, None) == (scratch / "r1", "")  # no prebuild: the published files
    assert sorted(p.name for p in (scratch / "r1").iterdir()) == ["kernels", "solution.py"]

    built = scratch / "r1.prebuild"
    victim = tmp_path / "victim.txt"
    victim.write_text("the grader's own file\n")
    shutil.copytree(published, built, ignore=shutil.ignore_patterns("run.yaml"))
    (built / "solution.py").unlink()
    (built / "solution.py").symlink_to(victim)  # the published file, now a link out
    shutil.rmtree(built / "kernels")
    (built / "kernels").symlink_to(tmp_path, target_is_directory=True)
    (built / "build" / "ext").mkdir(parents=True)
    for name in ("build.ninja", "ext.so", "lock"):
        (built / "build" / "ext" / name).write_text("x")
    (built / "tuned.json").write_text("{}")
    (built / "inplace.so").write_text("x")
    folder, kept = graded_copy(sub, scratch, built)
    assert folder == built and kept == "3 built files (1 build folder)"
    assert victim.read_text() == "the grader's own file\n"  # nothing written through solution.py's link
    assert (published / "kernels" / "k.cu").is_file()  # nor removed through the linked kernels/ folder
    assert not any(p.is_symlink() for p in built.rglob("*"))
    assert (built / "solution.py").read_text() == "print('published')\n"
    assert (built / "kernels" / "k.cu").read_text() == "// published\n"
    assert sorted(p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()) == [
        "build/ext/build.ninja", "build/ext/ext.so", "inplace.so", "kernels/k.cu", "solution.py"]


# A build that runs for 300 ticks of 0.05 s of its own running time (a paused build does not tick), printing
# each tick's wall time in its prebuild log; a child process of it ticks beside it, as a compiler would.
TICKING_BUILD = """
import pathlib, subprocess, sys, time
if pathlib.Path.cwd().name.endswith(".prebuild"):
    child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"])
    for _ in range(300):
        time.sleep(0.05)
        print(f"TICK {time.time():.3f}", flush=True)
    child.kill()
from reference import Model, get_inputs, get_init_inputs  # noqa: F401
"""


def test_builds_pause_while_the_gpu_times_a_shape_and_go_on_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines) -> None:
    """A shape the host's dispatch bounds is timed at the host's floor, which moved 2× between an H100 host busy
    with builds and a quieter one. The builds of the runs behind are stopped while a grading is in its timing
    phase: the first grading's log says for how long, the build's ticks stop for about as long, and the build
    ends and its run passes all the same."""
    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rows = _batch_of_03(tmp_path / "subs", out, measured_baselines, {"a_plain": PLAIN, "b_ticking": TICKING_BUILD})
    assert [r["status"] for r in rows] == ["pass", "pass"]
    logs = out / "cpu" / "logs"
    said = [line for line in (logs / "a_plain.log").read_text().splitlines()
            if "were paused while it was timed" in line]
    assert len(said) == 1, (logs / "a_plain.log").read_text()[-2000:]
    paused = float(said[0].split(": ")[-1].removesuffix(" s"))
    ticks = [float(line.split()[1]) for line in (logs / "b_ticking.prebuild.log").read_text().splitlines()
             if line.startswith("TICK ")]
    assert len(ticks) == 300  # it went on to its end after each pause
    gaps = sorted(b - a for a, b in itertools.pairwise(ticks))
    assert paused > 0.3 and gaps[-1] > 0.3  # a tick is 0.05 s: the longest gap is a pause
    assert sum(g for g in gaps if g > 0.25) == pytest.approx(paused, abs=1.0 + 0.25 * paused)


def test_a_paused_build_stops_its_whole_tree_and_its_paused_time_is_not_counted(tmp_path: Path) -> None:
    """`Prebuild.pause` stops the build and its children (a compiler it started), `resume` lets them go on, and
    the build's timeout and grade time count only the time it ran."""
    import os
    import subprocess
    import sys

    from kernelboard.eval import proctree
    from kernelboard.eval.sandbox import Prebuild, finish_prebuild

    script = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time\\nwhile 1: pass'])\n" \
             "while 1: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    build = Prebuild(proc, time.monotonic(), os.open(os.devnull, os.O_RDONLY)).watch()  # type: ignore[arg-type]
    try:
        for _ in range(100):
            if proctree.descendants(proc.pid):
                break
            time.sleep(0.05)
        tree = [proc.pid, *proctree.descendants(proc.pid)]
        assert len(tree) == 2
        build.pause()
        time.sleep(0.1)
        assert [proctree._stat(pid)[0] for pid in tree] == ["T", "T"]  # stopped, both
        time.sleep(1.0)
        assert build.active_s() < 0.9  # the pause does not count
        build.resume()
        time.sleep(0.1)
        assert all(proctree._stat(pid)[0] in ("R", "S") for pid in tree)
        assert build.paused_s > 1.0 and not build.stopped
        build.pause()  # a build paused at its end is let go and ended
        ran = finish_prebuild(build, 0)
        assert ran < 1.0 and build.paused_at is None
    finally:
        proctree.kill([proc.pid, *proctree.descendants(proc.pid)])
        proc.wait()

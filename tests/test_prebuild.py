"""The next solution's build overlaps the current grading, and the worker reuses what it built."""

from __future__ import annotations

from pathlib import Path

import pytest
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


def test_prebuild_compiles_the_next_solution_while_the_current_one_grades(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured_baselines: MeasuredBaselines) -> None:
    monkeypatch.setenv("KERNELBOARD_CACHE", str(tmp_path / "cache"))
    subs = tmp_path / "subs"
    for name, source in (("a_plain", "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"),
                         ("b_slow_build", SLOW_BUILD)):
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(source)
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    out = tmp_path / "out"
    measured_baselines.copy_into(out, ["03_paged_attention"], rep_ms=20.0)  # the session's: not what this is about
    rows = run_eval(EvalOptions(deck=DECK, submissions=subs, out=out, device="cpu", rep_ms=20.0, prebuild=True))
    assert [r["status"] for r in rows] == ["pass", "pass"]
    logs = out / "cpu" / "logs"
    assert "BUILT" in (logs / "b_slow_build.prebuild.log").read_text()
    assert "[prebuild] imported" in (logs / "b_slow_build.prebuild.log").read_text()
    assert "BUILD CACHE HIT" in (logs / "b_slow_build.log").read_text()
    assert not (logs / "a_plain.prebuild.log").exists()  # the first one has nothing to overlap with


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

"""Where a GPU's grader measures and where compiles run (eval/cpus.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kernelboard.eval import cpus


def test_two_gpus_on_32_cores_measure_on_disjoint_top_cores_and_compile_below() -> None:
    gpu0, gpu1 = cpus.cpu_plan(range(32), 0, 2), cpus.cpu_plan(range(32), 1, 2)
    assert gpu0 is not None and gpu1 is not None
    assert gpu0.measure == {30, 31} and gpu1.measure == {28, 29}
    assert gpu0.build == gpu1.build == frozenset(range(28))  # every GPU's compiles share the rest
    assert not gpu0.measure & gpu0.build


def test_a_small_host_is_not_pinned() -> None:
    assert cpus.cpu_plan(range(2), 0, 1) is None  # CI's machine
    assert cpus.cpu_plan(range(7), 0, 2) is None  # 2 GPUs × 2 cores leave 3 < MIN_SPARE
    assert cpus.cpu_plan(range(8), 0, 2) is not None
    assert cpus.cpu_plan(range(16), 3, 2) is None  # a slot the host does not have


def test_the_plan_follows_the_visible_gpu_and_the_usable_cores(tmp_path: Path, monkeypatch) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).touch()
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(16)))
    plan = cpus.host_plan({"CUDA_VISIBLE_DEVICES": "1"}, tmp_path)
    assert plan is not None and plan.measure == {12, 13} and plan.build == frozenset(range(12))
    assert cpus.host_plan({}, tmp_path).measure == {14, 15}  # unset: GPU 0
    assert cpus.host_plan({"CUDA_VISIBLE_DEVICES": "GPU-5f1c"}, tmp_path).measure == {14, 15}  # a UUID: GPU 0
    assert cpus.host_plan({}, tmp_path / "none") is None  # no GPU nodes: nothing to pin for


def test_describe_names_the_cores() -> None:
    plan = cpus.cpu_plan(range(32), 1, 2)
    assert cpus.describe(plan) == "[grader] CPUs: judge and runner on cores 28-29, compiles on 0-27"
    assert "not pinned" in cpus.describe(None)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="util-linux taskset is not installed")
def test_a_pinned_command_and_its_children_run_on_those_cores() -> None:
    command = cpus.pinned(["sh", "-c", "grep Cpus_allowed_list /proc/self/status"], frozenset({0}))
    assert command[1:3] == ["-c", "0"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.split()[-1] == "0"  # the shell's child (grep) inherited core 0
    assert cpus.pinned(["true"], None) == ["true"]

"""bench/autotune_configs.py: each config of a solution's autotuner run alone in its own process and judged.

On the CPU (Triton's interpreter) with a kernel written here whose four configs do four different things:
right, wrong by a factor, refused at compile time, and a process that dies (as one that faults does). Each
is told apart, and one config's death does not hide the others' results. A line after the answer (as
compute-sanitizer prints its summary) does not hide it either."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from grading import run_bench_tool

ROOT = Path(__file__).resolve().parents[1]

SOLUTION = '''
import atexit
import os
import torch
import triton
import triton.language as tl

from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401


@triton.autotune(configs=[triton.Config({"SCALE": s}) for s in (1, 2, 0, 3)], key=["n"])
@triton.jit
def _scaled(x_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    tl.static_assert(SCALE != 0, "SCALE 0 is refused")
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(x_ptr + i, x * SCALE, mask=i < n)


atexit.register(print, "========= ERROR SUMMARY: 0 errors")  # as compute-sanitizer ends: after the answer


class Model(_Reference):
    def forward(self, x):
        if [c.kwargs["SCALE"] for c in _scaled.configs] == [3]:
            os._exit(7)  # as a process whose kernel faulted dies
        out = super().forward(x).float().contiguous()  # fp32: Triton's interpreter has no bf16
        _scaled[(1,)](out, out.numel(), BLOCK=triton.next_power_of_2(out.numel()))
        return out.to(x.dtype)
'''


def _configs(tmp_path: Path, name: str, source: str) -> list[dict]:
    """bench/autotune_configs.py's rows for SOURCE as a 07 solution, on the CPU."""
    return run_bench_tool(tmp_path, "autotune_configs.py", name, source, "--device", "cpu")[0]["configs"]


def test_each_config_is_run_alone_and_judged(tmp_path: Path) -> None:
    rows = _configs(tmp_path, "sub", SOLUTION)
    assert [(r["autotuner"], r["config"], r["status"]) for r in rows] == [
        ("_scaled", 0, "ok"), ("_scaled", 1, "wrong"), ("_scaled", 2, "error"), ("_scaled", 3, "crashed")]
    assert "out of tolerance" in rows[1]["said"]
    assert "SCALE 0 is refused" in rows[2]["said"]
    assert "exit code 7" in rows[3]["said"]
    assert "SCALE: 2" in rows[1]["what"]


@pytest.mark.parametrize(("tool", "said"), [("autotune_configs.py", "no run.yaml naming its problem"),
                                           ("triton_bounds.py", "no run.yaml (who wrote this kernel")])
def test_a_folder_without_its_problem_is_one_line(tmp_path: Path, tool: str, said: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / tool), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"{tmp_path}: {said}" in proc.stderr
    assert "Traceback" not in proc.stderr


FIXED = '''
import torch
import triton
import triton.language as tl

from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401


@triton.jit
def _copy(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


class Model(_Reference):
    def forward(self, x):
        out = super().forward(x).float().contiguous()
        _copy[(1,)](out, out.numel(), BLOCK=triton.next_power_of_2(out.numel()), num_warps=4)
        return out.to(x.dtype)
'''


def test_a_solution_without_an_autotuner_is_called_once_as_published(tmp_path: Path) -> None:
    rows = _configs(tmp_path, "fixed", FIXED)
    assert [(r["autotuner"], r["what"], r["status"]) for r in rows] == [
        ("—", "no autotuner: the call as published", "ok")]

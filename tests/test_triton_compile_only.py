"""Triton kernels compiled for the H200 on a machine with no GPU: the prebuild's warm call launches them
on meta tensors, and they compile into the worker's cache (sm_90 cubins) and run nowhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # a dev dependency (pyproject.toml): these tests run wherever `make test` does
import triton.language as tl

from kernelboard.eval.triton_compile_only import compile_only

ROOT = Path(__file__).resolve().parents[1]
DECK = ROOT / "eval" / "decks" / "hard"


@triton.jit
def _add(x, y, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out + offsets, tl.load(x + offsets, mask=mask) + tl.load(y + offsets, mask=mask), mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 128}, num_warps=4),
                          triton.Config({"BLOCK": 256}, num_warps=4)], key=["n"], cache_results=True)
@triton.jit
def _double(x, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)


def _cache_files(cache: Path, ending: str) -> list[Path]:
    """The cache's files whose names end so, less the group indexes (`__grp__<name>.json`)."""
    return sorted(p for p in cache.rglob(f"*{ending}") if not p.name.startswith("__grp__"))


@pytest.fixture
def triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return tmp_path / "triton"


def test_a_launch_on_meta_compiles_for_the_grading_arch_and_nothing_runs(triton_cache: Path) -> None:
    """One variant per specialisation: a second launch alike is found, an odd length (not divisible by 16)
    is a new one; each is an sm_90 cubin in TRITON_CACHE_DIR. Afterwards Triton is as it was."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    x = torch.empty(4096, device="meta", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    with compile_only((9, 0)) as compiled:
        assert compiled is not None
        _add[(32,)](x, x, out, 4096, BLOCK=128)
        _add[(32,)](x, x, out, 4096, BLOCK=128)
        _add[(33,)](x, x, out, 4097, BLOCK=128)
    assert (compiled.variants, compiled.repeats, compiled.failed) == (2, 1, [])
    metadata = [json.loads(p.read_text()) for p in _cache_files(triton_cache, "_add.json")]
    assert len(metadata) == 2 and len(_cache_files(triton_cache, "_add.cubin")) == 2
    assert {(m["target"]["backend"], m["target"]["arch"], m["target"]["warp_size"]) for m in metadata} == {
        ("cuda", 90, 32)}
    assert JITFunction.run is run and driver._active is None  # the next use looks for a real driver again


def test_an_autotuner_compiles_every_config_and_keeps_no_choice_on_disk(triton_cache: Path) -> None:
    """Its choice here comes from no timing at all: written to disk (`cache_results=True`), it would be the
    worker's choice too. Every config compiles, so the worker's autotuning finds them all built."""
    x = torch.empty(10_000, device="meta", dtype=torch.float32)
    with compile_only((9, 0)) as compiled:
        _double[lambda meta: (triton.cdiv(10_000, meta["BLOCK"]),)](x, torch.empty_like(x), 10_000)
    assert compiled is not None and compiled.variants == 3  # the chosen config's launch is then found
    assert len(_cache_files(triton_cache, "_double.cubin")) == 3
    assert not _cache_files(triton_cache, ".autotune.json")


def test_a_failed_launch_is_counted_with_its_own_words(triton_cache: Path) -> None:
    """As kinetic-0715's Mega kernel of 2026-07-16 23:33 calls its own `.warmup` with one positional argument
    too many: the summary says which kernel failed and why, so a prebuild log tells the solution's bug
    from ours."""
    x = torch.empty(256, device="meta", dtype=torch.float32)
    with compile_only((9, 0)) as compiled, pytest.raises(TypeError):
        _add[(1,)](x, x, x, 256, 128, BLOCK=128)
    assert compiled is not None and compiled.variants == 0
    assert compiled.failed == ["_add: TypeError: dynamic_func() got multiple values for argument 'BLOCK'"]
    assert "1 failed (_add: TypeError: dynamic_func() got multiple values" in compiled.summary()


def _prebuild(problem: Path, solution_dir: Path, cache: Path) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCH_CUDA_ARCH_LIST": "9.0", "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-m", "kernelboard.eval.prebuild", str(problem), str(solution_dir), "120"],
                          cwd=solution_dir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


# A 05 solution whose first read of data is after its Triton kernel: each shape's call compiles it. It sets
# its own arch list at import, as 38 published kernels do ("9.0a" for five): the grader's is read before.
SOLUTION_05 = """
import os
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
import torch, triton, triton.language as tl
from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401

@triton.jit
def _copy(x, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offsets, tl.load(x + offsets, mask=offsets < n), mask=offsets < n)

class Model(_Reference):
    def forward(self, x):
        out = torch.empty_like(x)
        block = triton.next_power_of_2(min(x.shape[-1], 1024))  # a constexpr that follows the shape
        _copy[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
        return super().forward(out)
"""


def test_the_prebuild_compiles_each_shapes_triton_kernels(tmp_path: Path) -> None:
    from kernelboard.eval.deck import load_problem

    (tmp_path / "solution.py").write_text(SOLUTION_05)
    log = _prebuild(DECK / "05_topk_bitonic", tmp_path, tmp_path / "triton")
    shapes = load_problem(DECK / "05_topk_bitonic").shapes
    assert log.count("[prebuild] warm call returned") == 2 * len(shapes), log  # on meta, then on fake CUDA
    assert log.count("Model built on fake CUDA tensors") == len(shapes), log
    built = int(re.search(r"(\d+) Triton kernel variants compiled", log)[1])  # type: ignore[index]
    assert 1 <= built <= len(shapes) and built == len(_cache_files(tmp_path / "triton", "_copy.cubin")), log


def test_a_published_triton_kernel_compiles_in_the_prebuild(tmp_path: Path) -> None:
    """kimi-k2.7's 07 (published on kernelbench.com, no code of ours): its W4A16 kernels compile for sm_90
    in the warm call, and the call runs to its end on meta tensors."""
    import shutil

    published = ROOT / "data" / "submissions" / "hard" / "20260618_064723_kimi-claude_kimi-k2.7-code_07_w4a16_gemm"
    shutil.copytree(published, tmp_path / "solution")
    log = _prebuild(DECK / "07_w4a16_gemm", tmp_path / "solution", tmp_path / "triton")
    built = int(re.search(r"(\d+) Triton kernel variants compiled", log)[1])  # type: ignore[index]
    assert built >= 1 and "failed" not in log and "[prebuild] warm call returned" in log, log
    assert len(_cache_files(tmp_path / "triton", ".cubin")) == built

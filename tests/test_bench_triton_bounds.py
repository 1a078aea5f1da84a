"""bench/triton_bounds.py: every address a solution's Triton kernels touch, checked in the interpreter on the CPU.

A kernel written here for 07 passes the reference's output through a bf16 `tl.dot` with the identity, into a
buffer its constructor puts on "cuda" (as published kernels do): it must run here, on the CPU, and give the
reference's values (Triton 3.6's interpreter multiplies bf16 bit patterns as integers unless the tool widens
them). The same kernel with its row mask left off reads past the end of its input: the tool counts those lanes,
names the argument and how far past its end, masks them off (no crash) and judges the output wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from grading import run_bench_tool

ROOT = Path(__file__).resolve().parents[1]

SOLUTION = '''
import torch
import triton
import triton.language as tl

from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401


@triton.jit
def _through_identity(x_ptr, out_ptr, rows, ROW_MASK: tl.constexpr):
    r = tl.program_id(0) * 16 + tl.arange(0, 16)[:, None]
    c = tl.arange(0, 16)[None, :]
    inside = (r < rows) if ROW_MASK else (c < 16)
    x = tl.load(x_ptr + r * 16 + c, mask=inside, other=0.0)
    eye = tl.where(tl.arange(0, 16)[:, None] == tl.arange(0, 16)[None, :], 1.0, 0.0).to(tl.bfloat16)
    tl.store(out_ptr + r * 16 + c, tl.dot(x, eye), mask=r < rows)


class Model(_Reference):
    def __init__(self, *args):
        super().__init__(*args)
        self.scratch = torch.empty(4096, device="cuda", dtype=torch.float32)  # a buffer on the GPU

    def forward(self, x):
        out = super().forward(x).contiguous()
        rows = out.numel() // 16
        _through_identity[(triton.cdiv(rows, 16),)](out, self.scratch, rows, ROW_MASK=MASKED)
        return self.scratch[: out.numel()].view(out.shape).to(out.dtype)
'''


def _bounds(tmp_path: Path, name: str, source: str) -> tuple[dict, str]:
    """bench/triton_bounds.py's answer and printout for SOURCE as a 07 solution, at the CPU's shape 0."""
    return run_bench_tool(tmp_path, "triton_bounds.py", name, source, "--shapes-of", "cpu")


@pytest.mark.parametrize("masked", [True, False])
def test_every_address_is_checked_and_one_past_the_end_is_named(tmp_path: Path, masked: bool) -> None:
    pytest.importorskip("triton")
    answer, printed = _bounds(tmp_path, "masked" if masked else "unmasked", SOLUTION.replace("MASKED", str(masked)))
    assert "its output: right" in printed
    assert (answer["shapes_of"], answer["shape"], answer["shape_label"]) == ("cpu", 0, "cpu decode")
    # named with the constexpr values given as keywords, as an autotuner's config gives its block sizes
    tally = answer["kernels"][f"_through_identity[ROW_MASK={masked}]"]
    # cpu decode: M 1, N 64 -> 4 rows of 16 bf16 (128 B), one program of 16 rows
    assert tally["launches"] == 1 and tally["programs"] == 1
    # Right either way: the bf16 dot is widened (the interpreter's own would multiply integers), the stores
    # are masked, and the rows read past the end were masked off (read as 0), never read from other memory.
    assert answer["values"] == "right"
    if masked:
        assert tally["outside"] == 0 and tally["examples"] == []
        assert tally["accesses"] == 2 * 4 * 16  # each element loaded once and stored once
    else:
        assert tally["outside"] == 12 * 16  # rows 4-15 of the one tile, every column
        assert tally["accesses"] == 16 * 16 + 4 * 16
        assert tally["examples"][0] == "load of 2 B by program (0, 0, 0): byte 128 of x_ptr, which has 128 B"
        assert len(tally["examples"]) == 3


TUNED = '''
import torch
import triton
import triton.language as tl

from reference import Model as _Reference, get_inputs, get_init_inputs  # noqa: F401


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"])
@triton.jit
def _copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * 64 + tl.arange(0, BLOCK)  # BLOCK 128 strides by 64: its last program reads past n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n + (BLOCK - 64)), mask=i < n)


class Model(_Reference):
    def forward(self, x):
        out = super().forward(x).float().contiguous()
        copy = torch.empty_like(out)
        _copy[(triton.cdiv(out.numel(), 64),)](out, copy, out.numel())
        return copy.to(x.dtype)
'''


def test_every_config_of_an_autotuner_is_launched_and_tallied_apart(tmp_path: Path) -> None:
    """As on a GPU, where the autotuner's benchmark launches every config and any one can fault (LongCat-2.0's
    07 config 8 on the H100): each config runs once, and only the one that reads past the end is named."""
    pytest.importorskip("triton")
    kernels = _bounds(tmp_path, "tuned", TUNED)[0]["kernels"]
    # cpu decode: 64 fp32 outputs (256 B), one program. The autotuner launches each config once in its
    # benchmark, then the first (all timed alike) once more for the call itself.
    assert set(kernels) == {"_copy[BLOCK=64]", "_copy[BLOCK=128]"}
    assert kernels["_copy[BLOCK=64]"]["launches"] == 2 and kernels["_copy[BLOCK=64]"]["outside"] == 0
    assert kernels["_copy[BLOCK=128]"]["launches"] == 1 and kernels["_copy[BLOCK=128]"]["outside"] == 64
    assert kernels["_copy[BLOCK=128]"]["examples"][0].endswith("byte 256 of x_ptr, which has 256 B")


def test_a_solution_that_raises_is_one_line_beside_what_its_launches_touched(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    last = "        return self.scratch"
    gives_up = "        raise RuntimeError('the solution gave up')\n"
    source = SOLUTION.replace("MASKED", "True").replace(last, gives_up + last)
    answer, printed = _bounds(tmp_path, "raises", source)
    assert answer["values"] == "not judged: its call raised RuntimeError: the solution gave up"
    assert answer["kernels"]["_through_identity[ROW_MASK=True]"]["launches"] == 1  # what ran before it raised
    assert "Traceback" not in printed

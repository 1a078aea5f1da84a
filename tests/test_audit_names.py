"""The own-kernel rule on kernel names recorded on an H200 (torch 2.11, 2026-11-29): PyTorch and
vendor-library kernels never count as the candidate's own, whatever their names begin with."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelboard.eval.audit import LIBRARY_KERNEL, kernel_problems
from kernelboard.eval.deck import load_problem

HARD = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard"

#: What 02's reference (eager PyTorch, with a batched triangular solve) launched in one timed call.
REFERENCE_KDA = [
    "void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda(at::TensorIteratorBase&)>",
    "void at::native::tensor_kernel_scan_outer_dim<float, unsigned int, std::plus<float> >(float*, float const*)",
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas",
    "void batch_trsm_left_kernel<float, 64, 4, 3, false, true, true>"
    "(cublasTrsmBatchParams2<float>, float, float const*, int)",
    "Memcpy DtoD (Device -> Device)",
]
HOUSE_KDA = ["_kda_intra", "_kda_inter"]


@pytest.mark.parametrize("name", REFERENCE_KDA)
def test_library_kernels_are_recognised(name: str) -> None:
    assert LIBRARY_KERNEL.search(name), name


@pytest.mark.parametrize("name", [*HOUSE_KDA, "_paged_decode", "topk_kernel_0d1d2d", "my_gemm(float*, int)"])
def test_a_candidates_kernels_are_its_own(name: str) -> None:
    assert not LIBRARY_KERNEL.search(name), name


def test_a_reference_that_only_calls_libraries_has_no_kernel_of_its_own() -> None:
    problem = load_problem(HARD / "02_kda_cutlass")
    assert problem.require_own_kernel
    problems = kernel_problems(problem, REFERENCE_KDA)
    assert len(problems) == 1 and problems[0].startswith("no kernel of its own ran: all 5 kernels")
    assert kernel_problems(problem, [*REFERENCE_KDA, *HOUSE_KDA]) == []

"""What a nominal check can tell, per Hard problem, at its smallest H200 shape (the CPU runs the
reference): where the deck's atol dwarfs the nominal outputs, its element-wise rule passes a zero
output, and only the norm bound the judge adds on nominal draws (correctness.REL_ERR_MAX) refuses it.
The figures are the ones docs/methodology.md quotes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kernelboard.eval.correctness import REL_ERR_MAX, compare, dtype_name
from kernelboard.eval.deck import load_problem
from kernelboard.eval.judge import judge_values
from kernelboard.eval.plan import apply_shape, build_model, draw_inputs, import_file, install_shapes_module

HARD = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard"

#: problem -> whether the deck's element-wise rule alone passes a zero output at every element of
#: the nominal output of seed 42 at the smallest H200 shape.
ZEROS_PASS_THE_DECKS_RULE = {"01_fp8_gemm": False, "02_kda_cutlass": True, "03_paged_attention": True,
                             "05_topk_bitonic": False, "06_sonic_moe_swiglu": False, "07_w4a16_gemm": False}


@pytest.mark.parametrize("name", sorted(ZEROS_PASS_THE_DECKS_RULE))
def test_a_zero_output_fails_every_nominal_check(name: str) -> None:
    problem = load_problem(HARD / name)
    install_shapes_module(problem.shapes)
    reference = import_file("reference", HARD / name / "reference.py")
    shape = min(problem.shapes, key=lambda s: math.prod(v for v in s.params.values() if isinstance(v, int)))
    apply_shape(reference, problem, shape)
    inputs = draw_inputs(reference, 42, "cpu")
    with torch.no_grad():
        ref = build_model(reference, reference.get_init_inputs(), "cpu")(*inputs)
    parts = ref if isinstance(ref, tuple) else (ref,)
    zeros = tuple(torch.zeros_like(p) for p in parts)
    verdict = judge_values(problem, ref, zeros, inputs if problem.rule_reads_inputs else [], None)
    assert not verdict.ok
    out = parts[0]
    atol, rtol = problem.tolerance_for(dtype_name(out.dtype))
    decks_rule = compare(out, zeros[0], atol, rtol)
    assert decks_rule.ok == ZEROS_PASS_THE_DECKS_RULE[name], decks_rule.message
    if decks_rule.ok:  # the judge's own bound is what refuses it, and says so
        assert f"is above {REL_ERR_MAX:g}" in verdict.message and "dwarfs" in verdict.message
        assert float(out.abs().max()) < atol

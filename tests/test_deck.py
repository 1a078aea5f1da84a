"""Deck loading, formulas and tolerances."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernelboard.errors import DeckError
from kernelboard.eval.deck import evaluate_formula, load_deck, load_problem

DECK = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard"

# KernelBench-Hard's published sanity values for 03_paged_attention (hard-deck-interface.md B.3.6).
SANITY = [(134_217_728, 33_685_504), (1_073_741_824, 268_959_744), (536_870_912, 67_239_936),
          (402_391_040, 100_859_904), (65_536_000, 16_416_768)]


def test_paged_attention_formulas_match_the_published_values() -> None:
    problem = load_problem(DECK / "03_paged_attention")
    assert [(problem.flops(s), problem.bytes_moved(s)) for s in problem.shapes] == SANITY


def test_bytes_formula_is_the_kv_cache_plus_query_and_output() -> None:
    problem = load_problem(DECK / "03_paged_attention")
    for s in problem.shapes:
        p = s.params
        kv = 2 * p["batch"] * p["seq_len"] * p["num_kv_heads"] * p["head_dim"] * 2  # K and V, bf16
        q_and_out = 2 * p["batch"] * p["num_heads"] * p["head_dim"] * 2
        assert problem.bytes_moved(s) == kv + q_and_out


def test_tolerance_lookup_prefers_the_stress_case() -> None:
    problem = load_problem(DECK / "03_paged_attention")
    small = next(c for c in problem.numeric_stress if c.name == "small_q_kv")
    assert problem.tolerance_for("bfloat16") == (0.02, 0.02)
    assert problem.tolerance_for("bfloat16", small) == (5e-4, 5e-2)
    assert problem.tolerance_for("float32") == (1e-4, 1e-4)
    assert problem.tolerance_for("int32") == (0.0, 0.0)


def test_structural_cases_are_canonical_then_drawn_from_the_seed() -> None:
    stress = load_problem(DECK / "03_paged_attention").structural_stress
    assert stress is not None
    a, b = stress.cases(7), stress.cases(7)
    assert a == b and len(a) == 3
    assert a[0].params == {"divisor": 16, "tail": 1, "stride": 3}
    assert all(4 <= c.params["divisor"] <= 32 for c in a[1:])


@pytest.mark.parametrize("formula", ["__import__('os')", "batch.real", "max(batch, 1)", "nope * 2"])
def test_formulas_allow_only_arithmetic_on_shape_keys(formula: str) -> None:
    with pytest.raises(ValueError):
        evaluate_formula(formula, {"batch": 2})


def test_bad_problem_yaml_names_file_and_key(tmp_path: Path) -> None:
    folder = tmp_path / "03_paged_attention"
    shutil.copytree(DECK / "03_paged_attention", folder)
    text = (folder / "problem.yaml").read_text()
    (folder / "problem.yaml").write_text(text.replace("regime: memory", "regime: vibes"))
    with pytest.raises(DeckError, match=r"problem.yaml: key 'regime': expected one of compute, memory"):
        load_problem(folder)
    (folder / "problem.yaml").write_text(text.replace("seq_len: 50,", "seq_len: -5,"))
    with pytest.raises(DeckError, match=r"cpu_shapes\[0\].params.seq_len: expected a positive integer"):
        load_problem(folder)


def test_empty_deck_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DeckError, match="no problem folders"):
        load_deck(tmp_path)


def test_a_problem_can_leave_out_one_compile_baseline(tmp_path: Path) -> None:
    """02 never measures max-autotune (minutes of autotuning): `make eval` grades it as the committed
    rows were, with no --skip-baseline to remember; a name that is no compile variant, or one that
    leaves the headline no compile variant, is refused in one line."""
    from kernelboard.eval.schedule import EvalOptions, baseline_variants

    kda = load_problem(DECK / "02_kda_cutlass")
    assert kda.skip_baselines == ("compile:max-autotune",)
    opts = EvalOptions(deck=DECK, submissions=tmp_path, out=tmp_path, device="cuda")
    assert baseline_variants(opts, kda) == ("eager", "compile:default", "library:fla.chunk_kda")
    assert "compile:max-autotune" in baseline_variants(opts, load_problem(DECK / "03_paged_attention"))
    folder = tmp_path / "03_paged_attention"
    shutil.copytree(DECK / "03_paged_attention", folder)
    text = (folder / "problem.yaml").read_text()
    for value, why in (("[eager]", "expected one of compile:default, compile:max-autotune, got 'eager'"),
                       ("[compile:default, compile:max-autotune]", "skips every compile variant")):
        (folder / "problem.yaml").write_text(f"{text}\nskip_baselines: {value}\n")
        with pytest.raises(DeckError, match=rf"problem.yaml: skip_baselines: {why}"):
            load_problem(folder)

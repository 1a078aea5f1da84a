"""The Hard deck's 05_topk_bitonic and 06_sonic_moe_swiglu: the KernelBench-Hard interface
(hard-deck-interface.md B.4, B.5), formulas against counted work, structural cases, and 06
graded end to end on the CPU (05 returns a tuple, which the grader does not compare yet)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from grading import MeasuredBaselines, grade
from torch.utils.flop_counter import FlopCounterMode

from kernelboard.eval.correctness import compare_topk
from kernelboard.eval.deck import Problem, Shape, evaluate_formula, load_problem
from kernelboard.eval.plan import apply_shape, build_model, draw_inputs, import_file

DECK = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard"
TOPK, MOE = "05_topk_bitonic", "06_sonic_moe_swiglu"

# B.4.6: (flops, bytes) per shape, KernelBench-Hard's formulas, kept.
TOPK_SANITY = [(524_288, 525_056), (2_097_152, 2_103_296), (2_097_152, 2_109_440), (768_000, 771_072),
               (2_097_152, 2_098_688)]
# B.5.6: (KernelBench-Hard's formula flops, the actual GEMM flops, bytes) per shape.
MOE_SANITY = [(824_633_720_832, 6_597_069_766_656, 6_174_015_488),
              (34_359_738_368, 137_438_953_472, 637_534_208),
              (549_755_813_888, 4_398_046_511_104, 3_758_096_384)]
MOE_PUBLISHED_FLOPS = "2 * T_total * H * (2 * I)"


def _load(name: str) -> tuple[Problem, types.ModuleType]:
    problem = load_problem(DECK / name)
    return problem, import_file(f"_deck_{name}_reference", problem.reference_path)


@pytest.fixture(scope="module")
def topk() -> tuple[Problem, types.ModuleType]:
    return _load(TOPK)


@pytest.fixture(scope="module")
def moe() -> tuple[Problem, types.ModuleType]:
    return _load(MOE)


def _model(problem: Problem, ref: types.ModuleType, shape: Shape, seed: int = 42) -> torch.nn.Module:
    apply_shape(ref, problem, shape)
    torch.manual_seed(seed)
    return ref.Model(*ref.get_init_inputs()).eval()


def _inputs(ref: types.ModuleType, seed: int = 42) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return ref.get_inputs()


def moe_loop(model: torch.nn.Module, hidden: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """KernelBench-Hard's semantics written plainly: one bf16 GEMM pair per non-empty expert."""
    bounds = offsets.tolist()
    out = torch.zeros(hidden.shape[0], model.W_gate.shape[-1], dtype=hidden.dtype)
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            x = hidden[lo:hi]
            out[lo:hi] = F.silu(x @ model.W_gate[e]) * (x @ model.W_up[e])
    return out


# ------------------------------------------------------------------------------ loading and formulas


def test_both_problems_load_with_the_spec_interface(topk, moe) -> None:
    (p5, r5), (p6, r6) = topk, moe
    assert (p5.bench, p5.regime, p5.precision, p5.peak_tflops_key) == ("hard", "memory", "fp32", "fp32")
    assert (p6.bench, p6.regime, p6.precision, p6.peak_tflops_key) == ("hard", "compute", "bf16", "bf16")
    assert p5.shape_globals == {"batch": "batch", "n": "n", "k": "k"}
    assert set(p6.shape_globals) == {"T_total", "H", "I", "E", "K"}
    assert [s.params for s in p5.shapes] == [{"batch": 1, "n": 131072, "k": 64}, {"batch": 64, "n": 8192, "k": 8},
                                             {"batch": 32, "n": 16384, "k": 32}, {"batch": 16, "n": 12000, "k": 16},
                                             {"batch": 128, "n": 4096, "k": 1}]
    assert [s.params for s in p6.shapes] == [{"T_total": 32768, "H": 4096, "I": 1536, "E": 128, "K": 8},
                                             {"T_total": 4096, "H": 2048, "I": 1024, "E": 64, "K": 4},
                                             {"T_total": 16384, "H": 2048, "I": 4096, "E": 64, "K": 8}]
    assert p5.seeds == p6.seeds == (42, 123, 456)
    assert p5.tolerance_for("float32") == (1e-4, 1e-4) and p6.tolerance_for("bfloat16") == (0.02, 0.02)
    assert {c.name: c.scale for c in p5.numeric_stress} == {"tiny_values": {0: 1e-4}, "large_values": {0: 1e3}}
    assert {c.name: c.scale for c in p6.numeric_stress} == {"small_hidden": {0: 1e-2}, "large_hidden": {0: 8.0}}
    assert "torch.topk" in p5.forbidden and "Tensor.argsort" in p5.forbidden and len(p5.forbidden) == 11
    assert p6.forbidden == ("torch.matmul", "torch.bmm", "torch.nn.functional.linear", "F.linear",
                            "from sonic_moe", "import sonic_moe")
    assert (r5.OP_TYPE, r6.OP_TYPE) == ("topk", "grouped_gemm_swiglu")
    assert callable(r6._build_routing)
    for problem, ref in (topk, moe):
        assert problem.structural_stress is not None
        assert callable(getattr(ref, problem.structural_stress.function))


def test_topk_formulas_are_the_published_ones_and_match_tensor_sizes(topk) -> None:
    problem, ref = topk
    assert [(problem.flops(s), problem.bytes_moved(s)) for s in problem.shapes] == TOPK_SANITY
    for shape in problem.cpu_shapes:
        model = _model(problem, ref, shape)
        (x,) = _inputs(ref)
        values, indices = model(x)
        assert problem.bytes_moved(shape) == x.nbytes + values.nbytes + indices.nbytes  # read x, write both
        assert problem.flops(shape) == 4 * x.numel()  # nominal: selection has no arithmetic to count


def test_moe_flops_count_every_routed_row(moe) -> None:
    """The fix: KernelBench-Hard's formula leaves out K; ours is its 'actual GEMM flops' column."""
    problem, _ = moe
    for shape, (published, actual, bytes_moved) in zip(problem.shapes, MOE_SANITY, strict=True):
        old = evaluate_formula(MOE_PUBLISHED_FLOPS, shape.params)
        assert old == published
        assert problem.flops(shape) == actual == old * shape.params["K"]
        assert problem.bytes_moved(shape) == bytes_moved


@pytest.mark.parametrize("idx", [0, 1])
def test_moe_formulas_match_counted_flops_and_tensor_bytes(moe, idx: int) -> None:
    problem, ref = moe
    shape = problem.cpu_shapes[idx]
    model = _model(problem, ref, shape)
    hidden, offsets = _inputs(ref)
    with torch.no_grad(), FlopCounterMode(display=False) as loop_count:
        out = moe_loop(model, hidden, offsets)
    assert loop_count.get_total_flops() == problem.flops(shape)  # 2 GEMMs over T·K rows
    with torch.no_grad(), FlopCounterMode(display=False) as ref_count:
        model(hidden, offsets)
    if idx == 0:  # balanced groups: the reference's batched GEMM does exactly that work
        assert ref_count.get_total_flops() == problem.flops(shape)
    else:  # groups of 19 and 18 rows: it pads to 19, so it counts 6·19 = 114 rows for 111
        assert ref_count.get_total_flops() == problem.flops(shape) * 114 // 111
    weights = model.W_gate.nbytes + model.W_up.nbytes
    assert problem.bytes_moved(shape) == hidden.nbytes + weights + out.nbytes  # offsets left out


# ------------------------------------------------------------------------------ state and inputs


def test_topk_state_dict_and_inputs_match_the_spec(topk) -> None:
    problem, ref = topk
    for shape in problem.shapes + problem.cpu_shapes:
        p = shape.params
        model = _model(problem, ref, shape)
        assert ref.get_init_inputs() == [p["batch"], p["n"], p["k"]]
        assert (model.batch, model.n, model.k) == (p["batch"], p["n"], p["k"])
        state = model.state_dict()
        assert list(state) == ["_dummy"]  # persistent: a solution must register it too
        assert state["_dummy"].shape == (1,) and state["_dummy"].dtype == torch.float32
        (x,) = _inputs(ref)
        assert x.shape == (p["batch"], p["n"]) and x.dtype == torch.float32 and x.device.type == "cpu"
    torch.manual_seed(7)
    expected = torch.randn(p["batch"], p["n"])  # at the last shape applied
    assert torch.equal(_inputs(ref, 7)[0], expected)  # standard normal, no internal reseed


def test_moe_state_dict_and_inputs_match_the_spec(moe) -> None:
    problem, ref = moe
    for shape in problem.shapes:  # full size on the meta device: shapes and dtypes without 3 GB
        apply_shape(ref, problem, shape)
        p = shape.params
        assert ref.get_init_inputs() == [p["T_total"], p["H"], p["I"], p["E"], p["K"]]
        with torch.device("meta"):
            model = ref.Model(*ref.get_init_inputs())
        state = model.state_dict()
        assert list(state) == ["W_gate", "W_up"]
        assert all(v.shape == (p["E"], p["H"], p["I"]) and v.dtype == torch.bfloat16 for v in state.values())
        assert {n for n, _ in model.named_parameters()} == {"W_gate", "W_up"}
        counts = ref._build_routing(p["T_total"], p["E"], p["K"]).diff()
        assert counts.tolist() == [p["T_total"] * p["K"] // p["E"]] * p["E"]  # 2048, 256, 2048 per expert
    shape = problem.cpu_shapes[1]  # 111 rows over 6 experts: the first 3 get the extra row
    model = _model(problem, ref, shape, seed=5)
    torch.manual_seed(5)
    gate = torch.empty(6, 256, 96, dtype=torch.bfloat16).normal_(0, 0.02)
    up = torch.empty(6, 256, 96, dtype=torch.bfloat16).normal_(0, 0.02)
    assert torch.equal(model.W_gate, gate) and torch.equal(model.W_up, up)  # N(0, 0.02²), gate first
    hidden, offsets = _inputs(ref, 9)
    torch.manual_seed(9)
    assert torch.equal(hidden, torch.randn(111, 256).mul_(0.1).to(torch.bfloat16))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 19, 38, 57, 75, 93, 111]


# ------------------------------------------------------------------------------ 06: exactness, routing

_RAGGED = [
    {"receiver": 0, "donor": 1, "row_delta": 129, "prefix_rows": 64, "suffix_scale": 8, "empty_stride": 0},
    {"receiver": 5, "donor": 9, "row_delta": 127, "prefix_rows": 1, "suffix_scale": 4, "empty_stride": 3},
    {"receiver": 77, "donor": 3, "row_delta": 257, "prefix_rows": 100, "suffix_scale": 12, "empty_stride": 2},
    {"receiver": 2, "donor": 2, "row_delta": 1, "prefix_rows": 127, "suffix_scale": 5, "empty_stride": 16},
]


def _ragged(ref: types.ModuleType, hidden: torch.Tensor, offsets: torch.Tensor, case: dict) -> list:
    return ref.ragged_routing([hidden, offsets], **case)


@pytest.mark.parametrize("idx", [0, 1])
@pytest.mark.parametrize("case", [None, *_RAGGED], ids=["nominal", *(f"ragged{i}" for i in range(len(_RAGGED)))])
def test_vectorised_moe_is_bit_identical_to_a_per_expert_loop(moe, idx: int, case: dict | None) -> None:
    """Exact, not merely close: the same bf16 GEMMs with fp32 accumulation and the same two
    bf16 roundings of the SwiGLU; only the call that sums each dot product differs."""
    problem, ref = moe
    model = _model(problem, ref, problem.cpu_shapes[idx])
    inputs = _inputs(ref)
    if case is not None:
        inputs = _ragged(ref, *inputs, case)
    with torch.no_grad():
        out = model(*inputs)
        assert torch.equal(out, moe_loop(model, *inputs))
        big = (inputs[0].float() * 8).to(torch.bfloat16)  # the large_hidden numeric case
        assert torch.equal(model(big, inputs[1]), moe_loop(model, big, inputs[1]))


def test_ragged_routing_reproduces_kernelbench_hard_on_shape_1(moe) -> None:
    problem, ref = moe
    apply_shape(ref, problem, problem.shapes[1])
    hidden, offsets = _inputs(ref)
    new_hidden, new_offsets = _ragged(ref, hidden, offsets, _RAGGED[0])
    counts = new_offsets.diff().tolist()
    assert counts[:2] == [385, 127] and counts[2:] == [256] * 62  # B.5.6's canonical result
    assert torch.equal(new_hidden[:64], hidden[:64])  # p = max(64, 65536/2048, 64) = 64
    assert torch.equal(new_hidden[64:], (hidden[64:].float() * 8).to(torch.bfloat16))
    assert not torch.equal(new_hidden, hidden) and torch.equal(_inputs(ref)[0], hidden)  # no writes
    counts = _ragged(ref, hidden, offsets, _RAGGED[1])[1].diff().tolist()
    assert counts[0] == counts[-1] == 0 and counts.count(0) == 22  # experts 0, 3, …, 63 emptied
    assert max(counts) <= 3 * 256 + 127


@pytest.mark.parametrize("seed", range(6))
def test_ragged_routing_gives_valid_offsets_on_every_shape(moe, seed: int) -> None:
    problem, ref = moe
    assert problem.structural_stress is not None
    for shape in problem.shapes + problem.cpu_shapes:
        p = shape.params
        t_perm = p["T_total"] * p["K"]
        offsets = ref._build_routing(p["T_total"], p["E"], p["K"])
        stand_in = torch.zeros(1, p["H"], dtype=torch.bfloat16)  # the offsets never depend on the rows
        for case in problem.structural_stress.cases(seed):
            new = ref.ragged_routing([stand_in, offsets], **case.params)[1]
            counts = new.diff()
            assert new.dtype == torch.int32 and new.shape == (p["E"] + 1,), case.name
            assert int(new[0]) == 0 and int(new[-1]) == t_perm and bool((counts >= 0).all()), case.name
            if case.params["empty_stride"] >= 2:
                assert int(counts[-1]) == 0 or (p["E"] - 1) % p["E"] == case.params["receiver"] % p["E"], case.name


# ------------------------------------------------------------------------------ 05: ties and spikes


def test_clustered_spikes_reproduces_kernelbench_hard_on_shape_0(topk) -> None:
    problem, ref = topk
    apply_shape(ref, problem, problem.shapes[0])
    (x,) = ref.clustered_spikes(_inputs(ref), partition=3, offset=17, extra_values=8, baseline_quarters=4,
                                tie_run=1)
    spikes = (x[0] != 1.0).nonzero().flatten()
    assert spikes.tolist() == list(range(3089, 3161))  # B.4.6: 72 spikes at columns 3089–3160
    assert float(x[0, 3089]) == 2.0 and float(x[0, 3160]) == 1.25 and bool((x[0, 3089:3161].diff() < 0).all())


@pytest.mark.parametrize("tie_run", [1, 3])
def test_tied_boundaries_are_present_and_the_reference_stays_valid(topk, tie_run: int) -> None:
    problem, ref = topk
    for shape in problem.shapes + problem.cpu_shapes:
        k = shape.params["k"]
        model = _model(problem, ref, shape)
        (x,) = ref.clustered_spikes(_inputs(ref), partition=3, offset=17, extra_values=8, baseline_quarters=4,
                                    tie_run=tie_run)
        ranked = x.sort(dim=-1, descending=True).values
        tied = ranked[:, k - 1] == ranked[:, k]  # the k-th and (k+1)-th values
        assert bool(tied.all()) if tie_run == 3 else not bool(tied.any()), shape.label
        spread = (x != x.min()).nonzero()  # every row's spikes sit inside one partition
        width = min(1024, shape.params["n"])
        per_row = [spread[spread[:, 0] == r, 1] for r in range(x.shape[0])]
        assert all(int(c.min()) // width == int(c.max()) // width for c in per_row), shape.label
        values, indices = model(x)
        assert compare_topk(x, (values, indices), (values, indices), 1e-4, 1e-4).ok, shape.label


def test_the_comparison_rule_accepts_any_tie_break_and_nothing_else(topk) -> None:
    problem, ref = topk
    model = _model(problem, ref, problem.cpu_shapes[0])  # k = 64
    (x,) = ref.clustered_spikes(_inputs(ref), 3, 17, 8, 4, tie_run=3)
    values, indices = model(x)
    other = indices.clone()
    for r in range(x.shape[0]):  # swap the last pick for a tied column it left out
        spare = [int(c) for c in (x[r] == values[r, -1]).nonzero().flatten() if int(c) not in indices[r].tolist()]
        other[r, -1] = spare[0]
    assert not torch.equal(other, indices)
    ref = (values, indices)

    def why(out: tuple[torch.Tensor, torch.Tensor]) -> str:  # the grader's own rule (correctness.py)
        verdict = compare_topk(x, ref, out, 1e-4, 1e-4)
        return "ok" if verdict.ok else verdict.message

    assert why((values, other)) == "ok"
    repeated = other.clone()
    repeated[:, -1] = repeated[:, -2]
    assert why((values, repeated)) == "row 0 names the same index twice"
    outside = other.clone()
    outside[0, 0] = x.shape[-1]
    assert why((values, outside)) == f"1 indices outside [0, {x.shape[-1]})"
    assert why((values.flip(-1), other)).startswith("values: ")
    elsewhere = other.clone()
    elsewhere[:, 0] = torch.argmin(x, dim=-1)  # values kept, but the first index points at the row's minimum
    assert why((values, elsewhere)).startswith("the inputs at the returned indices: ")
    # Tuple shape and dtypes are checked before this rule: see test_topk_verdicts_name_what_is_wrong.


# ------------------------------------------------------------------------------ 06 graded end to end

_MOE_SOLUTION = """
import torch
import torch.nn.functional as F

import reference


def _project(x, w):
    # x (rows, H) @ w (H, I) without a library GEMM: fp32 products summed over H, rounded to bf16
    return (x.float()[:, :, None] * w.float()[None]).sum(1).to(torch.bfloat16)


class Model(reference.Model):
    def forward(self, hidden_states, expert_offsets):
        bounds = expert_offsets.tolist()
        parts = []
        for e in range(self.E):
            x = hidden_states[bounds[e]:bounds[e + 1]]
            gate, up = _project(x, self.W_gate[e]), _project(x, self.W_up[e])
            parts.append({swiglu})
        return torch.cat(parts)
"""

MOE_SUBMISSIONS = {
    "no_library_gemm": (_MOE_SOLUTION.replace("{swiglu}", "F.silu(gate) * up"), "pass"),
    "silu_on_up": (_MOE_SOLUTION.replace("{swiglu}", "gate * F.silu(up)"), "wrong"),
    # The reference runs torch.bmm: a library GEMM, refused at run time although its text is clean.
    "reference_reexport": ("from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n", "forbidden"),
}


@pytest.fixture(scope="module")
def moe_graded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> dict[str, dict]:
    subs = {run_id: (MOE, source) for run_id, (source, _) in MOE_SUBMISSIONS.items()}
    return grade(tmp_path_factory.mktemp("moe"), (MOE,), subs, measured_baselines)


@pytest.mark.parametrize("run_id", sorted(MOE_SUBMISSIONS))
def test_moe_submissions_get_their_status_on_the_cpu(moe_graded, run_id: str) -> None:
    row = moe_graded[run_id]
    assert row["status"] == MOE_SUBMISSIONS[run_id][1], row["message"]


def test_moe_verdicts_explain_themselves(moe_graded) -> None:
    assert "forbidden aten ops ran: aten::bmm" in moe_graded["reference_reexport"]["message"]
    assert "out of tolerance" in moe_graded["silu_on_up"]["message"]
    passed = moe_graded["no_library_gemm"]
    assert passed["speedup_vs_compile"] > 0 and "structural" in passed["message"]


# ------------------------------------------------------------------------------ 05 graded end to end

_TOPK_SOLUTION = """
import torch

import reference


class Model(reference.Model):
    def forward(self, x):
        work, values, indices = x.clone(), [], []
        for _ in range(self.k):  # k rounds of argmax, no sort or top-k op
            i = {pick}
            values.append(x.gather(-1, i))
            indices.append(i)
            work.scatter_(-1, i, float("-inf"))
        values, indices = torch.cat(values, -1), torch.cat(indices, -1)
        return {ret}
"""
_FIRST = "work.argmax(dim=-1, keepdim=True)"  # ties go to the lowest index
_LAST = "work.shape[-1] - 1 - work.flip(-1).argmax(dim=-1, keepdim=True)"  # ties go to the highest

TOPK_SUBMISSIONS = {
    "first_index_ties": (_TOPK_SOLUTION.format(pick=_FIRST, ret="values, indices"), "pass"),
    "last_index_ties": (_TOPK_SOLUTION.format(pick=_LAST, ret="values, indices"), "pass"),
    "repeated_index": (_TOPK_SOLUTION.format(pick=_FIRST, ret="values, indices[:, :1].expand_as(indices)"
                                             ".contiguous() if self.k > 1 else (values, indices)"), "wrong"),
    "ascending": (_TOPK_SOLUTION.format(pick=_FIRST, ret="values.flip(-1), indices.flip(-1)"), "wrong"),
    "values_only": (_TOPK_SOLUTION.format(pick=_FIRST, ret="values"), "wrong"),
    "int32_indices": (_TOPK_SOLUTION.format(pick=_FIRST, ret="values, indices.int()"), "wrong"),
}


@pytest.fixture(scope="module")
def topk_graded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> dict[str, dict]:
    subs = {run_id: ("05_topk_bitonic", source) for run_id, (source, _) in TOPK_SUBMISSIONS.items()}
    return grade(tmp_path_factory.mktemp("topk"), ("05_topk_bitonic",), subs, measured_baselines)


@pytest.mark.parametrize("run_id", sorted(TOPK_SUBMISSIONS))
def test_topk_submissions_get_their_status_on_the_cpu(topk_graded, run_id: str) -> None:
    row = topk_graded[run_id]
    assert row["status"] == TOPK_SUBMISSIONS[run_id][1], row["message"]


def test_topk_verdicts_name_what_is_wrong(topk_graded) -> None:
    messages = {run_id: row["message"] for run_id, row in topk_graded.items()}
    assert "names the same index twice" in messages["repeated_index"]
    assert "values:" in messages["ascending"] and "out of tolerance" in messages["ascending"]
    assert "output must be a tuple of 2 tensors" in messages["values_only"]
    assert "output 1: output dtype int32 != expected int64" in messages["int32_indices"]
    # 2 CPU shapes × 4 seeds × 3 numeric cases + 4 structural cases each
    assert messages["last_index_ties"].startswith("correct on all 32 checks (2 shapes"), messages["last_index_ties"]


def test_moe_reference_weights_and_inputs_are_drawn_on_the_grading_device(moe) -> None:
    """06 opts in to `draw_on_device`: the judge builds the reference Model and draws the inputs on
    the device (`normal_` and `randn` run there), not on the CPU and moved; no other problem opts in."""
    problem, ref = moe
    assert problem.draw_on_device
    others = [n for n in (p.name for p in DECK.iterdir() if (p / "problem.yaml").is_file()) if n != MOE]
    assert others and not any(load_problem(DECK / n).draw_on_device for n in others)
    apply_shape(ref, problem, problem.shapes[0])  # the full-size shape: 2 × 1.6 G weights, never allocated
    model = build_model(ref, list(ref.get_init_inputs()), "meta", init_on_device=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert sum(p.numel() for p in model.parameters()) == 2 * 128 * 4096 * 1536
    where = types.SimpleNamespace(get_inputs=lambda: [torch.randn(2, 3), 7])  # a factory call's default device
    drawn, kept = draw_inputs(where, 42, "meta", on_device=True)
    assert torch.randn(1).device.type == "cpu" and kept == 7
    where.get_inputs = lambda: [torch.empty(0).device.type]  # reports where get_inputs' factories allocate
    assert draw_inputs(where, 42, "meta", on_device=True) == ["meta"] and draw_inputs(where, 42, "meta") == ["cpu"]
    assert drawn.device.type == "meta" and drawn.shape == (2, 3)

"""The Hard deck's two GEMMs, 01_fp8_gemm and 07_w4a16_gemm: deck entries, formulas against the
spec's sanity tables and an independent count, the reference interface KernelBench-Hard solutions
rely on, and grading on the CPU. The spec is /work/shared/reference/hard-deck-interface.md (§B.1, §B.6)."""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path

import pytest
import torch
from grading import MeasuredBaselines, grade
from torch.utils.flop_counter import FlopCounterMode

from kernelboard.eval.deck import Problem, Shape, load_problem
from kernelboard.eval.formats import NATIVE, detect_format

DECK = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard"
FP8, W4 = "01_fp8_gemm", "07_w4a16_gemm"

# §B.1.6 and §B.6.6, verbatim: (label, M, N, K).
SHAPES = {
    FP8: [("square aligned", 4096, 4096, 4096), ("K not a multiple of 128", 4096, 4096, 4127),
          ("skinny M (decode)", 32, 8192, 8192), ("Llama-3 up-proj", 4096, 14336, 4096)],
    W4: [("decode", 1, 12288, 4096), ("small prefill", 32, 12288, 4096), ("larger prefill", 256, 12288, 4096),
         ("decode, square", 1, 4096, 4096), ("speculative decode", 16, 14336, 4096)],
}
# The spec's sanity tables (flops, bytes). 01's bytes omit the 4·N-byte weight_scale read.
SANITY = {
    FP8: [(137_438_953_472, 67_108_864), (138_479_140_864, 67_362_816), (4_294_967_296, 67_895_296),
          (481_036_337_152, 192_937_984)],
    W4: [(100_663_296, 26_771_456), (3_221_225_472, 27_787_264), (25_769_803_776, 35_127_296),
         (33_554_432, 8_929_280), (1_879_048_192, 31_784_960)],
}
# §B.6.3 [verified]: the seed 07's constructor reseeds the global RNG with, per shape.
W4_SEEDS = {(1, 12288, 4096): 32619022108281, (32, 12288, 4096): 32659800249406,
            (256, 12288, 4096): 32954455107550, (1, 4096, 4096): 10873884255865,
            (16, 14336, 4096): 38075037905582}
TOLERANCE = {FP8: {"bfloat16": (0.2, 0.2)}, W4: {"bfloat16": (0.1, 0.1)}}
STRESS = {  # name -> (scaled input positions, effective bf16 atol, rtol)
    FP8: {"small_input": ({0: 1e-3}, 5e-4, 5e-2), "large_input": ({0: 64.0}, 12.0, 5e-2),
          "small_weight": ({}, 3e-3, 5e-2)},
    W4: {"small_activation": ({0: 1e-3}, 1e-4, 5e-2), "large_activation": ({0: 64.0}, 1.0, 5e-2),
         "small_scales": ({}, 1e-3, 5e-2)},  # ours, not KernelBench-Hard's: a cached dequantised weight
}
STATE_SCALED = {FP8: {"small_weight": {"weight": 1e-2}}, W4: {"small_scales": {"scales": 1e-2}}}
FORBIDDEN = {
    FP8: ("torch._scaled_mm", "torch.ops.aten._scaled_mm"),
    W4: ("bitsandbytes.functional.dequantize_4bit", "bitsandbytes.functional.gemv_4bit", "marlin_kernel.gemm",
         "torch.nn.functional.linear"),
}


def _problem(name: str) -> Problem:
    return load_problem(DECK / name)


def _reference(name: str) -> types.ModuleType:
    """A private copy of the problem's reference module (not registered as `reference`)."""
    spec = importlib.util.spec_from_file_location(f"_ref_{name}", DECK / name / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(ref: types.ModuleType, m: int, n: int, k: int) -> torch.nn.Module:
    ref.M, ref.N, ref.K = m, n, k  # as the harness applies a shape: on the module's globals
    return ref.Model(*ref.get_init_inputs())


def _spec_state(name: str, m: int, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """§B.1.3 and §B.6.3: state-dict key -> (shape, dtype)."""
    if name == FP8:
        return {"weight": ((n, k), torch.float8_e4m3fn), "weight_scale": ((n,), torch.float32)}
    return {"w_q": ((k // 2, n), torch.uint8), "scales": ((k // 128, n), torch.bfloat16),
            "zeros": ((k // 128, n), torch.bfloat16)}


def _spec_input(name: str, m: int, k: int) -> tuple[tuple[int, ...], torch.dtype]:
    return (m, k), (torch.float8_e4m3fn if name == FP8 else torch.bfloat16)


def _mnk(shape: Shape) -> tuple[int, int, int]:
    return shape.params["M"], shape.params["N"], shape.params["K"]


CPU_CASES = [(name, i) for name in (FP8, W4) for i in range(2)]


# ------------------------------------------------------------------------------ the deck entries


@pytest.mark.parametrize("name", [FP8, W4])
def test_problem_loads_in_kernelboard_format_with_the_spec_grading(name: str) -> None:
    problem = _problem(name)
    assert detect_format(DECK / name) == NATIVE
    assert (problem.name, problem.bench, problem.seeds) == (name, "hard", (42, 123, 456))
    expected = {FP8: ("compute", "fp8_e4m3", "fp8"), W4: ("memory", "int4_bf16", "bf16")}[name]
    assert (problem.regime, problem.precision, problem.peak_tflops_key) == expected
    assert [(s.label, *_mnk(s)) for s in problem.shapes] == SHAPES[name]
    assert problem.shape_globals == {"M": "M", "N": "N", "K": "K"}
    assert problem.tolerance == TOLERANCE[name]
    assert {c.name: (c.scale, *c.tolerance["bfloat16"]) for c in problem.numeric_stress} == STRESS[name]
    state_scaled = {c.name: c.state_scale for c in problem.numeric_stress if c.state_scale}
    assert state_scaled == STATE_SCALED[name]
    assert problem.forbidden == FORBIDDEN[name]
    assert problem.require_own_kernel  # a timed call that ran only cuBLAS or PyTorch fails
    assert len(problem.cpu_shapes) == 2


def test_run_time_rules_catch_the_library_ops_but_leave_plain_matmul() -> None:
    def caught(problem: str, op: str) -> bool:  # as the audit matches: a needle inside the op name
        return any(needle in op for needle in _problem(problem).forbidden_ops)

    assert caught(FP8, "aten::_scaled_mm") and caught(FP8, "aten::_scaled_mm_v2")
    assert caught(W4, "aten::_weight_int4pack_mm") and caught(W4, "bitsandbytes::gemv_4bit")
    for op in ("aten::mm", "aten::matmul", "aten::bmm", "aten::addmm", "aten::_to_copy", "aten::mul"):
        assert not caught(FP8, op) and not caught(W4, op), op


# ------------------------------------------------------------------------------ formulas


def test_w4a16_formulas_match_the_published_values() -> None:
    problem = _problem(W4)
    assert [(problem.flops(s), problem.bytes_moved(s)) for s in problem.shapes] == SANITY[W4]


def test_fp8_flops_match_the_published_values_and_bytes_add_the_scale_read() -> None:
    problem = _problem(FP8)
    assert [problem.flops(s) for s in problem.shapes] == [f for f, _ in SANITY[FP8]]
    # The spec's bytes formula leaves out weight_scale: N fp32 values, 4·N bytes.
    assert [problem.bytes_moved(s) for s in problem.shapes] == [
        b + 4 * s.params["N"] for (_, b), s in zip(SANITY[FP8], problem.shapes, strict=True)]


@pytest.mark.parametrize("name", [FP8, W4])
def test_bytes_are_the_spec_tensors_read_once_and_the_output_written(name: str) -> None:
    """On every GPU and CPU shape: input, every state tensor and the bf16 output, sized from the
    spec's table of shapes and dtypes (meta tensors, nothing allocated)."""
    problem = _problem(name)
    for shape in problem.shapes + problem.cpu_shapes:
        m, n, k = _mnk(shape)
        tensors = [torch.empty(*s, dtype=d, device="meta") for s, d in _spec_state(name, m, n, k).values()]
        tensors += [torch.empty(*_spec_input(name, m, k)[0], dtype=_spec_input(name, m, k)[1], device="meta"),
                    torch.empty(m, n, dtype=torch.bfloat16, device="meta")]
        assert problem.bytes_moved(shape) == sum(t.numel() * t.element_size() for t in tensors), shape.label


@pytest.mark.parametrize(("name", "idx"), CPU_CASES)
def test_formulas_match_an_independent_count_of_the_reference(name: str, idx: int) -> None:
    """FLOPs counted by torch's FlopCounterMode on the reference forward; bytes as the sizes of
    the real input, state and output tensors."""
    problem, ref = _problem(name), _reference(name)
    shape = problem.cpu_shapes[idx]
    model = _build(ref, *_mnk(shape))
    inputs = ref.get_inputs()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        out = model(*inputs)
    assert problem.flops(shape) == counter.get_total_flops()
    tensors = [*inputs, *model.state_dict().values(), out]
    assert problem.bytes_moved(shape) == sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------------ the reference interface


@pytest.mark.parametrize(("name", "mnk"), [*((n, None) for n in (FP8, W4)), (FP8, (4096, 4096, 4096)),
                                           (W4, (1, 4096, 4096))])
def test_state_dict_inputs_and_output_are_the_spec(name: str, mnk: tuple[int, int, int] | None) -> None:
    """Keys, shapes and dtypes a KernelBench-Hard solution loads with strict=True, on both CPU
    shapes and one real shape; buffers only, no parameters."""
    ref = _reference(name)
    cases = [mnk] if mnk else [_mnk(s) for s in _problem(name).cpu_shapes]
    for m, n, k in cases:
        model = _build(ref, m, n, k)
        state = {key: (tuple(t.shape), t.dtype) for key, t in model.state_dict().items()}
        assert state == _spec_state(name, m, n, k)
        assert not list(model.parameters())
        (x,) = ref.get_inputs()
        assert (tuple(x.shape), x.dtype, x.device.type) == (*_spec_input(name, m, k), "cpu")
        if mnk is None:  # the forward of a real shape is the grader's job, not a unit test's
            out = model(x)
            assert (tuple(out.shape), out.dtype) == ((m, n), torch.bfloat16)


def test_module_names_and_signatures_are_kept() -> None:
    fp8, w4 = _reference(FP8), _reference(W4)
    assert (fp8.M, fp8.N, fp8.K, fp8.E4M3_MAX, fp8.OP_TYPE) == (4096, 4096, 4096, 448.0, "gemm")
    assert fp8.SUPPORTED_PRECISIONS == ["fp8_e4m3"]
    assert (w4.M, w4.N, w4.K, w4.GROUP_SIZE, w4.OP_TYPE) == (1, 12288, 4096, 128, "gemm_w4a16")
    assert w4.SUPPORTED_PRECISIONS == ["int4_bf16"]
    for ref in (fp8, w4):
        assert ref.HARDWARE_REQUIRED == ["RTX_PRO_6000", "H100", "B200"]
        ref.M, ref.N, ref.K = 3, 5, 256
        assert ref.get_init_inputs() == [3, 5, 256]  # read at call time
    assert list(inspect.signature(fp8.Model).parameters) == ["M", "N", "K"]
    params = inspect.signature(w4.Model).parameters
    assert list(params) == ["M", "N", "K", "group_size"] and params["group_size"].default == 128
    assert callable(w4._pack_int4) and callable(w4._unpack_int4)


def test_fp8_weight_rows_peak_at_e4m3_max_and_scales_undo_them() -> None:
    ref = _reference(FP8)
    torch.manual_seed(0)
    model = _build(ref, 16, 64, 128)
    w = model.weight.float()
    assert torch.equal(w.abs().amax(dim=1), torch.full((64,), 448.0))
    dequant = w * model.weight_scale[:, None]
    assert float(dequant.abs().max()) < 0.2 and 0.01 < float(dequant.std()) < 0.03  # N(0, 0.02²) drawn


def test_fp8_reference_rounds_twice() -> None:
    """§B.1.5: the bf16 GEMM result is rounded before the scale. A single-rounding fp32 path
    differs by up to ~0.06 on the spec's sample shape (M=256, N=512, K=4127): inside 0.2."""
    ref = _reference(FP8)
    torch.manual_seed(1)
    model = _build(ref, 256, 512, 4127)
    (x,) = ref.get_inputs()
    out = model(x).float()
    single = ((x.float() @ model.weight.float().t()) * model.weight_scale).to(torch.bfloat16).float()
    diff = float((out - single).abs().max())
    assert 0 < diff <= 0.125
    assert torch.allclose(out, single, atol=0.2, rtol=0.2)


def test_w4a16_reseeds_with_the_spec_seed_on_every_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructor's reseed, observed on the spec's five shapes without drawing their weights."""
    ref = _reference(W4)
    seen: list[int] = []

    class Stop(Exception):
        pass

    def record(seed: int) -> None:
        seen.append(seed)
        raise Stop

    monkeypatch.setattr(torch, "manual_seed", record)
    for m, n, k in W4_SEEDS:
        with pytest.raises(Stop):
            _build(ref, m, n, k)
    assert seen == list(W4_SEEDS.values())
    assert all(0xC0DE ^ (m * 1315423911 + n * 2654435761 + k) == s for (m, n, k), s in W4_SEEDS.items())


def test_w4a16_weights_do_not_depend_on_the_rng_state_and_leave_it_reseeded() -> None:
    ref = _reference(W4)
    m, n, k = 16, 96, 384
    torch.manual_seed(1)
    a = _build(ref, m, n, k).state_dict()
    after = torch.randn(4)
    torch.manual_seed(2)
    b = _build(ref, m, n, k).state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)
    torch.manual_seed(0xC0DE ^ (m * 1315423911 + n * 2654435761 + k))
    torch.randn(k, n)
    assert torch.equal(after, torch.randn(4))  # the side effect a solution's constructor sees


@pytest.mark.parametrize("mnk", [(1, 64, 256), (16, 96, 384)])
def test_w4a16_quantisation_is_the_spec_recipe(mnk: tuple[int, int, int]) -> None:
    """Recomputed from the spec's steps with a different formulation (per-row group index, integer
    nibble arithmetic); w_q, scales and zeros must agree exactly."""
    m, n, k = mnk
    model = _build(_reference(W4), m, n, k)
    torch.manual_seed(0xC0DE ^ (m * 1315423911 + n * 2654435761 + k))
    w = torch.randn(k, n) * 0.02
    group = torch.arange(k) // 128
    lo = torch.stack([w[group == g].min(dim=0).values for g in range(k // 128)])
    hi = torch.stack([w[group == g].max(dim=0).values for g in range(k // 128)])
    scale = torch.maximum(hi - lo, torch.tensor(1e-8)) / 15
    zero = torch.clamp(torch.round(-lo / scale), 0, 15)
    codes = torch.clamp(torch.round(w / scale[group] + zero[group]), 0, 15).to(torch.int64)
    packed = (codes[0::2] + 16 * codes[1::2]).to(torch.uint8)  # even row low nibble, odd row high
    assert torch.equal(model.w_q, packed)
    assert torch.equal(model.scales, scale.to(torch.bfloat16))
    assert torch.equal(model.zeros, zero.to(torch.bfloat16))


def test_w4a16_forward_dequantises_in_bf16() -> None:
    ref = _reference(W4)
    model = _build(ref, 16, 96, 384)
    torch.manual_seed(42)
    (x,) = ref.get_inputs()
    q = model.w_q.to(torch.int64)
    codes = torch.empty(384, 96, dtype=torch.int64)
    codes[0::2], codes[1::2] = q % 16, q // 16
    assert torch.equal(ref._unpack_int4(model.w_q, 384).to(torch.int64), codes)
    assert torch.equal(ref._pack_int4(ref._unpack_int4(model.w_q)), model.w_q)
    zeros, scales = model.zeros.repeat_interleave(128, 0), model.scales.repeat_interleave(128, 0)
    w = (codes.to(torch.bfloat16) - zeros) * scales
    assert torch.equal(model(x), x @ w)


def test_w4a16_zero_points_fall_in_the_observed_range_on_a_real_shape() -> None:
    """§B.6.3 [verified]: the zeros observed on the spec's shapes fall in 3–11."""
    model = _build(_reference(W4), 1, 4096, 4096)
    zeros = model.zeros.float()
    assert torch.equal(zeros, zeros.round()) and 3 <= float(zeros.min()) <= float(zeros.max()) <= 11


# ------------------------------------------------------------------------------ grading on the CPU

REFERENCE = "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n"

SUBMISSIONS = {  # run_id -> (problem, solution.py, expected status)
    "fp8_reference": (FP8, REFERENCE, "pass"),
    # Forgets the per-row weight_scale: off by a factor of ~1/448 on every row.
    "fp8_ignores_weight_scale": (FP8, """\
        import torch
        import reference


        class Model(reference.Model):
            def forward(self, x):
                return x.to(torch.bfloat16) @ self.weight.to(torch.bfloat16).t()
        """, "wrong"),
    # The library GEMM reached through an alias the text search cannot see.
    "fp8_scaled_mm_alias": (FP8, """\
        import torch
        import reference


        class Model(reference.Model):
            def forward(self, x):
                mm = getattr(torch, "_scal" + "ed_mm")
                one = torch.ones((), device=x.device)
                y = mm(x, self.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                return (y * self.weight_scale).to(torch.bfloat16)
        """, "forbidden"),
    # Dequantises `weight` once and keeps the copy: right on every call until the weights change.
    "fp8_caches_dequantised_weight": (FP8, """\
        import torch
        import reference


        class Model(reference.Model):
            def forward(self, x):
                if not hasattr(self, "cached"):
                    self.cached = (self.weight.float() * self.weight_scale[:, None]).t().contiguous()
                return (x.float() @ self.cached).to(torch.bfloat16)
        """, "wrong"),
    "w4a16_reference": (W4, REFERENCE, "pass"),
    # Dequantises once to bf16 and keeps the copy (what a published kernel did, running cuBLAS on it).
    "w4a16_caches_dequantised_weight": (W4, """\
        import torch
        import reference


        class Model(reference.Model):
            def forward(self, x):
                if not hasattr(self, "cached"):
                    k, n, g = self.K, self.N, self.group_size
                    codes = reference._unpack_int4(self.w_q).to(torch.bfloat16).view(k // g, g, n)
                    self.cached = ((codes - self.zeros[:, None, :]) * self.scales[:, None, :]).view(k, n)
                return x.to(torch.bfloat16) @ self.cached
        """, "wrong"),
    # Forgets the zero points: every weight is code·scale instead of (code − zero)·scale.
    "w4a16_ignores_zeros": (W4, """\
        import torch
        import reference


        class Model(reference.Model):
            def forward(self, x):
                k, n, g = self.K, self.N, self.group_size
                codes = reference._unpack_int4(self.w_q).to(torch.bfloat16).view(k // g, g, n)
                return x @ (codes * self.scales[:, None, :]).view(k, n)
        """, "wrong"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> dict[str, dict]:
    """One grading batch on a deck holding only these two problems (their baselines measured once a session)."""
    subs = {run_id: (problem, source) for run_id, (problem, source, _) in SUBMISSIONS.items()}
    return grade(tmp_path_factory.mktemp("gemms"), (FP8, W4), subs, measured_baselines)


@pytest.mark.parametrize("run_id", sorted(SUBMISSIONS))
def test_cpu_grading_gives_each_solution_its_status(graded: dict[str, dict], run_id: str) -> None:
    assert graded[run_id]["status"] == SUBMISSIONS[run_id][2], graded[run_id]["message"]


def test_cpu_grading_explains_the_failures(graded: dict[str, dict]) -> None:
    assert "out of tolerance" in graded["fp8_ignores_weight_scale"]["message"]
    assert "out of tolerance" in graded["w4a16_ignores_zeros"]["message"]
    assert "aten::_scaled_mm" in graded["fp8_scaled_mm_alias"]["message"]
    assert "case small_weight" in graded["fp8_caches_dequantised_weight"]["message"]
    assert "case small_scales" in graded["w4a16_caches_dequantised_weight"]["message"]
    for run_id in ("fp8_reference", "w4a16_reference"):
        assert graded[run_id]["speedup_vs_compile"] > 0 and graded[run_id]["speedup_vs_eager"] > 0

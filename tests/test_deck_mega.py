"""Deck mega/02_kimi_linear_decode on the CPU shapes: the yaml loads, the reference steps and advances
its state with the shapes and dtypes the yaml declares, deterministically, the KDA step matches the
delta rule's matrix form, the FLOP formula matches a count of the baseline's products, and the tuned
baseline agrees with the reference (cosine and element-wise rules) over consecutive steps."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.flop_counter import FlopCounterMode

from kernelboard.eval.deck import Problem, Shape, evaluate_formula, load_deck, load_problem
from kernelboard.eval.plan import apply_shape, draw_inputs

FOLDER = Path(__file__).resolve().parents[1] / "eval" / "decks" / "mega" / "02_kimi_linear_decode"
State = list[dict[str, torch.Tensor]]


def _load(name: str, path: Path) -> types.ModuleType:
    """A deck module under a private name, so no other test's `reference` module is replaced."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def problem() -> Problem:
    return load_problem(FOLDER)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load((FOLDER / "problem.yaml").read_text())


@pytest.fixture(scope="module")
def ref() -> types.ModuleType:
    return _load("mega02_reference", FOLDER / "reference.py")


@pytest.fixture(scope="module")
def base() -> types.ModuleType:
    return _load("mega02_baseline", FOLDER / "baseline.py")


def _config(ref: types.ModuleType, shape: Shape) -> Any:
    return ref.build_config(shape.params)


@pytest.fixture(scope="module")
def models(ref: types.ModuleType, base: types.ModuleType, problem: Problem) -> dict[tuple[int, str], Any]:
    """Reference and baseline per CPU shape (the baseline loaded from the reference's state dict)."""
    out: dict[tuple[int, str], Any] = {}
    for shape in problem.cpu_shapes:
        cfg = _config(ref, shape)
        model = ref.Model(cfg).eval()
        fast = base.Model(cfg).eval()
        fast.load_state_dict(model.state_dict(), strict=True)
        out[shape.idx, "ref"], out[shape.idx, "base"] = model, fast
    return out


def test_deck_loads(problem: Problem) -> None:
    assert (problem.bench, problem.name, problem.regime) == ("mega", "02_kimi_linear_decode", "memory")
    assert [s.params["context_len"] for s in problem.shapes] == [2048, 8192, 16384]
    assert [s.params["steps"] for s in problem.shapes] == [32, 16, 16]  # KernelBench-Mega's shapes.py
    assert problem.seeds == (0, 1, 2)
    assert set(load_deck(FOLDER.parent)) == {"02_kimi_linear_decode"}


def test_the_headline_is_the_decks_own_baseline(problem: Problem, tmp_path: Path) -> None:
    """Mega's headline divides by baseline.py (measured as the line library:tuned), not by
    torch.compile: each shape row gets its speedup over that line and the result their geomean."""
    import datetime as dt

    from kernelboard.eval.deck import DeckError
    from kernelboard.eval.scoring import result_row, shape_rows

    assert problem.headline_baseline == "library:tuned"
    ok = {"status": "ok"}
    baselines = {s.idx: {"eager": {**ok, "median_ms": 8.0}, "compile:default": {**ok, "median_ms": 6.0},
                         "library:tuned": {**ok, "median_ms": 3.0 * (s.idx + 1)}} for s in problem.cpu_shapes}
    timed = [{"idx": s.idx, "median_ms": 1.5, "p10_ms": 1.4, "p90_ms": 1.6, "min_ms": 1.3, "iterations": 10}
             for s in problem.cpu_shapes]
    shapes = shape_rows(problem, None, "r", "cpu", timed, baselines)
    assert [(s["baseline_ms"], s["speedup_vs_baseline"]) for s in shapes] == [(3.0, 2.0), (6.0, 4.0)]
    row = result_row(run_id="r", gpu="cpu", status="pass", message="ok", shapes=shapes, env={}, timer="cpu_wall",
                     seeds=None, grader_version="0", grade_seconds=None, log_path=None, driver_version=None,
                     graded_at=dt.datetime.now(dt.UTC))
    assert row["speedup_vs_baseline"] == pytest.approx(8 ** 0.5) and row["speedup_vs_compile"] == pytest.approx(4.0)
    spec = yaml.safe_load((FOLDER / "problem.yaml").read_text())
    (tmp_path / FOLDER.name).mkdir()
    for name in ("reference.py", "baseline.py"):
        (tmp_path / FOLDER.name / name).write_text((FOLDER / name).read_text())
    bad = {**spec, "headline_baseline": "compile:default"}
    (tmp_path / FOLDER.name / "problem.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(DeckError, match="key 'headline_baseline': expected one of eager, library:tuned, got"):
        load_problem(tmp_path / FOLDER.name)


def test_formulas_at_the_real_shapes(problem: Problem) -> None:
    """The per-step bytes and FLOPs quoted in problem.yaml's comment."""
    assert [problem.bytes_moved(s) for s in problem.shapes] == [243_382_912, 250_460_800, 259_897_984]
    assert [problem.flops(s) for s in problem.shapes] == [1_006_555_136, 1_434_374_144, 2_004_799_488]


def test_bytes_formula_counts_the_active_weights(ref: types.ModuleType, problem: Problem) -> None:
    """The int4 bytes of the formula are the buffers a step reads: everything but the unchosen experts."""
    shape = problem.cpu_shapes[0]
    cfg = _config(ref, shape)
    model = ref.Model(cfg, init_weights=False)
    per_expert = {n: b.nbytes // b.shape[0] for n, b in model.named_buffers() if ".moe." in n}
    total = sum(b.nbytes for n, b in model.named_buffers() if ".moe." not in n)
    total += sum(b * (cfg.n_active if ".moe.gate" in n or ".moe.up" in n or ".moe.down" in n else 1)
                 for n, b in per_expert.items())
    total += sum(p.nbytes for p in model.parameters())
    s = cfg.kda_heads * cfg.kda_head_dim
    state = 3 * (2 * cfg.kda_heads * cfg.kda_head_dim ** 2 * 4 + 2 * 3 * 3 * s * 2)
    cache = (shape.params["context_len"] + 1) * (cfg.kv_lora + cfg.qk_rope) * 2
    assert problem.bytes_moved(shape) == total + state + cache + 4 * cfg.hidden


def test_flops_formula_counts_the_baselines_products(ref: types.ModuleType, problem: Problem,
                                                     models: dict[tuple[int, str], Any]) -> None:
    """FlopCounterMode counts the baseline's matrix products (the absorbed MLA); the formula adds
    the KDA decay, one multiply per state element, which no product carries."""
    for shape in problem.cpu_shapes:
        cfg = _config(ref, shape)
        hidden, state = ref.init_token(cfg, 0), ref.init_state(cfg, shape.params["context_len"], 0)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            models[shape.idx, "base"].step(hidden, state)
        decay = 3 * cfg.kda_heads * cfg.kda_head_dim ** 2
        assert counter.get_total_flops() + decay == problem.flops(shape)


def _expected(spec: dict[str, Any], params: dict[str, int], grown: int) -> tuple[tuple[int, ...], torch.dtype]:
    shape = tuple(int(evaluate_formula(str(d), params)) for d in spec["shape"])
    if spec.get("grows"):
        shape = (shape[0] + grown * int(spec["grows"]), *shape[1:])
    return shape, getattr(torch, spec["dtype"])


def _check_layout(hidden: torch.Tensor, state: State, raw: dict[str, Any], params: dict[str, int], grown: int) -> None:
    spec = raw["stateful"]
    assert (tuple(hidden.shape), hidden.dtype) == _expected(spec["hidden"], params, grown)
    assert len(state) == 4
    for layer, kind in zip(state, ("kda", "kda", "kda", "mla"), strict=True):
        assert set(layer) == set(spec["state"][kind])
        for name, tensor in layer.items():
            assert (tuple(tensor.shape), tensor.dtype) == _expected(spec["state"][kind][name], params, grown), name


def test_step_runs_advances_and_keeps_the_declared_layout(ref: types.ModuleType, problem: Problem,
                                                         raw: dict[str, Any],
                                                         models: dict[tuple[int, str], Any]) -> None:
    for shape in problem.cpu_shapes:
        cfg = _config(ref, shape)
        hidden, state = ref.init_token(cfg, 1), ref.init_state(cfg, shape.params["context_len"], 1)
        _check_layout(hidden, state, raw, shape.params, grown=0)
        before = ref.clone_state(state)
        with torch.no_grad():
            out, after = models[shape.idx, "ref"].step(hidden, state)
        _check_layout(out, after, raw, shape.params, grown=1)
        assert torch.isfinite(out).all() and not torch.equal(out, hidden)
        for old, new in zip(before, after, strict=True):
            for name in old:
                if name in ("c_kv", "k_rope"):  # the past rows are kept; one new row is appended
                    assert torch.equal(new[name][:-1], old[name])
                else:
                    assert not torch.equal(new[name], old[name]), name


def test_two_models_from_the_seed_step_identically(ref: types.ModuleType, problem: Problem) -> None:
    shape = problem.cpu_shapes[0]
    cfg = _config(ref, shape)
    runs = []
    for _ in range(2):
        model = ref.Model(cfg).eval()
        hidden, state = ref.init_token(cfg, 2), ref.init_state(cfg, shape.params["context_len"], 2)
        with torch.no_grad():
            for _ in range(2):
                hidden, state = model.step(hidden, state)
        runs.append((hidden, state))
    (h1, s1), (h2, s2) = runs
    assert torch.equal(h1, h2)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(s1, s2, strict=True) for k in a)


def test_flip_chooses_one_routers_runner_up_and_nothing_else(ref: types.ModuleType, problem: Problem,
                                                             models: dict[tuple[int, str], Any]) -> None:
    """The grader's other expert choice (problem.py `Stateful`, judge.py `_RunnerUps`): `flip=r` has block r's
    router take its best unchosen expert in place of its last chosen one; the other routers choose as before
    (until the changed hidden vector reaches them) and the margins are the nominal step's."""
    shape = problem.cpu_shapes[0]
    cfg, model = _config(ref, shape), models[shape.idx, "ref"]
    y = torch.randn(cfg.hidden, generator=torch.Generator().manual_seed(3)).to(cfg.dtype)
    moe = model.blocks[0].moe
    with torch.no_grad():
        w, idx = moe.route(y)
        w_up, idx_up = moe.route(y, runner_up=True)
        ranked = torch.topk(torch.softmax(moe.router(y).float(), -1), cfg.n_active + 1).indices
    assert idx[:-1].tolist() == idx_up[:-1].tolist() and int(idx[-1]) == int(ranked[-2])
    assert int(idx_up[-1]) == int(ranked[-1]) != int(idx[-1])
    assert float(w_up.sum()) == pytest.approx(float(w.sum()))  # renormalised over the experts it chose
    hidden, state = ref.init_token(cfg, 4), ref.init_state(cfg, shape.params["context_len"], 4)
    outs, margins = {}, {}
    for flip in (None, *range(len(cfg.pattern))):
        margins[flip] = []
        with torch.no_grad():
            outs[flip] = model.step(hidden, ref.clone_state(state), margins[flip], flip=flip)[0]
    assert torch.equal(outs[None], model.step(hidden, ref.clone_state(state))[0])  # flip=None is the step
    for flip in range(len(cfg.pattern)):
        assert not torch.equal(outs[flip], outs[None]), flip
        assert margins[flip][: flip + 1] == margins[None][: flip + 1]  # routers up to the flipped one saw the same


def test_get_inputs_follow_the_shape_globals_and_the_seed(ref: types.ModuleType, problem: Problem,
                                                          raw: dict[str, Any]) -> None:
    shape = problem.cpu_shapes[1]
    apply_shape(ref, problem, shape)
    (cfg,) = ref.get_init_inputs()
    assert (cfg.hidden, cfg.n_experts, cfg.kv_lora) == (256, 8, 128)
    first, again, other = (draw_inputs(ref, seed, "cpu") for seed in (5, 5, 6))
    _check_layout(first[0], first[1], raw, shape.params, grown=0)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1][0]["S"], again[1][0]["S"])
    assert not torch.equal(first[0], other[0])


def test_int4_roundtrip(ref: types.ModuleType) -> None:
    codes = torch.randint(0, 16, (2, 256, 24), dtype=torch.uint8)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(codes)), codes)
    w = torch.randn(256, 24) * 0.02
    packed, scales, zeros = ref.quantize(w)
    assert packed.shape == (128, 24) and scales.shape == zeros.shape == (2, 24)
    err = (ref.dequantize(packed, scales, zeros, 128).float() - w).abs()
    assert (err <= scales.float().repeat_interleave(128, 0) * 0.5 + 1e-3).all()  # half a step, plus bf16


def test_kda_step_is_the_delta_rule(ref: types.ModuleType, problem: Problem,
                                    models: dict[tuple[int, str], Any]) -> None:
    """S_t = (I − β k kᵀ) diag(e^g) S + β k vᵀ and o = S_tᵀ q / √D, in fp64 from the layer's own q, k, v, g, β."""
    shape = problem.cpu_shapes[0]
    cfg = _config(ref, shape)
    kda = models[shape.idx, "ref"].blocks[0].attn
    state = ref.init_state(cfg, 4, 3)[0]
    x = ref.init_token(cfg, 3)
    st = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        out = kda.step(x, st)
        q, _ = kda.short_conv(kda.q_proj(x), state["cq"], 0)
        k, _ = kda.short_conv(kda.k_proj(x), state["ck"], 1)
        v, _ = kda.short_conv(kda.v_proj(x), state["cv"], 2)
        g = -F.softplus(kda.g_proj(x).double())
        beta = torch.sigmoid(kda.beta_proj(x).double())
    h, d = cfg.kda_heads, cfg.kda_head_dim
    q, k, v, g = (t.double().view(h, d) for t in (q, k, v, g))
    outs = []
    for i in range(h):
        s = torch.diag(g[i].exp()) @ state["S"][i].double()
        eye = torch.eye(d, dtype=torch.float64)
        s = (eye - beta[i] * torch.outer(k[i], k[i])) @ s + beta[i] * torch.outer(k[i], v[i])
        assert torch.allclose(st["S"][i].double(), s, atol=1e-5, rtol=1e-5)
        outs.append(s.t() @ q[i] * d ** -0.5)
    with torch.no_grad():
        expected = kda.o_proj(torch.cat(outs).to(torch.bfloat16))
    assert torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def _agrees(ref_t: torch.Tensor, sol_t: torch.Tensor, raw: dict[str, Any], elementwise: bool) -> str | None:
    """Why `sol_t` fails the deck's rules against `ref_t`, or None."""
    cos = F.cosine_similarity(ref_t.float().flatten(), sol_t.float().flatten(), dim=0).item()
    if cos < raw["stateful"]["cos_sim"]:
        return f"cosine {cos:.4f}"
    tol = raw["tolerance"][str(ref_t.dtype).removeprefix("torch.")]
    bad = (sol_t.float() - ref_t.float()).abs() > tol["atol"] + tol["rtol"] * ref_t.float().abs()
    return f"{int(bad.sum())} elements out of tolerance" if elementwise and bad.any() else None


def test_baseline_matches_the_reference_over_consecutive_steps(ref: types.ModuleType, problem: Problem,
                                                               raw: dict[str, Any],
                                                               models: dict[tuple[int, str], Any]) -> None:
    """Teacher-forced, as problem.yaml's `stateful` block says: both get the reference's hidden and
    state at each of `check_steps` positions; every output and state tensor is compared."""
    steps, margin_min = raw["stateful"]["check_steps"], raw["stateful"]["router_margin_ulps"]
    for shape in problem.cpu_shapes:
        cfg = _config(ref, shape)
        for seed in problem.seeds:
            hidden, state = ref.init_token(cfg, seed), ref.init_state(cfg, shape.params["context_len"], seed)
            for step in range(steps):
                fed = ref.clone_state(state)
                margins: list[float] = []
                with torch.no_grad():
                    out_ref, state = models[shape.idx, "ref"].step(hidden, state, margins)
                    out_sol, fed = models[shape.idx, "base"].step(hidden, fed)
                elementwise = min(margins) >= margin_min
                layers = enumerate(zip(state, fed, strict=True))
                pairs = [("out", out_ref, out_sol)]
                pairs += [(f"state[{i}].{k}", a[k], b[k]) for i, (a, b) in layers for k in a]
                for name, a, b in pairs:
                    assert a.shape == b.shape and a.dtype == b.dtype, name
                    why = _agrees(a, b, raw, elementwise)
                    assert why is None, f"{shape.label} seed {seed} step {step} {name}: {why}"
                hidden = out_ref


def test_a_wrong_cache_row_passes_the_cosine_but_not_the_bound(ref: types.ModuleType, problem: Problem,
                                                               raw: dict[str, Any],
                                                               models: dict[tuple[int, str], Any]) -> None:
    """Why the element-wise bound: a cosine over the whole latent cache hardly sees the one row a step
    writes (the past rows are copied): at context 8192 a kernel that appends zeros passes KernelBench-Mega's rule."""
    shape = problem.cpu_shapes[1]
    cfg = _config(ref, shape)
    with torch.no_grad():
        _, state = models[shape.idx, "ref"].step(ref.init_token(cfg, 0), ref.init_state(cfg, 8192, 0))
    cache = state[3]["c_kv"]
    wrong = cache.clone()
    wrong[-1] = 0
    cos = F.cosine_similarity(cache.float().flatten(), wrong.float().flatten(), dim=0).item()
    assert cos >= raw["stateful"]["cos_sim"]
    assert _agrees(cache, wrong, raw, elementwise=True) is not None


def test_drawn_state_moves_to_the_device_with_the_hidden_vector(ref: types.ModuleType, problem: Problem) -> None:
    """The state is a list of per-layer dicts: every tensor in it moves, not only the top-level hidden
    vector (on the H200 a CPU state met a CUDA projection in the reference's first conv)."""
    apply_shape(ref, problem, problem.cpu_shapes[0])
    for on_device in (False, True):  # draw_on_device: drawn on the CPU under the device's context, then moved
        hidden, state = draw_inputs(ref, 5, "meta", on_device)
        assert hidden.device.type == "meta"
        assert {t.device.type for layer in state for t in layer.values()} == {"meta"}



def test_fresh_sets_use_the_devices_generator_checked_seeds_the_cpus(ref: types.ModuleType,
                                                                     problem: Problem) -> None:
    """Checked seeds mean the same values on every device; timing and floor-batch states are drawn on
    the device itself (`get_fresh_inputs`), where the CPU's generator cost seconds a grading. On the
    CPU both are one draw."""
    from kernelboard.eval.plan import draw_fresh

    apply_shape(ref, problem, problem.cpu_shapes[0])
    checked, fresh = draw_inputs(ref, 5, "cpu", True), draw_fresh(ref, 5, "cpu", True)
    assert torch.equal(checked[0], fresh[0]) and all(
        torch.equal(a, b) for la, lb in zip(checked[1], fresh[1], strict=True) for a, b in zip(
            la.values(), lb.values(), strict=True))
    if not torch.cuda.is_available():
        return
    on_gpu, again = draw_fresh(ref, 5, "cuda", True), draw_inputs(ref, 5, "cuda", True)
    assert on_gpu[0].device.type == "cuda" and not torch.equal(on_gpu[0].cpu(), checked[0])
    assert torch.equal(again[0].cpu(), checked[0])  # a checked seed: the CPU's values, moved
    assert torch.equal(draw_fresh(ref, 5, "cuda", True)[1][0]["S"], on_gpu[1][0]["S"])  # seeded all the same


def _plan_with_margins(problem: Problem) -> tuple[Any, Any, list[float]]:
    """make_plan on the first CPU shape, and the reference's least router margin (ulps) on every
    timing and floor-batch set it drew, recomputed here on a model of its own."""
    from kernelboard.eval import plan as plan_module
    from kernelboard.eval.stateful import StepAdapter, clone_flat

    reference = plan_module.import_file("reference", problem.reference_path)
    (plan,) = plan_module.make_plan(problem, reference, (problem.cpu_shapes[0],), [0], (2026, 2027), "cpu",
                                    proof_seed=97)
    assert plan.layout is not None
    model = plan_module.build_model(reference, plan.init_args, "cpu")
    model.load_state_dict(plan.state_dict)
    step = StepAdapter(model, plan.layout, "step", margins=True)
    margins = []
    for flat in [*plan.timing_sets, *(s for batch in plan.proof_sets for s in batch)]:
        with torch.no_grad():
            step(*clone_flat(flat))
        margins.append(min(step.last_margins))
    return reference, plan, margins


def test_timed_sets_are_clear_of_router_ties(problem: Problem) -> None:
    """A timed output is judged element-wise, so no timing or floor-batch set may sit where a rounding
    picks another expert (on the H200, torch.compile's faithful step did on a drawn set)."""
    from kernelboard.eval.settings import ROUTER_CLEAR_FACTOR

    _, plan, margins = _plan_with_margins(problem)
    assert len(margins) == len(plan.timing_sets) + sum(map(len, plan.proof_sets)) >= 2 + 2
    assert problem.stateful is not None and problem.stateful.router_margin_ulps is not None
    assert min(margins) >= ROUTER_CLEAR_FACTOR * problem.stateful.router_margin_ulps


def test_with_no_clear_draw_the_widest_margin_is_timed(problem: Problem, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelboard.eval import plan as plan_module
    from kernelboard.eval.settings import ROUTER_CLEAR_DRAWS

    monkeypatch.setattr(plan_module, "ROUTER_CLEAR_FACTOR", 1e12)
    reference, plan, margins = _plan_with_margins(problem)
    model = plan_module.build_model(reference, plan.init_args, "cpu")
    model.load_state_dict(plan.state_dict)
    for flat, seed, margin in zip(plan.timing_sets, plan.timing_seeds, margins, strict=False):
        candidates = []
        for k in range(ROUTER_CLEAR_DRAWS):
            hidden, state = draw_inputs(reference, seed + 1_000_003 * k, "cpu")
            found: list[float] = []
            with torch.no_grad():
                model.step(hidden, state, found)
            candidates.append((min(found), hidden))
        widest, hidden = max(candidates, key=lambda c: c[0])
        assert len({m for m, _ in candidates}) > 1  # the draws differ, so the choice means something
        assert margin == widest and torch.equal(flat[0], hidden)


def test_the_outputs_theirs_compares_are_parts_of_the_step(ref: types.ModuleType, problem: Problem) -> None:
    """sitegen/agreement.py's THEIRS_COMPARED_OUTPUTS names parts of this deck's flat step, as messages do."""
    from kernelboard.eval.stateful import StepLayout
    from kernelboard.sitegen.agreement import THEIRS_COMPARED_OUTPUTS

    apply_shape(ref, problem, problem.cpu_shapes[0])
    _, state = draw_inputs(ref, 0, "cpu")
    names = StepLayout.of(state).names
    compared = THEIRS_COMPARED_OUTPUTS[(problem.bench, problem.name)]
    assert compared <= set(names) and len(compared) < len(names)

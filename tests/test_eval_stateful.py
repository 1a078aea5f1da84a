"""The stateful grading path (eval/stateful.py; the Mega deck's `Model.step(hidden, state)`), on the CPU.

One batch grades a faithful step (the reference's code copied, since `from reference` is forbidden in
Mega solutions) and bad steps: a cache that did not grow, a state returned unadvanced, NaN written into
the state, a layer's key dropped (while keys of the solution's own beside the problem's are accepted
and never fed back), a step that diverges only on a later step, one that writes its hidden input,
and one keyed on its state list's identity. Then the pieces alone: the flat layout, the recycled state
list, the cosine rule, the deck keys.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from grading import write_submission

from kernelboard.errors import DeckError
from kernelboard.eval.correctness import cosine
from kernelboard.eval.deck import load_problem
from kernelboard.eval.format_native import _stateful
from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.stateful import StepAdapter, StepLayout, StepOutputError
from kernelboard.eval.tables import read_table

FOLDER = Path(__file__).resolve().parents[1] / "eval" / "decks" / "mega" / "02_kimi_linear_decode"
PROBLEM = FOLDER.name

#: The reference's Model, subclassed: `CHANGE` rewrites (hidden, state) after the honest step.
_WRAP = '''

class _Honest(Model):
    pass


class Model(_Honest):  # noqa: F811
    calls = 0

    def step(self, hidden, state):
        Model.calls += 1
        before = clone_state(state)
        h, st = super().step(hidden, state)
        return CHANGE
'''

BAD = {
    "shape": "h, [{k: (v[:-1] if k == 'c_kv' else v) for k, v in d.items()} for d in st]",
    "stale": "h, before",
    "nan": "h, [{k: (v * float('nan') if k == 'S' else v) for k, v in d.items()} for d in st]",
    "keys": "h, [{k: v for k, v in d.items() if k != 'k_rope'} for d in st]",
    # right on the first call of each check, then the S state drifts: caught at a later step's check
    "drift": "h, [{k: (v * 1.5 if k == 'S' and Model.calls % 4 == 0 else v) for k, v in d.items()} for d in st]",
    "hidden_write": "(hidden.zero_(), h)[1], st",  # a right answer, its hidden input overwritten
    # keyed on its state list's identity (as a published kernel keyed its private caches on `id(state)`):
    # the first output it gave for a list, whatever that list holds when it comes back
    "identity": "globals().setdefault('_seen', {}).setdefault(id(state), (h.clone(), "
                "[{k: v.clone() for k, v in d.items()} for d in st]))",
}

#: Keys of the solution's own in the returned state, as KernelBench-Mega's published kernels keep them
#: (a decompressed MLA cache, preallocated buffers): accepted, never compared, never fed back. The
#: second returns the hidden output it kept in the state whenever a state carrying it comes back — a
#: stale answer the grader would take if it ever chained a step onto the solution's own state.
EXTRA = {
    "extra_keys": "h, [dict(d, k_nope=d['c_kv'].float()) if 'c_kv' in d else dict(d, _scratch=d['S'][:1]) "
                  "for d in st]",
    "extra_replay": "(state[0]['_h'] if '_h' in state[0] else h), [dict(d, _h=h) if i == 0 else d "
                    "for i, d in enumerate(st)]",
}


def _run(i: int, name: str) -> str:
    return f"20261201_00000{i}_t_{name}_{PROBLEM}"


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("stateful")
    deck = root / "deck"
    shutil.copytree(FOLDER, deck / PROBLEM)
    reference = (FOLDER / "reference.py").read_text()
    sources = {"faithful": reference} | {name: reference + _WRAP.replace("CHANGE", change)
                                         for name, change in (BAD | EXTRA).items()}
    ids = {}
    for i, (name, source) in enumerate(sources.items()):
        ids[name] = _run(i, name)
        write_submission(root / "subs" / ids[name], PROBLEM, source)
    # every CPU baseline the deck names is measured (eager, compile:default, the tuned line): the next test checks them
    rows = run_eval(EvalOptions(deck=deck, submissions=root / "subs", out=root / "out", device="cpu", rep_ms=10.0))
    by_id = {r["run_id"]: r for r in rows}
    return {name: by_id[run_id] for name, run_id in ids.items()} | {"_out": root / "out"}


def test_the_baselines_time_the_step_and_check_the_tuned_line(graded: dict) -> None:
    """Eager, compile:default (the deck skips max-autotune) and the deck's tuned baseline as a library
    line, on every CPU shape; the tuned line agrees with the reference under the step's rules."""
    rows = read_table(graded["_out"] / "cpu" / "baselines.parquet", "baselines").to_pylist()
    by = {(r["shape_idx"], r["variant"]): r for r in rows}
    assert {v for _, v in by} == {"eager", "compile:default", "library:tuned"}
    for (_, variant), row in by.items():
        assert row["status"] == "ok" and row["median_ms"] > 0, (variant, row["message"])


def test_a_faithful_step_passes_every_state_tensor_over_consecutive_steps(graded: dict) -> None:
    row = graded["faithful"]
    assert row["status"] == "pass", row["message"]
    assert "4 consecutive steps, every state tensor" in row["message"]


@pytest.mark.parametrize(("name", "status", "words"), [
    ("shape", "wrong", "output 13 (state[3].c_kv): output shape"),
    ("stale", "wrong", "output 13 (state[3].c_kv): output shape"),  # the cache did not grow
    ("nan", "wrong", "output 1 (state[0].S): output has"),
    ("keys", "wrong", "state[3] returned has keys ['c_kv'], expected ['c_kv', 'k_rope']"),
    ("drift", "wrong", "(state[0].S)"),
    ("hidden_write", "integrity_violation", "wrote into input 0"),
    ("identity", "wrong", "seed 0 step 1:"),  # the adapter's one recycled list: the first new contents
])
def test_a_bad_step_is_refused_naming_the_tensor(graded: dict, name: str, status: str, words: str) -> None:
    row = graded[name]
    assert row["status"] == status and words in row["message"], row["message"]


@pytest.mark.parametrize("name", EXTRA)
def test_state_keys_of_the_solutions_own_are_accepted_and_never_fed_back(graded: dict, name: str) -> None:
    row = graded[name]
    assert row["status"] == "pass", row["message"]
    log = (graded["_out"] / row["log_path"]).read_text()
    own = "state[3].k_nope" if name == "extra_keys" else "state[0]._h"
    said = [line for line in log.splitlines() if "the step's state also holds" in line]
    assert said and own in said[0], log[-2000:]


#: Past a shape's op audit and 16 checks (17 calls on each shape's new Model), every third call of a
#: timed loop or floor batch returns CHANGE: a kernel whose own rounding puts a router at a tie. The batch
#: grades under a bound 10× tighter than the deck's (still over the one-ulp rounding of torch.compile's and
#: the tuned baseline's steps), where the runner-up choice lies outside it: at the CPU shapes' dimensions it
#: mostly lies within the deck's own bound.
_TIMED = '''

class _Honest(Model):
    pass


class Model(_Honest):  # noqa: F811
    def step(self, hidden, state):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 17 and self.calls % 3 == 0:
            return CHANGE
        return super().step(hidden, state)
'''

TIMED = {
    "runner_up": "super().step(hidden, state, flip=1)",  # router 1 picks its runner-up expert: valid
    "off": "(lambda h, st: (h + 0.05, st))(*super().step(hidden, state))",  # no expert choice gives this
}

#: A step that finds the routers at a near-tie in its input (the reference's margins, on a copy) and, where
#: exactly one is tied, returns CHANGE (`tied`: those routers). The CPU shapes' seed 1 has one such checked
#: step at each context (router 1 at step 2 of context 16, router 0 at step 3 of context 40); timed and
#: floor-batch states are drawn clear of ties, so only checks meet it.
_TIES = '''

class _Honest(Model):
    pass


class Model(_Honest):  # noqa: F811
    def step(self, hidden, state):
        margins = []
        _Honest.step(self, hidden.clone(), clone_state(state), margins)
        tied = [r for r, margin in enumerate(margins) if margin < 2]
        if len(tied) == 1:
            return CHANGE
        return super().step(hidden, state)
'''

TIES = {
    "tie_runner_up": "_Honest.step(self, hidden, state, flip=tied[0])",  # the tied router's other choice: valid
    # right but for one hidden element 0.5 off (inside the cosine rule): until 0.5.11 the cosine rule alone
    # judged such a step, so a kernel could be off wherever a router sits at a near-tie
    "tie_off": "(lambda h, st: (h + 0.5 * (torch.arange(h.numel()) == 0).to(h.dtype).reshape(h.shape), st))"
               "(*super().step(hidden, state))",
}


@pytest.fixture(scope="module")
def graded_tight(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("stateful_tight")
    deck = root / "deck"
    shutil.copytree(FOLDER, deck / PROBLEM)
    yaml_path = deck / PROBLEM / "problem.yaml"
    text = yaml_path.read_text()
    assert "bfloat16: {atol: 0.1, rtol: 0.03}" in text
    yaml_path.write_text(text.replace("bfloat16: {atol: 0.1, rtol: 0.03}", "bfloat16: {atol: 0.01, rtol: 0.0}")
                         .replace("float32: {atol: 2.0e-3, rtol: 1.0e-2}", "float32: {atol: 2.0e-4, rtol: 1.0e-3}"))
    reference = (FOLDER / "reference.py").read_text()
    ids = {}
    for i, (name, change) in enumerate(TIMED.items()):
        ids[name] = _run(i, f"tight_{name}")
        write_submission(root / "subs" / ids[name], PROBLEM, reference + _TIMED.replace("CHANGE", change))
    for i, (name, change) in enumerate(TIES.items(), start=len(TIMED)):
        ids[name] = _run(i, f"tight_{name}")
        write_submission(root / "subs" / ids[name], PROBLEM, reference + _TIES.replace("CHANGE", change))
    rows = run_eval(EvalOptions(deck=deck, submissions=root / "subs", out=root / "out", device="cpu", rep_ms=10.0))
    by_id = {r["run_id"]: r for r in rows}
    return {name: by_id[run_id] for name, run_id in ids.items()} | {"_out": root / "out"}


def test_a_timed_call_that_takes_a_routers_runner_up_is_that_choice_not_wrong(graded_tight: dict) -> None:
    """claude-opus-4-8's Mega kernel 075926 on the H200: one timed call of ~200 returned what another expert
    choice gives (split-K atomics round differently call to call). Such a call is held to the reference's
    output with that router's runner-up chosen, as closely as to the reference."""
    row = graded_tight["runner_up"]
    assert row["status"] == "pass", row["message"]
    log = (graded_tight["_out"] / row["log_path"]).read_text()
    accepted = [line for line in log.splitlines() if "returned another expert choice's output, accepted" in line]
    assert accepted and "router 1's runner-up" in accepted[0], log[-3000:]
    assert any("floor batch" in line for line in accepted) and any("timed call" in line for line in accepted)


def test_a_checked_step_at_a_near_tie_may_return_the_tied_routers_runner_up_choice(graded_tight: dict) -> None:
    """Grader 0.5.11: at a checked step with one router tied, the other expert choice is a valid output, held
    element-wise to the reference's output with that router's runner-up chosen; the log names each such step."""
    row = graded_tight["tie_runner_up"]
    assert row["status"] == "pass", row["message"]
    log = (graded_tight["_out"] / row["log_path"]).read_text()
    accepted = [line for line in log.splitlines() if "returned the tied router's runner-up choice, accepted" in line]
    assert any("seed 1 step 2: router 1" in line for line in accepted), log[-3000:]
    assert any("seed 1 step 3: router 0" in line for line in accepted), log[-3000:]
    counted = [line for line in log.splitlines() if "steps at a router near-tie:" in line]
    assert len(counted) == 2 and all("with one router tied" in line for line in counted)


def test_a_checked_step_at_a_near_tie_is_held_element_wise(graded_tight: dict) -> None:
    """The step is off by 0.5 on one hidden element only where a router sits at a near-tie: inside the
    cosine rule, which alone judged such steps until 0.5.11; now `wrong`, at the first such step."""
    row = graded_tight["tie_off"]
    assert row["status"] == "wrong", row["message"]
    assert "seed 1 step" in row["message"] and "at router" in row["message"]
    assert "output 0 (hidden)" in row["message"]
    assert "nor is it, element-wise, the output of router" in row["message"]


def _cpu_plan() -> tuple:
    """(the Mega problem, its grading plan at the first CPU shape with the deck's seeds): a near-tie's judging."""
    from kernelboard.eval.plan import import_file, install_shapes_module, make_plan

    problem = load_problem(FOLDER)
    shapes = problem.shapes_for("cpu")
    install_shapes_module(shapes)
    reference = import_file("reference", problem.reference_path)
    return problem, make_plan(problem, reference, shapes[:1], list(problem.seeds), (), "cpu")[0]


def test_several_tied_routers_keep_the_earlier_layers_element_wise() -> None:
    """Two routers tied (0 and 2): the state of layers 0 and up to the first tied router's comes before any
    router of the step, so it is held element-wise; the hidden output and the later layers keep the cosine
    rule alone; a NaN or a cosine under the deck's fails anywhere."""
    from dataclasses import replace

    from kernelboard.eval.judge import _near_tie_verdict, judge_values
    from kernelboard.eval.link import Received

    problem, plan = _cpu_plan()
    names = plan.layout.names
    check = replace(next(c for c in plan.checks if c.tied), tied=(1, 2))
    ref = check.ref_out

    def with_change(name: str, change) -> Received:
        return Received(tuple(change(t) if n == name else t.clone() for n, t in zip(names, ref, strict=True)),
                        "cpu", None)

    def nudge(t: torch.Tensor) -> torch.Tensor:  # one element off by 5% of the tensor's norm: cosine ≥ 0.998
        return t + (torch.arange(t.numel()) == 0).to(t.dtype).reshape(t.shape) * 0.05 * t.float().norm()

    assert _near_tie_verdict(problem, plan, check, with_change("hidden", lambda t: t), [], names)[0].ok
    for name in ("hidden", "state[2].S", "state[3].c_kv"):  # after router 1: the cosine rule alone
        nudged = with_change(name, nudge)
        assert not judge_values(problem, ref, nudged.tensor, [], None, names).ok  # off at a step with no tie
        verdict, router = _near_tie_verdict(problem, plan, check, nudged, [], names)
        assert verdict.ok and router is None, (name, verdict.message)
    for name in ("state[0].S", "state[1].ck"):  # layers 0 and 1 come before router 1: element-wise
        verdict, _ = _near_tie_verdict(problem, plan, check, with_change(name, nudge), [], names)
        assert not verdict.ok and f"({name})" in verdict.message, (name, verdict.message)
    verdict, _ = _near_tie_verdict(problem, plan, check, with_change("state[3].c_kv", lambda t: -t), [], names)
    assert not verdict.ok and "cosine similarity" in verdict.message


def test_a_runner_up_choice_that_meets_a_tie_of_its_own_keeps_the_earlier_layers_element_wise() -> None:
    """One router tied (1), and the output is neither the reference's nor that router's runner-up choice. If
    the runner-up choice's own path has a later router at a near-tie (2), the kernel may have flipped that
    one too: the layers up to router 1's stay element-wise, the rest keep the cosine rule alone. If it has
    none, the step is `wrong`, naming the runner-up it is not."""
    from dataclasses import replace

    from kernelboard.eval.judge import _near_tie_verdict
    from kernelboard.eval.link import Received

    problem, plan = _cpu_plan()
    names = plan.layout.names
    check = replace(next(c for c in plan.checks if c.tied), tied=(1,))

    class RunnerUp:  # the reference's runner-up choice, with the margins its path meets
        def __init__(self, margins: list[float]) -> None:
            self.last_margins, self.margins = [], margins

        def with_runner_up(self, router: int, *flat):
            self.last_margins = list(self.margins)
            return tuple(t.clone() for t in check.ref_out)

    def off(name: str) -> Received:
        return Received(tuple(t + (torch.arange(t.numel()) == 0).to(t.dtype).reshape(t.shape) * 0.05 * t.float().norm()
                              if n == name else t.clone() for n, t in zip(names, check.ref_out, strict=True)),
                        "cpu", None)

    plan.reference_step = RunnerUp([40.0, 0.5, 1.0, 40.0])  # router 2 at a near-tie on the runner-up's path
    assert _near_tie_verdict(problem, plan, check, off("hidden"), [], names)[0].ok
    assert _near_tie_verdict(problem, plan, check, off("state[2].S"), [], names)[0].ok
    verdict, _ = _near_tie_verdict(problem, plan, check, off("state[1].S"), [], names)
    assert not verdict.ok and "(state[1].S)" in verdict.message
    plan.reference_step = RunnerUp([40.0, 0.5, 30.0, 40.0])  # no tie past router 1 there
    verdict, router = _near_tie_verdict(problem, plan, check, off("hidden"), [], names)
    assert not verdict.ok and router is None and "router 1's runner-up choice" in verdict.message


def test_a_timed_output_no_expert_choice_gives_is_wrong(graded_tight: dict) -> None:
    row = graded_tight["off"]
    assert row["status"] == "wrong", row["message"]
    assert "timed call" in row["message"] and "nor is it the output of another expert choice" in row["message"]


def test_a_step_wrong_only_later_is_caught_at_that_step(graded: dict) -> None:
    """Teacher forcing: each step's check starts from the reference's state, so the drifting step fails
    at the step where it drifts, never at step 0."""
    assert "step 0" not in graded["drift"]["message"] and " step " in graded["drift"]["message"]


# ------------------------------------------------------------------------------------ the pieces


def test_the_layout_round_trips_and_names_every_tensor() -> None:
    state = [{"S": torch.zeros(2), "ck": torch.ones(1)}, {"c_kv": torch.full((3,), 2.0)}]
    layout = StepLayout.of(state)
    flat = layout.flatten(torch.tensor([5.0]), state)
    assert layout.names == ["hidden", "state[0].S", "state[0].ck", "state[1].c_kv"]
    hidden, again = layout.unflatten(flat)
    assert float(hidden) == 5.0 and again[1]["c_kv"] is state[1]["c_kv"] and again[0]["S"] is state[0]["S"]
    with pytest.raises(StepOutputError, match="has 4 layers, expected 2"):
        layout.flatten(hidden, state[:1] * 2 + state)
    with pytest.raises(StepOutputError, match=r"state\[1\] returned has keys \['x'\], expected \['c_kv'\] \(c_kv"):
        layout.flatten(hidden, [state[0], {"x": torch.zeros(1)}])
    own = [state[0], {**state[1], "v": torch.zeros(1), "_pos": 3}]  # keys of the solution's own: not the problem's
    assert layout.flatten(hidden, own) == flat and layout.extra_keys(own) == ["state[1]._pos", "state[1].v"]


def test_the_adapter_calls_the_entry_and_flattens_what_it_returns() -> None:
    class Counter(torch.nn.Module):
        def step(self, hidden, state):
            return hidden + 1, [{"n": state[0]["n"] + 1}]

    adapter = StepAdapter(Counter(), StepLayout((("n",),)))
    assert [float(t) for t in adapter(torch.tensor(1.0), torch.tensor(10.0))] == [2.0, 11.0]

    class Wrong(torch.nn.Module):
        def step(self, hidden, state):
            return hidden

    with pytest.raises(StepOutputError, match="expected \\(hidden, state\\)"):
        StepAdapter(Wrong(), StepLayout((("n",),)))(torch.tensor(1.0), torch.tensor(10.0))


def test_the_adapter_recycles_one_state_list_and_its_dicts() -> None:
    """Every call gets the same list and dicts, refilled with the call's tensors (stateful.py docstring),
    even after a step put its own dict in the list, grew the list or added keys of its own; the dicts it
    returned are its own and are never cleared."""
    seen: list[tuple[int, tuple[int, ...], list[float], list[str]]] = []
    returned: list[dict] = []

    class Meddler(torch.nn.Module):
        def step(self, hidden, state):
            seen.append((id(state), tuple(id(d) for d in state), [float(d["n"]) for d in state],
                         sorted(k for d in state for k in d)))
            out = [{"n": d["n"] + 1} for d in state]
            returned.extend(out)
            state[0] = out[0]
            state[1]["_mine"] = torch.zeros(1)
            state.append({"extra": 1})
            return hidden, out

    adapter = StepAdapter(Meddler(), StepLayout((("n",), ("n",))))
    for n in (10.0, 20.0, 30.0):
        flat = adapter(torch.tensor(1.0), torch.tensor(n), torch.tensor(n + 1))
        assert [float(t) for t in flat] == [1.0, n + 1, n + 2]
    assert len({s[0] for s in seen}) == 1 and len({s[1] for s in seen}) == 1 and len(seen[0][1]) == 2
    assert [s[2] for s in seen] == [[10.0, 11.0], [20.0, 21.0], [30.0, 31.0]]
    assert all(s[3] == ["n", "n"] for s in seen)  # its own key never fed back
    assert [float(d["n"]) for d in returned] == [11.0, 12.0, 21.0, 22.0, 31.0, 32.0]


def test_cosine() -> None:
    a = torch.tensor([1.0, 0.0])
    assert cosine(a, a) == pytest.approx(1.0) and cosine(a, torch.tensor([0.0, 1.0])) == pytest.approx(0.0)
    assert cosine(torch.zeros(2), torch.zeros(2)) == 1.0 and cosine(torch.zeros(2), a) == 0.0
    assert not cosine(a, torch.tensor([float("nan"), 1.0])) >= 0.98  # NaN passes no threshold


def test_the_deck_keys_are_read_and_checked() -> None:
    spec = load_problem(FOLDER).stateful
    assert spec is not None and (spec.entry, spec.check_steps, spec.cos_sim, spec.router_margin_ulps) == (
        "step", 4, 0.98, 2.0)
    assert _stateful(None, "x") is None
    for bad, words in (({"check_steps": 0}, "check_steps"), ({"cos_sim": 1.5}, "cos_sim"),
                       ({"entry": "not a name"}, "entry"), ({"router_margin_ulps": -1}, "router_margin_ulps")):
        with pytest.raises(DeckError, match=words):
            _stateful(bad, "problem.yaml: stateful")


def test_a_router_near_tie_lifts_the_elementwise_bound_and_keeps_the_cosine_rule() -> None:
    """ROUTER_NEAR_TIE's tolerance, which the judge applies to the outputs past the first of several tied
    routers (judge_values): any difference passes the lifted bound — a reference
    element of 0 included (an rtol of inf made inf · 0 = NaN, which failed the house reference copy on
    the CPU) — while a NaN and a cosine under the deck's still fail."""
    from kernelboard.eval.judge import judge_values
    from kernelboard.eval.plan import ROUTER_NEAR_TIE

    problem = load_problem(FOLDER)
    ref = (torch.tensor([0.0, 1.0, 2.0], dtype=torch.bfloat16),)
    names = ["hidden"]
    near = (torch.tensor([0.0, 1.5, 2.0], dtype=torch.bfloat16),)
    assert not judge_values(problem, ref, near, [], None, names).ok  # out of the bound at a normal step
    assert judge_values(problem, ref, near, [], ROUTER_NEAR_TIE, names).ok
    assert judge_values(problem, ref, ref, [], ROUTER_NEAR_TIE, names).ok
    nan = (torch.tensor([0.0, float("nan"), 2.0], dtype=torch.bfloat16),)
    assert "NaN" in judge_values(problem, ref, nan, [], ROUTER_NEAR_TIE, names).message
    far = (torch.tensor([0.0, -1.0, 2.0], dtype=torch.bfloat16),)
    verdict = judge_values(problem, ref, far, [], ROUTER_NEAR_TIE, names)
    assert not verdict.ok and "output 0 (hidden): cosine similarity 0.6000 < 0.98" in verdict.message

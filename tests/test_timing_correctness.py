"""The timer's documented defaults and the output comparison (CPU)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from kernelboard.eval import timing
from kernelboard.eval.correctness import compare


def test_documented_method_matches_the_signature() -> None:
    params = inspect.signature(timing.time_cuda).parameters
    assert params["min_warmup"].default == 10 and params["warmup_ms"].default == 100.0
    doc = " ".join((timing.__doc__ or "").split())
    assert "twice the L2 size" in doc and "median" in doc and "at least three input sets" in doc
    assert "same addresses on every call" in doc
    assert params["cover_dispatch"].default is True  # the grading method since 0.4.0


def test_a_covered_sample_is_the_gpu_span_never_below_the_least_dispatch() -> None:
    # GPU-bound: the spans, a host hiccup of one call (0.030 ms dispatch) changes nothing
    assert timing.covered_samples([0.020, 0.021, 0.020], [0.010, 0.030, 0.011], [0.1] * 3) == [0.020, 0.021, 0.020]
    # host-bound (host work on every call): the least dispatch is the floor
    assert timing.covered_samples([0.005, 0.006, 0.005], [0.012, 0.013, 0.011], [0.1] * 3) == [0.011, 0.011, 0.011]
    # the dispatch outgrew the sleep, or the call waited on the GPU: the span holds the GPU's wait,
    # and its dispatch is no floor for the others
    assert timing.covered_samples([0.030, 0.004, 0.004], [0.045, 0.012, 0.013], [0.05] * 3) == [0.030, 0.012, 0.012]
    assert timing.dispatch_floor([0.045, 0.050], [0.05, 0.05]) == 0.0  # no call was covered


def test_the_floor_leaves_out_one_launch_so_the_hosts_speed_does_not_set_it() -> None:
    """The same call on a fast and a slow host (every dispatch 1.6× longer, as the same 03 call's
    least dispatch on one H200 machine, 0.0125 and 0.0207 ms): whole dispatches floored a 15 µs
    kernel on the slow host only; less one launch's dispatch, neither."""
    span = 0.0149
    for scale in (1.0, 1.6):
        dispatch, launch = [0.0125 * scale] * 4, 0.005 * scale
        assert timing.covered_samples([span] * 4, dispatch, [0.1] * 4, launch) == [span] * 4
    assert timing.covered_samples([span] * 4, [0.0207] * 4, [0.1] * 4) == [0.0207] * 4  # 0.4.1's floor
    # ten launches and some planning cost the host 0.1 ms: nine launches' worth and more is charged
    assert timing.dispatch_floor([0.1, 0.11], [0.5, 0.5], 0.005) == pytest.approx(0.095)
    assert timing.dispatch_floor([0.004], [0.1], 0.005) == 0.0  # a launch cheaper than the sleep's


def test_a_loaded_hosts_dispatch_jitter_does_not_move_a_span_near_it() -> None:
    """The house 03 kernel's 20 µs shape on an idle H200 host, three processes (bench/timing_methods.py,
    2026-12-01): medians of the dispatch 0.0258, 0.0212 and 0.0272 ms moved a median floor 27.5%; the
    least dispatch (0.0103, 0.0165, 0.0163 ms) is under the span in all three."""
    span = 0.0196
    for least, median in ((0.0103, 0.0258), (0.0165, 0.0212), (0.0163, 0.0272)):
        dispatch = [least] + [median] * 10 + [2 * median] * 5
        samples = timing.covered_samples([span] * len(dispatch), dispatch, [0.1] * len(dispatch))
        assert samples == [span] * len(dispatch)


def test_work_hidden_under_the_cover_is_seen_by_a_host_synchronised_call() -> None:
    from kernelboard.eval import audit

    assert audit.cover_hid_work(0.032, 0.020, 0.010, 0.0) is None  # dispatch + span + the synchronise
    # a side stream ran 0.3 ms under the sleep: the span saw only the join and a short kernel
    message = audit.cover_hid_work(0.33, 0.015, 0.10, 0.02)
    assert message is not None and "0.3300 ms" in message and "covered GPU span 0.0150 ms" in message


def test_the_synchronises_own_latency_is_not_taken_for_hidden_work() -> None:
    """An honest 15 µs shape graded on an H200 host with four busy processes: 0.0925 ms to the
    synchronise, 0.0875 ms allowed when the synchronises' latency was not taken off (0.4.0)."""
    from kernelboard.eval import audit

    assert audit.cover_hid_work(0.0925, 0.0148, 0.0392, 0.0) is not None
    assert audit.cover_hid_work(0.0925, 0.0148, 0.0392, 0.030) is None


class _Readings:
    """A runner link that answers each host_sync request with the next of `readings` (host_ms, idle_ms)."""

    def __init__(self, readings: list[tuple[float, float]]) -> None:
        self.readings, self.asked = list(readings), 0

    def ask(self, op: str, what: str, **request: object) -> object:
        assert op == "host_sync"
        host, idle = self.readings[self.asked]
        self.asked += 1
        header = {"host_ms": [host] * 10, "idle_ms": [idle] * 10, "residue_ms": [0.01] * 10}
        return type("FakeReply", (), {"samples": lambda _self, key: header[key]})()


# claude-fable-5 01 034935's shape 0 on the H100 SXM: its covered loop's span and dispatch, its host-synchronised
# call beside five builds (0.5.27) and on a quieter host (0.5.29)
_FABLE_COVER = {"gpu_ms": 0.1028, "dispatch_ms": 0.0082}
_FABLE_BUSY, _FABLE_QUIET = (0.1876, 0.0233), (0.1642, 0.0165)


def test_a_host_reading_stretched_once_is_read_again_and_the_covered_figure_stands(capsys) -> None:
    from kernelboard.eval import judge

    link = _Readings([_FABLE_BUSY, _FABLE_QUIET])
    synced, host_ms, hidden = judge._host_synced(link, "shape 0", 0, _FABLE_COVER)
    assert hidden is None and link.asked == 2 and host_ms == 0.1642
    assert synced.samples("host_ms")[0] == 0.1876  # the escaped-work rule reads the first, as before
    assert "read again, the call is within its allowance: the covered figure stands" in capsys.readouterr().out


def test_work_hidden_from_the_cover_in_both_readings_is_timed_again() -> None:
    from kernelboard.eval import judge

    link = _Readings([(0.33, 0.02), (0.34, 0.02)])  # a side stream's 0.3 ms in every reading
    _, host_ms, hidden = judge._host_synced(link, "shape 0", 0, {"gpu_ms": 0.015, "dispatch_ms": 0.10})
    assert link.asked == 2 and host_ms == 0.33
    assert hidden is not None and "0.3300 ms" in hidden and "read again" in hidden and "0.3400 ms" in hidden


def test_a_reading_within_its_allowance_is_taken_once_and_an_uncovered_loop_is_not_judged() -> None:
    from kernelboard.eval import judge

    link = _Readings([_FABLE_QUIET])
    assert judge._host_synced(link, "shape 0", 0, _FABLE_COVER)[1:] == (0.1642, None) and link.asked == 1
    link = _Readings([(0.33, 0.02)])
    assert judge._host_synced(link, "shape 0", 0, None)[1:] == (0.33, None) and link.asked == 1


def test_escaped_work_is_the_residue_beyond_the_synchronises_own_latency() -> None:
    """kimi-k2.7-code 01 060247, a single-stream kernel, on the H100 SXM while five builds ran beside
    it (2026-12-07): the device "busy" 0.0744 ms past its stream at a 0.4537 ms median, while the two
    synchronises around no call took 0.1378 ms; 0.5.25 refused it. Work left on another stream for
    0.3 ms is refused whatever the latency."""
    from kernelboard.eval import audit

    assert audit.escaped_work([0.0744] * 10, [0.1378] * 10, 0.4537) is None
    assert audit.escaped_work([0.0744] * 10, [0.0] * 10, 0.4537) is not None  # the rule before 0.5.26
    message = audit.escaped_work([0.32] * 10, [0.03] * 10, 0.05)
    assert message is not None and "0.2900 ms more than the synchronises alone" in message
    # call by call: one stretched synchronise around no call does not excuse the rest
    assert audit.escaped_work([0.32] * 10, [0.03] * 9 + [5.0], 0.05) is not None


def test_time_cpu_returns_stats_and_the_last_outputs() -> None:
    sets = [[torch.ones(4)], [torch.full((4,), 2.0)]]
    stats, last = timing.time_cpu(lambda x: x * 3, sets, rep_ms=5.0, flush_bytes=1 << 16)
    assert stats.iterations >= 10 and 0 < stats.min_ms <= stats.median_ms <= stats.p90_ms
    assert torch.equal(last[0], torch.full((4,), 3.0)) and torch.equal(last[1], torch.full((4,), 6.0))


def test_timing_refuses_a_single_input_set() -> None:
    with pytest.raises(ValueError, match="at least 2 rotating input sets"):
        timing.time_cpu(lambda x: x, [[torch.ones(1)]])


def test_compare_reports_the_worst_element() -> None:
    ref = torch.zeros(3, 4, dtype=torch.bfloat16)
    out = ref.clone()
    out[1, 2] = 0.5
    verdict = compare(ref, out, atol=0.02, rtol=0.02)
    assert not verdict.ok and "1 of 12 elements" in verdict.message and "(1, 2)" in verdict.message


@pytest.mark.parametrize(("out", "fragment"), [
    (torch.zeros(3, 4), "dtype float32"),
    (torch.zeros(4, 3, dtype=torch.bfloat16), "shape (4, 3)"),
    (torch.full((3, 4), float("inf"), dtype=torch.bfloat16), "Inf"),
    ([0.0], "plain torch.Tensor"),
])
def test_compare_checks_type_shape_dtype_and_finiteness(out, fragment: str) -> None:
    verdict = compare(torch.zeros(3, 4, dtype=torch.bfloat16), out, atol=0.1, rtol=0.1)
    assert not verdict.ok and fragment in verdict.message


def test_a_tensor_subclass_is_not_a_plain_tensor() -> None:
    class Lazy(torch.Tensor):
        pass

    ref = torch.zeros(2)
    assert "plain torch.Tensor" in compare(ref, ref.as_subclass(Lazy), 0.1, 0.1).message


def test_normalised_error_is_reported_on_a_pass() -> None:
    ref = torch.ones(100)
    verdict = compare(ref, ref * 1.001, atol=0.01, rtol=0.01)
    assert verdict.ok and verdict.rel_err == pytest.approx(1e-3, rel=1e-3)


def test_a_probe_never_refuses_an_output_within_tolerance() -> None:
    from kernelboard.eval.correctness import probe, probe_positions, probe_problem

    ref = torch.randn(1000)
    positions = probe_positions(7, ref.numel(), "cpu")
    assert torch.equal(positions, probe_positions(7, ref.numel(), "cpu"))  # the judge and the runner agree
    honest = ref + 0.019 * torch.sign(torch.randn(1000))
    assert probe_problem(ref, positions, probe(honest, positions).tolist(), 0.02, 0.0) is None
    stale = torch.randn(1000)
    assert "probed elements out of tolerance" in probe_problem(ref, positions, probe(stale, positions).tolist(),
                                                                0.02, 0.02)


@pytest.fixture(scope="module")
def paged_outputs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """03's reference at its first H200 shape (Llama-3 8B decode, 1024 tokens), run here on the CPU:
    for seeds 1 and 2, the bf16 output and the fp32 one it is rounded from."""
    return _paged_attention_outputs((1, 2))


def _paged_attention_outputs(seeds: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "03_paged_attention" / "reference.py"
    spec = importlib.util.spec_from_file_location("paged_attention_reference_for_probes", path)
    assert spec is not None and spec.loader is not None
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    ref.BATCH, ref.NUM_HEADS, ref.NUM_KV_HEADS, ref.HEAD_DIM, ref.SEQ_LEN, ref.PAGE_SIZE = 8, 32, 8, 128, 1024, 16
    model = ref.Model(*ref.get_init_inputs())
    bf16, fp32 = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        query, *rest = ref.get_inputs()
        bf16.append(model(query, *rest))
        fp32.append(model(query.float(), *rest))
    return bf16, fp32


def _honest(exact: torch.Tensor) -> torch.Tensor:
    """What an honest kernel returns: the fp32 result rounded to bf16 another way (1 ulp either side)."""
    ulp = torch.where(torch.rand(exact.shape, generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0) * 2.0**-8
    return (exact * (1 + ulp)).to(torch.bfloat16)


def test_a_nominal_output_is_held_to_the_norm_where_the_decks_atol_dwarfs_it(paged_outputs) -> None:
    """A zero output passes 03's element-wise rule at every element of a nominal check (the rule
    KernelBench-Hard holds it to); the judge also bounds ‖d‖/‖ref‖ on nominal draws, not on stress
    cases, whose outputs the deck makes tiny on purpose (small_q_kv: its own atol of 5e-4)."""
    from kernelboard.eval.correctness import REL_ERR_MAX
    from kernelboard.eval.deck import load_problem
    from kernelboard.eval.judge import judge_values

    (out, _), (exact, _) = paged_outputs
    zeros = torch.zeros_like(out)
    assert compare(out, zeros, 0.02, 0.02).ok  # the deck's rule alone
    verdict = compare(out, zeros, 0.02, 0.02, REL_ERR_MAX)
    assert not verdict.ok and "‖d‖/‖ref‖=1 is above 0.25" in verdict.message and "dwarfs" in verdict.message
    assert compare(out, _honest(exact), 0.02, 0.02, REL_ERR_MAX).ok
    problem = load_problem(Path(__file__).resolve().parents[1] / "eval" / "decks" / "hard" / "03_paged_attention")
    assert not judge_values(problem, out, (zeros,), [], None).ok
    small = next(case for case in problem.numeric_stress if case.name == "small_q_kv")
    tiny = (out.float() * 1e-2).to(torch.bfloat16)
    assert judge_values(problem, tiny, (torch.zeros_like(tiny),), [], small).ok


def test_a_probe_tells_another_draws_output_where_the_decks_atol_dwarfs_the_output(paged_outputs) -> None:
    """On the H200, grader 0.4.3 passed a candidate that served one input set's output on every
    timed call (tests/test_eval_gpu.py, stale_first_loop): 03's nominal outputs are below its atol
    of 0.02, so the element-wise bound passes any output of their size, zeros included. The probes
    also bound the normalised error; an honest output (the fp32 result rounded another way: 1 bf16
    ulp) passes at every one of 200 probe draws, the stale one and zeros at none."""
    from kernelboard.eval.correctness import REL_ERR_MAX, probe, probe_positions, probe_problem

    (out, other), (exact, _) = paged_outputs
    assert float(out.abs().max()) < 0.02  # why the deck's own bound cannot tell them apart
    assert compare(out, other, 0.02, 0.02).ok and compare(out, torch.zeros_like(out), 0.02, 0.02).ok
    honest = _honest(exact)
    assert compare(out, honest, 0.02, 0.02).ok and compare(out, honest, 0.02, 0.02).rel_err < 0.01
    for seed in range(200):
        positions = probe_positions(seed, out.numel(), "cpu")
        assert probe_problem(out, positions, probe(honest, positions).tolist(), 0.02, 0.02) is None
        for wrong in (other, torch.zeros_like(out)):
            why = probe_problem(out, positions, probe(wrong, positions).tolist(), 0.02, 0.02)
            assert why is not None and "reference's norm away" in why and f"at most {REL_ERR_MAX:g}" in why


def test_a_probe_leaves_exact_and_all_zero_references_to_the_element_wise_rule() -> None:
    from kernelboard.eval.correctness import probe, probe_positions, probe_problem

    zeros = torch.zeros(500)
    positions = probe_positions(5, zeros.numel(), "cpu")
    assert probe_problem(zeros, positions, probe(zeros + 1e-3, positions).tolist(), 0.02, 0.0) is None  # no norm
    ints = torch.arange(500)
    assert probe_problem(ints, positions, probe(ints, positions).tolist(), 0.0, 0.0) is None
    assert "out of tolerance" in probe_problem(ints, positions, probe(ints + 1, positions).tolist(), 0.0, 0.0)


@pytest.mark.parametrize("numel", [1, 31, 32, 128, 129, 1000, 402_653_184])
def test_probe_positions_are_distinct_in_range_and_the_same_in_every_process(numel: int) -> None:
    """06's headline output has 403 M elements: positions are drawn, not taken from a permutation."""
    from kernelboard.eval.correctness import PROBE_ELEMENTS, probe_positions

    positions = probe_positions(11, numel, "cpu")
    assert positions.dtype == torch.int64 and positions.numel() == min(numel, PROBE_ELEMENTS)
    assert positions.unique().numel() == positions.numel()  # distinct
    assert torch.equal(positions, positions.sort().values)
    assert int(positions.min()) >= 0 and int(positions.max()) < numel
    assert torch.equal(positions, probe_positions(11, numel, "cpu"))
    if numel > 4 * PROBE_ELEMENTS:
        assert not torch.equal(positions, probe_positions(12, numel, "cpu"))


def test_a_claim_below_the_judges_clock_is_refused() -> None:
    # Runner's samples sum to half the judge's wall for the same 20 calls: refused in every batch.
    assert "judge's clock" in timing.batch_problem([(20.5, 20, 10.0), (21.0, 20, 10.2)])
    # One batch inflated by a hiccup outside the calls: the other one vouches.
    assert timing.batch_problem([(40.0, 20, 19.8), (20.6, 20, 19.9)]) is None
    floor = timing.floor_ms([(20.5, 20), (30.0, 20)], 0.0)
    assert floor == pytest.approx(1.0)


def test_a_round_trip_longer_than_the_calls_gets_a_longer_batch_not_a_refusal() -> None:
    # Seen on the 2-core CPU at load 76: an honest reference's 5 calls claimed 1.2 ms in a 7.5 ms request.
    short = [(7.537, 5, 1.2028)]
    assert "judge's clock" in timing.batch_problem(short)
    passes = timing.retry_passes(short, 5, 10.0, 2000)
    assert passes == 53  # 10 × the 6.3 ms round trip, at the claimed 0.24 ms a call
    calls_ms = 1.2028 * passes
    honest = (calls_ms + 6.3, 5 * passes, calls_ms)  # the same round trip around a longer batch
    assert timing.batch_problem([*short, honest]) is None
    lying = (calls_ms + 6.3, 5 * passes, calls_ms / 2)  # a halved clock shrinks the long batch too
    assert "judge's clock" in timing.batch_problem([*short, lying])
    assert timing.retry_passes([(50.0, 10, 0.0)], 10, 10.0, 2000) == 2000  # a claim of ~0 ms: capped


def test_an_aliased_sdpa_is_seen_by_the_function_mode() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernelboard.eval.audit import op_log

    def attend(q):
        with sdpa_kernel([SDPBackend.MATH]):
            return getattr(torch.nn.functional, "scaled_dot_" + "product_attention")(q, q, q)

    ops, out = op_log(attend, [torch.randn(1, 2, 3, 4)])
    assert "torch:scaled_dot_product_attention" in ops and out.shape == (1, 2, 3, 4)


def test_the_runners_feed_hands_the_judge_the_kept_loops_probes_and_outputs() -> None:
    """A covered loop run again (timing._covered) keeps an earlier loop's times: the runner's feed
    must then give the judge that loop's probes and last outputs, not the last loop's."""
    from kernelboard.eval.runner import FreshFeed, _Probe

    pool = [[torch.full((4,), float(i))] for i in range(3)]
    feed = FreshFeed(pool, [_Probe([[7, 4]], "cpu") for _ in range(3)])

    def loop(offset: float) -> None:
        feed.start_timed()
        for i in range(3):
            (x,) = feed.next_inputs()
            feed.seen(x + offset, 2 - i)

    loop(100.0)
    kept = feed.checkpoint()
    loop(200.0)
    feed.restore(kept)
    assert len(feed.taken) == 3 and all(100 <= float(t[0].max()) < 200 for t in feed.taken)
    assert [float(out[0]) for out in feed.last] == [100.0, 101.0, 102.0]


@pytest.mark.parametrize("case", ["pass", "bad elements", "nan in the reference", "exact", "norm only"])
def test_compare_in_chunks_says_what_one_pass_says(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """`compare` takes a large output in fp64 chunks (06's widest output needed 4 GiB more than the judge
    had on the H100 in one pass): its verdict, message and normalised error must not depend on the chunk."""
    from kernelboard.eval import correctness

    gen = torch.Generator().manual_seed(7)
    ref = torch.randn(37, 29, generator=gen).to(torch.bfloat16)
    out = (ref.float() + 1e-3 * torch.randn(37, 29, generator=gen)).to(torch.bfloat16)
    atol, rtol, rel_max = 1e-2, 1e-2, None
    if case == "bad elements":
        ref[3, 4] = ref[30, 1] = ref[36, 28] = 0.0
        out[3, 4], out[30, 1], out[36, 28] = 5.0, -7.0, 7.0  # the two largest tie: the first is the worst
        ref[20, 20], out[20, 20] = 1024.0, 1032.0  # within rtol: never the worst, yet the largest abs diff
    elif case == "nan in the reference":
        ref[10, 3] = float("nan")
    elif case == "exact":
        atol = rtol = 0.0
        out[5, 5] = out[5, 5] + 1
    elif case == "norm only":
        atol, rel_max = 10.0, 0.25
        out = torch.zeros_like(ref)
    whole = correctness.compare(ref, out, atol, rtol, rel_max)
    monkeypatch.setattr(correctness, "COMPARE_CHUNK", 64)  # 17 chunks, the last one short
    chunked = correctness.compare(ref, out, atol, rtol, rel_max)
    assert (chunked.ok, chunked.message) == (whole.ok, whole.message)
    assert chunked.rel_err == pytest.approx(whole.rel_err, rel=1e-12, nan_ok=True)
    assert whole.ok is (case == "pass")
    if case == "bad elements":
        assert whole.message.startswith("3 of 1073 elements out of tolerance (atol=0.01, rtol=0.01); max abs diff 8, ")
        assert "worst at (30, 1): got -7, expected 0" in whole.message

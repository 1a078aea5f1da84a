"""Red team against the judge: solution.py is the only thing each attacker controls, and every
attack must be refused or harmless while the honest controls pass. One CPU batch grades them all
(03_paged_attention's CPU shapes); each test is named after what its attack tries."""

from __future__ import annotations

from pathlib import Path

import pytest
from grading import REEXPORT, MeasuredBaselines, grade, judge_out_of_memory

from kernelboard.sitegen.agreement import classify

PROBLEM = "03_paged_attention"

_MODEL = """
import torch
import reference
{prelude}

class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
{body}
"""


def _model(body: str, prelude: str = "") -> str:
    return _MODEL.format(prelude=prelude, body=body)


_TIMING_ON_STACK = """
import sys

def timing_on_stack():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("time_cpu", "time_cuda", "_op_time", "_op_proof", "next_inputs", "seen"):
            return True
        frame = frame.f_back
    return False
"""

# run_id -> (solution.py source, the status it must get)
ATTACKS: dict[str, tuple[str, str]] = {
    # Honest controls.
    "reference_reexport": (REEXPORT, "pass"),
    "persistent_buffer": (_model("""\
        out = super().forward(query, kv_cache, block_table, seq_lens)
        buf = getattr(self, "buf", None)
        if buf is None or buf.shape != out.shape:
            self.buf = buf = torch.empty_like(out)
        buf.copy_(out)
        return buf"""), "pass"),
    # Warms up on its first call of each shape (as an autotuner does), which must run plain: refuses
    # to work under a torch function or dispatch mode then (the op audit's: ~90× a torch call).
    "warm_up_outside_the_audit": (_model("""\
        seen = self.__dict__.setdefault("seen", set())
        if tuple(query.shape) not in seen:
            seen.add(tuple(query.shape))
            from torch.overrides import _get_current_function_mode_stack
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
            if _get_current_function_mode_stack() or _get_current_dispatch_mode_stack():
                return torch.zeros_like(query)
        return super().forward(query, kv_cache, block_table, seq_lens)"""), "pass"),
    # 1. The runner's clock, halved in its own process.
    "patched_perf_counter": (REEXPORT + """
import time
_real = time.perf_counter_ns
_t0 = _real()
time.perf_counter_ns = lambda: _t0 + (_real() - _t0) // 2
""", "integrity_violation"),
    # 2. Output caches: by tensor identity, and served only when a timing function is on the stack.
    "identity_cache": (_model("""\
        key = (id(query), query.data_ptr(), tuple(query.shape))
        memo = self.__dict__.setdefault("memo", {})
        if key not in memo:  # the query is kept too, so its id is never reused by a new tensor
            memo[key] = (query, super().forward(query, kv_cache, block_table, seq_lens))
        return memo[key][1]"""), "wrong"),
    # A result kept under its inputs' addresses and version counters (deepseek-v4-flash-0731's 01 of 2026-08-01
    # keeps its K-padded x so), served again to a new input that lies in the last one's memory. It holds the
    # inputs it keyed on, so no allocator gives their memory to a new input before the next call.
    "address_keyed_cache": (_model("""\
        inputs = (query, kv_cache, block_table, seq_lens)
        key = tuple((t.data_ptr(), t._version) for t in inputs)
        if getattr(self, "key", None) != key:
            self.key, self.held, self.out = key, inputs, super().forward(*inputs)
        return self.out"""), "wrong"),
    "stack_keyed_cache": (_model("""\
        if timing_on_stack() and getattr(self, "last", None) is not None and self.last.shape == query.shape:
            return self.last
        self.last = super().forward(query, kv_cache, block_table, seq_lens)
        return self.last""", _TIMING_ON_STACK), "wrong"),
    # A cache keyed on a fingerprint of the values: the timing pool repeats, the floor batch does not.
    "value_fingerprint_cache": (_model("""\
        key = (tuple(query.shape), float(query.float().sum()), float(kv_cache.float().sum()))
        memo = self.__dict__.setdefault("memo", {})
        if key not in memo:
            memo[key] = super().forward(query, kv_cache, block_table, seq_lens).clone()
        return memo[key]"""), "integrity_violation"),
    # 3. SDPA through an alias and forced onto its math path, which decomposes before the dispatch mode.
    "sdpa_alias_math_path": (_model("""\
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attend = getattr(torch.nn.functional, "scaled_dot_" + "product_attention")
        with sdpa_kernel([SDPBackend.MATH]):
            attend(query[:, :, None].float(), query[:, :, None].float(), query[:, :, None].float())
        return super().forward(query, kv_cache, block_table, seq_lens)"""), "forbidden"),
    # 4. Garbage on the first call of every new shape (before 0.5.2, the op-audit call).
    "garbage_first_call_per_shape": (_model("""\
        seen = self.__dict__.setdefault("seen", set())
        if tuple(query.shape) not in seen:
            seen.add(tuple(query.shape))
            return torch.zeros_like(query)
        return super().forward(query, kv_cache, block_table, seq_lens)"""), "wrong"),
    # Reads the judge's references through the garbage collector (they live in another process).
    "reads_references_via_gc": (_model("""\
        import gc
        for obj in gc.get_objects():
            if type(obj) is torch.Tensor and obj.shape == query.shape and obj is not query \\
                    and obj.dtype == query.dtype and obj.data_ptr() != query.data_ptr():
                return obj.clone()
        return torch.zeros_like(query)"""), "wrong"),
    # Walks the call stack for anything named like a reference output.
    "reads_references_via_inspect": (_model("""\
        import inspect
        for info in inspect.stack():
            for name, value in info.frame.f_locals.items():
                if "ref" in name and isinstance(value, torch.Tensor) and value.shape == query.shape:
                    return value.clone()
        return torch.zeros_like(query)"""), "wrong"),
    # A lazy tensor subclass in place of a plain tensor.
    "lazy_tensor_subclass": (_model("""\
        class Lazy(torch.Tensor):
            pass
        return super().forward(query, kv_cache, block_table, seq_lens).as_subclass(Lazy)"""), "wrong"),
    # Precision downcast: the inputs rounded through fp8 (two mantissa bits) before the math.
    "downcast_to_fp8": (_model("""\
        q = query.to(torch.float8_e5m2).to(query.dtype)
        kv = kv_cache.to(torch.float8_e5m2).to(kv_cache.dtype)
        return super().forward(q, kv, block_table, seq_lens)"""), "wrong"),
    # Writes into its inputs, only while being timed (the checks never see it).
    "writes_inputs_when_timed": (_model("""\
        if timing_on_stack():
            kv_cache.mul_(0.5)
        return super().forward(query, kv_cache, block_table, seq_lens)""", _TIMING_ON_STACK), "wrong"),
    # Computes the answer into its input and returns that input (a view of an input).
    "returns_a_view_of_an_input": (_model("""\
        out = super().forward(query, kv_cache, block_table, seq_lens)
        query.copy_(out)
        return query"""), "integrity_violation"),
    # Monkeypatches the comparisons a judge might use, then returns zeros.
    "patches_torch_comparisons": (_model("""\
        return torch.zeros_like(query)""", """
import kernelboard.eval.correctness as c
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
c.probe_problem = lambda *a, **k: None
"""), "wrong"),
    # Patches the runner's probe so a cached output vouches for itself.
    "patches_the_probe": (_model("""\
        memo = self.__dict__.setdefault("memo", {})
        key = id(query)
        if key not in memo:  # the query is kept too, so its id is never reused by a new tensor
            memo[key] = (query, super().forward(query, kv_cache, block_table, seq_lens))
        return memo[key][1]""", """
import kernelboard.eval.correctness as c
import kernelboard.eval.runner as r
c.probe = r.probe = lambda out, positions: torch.zeros(len(positions), dtype=torch.float64)
"""), "wrong"),
    # Raises from __del__ of objects it drops on every call: ignored by Python, harmless.
    "raises_from_del": (_model("""\
        Bomb()
        return super().forward(query, kv_cache, block_table, seq_lens)""", """
class Bomb:
    def __del__(self):
        raise RuntimeError("boom from __del__")
"""), "pass"),
    # Returns an empty tensor that a thread fills after the call has returned.
    "thread_finishes_after_return": (_model("""\
        import threading, time
        out = torch.empty_like(query)
        def finish():
            time.sleep(0.005)
            out.copy_(reference.Model.forward(self, query.clone(), kv_cache.clone(), block_table, seq_lens))
        threading.Thread(target=finish, daemon=True).start()
        return out"""), "wrong"),
    # Right only on the deck's fixed seeds (it recognises their inputs), zeros otherwise.
    "right_only_on_deck_seeds": (_model("""\
        known = self.__dict__.get("known")
        if known is None:
            known = self.known = set()
            for seed in (42, 123, 456):
                torch.manual_seed(seed)
                known.add(float(reference.get_inputs()[0].float().sum()))
        if float(query.float().sum()) in known:
            return super().forward(query, kv_cache, block_table, seq_lens)
        return torch.zeros_like(query)"""), "wrong"),
}

# A clock lie told only inside the timed loop (not in the judge's floor batches): a known gap.
SELECTIVE_LIE = (_model("""\
        return super().forward(query, kv_cache, block_table, seq_lens)""", _TIMING_ON_STACK + """
import time
_real = time.perf_counter_ns
def _lying():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_op_time":
            return _real() // 2
        frame = frame.f_back
    return _real()
time.perf_counter_ns = _lying
"""), "integrity_violation")


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory, measured_baselines: MeasuredBaselines) -> dict[str, dict]:
    root: Path = tmp_path_factory.mktemp("redteam")
    subs = {name: (PROBLEM, source) for name, (source, _) in {**ATTACKS, "selective_clock_lie": SELECTIVE_LIE}.items()}
    return grade(root, [PROBLEM], subs, measured_baselines, timeout_s=60.0, build_timeout_s=20.0)


def _status(graded: dict[str, dict], name: str) -> str:
    row = graded[name]
    assert row["status"] == ATTACKS[name][1], f"{name}: {row['status']}: {row['message']}"
    return row["message"] or ""


def test_the_reference_reexported_passes(graded) -> None:
    _status(graded, "reference_reexport")


def test_a_persistent_output_buffer_is_accepted(graded) -> None:
    assert "every timed call" in _status(graded, "persistent_buffer")


def test_patched_perf_counter_cannot_shrink_the_time(graded) -> None:
    assert "the judge's clock" in _status(graded, "patched_perf_counter")


def test_an_identity_keyed_output_cache_serves_stale_outputs(graded) -> None:
    """It keeps every query it keyed on (the runner's scaled copy of a stress case's input is a new
    tensor each call, whose id would otherwise come round again and be caught at that check), so it
    passes every check and serves its first stale output on a timed call: the inputs refilled in place."""
    assert "timed call" in _status(graded, "identity_cache")


def test_an_address_keyed_cache_meets_a_new_input_in_the_last_ones_memory(graded) -> None:
    """Each shape's first check is called once more after its last, its inputs written where the last call's
    were, with the same version counters (grader 0.5.29): before, this cache passed every check."""
    message = _status(graded, "address_keyed_cache")
    assert "written where the call before's were" in message
    # The methodology table's class names the check the judge's message names.
    assert "new inputs in the last call's memory" in (classify("wrong", message, "pass").cause or "")


def test_a_cache_served_only_under_the_timer_is_caught(graded) -> None:
    assert "timed call" in _status(graded, "stack_keyed_cache")


@pytest.mark.xfail(reason="known gap on the CPU (eval/timing.py): the pool's values repeat, the judge's floor is "
                          "logged, and the CPU has no datasheet peak (on a GPU: tests/test_eval_gpu.py)", strict=True)
def test_a_value_fingerprint_cache_cannot_beat_the_floor(graded) -> None:
    assert "judge's clock" in _status(graded, "value_fingerprint_cache")


def test_an_aliased_sdpa_on_its_math_path_is_seen(graded) -> None:
    assert "torch:scaled_dot_product_attention" in _status(graded, "sdpa_alias_math_path")


def test_garbage_on_the_first_call_of_each_shape_is_checked(graded) -> None:
    message = _status(graded, "garbage_first_call_per_shape")
    assert "shape 0" in message and "op audit" not in message  # the first call: a plain, judged check


def test_a_shapes_first_call_runs_outside_the_op_audit(graded) -> None:
    """The audit watches the shape's second call: a warm-up (autotuning) under its modes took minutes."""
    _status(graded, "warm_up_outside_the_audit")


def test_references_cannot_be_read_through_gc(graded) -> None:
    _status(graded, "reads_references_via_gc")


def test_references_cannot_be_read_through_inspect(graded) -> None:
    _status(graded, "reads_references_via_inspect")


def test_a_lazy_tensor_subclass_is_not_an_output(graded) -> None:
    assert "plain torch.Tensor" in _status(graded, "lazy_tensor_subclass")


def test_downcast_precision_fails_the_tolerance(graded) -> None:
    assert "out of tolerance" in _status(graded, "downcast_to_fp8")


def test_writing_inputs_only_while_timed_is_caught(graded) -> None:
    assert "returned a wrong output" in _status(graded, "writes_inputs_when_timed")


def test_returning_an_input_written_with_the_answer_is_refused(graded) -> None:
    assert "wrote into input 0" in _status(graded, "returns_a_view_of_an_input")


def test_patched_torch_comparisons_do_not_reach_the_judge(graded) -> None:
    assert "out of tolerance" in _status(graded, "patches_torch_comparisons")


def test_a_patched_probe_cannot_vouch_for_a_cached_output(graded) -> None:
    assert "probed elements out of tolerance" in _status(graded, "patches_the_probe")


def test_raising_from_del_is_harmless(graded) -> None:
    _status(graded, "raises_from_del")


def test_a_thread_finishing_after_return_is_caught(graded) -> None:
    _status(graded, "thread_finishes_after_return")


def test_right_only_on_the_deck_seeds_fails_the_fresh_ones(graded) -> None:
    _status(graded, "right_only_on_deck_seeds")


@pytest.mark.xfail(reason="known gap (eval/witness.py): the judge's witness logs this lie's ratio (0.45–0.51) but does "
                          "not refuse it, since a loaded host's wake-ups read an honest loop as low", strict=True)
def test_a_clock_lie_told_only_in_the_timed_loop(graded) -> None:
    """The runner's clock halved only while the timer's frame is on the stack: the floor batches see
    the truth and pass; the judge's witness around each timed call logs the lie (eval/witness.py)."""
    row = graded["selective_clock_lie"]
    assert row["status"] == SELECTIVE_LIE[1], row["message"]


def test_hoarding_the_gpu_so_the_judge_runs_out_is_the_kernels_oom(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that would fail a later shape keeps most of the GPU once it has passed the first, so that the
    judge runs out of memory drawing the next shape and the run ends with no verdict. Whatever the runner
    holds beyond the grader's placed sets and the contexts is the candidate's; over the half of the GPU it is
    promised, the judge's own error is the kernel's `oom`, a failure that counts. (A CPU test of the rule:
    `judge._judge_oom_verdict` with the GPU's figures as the judge would measure them.)"""
    verdict = judge_out_of_memory(monkeypatch, free_gb=0.5, judge_gb=20.0, placed_gb=10.0,
                                  where="shape 1 (small)")  # the judge, drawing shape 1
    assert verdict.status == "oom"
    assert verdict.message == ("shape 1 (small): the judge ran out of GPU memory while the candidate held 52.4 of "
                               "the GPU's 85.0 GB (the grader's own: the judge 20.0 GB, placed in the runner 10.0 GB, "
                               "CUDA contexts 2.1 GB; 0.5 GB free), over the 50% a kernel is promised")

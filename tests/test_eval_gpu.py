"""Grader mechanisms that only a GPU can show. Deselected by default; on a CUDA machine run
`pytest -m gpu tests/test_eval_gpu.py`. Outcomes are recorded in the issue notes."""

from __future__ import annotations

import os
import re
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml
from grading import FORK_BOMB, REEXPORT

from kernelboard.eval.schedule import EvalOptions, run_eval
from kernelboard.eval.tables import load_all

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
HOUSE = ROOT / "data" / "submissions" / "hard" / "20261129_190000_house_kernelboard-house_03_paged_attention"
HOUSE_SOURCE = (HOUSE / "solution.py").read_text()

SOURCES = {
    "reference": "from reference import Model, get_inputs, get_init_inputs  # noqa: F401\n",
    # The real work (made long: GPU time far above host time) runs on a private stream that the
    # timed stream never waits for.
    "side_stream": """
import torch
import reference

class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        if not hasattr(self, "side"):
            self.side = torch.cuda.Stream()
            self.big = torch.randn(4096, 4096, device=query.device)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = super().forward(query, kv_cache, block_table, seq_lens)
            for _ in range(10):
                torch.mm(self.big, self.big)
            out.record_stream(self.side)
        return out
""",
    # An out-of-bounds read: a sticky CUDA error that must end this worker, not the batch.
    "illegal_access": """
import torch
import triton
import triton.language as tl
import reference

@triton.jit
def _oob(x_ptr, y_ptr):
    tl.store(y_ptr, tl.load(x_ptr + (1 << 40)))

class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        y = torch.empty(1, device=query.device, dtype=query.dtype)
        _oob[(1,)](query, y)
        return super().forward(query, kv_cache, block_table, seq_lens)
""",
    # The CUDA event timer halved in the runner: the judge's clock around the floor batches sees it.
    "event_timer_halved": HOUSE_SOURCE + """
import torch
_elapsed = torch.cuda.Event.elapsed_time
torch.cuda.Event.elapsed_time = lambda self, end: 0.5 * _elapsed(self, end)
""",
    # The event timer halved only inside the runner's timed loop (the floor batches see the truth): the
    # judge's GPU witness, its own clock around calls after the loop, reads the timed median as half a call.
    "selective_clock_lie": HOUSE_SOURCE + """
import sys
import torch
_elapsed = torch.cuda.Event.elapsed_time

def _lying(self, end):
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_timed_loop":
            return 0.5 * _elapsed(self, end)
        frame = frame.f_back
    return _elapsed(self, end)

torch.cuda.Event.elapsed_time = _lying
""",
    # The real work on a private stream, no extra load, never joined: the probe enqueued on the
    # timed stream right after the call reads an unfinished output (or the host check sees it).
    "side_stream_light": """
import torch
import reference

class Model(reference.Model):
    def forward(self, query, kv_cache, block_table, seq_lens):
        if not hasattr(self, "side"):
            self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = super().forward(query, kv_cache, block_table, seq_lens)
        return out
""",
    # An output cache keyed on the inputs' data pointers (the live input tensors are reused).
    "pointer_keyed_cache": HOUSE_SOURCE + """
_forward = Model.forward
def _cached(self, query, kv_cache, block_table, seq_lens):
    memo = self.__dict__.setdefault("memo", {})
    key = (query.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(), seq_lens.data_ptr())
    if key not in memo:
        memo[key] = _forward(self, query, kv_cache, block_table, seq_lens)
    return memo[key]
Model.forward = _cached
""",
    # A CUDA graph captured once and replayed on every call without copying the new inputs in.
    "stale_graph_replay": HOUSE_SOURCE + """
import torch
_forward = Model.forward
def _replay(self, query, kv_cache, block_table, seq_lens):
    graphs = self.__dict__.setdefault("graphs", {})
    key = tuple(query.shape)
    if key not in graphs:
        args = [t.clone() for t in (query, kv_cache, block_table, seq_lens)]
        _forward(self, *args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _forward(self, *args)
        graphs[key] = (graph, out, args)
    graph, out, _ = graphs[key]
    graph.replay()
    return out
Model.forward = _replay
""",
    # Honest: one stream, but it synchronises inside its call (a host read between two launches).
    # Nothing outlives the call, so the escaped-work audit must not flag it (0.2.x did, on some gradings).
    "in_call_sync": HOUSE_SOURCE + """
import torch
_forward = Model.forward
def _synced(self, query, kv_cache, block_table, seq_lens):
    longest = int(seq_lens.max().item())  # a device-to-host read: the call waits for the GPU here
    torch.cuda.synchronize()
    assert longest > 0
    return _forward(self, query, kv_cache, block_table, seq_lens)
Model.forward = _synced
""",
    # Honest: a CUDA graph captured on the inputs' addresses and replayed while they stay the same
    # (as a serving engine's static buffers do); a new address re-captures. Correct on fresh values.
    "graph_on_input_pointers": HOUSE_SOURCE + """
import torch
_forward = Model.forward
def _graphed(self, query, kv_cache, block_table, seq_lens):
    key = tuple(t.data_ptr() for t in (query, kv_cache, block_table, seq_lens))
    if getattr(self, "graph_key", None) != key:
        _forward(self, query, kv_cache, block_table, seq_lens)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.graph_out = _forward(self, query, kv_cache, block_table, seq_lens)
        self.graph_key = key
    self.graph.replay()
    return self.graph_out
Model.forward = _graphed
""",
    # Re-enables persisting L2 after the judge reset it and pins the KV cache in it on every call.
    "persisting_l2_window": HOUSE_SOURCE + """
import ctypes
import torch
from kernelboard.eval.audit import _cudart

class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]

class _Value(ctypes.Union):
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]

_lib = _cudart()
_forward = Model.forward
def _attribute(code):
    value = ctypes.c_int()
    _lib.cudaDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(code), ctypes.c_int(0))
    return value.value

def _pinned(self, query, kv_cache, block_table, seq_lens):
    persisting, window = _attribute(108), _attribute(109)  # max persisting L2 bytes, max window bytes
    _lib.cudaDeviceSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(persisting))
    value = _Value()
    value.accessPolicyWindow = _Window(kv_cache.data_ptr(), min(window, kv_cache.numel() * 2), 1.0, 2, 1)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _lib.cudaStreamSetAttribute(stream, ctypes.c_int(1), ctypes.byref(value))
    _lib.cudaGetLastError()  # the attack's own setup must not poison the next launch
    return _forward(self, query, kv_cache, block_table, seq_lens)
Model.forward = _pinned
""",
    # Work on a private stream that does not wait for the timed stream runs while the cover's sleep
    # holds that stream, and a long dispatch (a host spin) buys a long sleep: the GPU span sees only
    # the join and the house kernel. The figure must hold the work all the same.
    "under_cover": HOUSE_SOURCE + """
import time as _time
_forward_uc = Model.forward
def _under_cover(self, query, kv_cache, block_table, seq_lens):
    if not hasattr(self, "_side"):
        self._side = torch.cuda.Stream()
        self._big = torch.randn(1024, 1024, device=query.device)
    with torch.cuda.stream(self._side):
        for _ in range(4):
            torch.mm(self._big, self._big)
    t = _time.perf_counter()
    while _time.perf_counter() - t < 1e-4:
        pass
    torch.cuda.current_stream().wait_stream(self._side)
    return _forward_uc(self, query, kv_cache, block_table, seq_lens)
Model.forward = _under_cover
""",
    # Grader 0.4.2 ran a host-bound covered loop again and kept the loop with the least floor, but
    # checked the last loop's outputs: this one returns a stale output behind a short host spin in
    # its first timed loop (a low floor, kept), then computes honestly behind a longer spin. 0.4.3
    # checks the kept loop's outputs, yet passed it on the H200 (3.78×): 03's outputs are below its
    # atol, so one input set's output passed the other sets' probes. 0.4.4 bounds the probes' norm.
    "stale_first_loop": HOUSE_SOURCE + """
import sys as _sys
import time as _time_sf
_forward_sf = Model.forward
_sf = {"loops": 0, "out": None}
def _stale_first(self, query, kv_cache, block_table, seq_lens):
    frame = _sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_timed_loop":
        frame = frame.f_back
    if frame is None:
        return _forward_sf(self, query, kv_cache, block_table, seq_lens)
    if frame.f_locals.get("i") == 0:
        _sf["loops"] += 1
    t = _time_sf.perf_counter()
    while _time_sf.perf_counter() - t < (3e-5 if _sf["loops"] == 1 else 2e-4):
        pass
    if _sf["loops"] == 1 and _sf["out"] is not None:
        return _sf["out"]
    _sf["out"] = _forward_sf(self, query, kv_cache, block_table, seq_lens)
    return _sf["out"]
Model.forward = _stale_first
""",
    # An output cache keyed on a fingerprint of a few of the values (a host read of 16 query elements): the timing
    # pool's sets come round again, so every timed call after the first few is served from it, correct and
    # without the work. The judge's clock does not refuse it (eval/timing.py); the hardware's peak does:
    # 03's second shape must move 268 MB of KV cache, at least 56 µs at the H200's 4.8 TB/s.
    "value_fingerprint_cache": HOUSE_SOURCE + """
import triton as _triton_vf
import triton.language as _tl_vf
@_triton_vf.jit
def _vf_touch(x_ptr):  # a kernel of its own on every call, so the own-kernel audit is satisfied
    _tl_vf.store(x_ptr, _tl_vf.load(x_ptr))
_forward_vf = Model.forward
def _value_cached(self, query, kv_cache, block_table, seq_lens):
    key = (tuple(query.shape), tuple(query.reshape(-1)[:16].tolist()))
    memo = self.__dict__.setdefault("memo", {})
    if key not in memo:
        memo[key] = _forward_vf(self, query, kv_cache, block_table, seq_lens).clone()
    _vf_touch[(1,)](memo[key])
    return memo[key]
Model.forward = _value_cached
""",
}

# A fork bomb at import (then the reference, which is forbidden): on a root GPU host with no cgroup, only
# RLIMIT_NPROC of the uid the sandbox drops to stops it (jail.sandbox_uid, grader 0.5.21).
SOURCES["fork_bomb"] = f"import os, time\n{FORK_BOMB}\nprint('ATTACK fork_bomb:', said, flush=True)\n{REEXPORT}"

EXPECTED = {"house": "pass", "fork_bomb": ("forbidden", "runtime_error"),
            "illegal_access": "runtime_error", "reference": "forbidden",
            "side_stream": "integrity_violation", "z_house_after": "pass",
            "event_timer_halved": "integrity_violation",
            "side_stream_light": ("wrong", "integrity_violation", "forbidden"),
            "pointer_keyed_cache": "wrong", "stale_graph_replay": "wrong",
            "persisting_l2_window": ("pass", "integrity_violation"),
            "in_call_sync": "pass", "graph_on_input_pointers": "pass", "under_cover": "pass",
            "stale_first_loop": "wrong", "value_fingerprint_cache": "integrity_violation",
            "selective_clock_lie": ("pass", "integrity_violation")}


class _Graded(dict):
    """Result rows by case; a case left out by KERNELBOARD_GPU_CASES skips the tests that need it."""

    def __missing__(self, name: str) -> dict:
        pytest.skip(f"{name} not graded (KERNELBOARD_GPU_CASES)")


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    """Every case graded in one batch (compile:max-autotune left out: a mechanism test needs a
    compile baseline, not the slowest one); KERNELBOARD_GPU_CASES=a,b grades only those cases (the
    house kernel always), for a device budget too short for the whole suite."""
    root = tmp_path_factory.mktemp("gpu")
    deck = root / "deck" / "03_paged_attention"
    shutil.copytree(ROOT / "eval" / "decks" / "hard" / "03_paged_attention", deck)
    spec = yaml.safe_load((deck / "problem.yaml").read_text())
    spec["shapes"] = spec["shapes"][:2]  # two shapes keep the test short
    (deck / "problem.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    wanted = set(filter(None, os.environ.get("KERNELBOARD_GPU_CASES", "").split(","))) or set(EXPECTED)
    subs = root / "subs"
    for name in ("house", "z_house_after"):
        if name == "house" or name in wanted:
            shutil.copytree(HOUSE, subs / name)
    for name, source in SOURCES.items():
        if name not in wanted:
            continue
        (subs / name).mkdir(parents=True)
        (subs / name / "solution.py").write_text(textwrap.dedent(source))
        (subs / name / "run.yaml").write_text("problem: 03_paged_attention\nmodel: t\nharness: pytest\n"
                                              "agent_outcome: completed\n")
    with pytest.MonkeyPatch.context() as env:  # as the caller had it after (bench/gpu_session.sh may set it)
        env.setenv("KERNELBOARD_GPU_WITNESS", "1")  # the judge's GPU witness (eval/gpu_witness.py), off by default
        rows = run_eval(EvalOptions(deck=root / "deck", submissions=subs, out=root / "out", device="cuda",
                                    timeout_s=300.0, rep_ms=100.0, skip_baselines=("compile:max-autotune",)))
    return root, _Graded({r["run_id"]: r for r in rows})


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_status(graded, name: str) -> None:
    _, rows = graded
    expected = EXPECTED[name] if isinstance(EXPECTED[name], tuple) else (EXPECTED[name],)
    assert rows[name]["status"] in expected, rows[name]["message"]


def test_candidate_code_runs_as_a_uid_of_its_own_and_a_fork_bomb_stops(graded) -> None:
    """Grader 0.5.21 on a root GPU host: the house kernel passes, CUDA and all, as an unprivileged uid, and
    a fork bomb meets RLIMIT_NPROC (the kernel does not apply it to root)."""
    root, rows = graded
    if os.getuid() == 0:
        assert "runs as uid" in rows["house"]["sandbox"], rows["house"]["sandbox"]
    log = (root / "out" / rows["fork_bomb"]["log_path"]).read_text(errors="replace")
    assert "ATTACK fork_bomb: fork refused after" in log, log[-2000:]


def test_a_halved_event_timer_is_caught_by_the_judges_clock(graded) -> None:
    _, rows = graded
    assert "the judge's clock" in rows["event_timer_halved"]["message"]


def test_a_persisting_l2_window_buys_no_speed_over_the_house_kernel(graded) -> None:
    root, rows = graded
    if rows["persisting_l2_window"]["status"] != "pass":
        return
    shapes = load_all(root / "out")["shapes"].to_pylist()
    house = {s["shape_idx"]: s["median_ms"] for s in shapes if s["run_id"] == "house"}
    pinned = {s["shape_idx"]: s["median_ms"] for s in shapes if s["run_id"] == "persisting_l2_window"}
    for idx, ms in pinned.items():
        assert ms >= 0.9 * house[idx], (idx, ms, house[idx])


def test_a_graph_keyed_on_input_pointers_is_timed_at_its_replay_not_its_capture(graded) -> None:
    """The live inputs keep their addresses across timed calls, so such a kernel replays its graph:
    no slower than the house kernel it wraps (re-capturing on every call measured 0.56-0.83x)."""
    root, rows = graded
    assert rows["graph_on_input_pointers"]["status"] == "pass"  # skips where the case was not graded
    shapes = load_all(root / "out")["shapes"].to_pylist()
    house = {s["shape_idx"]: s["median_ms"] for s in shapes if s["run_id"] == "house"}
    graphed = {s["shape_idx"]: s["median_ms"] for s in shapes if s["run_id"] == "graph_on_input_pointers"}
    assert graphed.keys() == house.keys()
    for idx, ms in graphed.items():
        assert ms <= 1.15 * house[idx], (idx, ms, house[idx])


@pytest.mark.parametrize("name", ["side_stream", "reference", "illegal_access", "stale_first_loop",
                                  "value_fingerprint_cache"])
def test_messages_name_the_mechanism(graded, name: str) -> None:
    _, rows = graded
    message = rows[name]["message"]
    if name == "stale_first_loop":
        assert "timed call" in message and "reference's norm away" in message
    elif name == "side_stream":
        assert any(m in message for m in ("escaped the timed stream", "the judge's clock"))
    elif name == "reference":
        assert "no kernel of its own ran" in message
    elif name == "value_fingerprint_cache":
        assert "faster than the" in message and "from a flushed L2" in message
    else:
        assert "illegal memory access" in message.lower() or "CUDA" in message


def test_house_shapes_record_kernels_graph_and_host_times(graded) -> None:
    root, _ = graded
    shapes = [s for s in load_all(root / "out")["shapes"].to_pylist() if s["run_id"] == "house"]
    assert len(shapes) == 2
    for s in shapes:
        assert any("paged" in k for k in s["kernels"]), s["kernels"]
        assert s["host_ms"] > 0
        if s["median_ms"] < 0.2:  # a replay from an idle GPU; the covered median may be below it (0.4.0)
            assert s["graph_ms"] is not None and s["graph_ms"] > 0


def test_work_under_the_cover_is_in_the_figure(graded) -> None:
    """The covered timing: the house kernel is timed covered; a call that waits on the GPU inside
    itself is timed again with the GPU idle before each call; and a call that does host work on every
    call (a 0.1 ms busy-wait) beside side-stream work under the cover's sleep is floored by its least
    dispatch, which holds that work. Under 0.4.0 (the median dispatch as floor) it was timed at
    0.384 ms against 0.390 ms from an idle GPU to a device-wide synchronise, on the H200 of
    2026-12-01; 0.4.1 floors at the least dispatch, 0.4.2 at the least dispatch less one PyTorch
    launch's (a few µs), so the figure holds at least the busy-wait less that."""
    root, rows = graded
    assert rows["under_cover"]["status"] == "pass"  # skips where the case was not graded
    shapes = load_all(root / "out")["shapes"].to_pylist()
    by = {(s["run_id"], s["shape_idx"]): s for s in shapes}
    for (run_id, idx), s in by.items():
        if run_id == "house":
            assert s["timing_method"] == "covered", s
            assert 0 < s["gpu_span_ms"] <= 1.5 * s["median_ms"], s  # the covered loop's span (0.4.8)
        elif run_id == "in_call_sync":
            assert s["timing_method"] == "synchronised", s
            assert s["gpu_span_ms"] is None, s  # its covered loop was given up: no span to report
        elif run_id == "under_cover":
            assert s["median_ms"] >= 0.09, (s["median_ms"], s["host_ms"])  # the busy-wait of every call
            assert s["median_ms"] >= 1.5 * by[("house", idx)]["median_ms"], (s["median_ms"], by[("house", idx)])


def _witness_ratios(root: Path, row: dict) -> dict[int, float | None]:
    """Per shape, the timed median as a fraction of the GPU witness's figure for a call (None: no figure)."""
    log = (root / "out" / row["log_path"]).read_text(errors="replace")
    assert "the GPU witness could not run" not in log, log[-3000:]
    found = re.findall(r"shape (\d+): the judge's clock around \d+ witnessed calls: .*?the timed median is "
                       r"([0-9.]+|—) of it", log)
    return {int(k): None if r == "—" else float(r) for k, r in found}


def test_the_gpu_witness_reads_a_clock_lie_told_in_the_timed_loop_alone(graded) -> None:
    """Grader 0.5.28 (eval/gpu_witness.py): after each shape's timed loop the judge's own stream times 16 calls
    the runner makes on inputs the judge writes into shared device memory. Its figure for a call, beside the
    timed median, is about 1 for the house kernel and about half for the same kernel whose event timer lies in
    the timed loop alone (shape 1, 0.12 ms on an H100; shape 0's 0.024 ms is within the handshake's noise)."""
    root, rows = graded
    honest, lying = _witness_ratios(root, rows["house"]), _witness_ratios(root, rows["selective_clock_lie"])
    print(f"witness ratios by shape: house {honest}, selective_clock_lie {lying}")
    assert set(honest) == set(lying) == {0, 1}, (honest, lying)
    assert honest[1] is not None and lying[1] is not None and lying[1] < 0.75 * honest[1], (honest, lying)
    log = (root / "out" / rows["house"]["log_path"]).read_text(errors="replace")
    assert "a witnessed call's output" not in log, log[-3000:]

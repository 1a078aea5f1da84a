"""Where the house paged-attention kernel's time goes on a GPU: dispatch vs device work.

For each graded shape: the grader's latency (`time_cuda`, host dispatch + GPU), the GPU time
alone (CUDA-graph replay of 50 calls), and the host dispatch cost (200 calls enqueued back to
back, wall time per call). Run on a GPU machine from the repository root:

    python bench/paged_attention_launch.py [SUBMISSION_DIR]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from kernelboard.eval.deck import load_problem
from kernelboard.eval.plan import apply_shape as _apply_shape
from kernelboard.eval.plan import import_file as _import_file
from kernelboard.eval.plan import install_shapes_module as _install_shapes_module
from kernelboard.eval.timing import time_cuda

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "data/submissions/hard/20261129_190000_house_kernelboard-house_03_paged_attention"


def graph_ms(fn, inputs, calls: int = 50) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def dispatch_us(fn, inputs, calls: int = 200) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / calls * 1e6


@torch.no_grad()
def main(submission: Path) -> None:
    problem = load_problem(ROOT / "eval/decks/hard/03_paged_attention")
    reference = _import_file("reference", problem.reference_path)
    _install_shapes_module(problem.shapes)
    sys.path.insert(0, str(submission))
    solution = _import_file("solution", submission / "solution.py")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{'shape':<28} {'latency ms':>10} {'graph ms':>9} {'dispatch us':>11} {'GB/s(graph)':>11}")
    for shape in problem.shapes:
        _apply_shape(reference, problem, shape)
        model = solution.Model(*reference.get_init_inputs()).cuda().eval()
        sets = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            sets.append([x.cuda() for x in reference.get_inputs()])
        stats, _ = time_cuda(model, sets, l2_bytes=l2)
        g = graph_ms(model, sets[0])
        d = dispatch_us(model, sets[0])
        gbs = problem.bytes_moved(shape) / (g * 1e-3) / 1e9
        print(f"{shape.label:<28} {stats.median_ms:>10.4f} {g:>9.4f} {d:>11.1f} {gbs:>11.0f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)

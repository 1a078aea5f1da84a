"""Measured peaks of the machine (worker side): copy bandwidth, bf16 and fp8 GEMM throughput.

Datasheet peaks are leads; these are what the card reaches through PyTorch on random data:
- copy: `y.copy_(x)` of 2 GiB, bytes read plus bytes written over the median time;
- bf16 GEMM: `torch.mm` of 8192×8192×8192 random bf16, 2·M·N·K FLOPs over the median time;
- fp8 GEMM: `torch._scaled_mm` of the same size in e4m3 with unit scales (sm_89 and newer).
Each is the median of 20 event-timed calls after 5 warm-ups. `python -m kernelboard.eval.calibrate`
prints one JSON object; `kernelboard eval calibrate` stores it in the hardware table.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable

import torch

from .probe import probe_environment

_SIZE = 8192
_COPY_BYTES = 2 << 30


def _median_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_gb_s() -> float:
    x = torch.randint(0, 255, (_COPY_BYTES,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * _COPY_BYTES / (_median_ms(lambda: y.copy_(x)) * 1e-3) / 1e9


def measure() -> dict[str, object]:
    copy_gb_s = _copy_gb_s()
    a = torch.randn(_SIZE, _SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(_SIZE, _SIZE, device="cuda", dtype=torch.bfloat16)
    flops = 2 * _SIZE**3
    bf16 = flops / (_median_ms(lambda: torch.mm(a, b)) * 1e-3) / 1e12
    fp8 = None
    if torch.cuda.get_device_capability() >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda", dtype=torch.float32)
        fp8 = flops / (_median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
                       * 1e-3) / 1e12
    return {"env": probe_environment("cuda"), "measured_copy_gb_s": copy_gb_s,
            "measured_bf16_tflop_s": bf16, "measured_fp8_tflop_s": fp8}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        sys.exit(1)
    print(json.dumps(measure()))

"""Where a call from an idle GPU spends its time on this host: the fact behind the hidden-work check's allowance.

Why: `audit.cover_hid_work` holds a call from an idle GPU to a device-wide synchronise (less the synchronises'
own latency around no call) to its covered GPU span plus its dispatch. On 2026-12-07 an H200 host read two
shapes over that allowance twice (claude-opus-4-8 07 034935 shape 1: 0.19–0.22 ms past the synchronises
against 0.17 ms allowed, with a covered span of 0.040 ms and a dispatch of 0.080 ms) that an H100 SXM host
read well inside it (0.106 ms), and the GPU witness saw 0.045 ms a call over 16 consecutive calls. Either the
GPU does the work slower from idle (its clocks or power state), or this host takes longer to reach an idle
GPU and hear back from it (a KVM guest's doorbells and interrupts). This measures each piece, with torch
alone and no candidate code:

- the two synchronises around no call (the judge's `idle_ms`), and one synchronise alone;
- a one-element kernel: its dispatch while the GPU is busy, and from idle to its synchronise;
- a ~30 µs bf16 matmul and a ~30 µs copy, their GPU time by CUDA events when warm (back to back) and when
  launched from an idle GPU after a host-side gap of 0, 0.2, 2 and 20 ms (an event span that grows with the
  gap is the GPU doing the work slower; a host time that grows while the event span does not is the host);
- the SM clock nvidia-smi reports before and after (when nvidia-smi is there).

One line a figure, each starting "idle latency:", so `gpu_session.sh` keeps them in a call's output; `--json`
writes them all. About 5 s on an H200.

    python3 bench/idle_latency.py --json idle.json
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

GAPS_MS = (0.0, 0.2, 2.0, 20.0)


def _us(samples: list[float]) -> float:
    """Median of seconds, in µs."""
    return statistics.median(samples) * 1e6


def _spin(seconds: float) -> None:
    """Wait on the host without sleeping: a sleep's own wake-up would add to the gap."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sm_clock() -> str | None:
    """nvidia-smi's SM clock and its maximum, or None where nvidia-smi is not on PATH."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def measure(torch: Any, samples: int) -> dict[str, Any]:
    """Every figure, in µs (medians over `samples`), keyed as `describe` names them."""
    cuda = torch.cuda
    one = torch.zeros(1, device="cuda")
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(32 * 2**20, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    work: dict[str, Callable[[], Any]] = {"matmul": lambda: a @ b, "copy": lambda: dst.copy_(src)}
    for fn in (*work.values(), lambda: one.add_(1)):  # first calls: cuBLAS handles, workspaces, modules
        for _ in range(20):
            fn()
    cuda.synchronize()
    out: dict[str, Any] = {"device": cuda.get_device_name(), "sm_clock_before": _sm_clock()}

    idle2, idle1, tiny_idle, tiny_dispatch = [], [], [], []
    for _ in range(samples):
        cuda.synchronize()
        t0 = time.perf_counter()
        done = cuda.Event()
        done.record()
        done.synchronize()
        cuda.synchronize()
        idle2.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cuda.synchronize()
        idle1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        one.add_(1)
        cuda.synchronize()
        tiny_idle.append(time.perf_counter() - t0)
        cuda._sleep(2_000_000)  # the GPU busy, so the launch below is queued, not run
        t0 = time.perf_counter()
        one.add_(1)
        tiny_dispatch.append(time.perf_counter() - t0)
        cuda.synchronize()
    out |= {"two_synchronises_us": _us(idle2), "one_synchronise_us": _us(idle1),
            "tiny_from_idle_us": _us(tiny_idle), "tiny_dispatch_us": _us(tiny_dispatch)}

    for name, fn in work.items():
        pairs = [(cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)) for _ in range(samples)]
        cuda.synchronize()
        cuda._sleep(5_000_000)  # the launches below queue behind it: warm means back to back, never idle
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        cuda.synchronize()
        out[f"{name}_warm_us"] = _us([s.elapsed_time(e) / 1e3 for s, e in pairs])
        start, end = pairs[0]
        for gap in GAPS_MS:
            events, host = [], []
            for _ in range(samples if gap < 20 else max(10, samples // 10)):
                cuda.synchronize()
                _spin(gap / 1e3)
                t0 = time.perf_counter()
                start.record()
                fn()
                end.record()
                cuda.synchronize()
                host.append(time.perf_counter() - t0)
                events.append(start.elapsed_time(end) / 1e3)
            out[f"{name}_idle_{gap:g}ms_events_us"] = _us(events)
            out[f"{name}_idle_{gap:g}ms_host_us"] = _us(host)
    out["sm_clock_after"] = _sm_clock()
    return out


def describe(m: dict[str, Any]) -> list[str]:
    """The figures as the lines a call's output keeps."""
    lines = [f"idle latency: {m['device']}; SM clock (now, max) {m['sm_clock_before'] or '?'} before, "
             f"{m['sm_clock_after'] or '?'} after",
             f"idle latency: the judge's two synchronises around no call {m['two_synchronises_us']:.1f} µs, "
             f"one synchronise {m['one_synchronise_us']:.1f} µs",
             f"idle latency: a one-element kernel: dispatched in {m['tiny_dispatch_us']:.1f} µs while the GPU is "
             f"busy, {m['tiny_from_idle_us']:.1f} µs from an idle GPU to its synchronise"]
    for name in ("matmul", "copy"):
        gaps = ", ".join(f"{g:g} ms {m[f'{name}_idle_{g:g}ms_events_us']:.1f} µs "
                         f"({m[f'{name}_idle_{g:g}ms_host_us']:.1f} µs to the synchronise)" for g in GAPS_MS)
        lines.append(f"idle latency: {name} {m[f'{name}_warm_us']:.1f} µs warm (events, back to back); from an idle "
                     f"GPU after a gap of {gaps}")
    return lines


@click.command()
@click.option("--samples", default=200, show_default=True, help="Calls per figure (a tenth after a 20 ms gap).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write every figure here.")
def main(samples: int, json_path: Path | None) -> None:
    try:
        import torch
    except ImportError:
        sys.exit("idle_latency.py: needs torch (the grader's .venv-eval)")
    if not torch.cuda.is_available():
        sys.exit("idle_latency.py: needs a CUDA GPU; this machine has none")
    figures = measure(torch, samples)
    for line in describe(figures):
        click.echo(line)
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

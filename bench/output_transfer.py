"""How fast a call's output reaches the judge: through the output area (shared memory the runner lays
its outputs in, grader 0.5.16) against the socket frames every output crossed before, in the same run.

A forked runner answers `--calls` "call" requests, each with one bf16 output of `--mb` MB made on
`--device` (on cuda the area is page-locked, as the runner's is), through the grader's own code on
both sides: `encode_output` there, `RunnerLink.ask(...).outputs(...)` here, which returns the judge's
private CPU copy. Printed: seconds per output and GB/s each way, and the ratio socket / area.

    python bench/output_transfer.py [--mb 800] [--calls 8] [--device cuda]

06's headline output is 0.8 GB, and a grading reads 16 of them at that shape alone.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch

from kernelboard.eval.link import RunnerLink
from kernelboard.eval.protocol import Channel, OutputArea, OutputSlots, encode_output, map_arena, pin_host


class _Runner:
    """Stands for the runner's process, which this script forks and waits for itself."""

    pid = None
    exitcode = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


class _NoBudget:
    phase = "bench"

    def deadline(self) -> tuple[float, str]:
        return time.monotonic() + 3600.0, "the benchmark ran past an hour"


def _serve(sock: socket.socket, output: torch.Tensor, area_fd: int | None, area_size: int, calls: int) -> None:
    chan = Channel(sock)
    base = map_arena(area_fd, area_size) if area_fd is not None else None
    if base is not None and output.is_cuda:
        pin_host(base)
    for _ in range(calls):
        if chan.recv_request() is None:
            return
        meta, blobs = encode_output(output, OutputSlots(base) if base is not None else None)
        chan.send_reply({"ok": True, "outputs": [meta]}, blobs)


def measure(mb: int, calls: int, device: str, shared: bool) -> float:
    """Seconds per output read, over `calls` calls."""
    numel = mb * 10**6 // 2
    ref = torch.empty(numel, dtype=torch.bfloat16)
    area = OutputArea(numel * 2) if shared else None
    judge_end, runner_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the runner: its output made once, on the device, before it serves
        judge_end.close()
        torch.set_num_threads(1)  # a forked child cannot use the parent's OpenMP pool: it would hang
        output = torch.randn(numel, device=device).to(torch.bfloat16)
        _serve(runner_end, output, os.dup(area.fd) if area else None, area.size if area else 0, calls)
        os._exit(0)
    runner_end.close()
    link = RunnerLink(_Runner(), judge_end, _NoBudget())  # type: ignore[arg-type]
    link.outputs_area = area
    try:
        link.ask("call", "warm-up").outputs([ref])
        start = time.perf_counter()
        for i in range(calls - 1):
            got = link.ask("call", f"call {i}").outputs([ref])[0]
            assert got.tensor is not None and got.tensor.numel() == numel, got.problem
        return (time.perf_counter() - start) / (calls - 1)
    finally:
        link.close()
        os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="one output's size (MB)")
    parser.add_argument("--calls", type=int, default=6, help="calls per way, the first a warm-up")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    socket_s = measure(args.mb, args.calls, args.device, shared=False)
    area_s = measure(args.mb, args.calls, args.device, shared=True)
    for name, s in (("socket frames", socket_s), ("output area", area_s)):
        print(f"{name:>13}: {s:.3f} s per {args.mb} MB output ({args.mb / 1e3 / s:.2f} GB/s), {args.device}")
    print(f"socket / area: {socket_s / area_s:.2f}x")


if __name__ == "__main__":
    main()

"""Can the judge time a call that a sandboxed runner makes, from its own process? An experiment (needs a GPU).

Why: every figure the grader takes today comes from CUDA events recorded in the runner's process, which the
candidate's code shares, so a lie told only inside the timed loop is bounded by `scoring.beyond_hardware`
alone (the strict xfails in tests/test_redteam_timing.py). A span the judge records on its own stream cannot be
forged there. This measures whether such a span can be had, and at what cost:

1. legacy CUDA IPC event handles (`torch.cuda.Event(interprocess=True)`) across the sandbox, which has its own
   PID namespace (the driver is said to refuse them across namespaces: this records what it does);
2. a handshake through device memory the judge allocates (`cuMemCreate`, exported as a POSIX file descriptor,
   which crosses any namespace as an inherited fd): the judge's stream writes the call's inputs, records its
   start event and writes a `ready` word; the runner's stream waits on `ready` (`cuStreamWaitValue32`), makes
   the call and writes `done`; the judge's stream waits on `done`, records its end event and copies the output.
   Inputs written on the judge's stream cannot be read before `ready`, and an output the judge copies before it
   is whole is wrong, so such a span bounds the call from below whatever the runner's code does;
3. per matmul size, the median of three clocks over the same calls: the judge's own events around the same
   matmul in its own process (the truth), the runner's events around its call (today's method), and the
   judge's cross-process span; their difference at a null call is the handshake's own cost;
4. an "early done" runner that writes `done` before its matmul: how often the judge's copy is then wrong;
5. the handshake shaped as the grader's timed loop would use it (`grader_loop`): per call the runner refills
   its inputs, flushes the L2, synchronises and sleeps (the cover), then its stream writes `arrived` and waits on
   `ready`, records its events around the matmul and writes `done`, and its host tells the judge the call is
   queued; only then does the judge queue its side (wait on `arrived`, start event, `ready`, wait on `done`, end
   event), so the judge's span starts when the runner's stream reaches the call, not when the judge's host
   queued. Rows: a null call, four sizes, and a runner that reports half its events' time (a lying clock),
   with the rule's figure: the median over calls of the runner's sample / (the judge's span − the null's median).

    python bench/cross_process_timing.py                 # sandboxed as the grader sandboxes (bubblewrap)
    python bench/cross_process_timing.py --unsandboxed   # the same processes without a sandbox

Needs the grader installed (`kernelboard.eval.jail` starts the sandboxed runner) and bwrap on PATH. Figures
measured on an H100 are in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (0, 256, 1024, 2048, 4096)  # 0: a null call (the handshake alone)
CALLS = 100
FLAG_BYTES = 256  # the words the two streams wait on, then the matrices
READY, DONE, ARRIVED = 0, 4, 8  # the offsets of the judge's word and the runner's two
L2_FLUSH_BYTES = 100 << 20  # more than twice an H100's or H200's L2, zeroed before each grader-loop call
COVER_CYCLES = 100_000  # the grader-loop cover: torch.cuda._sleep cycles (~60 µs)
POOL = 3  # input sets the judge rotates, as a Feed does

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernelboard.eval.cuda_driver import Driver, bytes_at  # noqa: E402  (the grader's own driver calls)


def tensor_at(address: int, shape: tuple[int, ...], torch_dtype: object) -> object:
    """A torch view of device memory this process mapped itself (no allocator owns it)."""
    return bytes_at(address, math.prod(shape) * torch_dtype.itemsize).view(torch_dtype).view(shape)


def allocation_bytes(size: int) -> int:
    """The shared allocation's bytes for matrices of `size`²: the flags, then A, B and C in bf16."""
    return FLAG_BYTES + 3 * size * size * 2


def matrices(base: int, size: int) -> tuple[object, object, object] | tuple[None, None, None]:
    """A, B and C of `size`² bf16 in the shared allocation at `base` (None for a null call, size 0)."""
    import torch

    if not size:
        return None, None, None
    a, b, c = (tensor_at(base + FLAG_BYTES + k * size * size * 2, (size, size), torch.bfloat16) for k in range(3))
    return a, b, c


def median_us(samples_ms: list[float]) -> float:
    return statistics.median(samples_ms) * 1000


def spread(samples_ms: list[float]) -> float:
    q = statistics.quantiles(samples_ms, n=10)
    return (q[-1] - q[0]) / statistics.median(samples_ms)


# ---- the runner: a child process, sandboxed as the grader's runner is ----

def runner(args: argparse.Namespace) -> None:
    """Map the judge's allocation, then for each line the judge sends ("size early seq0"), queue CALLS calls that
    each wait on `ready`, matmul and write `done`, timing each with its own events as today's runner does."""
    import torch

    torch.cuda.init()
    driver = Driver()
    device = torch.cuda.current_device()
    report = {"pid": os.getpid(), "uid": os.getuid()}
    try:  # 1. a legacy IPC event handle from the judge, across the PID namespace
        torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(args.event_handle)).query()
        report["ipc_event"] = "opened"
    except Exception as error:  # the experiment records what the driver says
        report["ipc_event"] = f"refused: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    try:
        base = driver.map(driver.import_fd(args.fd), args.bytes, device)
    except RuntimeError as error:
        print(json.dumps({**report, "import": str(error)}), flush=True)
        return
    print(json.dumps({**report, "import": "mapped"}), flush=True)
    stream = torch.cuda.Stream()
    for line in sys.stdin:
        if line.startswith("loop "):
            grader_loop_runner(driver, base, *map(int, line.split()[1:]))
            continue
        size, early, seq = map(int, line.split())
        a, b, c = matrices(base, size)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
        with torch.cuda.stream(stream):
            for i in range(CALLS):
                driver.wait(stream.cuda_stream, base + READY, seq + i)
                starts[i].record()
                if early:
                    driver.write(stream.cuda_stream, base + DONE, seq + i)
                if size:
                    torch.matmul(a, b, out=c)
                ends[i].record()
                if not early:
                    driver.write(stream.cuda_stream, base + DONE, seq + i)
        print("queued", flush=True)
        stream.synchronize()
        print(json.dumps([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]), flush=True)


def grader_loop_runner(driver: Driver, base: int, size: int, lie: int, seq: int) -> None:
    """CALLS calls as the grader's covered timed loop makes them, each inside the handshake (module docstring,
    5), on the current stream as the grader's are; then its samples, halved where it `lie`s."""
    import torch

    a, b, c = matrices(base, size)
    pool = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2 * POOL * bool(size))]
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    for i in range(CALLS):
        if size:
            a.copy_(pool[i % POOL])
            b.copy_(pool[POOL + i % POOL])
        flush.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(COVER_CYCLES)
        driver.write(stream, base + ARRIVED, seq + i)
        driver.wait(stream, base + READY, seq + i)
        starts[i].record()
        if size:
            torch.matmul(a, b, out=c)
        ends[i].record()
        driver.write(stream, base + DONE, seq + i)
        print(f"q {seq + i}", flush=True)
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) / (2 if lie else 1) for s, e in zip(starts, ends, strict=True)]
    print(json.dumps(samples), flush=True)


# ---- the judge ----

def finish(args: argparse.Namespace, child: subprocess.Popen[str], flags: object, starts: list, ends: list,
           seq: int, what: str, t0: float) -> tuple[list[float], list[float]]:
    """Wait for a row's last handshake (a stall past --stall-s releases the judge's waits from another
    stream and raises, never hangs), then (the runner's samples, the judge's spans) in ms."""
    import torch

    while not ends[-1].query():
        if time.monotonic() - t0 > args.stall_s:
            flags[DONE // 4].fill_(seq + CALLS)
            raise RuntimeError(f"stalled: {what}")
        time.sleep(0.001)
    torch.cuda.synchronize()
    runner_ms = json.loads(child.stdout.readline())
    return runner_ms, [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def grader_loop(args: argparse.Namespace, child: subprocess.Popen[str], driver: Driver, base: int, stream: object,
                size: int, lie: int, seq: int) -> tuple[list[float], list[float]]:
    """One grader-shaped row (module docstring, 5): the runner's samples and the judge's spans, per call."""
    import torch

    flags = tensor_at(base, (FLAG_BYTES // 4,), torch.int32)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    t0 = time.monotonic()
    child.stdin.write(f"loop {size} {lie} {seq}\n")
    child.stdin.flush()
    for i in range(CALLS):
        if child.stdout.readline().strip() != f"q {seq + i}":
            flags[DONE // 4].fill_(seq + CALLS)
            raise RuntimeError(f"the runner stopped before queueing call {i} (size {size})")
        with torch.cuda.stream(stream):
            driver.wait(stream.cuda_stream, base + ARRIVED, seq + i)
            starts[i].record()
            driver.write(stream.cuda_stream, base + READY, seq + i)
            driver.wait(stream.cuda_stream, base + DONE, seq + i)
            ends[i].record()
    return finish(args, child, flags, starts, ends, seq, f"grader loop, size {size}", t0)


def grader_loop_rows(args: argparse.Namespace, child: subprocess.Popen[str], driver: Driver, base: int,
                     stream: object, seq: int) -> list[dict[str, object]]:
    """The null call, then each size honest, then the two largest with a lying clock; each row with the rule's
    ratio against the null's median span."""
    rows: list[dict[str, object]] = []
    null_ms = 0.0
    for n, (size, lie) in enumerate([(s, 0) for s in SIZES] + [(2048, 1), (max(SIZES), 1)]):
        runner_ms, judge_ms = grader_loop(args, child, driver, base, stream, size, lie, seq + n * CALLS)
        if not size:
            null_ms = statistics.median(judge_ms)
        ratio = statistics.median(r / max(j - null_ms, 1e-9) for r, j in zip(runner_ms, judge_ms, strict=True))
        rows.append({"size": size, "lying_clock": bool(lie), "calls": CALLS, "judge_us": median_us(judge_ms),
                     "judge_spread": spread(judge_ms), "runner_us": median_us(runner_ms),
                     "runner_spread": spread(runner_ms), "judge_less_null_us": median_us(judge_ms) - null_ms * 1000,
                     "ratio": ratio if size else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure(args: argparse.Namespace, child: subprocess.Popen[str], driver: Driver, base: int, stream: object,
            size: int, early: int, seq: int) -> dict[str, object]:
    """One row: CALLS handshakes of the runner's matmul of `size`² (numbered from `seq`), the judge's span of
    each, the runner's own events, the same matmul timed in the judge's process, and the copies it checks."""
    import torch

    flags = tensor_at(base, (FLAG_BYTES // 4,), torch.int32)
    pool = [torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2 * POOL * bool(size))]
    a, b, c = matrices(base, size)
    truth = []  # the same matmul on the judge's own tensors, its own events: the call's real time
    if size:
        own = torch.empty_like(pool[0])
        for i in range(CALLS):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.matmul(pool[i % POOL], pool[POOL + i % POOL], out=own)
            e.record()
            truth.append((s, e))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    copies = [torch.empty_like(pool[0]) for _ in range(CALLS)] if size else []
    t0 = time.monotonic()  # the runner queues first: a stream takes ~1k pending operations, then its host waits
    child.stdin.write(f"{size} {early} {seq}\n")
    child.stdin.flush()
    stream.wait_stream(torch.cuda.current_stream())  # the pool and the copies are the default stream's
    with torch.cuda.stream(stream):
        for i in range(CALLS):
            if size:
                a.copy_(pool[i % POOL])
                b.copy_(pool[POOL + i % POOL])
            starts[i].record()
            driver.write(stream.cuda_stream, base + READY, seq + i)
            driver.wait(stream.cuda_stream, base + DONE, seq + i)
            ends[i].record()
            if size:
                copies[i].copy_(c)
    if child.stdout.readline().strip() != "queued":
        raise RuntimeError("the runner stopped before queueing its calls")
    runner_ms, judge_ms = finish(args, child, flags, starts, ends, seq, f"size {size}, early {early}", t0)
    row: dict[str, object] = {"size": size, "early_done": bool(early), "calls": CALLS,
                              "judge_us": median_us(judge_ms), "judge_spread": spread(judge_ms),
                              "runner_us": median_us(runner_ms), "runner_spread": spread(runner_ms)}
    if size:
        truth_ms = [s.elapsed_time(e) for s, e in truth]
        row |= {"truth_us": median_us(truth_ms), "truth_spread": spread(truth_ms)}
        row["copies_wrong"] = sum(
            not torch.allclose(copy.float(), torch.matmul(pool[i % POOL], pool[POOL + i % POOL]).float(),
                               rtol=2e-2, atol=2e-2) for i, copy in enumerate(copies))
    return row


def judge(args: argparse.Namespace) -> dict[str, object]:
    import torch

    torch.manual_seed(0)
    device = torch.cuda.current_device()
    driver = Driver()
    size_bytes = driver.granular(allocation_bytes(max(SIZES)), device)
    handle, fd = driver.create_exported(size_bytes, device)
    base = driver.map(handle, size_bytes, device)
    tensor_at(base, (FLAG_BYTES // 4,), torch.int32).zero_()
    event = torch.cuda.Event(interprocess=True)
    event.record()
    torch.cuda.synchronize()
    command = [sys.executable, str(Path(__file__).resolve()), "--runner", "--fd", str(fd), "--bytes", str(size_bytes),
               "--event-handle", event.ipc_handle().hex()]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if args.unsandboxed:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                 pass_fds=(fd,))
        sandbox, confined = "none", None
    else:
        from kernelboard.eval.jail import make_jail, start

        jail = make_jail(sandboxed=True, device="cuda", hide=[])
        scratch = Path(args.work)
        scratch.mkdir(parents=True, exist_ok=True)
        confined = start(jail, command, writable=[scratch], cwd=scratch, env=env, device="cuda",
                         owner="cross-process-timing", readable=[Path(__file__).resolve().parent],
                         pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        child, sandbox = confined.proc, confined.description
    try:  # the runner goes with the judge, whatever ends it (unsandboxed, nothing else would stop it)
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the runner ended before it reported (exit {child.wait(timeout=30)})")
        hello = json.loads(line)
        result: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "sandbox": sandbox, "runner": hello, "sizes": []}
        print(json.dumps(hello), flush=True)
        if hello.get("import") != "mapped":
            child.kill()
            return result
        stream = torch.cuda.Stream()
        rows = [(s, 0) for s in SIZES] + [(max(SIZES), 1), (1024, 1)]
        for n, (size, early) in enumerate(rows):
            row = measure(args, child, driver, base, stream, size, early, 1 + n * CALLS)
            result["sizes"].append(row)
            print(json.dumps(row), flush=True)
        result["grader_loop"] = grader_loop_rows(args, child, driver, base, stream, 1 + len(rows) * CALLS)
        child.stdin.close()
        child.wait(timeout=30)
        return result
    finally:
        if child.poll() is None:
            child.kill()
        if confined is not None:
            confined.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unsandboxed", action="store_true")
    parser.add_argument("--work", default="/tmp/kb-cross-process", help="the runner's scratch folder")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--stall-s", type=float, default=15.0)
    parser.add_argument("--runner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--event-handle", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner:
        runner(args)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("cross_process_timing: needs a CUDA GPU, and torch sees none")
    result = judge(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for row in result["sizes"]:
        print(f"{row['size']:>5}{' early' if row['early_done'] else '      '}  judge {row['judge_us']:9.1f} us"
              f" ({row['judge_spread']:.1%})  runner {row['runner_us']:9.1f} us"
              + (f"  truth {row['truth_us']:9.1f} us  copies wrong {row['copies_wrong']}/{CALLS}"
                 if "truth_us" in row else ""))
    for row in result.get("grader_loop", []):
        print(f"loop {row['size']:>5}{' lying' if row['lying_clock'] else '      '}  judge {row['judge_us']:9.1f} us"
              f" ({row['judge_spread']:.1%}), less the null {row['judge_less_null_us']:9.1f} us  runner"
              f" {row['runner_us']:9.1f} us" + ("" if row["ratio"] is None else f"  ratio {row['ratio']:.2f}"))


if __name__ == "__main__":
    main()

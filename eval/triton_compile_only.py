"""Triton launches as compiles only, with no GPU: what lets the prebuild's warm call (prebuild.py) compile
a solution's Triton kernels on the CPU, into the cache the grading worker reads, instead of on the GPU's time.

A Triton kernel compiles on its first launch, keyed by its source, the target (backend, arch, warp size),
its options and its arguments' specialisation (dtypes; pointer alignment to 16 bytes; integers equal to 1
or divisible by 16), and lands in TRITON_CACHE_DIR, which the prebuild shares with the worker. Inside
`compile_only`:

- the active Triton driver is a compile-only one, whose target is the grading GPU's
  (`GPUTarget("cuda", 90, 32)` for the H200, as Triton's own CUDA driver reports it there);
- every `JITFunction.run` is a warmup: it compiles (or finds in the cache) and launches nothing;
- an autotuner "benchmarks" each config by compiling it, never writes its choice to disk (the worker
  must time the configs itself: a choice made on fake timings would slow a solution down), and so
  compiles every config the worker will time.

A meta tensor's `data_ptr()` is its storage offset in bytes (base 0): aligned exactly as a view of a
caching-allocator block (512-byte aligned) on the GPU, so the specialisation, and the cache key, match.
Where they do not (a constexpr read from the device's properties, a kernel past the first read of data),
the worker compiles as it would have: nothing here changes a verdict, only where the time is spent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any


@dataclasses.dataclass
class Compiled:
    """What a warm call's launches came to: `variants`, the kernel variants (one per specialisation) first
    launched here, each compiled (or, where an earlier prebuild of the same solution compiled it, read from
    the disk cache); `repeats`, launches of a variant already launched; the seconds of all of them; the
    launches that raised (a compile error, an argument Triton cannot take)."""

    variants: int = 0
    repeats: int = 0
    seconds: float = 0.0
    failed: list[str] = dataclasses.field(default_factory=list)

    #: `summary()` as read back from a log: (variants, seconds).
    SUMMARY = re.compile(r"(\d+) Triton kernel variants compiled in ([\d.]+) s")

    def summary(self) -> str:
        failed = f", {len(self.failed)} failed ({self.failed[0]})" if self.failed else ""
        return (f"{self.variants} Triton kernel variants compiled in {self.seconds:.1f} s, "
                f"{self.repeats} launched again{failed}")


def compile_only(capability: tuple[int, int]) -> contextlib.AbstractContextManager[Compiled | None]:
    """Within it, Triton launches compile for `capability` and do nothing else; yields the count of what
    they compiled, or None where Triton is absent or too unlike 3.x (no `warmup` in `JITFunction.run`)."""
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return contextlib.nullcontext(None)
    if "warmup" not in inspect.signature(JITFunction.run).parameters:
        return contextlib.nullcontext(None)
    return _compile_only(capability, JITFunction, Autotuner)


@contextlib.contextmanager
def _compile_only(capability: tuple[int, int], jit_function: Any, autotuner: Any) -> Iterator[Compiled]:
    from triton.runtime.driver import driver

    compiled = Compiled()
    run, check_disk_cache, do_bench = jit_function.run, autotuner.check_disk_cache, autotuner.__dict__["do_bench"]

    def compile_run(self: Any, *args: Any, grid: Any = None, warmup: bool = False, **kwargs: Any) -> Any:
        device = 0
        before = len(self.device_caches[device][0]) if device in self.device_caches else 0
        start = time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:
            said = str(exc).strip().splitlines()
            compiled.failed.append(f"{getattr(self, '__name__', '?')}: {type(exc).__name__}"
                                   + (f": {said[-1][:160]}" if said else ""))
            raise
        finally:
            compiled.seconds += time.perf_counter() - start
        if len(self.device_caches[device][0]) > before:
            compiled.variants += 1
        else:
            compiled.repeats += 1
        return kernel

    def bench_without_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Callable[[], None]) -> bool:
        bench_fn()
        return False

    driver.set_active(_compile_only_driver(capability))
    jit_function.run = compile_run
    autotuner.check_disk_cache = bench_without_disk_cache
    autotuner.do_bench = property(lambda self: compile_once)
    try:
        yield compiled
    finally:
        jit_function.run, autotuner.check_disk_cache = run, check_disk_cache
        autotuner.do_bench = do_bench
        _restore_driver(driver)


def compile_once(kernel_call: Callable[[], None], quantiles: Sequence[float] = (0.5,), **_: Any) -> list[float]:
    """An autotuner's benchmark, compile-only: the call compiles its config; every config times 1 ms, so
    the autotuner's choice (kept in memory only) is its first config."""
    kernel_call()
    return [1.0] * len(quantiles)


def _restore_driver(driver: Any) -> None:
    """Give Triton's own driver back where it exists (a CUDA process); else leave none active, so that
    Triton looks for one again on its next use, as it would have (`reset_active` would look now, and fail)."""
    if getattr(driver, "_default", None) is not None:
        driver.reset_active()
    else:
        driver._active = None


def _compile_only_driver(capability: tuple[int, int]) -> Any:
    """Triton's view of a GPU that is not there: its target, device 0, stream 0, no launcher."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class CompileOnlyDriver(DriverBase):
        def __init__(self) -> None:
            super().__init__()
            self.target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

        @classmethod
        def is_active(cls) -> bool:
            return False  # never picked by Triton itself; set active by compile_only alone

        def map_python_to_cpp_type(self, ty: str) -> str:
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_current_target(self) -> Any:
            return self.target

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("meta")

        def get_benchmarker(self) -> Callable[..., list[float]]:
            return compile_once

    return CompileOnlyDriver()

"""Triton's interpreter (TRITON_INTERPRET=1: how a CPU grading runs a Triton kernel) made to compute what a GPU does.

Triton 3.6's interpreter holds bf16 values as uint16 and its `tl.dot` multiplies those bit patterns as integers:
`InterpreterBuilder.create_dot` widens fp8 operands only. So a correct kernel with a bf16 `tl.dot`, the usual
kind, returned garbage on the CPU and a CPU grading called it `wrong` (2026-12-06: a kernel that passes the
reference's output through a bf16 dot with the identity got ‖d‖/‖ref‖ = 1.9e9). A GPU's tensor cores multiply
bf16 exactly and accumulate in fp32; widening both operands to fp32 before the product gives the same.

The runner installs this before it imports a solution, when it interprets (`runner.serve`), and
bench/triton_bounds.py for its run. Only the interpreter's own arithmetic changes: nothing on a GPU does.

`check_memory` checks every address a load, store or atomic touches against the storage of each tensor the
launch was given (the allocation a GPU faults outside of), counts and names a lane outside, and masks it off,
so the interpreter never reads or writes memory the kernel was not given (where a GPU faults, or reads
another tensor's values). bench/triton_bounds.py tallies a whole run with it; a CPU grading's runner says in
the log the first time each kernel reaches outside (`runner.serve`), a finding on the kernel, not a verdict.
A CPU grading's inputs are views of one shared arena, so a lane past one input but inside the arena is not
caught there; a GPU grading copies each input to an allocation of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Set on the builder's create_dot once widened, so a second install is a no-op.
_WIDENED = "_kernelboard_widens_bf16"
#: Out-of-bounds lanes kept as examples, per kernel.
EXAMPLES = 3


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _interpreter() -> Any:
    """Triton's interpreter module, or None without Triton."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter


def widen_bf16_dots() -> Callable[[], None]:
    """Widen bf16 `tl.dot` operands to fp32 in the interpreter (see the module docstring); returns what undoes
    it. Without Triton, or already widened, it does nothing."""
    interp = _interpreter()
    if interp is None or getattr(interp.InterpreterBuilder.create_dot, _WIDENED, False):
        return lambda: None
    saved = interp.InterpreterBuilder.create_dot

    def widened(handle: Any) -> Any:
        if handle.dtype.scalar != interp.tl.bfloat16:
            return handle
        data = interp._convert_float(handle.data, interp.tl.bfloat16, interp.tl.float32, None).view("float32")
        return interp.TensorHandle(data, interp.tl.float32)

    def create_dot(self: Any, a: Any, b: Any, *rest: Any) -> Any:
        return saved(self, widened(a), widened(b), *rest)

    setattr(create_dot, _WIDENED, True)
    interp.InterpreterBuilder.create_dot = create_dot

    def undo() -> None:
        interp.InterpreterBuilder.create_dot = saved

    return undo


@dataclass
class Region:
    """One tensor argument's storage in a launch: [start, end) in host bytes."""

    name: str
    start: int
    end: int


@dataclass
class KernelTally:
    """What one kernel's launches touched."""

    launches: int = 0
    programs: int = 0
    accesses: int = 0  # lanes checked (masked-off lanes are not accesses)
    outside: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass
class Bounds:
    """The tally of a run, by kernel, and the launch under way (its name, program and memory)."""

    kernels: dict[str, KernelTally] = field(default_factory=dict)
    kernel: str = ""
    regions: list[Region] = field(default_factory=list)
    #: Called with (kernel, its first lane outside) the first time a kernel reaches outside its tensors.
    on_outside: Callable[[str, str], None] | None = None

    def check(self, op: str, addresses: np.ndarray, mask: np.ndarray, itemsize: int, program: tuple) -> np.ndarray:
        """Count the unmasked lanes of one access, and return the mask with every lane outside the launch's
        memory turned off (so the interpreter never reads or writes there)."""
        tally = self.kernels[self.kernel]
        active = np.broadcast_to(mask, addresses.shape).astype(bool)
        flat = addresses.astype(np.int64)
        inside = np.zeros(addresses.shape, dtype=bool)
        for region in self.regions:
            inside |= (flat >= region.start) & (flat + itemsize <= region.end)
        bad = active & ~inside
        tally.accesses += int(active.sum())
        if not bad.any():
            return mask
        first = tally.outside == 0
        tally.outside += int(bad.sum())
        for address in flat[bad][: max(0, EXAMPLES - len(tally.examples))]:
            tally.examples.append(f"{op} of {itemsize} B by program {program}: {self._where(int(address))}")
        if first and self.on_outside is not None:
            self.on_outside(self.kernel, tally.examples[0])
        return active & ~bad

    def _where(self, address: int) -> str:
        """The argument nearest an address outside every one, and the address as a byte of it."""
        def gap(region: Region) -> int:
            return region.start - address if address < region.start else address - region.end + 1

        if not self.regions:
            return f"address {address:#x}, and the launch was given no tensor"
        region = min(self.regions, key=gap)
        return f"byte {address - region.start:,} of {region.name}, which has {region.end - region.start:,} B"


def check_memory(bounds: Bounds) -> Callable[[], None]:
    """Check every address the interpreter's loads, stores and atomics touch against the storage of the tensors
    its launch was given, into `bounds` (a lane outside is counted, named and masked off); returns what undoes it.
    Without Triton it does nothing."""
    import torch

    interp = _interpreter()
    if interp is None:
        return lambda: None
    builder_class, executor = interp.InterpreterBuilder, interp.GridExecutor
    saved = {name: getattr(builder_class, name) for name in
             ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    saved_call, saved_args = executor.__call__, executor._init_args_hst

    def inside(builder: Any, op: str, ptrs: Any, mask: np.ndarray) -> Any:
        """`mask` with the lanes outside the launch's tensors turned off, as the builder's mask handle."""
        itemsize = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        program = tuple(int(i) for i in (builder.grid_idx or ()))
        return interp.TensorHandle(bounds.check(op, ptrs.data, mask, itemsize, program), interp.tl.int1)

    def load(self: Any, ptrs: Any, mask: Any, other: Any, *rest: Any) -> Any:
        return saved["create_masked_load"](self, ptrs, inside(self, "load", ptrs, mask.data), other, *rest)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
        return saved["create_masked_store"](self, ptrs, value, inside(self, "store", ptrs, mask.data), *rest)

    def atomic_rmw(self: Any, op: Any, ptr: Any, val: Any, mask: Any, *rest: Any) -> Any:
        return saved["create_atomic_rmw"](self, op, ptr, val, inside(self, "atomic", ptr, mask.data), *rest)

    def atomic_cas(self: Any, ptr: Any, cmp: Any, val: Any, *rest: Any) -> Any:
        if not inside(self, "atomic", ptr, np.ones(ptr.data.shape, dtype=bool)).data.all():  # it has no mask
            raise RuntimeError(f"{bounds.kernel}: an atomic compare-and-swap outside its tensors (see the tally)")
        return saved["create_atomic_cas"](self, ptr, cmp, val, *rest)

    def init_args(self: Any, args_dev: Any, kwargs: dict) -> Any:
        args_hst, kwargs_hst = saved_args(self, args_dev, kwargs)
        named = [*zip(self.arg_names, args_hst, strict=False), *kwargs_hst.items()]  # positional ones first
        bounds.regions = [Region(name, t.untyped_storage().data_ptr(),
                                 t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                          for name, t in named if isinstance(t, torch.Tensor)]
        return args_hst, kwargs_hst

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        tuned = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k in self.constexprs and isinstance(v, int))
        bounds.kernel = f"{self.fn.__name__}[{tuned}]" if tuned else self.fn.__name__
        tally = bounds.kernels.setdefault(bounds.kernel, KernelTally())
        tally.launches += 1
        result = saved_call(self, *args, **kwargs)
        grid = interp.interpreter_builder.grid_dim
        tally.programs += int(np.prod(grid)) if grid else 0
        return result

    patched = {"create_masked_load": load, "create_masked_store": store, "create_atomic_rmw": atomic_rmw,
               "create_atomic_cas": atomic_cas}
    for name, fn in patched.items():
        setattr(builder_class, name, fn)
    executor.__call__, executor._init_args_hst = call, init_args

    def undo() -> None:
        for name, fn in saved.items():
            setattr(builder_class, name, fn)
        executor.__call__, executor._init_args_hst = saved_call, saved_args

    return undo

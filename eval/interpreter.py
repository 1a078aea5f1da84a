"""Triton's interpreter (TRITON_INTERPRET=1: how a CPU grading runs a Triton kernel) made to compute what a GPU does.

Triton 3.6's interpreter holds bf16 values as uint16 and its `tl.dot` multiplies those bit patterns as integers:
`InterpreterBuilder.create_dot` widens fp8 operands only. So a correct kernel with a bf16 `tl.dot`, the usual
kind, returned garbage on the CPU and a CPU grading called it `wrong` (2026-12-06: a kernel that passes the
reference's output through a bf16 dot with the identity got ‖d‖/‖ref‖ = 1.9e9). A GPU's tensor cores multiply
bf16 exactly and accumulate in fp32; widening both operands to fp32 before the product gives the same.

The runner installs this before it imports a solution, when it interprets (`runner.serve`), and
bench/triton_bounds.py for its run. Only the interpreter's own arithmetic changes: nothing on a GPU does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

#: Set on the builder's create_dot once widened, so a second install is a no-op.
_WIDENED = "_kernelboard_widens_bf16"


def interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def widen_bf16_dots() -> Callable[[], None]:
    """Widen bf16 `tl.dot` operands to fp32 in the interpreter (see the module docstring); returns what undoes
    it. Without Triton, or already widened, it does nothing."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return lambda: None
    saved = interp.InterpreterBuilder.create_dot
    if getattr(saved, _WIDENED, False):
        return lambda: None

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

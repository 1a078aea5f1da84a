"""Device and software identity, and torch's global numeric switches (worker side: imports torch)."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch


def torch_global_state() -> dict[str, Any]:
    """Torch's global numeric switches, which a solution may flip for its own computations: the judge names a
    change in the log and the verdict (judge.Switches); the reference is computed in another process."""
    cuda_matmul = torch.backends.cuda.matmul
    return {
        "matmul.allow_tf32": cuda_matmul.allow_tf32,
        "matmul.allow_bf16_reduced_precision_reduction": cuda_matmul.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction": cuda_matmul.allow_fp16_reduced_precision_reduction,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "grad_enabled": torch.is_grad_enabled(),
    }


def probe_environment(device: str) -> dict[str, Any]:
    """Device and software identity, recorded with every result."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    env: dict[str, Any] = {
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "python_version": platform.python_version(),
        "cuda_version": torch.version.cuda,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, l2_bytes=int(props.L2_cache_size),
                   sm_count=int(props.multi_processor_count), memory_bytes=int(props.total_memory),
                   capability=f"{props.major}.{props.minor}")
    else:
        env.update(device_name=f"CPU: {_cpu_model()}", l2_bytes=None, sm_count=None, cuda_version=None)
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str]) -> int:
    """`python -m kernelboard.eval.probe DEVICE` (sandbox.probe_device): `probe_environment` as one JSON line,
    or {"error": …} where DEVICE is cuda and none is visible."""
    device = argv[0]
    print(json.dumps(probe_environment(device) if device == "cpu" or torch.cuda.is_available()
                     else {"error": "no CUDA device"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

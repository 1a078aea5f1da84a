"""GPU hardware table: datasheet dense peaks per precision, with provenance, keyed by GPU.

Shared types live here, never in one GPU's entry. Dense tensor-core figures are the datasheet's
"with sparsity" numbers divided by two. GB/s means 10^9 bytes per second; TFLOP/s 10^12 FLOP/s.
Datasheet figures are leads, not achievable peaks: `measured_*` columns of the hardware table
hold what was measured on the machine (see `kernelboard eval calibrate`, a later addition).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from .schema import PRECISIONS, peak_column  # the contract's precisions, kept importable from here


@dataclass(frozen=True)
class GpuSpec:
    """One GPU SKU as its vendor's datasheet describes it."""

    key: str
    name: str
    sm: str
    memory_gb: float
    l2_mb: float | None
    bandwidth_gb_s: float
    peak_tflop_s: dict[str, float]
    source: str

    def peak(self, precision: str) -> float:
        """Dense peak TFLOP/s for a precision; an unknown precision is an error, never 0."""
        if precision not in self.peak_tflop_s:
            raise KeyError(f"{self.key}: no datasheet peak for precision {precision!r}; "
                           f"known: {', '.join(sorted(self.peak_tflop_s))}")
        return self.peak_tflop_s[precision]

    def hardware_row(self) -> dict:
        row = asdict(self)
        row.pop("key")
        peaks = row.pop("peak_tflop_s")
        return {"gpu": self.key, **row, **{peak_column(p): peaks.get(p) for p in PRECISIONS}}


_H100_FAMILY = "sm_90"

GPUS: dict[str, GpuSpec] = {
    spec.key: spec
    for spec in (
        GpuSpec(
            "h200", "NVIDIA H200 SXM", _H100_FAMILY, 141, None, 4800.0,
            {"fp8": 1979.0, "bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): FP8 3,958 / BF16 1,979 / TF32 989 TFLOPS with "
            "sparsity, halved for dense; FP32 67 TFLOPS; 4.8 TB/s HBM3e; 141 GB",
        ),
        GpuSpec(
            "h100-sxm", "NVIDIA H100 SXM5", _H100_FAMILY, 80, 50, 3350.0,
            {"fp8": 1979.0, "bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 67.0},
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP8 3,958 / BF16 1,979 / TF32 989 TFLOPS with "
            "sparsity, halved for dense; FP32 67 TFLOPS; 3.35 TB/s HBM3; 80 GB",
        ),
        GpuSpec(
            "h100-pcie", "NVIDIA H100 PCIe", _H100_FAMILY, 80, 50, 2039.0,
            {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
            "NVIDIA H100 Tensor Core GPU datasheet (PCIe): FP8 3,026 / BF16 1,513 / TF32 756 TFLOPS with "
            "sparsity, halved for dense; FP32 51 TFLOPS; 2,039 GB/s HBM2e (KernelBench-Hard's H100 table)",
        ),
        GpuSpec(
            "b200", "NVIDIA B200", "sm_100", 180, None, 8000.0,
            {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
            "NVIDIA HGX B200 datasheet, per GPU: FP8 9 / BF16 4.5 / TF32 2.2 PFLOPS with sparsity, halved "
            "for dense; FP32 80 TFLOPS (estimate); 8 TB/s HBM3e",
        ),
        GpuSpec(
            "rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell Workstation", "sm_120", 96, 96, 1800.0,
            {"fp8": 1000.0, "bf16": 500.0, "fp16": 500.0, "tf32": 250.0, "fp32": 125.0},
            "NVIDIA RTX PRO 6000 Blackwell datasheet as tabulated by KernelBench-Hard (dense tensor-core "
            "peaks, corrected 2026-06-14); 1,792 GB/s GDDR7 rounded to 1,800",
        ),
    )
}

_NAME_RULES: tuple[tuple[str, str], ...] = (
    (r"\bH200\b", "h200"),
    (r"\bH100\b.*\bPCIe\b", "h100-pcie"),
    (r"\bH100\b", "h100-sxm"),
    (r"\bB200\b", "b200"),
    (r"RTX PRO 6000", "rtx-pro-6000"),
)


def gpu_key(device_name: str) -> str:
    """The table key for a CUDA device name, e.g. 'NVIDIA H200' -> 'h200'.

    An unknown device gets a slug of its name, so its results are kept apart and have no peaks.
    """
    for pattern, key in _NAME_RULES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"

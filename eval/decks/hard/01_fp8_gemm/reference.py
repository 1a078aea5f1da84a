"""FP8 e4m3 GEMM with per-row weight scales: the correctness oracle for 01_fp8_gemm.

Interface-compatible with KernelBench-Hard's reference (hard-deck-interface.md §B.1): the same
module globals, constructor, state-dict keys, buffer shapes and dtypes, `get_inputs()` draw and
forward arithmetic, including its double rounding (the GEMM result is rounded to bf16 before
the scale is applied, then rounded again), which decides verdicts near the tolerance.
"""

import torch
import torch.nn as nn

M = 4096
N = 4096
K = 4096

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
OP_TYPE = "gemm"
SUPPORTED_PRECISIONS = ["fp8_e4m3"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]


class Model(nn.Module):
    """y = x · (weight · diag(weight_scale))ᵀ with x and weight in e4m3; two persistent buffers:
    `weight` (N, K) float8_e4m3fn and `weight_scale` (N,) float32."""

    def __init__(self, M: int, N: int, K: int):
        super().__init__()
        self.M, self.N, self.K = M, N, K
        # Drawn in place as bf16 from the global CPU RNG, no reseed (as the original): the values
        # depend on the RNG state at construction; graders transfer them by state dict.
        w = torch.empty(N, K, dtype=torch.bfloat16).normal_(0.0, 0.02).float()
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)  # (N, 1) fp32
        # Each row's largest magnitude lands exactly on 448 after the round-to-nearest cast.
        self.register_buffer("weight", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.squeeze(1).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) float8_e4m3fn -> (M, N) bf16."""
        # Both upcasts are exact; the bf16 GEMM accumulates in fp32 and rounds its result to bf16.
        y = x.to(torch.bfloat16) @ self.weight.to(torch.bfloat16).t()
        # Quirk kept on purpose (hard-deck-interface.md §B.1.5, §F.6): the scale is applied in fp32
        # to the already-rounded bf16 product, then rounded again. A single-rounding kernel differs
        # by up to ~0.06 on outputs of magnitude ~14, well inside the 0.2 tolerance.
        return (y.float() * self.weight_scale).to(torch.bfloat16)


def get_inputs():
    """[x]: (M, K) e4m3, drawn as fp32 uniform on [-4, 4) then cast (round to nearest), on the CPU."""
    x = (torch.rand(M, K) * 8 - 4).to(torch.float8_e4m3fn)
    return [x]


def get_init_inputs():
    return [M, N, K]


def library_scaled_mm(model, x):
    """The library line: `torch._scaled_mm` (cuBLASLt fp8) with unit scales, then the per-row weight
    scale applied to its bf16 output. cuBLASLt needs K and N multiples of 16, so the K=4127 shape
    records an error instead of a time — as the original's SOTA line did."""
    one = torch.ones((), device=x.device, dtype=torch.float32)
    y = torch._scaled_mm(x, model.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return (y.float() * model.weight_scale).to(torch.bfloat16)

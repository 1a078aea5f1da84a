"""W4A16 GEMM (asymmetric int4 weights, group size 128, bf16 activations): the oracle for 07_w4a16_gemm.

Interface-compatible with KernelBench-Hard's reference (hard-deck-interface.md §B.6): the same
module globals and helpers, constructor, state-dict keys, buffer shapes and dtypes, `get_inputs()`
draw and forward arithmetic. Two documented behaviours are kept because they change verdicts:
the constructor reseeds the global RNG from the shape (so every grader quantises the same
weights), and dequantisation happens in bf16 arithmetic with the bf16-rounded scales.
"""

import torch
import torch.nn as nn

M = 1
N = 12288
K = 4096

GROUP_SIZE = 128
OP_TYPE = "gemm_w4a16"
SUPPORTED_PRECISIONS = ["int4_bf16"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]


def shape_seed(m: int, n: int, k: int) -> int:
    """The seed the constructor reseeds with: 0xC0DE XOR (M·1315423911 + N·2654435761 + K),
    Python integers (no overflow). (1, 12288, 4096) gives 32619022108281."""
    return 0xC0DE ^ (m * 1315423911 + n * 2654435761 + k)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(K, N) uint8 codes 0..15 -> (K/2, N) uint8: row 2r in the low nibble, row 2r+1 in the high."""
    return codes[0::2] | (codes[1::2] << 4)


def _unpack_int4(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """(K/2, N) uint8 -> (K, N) uint8 codes 0..15, the inverse of `_pack_int4`; `k`, if given,
    must be 2 × the packed rows."""
    rows, cols = packed.shape
    if k is not None and k != 2 * rows:
        raise ValueError(f"k={k} does not match {rows} packed rows (expected {2 * rows})")
    return torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(2 * rows, cols)


class Model(nn.Module):
    """y = x · W with W[k, n] = (code[k, n] − zeros[k // g, n]) · scales[k // g, n], g = group size.

    Three persistent buffers: `w_q` (K/2, N) uint8, `scales` (K/g, N) bf16, `zeros` (K/g, N) bf16.
    """

    def __init__(self, M: int, N: int, K: int, group_size: int = GROUP_SIZE):
        super().__init__()
        assert K % group_size == 0, "K must be a multiple of group_size"
        assert K % 2 == 0, "K must be even (two codes per byte)"
        self.M, self.N, self.K, self.group_size = M, N, K, group_size
        # Side effect kept on purpose (§B.6.3, §F.7): the global RNG is reseeded from the shape,
        # so the weights are the same in every grader and whatever runs next sees this state.
        torch.manual_seed(shape_seed(M, N, K))
        w = torch.randn(K, N) * 0.02  # fp32, on the CPU
        groups = w.view(K // group_size, group_size, N)
        lo, hi = groups.amin(dim=1), groups.amax(dim=1)  # (K/g, N)
        scale = (hi - lo).clamp_min(1e-8) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
        # Quantised with the fp32 scale (round half to even); dequantised with its bf16 rounding.
        codes = torch.round(groups / scale[:, None, :] + zero[:, None, :]).clamp(0, 15).to(torch.uint8)
        self.register_buffer("w_q", _pack_int4(codes.view(K, N)))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("zeros", zero.to(torch.bfloat16))  # exact small integers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) bf16 -> (M, N) bf16."""
        k, n, g = self.K, self.N, self.group_size
        codes = _unpack_int4(self.w_q).to(torch.bfloat16).view(k // g, g, n)
        # bf16 arithmetic, as the original: code − zero is exact, the product rounds to bf16.
        w = ((codes - self.zeros[:, None, :]) * self.scales[:, None, :]).view(k, n)
        return x.to(torch.bfloat16) @ w  # bf16 GEMM, fp32 accumulation, bf16 result


def get_inputs():
    """[x]: (M, K) bf16 standard normal, not scaled, drawn on the CPU."""
    return [torch.randn(M, K, dtype=torch.bfloat16)]


def get_init_inputs():
    return [M, N, K]


_TINYGEMM_INNER_K_TILES = 8  # tinygemm's K tiling of the packed weight (2, 4 or 8; K must divide by 16·it)


def _tinygemm_operands(model):
    """The model's weights in tinygemm's layout, once: codes as (N, K/2) bytes (even k in the
    high nibble) converted by `_convert_weight_to_int4pack`, and (K/g, N, 2) bf16 scale and zero
    with tinygemm's dequantisation w = (code − 8)·scale + zero, so zero = (8 − zero point)·scale."""
    codes = _unpack_int4(model.w_q).t().contiguous()  # (N, K)
    pairs = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _TINYGEMM_INNER_K_TILES)
    shift = ((8 - model.zeros.float()) * model.scales.float()).to(torch.bfloat16)
    return packed, torch.stack((model.scales, shift), dim=-1).contiguous()


def library_tinygemm(model, x):
    """The library line: PyTorch's int4 GEMM (`aten._weight_int4pack_mm`, tinygemm, CUDA), the
    same asymmetric int4 format with its zero point folded into an additive bf16 term; the weights
    are repacked once, outside the timed calls' cost (the first call, a warm-up, does it)."""
    if getattr(model, "_tinygemm", None) is None:
        model._tinygemm = _tinygemm_operands(model)
    packed, scales_and_zeros = model._tinygemm
    return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), packed, model.group_size, scales_and_zeros)

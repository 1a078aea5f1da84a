"""Fused W4A16 GEMM: int4 unpack + dequant + matmul in one Triton kernel."""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl

GROUP_SIZE = 128
PACKS_PER_GROUP = GROUP_SIZE // 2


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wqk,
    stride_wqn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    PACKS_PER_GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    n_groups = K // GROUP_SIZE
    offs_pk = tl.arange(0, PACKS_PER_GROUP)
    k_even = tl.arange(0, PACKS_PER_GROUP) * 2
    k_odd = k_even + 1

    for g in tl.range(0, n_groups):
        scale = tl.load(
            scales_ptr + g * stride_sg + offs_n * stride_sn,
            mask=mask_n,
            other=0.0,
        )
        zero = tl.load(
            zeros_ptr + g * stride_zg + offs_n * stride_zn,
            mask=mask_n,
            other=0.0,
        )

        w_byte = tl.load(
            wq_ptr
            + (g * PACKS_PER_GROUP + offs_pk[:, None]) * stride_wqk
            + offs_n[None, :] * stride_wqn,
            mask=mask_n[None, :],
            other=0,
        )
        w_lo_dq = ((w_byte & 0xF).to(tl.bfloat16) - zero[None, :]) * scale[None, :]
        w_hi_dq = (((w_byte >> 4) & 0xF).to(tl.bfloat16) - zero[None, :]) * scale[None, :]

        k_base = g * GROUP_SIZE
        x_lo = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k_base + k_even[None, :]) * stride_xk,
            mask=mask_m[:, None],
            other=0.0,
        )
        x_hi = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k_base + k_odd[None, :]) * stride_xk,
            mask=mask_m[:, None],
            other=0.0,
        )
        acc += tl.dot(x_lo, w_lo_dq)
        acc += tl.dot(x_hi, w_hi_dq)

    out = acc.to(tl.bfloat16)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        out,
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _pick_config(M: int, N: int) -> dict:
    if M == 1:
        return {"BLOCK_M": 1, "BLOCK_N": 512, "num_warps": 8, "num_stages": 4}
    if M <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4}
    if M <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}


def w4a16_gemm(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
) -> torch.Tensor:
    M, K = x.shape
    Kh, N = w_q.shape
    assert Kh * 2 == K
    assert scales.shape == zeros.shape == (K // GROUP_SIZE, N)

    out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    cfg = _pick_config(M, N)
    block_m = min(cfg["BLOCK_M"], M)
    block_n = cfg["BLOCK_N"]

    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w4a16_gemm_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        out,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        GROUP_SIZE=GROUP_SIZE,
        PACKS_PER_GROUP=PACKS_PER_GROUP,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


class Model(nn.Module):
    def __init__(self, M: int, N: int, K: int, group_size: int = GROUP_SIZE):
        super().__init__()
        assert K % group_size == 0
        assert K % 2 == 0
        self.M, self.N, self.K = M, N, K
        self.group_size = group_size
        n_groups = K // group_size
        self.register_buffer("w_q", torch.empty(K // 2, N, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(n_groups, N, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.empty(n_groups, N, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a16_gemm(x, self.w_q, self.scales, self.zeros)


M = 1
N = 12288
K = 4096


def get_inputs():
    x = torch.randn(M, K, dtype=torch.bfloat16)
    return [x]


def get_init_inputs():
    return [M, N, K]

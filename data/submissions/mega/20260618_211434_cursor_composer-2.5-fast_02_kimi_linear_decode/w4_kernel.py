"""Fused W4A16 dequant-GEMV / dequant-GEMM — no materialized bf16 weights."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 128
BLOCK_N = 256
BLOCK_M = 64
BLOCK_PAIRS = 64


@triton.jit
def w4a16_gemv_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    K,
    N,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    stride_z_g,
    stride_z_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ng = K // GROUP

    for g in range(ng):
        k_base = g * GROUP
        kh_base = k_base // 2
        s = tl.load(scales_ptr + g * stride_s_g + offs_n * stride_s_n, mask=mask_n, other=0.0).to(
            tl.float32
        )
        z = tl.load(zeros_ptr + g * stride_z_g + offs_n * stride_z_n, mask=mask_n, other=0.0).to(
            tl.float32
        )
        offs_p = tl.arange(0, BLOCK_PAIRS)
        mask_p = offs_p < GROUP // 2
        x0 = tl.load(x_ptr + k_base + 2 * offs_p, mask=mask_p, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + k_base + 2 * offs_p + 1, mask=mask_p, other=0.0).to(tl.float32)
        packed = tl.load(
            wq_ptr + (kh_base + offs_p)[:, None] * stride_wq_k + offs_n[None, :] * stride_wq_n,
            mask=mask_p[:, None] & mask_n[None, :],
            other=0,
        ).to(tl.int32)
        w0 = (packed & 0xF).to(tl.float32)
        w1 = ((packed >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(x0[:, None] * (w0 - z[None, :]) * s[None, :], axis=0)
        acc += tl.sum(x1[:, None] * (w1 - z[None, :]) * s[None, :], axis=0)

    tl.store(y_ptr + offs_n, acc.to(tl.bfloat16), mask=mask_n)


@triton.jit
def w4a16_col_gemv_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    col_start,
    K,
    Kslice,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    stride_z_g,
    stride_z_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[c] = W[c, col_start:col_start+Kslice] @ x  with W shape (K, N_full)."""
    pid = tl.program_id(0)
    offs_c = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_c = offs_c < K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    kh = offs_c // 2
    is_even = (offs_c % 2) == 0
    g_row = offs_c // GROUP

    for d in range(0, Kslice, 2):
        col0 = col_start + d
        col1 = col_start + d + 1
        x0 = tl.load(x_ptr + d).to(tl.float32)
        x1 = tl.load(x_ptr + d + 1).to(tl.float32)

        pk0 = tl.load(
            wq_ptr + kh * stride_wq_k + col0 * stride_wq_n, mask=mask_c, other=0
        ).to(tl.int32)
        pk1 = tl.load(
            wq_ptr + kh * stride_wq_k + col1 * stride_wq_n, mask=mask_c, other=0
        ).to(tl.int32)
        w0 = tl.where(is_even, pk0 & 0xF, (pk0 >> 4) & 0xF).to(tl.float32)
        w1 = tl.where(is_even, pk1 & 0xF, (pk1 >> 4) & 0xF).to(tl.float32)

        s0 = tl.load(
            scales_ptr + g_row * stride_s_g + col0 * stride_s_n, mask=mask_c, other=0.0
        ).to(tl.float32)
        z0 = tl.load(
            zeros_ptr + g_row * stride_z_g + col0 * stride_z_n, mask=mask_c, other=0.0
        ).to(tl.float32)
        s1 = tl.load(
            scales_ptr + g_row * stride_s_g + col1 * stride_s_n, mask=mask_c, other=0.0
        ).to(tl.float32)
        z1 = tl.load(
            zeros_ptr + g_row * stride_z_g + col1 * stride_z_n, mask=mask_c, other=0.0
        ).to(tl.float32)

        acc += x0 * (w0 - z0) * s0
        acc += x1 * (w1 - z1) * s1

    tl.store(y_ptr + offs_c, acc.to(tl.bfloat16), mask=mask_c)


@triton.jit
def w4a16_col_gemv_batched_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    col_starts_ptr,
    K,
    Kslice,
    stride_x_h,
    stride_x_k,
    stride_y_h,
    stride_y_k,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    stride_z_g,
    stride_z_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_c = tl.program_id(1)
    col_start = tl.load(col_starts_ptr + pid_h).to(tl.int32)
    x_base = x_ptr + pid_h * stride_x_h
    y_base = y_ptr + pid_h * stride_y_h

    offs_c = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_c = offs_c < K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    kh = offs_c // 2
    is_even = (offs_c % 2) == 0
    g_row = offs_c // GROUP

    for d in range(0, Kslice, 2):
        col0 = col_start + d
        col1 = col_start + d + 1
        x0 = tl.load(x_base + d * stride_x_k).to(tl.float32)
        x1 = tl.load(x_base + (d + 1) * stride_x_k).to(tl.float32)

        pk0 = tl.load(
            wq_ptr + kh * stride_wq_k + col0 * stride_wq_n, mask=mask_c, other=0
        ).to(tl.int32)
        pk1 = tl.load(
            wq_ptr + kh * stride_wq_k + col1 * stride_wq_n, mask=mask_c, other=0
        ).to(tl.int32)
        w0 = tl.where(is_even, pk0 & 0xF, (pk0 >> 4) & 0xF).to(tl.float32)
        w1 = tl.where(is_even, pk1 & 0xF, (pk1 >> 4) & 0xF).to(tl.float32)

        s0 = tl.load(
            scales_ptr + g_row * stride_s_g + col0 * stride_s_n, mask=mask_c, other=0.0
        ).to(tl.float32)
        z0 = tl.load(
            zeros_ptr + g_row * stride_z_g + col0 * stride_z_n, mask=mask_c, other=0.0
        ).to(tl.float32)
        s1 = tl.load(
            scales_ptr + g_row * stride_s_g + col1 * stride_s_n, mask=mask_c, other=0.0
        ).to(tl.float32)
        z1 = tl.load(
            zeros_ptr + g_row * stride_z_g + col1 * stride_z_n, mask=mask_c, other=0.0
        ).to(tl.float32)

        acc += x0 * (w0 - z0) * s0
        acc += x1 * (w1 - z1) * s1

    tl.store(y_base + offs_c * stride_y_k, acc.to(tl.bfloat16), mask=mask_c)


@triton.jit
def w4a16_rowcol_gemv_batched_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    col_starts_ptr,
    K,
    Kslice,
    stride_x_h,
    stride_x_k,
    stride_y_h,
    stride_y_d,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    stride_z_g,
    stride_z_n,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """y[h,d] = sum_c x[h,c] * W[c, col_start+d]  (output length Kslice)."""
    pid_h = tl.program_id(0)
    pid_d = tl.program_id(1)
    col_start = tl.load(col_starts_ptr + pid_h).to(tl.int32)
    x_base = x_ptr + pid_h * stride_x_h
    y_base = y_ptr + pid_h * stride_y_h

    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < Kslice
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)

    for c in range(K):
        xh = tl.load(x_base + c * stride_x_k).to(tl.float32)
        kh = c // 2
        is_even = (c % 2) == 0
        g_row = c // GROUP

        col = col_start + offs_d
        pk = tl.load(
            wq_ptr + kh * stride_wq_k + col * stride_wq_n, mask=mask_d, other=0
        ).to(tl.int32)
        w = tl.where(is_even, pk & 0xF, pk >> 4).to(tl.float32)
        s = tl.load(
            scales_ptr + g_row * stride_s_g + col * stride_s_n, mask=mask_d, other=0.0
        ).to(tl.float32)
        z = tl.load(
            zeros_ptr + g_row * stride_z_g + col * stride_z_n, mask=mask_d, other=0.0
        ).to(tl.float32)
        acc += xh * (w - z) * s

    tl.store(y_base + offs_d * stride_y_d, acc.to(tl.bfloat16), mask=mask_d)


@triton.jit
def w4a16_batched_gemv_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    expert_ids_ptr,
    K,
    N,
    stride_wq_e,
    stride_wq_k,
    stride_wq_n,
    stride_se_e,
    stride_se_g,
    stride_se_n,
    stride_ze_e,
    stride_ze_g,
    stride_ze_n,
    stride_y_e,
    stride_y_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    eid = tl.load(expert_ids_ptr + pid_e).to(tl.int32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N

    wq_base = wq_ptr + eid * stride_wq_e
    s_base = scales_ptr + eid * stride_se_e
    z_base = zeros_ptr + eid * stride_ze_e
    y_base = y_ptr + pid_e * stride_y_e

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ng = K // GROUP

    for g in range(ng):
        k_base = g * GROUP
        kh_base = k_base // 2
        s = tl.load(
            s_base + g * stride_se_g + offs_n * stride_se_n, mask=mask_n, other=0.0
        ).to(tl.float32)
        z = tl.load(
            z_base + g * stride_ze_g + offs_n * stride_ze_n, mask=mask_n, other=0.0
        ).to(tl.float32)
        offs_p = tl.arange(0, BLOCK_PAIRS)
        mask_p = offs_p < GROUP // 2
        x0 = tl.load(x_ptr + k_base + 2 * offs_p, mask=mask_p, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + k_base + 2 * offs_p + 1, mask=mask_p, other=0.0).to(tl.float32)
        packed = tl.load(
            wq_base + (kh_base + offs_p)[:, None] * stride_wq_k + offs_n[None, :] * stride_wq_n,
            mask=mask_p[:, None] & mask_n[None, :],
            other=0,
        ).to(tl.int32)
        w0 = (packed & 0xF).to(tl.float32)
        w1 = ((packed >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(x0[:, None] * (w0 - z[None, :]) * s[None, :], axis=0)
        acc += tl.sum(x1[:, None] * (w1 - z[None, :]) * s[None, :], axis=0)

    tl.store(y_base + offs_n * stride_y_n, acc.to(tl.bfloat16), mask=mask_n)


@triton.jit
def w4a16_batched_gemv_varx_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    expert_ids_ptr,
    K,
    N,
    stride_x_e,
    stride_x_k,
    stride_wq_e,
    stride_wq_k,
    stride_wq_n,
    stride_se_e,
    stride_se_g,
    stride_se_n,
    stride_ze_e,
    stride_ze_g,
    stride_ze_n,
    stride_y_e,
    stride_y_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    eid = tl.load(expert_ids_ptr + pid_e).to(tl.int32)
    x_base = x_ptr + pid_e * stride_x_e
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N

    wq_base = wq_ptr + eid * stride_wq_e
    s_base = scales_ptr + eid * stride_se_e
    z_base = zeros_ptr + eid * stride_ze_e
    y_base = y_ptr + pid_e * stride_y_e

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ng = K // GROUP

    for g in range(ng):
        k_base = g * GROUP
        kh_base = k_base // 2
        s = tl.load(
            s_base + g * stride_se_g + offs_n * stride_se_n, mask=mask_n, other=0.0
        ).to(tl.float32)
        z = tl.load(
            z_base + g * stride_ze_g + offs_n * stride_ze_n, mask=mask_n, other=0.0
        ).to(tl.float32)
        offs_p = tl.arange(0, BLOCK_PAIRS)
        mask_p = offs_p < GROUP // 2
        x0 = tl.load(
            x_base + (k_base + 2 * offs_p) * stride_x_k, mask=mask_p, other=0.0
        ).to(tl.float32)
        x1 = tl.load(
            x_base + (k_base + 2 * offs_p + 1) * stride_x_k, mask=mask_p, other=0.0
        ).to(tl.float32)
        packed = tl.load(
            wq_base + (kh_base + offs_p)[:, None] * stride_wq_k + offs_n[None, :] * stride_wq_n,
            mask=mask_p[:, None] & mask_n[None, :],
            other=0,
        ).to(tl.int32)
        w0 = (packed & 0xF).to(tl.float32)
        w1 = ((packed >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(x0[:, None] * (w0 - z[None, :]) * s[None, :], axis=0)
        acc += tl.sum(x1[:, None] * (w1 - z[None, :]) * s[None, :], axis=0)

    tl.store(y_base + offs_n * stride_y_n, acc.to(tl.bfloat16), mask=mask_n)


def _launch_gemv(x, w_q, scales, zeros, y):
    K = w_q.shape[0] * 2
    N = w_q.shape[1]
    grid = (triton.cdiv(N, BLOCK_N),)
    w4a16_gemv_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        y,
        K,
        N,
        w_q.stride(0),
        w_q.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        GROUP=GROUP,
        BLOCK_N=BLOCK_N,
        BLOCK_PAIRS=BLOCK_PAIRS,
        num_warps=8,
    )


def w4a16_gemv(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    y = torch.empty(w_q.shape[1], dtype=torch.bfloat16, device=x.device)
    _launch_gemv(x.contiguous(), w_q, scales, zeros, y)
    return y


def w4a16_gemm(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """GEMM via per-row GEMV (fallback for non-MLA paths)."""
    M = x.shape[0]
    N = w_q.shape[1]
    y = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    for i in range(M):
        _launch_gemv(x[i].contiguous(), w_q, scales, zeros, y[i])
    return y


def w4a16_col_gemv_batched(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    col_starts: torch.Tensor,
) -> torch.Tensor:
    """x (H, Kslice), col_starts (H,) -> y (H, K)."""
    H, Kslice = x.shape
    K = w_q.shape[0] * 2
    y = torch.empty(H, K, dtype=torch.bfloat16, device=x.device)
    grid = (H, triton.cdiv(K, BLOCK_N))
    w4a16_col_gemv_batched_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        y,
        col_starts,
        K,
        Kslice,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        GROUP=GROUP,
        BLOCK_N=BLOCK_N,
        num_warps=8,
    )
    return y


def w4a16_rowcol_gemv_batched(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    col_starts: torch.Tensor,
) -> torch.Tensor:
    """x (H, K) -> y (H, Kslice) via column-slice row reduction."""
    H, _ = x.shape
    Kslice = 128  # qk_nope / v_head
    K = w_q.shape[0] * 2
    y = torch.empty(H, Kslice, dtype=torch.bfloat16, device=x.device)
    grid = (H, triton.cdiv(Kslice, BLOCK_N))
    w4a16_rowcol_gemv_batched_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        y,
        col_starts,
        K,
        Kslice,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        scales.stride(0),
        scales.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        GROUP=GROUP,
        BLOCK_D=BLOCK_N,
        num_warps=8,
    )
    return y


def w4a16_batched_gemv(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    expert_ids: torch.Tensor,
) -> torch.Tensor:
    E = expert_ids.numel()
    K = w_q.shape[1] * 2
    N = w_q.shape[2]
    y = torch.empty(E, N, dtype=torch.bfloat16, device=x.device)
    grid = (E, triton.cdiv(N, BLOCK_N))
    w4a16_batched_gemv_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        y,
        expert_ids,
        K,
        N,
        w_q.stride(0),
        w_q.stride(1),
        w_q.stride(2),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        zeros.stride(0),
        zeros.stride(1),
        zeros.stride(2),
        y.stride(0),
        y.stride(1),
        GROUP=GROUP,
        BLOCK_N=BLOCK_N,
        BLOCK_PAIRS=BLOCK_PAIRS,
        num_warps=8,
    )
    return y


def w4a16_batched_gemv_varx(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    expert_ids: torch.Tensor,
) -> torch.Tensor:
    E = expert_ids.numel()
    K = x.shape[1]
    N = w_q.shape[2]
    y = torch.empty(E, N, dtype=torch.bfloat16, device=x.device)
    grid = (E, triton.cdiv(N, BLOCK_N))
    w4a16_batched_gemv_varx_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        y,
        expert_ids,
        K,
        N,
        x.stride(0),
        x.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        w_q.stride(2),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        zeros.stride(0),
        zeros.stride(1),
        zeros.stride(2),
        y.stride(0),
        y.stride(1),
        GROUP=GROUP,
        BLOCK_N=BLOCK_N,
        BLOCK_PAIRS=BLOCK_PAIRS,
        num_warps=8,
    )
    return y

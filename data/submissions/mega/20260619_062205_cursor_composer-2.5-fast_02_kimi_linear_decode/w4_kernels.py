"""Fused W4A16 dequant + GEMV/GEMM (no materialized bf16 weights)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZE = 128


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_q_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    K,
    N,
    stride_x,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    stride_z_g,
    stride_z_n,
    stride_y,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x = tl.load(x_ptr + k_offs * stride_x, mask=k_mask, other=0.0).to(tl.float32)

        packed_row = k_offs // 2
        is_hi = (k_offs & 1) == 1
        wq = tl.load(
            w_q_ptr + packed_row[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        w_int = tl.where(is_hi[:, None], (wq >> 4) & 0xF, wq & 0xF).to(tl.float32)
        g_idx = k_offs // GROUP_SIZE
        sc = tl.load(
            scales_ptr + g_idx[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zr = tl.load(
            zeros_ptr + g_idx[:, None] * stride_z_g + n_offs[None, :] * stride_z_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = (w_int - zr) * sc
        acc += tl.sum(x[:, None] * w, axis=0)

    tl.store(y_ptr + n_offs * stride_y, acc, mask=n_mask)


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_q_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    stride_z_g,
    stride_z_n,
    stride_ym,
    stride_yn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m_offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m_offs < M
    n_mask = n_offs < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x = tl.load(
            x_ptr + m_offs[:, None] * stride_xm + k_offs[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)

        packed_row = k_offs // 2
        is_hi = (k_offs & 1) == 1
        wq = tl.load(
            w_q_ptr + packed_row[None, :] * stride_wq_k + n_offs[:, None] * stride_wq_n,
            mask=k_mask[None, :] & n_mask[:, None],
            other=0,
        )
        w_int = tl.where(is_hi[None, :], (wq >> 4) & 0xF, wq & 0xF).to(tl.float32)
        g_idx = k_offs // GROUP_SIZE
        sc = tl.load(
            scales_ptr + g_idx[None, :] * stride_s_g + n_offs[:, None] * stride_s_n,
            mask=k_mask[None, :] & n_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        zr = tl.load(
            zeros_ptr + g_idx[None, :] * stride_z_g + n_offs[:, None] * stride_z_n,
            mask=k_mask[None, :] & n_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        w = (w_int - zr) * sc
        acc += tl.dot(x, tl.trans(w))

    tl.store(
        y_ptr + m_offs[:, None] * stride_ym + n_offs[None, :] * stride_yn,
        acc,
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _batch_gemv_kernel(
    x_ptr,
    w_q_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    E,
    K,
    N,
    stride_x,
    stride_wqe,
    stride_wq_k,
    stride_wq_n,
    stride_se,
    stride_s_g,
    stride_s_n,
    stride_ze,
    stride_z_g,
    stride_z_n,
    stride_ye,
    stride_yn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_e >= E:
        return
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x = tl.load(x_ptr + k_offs * stride_x, mask=k_mask, other=0.0).to(tl.float32)

        packed_row = k_offs // 2
        is_hi = (k_offs & 1) == 1
        wq = tl.load(
            w_q_ptr
            + pid_e * stride_wqe
            + packed_row[:, None] * stride_wq_k
            + n_offs[None, :] * stride_wq_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        w_int = tl.where(is_hi[:, None], (wq >> 4) & 0xF, wq & 0xF).to(tl.float32)
        g_idx = k_offs // GROUP_SIZE
        sc = tl.load(
            scales_ptr
            + pid_e * stride_se
            + g_idx[:, None] * stride_s_g
            + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zr = tl.load(
            zeros_ptr
            + pid_e * stride_ze
            + g_idx[:, None] * stride_z_g
            + n_offs[None, :] * stride_z_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = (w_int - zr) * sc
        acc += tl.sum(x[:, None] * w, axis=0)

    tl.store(y_ptr + pid_e * stride_ye + n_offs * stride_yn, acc, mask=n_mask)


@triton.jit
def _batch_gemv_rows_kernel(
    x_ptr,
    w_q_ptr,
    scales_ptr,
    zeros_ptr,
    y_ptr,
    E,
    K,
    N,
    stride_xe,
    stride_xk,
    stride_wqe,
    stride_wq_k,
    stride_wq_n,
    stride_se,
    stride_s_g,
    stride_s_n,
    stride_ze,
    stride_z_g,
    stride_z_n,
    stride_ye,
    stride_yn,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_e >= E:
        return
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x = tl.load(
            x_ptr + pid_e * stride_xe + k_offs * stride_xk,
            mask=k_mask,
            other=0.0,
        ).to(tl.float32)

        packed_row = k_offs // 2
        is_hi = (k_offs & 1) == 1
        wq = tl.load(
            w_q_ptr
            + pid_e * stride_wqe
            + packed_row[:, None] * stride_wq_k
            + n_offs[None, :] * stride_wq_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        w_int = tl.where(is_hi[:, None], (wq >> 4) & 0xF, wq & 0xF).to(tl.float32)
        g_idx = k_offs // GROUP_SIZE
        sc = tl.load(
            scales_ptr
            + pid_e * stride_se
            + g_idx[:, None] * stride_s_g
            + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zr = tl.load(
            zeros_ptr
            + pid_e * stride_ze
            + g_idx[:, None] * stride_z_g
            + n_offs[None, :] * stride_z_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = (w_int - zr) * sc
        acc += tl.sum(x[:, None] * w, axis=0)

    tl.store(y_ptr + pid_e * stride_ye + n_offs * stride_yn, acc, mask=n_mask)


_GEMV_BLOCK_N = 128
_GEMV_BLOCK_K = 128
_GEMM_BLOCK_M = 32
_GEMM_BLOCK_N = 64
_GEMM_BLOCK_K = 128


def gemv_w4a16(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k_in: int) -> torch.Tensor:
    assert x.ndim == 1 and x.is_contiguous()
    kh, n = w_q.shape
    assert kh * 2 == k_in
    y = torch.empty(n, device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(n, _GEMV_BLOCK_N),)
    _gemv_kernel[grid](
        x, w_q, scales, zeros, y,
        k_in, n,
        x.stride(0), w_q.stride(0), w_q.stride(1),
        scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1),
        y.stride(0),
        GROUP_SIZE=GROUP_SIZE,
        BLOCK_N=_GEMV_BLOCK_N,
        BLOCK_K=_GEMV_BLOCK_K,
        num_warps=4,
    )
    return y


def gemm_w4a16(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k_in: int) -> torch.Tensor:
    assert x.ndim == 2 and x.is_contiguous()
    m, k = x.shape
    kh, n = w_q.shape
    assert k == k_in and kh * 2 == k_in
    y = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, _GEMM_BLOCK_M), triton.cdiv(n, _GEMM_BLOCK_N))
    _gemm_kernel[grid](
        x, w_q, scales, zeros, y,
        m, n, k_in,
        x.stride(0), x.stride(1),
        w_q.stride(0), w_q.stride(1),
        scales.stride(0), scales.stride(1),
        zeros.stride(0), zeros.stride(1),
        y.stride(0), y.stride(1),
        GROUP_SIZE=GROUP_SIZE,
        BLOCK_M=_GEMM_BLOCK_M,
        BLOCK_N=_GEMM_BLOCK_N,
        BLOCK_K=_GEMM_BLOCK_K,
        num_warps=4,
    )
    return y


def batch_gemv_w4a16(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    k_in: int,
) -> torch.Tensor:
    assert x.ndim == 1 and x.is_contiguous()
    e, kh, n = w_q.shape
    assert kh * 2 == k_in
    y = torch.empty(e, n, device=x.device, dtype=torch.bfloat16)
    grid = (e, triton.cdiv(n, _GEMV_BLOCK_N))
    _batch_gemv_kernel[grid](
        x, w_q, scales, zeros, y,
        e, k_in, n,
        x.stride(0),
        w_q.stride(0), w_q.stride(1), w_q.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2),
        zeros.stride(0), zeros.stride(1), zeros.stride(2),
        y.stride(0), y.stride(1),
        GROUP_SIZE=GROUP_SIZE,
        BLOCK_N=_GEMV_BLOCK_N,
        BLOCK_K=_GEMV_BLOCK_K,
        num_warps=4,
    )
    return y


def batch_gemv_rows_w4a16(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    k_in: int,
) -> torch.Tensor:
    """x: (E, K) bf16; expert weights (E, K//2, N) -> y: (E, N) bf16."""
    assert x.ndim == 2 and x.is_contiguous()
    e, k = x.shape
    assert w_q.shape[0] == e and w_q.shape[1] * 2 == k_in and k == k_in
    n = w_q.shape[2]
    y = torch.empty(e, n, device=x.device, dtype=torch.bfloat16)
    grid = (e, triton.cdiv(n, _GEMV_BLOCK_N))
    _batch_gemv_rows_kernel[grid](
        x, w_q, scales, zeros, y,
        e, k_in, n,
        x.stride(0), x.stride(1),
        w_q.stride(0), w_q.stride(1), w_q.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2),
        zeros.stride(0), zeros.stride(1), zeros.stride(2),
        y.stride(0), y.stride(1),
        GROUP_SIZE=GROUP_SIZE,
        BLOCK_N=_GEMV_BLOCK_N,
        BLOCK_K=_GEMV_BLOCK_K,
        num_warps=4,
    )
    return y

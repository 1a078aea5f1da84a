"""Fused W4A16 dequant-GEMV kernels (Triton)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZE = 128


@triton.jit
def _w4_gemv_kernel(
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x_blk = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        g = k_offs // GROUP
        scale = tl.load(
            scales_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zero = tl.load(
            zeros_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        pair = k_offs // 2
        is_lo = (k_offs & 1) == 0
        wq = tl.load(
            wq_ptr + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        nibble = tl.where(is_lo[:, None], wq & 0xF, (wq >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(x_blk[:, None] * (nibble - zero) * scale, axis=0)
    tl.store(y_ptr + n_offs, acc.to(tl.bfloat16), mask=n_mask)


@triton.jit
def _w4_gemv_quad_kernel(
    x_ptr,
    wq0_ptr,
    wq1_ptr,
    wq2_ptr,
    wq3_ptr,
    s0_ptr,
    s1_ptr,
    s2_ptr,
    s3_ptr,
    z0_ptr,
    z1_ptr,
    z2_ptr,
    z3_ptr,
    y0_ptr,
    y1_ptr,
    y2_ptr,
    y3_ptr,
    K,
    N,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x_blk = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        g = k_offs // GROUP
        pair = k_offs // 2
        is_lo = (k_offs & 1) == 0
        scale0 = tl.load(s0_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        zero0 = tl.load(z0_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        wq0 = tl.load(wq0_ptr + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
                      mask=k_mask[:, None] & n_mask[None, :], other=0)
        nib0 = tl.where(is_lo[:, None], wq0 & 0xF, (wq0 >> 4) & 0xF).to(tl.float32)
        acc0 += tl.sum(x_blk[:, None] * (nib0 - zero0) * scale0, axis=0)
        scale1 = tl.load(s1_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        zero1 = tl.load(z1_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        wq1 = tl.load(wq1_ptr + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
                      mask=k_mask[:, None] & n_mask[None, :], other=0)
        nib1 = tl.where(is_lo[:, None], wq1 & 0xF, (wq1 >> 4) & 0xF).to(tl.float32)
        acc1 += tl.sum(x_blk[:, None] * (nib1 - zero1) * scale1, axis=0)
        scale2 = tl.load(s2_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        zero2 = tl.load(z2_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        wq2 = tl.load(wq2_ptr + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
                      mask=k_mask[:, None] & n_mask[None, :], other=0)
        nib2 = tl.where(is_lo[:, None], wq2 & 0xF, (wq2 >> 4) & 0xF).to(tl.float32)
        acc2 += tl.sum(x_blk[:, None] * (nib2 - zero2) * scale2, axis=0)
        scale3 = tl.load(s3_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        zero3 = tl.load(z3_ptr + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        wq3 = tl.load(wq3_ptr + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
                      mask=k_mask[:, None] & n_mask[None, :], other=0)
        nib3 = tl.where(is_lo[:, None], wq3 & 0xF, (wq3 >> 4) & 0xF).to(tl.float32)
        acc3 += tl.sum(x_blk[:, None] * (nib3 - zero3) * scale3, axis=0)
    tl.store(y0_ptr + n_offs, acc0.to(tl.bfloat16), mask=n_mask)
    tl.store(y1_ptr + n_offs, acc1.to(tl.bfloat16), mask=n_mask)
    tl.store(y2_ptr + n_offs, acc2.to(tl.bfloat16), mask=n_mask)
    tl.store(y3_ptr + n_offs, acc3.to(tl.bfloat16), mask=n_mask)


@triton.jit
def _w4_gemv_indexed_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    idx_ptr,
    y_ptr,
    K,
    N,
    NUM,
    GRID_N,
    stride_wq_e,
    stride_wq_k,
    stride_wq_n,
    stride_s_e,
    stride_s_g,
    stride_s_n,
    stride_y_num,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    num_id = pid // GRID_N
    pid_n = pid % GRID_N
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    num_mask = num_id < NUM
    e = tl.load(idx_ptr + num_id).to(tl.int32)
    wq_base = wq_ptr + e * stride_wq_e
    s_base = scales_ptr + e * stride_s_e
    z_base = zeros_ptr + e * stride_s_e
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x_blk = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        g = k_offs // GROUP
        scale = tl.load(
            s_base + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zero = tl.load(
            z_base + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        pair = k_offs // 2
        is_lo = (k_offs & 1) == 0
        wq = tl.load(
            wq_base + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        nibble = tl.where(is_lo[:, None], wq & 0xF, (wq >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(x_blk[:, None] * (nibble - zero) * scale, axis=0)
    tl.store(y_ptr + num_id * stride_y_num + n_offs, acc.to(tl.bfloat16), mask=n_mask & num_mask)


@triton.jit
def _w4_batched_rows_kernel(
    x_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    idx_ptr,
    y_ptr,
    K,
    N,
    NUM,
    GRID_N,
    stride_x_num,
    stride_x_k,
    stride_wq_e,
    stride_wq_k,
    stride_wq_n,
    stride_s_e,
    stride_s_g,
    stride_s_n,
    stride_y_num,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    num_id = pid // GRID_N
    pid_n = pid % GRID_N
    n_offs = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    num_mask = num_id < NUM
    e = tl.load(idx_ptr + num_id).to(tl.int32)
    wq_base = wq_ptr + e * stride_wq_e
    s_base = scales_ptr + e * stride_s_e
    z_base = zeros_ptr + e * stride_s_e
    x_base = x_ptr + num_id * stride_x_num
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        x_blk = tl.load(x_base + k_offs * stride_x_k, mask=k_mask, other=0.0).to(tl.float32)
        g = k_offs // GROUP
        scale = tl.load(
            s_base + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zero = tl.load(
            z_base + g[:, None] * stride_s_g + n_offs[None, :] * stride_s_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        pair = k_offs // 2
        is_lo = (k_offs & 1) == 0
        wq = tl.load(
            wq_base + pair[:, None] * stride_wq_k + n_offs[None, :] * stride_wq_n,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        nibble = tl.where(is_lo[:, None], wq & 0xF, (wq >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(x_blk[:, None] * (nibble - zero) * scale, axis=0)
    tl.store(y_ptr + num_id * stride_y_num + n_offs, acc.to(tl.bfloat16), mask=n_mask & num_mask)


@triton.jit
def _w4_qk_proj_kernel(
    q_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    K,
    H,
    D: tl.constexpr,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_j = tl.program_id(0)
    pid_h = tl.program_id(1)
    j = pid_j
    h_offs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h_offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        d_offs = k0 + tl.arange(0, BLOCK_K)
        d_mask = d_offs < D
        qv = tl.load(
            q_ptr + h_offs[None, :] * D + d_offs[:, None],
            mask=d_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        n_cols = h_offs[None, :] * (2 * D) + d_offs[:, None]
        g = j // GROUP
        scale = tl.load(
            scales_ptr + g * stride_s_g + n_cols * stride_s_n,
            mask=d_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zero = tl.load(
            zeros_ptr + g * stride_s_g + n_cols * stride_s_n,
            mask=d_mask[:, None] & h_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        pair = j // 2
        is_lo = (j & 1) == 0
        wq = tl.load(
            wq_ptr + pair * stride_wq_k + n_cols * stride_wq_n,
            mask=d_mask[:, None] & h_mask[None, :],
            other=0,
        )
        nibble = tl.where(is_lo, wq & 0xF, (wq >> 4) & 0xF).to(tl.float32)
        acc += tl.sum(qv * (nibble - zero) * scale, axis=0)
    tl.store(out_ptr + j * H + h_offs, acc, mask=h_mask)


@triton.jit
def _w4_pc_v_kernel(
    pc_ptr,
    wq_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    K,
    H,
    D: tl.constexpr,
    stride_wq_k,
    stride_wq_n,
    stride_s_g,
    stride_s_n,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_h = tl.program_id(0)
    pid_d = tl.program_id(1)
    h_offs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    d_offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    h_mask = h_offs < H
    d_mask = d_offs < D
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for j in range(K):
        pc = tl.load(pc_ptr + h_offs * K + j, mask=h_mask, other=0.0).to(tl.float32)
        n_cols = h_offs[:, None] * (2 * D) + D + d_offs[None, :]
        g = j // GROUP
        scale = tl.load(
            scales_ptr + g * stride_s_g + n_cols * stride_s_n,
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        zero = tl.load(
            zeros_ptr + g * stride_s_g + n_cols * stride_s_n,
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        pair = j // 2
        is_lo = (j & 1) == 0
        wq = tl.load(
            wq_ptr + pair * stride_wq_k + n_cols * stride_wq_n,
            mask=h_mask[:, None] & d_mask[None, :],
            other=0,
        )
        nibble = tl.where(is_lo, wq & 0xF, (wq >> 4) & 0xF).to(tl.float32)
        acc += pc[:, None] * (nibble - zero) * scale
    out_ptrs = out_ptr + h_offs[:, None] * D + d_offs[None, :]
    tl.store(out_ptrs, acc.to(tl.bfloat16), mask=h_mask[:, None] & d_mask[None, :])


def w4_gemv(x, w_q, scales, zeros):
    K2, N = w_q.shape
    K = K2 * 2
    y = torch.empty(N, device=x.device, dtype=torch.bfloat16)
    bn, bk = 64, 128
    _w4_gemv_kernel[(triton.cdiv(N, bn),)](
        x, w_q, scales, zeros, y, K, N,
        w_q.stride(0), w_q.stride(1), scales.stride(0), scales.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_SIZE,
    )
    return y


def w4_gemv_quad(x, layers):
    q, k, v, g = layers
    K2, N = q.w_q.shape
    K = K2 * 2
    y0 = torch.empty(N, device=x.device, dtype=torch.bfloat16)
    y1 = torch.empty(N, device=x.device, dtype=torch.bfloat16)
    y2 = torch.empty(N, device=x.device, dtype=torch.bfloat16)
    y3 = torch.empty(N, device=x.device, dtype=torch.bfloat16)
    bn, bk = 64, 128
    _w4_gemv_quad_kernel[(triton.cdiv(N, bn),)](
        x,
        q.w_q, k.w_q, v.w_q, g.w_q,
        q.scales, k.scales, v.scales, g.scales,
        q.zeros, k.zeros, v.zeros, g.zeros,
        y0, y1, y2, y3,
        K, N,
        q.w_q.stride(0), q.w_q.stride(1), q.scales.stride(0), q.scales.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_SIZE,
    )
    return y0, y1, y2, y3


def w4_gemv_indexed(x, w_q, scales, zeros, idx):
    num = idx.numel()
    K2, N = w_q.shape[1], w_q.shape[2]
    K = K2 * 2
    y = torch.empty(num, N, device=x.device, dtype=torch.bfloat16)
    bn, bk = 64, 128
    grid_n = triton.cdiv(N, bn)
    _w4_gemv_indexed_kernel[(num * grid_n,)](
        x, w_q, scales, zeros, idx, y, K, N, num, grid_n,
        w_q.stride(0), w_q.stride(1), w_q.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2),
        y.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_SIZE,
    )
    return y


def w4_gemv_experts(x, w_q, scales, zeros, idx):
    return w4_gemv_indexed(x, w_q, scales, zeros, idx)


def w4_gemv_experts_rows(x_rows, w_q, scales, zeros, idx):
    """x_rows (NUM, K) with one row per indexed expert."""
    num, K = x_rows.shape
    K2, N = w_q.shape[1], w_q.shape[2]
    assert K == K2 * 2
    y = torch.empty(num, N, device=x_rows.device, dtype=torch.bfloat16)
    bn, bk = 64, 128
    grid_n = triton.cdiv(N, bn)
    _w4_batched_rows_kernel[(num * grid_n,)](
        x_rows, w_q, scales, zeros, idx, y, K, N, num, grid_n,
        x_rows.stride(0), x_rows.stride(1),
        w_q.stride(0), w_q.stride(1), w_q.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2),
        y.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, GROUP=GROUP_SIZE,
    )
    return y


def mla_qk_proj(q_nope, w_q, scales, zeros):
    H, D = q_nope.shape
    K = w_q.shape[0] * 2
    out = torch.empty(K, H, device=q_nope.device, dtype=torch.float32)
    _w4_qk_proj_kernel[(K, triton.cdiv(H, 8))](
        q_nope, w_q, scales, zeros, out, K, H, D,
        w_q.stride(0), w_q.stride(1), scales.stride(0), scales.stride(1),
        BLOCK_H=8, BLOCK_K=32, GROUP=GROUP_SIZE,
    )
    return out


def mla_pc_v(pc, w_q, scales, zeros, D):
    H, K = pc.shape
    out = torch.empty(H, D, device=pc.device, dtype=torch.bfloat16)
    _w4_pc_v_kernel[(triton.cdiv(H, 4), triton.cdiv(D, 32))](
        pc, w_q, scales, zeros, out, K, H, D,
        w_q.stride(0), w_q.stride(1), scales.stride(0), scales.stride(1),
        BLOCK_H=4, BLOCK_D=32, GROUP=GROUP_SIZE,
    )
    return out

"""Fused W4A16 int4 unpack + asymmetric dequant + GEMV/GEMM (batch=1 decode)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZE = 128
BLOCK_N = 256
NUM_WARPS = 8


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, K, N,
    stride_wq_k, stride_wq_n, stride_s_g, stride_s_n,
    wq_expert_stride, s_expert_stride, expert_id, y_row_stride,
    BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    wq_base = wq_ptr + expert_id * wq_expert_stride
    s_base = s_ptr + expert_id * s_expert_stride
    z_base = z_ptr + expert_id * s_expert_stride
    y_base = y_ptr + expert_id * y_row_stride
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed_per_group = GROUP_SIZE // 2
    for g in range(0, K // GROUP_SIZE):
        scale = tl.load(s_base + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_base + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        x_base = g * GROUP_SIZE
        for ki in range(0, packed_per_group):
            k_pair = g * packed_per_group + ki
            w_byte = tl.load(wq_base + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            dw_lo = ((w_byte & 0xF).to(tl.float32) - zero) * scale
            dw_hi = (((w_byte >> 4) & 0xF).to(tl.float32) - zero) * scale
            k_lo = x_base + ki * 2
            acc += tl.load(x_ptr + k_lo).to(tl.float32) * dw_lo
            acc += tl.load(x_ptr + k_lo + 1).to(tl.float32) * dw_hi
    tl.store(y_base + cols, acc, mask=mask)


@triton.jit
def _w4a16_batched_expert_gemv_kernel(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, expert_ids_ptr, K, N,
    stride_wq_e, stride_wq_k, stride_wq_n,
    stride_s_e, stride_s_g, stride_s_n, stride_y_e,
    BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert_id = tl.load(expert_ids_ptr + pid_e).to(tl.int32)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    wq_base = wq_ptr + expert_id * stride_wq_e
    s_base = s_ptr + expert_id * stride_s_e
    z_base = z_ptr + expert_id * stride_s_e
    y_base = y_ptr + pid_e * stride_y_e
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed_per_group = GROUP_SIZE // 2
    for g in range(0, K // GROUP_SIZE):
        scale = tl.load(s_base + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_base + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        x_base = g * GROUP_SIZE
        for ki in range(0, packed_per_group):
            k_pair = g * packed_per_group + ki
            w_byte = tl.load(wq_base + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            dw_lo = ((w_byte & 0xF).to(tl.float32) - zero) * scale
            dw_hi = (((w_byte >> 4) & 0xF).to(tl.float32) - zero) * scale
            k_lo = x_base + ki * 2
            acc += tl.load(x_ptr + k_lo).to(tl.float32) * dw_lo
            acc += tl.load(x_ptr + k_lo + 1).to(tl.float32) * dw_hi
    tl.store(y_base + cols, acc, mask=mask)


@triton.jit
def _w4a16_batched_expert_gemv_rows_kernel(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, expert_ids_ptr, K, N,
    stride_x_e, stride_x_k,
    stride_wq_e, stride_wq_k, stride_wq_n,
    stride_s_e, stride_s_g, stride_s_n, stride_y_e,
    BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert_id = tl.load(expert_ids_ptr + pid_e).to(tl.int32)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    x_base = x_ptr + pid_e * stride_x_e
    wq_base = wq_ptr + expert_id * stride_wq_e
    s_base = s_ptr + expert_id * stride_s_e
    z_base = z_ptr + expert_id * stride_s_e
    y_base = y_ptr + pid_e * stride_y_e
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed_per_group = GROUP_SIZE // 2
    for g in range(0, K // GROUP_SIZE):
        scale = tl.load(s_base + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(z_base + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        x_off = g * GROUP_SIZE
        for ki in range(0, packed_per_group):
            k_pair = g * packed_per_group + ki
            w_byte = tl.load(wq_base + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            dw_lo = ((w_byte & 0xF).to(tl.float32) - zero) * scale
            dw_hi = (((w_byte >> 4) & 0xF).to(tl.float32) - zero) * scale
            k_lo = x_off + ki * 2
            acc += tl.load(x_base + k_lo * stride_x_k).to(tl.float32) * dw_lo
            acc += tl.load(x_base + (k_lo + 1) * stride_x_k).to(tl.float32) * dw_hi
    tl.store(y_base + cols, acc, mask=mask)


@triton.jit
def _w4a16_quad_gemv_kernel(
    x_ptr,
    wq0_ptr, s0_ptr, z0_ptr, wq1_ptr, s1_ptr, z1_ptr,
    wq2_ptr, s2_ptr, z2_ptr, wq3_ptr, s3_ptr, z3_ptr,
    y0_ptr, y1_ptr, y2_ptr, y3_ptr,
    K, N, stride_wq_k, stride_wq_n, stride_s_g, stride_s_n,
    BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed_per_group = GROUP_SIZE // 2
    for g in range(0, K // GROUP_SIZE):
        s0 = tl.load(s0_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        z0 = tl.load(z0_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(s1_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        z1 = tl.load(z1_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(s2_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        z2 = tl.load(z2_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        s3 = tl.load(s3_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        z3 = tl.load(z3_ptr + g * stride_s_g + cols * stride_s_n, mask=mask, other=0.0).to(tl.float32)
        x_base = g * GROUP_SIZE
        for ki in range(0, packed_per_group):
            k_pair = g * packed_per_group + ki
            w0 = tl.load(wq0_ptr + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            w1 = tl.load(wq1_ptr + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            w2 = tl.load(wq2_ptr + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            w3 = tl.load(wq3_ptr + k_pair * stride_wq_k + cols * stride_wq_n, mask=mask, other=0)
            k_lo = x_base + ki * 2
            x_lo = tl.load(x_ptr + k_lo).to(tl.float32)
            x_hi = tl.load(x_ptr + k_lo + 1).to(tl.float32)
            acc0 += x_lo * (((w0 & 0xF).to(tl.float32) - z0) * s0) + x_hi * ((((w0 >> 4) & 0xF).to(tl.float32) - z0) * s0)
            acc1 += x_lo * (((w1 & 0xF).to(tl.float32) - z1) * s1) + x_hi * ((((w1 >> 4) & 0xF).to(tl.float32) - z1) * s1)
            acc2 += x_lo * (((w2 & 0xF).to(tl.float32) - z2) * s2) + x_hi * ((((w2 >> 4) & 0xF).to(tl.float32) - z2) * s2)
            acc3 += x_lo * (((w3 & 0xF).to(tl.float32) - z3) * s3) + x_hi * ((((w3 >> 4) & 0xF).to(tl.float32) - z3) * s3)
    tl.store(y0_ptr + cols, acc0, mask=mask)
    tl.store(y1_ptr + cols, acc1, mask=mask)
    tl.store(y2_ptr + cols, acc2, mask=mask)
    tl.store(y3_ptr + cols, acc3, mask=mask)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, M, K, N,
    stride_xm, stride_xk, stride_ym, stride_yn,
    stride_wq_k, stride_wq_n, stride_s_g, stride_s_n,
    wq_expert_stride, s_expert_stride, expert_id,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    wq_base = wq_ptr + expert_id * wq_expert_stride
    s_base = s_ptr + expert_id * s_expert_stride
    z_base = z_ptr + expert_id * s_expert_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    packed_per_group = GROUP_SIZE // 2
    for g in range(0, K // GROUP_SIZE):
        scale = tl.load(s_base + g * stride_s_g + cols[None, :] * stride_s_n, mask=col_mask[None, :], other=0.0).to(tl.float32)
        zero = tl.load(z_base + g * stride_s_g + cols[None, :] * stride_s_n, mask=col_mask[None, :], other=0.0).to(tl.float32)
        x_base = g * GROUP_SIZE
        for ki in range(0, packed_per_group):
            k_pair = g * packed_per_group + ki
            w_byte = tl.load(wq_base + k_pair * stride_wq_k + cols[None, :] * stride_wq_n, mask=col_mask[None, :], other=0)
            dw_lo = ((w_byte & 0xF).to(tl.float32) - zero) * scale
            dw_hi = (((w_byte >> 4) & 0xF).to(tl.float32) - zero) * scale
            k_lo = x_base + ki * 2
            x_lo = tl.load(x_ptr + rows[:, None] * stride_xm + k_lo * stride_xk, mask=row_mask[:, None], other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + rows[:, None] * stride_xm + (k_lo + 1) * stride_xk, mask=row_mask[:, None], other=0.0).to(tl.float32)
            acc += x_lo * dw_lo + x_hi * dw_hi
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, acc, mask=row_mask[:, None] & col_mask[None, :])


def _launch_gemv(x, w_q, scales, zeros, K, N, expert_id=0, out=None):
    if out is None:
        out = torch.empty(N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(N, BLOCK_N),)
    _w4a16_gemv_kernel[grid](
        x, w_q, scales, zeros, out, K, N,
        w_q.stride(-2), w_q.stride(-1), scales.stride(-2), scales.stride(-1),
        w_q.stride(0) if w_q.ndim == 3 else 0, scales.stride(0) if scales.ndim == 3 else 0,
        expert_id, out.stride(0) if out.ndim == 1 else out.stride(0),
        BLOCK_N=BLOCK_N, GROUP_SIZE=GROUP_SIZE, num_warps=NUM_WARPS,
    )
    return out


def _launch_batched_expert_gemv(x, w_q, scales, zeros, expert_ids, K, N, out=None):
    e = expert_ids.shape[0]
    if out is None:
        out = torch.empty(e, N, device=x.device, dtype=torch.float32)
    grid = (e, triton.cdiv(N, BLOCK_N))
    _w4a16_batched_expert_gemv_kernel[grid](
        x, w_q, scales, zeros, out, expert_ids, K, N,
        w_q.stride(0), w_q.stride(1), w_q.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2), out.stride(0),
        BLOCK_N=BLOCK_N, GROUP_SIZE=GROUP_SIZE, num_warps=NUM_WARPS,
    )
    return out


def _launch_batched_expert_gemv_rows(x, w_q, scales, zeros, expert_ids, K, N, out=None):
    e = expert_ids.shape[0]
    if out is None:
        out = torch.empty(e, N, device=x.device, dtype=torch.float32)
    grid = (e, triton.cdiv(N, BLOCK_N))
    _w4a16_batched_expert_gemv_rows_kernel[grid](
        x, w_q, scales, zeros, out, expert_ids, K, N,
        x.stride(0), x.stride(1),
        w_q.stride(0), w_q.stride(1), w_q.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2), out.stride(0),
        BLOCK_N=BLOCK_N, GROUP_SIZE=GROUP_SIZE, num_warps=NUM_WARPS,
    )
    return out


def _launch_quad_gemv(x, layers, K, N):
    outs = [torch.empty(N, device=x.device, dtype=torch.float32) for _ in range(4)]
    grid = (triton.cdiv(N, BLOCK_N),)
    _w4a16_quad_gemv_kernel[grid](
        x, layers[0].w_q, layers[0].scales, layers[0].zeros,
        layers[1].w_q, layers[1].scales, layers[1].zeros,
        layers[2].w_q, layers[2].scales, layers[2].zeros,
        layers[3].w_q, layers[3].scales, layers[3].zeros,
        outs[0], outs[1], outs[2], outs[3], K, N,
        layers[0].w_q.stride(-2), layers[0].w_q.stride(-1),
        layers[0].scales.stride(-2), layers[0].scales.stride(-1),
        BLOCK_N=BLOCK_N, GROUP_SIZE=GROUP_SIZE, num_warps=NUM_WARPS,
    )
    return tuple(o.to(torch.bfloat16) for o in outs)


def _launch_gemm(x, w_q, scales, zeros, K, N, expert_id=0, out=None):
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, N, device=x.device, dtype=torch.float32)
    block_m, block_n = 16, 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(N, block_n))
    _w4a16_gemm_kernel[grid](
        x, w_q, scales, zeros, out, m, K, N,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        w_q.stride(-2), w_q.stride(-1), scales.stride(-2), scales.stride(-1),
        w_q.stride(0) if w_q.ndim == 3 else 0, scales.stride(0) if scales.ndim == 3 else 0,
        expert_id, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_SIZE=GROUP_SIZE, num_warps=NUM_WARPS,
    )
    return out


def w4a16_linear(x, w_q, scales, zeros, in_f, out_f):
    return _launch_gemv(x.contiguous(), w_q, scales, zeros, in_f, out_f).to(torch.bfloat16)


def w4a16_linear_matmul(x, w_q, scales, zeros, in_f, out_f):
    if x.ndim == 1:
        return w4a16_linear(x, w_q, scales, zeros, in_f, out_f)
    if x.shape[0] == 1:
        return w4a16_linear(x[0], w_q, scales, zeros, in_f, out_f).unsqueeze(0)
    return _launch_gemm(x.contiguous(), w_q, scales, zeros, in_f, out_f).to(torch.bfloat16)


def w4a16_experts_gemv(x, w_q, scales, zeros, expert_ids, in_f, out_f):
    return _launch_batched_expert_gemv(x.contiguous(), w_q, scales, zeros, expert_ids, in_f, out_f).to(torch.bfloat16)


def w4a16_experts_gemv_rows(x, w_q, scales, zeros, expert_ids, in_f, out_f):
    return _launch_batched_expert_gemv_rows(x.contiguous(), w_q, scales, zeros, expert_ids, in_f, out_f).to(torch.bfloat16)


def w4a16_quad_linear(x, layers):
    return _launch_quad_gemv(x.contiguous(), layers, layers[0].in_f, layers[0].out_f)

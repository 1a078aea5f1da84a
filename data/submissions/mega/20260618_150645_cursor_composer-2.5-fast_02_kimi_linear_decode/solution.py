"""Fused W4A16 Kimi-Linear decode: Triton int4 dequant-GEMV + MLA absorption."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

EPS = 1.0e-6
GROUP_SIZE = 128


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    ],
    key=["M", "N", "K"],
)
@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    w_q_ptr,
    scales_ptr,
    zeros_ptr,
    out_ptr,
    M,
    N,
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
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_groups: tl.constexpr = K // GROUP_SIZE
    k_steps: tl.constexpr = GROUP_SIZE // BLOCK_K
    for g in tl.static_range(n_groups):
        g_k = g * GROUP_SIZE
        scale = tl.load(
            scales_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0
        ).to(tl.float32)
        zero = tl.load(
            zeros_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0.0
        ).to(tl.float32)
        for step in tl.static_range(k_steps):
            k_base = g_k + step * BLOCK_K
            offs_k = k_base + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            ).to(tl.bfloat16)
            packed_row = offs_k // 2
            is_odd = (offs_k & 1).to(tl.int32)
            w_packed = tl.load(
                w_q_ptr + packed_row[:, None] * stride_wqk + offs_n[None, :] * stride_wqn,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0,
            )
            w_lo = (w_packed & 0xF).to(tl.int32)
            w_hi = ((w_packed >> 4) & 0xF).to(tl.int32)
            w_int4 = tl.where(is_odd[:, None] == 0, w_lo, w_hi).to(tl.float32)
            w_bf = ((w_int4 - zero[None, :]) * scale[None, :]).to(tl.bfloat16)
            acc += tl.dot(x, w_bf, out_dtype=tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(tl.bfloat16),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 256, "BLOCK_K": 128}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    ],
    key=["N", "K", "BATCH"],
)
@triton.jit
def _w4a16_batch_gemv_kernel(
    x_ptr,
    w_q_ptr,
    scales_ptr,
    zeros_ptr,
    idx_ptr,
    out_ptr,
    N,
    stride_xm,
    stride_xk,
    stride_wqE,
    stride_wqk,
    stride_wqn,
    stride_sE,
    stride_sg,
    stride_sn,
    stride_zE,
    stride_zg,
    stride_zn,
    stride_om,
    stride_on,
    K: tl.constexpr,
    BATCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(idx_ptr + pid_e).to(tl.int32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    n_groups: tl.constexpr = K // GROUP_SIZE
    k_steps: tl.constexpr = GROUP_SIZE // BLOCK_K
    for g in tl.static_range(n_groups):
        g_k = g * GROUP_SIZE
        scale = tl.load(
            scales_ptr + e * stride_sE + g * stride_sg + offs_n * stride_sn,
            mask=mask_n,
            other=0.0,
        ).to(tl.float32)
        zero = tl.load(
            zeros_ptr + e * stride_zE + g * stride_zg + offs_n * stride_zn,
            mask=mask_n,
            other=0.0,
        ).to(tl.float32)
        for step in tl.static_range(k_steps):
            k_base = g_k + step * BLOCK_K
            offs_k = k_base + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(
                x_ptr + pid_e * stride_xm + offs_k * stride_xk,
                mask=mask_k,
                other=0.0,
            ).to(tl.bfloat16)
            packed_row = offs_k // 2
            is_odd = (offs_k & 1).to(tl.int32)
            w_packed = tl.load(
                w_q_ptr + e * stride_wqE + packed_row[:, None] * stride_wqk + offs_n[None, :] * stride_wqn,
                mask=mask_k[:, None] & mask_n[None, :],
                other=0,
            )
            w_lo = (w_packed & 0xF).to(tl.int32)
            w_hi = ((w_packed >> 4) & 0xF).to(tl.int32)
            w_int4 = tl.where(is_odd[:, None] == 0, w_lo, w_hi).to(tl.float32)
            w_bf = ((w_int4 - zero[None, :]) * scale[None, :]).to(tl.bfloat16)
            acc += tl.sum(x[:, None].to(tl.float32) * w_bf.to(tl.float32), axis=0)
    tl.store(out_ptr + pid_e * stride_om + offs_n * stride_on, acc.to(tl.bfloat16), mask=mask_n)


def _launch_gemm(x, w_q, scales, zeros, out):
    M, K = x.shape
    Kh, N = w_q.shape
    assert Kh * 2 == K
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
    _w4a16_gemm_kernel[grid](
        x,
        w_q,
        scales,
        zeros,
        out,
        M,
        N,
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
        K=K,
        GROUP_SIZE=GROUP_SIZE,
    )


def _gemv(x, wq, scl, zer, K, N, group=128):
    xm = x.unsqueeze(0) if x.ndim == 1 else x
    y = torch.empty((xm.shape[0], N), device=x.device, dtype=torch.bfloat16)
    _launch_gemm(xm.contiguous(), wq, scl, zer, y)
    return y.squeeze(0)


def _batch_gemv(x, w_q, scales, zeros, idx, K, N, group=128):
    batch = idx.numel()
    if x.ndim == 1:
        xm = x.unsqueeze(0).expand(batch, -1).contiguous()
        stride_xm = 0
    else:
        xm = x.contiguous()
        stride_xm = xm.stride(0)
    out = torch.empty((batch, N), device=x.device, dtype=torch.bfloat16)
    grid = lambda meta: (batch, triton.cdiv(N, meta["BLOCK_N"]))
    _w4a16_batch_gemv_kernel[grid](
        xm,
        w_q,
        scales,
        zeros,
        idx,
        out,
        N,
        stride_xm,
        xm.stride(-1),
        w_q.stride(0),
        w_q.stride(1),
        w_q.stride(2),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        zeros.stride(0),
        zeros.stride(1),
        zeros.stride(2),
        out.stride(0),
        out.stride(1),
        K=K,
        BATCH=batch,
        GROUP_SIZE=group,
    )
    return out


def _unpack(wq, K):
    out = torch.empty((K, wq.shape[1]), dtype=torch.uint8, device=wq.device)
    out[0::2] = wq & 0xF
    out[1::2] = (wq >> 4) & 0xF
    return out


def _dequant(wq, scl, zer, K, group):
    wu = _unpack(wq, K).to(torch.bfloat16)
    s = scl.repeat_interleave(group, dim=0)
    z = zer.repeat_interleave(group, dim=0)
    return (wu - z) * s


class QuantLinear(nn.Module):
    def __init__(self, in_f, out_f, group=128):
        super().__init__()
        self.in_f, self.out_f, self.group = in_f, out_f, group
        ng = in_f // group
        self.register_buffer("w_q", torch.zeros(in_f // 2, out_f, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(ng, out_f, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(ng, out_f, dtype=torch.bfloat16))

    def gemv(self, x):
        return _gemv(x, self.w_q, self.scales, self.zeros, self.in_f, self.out_f, self.group)

    def weight_bf(self):
        return _dequant(self.w_q, self.scales, self.zeros, self.in_f, self.group)


class QuantExperts(nn.Module):
    def __init__(self, n, in_f, out_f, group=128):
        super().__init__()
        self.n, self.in_f, self.out_f, self.group = n, in_f, out_f, group
        ng = in_f // group
        self.register_buffer("w_q", torch.zeros(n, in_f // 2, out_f, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(n, ng, out_f, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(n, ng, out_f, dtype=torch.bfloat16))

    def gemv(self, x, e):
        return _gemv(x, self.w_q[e], self.scales[e], self.zeros[e], self.in_f, self.out_f, self.group)

    def batch_gemv(self, x, idx):
        return _batch_gemv(x, self.w_q, self.scales, self.zeros, idx, self.in_f, self.out_f, self.group)


def _rmsnorm(x, w):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * w.float()).to(x.dtype)


def _rope_cossin(pos, dim, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    ang = pos * inv
    return torch.cos(ang), torch.sin(ang)


def _apply_rope(x, cos, sin):
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.empty_like(xf)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out.to(x.dtype)


class KDA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, Dk, d = cfg.kda_heads, cfg.kda_head_dim, cfg.hidden
        self.q_proj = QuantLinear(d, H * Dk, cfg.group)
        self.k_proj = QuantLinear(d, H * Dk, cfg.group)
        self.v_proj = QuantLinear(d, H * Dk, cfg.group)
        self.g_proj = QuantLinear(d, H * Dk, cfg.group)
        self.beta_proj = nn.Linear(d, H, bias=False, dtype=cfg.dtype)
        self.conv_w = nn.Parameter(torch.empty(3, H * Dk, cfg.short_conv, dtype=cfg.dtype))
        self.o_proj = QuantLinear(H * Dk, d, cfg.group)
        self.scale = Dk ** -0.5

    def _short_conv(self, val, prev, idx):
        win = torch.cat([prev, val[None]], dim=0)
        w = self.conv_w[idx].float().transpose(0, 1)
        out = (win.float() * w).sum(0)
        return F.silu(out).to(val.dtype), win[1:]

    def step(self, x, st):
        H, Dk = self.cfg.kda_heads, self.cfg.kda_head_dim
        q = self.q_proj.gemv(x)
        k = self.k_proj.gemv(x)
        v = self.v_proj.gemv(x)
        q, st["cq"] = self._short_conv(q, st["cq"], 0)
        k, st["ck"] = self._short_conv(k, st["ck"], 1)
        v, st["cv"] = self._short_conv(v, st["cv"], 2)
        q = q.view(H, Dk).float() * self.scale
        k = k.view(H, Dk).float()
        v = v.view(H, Dk).float()
        g = (-F.softplus(self.g_proj.gemv(x).float())).view(H, Dk)
        beta = torch.sigmoid(self.beta_proj(x).float())
        S = st["S"] * g.exp()[:, :, None]
        pred = (S * k[:, :, None]).sum(1)
        S = S + beta[:, None, None] * k[:, :, None] * (v - pred)[:, None, :]
        o = (S * q[:, :, None]).sum(1)
        st["S"] = S
        return self.o_proj.gemv(o.reshape(H * Dk).to(torch.bfloat16))


class MLA(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, d = cfg.mla_heads, cfg.hidden
        self.q_proj = QuantLinear(d, H * (cfg.qk_nope + cfg.qk_rope), cfg.group)
        self.kv_a = QuantLinear(d, cfg.kv_lora + cfg.qk_rope, cfg.group)
        self.kv_b = QuantLinear(cfg.kv_lora, H * (cfg.qk_nope + cfg.v_head), cfg.group)
        self.o_proj = QuantLinear(H * cfg.v_head, d, cfg.group)
        self.scale = (cfg.qk_nope + cfg.qk_rope) ** -0.5
        self._w_k: torch.Tensor | None = None
        self._w_v: torch.Tensor | None = None

    def _absorb_weights(self):
        if self._w_k is not None:
            return self._w_k, self._w_v
        cfg = self.cfg
        H, nope, vh, lora = cfg.mla_heads, cfg.qk_nope, cfg.v_head, cfg.kv_lora
        w = self.kv_b.weight_bf().view(lora, H, nope + vh).float()
        self._w_k = w[:, :, :nope].contiguous()
        self._w_v = w[:, :, nope:].contiguous()
        return self._w_k, self._w_v

    def step(self, x, st):
        cfg = self.cfg
        H, nope, vh, lora = cfg.mla_heads, cfg.qk_nope, cfg.v_head, cfg.kv_lora
        pos = st["c_kv"].shape[0]
        q = self.q_proj.gemv(x).view(H, nope + cfg.qk_rope)
        q_nope = q[:, :nope].float()
        q_rope = q[:, nope:]
        kv = self.kv_a.gemv(x)
        c_kv = kv[:lora]
        k_rope = kv[lora:]
        cos, sin = _rope_cossin(pos, cfg.qk_rope, cfg.rope_theta, x.device)
        q_rope = _apply_rope(q_rope, cos, sin).float()
        k_rope = _apply_rope(k_rope, cos, sin)
        st["c_kv"] = torch.cat([st["c_kv"], c_kv[None]], 0)
        st["k_rope"] = torch.cat([st["k_rope"], k_rope[None]], 0)
        ckv = st["c_kv"].float()
        w_k, w_v = self._absorb_weights()
        q_abs = torch.einsum("hn,lhn->hl", q_nope, w_k)
        k_rope_f = st["k_rope"].float()
        scores = (ckv @ q_abs.T + k_rope_f @ q_rope.T) * self.scale
        p = torch.softmax(scores, dim=0)
        ctx = p.T @ ckv
        o = torch.einsum("hl,lhv->hv", ctx, w_v)
        return self.o_proj.gemv(o.reshape(H * vh).to(torch.bfloat16))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, m, E = cfg.hidden, cfg.moe_inter, cfg.n_experts
        self.router = nn.Linear(d, E, bias=False, dtype=cfg.dtype)
        self.gate = QuantExperts(E, d, m, cfg.group)
        self.up = QuantExperts(E, d, m, cfg.group)
        self.down = QuantExperts(E, m, d, cfg.group)
        self.s_gate = QuantExperts(cfg.n_shared, d, m, cfg.group)
        self.s_up = QuantExperts(cfg.n_shared, d, m, cfg.group)
        self.s_down = QuantExperts(cfg.n_shared, m, d, cfg.group)

    def step(self, x):
        cfg = self.cfg
        probs = torch.softmax(self.router(x).float(), dim=-1)
        wts, idx = torch.topk(probs, cfg.n_active)
        wts = (wts / (wts.sum() + 1e-9) * cfg.routed_scaling).to(x.dtype)
        g = self.gate.batch_gemv(x, idx)
        u = self.up.batch_gemv(x, idx)
        hh = (F.silu(g.float()) * u.float()).to(torch.bfloat16)
        d = self.down.batch_gemv(hh, idx)
        out = (wts[:, None] * d.float()).sum(0)
        sidx = torch.arange(cfg.n_shared, device=x.device)
        sg = self.s_gate.batch_gemv(x, sidx)
        su = self.s_up.batch_gemv(x, sidx)
        sh = (F.silu(sg.float()) * su.float()).to(torch.bfloat16)
        sd = self.s_down.batch_gemv(sh, sidx)
        out = out + sd.float().sum(0)
        return out.to(torch.bfloat16)


class Block(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=cfg.dtype))
        self.moe_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=cfg.dtype))
        self.attn = KDA(cfg) if kind == "K" else MLA(cfg)
        self.moe = MoE(cfg)

    def step(self, x, st):
        h = x + self.attn.step(_rmsnorm(x, self.attn_norm), st)
        return h + self.moe.step(_rmsnorm(h, self.moe_norm))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg, k) for k in cfg.pattern)

    def step(self, hidden, state):
        for i, blk in enumerate(self.blocks):
            hidden = blk.step(hidden, state[i])
        return hidden, state

"""Fused W4A16 Kimi-Linear hybrid decode unit — custom int4 dequant-GEMV kernels."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from w4a16_kernels import (
    GROUP_SIZE,
    w4a16_experts_gemv,
    w4a16_experts_gemv_rows,
    w4a16_linear,
    w4a16_linear_matmul,
    w4a16_quad_linear,
)

OP_TYPE = "kimi_linear_w4a16_decode"
HARDWARE_REQUIRED = ["RTX_PRO_6000"]
EPS = 1.0e-6


@dataclass(frozen=True)
class Config:
    hidden: int = 2304
    kda_heads: int = 32
    kda_head_dim: int = 128
    short_conv: int = 4
    mla_heads: int = 32
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    rope_theta: float = 10000.0
    n_experts: int = 64
    n_active: int = 8
    n_shared: int = 1
    moe_inter: int = 1024
    routed_scaling: float = 2.446
    group: int = 128
    pattern: tuple = ("K", "K", "K", "M")
    dtype: torch.dtype = field(default=torch.bfloat16)


def build_config(shape: dict) -> Config:
    return Config(n_experts=int(shape.get("n_experts", 64)))


def _pack_int4(w_q: torch.Tensor) -> torch.Tensor:
    lo = w_q[0::2] & 0xF
    hi = w_q[1::2] & 0xF
    return (lo | (hi << 4)).contiguous()


def quantize(w_io: torch.Tensor, group: int = GROUP_SIZE):
    K, N = w_io.shape
    ng = K // group
    wg = w_io.view(ng, group, N).float()
    wmin = wg.min(dim=1, keepdim=True).values
    wmax = wg.max(dim=1, keepdim=True).values
    scales = (wmax - wmin).clamp_min(1e-8) / 15.0
    zeros = (-wmin / scales).round().clamp(0, 15)
    w_q = ((wg / scales) + zeros).round().clamp(0, 15).to(torch.uint8).view(K, N)
    return _pack_int4(w_q), scales.squeeze(1).to(torch.bfloat16), zeros.squeeze(1).to(torch.bfloat16)


class QuantLinear(nn.Module):
    def __init__(self, in_f: int, out_f: int, group: int = GROUP_SIZE):
        super().__init__()
        assert in_f % group == 0 and in_f % 2 == 0
        self.in_f, self.out_f, self.group = in_f, out_f, group
        ng = in_f // group
        self.register_buffer("w_q", torch.zeros(in_f // 2, out_f, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(ng, out_f, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(ng, out_f, dtype=torch.bfloat16))

    def init_random(self, gen: torch.Generator, std: float = 0.02) -> None:
        w = torch.randn(self.in_f, self.out_f, generator=gen) * std
        wq, s, z = quantize(w, self.group)
        self.w_q.copy_(wq)
        self.scales.copy_(s)
        self.zeros.copy_(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 1:
            return w4a16_linear(x, self.w_q, self.scales, self.zeros, self.in_f, self.out_f)
        return w4a16_linear_matmul(x, self.w_q, self.scales, self.zeros, self.in_f, self.out_f)


class QuantExperts(nn.Module):
    def __init__(self, n: int, in_f: int, out_f: int, group: int = GROUP_SIZE):
        super().__init__()
        self.n, self.in_f, self.out_f, self.group = n, in_f, out_f, group
        ng = in_f // group
        self.register_buffer("w_q", torch.zeros(n, in_f // 2, out_f, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(n, ng, out_f, dtype=torch.bfloat16))
        self.register_buffer("zeros", torch.zeros(n, ng, out_f, dtype=torch.bfloat16))

    def init_random(self, gen: torch.Generator, std: float = 0.02) -> None:
        for e in range(self.n):
            w = torch.randn(self.in_f, self.out_f, generator=gen) * std
            wq, s, z = quantize(w, self.group)
            self.w_q[e].copy_(wq)
            self.scales[e].copy_(s)
            self.zeros[e].copy_(z)


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (xf * w.float()).to(x.dtype)


def _rope_cossin(pos: int, dim: int, theta: float, device):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    ang = pos * inv
    return torch.cos(ang), torch.sin(ang)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.empty_like(xf)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out.to(x.dtype)


class KDA(nn.Module):
    def __init__(self, cfg: Config):
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
        q, k, v, g = w4a16_quad_linear(
            x, (self.q_proj, self.k_proj, self.v_proj, self.g_proj)
        )
        q, st["cq"] = self._short_conv(q, st["cq"], 0)
        k, st["ck"] = self._short_conv(k, st["ck"], 1)
        v, st["cv"] = self._short_conv(v, st["cv"], 2)
        q = q.view(H, Dk).float() * self.scale
        k = k.view(H, Dk).float()
        v = v.view(H, Dk).float()
        g = (-F.softplus(g.float())).view(H, Dk)
        beta = torch.sigmoid(self.beta_proj(x).float())
        S = st["S"] * g.exp()[:, :, None]
        pred = (S * k[:, :, None]).sum(1)
        S = S + beta[:, None, None] * k[:, :, None] * (v - pred)[:, None, :]
        o = (S * q[:, :, None]).sum(1)
        st["S"] = S
        return self.o_proj(o.reshape(H * Dk).to(torch.bfloat16))


class MLA(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        H, d = cfg.mla_heads, cfg.hidden
        self.q_proj = QuantLinear(d, H * (cfg.qk_nope + cfg.qk_rope), cfg.group)
        self.kv_a = QuantLinear(d, cfg.kv_lora + cfg.qk_rope, cfg.group)
        self.kv_b = QuantLinear(cfg.kv_lora, H * (cfg.qk_nope + cfg.v_head), cfg.group)
        self.o_proj = QuantLinear(H * cfg.v_head, d, cfg.group)
        self.scale = (cfg.qk_nope + cfg.qk_rope) ** -0.5

    def _setup_bufs(self, st):
        if "pos" in st:
            return
        cfg = self.cfg
        pos = st["c_kv"].shape[0]
        cap = pos + 512
        dev, dtype = st["c_kv"].device, st["c_kv"].dtype
        st["c_kv_buf"] = torch.empty(cap, cfg.kv_lora, device=dev, dtype=dtype)
        st["k_rope_buf"] = torch.empty(cap, cfg.qk_rope, device=dev, dtype=dtype)
        st["k_nope_buf"] = torch.empty(cap, cfg.mla_heads, cfg.qk_nope, device=dev, dtype=torch.float32)
        st["v_buf"] = torch.empty(cap, cfg.mla_heads, cfg.v_head, device=dev, dtype=torch.float32)
        st["c_kv_buf"][:pos] = st["c_kv"]
        st["k_rope_buf"][:pos] = st["k_rope"]
        st["pos"] = pos
        st["cap"] = cap

    def _ensure_kv_cache(self, st):
        if "k_nope" in st:
            return
        cfg = self.cfg
        H = cfg.mla_heads
        pos = st["pos"]
        kvb = self.kv_b(st["c_kv_buf"][:pos]).view(-1, H, cfg.qk_nope + cfg.v_head).float()
        st["k_nope_buf"][:pos] = kvb[..., : cfg.qk_nope]
        st["v_buf"][:pos] = kvb[..., cfg.qk_nope :]

    def step(self, x, st):
        cfg = self.cfg
        H = cfg.mla_heads
        self._setup_bufs(st)
        pos = st["pos"]
        q = self.q_proj(x).view(H, cfg.qk_nope + cfg.qk_rope)
        q_nope = q[:, : cfg.qk_nope].float()
        q_rope = q[:, cfg.qk_nope :]
        kv = self.kv_a(x)
        c_kv = kv[: cfg.kv_lora]
        k_rope = kv[cfg.kv_lora :]
        cos, sin = _rope_cossin(pos, cfg.qk_rope, cfg.rope_theta, x.device)
        q_rope = _apply_rope(q_rope, cos, sin).float()
        k_rope = _apply_rope(k_rope, cos, sin)
        self._ensure_kv_cache(st)
        if pos >= st["cap"]:
            extra = 256
            st["c_kv_buf"] = torch.cat([st["c_kv_buf"], torch.empty(extra, cfg.kv_lora, device=x.device, dtype=st["c_kv_buf"].dtype)], 0)
            st["k_rope_buf"] = torch.cat([st["k_rope_buf"], torch.empty(extra, cfg.qk_rope, device=x.device, dtype=st["k_rope_buf"].dtype)], 0)
            st["k_nope_buf"] = torch.cat([st["k_nope_buf"], torch.empty(extra, H, cfg.qk_nope, device=x.device, dtype=torch.float32)], 0)
            st["v_buf"] = torch.cat([st["v_buf"], torch.empty(extra, H, cfg.v_head, device=x.device, dtype=torch.float32)], 0)
            st["cap"] += extra
        st["c_kv_buf"][pos] = c_kv
        st["k_rope_buf"][pos] = k_rope
        new_kvb = self.kv_b(c_kv).view(H, cfg.qk_nope + cfg.v_head).float()
        st["k_nope_buf"][pos] = new_kvb[..., : cfg.qk_nope]
        st["v_buf"][pos] = new_kvb[..., cfg.qk_nope :]
        pos += 1
        st["pos"] = pos
        st["c_kv"] = st["c_kv_buf"][:pos]
        st["k_rope"] = st["k_rope_buf"][:pos]
        st["k_nope"] = st["k_nope_buf"][:pos]
        st["v"] = st["v_buf"][:pos]

        scores = (
            torch.einsum("hd,lhd->lh", q_nope, st["k_nope"])
            + torch.einsum("hd,ld->lh", q_rope, st["k_rope"].float())
        ) * self.scale
        p = torch.softmax(scores, dim=0)
        o = torch.einsum("lh,lhd->hd", p, st["v"])
        return self.o_proj(o.reshape(H * cfg.v_head).to(torch.bfloat16))


class MoE(nn.Module):
    def __init__(self, cfg: Config):
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

    @staticmethod
    def _ffn_batch(x, gate, up, down, expert_ids):
        g = w4a16_experts_gemv(x, gate.w_q, gate.scales, gate.zeros, expert_ids, gate.in_f, gate.out_f)
        u = w4a16_experts_gemv(x, up.w_q, up.scales, up.zeros, expert_ids, up.in_f, up.out_f)
        h = F.silu(g.float()) * u.float()
        return w4a16_experts_gemv_rows(
            h, down.w_q, down.scales, down.zeros, expert_ids, down.in_f, down.out_f
        )

    def step(self, x):
        cfg = self.cfg
        probs = torch.softmax(self.router(x).float(), dim=-1)
        w, idx = torch.topk(probs, cfg.n_active)
        w = w / (w.sum() + 1e-9) * cfg.routed_scaling
        routed = self._ffn_batch(x, self.gate, self.up, self.down, idx)
        out = (w[:, None].float() * routed.float()).sum(0)
        sidx = torch.arange(cfg.n_shared, device=x.device)
        shared = self._ffn_batch(x, self.s_gate, self.s_up, self.s_down, sidx).sum(0)
        return (out + shared).to(torch.bfloat16)


class Block(nn.Module):
    def __init__(self, cfg: Config, kind: str):
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
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg, k) for k in cfg.pattern)

    def step(self, hidden, state):
        for i, blk in enumerate(self.blocks):
            hidden = blk.step(hidden, state[i])
        return hidden, state

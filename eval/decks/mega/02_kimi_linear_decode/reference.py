"""Batch-1 W4A16 decode of one Kimi-Linear block: the oracle for mega/02_kimi_linear_decode.

Written for kernelboard from KernelBench-Mega's definition of the problem (same module interface,
state-dict keys, state layout, value distributions and arithmetic), not from its code. The block is
four layers [KDA, KDA, KDA, MLA], each followed by a 64-expert MoE; `Model.step(hidden, state)`
consumes one token and returns the next hidden vector and the advanced state (the same list,
its dicts updated in place, as the original does).

Numerics that decide verdicts and are kept on purpose:
- int4 weights are dequantised in bf16 arithmetic ((code − zero) is exact, × scale rounds to bf16),
  then every projection accumulates in fp32 and rounds its output to bf16;
- the KDA recurrent state S is fp32; the conv windows and the MLA caches are bf16;
- the MoE sums its experts in fp32 (the SwiGLU product is not rounded before the down projection);
- the MLA layer up-projects the whole latent cache with kv_b every step (materialised, not absorbed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

OP_TYPE = "kimi_linear_w4a16_decode"
SUPPORTED_PRECISIONS = ["int4_bf16"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]

GROUP_SIZE = 128  # int4 group along the input dimension
EPS = 1.0e-6  # RMSNorm epsilon
WEIGHT_SEED = 1234  # every weight is drawn from one generator with this seed

# Shape globals (problem.yaml `shape_globals`): the grader sets them before get_init_inputs/get_inputs.
HIDDEN = 2304
KDA_HEADS = 32
KDA_HEAD_DIM = 128
MLA_HEADS = 32
KV_LORA = 512
QK_NOPE = 128
QK_ROPE = 64
V_HEAD = 128
N_EXPERTS = 64
N_ACTIVE = 8
MOE_INTER = 1024
CONTEXT_LEN = 2048
STEPS = 32

_SHAPE_KEYS = {"hidden": "HIDDEN", "kda_heads": "KDA_HEADS", "kda_head_dim": "KDA_HEAD_DIM",
               "mla_heads": "MLA_HEADS", "kv_lora": "KV_LORA", "qk_nope": "QK_NOPE", "qk_rope": "QK_ROPE",
               "v_head": "V_HEAD", "n_experts": "N_EXPERTS", "n_active": "N_ACTIVE", "moe_inter": "MOE_INTER"}


@dataclass(frozen=True)
class Config:
    """The block's dimensions; field names are KernelBench-Mega's (solutions read them)."""

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
    group: int = GROUP_SIZE
    pattern: tuple[str, ...] = ("K", "K", "K", "M")
    dtype: torch.dtype = field(default=torch.bfloat16)

    def __post_init__(self) -> None:
        for name in ("hidden", "moe_inter", "kv_lora"):
            if getattr(self, name) % self.group:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of the group size {self.group}")
        for name, value in (("kda_heads*kda_head_dim", self.kda_heads * self.kda_head_dim),
                            ("mla_heads*v_head", self.mla_heads * self.v_head)):
            if value % self.group:
                raise ValueError(f"{name}={value} must be a multiple of the group size {self.group}")
        if self.qk_rope % 2:
            raise ValueError(f"qk_rope={self.qk_rope} must be even (RoPE rotates pairs)")
        if not 0 < self.n_active <= self.n_experts:
            raise ValueError(f"n_active={self.n_active} must be in 1..n_experts={self.n_experts}")


def build_config(shape: Mapping[str, int]) -> Config:
    """A Config from a shape's parameters; keys it does not name keep the real model's value."""
    return replace(Config(), **{k: int(v) for k, v in shape.items() if k in _SHAPE_KEYS})


# ----------------------------------------------------------------------------------------------
# W4A16 format: KernelBench-Hard 07's (hard-deck-interface.md B.6): per (in, out) weight, codes
# packed two per byte along `in` (even row low nibble), bf16 scale and zero per 128 rows.
# ----------------------------------------------------------------------------------------------
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(..., K, N) uint8 codes 0..15 -> (..., K/2, N): row 2r in the low nibble, row 2r+1 in the high."""
    return codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(..., K/2, N) uint8 -> (..., K, N) uint8 codes, the inverse of `pack_int4`."""
    *lead, rows, cols = packed.shape
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2).reshape(*lead, 2 * rows, cols)


def quantize(w: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of (..., K, N) fp32 weights, per `group` rows: (packed, scales bf16, zeros bf16).

    scale = (max − min)/15 (at least 1e-8/15), zero = round(−min/scale) in 0..15, code =
    round(w/scale + zero) in 0..15, rounding half to even; the fp32 scale quantises, its bf16
    rounding dequantises.
    """
    *lead, k, n = w.shape
    groups = w.reshape(*lead, k // group, group, n)
    lo, hi = groups.amin(dim=-2), groups.amax(dim=-2)
    scale = (hi - lo).clamp_min(1e-8) / 15
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(groups / scale.unsqueeze(-2) + zero.unsqueeze(-2)).clamp(0, 15).to(torch.uint8)
    return pack_int4(codes.reshape(*lead, k, n)), scale.to(torch.bfloat16), zero.to(torch.bfloat16)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """(..., K/2, N) codes with (..., K/g, N) scales and zeros -> (..., K, N) bf16, in bf16 arithmetic."""
    codes = unpack_int4(packed).to(torch.bfloat16)
    *lead, k, n = codes.shape
    w = (codes.view(*lead, k // group, group, n) - zeros.unsqueeze(-2)) * scales.unsqueeze(-2)
    return w.view(*lead, k, n)


class QuantLinear(nn.Module):
    """y = x · W for an (in, out) int4 weight: buffers `w_q` (in/2, out) uint8, `scales` and `zeros`
    (in/g, out) bf16. The reference accumulates in fp32 and rounds the output to bf16."""

    def __init__(self, in_f: int, out_f: int, group: int = GROUP_SIZE, device: torch.device | str | None = None):
        super().__init__()
        self.in_f, self.out_f, self.group = in_f, out_f, group
        self.register_buffer("w_q", torch.zeros(in_f // 2, out_f, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(in_f // group, out_f, dtype=torch.bfloat16, device=device))
        self.register_buffer("zeros", torch.zeros(in_f // group, out_f, dtype=torch.bfloat16, device=device))

    def init_random(self, gen: torch.Generator, std: float = 0.02) -> None:
        w = torch.randn(self.in_f, self.out_f, generator=gen, device=self.w_q.device) * std
        for buf, value in zip((self.w_q, self.scales, self.zeros), quantize(w, self.group), strict=True):
            buf.copy_(value)

    def weight_bf(self) -> torch.Tensor:
        return dequantize(self.w_q, self.scales, self.zeros, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.weight_bf().float()).to(torch.bfloat16)


class QuantExperts(nn.Module):
    """`n` int4 (in, out) weights stacked: `w_q` (n, in/2, out), `scales` and `zeros` (n, in/g, out)."""

    def __init__(self, n: int, in_f: int, out_f: int, group: int = GROUP_SIZE,
                 device: torch.device | str | None = None):
        super().__init__()
        self.n, self.in_f, self.out_f, self.group = n, in_f, out_f, group
        self.register_buffer("w_q", torch.zeros(n, in_f // 2, out_f, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(n, in_f // group, out_f, dtype=torch.bfloat16, device=device))
        self.register_buffer("zeros", torch.zeros(n, in_f // group, out_f, dtype=torch.bfloat16, device=device))

    def init_random(self, gen: torch.Generator, std: float = 0.02) -> None:
        for e in range(self.n):  # one expert at a time: the real MoE's fp32 draw would be 0.6 GB at once
            w = torch.randn(self.in_f, self.out_f, generator=gen, device=self.w_q.device) * std
            for buf, value in zip((self.w_q[e], self.scales[e], self.zeros[e]), quantize(w, self.group), strict=True):
                buf.copy_(value)

    def weight_bf(self, e: int) -> torch.Tensor:
        return dequantize(self.w_q[e], self.scales[e], self.zeros[e], self.group)


# ----------------------------------------------------------------------------------------------
# small pieces
# ----------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · rsqrt(mean(x²) + 1e-6) · weight in fp32, rounded back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


def rope_cos_sin(pos: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of pos · θ^(−2i/dim), i = 0 … dim/2 − 1, fp32."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angle = pos * inv_freq
    return torch.cos(angle), torch.sin(angle)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the angle, in fp32; returns x's dtype."""
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------------
class KDA(nn.Module):
    """Kimi Delta Attention, one token: q, k, v through a causal depthwise conv (width 4) + SiLU,
    per-channel log-decay g = −softplus(x·W_g), write strength β = σ(x·W_β), then per head
    S ← S·diag(e^g) (decay along the key dim), S ← S + β k (v − Sᵀk)ᵀ, o = Sᵀ (q/√D)."""

    def __init__(self, cfg: Config, device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        d, c, g = cfg.hidden, cfg.kda_heads * cfg.kda_head_dim, cfg.group
        self.q_proj = QuantLinear(d, c, g, device)
        self.k_proj = QuantLinear(d, c, g, device)
        self.v_proj = QuantLinear(d, c, g, device)
        self.g_proj = QuantLinear(d, c, g, device)
        self.beta_proj = nn.Linear(d, cfg.kda_heads, bias=False, dtype=cfg.dtype, device=device)
        self.conv_w = nn.Parameter(torch.empty(3, c, cfg.short_conv, dtype=cfg.dtype, device=device))  # q, k, v
        self.o_proj = QuantLinear(c, d, g, device)
        self.scale = cfg.kda_head_dim ** -0.5

    def short_conv(self, val: torch.Tensor, window: torch.Tensor, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(C,) new value and (width−1, C) past values -> SiLU(conv) as bf16, and the shifted window.
        Tap t multiplies the t-th oldest of the width values (the newest takes the last tap)."""
        win = torch.cat((window, val[None]), dim=0)
        out = (win.float() * self.conv_w[which].float().t()).sum(0)
        return F.silu(out).to(val.dtype), win[1:]

    def step(self, x: torch.Tensor, st: dict[str, torch.Tensor]) -> torch.Tensor:
        h, dk = self.cfg.kda_heads, self.cfg.kda_head_dim
        q, st["cq"] = self.short_conv(self.q_proj(x), st["cq"], 0)
        k, st["ck"] = self.short_conv(self.k_proj(x), st["ck"], 1)
        v, st["cv"] = self.short_conv(self.v_proj(x), st["cv"], 2)
        q = q.view(h, dk).float() * self.scale
        k, v = k.view(h, dk).float(), v.view(h, dk).float()
        g = -F.softplus(self.g_proj(x).float()).view(h, dk)
        beta = torch.sigmoid(self.beta_proj(x).float())
        s = st["S"] * g.exp()[:, :, None]  # (H, Dk, Dv), fp32
        pred = (s * k[:, :, None]).sum(1)
        s = s + beta[:, None, None] * k[:, :, None] * (v - pred)[:, None, :]
        st["S"] = s
        o = (s * q[:, :, None]).sum(1)
        return self.o_proj(o.reshape(-1).to(torch.bfloat16))


class MLA(nn.Module):
    """Multi-head latent attention, one token: the latent c (kv_lora) and the rotated rope key are
    appended to the caches; keys and values are kv_b(c) for every cached token."""

    def __init__(self, cfg: Config, device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        d, hm, g = cfg.hidden, cfg.mla_heads, cfg.group
        self.q_proj = QuantLinear(d, hm * (cfg.qk_nope + cfg.qk_rope), g, device)
        self.kv_a = QuantLinear(d, cfg.kv_lora + cfg.qk_rope, g, device)
        self.kv_b = QuantLinear(cfg.kv_lora, hm * (cfg.qk_nope + cfg.v_head), g, device)
        self.o_proj = QuantLinear(hm * cfg.v_head, d, g, device)
        self.scale = (cfg.qk_nope + cfg.qk_rope) ** -0.5

    def step(self, x: torch.Tensor, st: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        hm, nope = cfg.mla_heads, cfg.qk_nope
        pos = st["c_kv"].shape[0]  # the new token's position: the cache length before it
        cos, sin = rope_cos_sin(pos, cfg.qk_rope, cfg.rope_theta, x.device)
        q = self.q_proj(x).view(hm, nope + cfg.qk_rope)
        q_nope, q_rope = q[:, :nope].float(), apply_rope(q[:, nope:], cos, sin).float()
        kv = self.kv_a(x)
        st["c_kv"] = torch.cat((st["c_kv"], kv[None, : cfg.kv_lora]), dim=0)
        st["k_rope"] = torch.cat((st["k_rope"], apply_rope(kv[cfg.kv_lora:], cos, sin)[None]), dim=0)
        kvb = self.kv_b(st["c_kv"]).view(-1, hm, nope + cfg.v_head).float()  # (T+1, H, nope + v)
        scores = (torch.einsum("hd,thd->th", q_nope, kvb[..., :nope])
                  + torch.einsum("hd,td->th", q_rope, st["k_rope"].float())) * self.scale
        o = torch.einsum("th,thd->hd", torch.softmax(scores, dim=0), kvb[..., nope:])
        return self.o_proj(o.reshape(-1).to(torch.bfloat16))


class MoE(nn.Module):
    """Softmax router, top-n_active renormalised × routed_scaling, SwiGLU experts, plus the shared
    expert(s) at weight 1; everything after the router sums in fp32."""

    def __init__(self, cfg: Config, device: torch.device | str | None = None):
        super().__init__()
        self.cfg = cfg
        d, m, e, g = cfg.hidden, cfg.moe_inter, cfg.n_experts, cfg.group
        self.router = nn.Linear(d, e, bias=False, dtype=cfg.dtype, device=device)
        self.gate = QuantExperts(e, d, m, g, device)
        self.up = QuantExperts(e, d, m, g, device)
        self.down = QuantExperts(e, m, d, g, device)
        self.s_gate = QuantExperts(cfg.n_shared, d, m, g, device)
        self.s_up = QuantExperts(cfg.n_shared, d, m, g, device)
        self.s_down = QuantExperts(cfg.n_shared, m, d, g, device)

    def route(self, x: torch.Tensor, runner_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32, expert indices) of the n_active experts this token goes to; with `runner_up`,
        the best unchosen expert in place of the last chosen one (the grader's other expert choice at a
        tie, eval/judge.py `_RunnerUps`)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        n = self.cfg.n_active
        if runner_up and n < self.cfg.n_experts:
            w, idx = torch.topk(probs, n + 1)
            w, idx = torch.cat([w[: n - 1], w[n:]]), torch.cat([idx[: n - 1], idx[n:]])
        else:
            w, idx = torch.topk(probs, n)
        return w / (w.sum() + 1e-9) * self.cfg.routed_scaling, idx

    def margin_ulps(self, x: torch.Tensor) -> float:
        """How far the last chosen expert's bf16 router logit is above the best unchosen one, in bf16
        ulps at that magnitude. Under about one ulp, an implementation whose router input differs
        from the reference's by rounding may pick the other expert: a different, equally valid
        output whose elements move far more than rounding (the cosine rule still holds)."""
        if self.cfg.n_active == self.cfg.n_experts:
            return float("inf")
        top = torch.topk(self.router(x).float(), self.cfg.n_active + 1).values
        last, nxt = top[-2].item(), top[-1].item()
        ulp = 2.0 ** (torch.frexp(torch.tensor(max(abs(last), 1e-30))).exponent.item() - 8)
        return (last - nxt) / ulp

    @staticmethod
    def expert(x: torch.Tensor, gate: QuantExperts, up: QuantExperts, down: QuantExperts, e: int) -> torch.Tensor:
        xf = x.float()
        h = F.silu(xf @ gate.weight_bf(e).float()) * (xf @ up.weight_bf(e).float())
        return h @ down.weight_bf(e).float()

    def step(self, x: torch.Tensor, runner_up: bool = False) -> torch.Tensor:
        w, idx = self.route(x, runner_up)
        out = torch.zeros(self.cfg.hidden, dtype=torch.float32, device=x.device)
        for j in range(self.cfg.n_active):
            out = out + w[j] * self.expert(x, self.gate, self.up, self.down, int(idx[j]))
        for s in range(self.cfg.n_shared):
            out = out + self.expert(x, self.s_gate, self.s_up, self.s_down, s)
        return out.to(torch.bfloat16)


class Block(nn.Module):
    """h = x + attn(rmsnorm(x)); out = h + moe(rmsnorm(h)), residual sums in bf16."""

    def __init__(self, cfg: Config, kind: str, device: torch.device | str | None = None):
        super().__init__()
        self.kind = kind
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=cfg.dtype, device=device))
        self.moe_norm = nn.Parameter(torch.ones(cfg.hidden, dtype=cfg.dtype, device=device))
        self.attn = KDA(cfg, device) if kind == "K" else MLA(cfg, device)
        self.moe = MoE(cfg, device)

    def step(self, x: torch.Tensor, st: dict[str, torch.Tensor], margins: list[float] | None = None,
             runner_up: bool = False) -> torch.Tensor:
        h = x + self.attn.step(rmsnorm(x, self.attn_norm), st)
        y = rmsnorm(h, self.moe_norm)
        if margins is not None:
            margins.append(self.moe.margin_ulps(y))
        return h + self.moe.step(y, runner_up)


class Model(nn.Module):
    """The block: `step(hidden (d,) bf16, state) -> (hidden, state)`, state as `init_state` makes it.

    Weights are drawn once from `WEIGHT_SEED` (int4 weights N(0, 0.02²) quantised, the bf16 router
    and β projections N(0, 0.02²), the conv taps N(0, 0.1²), norms 1), on `device` (CPU by default;
    another device gives other values, the same on every run there). `init_weights=False` leaves
    them zero, for a model that will receive them through `load_state_dict`.
    """

    def __init__(self, cfg: Config, *, device: torch.device | str | None = None, init_weights: bool = True):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg, kind, device) for kind in cfg.pattern)
        if init_weights:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        device = next(self.buffers()).device
        gen = torch.Generator(device=device).manual_seed(WEIGHT_SEED)
        for mod in self.modules():  # registration order: the same draw order on every run
            if isinstance(mod, QuantLinear | QuantExperts):
                mod.init_random(gen)
            elif isinstance(mod, nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen, device=device) * 0.02)
            elif isinstance(mod, KDA):
                mod.conv_w.copy_(torch.randn(mod.conv_w.shape, generator=gen, device=device) * 0.1)

    def step(self, hidden: torch.Tensor, state: list[dict[str, torch.Tensor]], margins: list[float] | None = None,
             flip: int | None = None) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """One token; `margins`, if given, receives each MoE's router margin (MoE.margin_ulps); `flip`, if
        given, makes the MoE of that block choose its runner-up expert in place of its last chosen one."""
        for i, (blk, st) in enumerate(zip(self.blocks, state, strict=True)):
            hidden = blk.step(hidden, st, margins, runner_up=i == flip)
        return hidden, state

    def forward(self, hidden: torch.Tensor, state: list[dict[str, torch.Tensor]]
                ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        return self.step(hidden, state)


# ----------------------------------------------------------------------------------------------
# state and inputs: drawn from explicit generators, on the CPU (the same values on every device)
# and moved, or on the device itself for the grader's fresh sets (below); the distributions are
# KernelBench-Mega's.
# ----------------------------------------------------------------------------------------------
def init_state(cfg: Config, context_len: int, seed: int, device: torch.device | str = "cpu",
               draw_on: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The decode state after `context_len` tokens: per KDA layer S (H, Dk, Dk) fp32 ~ 0.05·N and the
    conv windows cq, ck, cv (width−1, H·Dk) bf16 ~ 0.1·N; for the MLA layer the caches c_kv
    (context_len, kv_lora) and k_rope (context_len, qk_rope) bf16 ~ 0.1·N. Drawn by a generator on
    `draw_on` (the CPU by default, under a `torch.device` context too), then moved to `device`."""
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    c = cfg.kda_heads * cfg.kda_head_dim

    def draw(*shape: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=draw_on) * scale).to(dtype).to(device)

    state: list[dict[str, torch.Tensor]] = []
    for kind in cfg.pattern:
        if kind == "K":
            state.append({"S": draw(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim, scale=0.05, dtype=torch.float32),
                          **{name: draw(cfg.short_conv - 1, c, scale=0.1, dtype=cfg.dtype)
                             for name in ("cq", "ck", "cv")}})
        else:
            state.append({"c_kv": draw(context_len, cfg.kv_lora, scale=0.1, dtype=cfg.dtype),
                          "k_rope": draw(context_len, cfg.qk_rope, scale=0.1, dtype=cfg.dtype)})
    return state


def init_token(cfg: Config, seed: int, device: torch.device | str = "cpu",
               draw_on: torch.device | str = "cpu") -> torch.Tensor:
    """The incoming hidden vector: (hidden,) bf16 ~ 0.25·N, from seed + 1 (not the state's stream),
    drawn on `draw_on` as `init_state` draws."""
    gen = torch.Generator(device=draw_on).manual_seed(seed + 1)
    return (torch.randn(cfg.hidden, generator=gen, device=draw_on) * 0.25).to(cfg.dtype).to(device)


def clone_state(state: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """A deep copy, so two models can be fed the identical state (a step updates its dicts in place)."""
    return [{name: t.clone() for name, t in layer.items()} for layer in state]


def _config_from_globals() -> Config:
    return build_config({key: globals()[name] for key, name in _SHAPE_KEYS.items()})


def tuned_baseline(model: Model, hidden: torch.Tensor, state: list[dict[str, torch.Tensor]]
                   ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The deck's headline baseline as a library line (problem.yaml `library`): baseline.py's tuned
    step with `model`'s weights, built on the first call and kept on the model."""
    tuned = model.__dict__.get("_tuned_baseline")
    if tuned is None:
        import importlib.util
        import sys
        from pathlib import Path

        name = "_kernelboard_mega02_baseline"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("baseline.py"))
            assert spec is not None and spec.loader is not None
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
        device = next(model.buffers()).device
        tuned = sys.modules[name].Model(model.cfg, device=device, init_weights=False)
        tuned.load_state_dict(model.state_dict())
        tuned.eval()
        model.__dict__["_tuned_baseline"] = tuned  # not a submodule: the state dict stays the reference's
    return tuned.step(hidden, state)


def get_init_inputs() -> list[Config]:
    """Model(*get_init_inputs()): the Config of the current shape globals."""
    return [_config_from_globals()]


def get_inputs() -> list:
    """[hidden, state] at CONTEXT_LEN, drawn on the CPU (the same values on every device) from a seed
    taken from the global CPU RNG (so the grader's torch.manual_seed(seed) before the call decides
    them, as for the Hard decks)."""
    return _inputs_drawn_on("cpu")


def get_fresh_inputs() -> list:
    """As `get_inputs`, but drawn by the generator of the default device (the grader's `torch.device`
    context): for sets whose values need not be the same on every device (plan.py `draw_fresh`: the
    timing and floor-batch states). A router-clear set may take eight draws, and the CPU's generator
    spends about 0.1 s on each 25 MB state at context 16384."""
    return _inputs_drawn_on(torch.get_default_device())


def _inputs_drawn_on(where: torch.device | str) -> list:
    """[hidden, state] drawn by a generator on `where` and left there, from a seed of the global CPU RNG."""
    cfg = _config_from_globals()
    seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))  # the CPU generator under any device context
    return [init_token(cfg, seed, where, where), init_state(cfg, CONTEXT_LEN, seed, where, where)]

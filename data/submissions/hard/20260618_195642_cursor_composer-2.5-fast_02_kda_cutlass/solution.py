"""KDA chunk forward for B200 — Triton inter-chunk recurrence + vectorized intra-chunk."""
from __future__ import annotations

import torch
import torch.nn as nn
import triton
import triton.language as tl
from einops import rearrange

OP_TYPE = "linear_attention"
SUPPORTED_PRECISIONS = ["bf16"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]

CHUNK_SIZE = 64


@triton.jit
def kda_inter_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    u_ptr,
    w_ptr,
    Aqk_ptr,
    o_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qk,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kk,
    stride_gb,
    stride_gt,
    stride_gh,
    stride_gk,
    stride_ub,
    stride_ut,
    stride_uh,
    stride_uv,
    stride_wb,
    stride_wt,
    stride_wh,
    stride_wk,
    stride_Ab,
    stride_At,
    stride_Ah,
    stride_Ac,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_ov,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Inter-chunk KDA: v_new = u - w@S, o = qg@S + Aqk@v_new, update S."""
    pid = tl.program_id(0)
    i_b = pid // H
    i_h = pid % H
    NT = T // BT
    NK = K // BK
    NV = V // BV

    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    g_base = g_ptr + i_b * stride_gb + i_h * stride_gh
    u_base = u_ptr + i_b * stride_ub + i_h * stride_uh
    w_base = w_ptr + i_b * stride_wb + i_h * stride_wh
    A_base = Aqk_ptr + i_b * stride_Ab + i_h * stride_Ah
    o_base = o_ptr + i_b * stride_ob + i_h * stride_oh

    # Register-resident state S tiles [BK, BV]
    s00 = tl.zeros([BK, BV], dtype=tl.float32)
    s01 = tl.zeros([BK, BV], dtype=tl.float32)
    s10 = tl.zeros([BK, BV], dtype=tl.float32)
    s11 = tl.zeros([BK, BV], dtype=tl.float32)

    for i_t in range(NT):
        t0 = i_t * BT

        # v_new = u - w @ S
        v0 = tl.load(
            u_base + (t0 + tl.arange(0, BT))[:, None] * stride_ut + tl.arange(0, BV)[None, :] * stride_uv,
            mask=(t0 + tl.arange(0, BT))[:, None] < T,
            other=0.0,
        ).to(tl.float32)
        v1 = tl.load(
            u_base + (t0 + tl.arange(0, BT))[:, None] * stride_ut + (BV + tl.arange(0, BV))[None, :] * stride_uv,
            mask=(t0 + tl.arange(0, BT))[:, None] < T,
            other=0.0,
        ).to(tl.float32)

        p_w0 = tl.make_block_ptr(w_base, (T, K), (stride_wt, stride_wk), (t0, 0), (BT, BK), (1, 0))
        p_w1 = tl.make_block_ptr(w_base, (T, K), (stride_wt, stride_wk), (t0, BK), (BT, BK), (1, 0))
        bw0 = tl.load(p_w0, boundary_check=(0, 1)).to(tl.float32)
        bw1 = tl.load(p_w1, boundary_check=(0, 1)).to(tl.float32)

        v0 = v0 - tl.dot(bw0, s00) - tl.dot(bw1, s10)
        v1 = v1 - tl.dot(bw0, s01) - tl.dot(bw1, s11)

        # o = qg @ S + Aqk @ v_new
        p_q0 = tl.make_block_ptr(q_base, (T, K), (stride_qt, stride_qk), (t0, 0), (BT, BK), (1, 0))
        p_q1 = tl.make_block_ptr(q_base, (T, K), (stride_qt, stride_qk), (t0, BK), (BT, BK), (1, 0))
        p_g0 = tl.make_block_ptr(g_base, (T, K), (stride_gt, stride_gk), (t0, 0), (BT, BK), (1, 0))
        p_g1 = tl.make_block_ptr(g_base, (T, K), (stride_gt, stride_gk), (t0, BK), (BT, BK), (1, 0))
        bq0 = tl.load(p_q0, boundary_check=(0, 1)).to(tl.float32)
        bq1 = tl.load(p_q1, boundary_check=(0, 1)).to(tl.float32)
        bg0 = tl.load(p_g0, boundary_check=(0, 1)).to(tl.float32)
        bg1 = tl.load(p_g1, boundary_check=(0, 1)).to(tl.float32)
        qg0 = bq0 * tl.exp(bg0)
        qg1 = bq1 * tl.exp(bg1)

        p_A = tl.make_block_ptr(A_base, (T, BT), (stride_At, stride_Ac), (t0, 0), (BT, BT), (1, 0))
        bA = tl.load(p_A, boundary_check=(0, 1)).to(tl.float32)

        o0 = tl.dot(qg0, s00) + tl.dot(qg1, s10) + tl.dot(bA, v0)
        o1 = tl.dot(qg0, s01) + tl.dot(qg1, s11) + tl.dot(bA, v1)

        tl.store(
            o_base + (t0 + tl.arange(0, BT))[:, None] * stride_ot + tl.arange(0, BV)[None, :] * stride_ov,
            o0.to(o_ptr.dtype.element_ty),
            mask=(t0 + tl.arange(0, BT))[:, None] < T,
        )
        tl.store(
            o_base + (t0 + tl.arange(0, BT))[:, None] * stride_ot + (BV + tl.arange(0, BV))[None, :] * stride_ov,
            o1.to(o_ptr.dtype.element_ty),
            mask=(t0 + tl.arange(0, BT))[:, None] < T,
        )

        # S = S * exp(g_last) + k_decay.T @ v_new
        last = t0 + BT - 1
        gl0 = tl.load(g_base + last * stride_gt + tl.arange(0, BK) * stride_gk, mask=tl.arange(0, BK) < K, other=0.0).to(
            tl.float32
        )
        gl1 = tl.load(
            g_base + last * stride_gt + (BK + tl.arange(0, BK)) * stride_gk, mask=BK + tl.arange(0, BK) < K, other=0.0
        ).to(tl.float32)
        eg0 = tl.exp(gl0)
        eg1 = tl.exp(gl1)

        s00 = s00 * eg0[:, None]
        s01 = s01 * eg0[:, None]
        s10 = s10 * eg1[:, None]
        s11 = s11 * eg1[:, None]

        p_k0 = tl.make_block_ptr(k_base, (T, K), (stride_kt, stride_kk), (t0, 0), (BT, BK), (1, 0))
        p_k1 = tl.make_block_ptr(k_base, (T, K), (stride_kt, stride_kk), (t0, BK), (BT, BK), (1, 0))
        bk0 = tl.load(p_k0, boundary_check=(0, 1)).to(tl.float32)
        bk1 = tl.load(p_k1, boundary_check=(0, 1)).to(tl.float32)

        rows = t0 + tl.arange(0, BT)
        m_t = rows < T
        g_rows0 = tl.load(
            g_base + rows[:, None] * stride_gt + tl.arange(0, BK)[None, :] * stride_gk,
            mask=m_t[:, None],
            other=0.0,
        ).to(tl.float32)
        g_rows1 = tl.load(
            g_base + rows[:, None] * stride_gt + (BK + tl.arange(0, BK))[None, :] * stride_gk,
            mask=m_t[:, None],
            other=0.0,
        ).to(tl.float32)
        kd0 = tl.exp(gl0[None, :] - g_rows0) * bk0
        kd1 = tl.exp(gl1[None, :] - g_rows1) * bk1

        s00 = s00 + tl.dot(tl.trans(kd0), v0)
        s01 = s01 + tl.dot(tl.trans(kd0), v1)
        s10 = s10 + tl.dot(tl.trans(kd1), v0)
        s11 = s11 + tl.dot(tl.trans(kd1), v1)


def _intra_chunk_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int,
):
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = chunk_size
    device = q.device

    qf = rearrange(q.float() * scale, "b (n c) h d -> b h n c d", c=BT)
    kf = rearrange(k.float(), "b (n c) h d -> b h n c d", c=BT)
    vf = rearrange(v.float(), "b (n c) h d -> b h n c d", c=BT)
    gf = rearrange(g.float(), "b (n c) h d -> b h n c d", c=BT)
    bf = rearrange(beta.float(), "b (n c) h -> b h n c", c=BT)

    gf = gf.cumsum(dim=-2)

    decay = (gf.unsqueeze(-2) - gf.unsqueeze(-3)).exp()
    A = (kf.unsqueeze(-2) * decay * kf.unsqueeze(-3)).sum(-1)
    A = A * bf.unsqueeze(-1)

    mask_diag_upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=device), diagonal=0)
    A = -A.masked_fill(mask_diag_upper, 0)
    for i in range(1, BT):
        A[..., i, :i] = A[..., i, :i] + (A[..., i, :, None] * A[..., :, :i]).sum(-2)
    A = (A + torch.eye(BT, device=device, dtype=A.dtype)) * bf.unsqueeze(-2)

    gk = gf.exp() * kf
    w = torch.matmul(A, gk)
    u = torch.matmul(A, vf)

    Aqk = (qf.unsqueeze(-2) * decay * kf.unsqueeze(-3)).sum(-1)
    mask_strict_upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=device), diagonal=1)
    Aqk = Aqk.masked_fill(mask_strict_upper, 0)

    def to_bthx(x, d):
        return rearrange(x, "b h n c ... -> b (n c) h ...").reshape(B, T, H, d)

    q_b = to_bthx(qf, K).contiguous()
    k_b = to_bthx(kf, K).contiguous()
    g_b = to_bthx(gf, K).contiguous()
    w_b = to_bthx(w, K).contiguous()
    u_b = to_bthx(u, V).contiguous()
    Aqk_b = rearrange(Aqk, "b h n r c -> b (n r) h c").contiguous()
    return q_b, k_b, g_b, w_b, u_b, Aqk_b


def _inter_chunk_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    Aqk: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    B, T, H, K = q.shape
    V = u.shape[-1]
    BT = chunk_size
    assert K == 128 and V == 128 and BT == 64, "Triton kernel specialized for K=V=128, BT=64"

    o = torch.empty(B, T, H, V, device=q.device, dtype=torch.bfloat16)
    grid = (B * H,)
    kda_inter_kernel[grid](
        q,
        k,
        g,
        u,
        w,
        Aqk,
        o,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        q.stride(3),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        k.stride(3),
        g.stride(0),
        g.stride(1),
        g.stride(2),
        g.stride(3),
        u.stride(0),
        u.stride(1),
        u.stride(2),
        u.stride(3),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        w.stride(3),
        Aqk.stride(0),
        Aqk.stride(1),
        Aqk.stride(2),
        Aqk.stride(3),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        o.stride(3),
        T,
        H=H,
        K=K,
        V=V,
        BT=BT,
        BK=64,
        BV=64,
        num_warps=4,
        num_stages=1,
    )
    return o


def _inter_chunk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    Aqk: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    B, T, H, K = q.shape
    V = u.shape[-1]
    BT = chunk_size
    NT = T // BT

    qf = rearrange(q.float(), "b (n c) h d -> b h n c d", c=BT)
    kf = rearrange(k.float(), "b (n c) h d -> b h n c d", c=BT)
    gf = rearrange(g.float(), "b (n c) h d -> b h n c d", c=BT)
    wf = rearrange(w.float(), "b (n c) h d -> b h n c d", c=BT)
    uf = rearrange(u.float(), "b (n c) h d -> b h n c d", c=BT)
    Aqkf = rearrange(Aqk.float(), "b (n c) h d -> b h n c d", c=BT)

    S = q.new_zeros(B, H, K, V)
    o = torch.zeros(B, H, NT, BT, V, device=q.device, dtype=torch.float32)
    for i in range(NT):
        q_i, k_i = qf[:, :, i], kf[:, :, i]
        u_i, g_i, w_i = uf[:, :, i], gf[:, :, i], wf[:, :, i]
        Aqk_i = Aqkf[:, :, i]
        v_i = u_i - w_i @ S
        o[:, :, i] = (q_i * g_i.exp()) @ S + Aqk_i @ v_i
        g_last = g_i[:, :, -1]
        S = S * g_last.exp().unsqueeze(-1)
        k_decay = (g_last.unsqueeze(-2) - g_i).exp() * k_i
        S = S + rearrange(k_decay, "b h c d -> b h d c") @ v_i

    return rearrange(o, "b h n c d -> b (n c) h d")


def kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    dtype = v.dtype
    q_b, k_b, g_b, w_b, u_b, Aqk_b = _intra_chunk_prepare(q, k, v, g, beta, scale, chunk_size)
    if q.is_cuda and q.shape[-1] == 128 and v.shape[-1] == 128 and chunk_size == 64:
        o = _inter_chunk_triton(q_b, k_b, g_b, w_b, u_b, Aqk_b, chunk_size)
    else:
        o = _inter_chunk_torch(q_b, k_b, g_b, w_b, u_b, Aqk_b, chunk_size)
    return o.to(dtype)


class Model(nn.Module):
    def __init__(self, B: int, T: int, H: int, K: int, V: int, chunk_size: int = CHUNK_SIZE):
        super().__init__()
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.chunk_size = chunk_size
        self.scale = float(K) ** -0.5
        self.register_buffer("_dummy", torch.zeros(1), persistent=False)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        return kda_fwd(q, k, v, g, beta, scale=self.scale, chunk_size=self.chunk_size)


B = 2
T = 1024
H = 8
K = 128
V = 128


def get_inputs():
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16) * 0.1
    k = torch.randn(B, T, H, K, dtype=torch.bfloat16) * 0.1
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16) * 0.1
    g = (torch.randn(B, T, H, K, dtype=torch.float32) * 0.1 - 0.05)
    beta = torch.sigmoid(torch.randn(B, T, H, dtype=torch.bfloat16))
    return [q, k, v, g, beta]


def get_init_inputs():
    return [B, T, H, K, V, CHUNK_SIZE]

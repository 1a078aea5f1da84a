import torch
import torch.nn as nn
from einops import rearrange
import triton
import triton.language as tl

@triton.jit
def kda_recurrent_kernel(
    Q_ptr, K_ptr, G_ptr, U_ptr, W_ptr, O_ptr,
    stride_qb, stride_qh, stride_qn, stride_qc, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kc, stride_kk,
    stride_gb, stride_gh, stride_gn, stride_gc, stride_gk,
    stride_ub, stride_uh, stride_un, stride_uc, stride_uv,
    stride_wb, stride_wh, stride_wn, stride_wc, stride_wk,
    stride_ob, stride_oh, stride_on, stride_oc, stride_ov,
    B, T, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, NT: tl.constexpr
):
    # Program ID
    b = tl.program_id(0)
    h = tl.program_id(1)

    # Offsets
    off_k = tl.arange(0, K)
    off_v = tl.arange(0, V)
    off_bt = tl.arange(0, BT)

    # Initialize S to 0
    S = tl.zeros((K, V), dtype=tl.float32)

    # Mask for Aqk (lower triangular, including diagonal)
    mask_lower = off_bt[:, None] >= off_bt[None, :]

    for i in range(NT):
        # Base pointers for chunk i
        q_offset = b * stride_qb + h * stride_qh + i * stride_qn
        k_offset = b * stride_kb + h * stride_kh + i * stride_kn
        g_offset = b * stride_gb + h * stride_gh + i * stride_gn
        u_offset = b * stride_ub + h * stride_uh + i * stride_un
        w_offset = b * stride_wb + h * stride_wh + i * stride_wn
        o_offset = b * stride_ob + h * stride_oh + i * stride_on

        # Load inputs of size (BT, K) or (BT, V)
        q_i = tl.load(Q_ptr + q_offset + off_bt[:, None] * stride_qc + off_k[None, :] * stride_qk)
        k_i = tl.load(K_ptr + k_offset + off_bt[:, None] * stride_kc + off_k[None, :] * stride_kk)
        g_i = tl.load(G_ptr + g_offset + off_bt[:, None] * stride_gc + off_k[None, :] * stride_gk)
        u_i = tl.load(U_ptr + u_offset + off_bt[:, None] * stride_uc + off_v[None, :] * stride_uv)
        w_i = tl.load(W_ptr + w_offset + off_bt[:, None] * stride_wc + off_k[None, :] * stride_wk)

        # Cast loaded values to float32
        q_i = q_i.to(tl.float32)
        k_i = k_i.to(tl.float32)
        g_i = g_i.to(tl.float32)
        u_i = u_i.to(tl.float32)
        w_i = w_i.to(tl.float32)

        # Compute exp(g) and exp(-g)
        exp_g = tl.exp(g_i)
        exp_neg_g = tl.exp(-g_i)

        # Aqk = (q_i * exp_g) @ (k_i * exp_neg_g).T
        temp_q = q_i * exp_g
        temp_k = k_i * exp_neg_g
        Aqk = tl.dot(temp_q, tl.trans(temp_k), allow_tf32=False)
        Aqk = tl.where(mask_lower, Aqk, 0.0)

        # v_i = u_i - w_i @ S
        v_i = u_i - tl.dot(w_i, S, allow_tf32=False)

        # o_i = temp_q @ S + Aqk @ v_i
        o_i = tl.dot(temp_q, S, allow_tf32=False) + tl.dot(Aqk, v_i, allow_tf32=False)

        # Store o_i (cast to bfloat16)
        tl.store(O_ptr + o_offset + off_bt[:, None] * stride_oc + off_v[None, :] * stride_ov, o_i.to(tl.bfloat16))

        # Update S
        # Load g_last of shape (K,)
        g_last = tl.load(G_ptr + g_offset + (BT - 1) * stride_gc + off_k * stride_gk).to(tl.float32)
        exp_g_last = tl.exp(g_last)

        # Multiply S by exp_g_last (broadcasting K to V)
        S = S * exp_g_last[:, None]

        # temp_k_S = exp(g_last[None, :] - g_i) * k_i
        temp_k_S = tl.exp(g_last[None, :] - g_i) * k_i
        S = S + tl.dot(tl.trans(temp_k_S), v_i, allow_tf32=False)


@torch.compile(fullgraph=True, mode="max-autotune")
def precompute_u_w(q, k, v, g, beta, scale, BT):
    # Cast to fp32 for internal computation
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    q = q * scale

    q = rearrange(q, "b (n c) h d -> b h n c d", c=BT)
    k = rearrange(k, "b (n c) h d -> b h n c d", c=BT)
    v = rearrange(v, "b (n c) h d -> b h n c d", c=BT)
    g = rearrange(g, "b (n c) h d -> b h n c d", c=BT)
    beta = rearrange(beta, "b (n c) h -> b h n c", c=BT)

    g = g.cumsum(-2)

    mask_diag_upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=0)
    
    temp1 = k * g.exp()
    temp2 = k * (-g).exp()
    A_ref = temp1 @ temp2.transpose(-2, -1)
    A_ref = A_ref * beta[..., None]
    A_ref = -A_ref.masked_fill(mask_diag_upper, 0)

    M = torch.eye(BT, device=q.device).expand_as(A_ref) - A_ref
    M_inv = torch.linalg.solve_triangular(M, torch.eye(BT, device=q.device).expand_as(M), upper=False)
    A_final = M_inv * beta[..., None, :]

    w = A_final @ (g.exp() * k)
    u = A_final @ v
    return q, k, v, g, u, w


def run_triton_kda(q, k, v, g, beta, scale, chunk_size):
    # 1. Precompute u and w
    q, k, v, g, u, w = precompute_u_w(q, k, v, g, beta, scale, chunk_size)

    # 2. Allocate output tensor
    B, H, NT, BT, V_dim = u.shape
    O = torch.zeros(B, H, NT, BT, V_dim, dtype=torch.bfloat16, device=q.device)

    # 3. Launch Triton kernel
    grid = (B, H)
    kda_recurrent_kernel[grid](
        q, k, g, u, w, O,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3), q.stride(4),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3), k.stride(4),
        g.stride(0), g.stride(1), g.stride(2), g.stride(3), g.stride(4),
        u.stride(0), u.stride(1), u.stride(2), u.stride(3), u.stride(4),
        w.stride(0), w.stride(1), w.stride(2), w.stride(3), w.stride(4),
        O.stride(0), O.stride(1), O.stride(2), O.stride(3), O.stride(4),
        B, NT * BT, H, q.shape[-1], u.shape[-1], BT, NT,
        num_stages=1, num_warps=4
    )

    # 4. Reshape back
    O = rearrange(O, "b h n c d -> b (n c) h d")
    return O

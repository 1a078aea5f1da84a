"""Kimi Delta Attention, chunked forward: the correctness oracle for 02_kda_cutlass.

Interface-compatible with KernelBench-Hard's reference: the same module globals, constructor
(an empty state dict), `get_inputs()` draw order, distributions and internal `manual_seed(0)`,
and the same output, including its quirk of taking the in-chunk prefix sum of g itself.

How it stays exact while dropping the original's Python loops over chunk positions: every step
computes the same fp32 quantities as the chunked algorithm, only batched.

- The pairwise decay e^(G[c,d] - G[i,d]) is formed from the *difference* of prefix sums, as in
  the original, never split into e^G[c]·e^-G[i] (that changes the rounding and overflows for
  strong decay). Γ and the query-key matrix are contracted from one such tensor for every chunk
  of every (batch, head) at once, in blocks that cap the temporary at 256 MiB.
- (I - L)⁻¹ comes from one batched triangular solve instead of 63 row updates: both are
  forward substitution with a unit diagonal, so they differ only in fp32 summation order.
- The recurrence over chunks stays sequential (each state needs the previous one) but carries
  only what depends on the state: Ṽ = U - W·S and the state update. The state entering each
  chunk is kept, and the outputs (q ⊙ e^G)·S + A·Ṽ are two batched products after the loop,
  the same products the original forms per chunk.

Every product, exp and prefix sum is fp32, as in the original; only the final cast is bf16.
"""

import torch
import torch.nn as nn

B = 2
T = 1024
H = 8
K = 128
V = 128
CHUNK_SIZE = 64

OP_TYPE = "linear_attention"
SUPPORTED_PRECISIONS = ["bf16"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]

#: Largest pairwise-decay temporary in fp32 elements (2**26 = 256 MiB): bounds the reference's memory.
_PAIRWISE_ELEMENTS = 1 << 26


class Model(nn.Module):
    """Chunked KDA forward without initial or final state; no parameters, an empty state dict."""

    def __init__(self, B: int, T: int, H: int, K: int, V: int, chunk_size: int = 64):
        super().__init__()
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.chunk_size = chunk_size
        self.scale = K**-0.5
        self.register_buffer("_dummy", torch.zeros(1), persistent=False)

    def forward(self, q, k, v, g, beta):
        """q, k (B, T, H, K) bf16; v (B, T, H, V) bf16; g (B, T, H, K) fp32 per-channel log-decay
        (not yet cumulated); beta (B, T, H) bf16 -> o (B, T, H, V) in v's dtype."""
        return kda_forward_fp32(q, k, v, g, beta, self.scale, self.chunk_size).to(v.dtype)


def _to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, T, H, ...) -> (B, H, N, C, ...) in fp32, N = T / C chunks of C positions."""
    b, t, h = x.shape[:3]
    return x.float().reshape(b, t // chunk, chunk, h, *x.shape[3:]).movedim(3, 1)


def _decayed_products(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each chunk (leading dims of (..., C, D) tensors), with E[c,i,d] = e^(G[c,d] - G[i,d]):
    Γ[c,i] = Σ_d k[c,d]·E[c,i,d]·k[i,d] for every (c, i), and A[c,i] = Σ_d q[c,d]·E[c,i,d]·k[i,d]
    for i <= c, 0 above the diagonal.

    Both come from one batched matmul of (E ⊙ k_i) with the stacked rows (k_c, q_c). Entries above
    the diagonal may overflow (e^ of a positive sum); they stay in their own (c, i) and are masked.
    """
    lead, (c, d) = q.shape[:-2], q.shape[-2:]
    qf, kf, Gf = (x.reshape(-1, c, d) for x in (q, k, G))
    out = torch.empty(qf.shape[0], c, c, 2, dtype=torch.float32, device=q.device)
    step = max(1, _PAIRWISE_ELEMENTS // (c * c * d))
    for s in range(0, qf.shape[0], step):
        Gs, ks = Gf[s : s + step], kf[s : s + step]
        decayed_k = (Gs[:, :, None, :] - Gs[:, None, :, :]).exp_().mul_(ks[:, None, :, :])  # [n, c, i, d]
        rows = torch.stack((ks, qf[s : s + step]), dim=-1)  # [n, c, d, 2] = (k[c,d], q[c,d])
        out[s : s + step] = decayed_k @ rows  # [n, c, i, 2]
    out = out.reshape(*lead, c, c, 2)
    above = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    return out[..., 0], out[..., 1].masked_fill(above, 0.0)


def kda_forward_fp32(q, k, v, g, beta, scale: float, chunk: int) -> torch.Tensor:
    """The chunked KDA forward in fp32, (B, T, H, V); T must be a multiple of `chunk`.

    Per chunk (positions c, i), with G the inclusive in-chunk prefix sum of g:
    L = -β[c]·Γ[c,i] below the diagonal, T = (I - L)⁻¹·diag(β), W = T·(e^G ⊙ k), U = T·v; then
    over chunks, from S = 0: Ṽ = U - W·S, o = (q ⊙ e^G)·S + A·Ṽ,
    S ← e^G[C-1] ⊙ S + (e^(G[C-1] - G) ⊙ k)ᵀ·Ṽ.
    """
    b, t, h, _ = q.shape
    if t % chunk:
        raise ValueError(f"sequence length {t} is not a multiple of the chunk size {chunk}")
    q, k, v, beta = (_to_chunks(x, chunk) for x in (q, k, v, beta))  # (B, H, N, C, ...)
    q = q * scale
    G = _to_chunks(g, chunk).cumsum(-2)  # the in-chunk cumulation the original applies (its quirk F.3)
    gamma, A = _decayed_products(q, k, G)

    eye = torch.eye(chunk, dtype=torch.float32, device=q.device)
    strictly_lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    L = -(gamma * beta[..., :, None]).masked_fill(~strictly_lower, 0.0)
    P = torch.linalg.solve_triangular(eye - L, eye.expand_as(L), upper=False, unitriangular=True)
    T_ = P * beta[..., None, :]
    W = T_ @ (G.exp() * k)
    U = T_ @ v

    last = G[..., -1:, :]  # (B, H, N, 1, K)
    state_decay = last.exp().transpose(-1, -2)  # (B, H, N, K, 1)
    k_to_end = (last - G).exp() * k  # (B, H, N, C, K)
    n = t // chunk
    S = q.new_zeros(b, h, k.shape[-1], v.shape[-1])
    states = q.new_empty(b, h, n, k.shape[-1], v.shape[-1])
    v_new = torch.empty_like(U)
    for i in range(n):
        states[:, :, i] = S
        v_new[:, :, i] = U[:, :, i] - W[:, :, i] @ S
        S = S * state_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new[:, :, i]
    o = (q * G.exp()) @ states + A @ v_new  # (B, H, N, C, V)
    return o.movedim(1, 3).reshape(b, t, h, v.shape[-1])


def get_inputs():
    """q, k, v, g, beta for the current globals, drawn on the CPU after `torch.manual_seed(0)`.

    The reseed is the original's (quirk F.2): every grading seed gives this same input set.
    """
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16) * 0.1
    k = torch.randn(B, T, H, K, dtype=torch.bfloat16) * 0.1
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16) * 0.1
    g = torch.randn(B, T, H, K, dtype=torch.float32) * 0.1 - 0.05
    beta = torch.sigmoid(torch.randn(B, T, H, dtype=torch.bfloat16))
    return [q, k, v, g, beta]


def long_memory(inputs, split_chunks, key_millivalue, query_scale_percent, value_scale_percent,
                decay_micros, beta_percent):
    """Structural stress: outputs after a split that only the carried state can produce.

    With C = CHUNK_SIZE (64 on every GPU shape, as in the original) the split is
    C·min(max(1, split_chunks), max(1, T/C - 1)) positions. Keys become ±key_millivalue/1000 (+ on
    even channels, − on odd, sign flipped on odd chunks; the first token's key × 0.05); queries are
    zero before the split and × query_scale_percent/100 after; values × value_scale_percent/100
    before and zero after; g is −decay_micros/10⁶ everywhere (decay close to 1) and beta is
    beta_percent/100. Every output past the split reads values written 1–8 chunks earlier.
    """
    q, k, v, g, beta = (x.clone() for x in inputs)
    t, dk = k.shape[1], k.shape[-1]
    split = CHUNK_SIZE * min(max(1, split_chunks), max(1, t // CHUNK_SIZE - 1))
    chunk_sign = 1 - 2 * ((torch.arange(t, device=k.device) // CHUNK_SIZE) % 2)
    channel_sign = 1 - 2 * (torch.arange(dk, device=k.device) % 2)
    pattern = (key_millivalue / 1000) * (chunk_sign[:, None] * channel_sign[None, :]).float()
    k.copy_(pattern[None, :, None, :].expand_as(k))
    k[:, 0] *= 0.05
    q[:, :split] = 0
    q[:, split:] *= query_scale_percent / 100
    v[:, :split] *= value_scale_percent / 100
    v[:, split:] = 0
    g.fill_(-decay_micros / 1e6)
    beta.fill_(beta_percent / 100)
    return [q, k, v, g, beta]


def get_init_inputs():
    return [B, T, H, K, V, CHUNK_SIZE]


def library_fla_chunk_kda(model, q, k, v, g, beta):
    """The library line: flash-linear-attention's `fla.ops.kda.chunk_kda` (Triton, `fla-core`),
    with the per-step log decay g (FLA cumulates it per chunk of 64 itself) and the model's scale.
    Imported here, so a machine without FLA records the import error as this line's result."""
    from fla.ops.kda import chunk_kda

    out, _ = chunk_kda(q, k, v, g, beta, scale=model.scale)
    return out.to(v.dtype)

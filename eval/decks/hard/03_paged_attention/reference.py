"""Paged-attention decode: the correctness oracle for 03_paged_attention.

Interface-compatible with KernelBench-Hard's reference: the same module globals, constructor,
`get_inputs()` draw order and output. The forward pass is vectorised over the batch (one gather
of every table page, positions past each sequence's length masked out) instead of a Python loop
over sequences; the arithmetic is the same fp32 softmax(q·k·scale)·v, so results agree to
fp32 rounding while the eager and torch.compile baselines stop paying for the loop.
"""

import math

import torch
import torch.nn as nn

BATCH = 8
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
SEQ_LEN = 1024
PAGE_SIZE = 16

OP_TYPE = "attention"
SUPPORTED_PRECISIONS = ["bf16"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]


class Model(nn.Module):
    """Single-query decode over a paged KV cache; no parameters, an empty state dict."""

    def __init__(self, batch, num_heads, num_kv_heads, head_dim, seq_len, page_size):
        super().__init__()
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.batch = batch
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.seq_len = seq_len
        self.page_size = page_size
        self.group_size = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        self.register_buffer("_dummy", torch.zeros(1, dtype=torch.bfloat16), persistent=False)

    def forward(self, query, kv_cache, block_table, seq_lens):
        """query (B, H, D) bf16; kv_cache (pages, P, Hkv, 2D) bf16 with K then V on the last
        axis; block_table (B, pages_per_seq) int32; seq_lens (B,) int32 -> (B, H, D) bf16."""
        b, h, d = query.shape
        hkv, g, p = self.num_kv_heads, self.group_size, self.page_size
        n_tokens = block_table.shape[1] * p
        tokens = kv_cache[block_table.long()].reshape(b, n_tokens, hkv, 2 * d).float()
        valid = torch.arange(n_tokens, device=query.device)[None, :] < seq_lens.long()[:, None]
        k = tokens[..., :d]
        v = tokens[..., d:].masked_fill(~valid[:, :, None, None], 0.0)  # past-the-end slots may hold inf
        q = query.float().reshape(b, hkv, g, d)
        scores = torch.einsum("bkgd,blkd->bkgl", q, k) * self.scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, v)
        return out.reshape(b, h, d).to(query.dtype)


def get_inputs():
    """Query, KV pool, block table and lengths for the current globals, drawn on the CPU.

    Draw order (query, kv_cache, permutation) matches the original, so a seed gives the same
    tensors. The pool holds at least 8 pages that no sequence references.
    """
    pages_per_seq = (SEQ_LEN + PAGE_SIZE - 1) // PAGE_SIZE
    total_pages = max(BATCH * pages_per_seq + 8, 64)
    query = torch.randn(BATCH, NUM_HEADS, HEAD_DIM).mul_(0.1).to(torch.bfloat16)
    kv_cache = torch.randn(total_pages, PAGE_SIZE, NUM_KV_HEADS, 2 * HEAD_DIM).mul_(0.1).to(torch.bfloat16)
    perm = torch.randperm(total_pages)[: BATCH * pages_per_seq]
    block_table = perm.reshape(BATCH, pages_per_seq).to(torch.int32)
    seq_lens = torch.full((BATCH,), SEQ_LEN, dtype=torch.int32)
    return [query, kv_cache, block_table, seq_lens]


def ragged_lengths(inputs, divisor, tail, stride):
    """Structural stress: short ragged lengths whose exact answer is +1 everywhere.

    Sequence b gets length max(1, min(F, l - l % P + t)) with l = max(1, F // (divisor + b*stride)),
    t = ((tail - 1 + b*stride) % 15) + 1 and F the nominal length: short and never a multiple
    of the page size. The query and every K are zero (uniform attention); V is +1 on each
    sequence's valid slots and -1 on every other slot of the pool, so the output is exactly +1
    and any read past a length pulls it below.
    """
    query, kv_cache, block_table, seq_lens = inputs
    page, d = kv_cache.shape[1], query.shape[-1]
    full = int(seq_lens.max())
    lengths = []
    for b in range(seq_lens.shape[0]):
        ell = max(1, full // (divisor + b * stride))
        tau = ((tail - 1 + b * stride) % 15) + 1
        lengths.append(max(1, min(full, ell - ell % page + tau)))
    kv = kv_cache.clone()
    kv[..., :d] = 0
    kv[..., d:] = -1
    table = block_table.long().cpu()
    for b, length in enumerate(lengths):
        for i in range((length + page - 1) // page):
            kv[int(table[b, i]), : min(page, length - i * page), :, d:] = 1
    lens = torch.tensor(lengths, dtype=torch.int32, device=seq_lens.device)
    return [torch.zeros_like(query), kv, block_table.clone(), lens]


def get_init_inputs():
    return [BATCH, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SEQ_LEN, PAGE_SIZE]

"""A deliberately wrong paged-attention decode: a calibration row that must fail.

It attends over every slot of every page in the block table, ignoring `seq_lens`, so it reads
past the end of any sequence whose length is not a multiple of the page size — the classic
off-by-a-page bug. The grader must report `wrong` with the shape where it first shows.
"""

import math

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, batch, num_heads, num_kv_heads, head_dim, seq_len, page_size):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, query, kv_cache, block_table, seq_lens):
        b, h, d = query.shape
        tokens = kv_cache[block_table.long()].reshape(b, -1, self.num_kv_heads, 2 * d).float()
        q = query.float().reshape(b, self.num_kv_heads, self.group_size, d)
        scores = torch.einsum("bkgd,blkd->bkgl", q, tokens[..., :d]) * self.scale
        out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), tokens[..., d:])
        return out.reshape(b, h, d).to(query.dtype)


def get_inputs():
    import reference

    return reference.get_inputs()


def get_init_inputs():
    import reference

    return reference.get_init_inputs()

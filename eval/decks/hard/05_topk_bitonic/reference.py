"""Top-k along the last axis: the correctness oracle for 05_topk_bitonic.

Interface-compatible with KernelBench-Hard's reference: the same lower-case module globals
(`batch`, `n`, `k`), constructor, persistent `_dummy` buffer (the only state-dict key),
`get_inputs()` draw and output, a tuple (values, indices) with values sorted largest first.
Ties may be broken any way, so only the values are unique: a grader compares values by
position and checks that x gathered at the returned indices gives those values.
"""

import torch
import torch.nn as nn

batch = 64
n = 8192
k = 8

OP_TYPE = "topk"
SUPPORTED_PRECISIONS = ["fp32"]
HARDWARE_REQUIRED = ["RTX_PRO_6000", "H100", "B200"]


class Model(nn.Module):
    """The k largest entries of every row; state: one persistent fp32 buffer `_dummy` of shape (1,)."""

    def __init__(self, batch, n, k):
        super().__init__()
        self.batch = batch
        self.n = n
        self.k = k
        self.register_buffer("_dummy", torch.zeros(1, dtype=torch.float32))

    def forward(self, x):
        """x (batch, n) fp32 -> (values (batch, k) fp32 descending, indices (batch, k) int64)."""
        values, indices = torch.topk(x, self.k, dim=-1, largest=True, sorted=True)
        return values, indices


def get_inputs():
    """One (batch, n) fp32 standard-normal matrix for the current globals, drawn on the CPU."""
    return [torch.randn(batch, n, dtype=torch.float32)]


def clustered_spikes(inputs, partition, offset, extra_values, baseline_quarters, tie_run):
    """Structural stress: more than k spikes packed into one 1024-wide partition, above a sea of
    exact ties, optionally with runs of equal spikes so the k-th value is tied.

    Every element becomes baseline = baseline_quarters / 4. Row r gets c = min(n, min(64, n) +
    extra_values) spikes in columns [s, s + c), where the partition width is w = min(1024, n),
    s = p·w + (offset + 37·r) mod max(1, w − c + 1) and p = (partition + r) mod max(1, n // w).
    Spike j holds baseline + ramp[j - j mod tie_run] with ramp an evenly spaced fp32 descent
    from 1.0 to 0.25: tie_run = 1 gives c distinct spikes (KernelBench-Hard's "clustered spikes"
    case, whose row 0 this is), tie_run = 3 makes ranks k and k + 1 equal for every k of the
    deck (64, 8, 32, 16 and 1), so only the values, not the indices, are determined.
    """
    (x,) = inputs
    rows, width = x.shape[0], x.shape[1]
    part_width = min(1024, width)
    partitions = max(1, width // part_width)
    count = min(width, min(64, width) + extra_values)
    room = max(1, part_width - count + 1)
    run = max(1, tie_run)
    ramp = torch.linspace(1.0, 0.25, count, dtype=torch.float32)
    spikes = ramp[torch.arange(count) // run * run] + baseline_quarters / 4
    out = torch.full((rows, width), baseline_quarters / 4, dtype=torch.float32)
    for r in range(rows):
        start = ((partition + r) % partitions) * part_width + (offset + 37 * r) % room
        out[r, start:start + count] = spikes
    return [out.to(x.device)]


def get_init_inputs():
    return [batch, n, k]


def library_topk(model, x):
    """The library line: `torch.topk` itself (what a kernel has to beat; never a solution)."""
    return torch.topk(x, model.k, dim=-1, largest=True, sorted=True)

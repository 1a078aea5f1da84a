"""W4A16 GEMM (asymmetric int4 weights, group size 128, bf16 activations) in Triton.

A kernelboard house kernel, written from scratch by the kernelboard team (not
an AI submission).  y = x · W with

    W[k, n] = (q[k, n] - zeros[k // 128, n]) · scales[k // 128, n],

q packed two per byte in `w_q` (K/2, N): k = 2r in the low nibble of byte
[r, n], k = 2r + 1 in the high nibble.  The dequantised weight never exists in
global memory: every kernel reads the packed bytes once and unpacks them in
registers.

Both kernels use the same algebra: within one group g the zero point and
scale are constant per column, so

    sum_k x[k] W[k, n] = s[g, n] · (sum_k x[k] q[k, n] - z[g, n] · sum_k x[k]),

i.e. the inner loop only needs the raw codes (0..15, exact in bf16) and the
per-group correction is applied to a [rows, BLOCK_N] partial sum.  Even /
odd k are handled by splitting the x tile in two (`tl.split` of a
[.., BLOCK_K/2, 2] view), never by interleaving the nibbles.  The reference
rounds each dequantised weight to bf16; this kernel uses the exact (q - z)·s,
a difference of about 2⁻⁹ relative per weight, far inside the 0.1 / 0.1
tolerance (and the 5 % rtol of the stress cases).

* `_w4a16_mma` (M >= 5): tiled GEMM, one program per (BLOCK_M, BLOCK_N)
  output tile, grouped tile order.  Per K step (BLOCK_K divides 128, so one
  group per step): load x [BLOCK_M, BLOCK_K] bf16 and the packed
  [BLOCK_K/2, BLOCK_N] bytes, form the low / high code tiles as bf16 by
  bit tricks (bits 0x4300 | c are the bf16 value 128 + c, exact, so no
  int->float conversions), two `tl.dot`s (even x × low tile, odd x × high
  tile) into an fp32 partial, then acc += (partial - rowsum(x)·(z + 128))·s.
  The 128 offset cancels exactly in real arithmetic; in fp32 it costs about
  2⁻²⁴·128·Σ|x| per group, negligible next to the tolerance.  On CUDA the tile sizes are
  autotuned (keyed on M, N, K) among a few configs per M regime.
* `_w4a16_gemv` (M <= 4): one program per (BLOCK_N columns, K split, row).
  Each K step is one group: the codes are unpacked to fp32, multiplied by the
  even / odd halves of x and reduced over k in registers, then corrected as
  above.  K is split so that there are a few programs per SM even at N = 4096;
  each split writes an fp32 partial to a cached workspace and bumps a
  per-(row, column block) counter (acq_rel atomic); the last split to arrive
  sums the partials in split order (deterministic), writes bf16 and resets the
  counter, so the workspace never needs a memset.  Calls on one stream are
  serialised, so the workspace is shared across calls of one geometry.

Under the Triton interpreter (CPU) the first config of the M regime is
launched directly, with the two MMA operands upcast to fp32 (the 3.6
interpreter's bf16 `tl.dot` multiplies the raw bf16 bit patterns); the CUDA
path never upcasts.

Everything per geometry (kernel, grid, constexprs, workspace) is computed once
and cached; a call is a dict lookup, an output allocation and one launch, with
no host synchronisation.
"""
import torch
import torch.nn as nn
import triton
import triton.language as tl

GROUP_SIZE = 128


def shape_seed(m: int, n: int, k: int) -> int:
    """The reference's reseed: 0xC0DE XOR (M·1315423911 + N·2654435761 + K)."""
    return 0xC0DE ^ (m * 1315423911 + n * 2654435761 + k)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(K, N) uint8 codes 0..15 -> (K/2, N) uint8: row 2r in the low nibble, row 2r+1 in the high."""
    return codes[0::2] | (codes[1::2] << 4)


def _unpack_int4(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """(K/2, N) uint8 -> (K, N) uint8 codes 0..15, the inverse of `_pack_int4`."""
    rows, cols = packed.shape
    if k is not None and k != 2 * rows:
        raise ValueError(f"k={k} does not match {rows} packed rows (expected {2 * rows})")
    return torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(2 * rows, cols)


@triton.jit
def _w4a16_mma(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr = False,  # CPU interpreter only: its bf16 tl.dot multiplies raw bits
):
    HALF_K: tl.constexpr = BLOCK_K // 2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    cols = offs_n % N  # wrapped: out-of-range columns are loaded but never stored
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, HALF_K)

    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]   # [BLOCK_M, BLOCK_K]
    w_ptrs = wq_ptr + offs_r.to(tl.int64)[:, None] * N + cols[None, :]             # [HALF_K, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        p = tl.load(w_ptrs)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + cols).to(tl.float32)
        z = tl.load(z_ptr + g * N + cols).to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, HALF_K, 2)))
        # code c -> bf16 bits 0x4300 | c = 128 + c (exact; no int->float conversion instruction)
        q_lo = ((p & 0xF).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        q_hi = ((p >> 4).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        if UPCAST:
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            q_lo, q_hi = q_lo.to(tl.float32), q_hi.to(tl.float32)
        part = tl.dot(x_even, q_lo)
        part = tl.dot(x_odd, q_hi, part)
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc += (part - x_sum[:, None] * (z[None, :] + 128.0)) * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += HALF_K * N

    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4a16_gemv(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_xm, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,   # multiple of GROUP
):
    HALF_G: tl.constexpr = GROUP // 2
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    cols = offs_n % N
    offs_r = tl.arange(0, HALF_G)

    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_end, GROUP):
        x_even = tl.load(x_row + k0 + 2 * offs_r).to(tl.float32)       # [HALF_G]
        x_odd = tl.load(x_row + k0 + 2 * offs_r + 1).to(tl.float32)
        p = tl.load(wq_ptr + (k0 // 2 + offs_r).to(tl.int64)[:, None] * N + cols[None, :])  # [HALF_G, BLOCK_N]
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + cols).to(tl.float32)
        z = tl.load(z_ptr + g * N + cols).to(tl.float32)
        q_lo = (p & 0xF).to(tl.float32)
        q_hi = (p >> 4).to(tl.float32)
        part = tl.sum(x_even[:, None] * q_lo + x_odd[:, None] * q_hi, axis=0)  # [BLOCK_N]
        x_sum = tl.sum(x_even, axis=0) + tl.sum(x_odd, axis=0)
        acc += (part - x_sum * z) * s

    y_ptrs = y_ptr + row.to(tl.int64) * stride_ym + offs_n
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(tl.bfloat16), mask=n_ok)
    else:
        # workspace: (rows, SPLIT_K, N) fp32 partials; counters: (rows, column blocks) int32
        ws_row = ws_ptr + row.to(tl.int64) * (SPLIT_K * N)
        tl.store(ws_row + split * N + offs_n, acc, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below
        cnt = cnt_ptr + row * tl.num_programs(0) + pid_n
        count = tl.atomic_add(cnt, 1, sem="acq_rel")
        if count == SPLIT_K - 1:  # last split of this (row, column block): reduce in split order
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):
                total += tl.load(ws_row + sp * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(tl.bfloat16), mask=n_ok)
            tl.store(cnt, 0)  # ready for the next call (stream-ordered)


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Per M regime (BLOCK_M = the regime's row tile); BLOCK_K must divide the group size 128.
_MMA_CONFIGS = {
    16: [_cfg(16, 64, 128, 4, 4), _cfg(16, 128, 128, 4, 4), _cfg(16, 64, 64, 4, 5), _cfg(16, 32, 128, 4, 4)],
    32: [_cfg(32, 64, 128, 4, 4), _cfg(32, 128, 128, 4, 4), _cfg(32, 64, 64, 4, 5), _cfg(32, 32, 128, 4, 4)],
    64: [_cfg(64, 64, 128, 4, 4), _cfg(64, 128, 128, 4, 4), _cfg(64, 128, 64, 4, 4)],
    128: [_cfg(128, 128, 128, 8, 3), _cfg(64, 128, 128, 4, 4), _cfg(128, 64, 128, 4, 4),
          _cfg(128, 256, 64, 8, 3), _cfg(64, 256, 128, 8, 3)],
}
_MMA_TUNED = {bm: triton.autotune(configs=cfgs, key=["M", "N", "K"])(_w4a16_mma)
              for bm, cfgs in _MMA_CONFIGS.items()}
_GEMV_MAX_M = 4


def _regime(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    try:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(idx).multi_processor_count
    except Exception:
        return 132


class _Plan:
    """Launch state for one (M, N, K, group, device)."""

    __slots__ = ("cnt", "consts", "gemv", "grid", "kernel", "launch_kw", "ws")

    def __init__(self, m: int, n: int, k: int, group: int, device: torch.device):
        self.gemv = m <= _GEMV_MAX_M
        self.ws = self.cnt = None
        if self.gemv:
            block_n = 64
            n_blocks = _cdiv(n, block_n)
            groups = k // group
            # a few programs per SM: split K (in whole groups) until the grid is large enough
            target = 3 * _num_sms(device)
            split = max(1, min(groups, _cdiv(target, n_blocks * m), 16))
            k_per_split = _cdiv(groups, split) * group
            split = _cdiv(k, k_per_split)  # no empty splits
            self.kernel = _w4a16_gemv
            self.grid = (n_blocks, split, m)
            self.consts = dict(GROUP=group, BLOCK_N=block_n, SPLIT_K=split, K_PER_SPLIT=k_per_split)
            self.launch_kw = dict(num_warps=4, num_stages=3)
            if split > 1:
                self.ws = torch.empty(m * split * n, dtype=torch.float32, device=device)
                self.cnt = torch.zeros(m * n_blocks, dtype=torch.int32, device=device)
        else:
            bm = _regime(m)
            self.consts = dict(GROUP=group)
            if device.type == "cuda":
                self.kernel = _MMA_TUNED[bm]
                self.launch_kw = {}

                def grid(meta):
                    return (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]),)
            else:  # interpreter: first config of the regime, launched directly
                cfg = _MMA_CONFIGS[bm][0]
                self.kernel = _w4a16_mma
                self.consts.update(cfg.kwargs, UPCAST=True)
                self.launch_kw = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                ntiles = _cdiv(m, cfg.kwargs["BLOCK_M"]) * _cdiv(n, cfg.kwargs["BLOCK_N"])

                def grid(meta, _g=(ntiles,)):
                    return _g
            self.grid = grid


class Model(nn.Module):
    """y = x · W, W dequantised on the fly from `w_q` (K/2, N) uint8, `scales` and `zeros` (K/g, N) bf16 --
    the reference's buffers (the grader loads its state dict into this module)."""

    def __init__(self, M: int, N: int, K: int, group_size: int = GROUP_SIZE):
        super().__init__()
        assert K % group_size == 0, "K must be a multiple of group_size"
        assert K % 2 == 0, "K must be even (two codes per byte)"
        assert group_size >= 128 and group_size & (group_size - 1) == 0, "kernel needs a power-of-two group >= 128"
        self.M, self.N, self.K, self.group_size = M, N, K, group_size
        # same construction (and global-RNG reseed) as the reference; the grader overwrites the buffers
        torch.manual_seed(shape_seed(M, N, K))
        w = torch.randn(K, N) * 0.02
        groups = w.view(K // group_size, group_size, N)
        lo, hi = groups.amin(dim=1), groups.amax(dim=1)
        scale = (hi - lo).clamp_min(1e-8) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
        codes = torch.round(groups / scale[:, None, :] + zero[:, None, :]).clamp(0, 15).to(torch.uint8)
        self.register_buffer("w_q", _pack_int4(codes.view(K, N)))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.register_buffer("zeros", zero.to(torch.bfloat16))
        self._plans: dict = {}  # plain attribute, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) bf16 -> (M, N) bf16."""
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if x.stride(-1) != 1:
            x = x.contiguous()
        wq, s, z = self.w_q, self.scales, self.zeros
        if not (wq.is_contiguous() and s.is_contiguous() and z.is_contiguous()):
            wq, s, z = wq.contiguous(), s.contiguous(), z.contiguous()
        m, k = x.shape
        n = wq.shape[1]
        key = (m, n, k, x.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(m, n, k, self.group_size, x.device)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        if plan.gemv:
            ws = plan.ws if plan.ws is not None else y
            cnt = plan.cnt if plan.cnt is not None else y
            plan.kernel[plan.grid](x, wq, s, z, y, ws, cnt, n, k, x.stride(0), y.stride(0),
                                   **plan.consts, **plan.launch_kw)
        else:
            plan.kernel[plan.grid](x, wq, s, z, y, m, n, k, x.stride(0), y.stride(0),
                                   **plan.consts, **plan.launch_kw)
        return y


def get_inputs():
    import reference
    return reference.get_inputs()


def get_init_inputs():
    import reference
    return reference.get_init_inputs()

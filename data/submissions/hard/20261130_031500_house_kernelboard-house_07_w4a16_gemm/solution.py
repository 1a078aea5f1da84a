"""W4A16 GEMM (asymmetric int4 weights, group size 128, bf16 activations) in Triton -- house kernel v3.

A kernelboard house kernel, written from scratch by the kernelboard team (not
an AI submission).  v3 is v2 (20261130_120000) with wider token tiles for
M > 64.  v2 on an H200 (grader 0.2.2, 2026-11-30): 0.0516 / 0.0729 / 0.1992 /
0.0464 / 0.0785 ms on the five shapes, 1.60x torch.compile, but 0.70x on
M = 256, where the best of its configs was BLOCK_M = 64: every packed weight
tile was unpacked once per 64 tokens, four times per call.  v3 adds tiles of
128 and 256 tokens (wgmma m64n128 / m64n256; compiled for sm_90 with Triton
3.6: 64-131 KB of shared memory, no local-memory spills), so that at
M = 256 each weight tile is unpacked once.  The autotuner still chooses per
(M, N, K) among v2's configs and the new ones; nothing else changed.

    y = x · W,   W[k, n] = (q[k, n] - zeros[k // 128, n]) · scales[k // 128, n],

q packed two per byte in `w_q` (K/2, N): k = 2r in the low nibble of byte
[r, n], k = 2r + 1 in the high nibble.  The dequantised weight never exists
in global memory; every packed byte is read from HBM once per column block.

Taken over from v1 (20261129_190000):
  * the zero-point algebra: within one group the zero point and scale are
    constant per column, so sum_k x[k] W[k, n] = s · (sum_k x[k] q[k, n] -
    z · sum_k x[k]); the MMA only sees raw codes and the correction is applied
    to the fp32 partial once per K step;
  * the code -> bf16 bit trick: bits 0x4300 | c are the bf16 value 128 + c
    (exact), the 128 is folded into the correction as (z + 128);
  * even / odd k are kept apart (low nibbles with even k, high with odd k)
    rather than interleaved;
  * the split-K reduction without a memset: partials in a cached fp32
    workspace, a per-tile counter bumped with an acq_rel atomic, the last
    split to arrive sums the partials in split order (deterministic), writes
    bf16 and resets the counter;
  * the plan cache (kernel, grid, constants, workspace per geometry; one
    launch, no host synchronisation per call) and the interpreter rule (the
    dot operands are upcast to fp32 under TRITON_INTERPRET=1, because the 3.6
    interpreter's bf16 tl.dot multiplies raw bit patterns).

What is new in v2:

* `_w4a16_mma_t` (M >= 5) computes yᵀ = Wᵀ · xᵀ.  v1 used the dequantised
  weight tile as tl.dot's B operand.  Compiling v1 for sm_90 shows two
  different problems: with BLOCK_M < 64 (the M <= 32 regimes) Triton cannot
  use wgmma at all and falls back to mma.sync, with the unpacked tile taken
  through a shared-memory layout conversion every step; with BLOCK_M >= 64 the
  wgmma's B operand is the register tile stored to shared memory
  (local_alloc + fence.proxy.async) and every wgmma is waited for at once.
  Swapped, the weight tile [BLOCK_N, BLOCK_K/2] is the A operand, which wgmma
  may take from registers, and the GEMM's M side is BLOCK_N (64 per
  warpgroup), so wgmma is used for any number of tokens (BLOCK_M = 16 ... 128
  is wgmma's N).  In the sm_90 IR the packed bytes travel by cp.async into a
  multi-stage shared buffer and are read from it directly in the MMA's
  register layout (Triton hoists the layout conversion above the unpacking
  because the unpacking is elementwise with constant operands), so the
  dequantised tile is never stored.  x is read as 32-bit words (one even and
  one odd bf16 each: cp.async-able, 4-byte aligned) and split in registers;
  only this small x tile is written to shared memory as wgmma's B operand.
  Per K step: two wgmmas (low codes × even x, high codes × odd x) into a
  fresh fp32 partial, then acc += (partial - (z + 128)·rowsum(x))·s.
  The correction needs the partial at once, so each wgmma is still waited
  for within its step (the loads of later steps are in flight meanwhile);
  for large M the MMA and the ALU work of one program therefore do not
  overlap, and several programs per SM are what hides it.
  For M <= 32 the configs may split K in two or four (same deterministic
  reduction as the GEMV) to fill 132 SMs.  Tile sizes are autotuned (keyed on
  M, N, K) over a few configs per M regime; the first config of each regime is
  the conservative one and is what the interpreter runs.
* `_w4a16_gemv` (M <= 4): one program per (256 columns, K split, row).
  v1 loaded [64 rows x 64 columns] byte tiles and reduced over k across
  threads every step.  v2 walks 32 packed rows of 256 contiguous bytes per
  step (every load of the step issued before any use), keeps one fp32
  partial per column in registers (no cross-thread reduction in the loop),
  takes x as 32-bit words (bf16 -> fp32 is a shift) and applies the group
  correction per step.  K is split so that there are about eight small (two
  warps) programs per SM.

Accuracy: the kernels use the exact (q - z)·s where the reference rounds each
dequantised weight to bf16 (about 2^-9 relative per weight), and the 128
offset costs about 2^-24·128·sum|x| per group in fp32; both far inside the
0.1 / 0.1 tolerance and the 5 % rtol of the stress cases.
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
def _w4a16_mma_t(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N,
    K: tl.constexpr,         # fixed per module; constexpr keeps the loop bounds static (also for the interpreter)
    stride_xm, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,   # tokens per tile: wgmma's N side
    BLOCK_N: tl.constexpr,   # weight columns per tile: wgmma's M side (64 per warpgroup)
    BLOCK_K: tl.constexpr,   # divides GROUP: one group per K step
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr = False,  # CPU interpreter only: its bf16 tl.dot multiplies raw bits
):
    HALF_K: tl.constexpr = BLOCK_K // 2
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    # token tiles of one column block are neighbours in launch order: the second reads W from L2
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    cols = offs_n % N  # wrapped: out-of-range columns are loaded but never stored
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_r = tl.arange(0, HALF_K)

    # the host only launches SPLIT_K dividing K / BLOCK_K: every split has K / SPLIT_K of the k range
    k_lo = split * (K // SPLIT_K)

    # packed bytes, transposed view [BLOCK_N, HALF_K]: column n of W is row n of the A operand
    w_ptrs = wq_ptr + ((k_lo // 2 + offs_r).to(tl.int64) * N)[None, :] + cols[:, None]
    # x as 32-bit words: word r of a row holds x[2r] (low half) and x[2r + 1] (high half)
    x_words = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    x_ptrs = x_words + (offs_m.to(tl.int64) * (stride_xm // 2))[:, None] + (k_lo // 2 + offs_r)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, K, BLOCK_K * SPLIT_K):   # trip count K / (BLOCK_K · SPLIT_K)
        k0 = k_lo + kk // SPLIT_K
        p = tl.load(w_ptrs)                                      # [BLOCK_N, HALF_K] uint8
        xw = tl.load(x_ptrs, mask=m_ok[:, None], other=0)        # [BLOCK_M, HALF_K] uint32
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + cols).to(tl.float32)
        z = tl.load(z_ptr + g * N + cols).to(tl.float32)
        x_even = (xw & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        x_odd = (xw >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        # code c -> bf16 bits 0x4300 | c = 128 + c: elementwise with constants only, so Triton can
        # read the bytes from shared memory straight into the MMA's register layout
        q_lo = ((p & 0xF).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        q_hi = ((p >> 4).to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)   # [BLOCK_M]
        if UPCAST:
            q_lo, q_hi = q_lo.to(tl.float32), q_hi.to(tl.float32)
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
        part = tl.dot(q_lo, tl.trans(x_even))
        part = tl.dot(q_hi, tl.trans(x_odd), part)                # [BLOCK_N, BLOCK_M]
        acc += (part - (z + 128.0)[:, None] * x_sum[None, :]) * s[:, None]
        w_ptrs += HALF_K * N
        x_ptrs += HALF_K

    y_ptrs = y_ptr + (offs_m.to(tl.int64) * stride_ym)[None, :] + offs_n[:, None]
    out_ok = m_ok[None, :] & n_ok[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(tl.bfloat16), mask=out_ok)
    else:
        # workspace: (SPLIT_K, M, N) fp32 partials; counters: one int32 per output tile
        part_ptrs = ws_ptr + (offs_m.to(tl.int64) * N)[None, :] + offs_n[:, None]
        tl.store(part_ptrs + split.to(tl.int64) * M * N, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is written before the release below
        cnt = cnt_ptr + pid
        count = tl.atomic_add(cnt, 1, sem="acq_rel")
        if count == SPLIT_K - 1:  # last split of this tile: reduce in split order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):
                total += tl.load(part_ptrs + sp * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(tl.bfloat16), mask=out_ok)
            tl.store(cnt, 0)  # ready for the next call (stream-ordered)


@triton.jit
def _w4a16_gemv(
    x_ptr, wq_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr,
    N,
    K: tl.constexpr,
    stride_xm, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,          # packed rows per step (2·ROWS k values); 2·ROWS divides GROUP
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,   # multiple of 2·ROWS, divides K
):
    STEP: tl.constexpr = 2 * ROWS
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    cols = offs_n % N

    k_start = split * K_PER_SPLIT   # the host picks K_PER_SPLIT dividing K
    x_words = x_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + row.to(tl.int64) * (stride_xm // 2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, K_PER_SPLIT // STEP):
        k0 = k_start + i * STEP
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + cols).to(tl.float32)
        z = tl.load(z_ptr + g * N + cols).to(tl.float32)
        w_row = wq_ptr + (k0 // 2).to(tl.int64) * N + cols
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        x_sum = 0.0
        for r in tl.static_range(ROWS):
            p = tl.load(w_row + r * N)                  # [BLOCK_N] uint8, contiguous
            xw = tl.load(x_words + k0 // 2 + r)         # scalar: x[k0 + 2r] | x[k0 + 2r + 1] << 16
            x_even = (xw << 16).to(tl.float32, bitcast=True)
            x_odd = (xw & 0xFFFF0000).to(tl.float32, bitcast=True)
            part += x_even * (p & 0xF).to(tl.float32) + x_odd * (p >> 4).to(tl.float32)
            x_sum += x_even + x_odd
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


def _cfg(bm, bn, bk, warps, stages, split=1):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split},
                         num_warps=warps, num_stages=stages)


# Per M regime (the key is the regime's BLOCK_M); BLOCK_K divides the group size 128; BLOCK_N is
# 64 per warpgroup.  The first entry of each list is the conservative config (and the one the
# interpreter runs).  Split-K is offered only where M <= 32 (the workspace is SPLIT_K·M·N fp32).
_MMA_CONFIGS = {
    16: [_cfg(16, 64, 128, 4, 4), _cfg(16, 128, 128, 8, 4), _cfg(16, 64, 128, 4, 4, 2),
         _cfg(16, 128, 128, 8, 4, 2), _cfg(16, 64, 64, 4, 6), _cfg(16, 64, 64, 4, 6, 2),
         _cfg(16, 64, 128, 4, 3, 4)],
    32: [_cfg(32, 64, 128, 4, 4), _cfg(32, 128, 128, 8, 4), _cfg(32, 64, 128, 4, 4, 2),
         _cfg(32, 128, 128, 8, 4, 2), _cfg(32, 64, 64, 4, 6), _cfg(32, 64, 64, 4, 6, 2),
         _cfg(32, 64, 128, 4, 3, 4)],
    64: [_cfg(64, 64, 128, 4, 3), _cfg(64, 128, 128, 8, 3), _cfg(64, 64, 64, 4, 5),
         _cfg(64, 128, 64, 8, 4)],
    128: [_cfg(64, 128, 128, 8, 3), _cfg(128, 128, 128, 8, 3), _cfg(128, 128, 64, 8, 4),
          _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 128, 4, 4),
          # v3: one token tile per 128 or 256 rows, 8 warps (two warpgroups split the tokens)
          _cfg(128, 64, 64, 8, 4), _cfg(128, 64, 128, 8, 3), _cfg(256, 64, 64, 8, 3),
          _cfg(256, 64, 64, 8, 4), _cfg(256, 128, 64, 8, 3)],
}


def _split_fits(cfg, k: int) -> bool:
    steps = k // cfg.kwargs["BLOCK_K"]
    return steps % cfg.kwargs["SPLIT_K"] == 0 and steps >= cfg.kwargs["SPLIT_K"]


def _prune(configs, named_args, **kwargs):
    """Autotune pre-filter: only split-K configs whose splits are equal (the kernel assumes it)."""
    return [c for c in configs if _split_fits(c, named_args["K"])]


_MMA_TUNED = {
    bm: triton.autotune(configs=cfgs, key=["M", "N", "K"],
                        prune_configs_by={"early_config_prune": _prune})(_w4a16_mma_t)
    for bm, cfgs in _MMA_CONFIGS.items()
}
_GEMV_MAX_M = 4
_GEMV_BLOCK_N = 256
_GEMV_ROWS = 32
_GEMV_MAX_SPLIT = 32


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
            block_n, rows = _GEMV_BLOCK_N, _GEMV_ROWS
            step = 2 * rows
            n_blocks = _cdiv(n, block_n)
            chunks = k // step
            # about eight small programs per SM: split K (in whole steps) until the grid is large enough
            target = 8 * _num_sms(device)
            want = max(1, min(chunks, _cdiv(target, n_blocks * m), _GEMV_MAX_SPLIT))
            split = max(d for d in range(1, want + 1) if chunks % d == 0)  # equal splits
            k_per_split = chunks // split * step
            self.kernel = _w4a16_gemv
            self.grid = (n_blocks, split, m)
            self.consts = dict(GROUP=group, BLOCK_N=block_n, ROWS=rows, SPLIT_K=split, K_PER_SPLIT=k_per_split)
            self.launch_kw = dict(num_warps=2, num_stages=1)
            if split > 1:
                self.ws = torch.empty(m * split * n, dtype=torch.float32, device=device)
                self.cnt = torch.zeros(m * n_blocks, dtype=torch.int32, device=device)
        else:
            bm = _regime(m)
            cfgs = _MMA_CONFIGS[bm]
            self.consts = dict(GROUP=group)
            max_split = max(c.kwargs["SPLIT_K"] for c in cfgs)
            if max_split > 1:
                min_bm = min(c.kwargs["BLOCK_M"] for c in cfgs)
                min_bn = min(c.kwargs["BLOCK_N"] for c in cfgs)
                self.ws = torch.empty(max_split * m * n, dtype=torch.float32, device=device)
                self.cnt = torch.zeros(_cdiv(m, min_bm) * _cdiv(n, min_bn), dtype=torch.int32, device=device)
            if device.type == "cuda":
                self.kernel = _MMA_TUNED[bm]
                self.launch_kw = {}

                def grid(meta):
                    return (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])
            else:  # interpreter: first config of the regime, launched directly
                cfg = cfgs[0]
                self.kernel = _w4a16_mma_t
                self.consts.update(cfg.kwargs, UPCAST=True)
                self.launch_kw = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                fixed = (_cdiv(m, cfg.kwargs["BLOCK_M"]) * _cdiv(n, cfg.kwargs["BLOCK_N"]), cfg.kwargs["SPLIT_K"])

                def grid(meta, _g=fixed):
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
        # both kernels read x as 32-bit words: unit stride, even row stride, 4-byte aligned base
        if x.stride(-1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.contiguous() if x.stride(-1) != 1 else x.clone()
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
        ws = plan.ws if plan.ws is not None else y
        cnt = plan.cnt if plan.cnt is not None else y
        if plan.gemv:
            plan.kernel[plan.grid](x, wq, s, z, y, ws, cnt, n, k, x.stride(0), y.stride(0),
                                   **plan.consts, **plan.launch_kw)
        else:
            plan.kernel[plan.grid](x, wq, s, z, y, ws, cnt, m, n, k, x.stride(0), y.stride(0),
                                   **plan.consts, **plan.launch_kw)
        return y


def get_inputs():
    import reference
    return reference.get_inputs()


def get_init_inputs():
    import reference
    return reference.get_init_inputs()

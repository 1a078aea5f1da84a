"""Paged-attention decode (one query token per sequence) in Triton.

A kernelboard house kernel, written from scratch by the kernelboard team (not
an AI submission): flash-decoding with a split over the token axis, fused into
ONE kernel launch per call, with a host side trimmed for low dispatch latency.

Kernel (`_paged_decode`), grid (NUM_SPLITS, Hkv, B):

* One program owns every query head of one KV-head group (G = H / Hkv heads,
  padded to G_PAD >= 16 rows so `tl.dot` can be used) and one contiguous chunk
  of that sequence's tokens (ceil(L_b / NUM_SPLITS) rounded up to 16, chosen
  in-kernel so ragged batches stay balanced).  It walks the chunk BLOCK_N
  tokens at a time, gathering page ids from the block table, loading K and V
  masked at L_b (slots past a sequence's length are never read), and keeps an
  online softmax (running max / sum / fp32 accumulator, base-2 exponentials
  with scale*log2(e) folded into a constexpr).
* NUM_SPLITS == 1: the program normalises and writes the bf16 output.
* NUM_SPLITS > 1: each non-empty split writes its partial (acc, m, l) to a
  cached fp32 workspace, then (after a CTA barrier) bumps a per-(b, kv-head)
  int32 counter with an acq_rel atomic.  The program that sees
  count == NUM_SPLITS - 1 is the last one of its group: it reads the partials
  of the non-empty splits (visible through the release/acquire chain; loaded
  .cg so L1 is bypassed), merges them in one log-sum-exp pass, writes the
  bf16 output and resets the counter to 0, so the workspace needs no memset.
  Calls on one stream are serialised, so the workspace is shared across calls.

Inputs are assumed contiguous (made so on the host if not); every stride is
derived from constexprs (D, P, Hkv, G, pages per sequence), so the kernel takes
only pointers.  Everything that depends on the input geometry (grid, split
count, constexprs, workspace, counters) is computed once per geometry; a call is
one dict lookup, one `torch.empty_like` and one launch.  After the first
(normal) Triton launch of a geometry, later calls on Triton 3.6 go straight to
the compiled kernel's launcher with the argument list `JITFunction.run` itself
passes (checked against the 3.6.0 source), pointers given as ints; any
surprise disables that shortcut for good and falls back to the normal
`kernel[grid](...)` launch, which is also used while a Triton launch hook
(profiler) is installed or a pointer is not 16-byte aligned.
"""
import math

import torch
import triton
import triton.language as tl


_NEG_BIG = tl.constexpr(-1.0e30)  # globals used in @jit must be constexpr
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode(
    q_ptr, kv_ptr, bt_ptr, sl_ptr, out_ptr, ws_ptr, cnt_ptr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,        # query rows of the MMA tile: max(16, next_pow2(G))
    G_R: tl.constexpr,          # rows of the reduction tile: next_pow2(G)
    D: tl.constexpr,
    P: tl.constexpr,
    PPS: tl.constexpr,          # pages per sequence (block_table row length)
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QK_SCALE: tl.constexpr,     # softmax scale * log2(e)
    PV_SPLIT: tl.constexpr,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)

    MAX_LEN: tl.constexpr = PPS * P
    seq_len = tl.load(sl_ptr + b)
    seq_len = tl.minimum(seq_len, MAX_LEN)
    # Per-sequence chunk: ceil(L / NUM_SPLITS) rounded up to a multiple of 16.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), 16) * 16
    chunk = tl.maximum(chunk, 16)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    heads = kvh * G + offs_g  # query heads served by this KV head

    # query / out: contiguous (B, HKV*G, D); row base of this batch entry
    qo_row = b.to(tl.int64) * (HKV * G * D)
    q = tl.load(q_ptr + qo_row + heads[:, None] * D + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # [G_PAD, D]

    m_i = tl.full([G_PAD], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)

    # block_table: contiguous (B, PPS); kv_cache: contiguous (pages, P, HKV, 2D)
    bt_row = bt_ptr + b.to(tl.int64) * PPS
    kv_head = kv_ptr + kvh * (2 * D)
    k_dofs = offs_d
    v_dofs = offs_d + D

    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_n
        t_mask = t < end
        page = tl.load(bt_row + t // P, mask=t_mask, other=0)
        slot = t % P
        tok_off = page.to(tl.int64) * (P * HKV * 2 * D) + slot * (HKV * 2 * D)  # [BLOCK_N]
        k = tl.load(kv_head + tok_off[:, None] + k_dofs[None, :],
                    mask=t_mask[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(kv_head + tok_off[:, None] + v_dofs[None, :],
                    mask=t_mask[:, None], other=0.0)  # [BLOCK_N, D]

        s = tl.dot(q, tl.trans(k))  # [G_PAD, BLOCK_N], fp32
        s = s * QK_SCALE
        s = tl.where(t_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        p_hi = p.to(v.dtype)
        acc = tl.dot(p_hi, v, acc)
        if PV_SPLIT:
            # second MMA on the bf16 rounding residual of p: keeps the
            # probabilities at ~16 mantissa bits (MMA throughput is idle here)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = tl.dot(p_lo, v, acc)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + qo_row + heads[:, None] * D + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # workspace record per (b, kvh, split): acc [G, D], then m [G], then l [G]
        REC: tl.constexpr = G * (D + 2)
        grp = b * HKV + kvh
        grp_ws = ws_ptr + grp.to(tl.int64) * (NUM_SPLITS * REC)
        if start < seq_len:  # empty splits store nothing; the reducer skips them
            rec = grp_ws + split * REC
            tl.store(rec + offs_g[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
            tl.store(rec + G * D + offs_g, m_i, mask=g_mask)
            tl.store(rec + G * D + G + offs_g, l_i, mask=g_mask)
        # every thread's stores happen-before the (single-thread) release below
        tl.debug_barrier()
        count = tl.atomic_add(cnt_ptr + grp, 1, sem="acq_rel")
        if count == NUM_SPLITS - 1:
            # last program of this (b, kvh): one-pass log-sum-exp merge of the
            # non-empty splits (a prefix: s < n_valid) on [G_R, D] tiles
            # (G_R = next_pow2(G), no MMA padding).  Skipped splits / padded rows
            # read m = -1e30, l = 0, acc = 0 and get weight exp2(-1e30 - m) = 0.
            n_valid = tl.cdiv(seq_len, chunk)
            offs_r = tl.arange(0, G_R)
            r_mask = offs_r < G
            m_o = tl.full([G_R], _NEG_BIG, dtype=tl.float32)
            l_o = tl.zeros([G_R], dtype=tl.float32)
            acc_o = tl.zeros([G_R, D], dtype=tl.float32)
            for sp in tl.static_range(NUM_SPLITS):
                ok = offs_r < tl.where(sp < n_valid, G, 0)
                rs = grp_ws + sp * REC
                m_s = tl.load(rs + G * D + offs_r, mask=ok, other=_NEG_BIG, cache_modifier=".cg")
                l_s = tl.load(rs + G * D + G + offs_r, mask=ok, other=0.0, cache_modifier=".cg")
                a_s = tl.load(rs + offs_r[:, None] * D + offs_d[None, :],
                              mask=ok[:, None], other=0.0, cache_modifier=".cg")
                m_n = tl.maximum(m_o, m_s)
                c_o = tl.exp2(m_o - m_n)
                c_s = tl.exp2(m_s - m_n)
                l_o = l_o * c_o + l_s * c_s
                acc_o = acc_o * c_o[:, None] + a_s * c_s[:, None]
                m_o = m_n
            l_o = tl.where(r_mask, l_o, 1.0)
            out = acc_o / l_o[:, None]
            tl.store(out_ptr + qo_row + (kvh * G + offs_r)[:, None] * D + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])
            tl.store(cnt_ptr + grp, 0)  # ready for the next call (stream-ordered)


_ARG_NAMES = ("q_ptr", "kv_ptr", "bt_ptr", "sl_ptr", "out_ptr", "ws_ptr", "cnt_ptr",
              "HKV", "G", "G_PAD", "G_R", "D", "P", "PPS", "NUM_SPLITS", "BLOCK_N", "QK_SCALE",
              "PV_SPLIT")
_N_PTR = 7

# Direct launch of the cached CompiledKernel: only on Triton versions whose
# JITFunction.run / CompiledKernel launcher calling convention was checked.
_DIRECT_VERSIONS = ("3.6.",)
try:
    from triton import knobs as _knobs
    _RT = _knobs.runtime
except Exception:  # pragma: no cover - other Triton versions
    _RT = None
try:
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except Exception:  # pragma: no cover
    _raw_stream = None


def _hooks_idle():
    """No Triton launch hook installed (3.6 keeps them in HookChains; empty = none)."""
    e = _RT.launch_enter_hook
    x = _RT.launch_exit_hook
    return (e is None or not getattr(e, "calls", True)) and (x is None or not getattr(x, "calls", True))


def _num_sms(device):
    if device.type != "cuda":
        return 132
    try:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(idx).multi_processor_count
    except Exception:
        return 132


def _cdiv(a, b):
    return -(-a // b)


def _next_pow2(x):
    return 1 << (max(1, int(x)) - 1).bit_length()


def _make_direct(ck, grid, tail, ws_ptr, cnt_ptr, dev_idx):
    """Return fn(q, kv, bt, sl, out) -> None launching `ck` directly, or None.

    Mirrors Triton 3.6.0: JITFunction.run calls
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                   launch_metadata, enter_hook, exit_hook, *bound_args.values())
    (bound args = every parameter in order, constexprs included; the generated
    launcher parses constexprs as objects and drops them), and
    CudaLauncher.__call__ forwards to its C `launch` as
        launch(g0, g1, g2, stream, function, launch_cooperative_grid,
               launch_pdl, global_scratch, profile_scratch, *rest)
    with global/profile scratch None when their sizes are 0.  Pointers are
    passed as ints (the launcher's PyLong path, no cuPointerGetAttribute).
    """
    if not triton.__version__.startswith(_DIRECT_VERSIONS) or _RT is None or _raw_stream is None:
        return None
    from triton.backends.nvidia.driver import CudaLauncher
    src = ck.src
    if src.fn is not _paged_decode or tuple(src.fn.arg_names) != _ARG_NAMES:
        return None
    sig = src.signature
    if [sig[k] == "constexpr" for k in _ARG_NAMES] != [False] * _N_PTR + [True] * (len(_ARG_NAMES) - _N_PTR):
        return None
    launcher = ck.run  # handles were initialised by the normal launch
    function = ck.function
    packed = ck.packed_metadata
    if not isinstance(launcher, CudaLauncher) or not isinstance(function, int) or not function:
        return None
    g0, g1, g2 = grid
    stream_of = _raw_stream
    idx = dev_idx
    c_launch = getattr(launcher, "launch", None)
    if (callable(c_launch) and launcher.global_scratch_size == 0 and launcher.profile_scratch_size == 0
            and type(launcher.launch_cooperative_grid) is bool and type(launcher.launch_pdl) is bool):
        coop = launcher.launch_cooperative_grid
        pdl = launcher.launch_pdl

        def direct(q, kv, bt, sl, out, _keep=ck):
            c_launch(g0, g1, g2, stream_of(idx), function, coop, pdl, None, None,
                     packed, None, None, None, q, kv, bt, sl, out, ws_ptr, cnt_ptr, *tail)
    else:
        def direct(q, kv, bt, sl, out, _keep=ck):
            launcher(g0, g1, g2, stream_of(idx), function, packed, None, None, None,
                     q, kv, bt, sl, out, ws_ptr, cnt_ptr, *tail)
    return direct


class _Plan:
    """Everything a call needs for one input geometry, computed once."""

    __slots__ = ("grid", "consts", "ws", "cnt", "device", "launch_kw", "direct", "direct_state")

    def __init__(self, model, query, kv_cache, block_table):
        B, H, D = query.shape
        P = kv_cache.shape[1]
        Hkv = kv_cache.shape[2]
        if kv_cache.shape[3] != 2 * D or H % Hkv != 0 or D & (D - 1) or D < 16:
            raise ValueError("unsupported paged-attention geometry")
        G = H // Hkv
        PPS = block_table.shape[1]
        device = query.device
        S = int(model._choose_splits(B, Hkv, PPS * P, device))
        self.grid = (S, Hkv, B)
        self.consts = dict(
            HKV=Hkv, G=G, G_PAD=max(16, _next_pow2(G)), G_R=_next_pow2(G), D=D, P=P, PPS=PPS,
            NUM_SPLITS=S, BLOCK_N=64, QK_SCALE=float(model.scale) * _LOG2E,
            PV_SPLIT=bool(model.pv_split),
        )
        self.launch_kw = dict(num_warps=4, num_stages=3)
        # fp32 workspace (acc, m, l per split) and int32 counters (must start at 0)
        self.ws = torch.empty(max(1, B * Hkv * S * G * (D + 2)), dtype=torch.float32, device=device)
        self.cnt = torch.zeros(max(1, B * Hkv), dtype=torch.int32, device=device)
        self.device = device
        self.direct = None
        self.direct_state = 0  # 0: not tried yet, 1: active, 2: unavailable / disabled

    def launch(self, query, kv_cache, block_table, seq_lens, out):
        """Normal Triton launch; the first one also sets up the direct path."""
        ck = _paged_decode[self.grid](
            query, kv_cache, block_table, seq_lens, out, self.ws, self.cnt,
            **self.consts, **self.launch_kw,
        )
        if self.direct_state == 0:
            self.direct_state = 2
            try:
                ptrs = (query.data_ptr(), kv_cache.data_ptr(), block_table.data_ptr(),
                        seq_lens.data_ptr(), out.data_ptr())
                # only when this compile assumed 16-B aligned pointers (checked per call)
                if self.device.type == "cuda" and ck is not None and not any(p & 15 for p in ptrs):
                    idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
                    tail = tuple(self.consts[k] for k in _ARG_NAMES[_N_PTR:])
                    self.direct = _make_direct(ck, self.grid, tail, self.ws.data_ptr(),
                                               self.cnt.data_ptr(), idx)
                    if self.direct is not None:
                        self.direct_state = 1
            except Exception:
                self.direct = None


class Model(torch.nn.Module):
    def __init__(self, batch, num_heads, num_kv_heads, head_dim, seq_len, page_size):
        super().__init__()
        self.batch = batch
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.seq_len = seq_len
        self.page_size = page_size
        self.group_size = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        # PV_SPLIT=True adds a 2nd MMA on the bf16 residual of p (slightly more
        # accurate, measured ~15% lower max error); off by default for speed.
        self.pv_split = False
        # Plain attribute (not a buffer): per-geometry plans, incl. workspace.
        self._plans = {}

    def _choose_splits(self, B, Hkv, max_len, device):
        groups = B * Hkv
        target = 4 * _num_sms(device)  # aim for ~4 programs per SM
        splits = _cdiv(target, groups)
        # keep each split at least 128 tokens long (>= 2 BLOCK_N tiles)
        splits = max(1, min(splits, max_len // 128, 64))
        if splits > 1:
            # drop splits that would be empty for a full-length sequence
            chunk = _cdiv(_cdiv(max_len, splits), 16) * 16
            splits = _cdiv(max_len, chunk)
        return splits

    def forward(self, query, kv_cache, block_table, seq_lens):
        # dtypes are part of the key: the cached direct launch is dtype-specialised
        key = (query.shape, kv_cache.shape, block_table.shape, query.device,
               query.dtype, kv_cache.dtype, block_table.dtype, seq_lens.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self, query, kv_cache, block_table)
        if not (query.is_contiguous() and kv_cache.is_contiguous()
                and block_table.is_contiguous() and seq_lens.is_contiguous()):
            query = query.contiguous()
            kv_cache = kv_cache.contiguous()
            block_table = block_table.contiguous()
            seq_lens = seq_lens.contiguous()
        out = torch.empty_like(query)  # query is contiguous here, so is out
        direct = plan.direct
        if direct is not None:
            qp = query.data_ptr()
            kp = kv_cache.data_ptr()
            bp = block_table.data_ptr()
            sp = seq_lens.data_ptr()
            op = out.data_ptr()
            if not ((qp | kp | bp | sp | op) & 15) and _hooks_idle():
                try:
                    direct(qp, kp, bp, sp, op)
                    return out
                except Exception:
                    plan.direct = None  # permanent fallback to the normal launch
                    plan.direct_state = 2
        plan.launch(query, kv_cache, block_table, seq_lens, out)
        return out


def get_inputs():
    import reference
    return reference.get_inputs()


def get_init_inputs():
    import reference
    return reference.get_init_inputs()

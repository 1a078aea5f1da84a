"""MoE up-projection (grouped GEMM + SwiGLU) in Triton -- house kernel v2: one launch, no host sync.

A kernelboard house kernel, written from scratch by the kernelboard team (not
an AI submission).  NOT YET TIMED ON A GPU: written on a machine without one,
checked with the Triton interpreter on the CPU, and its CUDA path only
compiled for sm_90 (Triton 3.6, bundled ptxas) to read the IR; every
performance statement below is a design intent.

    out[r] = silu(x[r] @ W_gate[e]) * (x[r] @ W_up[e])   for offsets[e] <= r < offsets[e+1]

Taken over from v1 (20261129_190000): the on-device schedule (each program
loads the E + 1 offsets, prefix-sums the per-expert row-tile counts and finds
its expert; empty experts own no tiles; the grid is the host-side upper bound
(cdiv(T_perm, BLOCK_M) + E) x column tiles, so no host read of the offsets),
the GROUP_M = 8 swizzle, the 128 x 128 output tile with BLOCK_K 64 / 8 warps /
3 stages (now the first, conservative config), and the fused epilogue with
the reference's rounding points (gate and up each to bf16, SiLU in fp32 on
the bf16 gate then bf16, product to bf16).

New in v2:
* Gate and up weights are interleaved once into a cached (E, H, 2I) copy
  (column 2j = gate j, 2j+1 = up j; rebuilt only when either parameter's
  data pointer or version counter changes, e.g. after load_state_dict).  A
  tile's B operand is then one [BLOCK_K, 2 * BLOCK_N] box, and the tile is ONE
  tl.dot into a 128 x 256 fp32 accumulator: wgmma m64n256k16, which reads the
  x tile from shared memory once per k16 instead of twice (v1: two m64n128
  wgmmas per k16).  The epilogue splits the accumulator with
  reshape(BM, BN, 2).split(), which is register-local in the wgmma layout
  (the pair lives in one thread; the IR shows no layout conversion for it).
  Cost: a second copy of the weights (headline 3.2 GB, wide shape 2.1 GB),
  built on the first call.
* TMA (host TensorDescriptor) for x and the weights instead of cp.async with
  pointer tensors: x as (T_perm, H) with box [BLOCK_M, BLOCK_K]; the weights
  as 3-D (E, H, 2I) with box [1, BLOCK_K, 2 BLOCK_N], so K past H and columns
  past 2I are zero-filled per expert and no load masks are needed.  Rows of a
  ragged tail are read from the next expert (or zero-filled past T_perm) and
  never stored; stores are masked at the expert's last row and at I.  Needs
  H % 8 == 0 and I % 4 == 0 (16-byte strides), true of all deck shapes.
* Optional persistent schedule (PERSISTENT configs: grid = #SMs, grid-stride
  loop over the real tiles, the tile count computed on the device from the
  offsets; the loop's static trip count ITERS is the host-side upper bound).
* Autotune over 7 Hopper configs, keyed on (H, I, T_perm, E): v1's tile with 3
  and 4 stages, the same persistent, 128x(2x64) with 4 warps, 64x(2x128) with
  4 warps, and BLOCK_K 32 with 5 stages.  One autotuner per shape (each
  config's ITERS depends on it); a pre-hook sets the TMA boxes per config.
* Interpreter path (TRITON_INTERPRET=1, CPU grading): CONFIGS[0] launched
  directly, dot operands upcast to fp32 (the 3.6 interpreter's bf16 tl.dot
  multiplies raw bits) and the bf16 roundings done on the bits with
  round-to-nearest-even, because the interpreter's fp32 -> bf16 cast
  truncates (it made v1-style code 1-2 % off at large inputs on the CPU; on
  the GPU the cast is cvt.rn and the bit path is not compiled).

sm_90 compile (headline shape, all 7 configs): the dot is
ttng.warp_group_dot with both operands in shared memory (NVMMA layouts), isAsync,
m64n256k16 (m64n128k16 for the 2x64 config); loads are
async_tma_copy_global_to_local / cp.async.bulk.tensor with one mbarrier per
stage (3-5 stages as configured); inside the K loop warp_group_dot_wait keeps
pendings = 1 (one step's wgmma in flight while the next is issued; the only
pendings = 0 is after the loop); 8-warp configs use 192 registers (182
persistent), 4-warp ones 168, no spills, shared memory 147 KB (3 stages) /
197 KB (4 stages).  v1 for comparison: two async m64n128 wgmmas per k16,
cp.async loads, pendings = 2 in the loop, 185 registers, no spills.

Not tried (left for a GPU session): warp specialisation (producer/consumer
warpgroups), flattening the persistent loop so the next tile's loads overlap
this tile's epilogue, TMA stores of the output (ragged row tails make a
masked store simpler), device-side descriptors (tl.make_tensor_descriptor),
BLOCK_M 256 / 2 CTAs-per-SM configs, and a fallback without the weight copy
if memory is short.
"""
import os

import torch
import torch.nn as nn
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _round_bf16(v, BY_BITS: tl.constexpr):
    """fp32 -> nearest bf16 (ties to even), returned as fp32.  On the GPU this is cvt.rn.bf16.f32;
    the 3.6 interpreter's fp32 -> bf16 cast truncates, so there (BY_BITS) it is done on the bits
    (finite values; the inputs here are)."""
    if BY_BITS:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _moe_up_swiglu_v2(
    x_desc,                     # TMA: hidden states (T_perm, H), block [BLOCK_M, BLOCK_K]
    w_desc,                     # TMA: interleaved weights (E, H, 2I), block [1, BLOCK_K, 2 * BLOCK_N]
    off_ptr, out_ptr,
    T_perm,                     # rows of x (also an autotune key)
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,        # next power of two >= NUM_EXPERTS
    HID: tl.constexpr,          # H
    INTER: tl.constexpr,        # I: output width and row stride of out
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,      # output columns per tile; the MMA is BLOCK_M x (2 * BLOCK_N)
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,   # grid = #SMs, each program loops over tiles (else one tile each)
    ITERS: tl.constexpr,        # tiles per program (upper bound); 1 when not persistent
    UPCAST: tl.constexpr = False,  # CPU interpreter only: its bf16 tl.dot multiplies raw bits
):
    NUM_N_TILES: tl.constexpr = (INTER + BLOCK_N - 1) // BLOCK_N
    PER_GROUP: tl.constexpr = GROUP_M * NUM_N_TILES
    K_STEPS: tl.constexpr = (HID + BLOCK_K - 1) // BLOCK_K

    # per-expert row-tile table, rebuilt from the offsets on the device (no host read)
    idx = tl.arange(0, E_PAD)
    e_ok = idx < NUM_EXPERTS
    starts = tl.load(off_ptr + idx, mask=e_ok, other=0)
    ends = tl.load(off_ptr + idx + 1, mask=e_ok, other=0)
    tiles = (ends - starts + (BLOCK_M - 1)) // BLOCK_M   # 0 for empty and padded experts
    tiles_end = tl.cumsum(tiles, 0)                      # inclusive prefix sum
    real_m_tiles = tl.sum(tiles, 0)

    real_tiles = real_m_tiles * NUM_N_TILES

    pid = tl.program_id(0)
    step = tl.num_programs(0)
    # grid-stride loop; ITERS (host: ceil(grid upper bound / grid), 1 when not persistent) is a
    # constexpr so the trip count is static, also for the interpreter, where int arguments and
    # program ids cannot bound a range; iterations past the real tiles fall through the test
    for it in range(0, ITERS):
        tile = pid + it * step
        if tile < real_tiles:
            # ---- tile -> (row tile, column tile), GROUP_M swizzle over the real row tiles ----
            group = tile // PER_GROUP
            first_m = group * GROUP_M
            group_m = tl.minimum(real_m_tiles - first_m, GROUP_M)
            in_group = tile % PER_GROUP
            tile_m = first_m + in_group % group_m
            tile_n = in_group // group_m

            # ---- row tile -> expert (the number of experts whose tiles end at or before it) ----
            expert = tl.sum((e_ok & (tiles_end <= tile_m)).to(tl.int32), 0)
            hit = idx == expert
            row_start = tl.sum(tl.where(hit, starts, 0), 0)
            row_end = tl.sum(tl.where(hit, ends, 0), 0)
            first_tile = tl.sum(tl.where(hit, tiles_end - tiles, 0), 0)
            row0 = row_start + (tile_m - first_tile) * BLOCK_M
            col0 = tile_n * (2 * BLOCK_N)                # in the interleaved weight

            # rows past row_end (the next expert's, or TMA zero fill past T_perm) are computed but
            # never stored; K past H and columns past 2I are zero-filled by TMA
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
            for ks in range(0, K_STEPS):
                k0 = ks * BLOCK_K
                a = x_desc.load([row0, k0])
                b = w_desc.load([expert, k0, col0]).reshape(BLOCK_K, 2 * BLOCK_N)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc)

            # ---- SwiGLU epilogue: columns 2j / 2j+1 of the tile are gate / up of column j ----
            gate_f, up_f = acc.reshape(BLOCK_M, BLOCK_N, 2).split()
            gate = _round_bf16(gate_f, UPCAST)
            up = _round_bf16(up_f, UPCAST)
            act = _round_bf16(gate / (1.0 + tl.exp(-gate)), UPCAST)
            res = _round_bf16(act * up, UPCAST).to(tl.bfloat16)   # exact: already a bf16 value

            offs_m = row0 + tl.arange(0, BLOCK_M)
            offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * INTER + offs_n[None, :]
            tl.store(out_ptrs, res, mask=(offs_m < row_end)[:, None] & (offs_n < INTER)[None, :])


def _cfg(bm, bn, bk, warps, stages, persistent=False, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
                          "PERSISTENT": persistent}, num_warps=warps, num_stages=stages)


# Hopper configs.  The first is v1's tile (128 rows x 128 output columns, i.e. 128 x 256 of MMA
# with gate and up, BLOCK_K 64, 8 warps, 3 stages), kept as the safe choice and run by the
# interpreter; the others are candidates for the autotuner.
CONFIGS = [
    _cfg(128, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 3, persistent=True),
    _cfg(128, 128, 64, 8, 4, persistent=True),
    _cfg(128, 64, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(128, 128, 32, 8, 5),
]

def _set_block_shapes(nargs):
    """Autotuner pre-hook: the TMA boxes follow the config being run."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [1, bk, 2 * bn]


_TUNED: dict = {}  # (T_perm, H, I, E, #SMs) -> autotuner whose configs carry that shape's ITERS


def _tuned(key, iters):
    tuner = _TUNED.get(key)
    if tuner is None:
        cfgs = []
        for c in CONFIGS:
            kw = dict(c.kwargs, ITERS=iters(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["PERSISTENT"]))
            cfgs.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages,
                                      pre_hook=_set_block_shapes))
        tuner = _TUNED[key] = triton.autotune(configs=cfgs, key=["HID", "INTER", "T_perm", "NUM_EXPERTS"])(
            _moe_up_swiglu_v2)
    return tuner


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(x: int) -> int:
    return 1 << (max(1, int(x)) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def interleave_weights(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """(E, H, I) x 2 -> (E, H, 2I): column 2j is gate column j, column 2j+1 is up column j."""
    return torch.stack((w_gate, w_up), dim=-1).reshape(w_gate.shape[0], w_gate.shape[1], 2 * w_gate.shape[2])


def launch(x, w_cat, offsets, out, cfg=None):
    """One launch of the v2 kernel.  cfg=None: the autotuner (GPU) or CONFIGS[0] under the
    interpreter; else that config, launched directly."""
    t_perm, hid = x.shape
    n_exp, _, two_i = w_cat.shape
    inter = two_i // 2
    n_sms = _num_sms(x.device)

    def bound(bm, bn):  # tiles in the worst case: sum of ceil(count_e / BLOCK_M) <= cdiv(T_perm, BLOCK_M) + E
        return (_cdiv(t_perm, bm) + n_exp) * _cdiv(inter, bn)

    def grid(meta):
        tiles = bound(meta["BLOCK_M"], meta["BLOCK_N"])
        return (min(tiles, n_sms),) if meta["PERSISTENT"] else (tiles,)

    def iters(bm, bn, persistent):
        tiles = bound(bm, bn)
        return _cdiv(tiles, min(tiles, n_sms)) if persistent else 1

    if cfg is None and _interpreting():
        cfg = CONFIGS[0]
    if cfg is None:
        kernel, consts, kw = _tuned((t_perm, hid, inter, n_exp, n_sms), iters), {}, {}
        # descriptors carry a placeholder block shape; the autotuner's pre-hook sets it per config
        bm, bn, bk = 128, 128, 64
    else:
        kernel, consts = _moe_up_swiglu_v2, dict(cfg.kwargs)
        kw = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        bm, bn, bk = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"]
        consts["ITERS"] = iters(bm, bn, consts["PERSISTENT"])
        if _interpreting():
            consts["UPCAST"] = True
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w_cat, [1, bk, 2 * bn])
    kernel[grid](x_desc, w_desc, offsets, out, t_perm,
                 NUM_EXPERTS=n_exp, E_PAD=_next_pow2(n_exp), HID=hid, INTER=inter, **consts, **kw)
    return out


class Model(nn.Module):
    """Per-expert gate and up projections: parameters `W_gate`, `W_up`, each (E, H, I) bf16."""

    def __init__(self, T_total: int, H: int, I: int, E: int, K: int):  # noqa: E741 (the reference's names)
        super().__init__()
        self.T_total = T_total
        self.H = H
        self.I = I
        self.E = E
        self.K = K
        self.W_gate = nn.Parameter(torch.empty(E, H, I, dtype=torch.bfloat16))
        self.W_up = nn.Parameter(torch.empty(E, H, I, dtype=torch.bfloat16))
        nn.init.normal_(self.W_gate, std=0.02)  # same draw order as the reference
        nn.init.normal_(self.W_up, std=0.02)
        self._w_cat = None  # plain attribute, not state: the interleaved copy and what it was built from
        self._w_key = None

    def _interleaved(self) -> torch.Tensor:
        """The (E, H, 2I) interleaved weights, rebuilt only when either parameter changed (the
        version counters move on every in-place write, load_state_dict's copy_ included)."""
        wg, wu = self.W_gate, self.W_up
        key = (wg.data_ptr(), wg._version, wu.data_ptr(), wu._version, wg.device, wg.shape)
        if self._w_key != key:
            self._w_cat = None  # release the old copy before building the new one
            with torch.no_grad():
                self._w_cat = interleave_weights(wg.detach(), wu.detach()).contiguous()
            self._w_key = key
        return self._w_cat

    def forward(self, hidden_states: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
        """hidden_states (T_perm, H) bf16 in expert order; expert_offsets (E+1,) int32 prefix sums
        from 0 to T_perm (empty experts allowed) -> (T_perm, I) bf16."""
        n_exp, hid, inter = self.W_gate.shape
        t_perm = hidden_states.shape[0]
        out = torch.empty((t_perm, inter), dtype=torch.bfloat16, device=hidden_states.device)
        if t_perm == 0 or inter == 0:
            return out
        if hid % 8 or inter % 4:
            raise ValueError("TMA needs 16-byte row strides: H % 8 == 0 and I % 4 == 0")
        x = hidden_states
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        offsets = expert_offsets
        if offsets.dtype != torch.int32 or not offsets.is_contiguous():
            offsets = offsets.to(torch.int32).contiguous()
        return launch(x, self._interleaved(), offsets, out)


def get_inputs():
    import reference
    return reference.get_inputs()


def get_init_inputs():
    import reference
    return reference.get_init_inputs()

"""Row-wise top-k (values, indices), sorted largest first, in ONE Triton launch.

A kernelboard house kernel, written from scratch by the kernelboard team (not
an AI submission).  Every shape of the deck is launch-bound, so the design
goal is a single kernel launch per call and a thin host side.

Packed keys.  Each element becomes one int64 key whose order is the order we
want: the high 32 bits are the fp32 bits made order-preserving as a signed
int32 (negative floats get their 31 low bits flipped), the low 32 bits are
``2**31 - 1 - column`` (non-negative, so equal values rank the lower column
first, as torch does).  Keys are unique per row, so a top-k of keys is a
top-k of values with distinct indices, and the value and column are decoded
back from the key exactly (no gather).  Padding lanes get INT64_MIN, below
every real key.

Kernel (`_topk_rows`), grid (SPLITS, batch):

* One program owns CHUNK (a power of two, at most 4096) consecutive columns
  of one row, loads them (masked at n, so n need not be a power of two) and
  keeps its K_PAD = next_pow2(k) largest keys with Triton's bitonic
  `tl.topk` (partial bitonic sort + max-halving; never a full sort).  k = 1
  is a plain `tl.max` of the keys.
* SPLITS == 1 (the row fits one chunk): the program decodes and writes the
  k values (fp32) and indices (int64) directly.
* SPLITS > 1 (long rows, e.g. 1 x 131072): each program writes its K_PAD
  candidates to a cached int64 workspace, then (after a CTA barrier) bumps a
  per-row int32 counter with an acq_rel atomic.  The program that sees
  count == SPLITS - 1 is the row's last one: it loads the SPLITS * K_PAD
  candidates (.cg, bypassing L1), runs one more `tl.topk` over them, writes
  the outputs and resets the counter to 0 (so no memset per call; calls on
  one stream are serialised, so the workspace is shared across calls).

Everything that depends on the geometry (grid, constexprs, workspace,
counters) is computed once per geometry; a call is one dict lookup, two
`torch.empty` and one launch.  After the first (normal) Triton launch of a
geometry, later calls on Triton 3.6 go straight to the compiled kernel's
launcher with the argument list `JITFunction.run` itself passes (the same
shortcut as the 03 house kernel); any surprise disables it for good and
falls back to the normal `kernel[grid](...)` launch, which is also used
while a Triton launch hook (profiler) is installed or a pointer is not
16-byte aligned.
"""
import torch
import torch.nn as nn
import triton
import triton.language as tl

_PAD_KEY = tl.constexpr(-(2**63))  # below every real key
_MAX_CHUNK = 4096  # columns per program (power of two)


@triton.jit
def _pack(x, col, mask):
    """fp32 values + int32 columns -> int64 keys ordered by (value, -column)."""
    b = x.to(tl.int32, bitcast=True)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)  # order-preserving as signed int32
    key = (s.to(tl.int64) << 32) | (2147483647 - col).to(tl.int64)
    return tl.where(mask, key, _PAD_KEY)


@triton.jit
def _select(keys, K_PAD: tl.constexpr):
    """The K_PAD largest keys, descending (shape [K_PAD])."""
    # K_PAD is a constexpr: only the chosen branch is compiled
    return tl.zeros([1], dtype=tl.int64) + tl.max(keys, axis=0) if K_PAD == 1 else tl.topk(keys, K_PAD)


@triton.jit
def _emit(top, val_ptr, idx_ptr, row, K: tl.constexpr, K_PAD: tl.constexpr):
    """Decode keys and write the first K values / indices of `row`."""
    s = (top >> 32).to(tl.int32)
    b = s ^ ((s >> 31) & 0x7FFFFFFF)
    val = b.to(tl.float32, bitcast=True)
    idx = (2147483647 - top.to(tl.int32)).to(tl.int64)  # truncation keeps the low half
    o = tl.arange(0, K_PAD)
    base = row.to(tl.int64) * K
    tl.store(val_ptr + base + o, val, mask=o < K)
    tl.store(idx_ptr + base + o, idx, mask=o < K)


@triton.jit
def _topk_rows(
    x_ptr, val_ptr, idx_ptr, ws_ptr, cnt_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,       # next_pow2(K)
    CHUNK: tl.constexpr,       # columns per program, power of two >= K_PAD
    SPLITS: tl.constexpr,      # programs per row: cdiv(N, CHUNK)
    MERGE: tl.constexpr,       # next_pow2(SPLITS * K_PAD)
):
    split = tl.program_id(0)
    row = tl.program_id(1)

    col = split * CHUNK + tl.arange(0, CHUNK)
    mask = col < N
    x = tl.load(x_ptr + row.to(tl.int64) * N + col, mask=mask, other=0.0)
    top = _select(_pack(x, col, mask), K_PAD)

    if SPLITS == 1:
        _emit(top, val_ptr, idx_ptr, row, K, K_PAD)
    else:
        ws_row = ws_ptr + row.to(tl.int64) * (SPLITS * K_PAD)
        tl.store(ws_row + split * K_PAD + tl.arange(0, K_PAD), top)
        # every thread's stores happen-before the (single-thread) release below
        tl.debug_barrier()
        count = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")
        if count == SPLITS - 1:
            m = tl.arange(0, MERGE)
            cand = tl.load(ws_row + m, mask=m < SPLITS * K_PAD, other=_PAD_KEY, cache_modifier=".cg")
            _emit(_select(cand, K_PAD), val_ptr, idx_ptr, row, K, K_PAD)
            tl.store(cnt_ptr + row, 0)  # ready for the next call (stream-ordered)


_ARG_NAMES = ("x_ptr", "val_ptr", "idx_ptr", "ws_ptr", "cnt_ptr", "N", "K", "K_PAD", "CHUNK", "SPLITS", "MERGE")
_N_PTR = 5

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


def _hooks_idle() -> bool:
    """No Triton launch hook installed (3.6 keeps them in HookChains; empty = none)."""
    e = _RT.launch_enter_hook
    x = _RT.launch_exit_hook
    return (e is None or not getattr(e, "calls", True)) and (x is None or not getattr(x, "calls", True))


def _next_pow2(v: int) -> int:
    return 1 << (max(1, int(v)) - 1).bit_length()


def _make_direct(ck, grid: tuple[int, int, int], tail: tuple, ws_ptr: int, cnt_ptr: int, dev_idx: int):
    """Return fn(x, values, indices) -> None launching `ck` directly, or None.

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
    if src.fn is not _topk_rows or tuple(src.fn.arg_names) != _ARG_NAMES:
        return None
    sig = src.signature
    if [sig[a] == "constexpr" for a in _ARG_NAMES] != [False] * _N_PTR + [True] * (len(_ARG_NAMES) - _N_PTR):
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

        def direct(xp: int, vp: int, ip: int, _keep=ck) -> None:
            c_launch(g0, g1, g2, stream_of(idx), function, coop, pdl, None, None,
                     packed, None, None, None, xp, vp, ip, ws_ptr, cnt_ptr, *tail)
    else:
        def direct(xp: int, vp: int, ip: int, _keep=ck) -> None:
            launcher(g0, g1, g2, stream_of(idx), function, packed, None, None, None,
                     xp, vp, ip, ws_ptr, cnt_ptr, *tail)
    return direct


class _Plan:
    """Everything a call needs for one input geometry, computed once."""

    __slots__ = ("cnt", "consts", "device", "direct", "direct_state", "grid", "launch_kw", "ws")

    def __init__(self, rows: int, cols: int, kk: int, device: torch.device, max_chunk: int = _MAX_CHUNK):
        if not 1 <= kk <= cols or cols >= 2**31 - 1:
            raise ValueError(f"unsupported top-k geometry: n={cols}, k={kk}")
        k_pad = _next_pow2(kk)
        chunk = max(k_pad, min(_next_pow2(cols), _next_pow2(max_chunk)))
        splits = -(-cols // chunk)
        merge = _next_pow2(splits * k_pad) if splits > 1 else 1
        self.grid = (splits, max(1, rows), 1)
        self.consts = dict(N=cols, K=kk, K_PAD=k_pad, CHUNK=chunk, SPLITS=splits, MERGE=merge)
        # ~16 keys per thread for the chunk pass; the merge (if any) reuses the warps
        self.launch_kw = dict(num_warps=max(1, min(16, max(chunk, merge) // 512)), num_stages=1)
        # int64 candidates per (row, split) and int32 counters (must start at 0)
        self.ws = torch.empty(max(1, rows * splits * k_pad if splits > 1 else 1), dtype=torch.int64, device=device)
        self.cnt = torch.zeros(max(1, rows), dtype=torch.int32, device=device)
        self.device = device
        self.direct = None
        self.direct_state = 0  # 0: not tried yet, 1: active, 2: unavailable / disabled

    def launch(self, x: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
        """Normal Triton launch; the first one also sets up the direct path."""
        ck = _topk_rows[self.grid](x, values, indices, self.ws, self.cnt, **self.consts, **self.launch_kw)
        if self.direct_state == 0:
            self.direct_state = 2
            try:
                ptrs = (x.data_ptr(), values.data_ptr(), indices.data_ptr())
                # only when this compile assumed 16-B aligned pointers (checked per call)
                if self.device.type == "cuda" and ck is not None and not any(p & 15 for p in ptrs):
                    idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
                    tail = tuple(self.consts[a] for a in _ARG_NAMES[_N_PTR:])
                    self.direct = _make_direct(ck, self.grid, tail, self.ws.data_ptr(), self.cnt.data_ptr(), idx)
                    if self.direct is not None:
                        self.direct_state = 1
            except Exception:
                self.direct = None


class Model(nn.Module):
    """The k largest entries of every row; state: one persistent fp32 buffer `_dummy` of shape (1,)."""

    def __init__(self, batch: int, n: int, k: int):
        super().__init__()
        self.batch = batch
        self.n = n
        self.k = k
        self.register_buffer("_dummy", torch.zeros(1, dtype=torch.float32))
        self.max_chunk = _MAX_CHUNK
        # Plain attribute (not a buffer): per-geometry plans, incl. workspace.
        self._plans: dict = {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (batch, n) fp32 -> (values (batch, k) fp32 descending, indices (batch, k) int64)."""
        if x.dtype != torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        key = (x.shape, x.device, self.k)
        plan = self._plans.get(key)
        if plan is None:
            cols = x.shape[-1]
            rows = x.numel() // cols if cols else 0
            plan = self._plans[key] = _Plan(rows, cols, self.k, x.device, self.max_chunk)
        out_shape = (*x.shape[:-1], self.k)
        values = torch.empty(out_shape, dtype=torch.float32, device=x.device)
        indices = torch.empty(out_shape, dtype=torch.int64, device=x.device)
        if values.numel() == 0:
            return values, indices
        direct = plan.direct
        if direct is not None:
            xp = x.data_ptr()
            vp = values.data_ptr()
            ip = indices.data_ptr()
            if not ((xp | vp | ip) & 15) and _hooks_idle():
                try:
                    direct(xp, vp, ip)
                    return values, indices
                except Exception:
                    plan.direct = None  # permanent fallback to the normal launch
                    plan.direct_state = 2
        plan.launch(x, values, indices)
        return values, indices


def get_inputs():
    import reference
    return reference.get_inputs()


def get_init_inputs():
    import reference
    return reference.get_init_inputs()

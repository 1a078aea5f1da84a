"""FP8 e4m3 GEMM with a per-row weight scale, in Triton.

A kernelboard house kernel, written from scratch by the kernelboard team (not
an AI submission).  Computes

    y = bf16( bf16(x · weightᵀ) · weight_scale )

for x (M, K) and weight (N, K), both float8_e4m3fn and K-major, weight_scale
(N,) fp32, y (M, N) bf16 -- the reference's arithmetic, double rounding
included (it costs two register conversions in the epilogue).

Kernel (`_fp8_gemm`), a classic tiled matmul, one program per (BLOCK_M,
BLOCK_N) output tile:

* Tiles are visited in grouped order (GROUP_M row tiles share a band of
  weight columns) so the weight tiles a wave of programs needs stay in L2.
* The main loop loads a [BLOCK_M, BLOCK_K] tile of x and a [BLOCK_K, BLOCK_N]
  tile of weightᵀ straight from memory as e4m3 (both K-major, the operand
  layout Hopper's FP8 warp-group MMA wants) and feeds them to `tl.dot`, which
  accumulates in fp32.  Row indices past M / N are wrapped (`% M`, `% N`), so
  only the K tail needs a mask, and only when K is not a multiple of BLOCK_K
  (`EVEN_K` constexpr).
* Epilogue: round the fp32 accumulator to bf16, multiply by the column's
  scale in fp32, round to bf16 and store (masked at M / N).

K not a multiple of 16 (the K = 4127 shape): a row of x or weight is then not
16-byte aligned, and the compiler could only use byte loads.  For such K the
host copies both operands into a cached, zero-padded buffer whose row length
is a multiple of 16 (the pad columns are zeroed once and never written again,
zeros add nothing to the dot products).  The copy is made on every call from
the live `weight` buffer, so in-place changes to the weight are always seen.

Launch configuration: on CUDA `triton.autotune` picks among a few
Hopper-sized configs (128x128/128x256 tiles with BLOCK_K 64/128, 8 warps,
3-4 stages for the large shapes; 64-row tiles and narrow N tiles for skinny
decode-sized M, where the GEMM is a stream over the weight), keyed on
(M, N, K), one autotuner per family so only the configs matching M are tried.  Under the Triton
interpreter (CPU) the first config of the family is launched directly.
Everything per geometry (grid function, kernel handle, pad buffers) is
computed once and cached; a call is a dict lookup, at most two copies, an
output allocation and one launch, with no host synchronisation.
"""
import torch
import torch.nn as nn
import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def _fp8_gemm(
    x_ptr, w_ptr, scale_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row tiles walk the same band of column tiles
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # wrap out-of-range rows instead of masking them (their results are never stored)
    rows_x = (offs_m % M).to(tl.int64)
    rows_w = (offs_n % N).to(tl.int64)

    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]   # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + offs_k[:, None]   # [BLOCK_K, BLOCK_N] = weightᵀ tile

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # epilogue: the reference rounds the product to bf16, then scales in fp32 and rounds again
    n_ok = offs_n < N
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    y = acc.to(tl.bfloat16).to(tl.float32) * scale[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(tl.bfloat16), mask=(offs_m < M)[:, None] & n_ok[None, :])


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages)


# Skinny M (decode-sized): memory-bound stream over the weight; 64-row MMA tiles
# (the warp-group MMA's minimum), narrow N tiles for enough programs, deep K.
_SKINNY_CONFIGS = [
    _cfg(64, 64, 256, 4, 4),
    _cfg(64, 32, 256, 4, 5),
    _cfg(64, 64, 128, 4, 6),
    _cfg(64, 128, 128, 4, 4),
    _cfg(64, 128, 256, 8, 3),
]
# Large M: Hopper-sized tiles (shared memory per stage 16-48 KiB).
_LARGE_CONFIGS = [
    _cfg(128, 128, 128, 8, 4),
    _cfg(128, 256, 128, 8, 3),
    _cfg(128, 256, 64, 8, 4),
    _cfg(256, 128, 128, 8, 3),
    _cfg(128, 128, 64, 4, 4),
    _cfg(128, 128, 128, 4, 3),
]
_SKINNY_MAX_M = 64

# EVEN_K follows from the autotuned BLOCK_K, so it is derived by a heuristic.
_fp8_gemm_h = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_fp8_gemm)
# One autotuner per family (keyed on M, N, K): only configs suited to the M regime are benchmarked.
_TUNED = {
    "skinny": triton.autotune(configs=_SKINNY_CONFIGS, key=["M", "N", "K"])(_fp8_gemm_h),
    "large": triton.autotune(configs=_LARGE_CONFIGS, key=["M", "N", "K"])(_fp8_gemm_h),
}


def _family(m: int) -> str:
    return "skinny" if m <= _SKINNY_MAX_M else "large"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Plan:
    """Launch state for one (M, N, K, device): pad buffers, kernel, grid."""

    __slots__ = ("consts", "grid", "k_pad", "kernel", "launch_kw", "w_buf", "x_buf")

    def __init__(self, m: int, n: int, k: int, device: torch.device):
        self.k_pad = k if k % 16 == 0 else _cdiv(k, 16) * 16
        self.x_buf = self.w_buf = None
        if self.k_pad != k:  # zero pad columns, written once; [:, :k] is refreshed every call
            self.x_buf = torch.zeros(m, self.k_pad, dtype=torch.float8_e4m3fn, device=device)
            self.w_buf = torch.zeros(n, self.k_pad, dtype=torch.float8_e4m3fn, device=device)
        fam = _family(m)
        if device.type == "cuda":
            self.kernel = _TUNED[fam]
            self.consts = {}
            self.launch_kw = {}

            def grid(meta):
                return (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]),)
        else:  # interpreter: first config of the family, launched directly
            cfg = (_SKINNY_CONFIGS if fam == "skinny" else _LARGE_CONFIGS)[0]
            self.kernel = _fp8_gemm_h
            self.consts = dict(cfg.kwargs)
            self.launch_kw = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            ntiles = _cdiv(m, cfg.kwargs["BLOCK_M"]) * _cdiv(n, cfg.kwargs["BLOCK_N"])

            def grid(meta, _g=(ntiles,)):
                return _g
        self.grid = grid


class Model(nn.Module):
    """y = bf16(bf16(x · weightᵀ) · weight_scale); buffers `weight` (N, K) e4m3 and `weight_scale` (N,) fp32,
    exactly as the reference registers them (the grader loads its state dict into this module)."""

    def __init__(self, M: int, N: int, K: int):
        super().__init__()
        self.M, self.N, self.K = M, N, K
        w = torch.empty(N, K, dtype=torch.bfloat16).normal_(0.0, 0.02).float()
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
        self.register_buffer("weight", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.squeeze(1).contiguous())
        self._plans: dict = {}  # plain attribute, not state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) float8_e4m3fn -> (M, N) bf16."""
        w, scale = self.weight, self.weight_scale
        m, k = x.shape
        n = w.shape[0]
        key = (m, n, k, x.device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(m, n, k, x.device)
        if x.dtype != torch.float8_e4m3fn:
            x = x.to(torch.float8_e4m3fn)
        if plan.x_buf is not None:
            plan.x_buf[:, :k].copy_(x)
            plan.w_buf[:, :k].copy_(w)
            x, w = plan.x_buf, plan.w_buf
        else:
            x = x.contiguous()
            w = w.contiguous()
        if scale.dtype != torch.float32 or not scale.is_contiguous():
            scale = scale.float().contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        plan.kernel[plan.grid](
            x, w, scale, y, m, n, plan.k_pad, x.stride(0), w.stride(0), y.stride(0),
            **plan.consts, **plan.launch_kw,
        )
        return y


def get_inputs():
    import reference
    return reference.get_inputs()


def get_init_inputs():
    import reference
    return reference.get_init_inputs()

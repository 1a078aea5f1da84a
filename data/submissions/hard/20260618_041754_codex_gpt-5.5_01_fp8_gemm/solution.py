import torch
import torch.nn as nn
import triton
import triton.language as tl


E4M3_MAX = 448.0
M = 4096
N = 4096
K = 4096


@triton.jit
def _matmul_fp8_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    y_ptr,
    M_: tl.constexpr,
    N_: tl.constexpr,
    K_: tl.constexpr,
    W_STRIDE: tl.constexpr,
    K_FULL: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M_, BLOCK_M)
    num_pid_n = tl.cdiv(N_, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_in_group = pid - group_id * num_pid_in_group
    pid_m = first_pid_m + (pid_in_group % group_size_m)
    pid_n = pid_in_group // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = x_ptr + offs_m[:, None] * K_ + offs_k[None, :]
    b_ptrs = w_ptr + offs_n[None, :] * W_STRIDE + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)

    for _ in range(0, K_FULL, BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if HAS_TAIL:
        k_idxs = K_FULL + offs_k
        a = tl.load(a_ptrs, mask=k_idxs[None, :] < K_, other=0.0)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, b, acc, out_dtype=tl.float32)

    scale = tl.load(scale_ptr + offs_n)
    out = acc * scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * N_ + offs_n[None, :]
    tl.store(y_ptrs, out)


def _launch_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    M_: int,
    N_: int,
    K_: int,
    w_stride: int,
):
    y = torch.empty((M_, N_), device=x.device, dtype=torch.bfloat16)

    if M_ <= 64:
        block_m, block_n, block_k, group_m, warps, stages = 16, 64, 256, 1, 4, 3
    elif K_ % 128 != 0:
        block_m, block_n, block_k, group_m, warps, stages = 64, 256, 128, 8, 8, 4
    else:
        block_m, block_n, block_k, group_m, warps, stages = 128, 128, 128, 4, 4, 4

    grid = (triton.cdiv(M_, block_m) * triton.cdiv(N_, block_n),)
    k_full = (K_ // block_k) * block_k
    has_tail = K_ != k_full
    _matmul_fp8_kernel[grid](
        x,
        weight,
        weight_scale,
        y,
        M_,
        N_,
        K_,
        w_stride,
        k_full,
        has_tail,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        num_warps=warps,
        num_stages=stages,
    )
    return y


class Model(nn.Module):
    def __init__(self, M: int, N: int, K: int):
        super().__init__()
        self.M, self.N, self.K = M, N, K
        w = torch.empty(N, K, dtype=torch.bfloat16)
        nn.init.normal_(w, std=0.02)
        s = (w.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        w_fp8 = (w.float() / s).to(torch.float8_e4m3fn)
        self.register_buffer("weight", w_fp8)
        self.register_buffer("weight_scale", s.squeeze(1).to(torch.float32))
        self._weight_packed = None
        self._weight_packed_version = -1
        self._weight_packed_stride = K
        self._x_packed = None
        self._x_packed_source = None
        self._x_packed_version = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, stride = self._weight_for_kernel()
        if self.K % 128 != 0:
            x, k_eff = self._x_for_kernel(x, stride)
            return _launch_matmul(x, weight, self.weight_scale, self.M, self.N, k_eff, stride)
        return _launch_matmul(x, weight, self.weight_scale, self.M, self.N, self.K, stride)

    def load_state_dict(self, *args, **kwargs):
        result = super().load_state_dict(*args, **kwargs)
        self._weight_packed = None
        self._weight_packed_version = -1
        return result

    def _x_for_kernel(self, x: torch.Tensor, k_pad: int):
        version = getattr(x, "_version", 0)
        packed = self._x_packed
        if (
            packed is None
            or packed.device != x.device
            or packed.dtype != x.dtype
            or packed.shape != (self.M, k_pad)
            or self._x_packed_source is not x
            or self._x_packed_version != version
        ):
            packed = torch.empty((self.M, k_pad), device=x.device, dtype=x.dtype)
            packed.zero_()
            packed[:, : self.K].copy_(x)
            self._x_packed = packed
            self._x_packed_source = x
            self._x_packed_version = version
        return packed, k_pad

    def _weight_for_kernel(self):
        if self.K % 128 == 0:
            return self.weight, self.K

        version = getattr(self.weight, "_version", 0)
        packed = self._weight_packed
        if (
            packed is None
            or packed.device != self.weight.device
            or packed.dtype != self.weight.dtype
            or self._weight_packed_version != version
        ):
            k_pad = ((self.K + 127) // 128) * 128
            packed = torch.empty((self.N, k_pad), device=self.weight.device, dtype=self.weight.dtype)
            packed.zero_()
            packed[:, : self.K].copy_(self.weight)
            self._weight_packed = packed
            self._weight_packed_version = version
            self._weight_packed_stride = k_pad

        return packed, self._weight_packed_stride


def get_inputs():
    x = (torch.rand(M, K) * 8 - 4).to(torch.float8_e4m3fn)
    return [x]


def get_init_inputs():
    return [M, N, K]

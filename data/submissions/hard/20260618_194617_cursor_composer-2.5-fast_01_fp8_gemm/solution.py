"""FP8 e4m3 GEMM — Triton tl.dot with stride-aligned padding."""
import torch
import torch.nn as nn
import triton
import triton.language as tl

E4M3_MAX = 448.0
BLOCK_K = 128


@triton.jit
def _fp8_gemm_kernel(
    A_ptr, B_ptr, C_ptr, Scale_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
  pid_m = tl.program_id(0)
  pid_n = tl.program_id(1)
  offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
  offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  offs_k = tl.arange(0, BLOCK_K)
  acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
  for ki in range(K // BLOCK_K):
    k_offs = ki * BLOCK_K + offs_k
    a = tl.load(A_ptr + offs_m[:, None] * stride_am + k_offs[None, :] * stride_ak,
                mask=offs_m[:, None] < M, other=0.0)
    b = tl.load(B_ptr + offs_n[None, :] * stride_bn + k_offs[:, None] * stride_bk,
                mask=offs_n[None, :] < N, other=0.0)
    acc = tl.dot(a, b, acc)
  scale = tl.load(Scale_ptr + offs_n, mask=offs_n < N, other=0.0)
  c = (acc * scale[None, :]).to(tl.bfloat16)
  mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
  tl.store(C_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, c, mask=mask)


def _k_pad(K: int) -> int:
  return ((K + BLOCK_K - 1) // BLOCK_K) * BLOCK_K


def _needs_pad(K: int, x: torch.Tensor, weight: torch.Tensor) -> bool:
  return K % BLOCK_K != 0 or x.stride(0) % BLOCK_K != 0 or weight.stride(0) % BLOCK_K != 0


def _get_config(M: int, N: int):
  if M <= 64:
    return 32, 128, 4, 3
  if N >= 12000:
    return 128, 256, 8, 4
  return 128, 128, 8, 4


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_pad: torch.Tensor | None = None,
    K_pad: int | None = None,
    x_pad: torch.Tensor | None = None,
) -> torch.Tensor:
  M, K = x.shape
  N = weight.shape[0]
  out = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
  BLOCK_M, BLOCK_N, num_warps, num_stages = _get_config(M, N)

  if _needs_pad(K, x, weight):
    kp = K_pad if K_pad is not None else _k_pad(K)
    w_use = weight_pad if weight_pad is not None else _pad_weight(weight, K, kp)
    if x_pad is not None and x_pad.shape[0] >= M and x_pad.shape[1] == kp:
      x_use = x_pad[:M]
      x_use.zero_()
      x_use[:, :K] = x
    else:
      x_use = torch.zeros(M, kp, device=x.device, dtype=x.dtype)
      x_use[:, :K] = x
    K_run = kp
  else:
    x_use, w_use = x, weight
    K_run = K

  grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
  _fp8_gemm_kernel[grid](
      x_use, w_use, out, weight_scale,
      M, N, K_run,
      x_use.stride(0), x_use.stride(1),
      w_use.stride(0), w_use.stride(1),
      out.stride(0), out.stride(1),
      BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
      num_warps=num_warps, num_stages=num_stages,
  )
  return out


def _pad_weight(weight: torch.Tensor, K: int, kp: int) -> torch.Tensor:
  N = weight.shape[0]
  pad = torch.zeros(N, kp, device=weight.device, dtype=weight.dtype)
  pad[:, :K] = weight
  return pad


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
    self._weight_pad: torch.Tensor | None = None
    self._K_pad: int | None = None
    self._x_pad: torch.Tensor | None = None

  def _ensure_weight_pad(self, device: torch.device):
    if self.K % BLOCK_K == 0 and self.weight.stride(0) % BLOCK_K == 0:
      return
    kp = _k_pad(self.K)
    if self._weight_pad is None or self._weight_pad.device != device:
      self._weight_pad = torch.zeros(self.N, kp, device=device, dtype=self.weight.dtype)
      self._K_pad = kp
    self._weight_pad[:, :self.K].copy_(self.weight)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    if _needs_pad(self.K, x, self.weight):
      self._ensure_weight_pad(x.device)
      kp = self._K_pad
      if self._x_pad is None or self._x_pad.device != x.device or self._x_pad.shape[1] != kp:
        self._x_pad = torch.zeros(self.M, kp, device=x.device, dtype=x.dtype)
      return fp8_gemm(
          x, self.weight, self.weight_scale,
          self._weight_pad, kp, self._x_pad,
      )
    return fp8_gemm(x, self.weight, self.weight_scale)


M = 4096
N = 4096
K = 4096


def get_inputs():
  x = (torch.rand(M, K) * 8 - 4).to(torch.float8_e4m3fn)
  return [x]


def get_init_inputs():
  return [M, N, K]

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

using Wide = cutlass::bfloat16_t;
using Narrow = cutlass::uint4b_t;
using ElementScale = Wide;
using ElementZero = Wide;

using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutC = cutlass::layout::RowMajor;
using LayoutD = cutlass::layout::RowMajor;
using LayoutAT = typename cutlass::layout::LayoutTranspose<LayoutA>::type;
using LayoutBT = typename cutlass::layout::LayoutTranspose<LayoutB>::type;
constexpr int AlignA = 8;
constexpr int AlignB = 32;
constexpr int AlignC = 8;
constexpr int AlignD = 8;

using Acc = float;
using Arch = cutlass::arch::Sm90;
using OpClass = cutlass::arch::OpClassTensorOp;
#ifndef W4_TILE_M
#define W4_TILE_M 128
#endif
#ifndef W4_TILE_N
#define W4_TILE_N 128
#endif
using TileShapeMNK = Shape<Int<W4_TILE_M>, Int<W4_TILE_N>, _64>;
using Cluster = Shape<_1, _1, _1>;
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;

using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    Arch, OpClass, TileShapeMNK, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto,
    Acc, Acc,
    void, typename cutlass::layout::LayoutTranspose<LayoutC>::type, AlignC,
    Wide, typename cutlass::layout::LayoutTranspose<LayoutD>::type, AlignD,
    EpiSchedule>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    Arch, OpClass,
    cute::tuple<Narrow, ElementScale, ElementZero>, LayoutBT, AlignB,
    Wide, LayoutAT, AlignA,
    Acc, TileShapeMNK, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<
      static_cast<int>(sizeof(typename Epi::SharedStorage))>,
    MainSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, Mainloop, Epi>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = cutlass::detail::TagToStrideA_t<LayoutA>;
using StrideB = cutlass::detail::TagToStrideB_t<LayoutB>;
using StrideS = typename Mainloop::StrideScale;
using StrideC = typename Kernel::StrideC;
using StrideD = typename Kernel::StrideD;

// Decode kernel: a CTA owns 32 adjacent output columns.  Its 32 warps each
// consume one complete 128-K quantization group, preserving fully coalesced
// byte loads from the reference's native (K/2, N) packing.  Warp 0 performs
// the final cross-group reduction.
__global__ __launch_bounds__(1024, 1)
void w4a16_gemv_kernel(
    __nv_bfloat16 const* __restrict__ x,
    uint8_t const* __restrict__ q,
    __nv_bfloat16 const* __restrict__ scales,
    __nv_bfloat16 const* __restrict__ zeros,
    __nv_bfloat16* __restrict__ out,
    int n_extent) {
  int lane = int(threadIdx.x) & 31;
  int warp = int(threadIdx.x) >> 5;
  int n = int(blockIdx.x) * 32 + lane;
  int group = warp;
  float accum = 0.0f;

  if (n < n_extent) {
    __nv_bfloat16 scale = scales[group * n_extent + n];
    __nv_bfloat16 zero = zeros[group * n_extent + n];
    __nv_bfloat162 scale2 = __bfloat162bfloat162(scale);
    __nv_bfloat162 zero2 = __bfloat162bfloat162(zero);
    uint32_t magic_bits = 0x43004300u;  // bf16x2 {128, 128}
    __nv_bfloat162 magic = *reinterpret_cast<__nv_bfloat162*>(&magic_bits);
    int packed_base = group * 64;
    int k_base = group * 128;
    #pragma unroll
    for (int p = 0; p < 64; ++p) {
      uint8_t packed = q[(packed_base + p) * n_extent + n];
      // Form bf16x2 {128+lo, 128+hi} directly in integer registers,
      // subtract the magic bias, then apply the exact bf16 affine order.
      uint32_t q_bits = 0x43004300u |
          uint32_t(packed & 15) | (uint32_t(packed & 0xf0) << 12);
      __nv_bfloat162 q_magic = *reinterpret_cast<__nv_bfloat162*>(&q_bits);
      __nv_bfloat162 q_pair = __hsub2(q_magic, magic);
      __nv_bfloat162 w_pair = __hmul2(__hsub2(q_pair, zero2), scale2);
      __nv_bfloat162 x_pair = reinterpret_cast<__nv_bfloat162 const*>(x)[
          k_base / 2 + p];
      float2 wf = __bfloat1622float2(w_pair);
      float2 xf = __bfloat1622float2(x_pair);
      accum = fmaf(xf.x, wf.x, accum);
      accum = fmaf(xf.y, wf.y, accum);
    }
  }

  __shared__ float partial[32][32];
  partial[warp][lane] = accum;
  __syncthreads();
  if (warp == 0 && n < n_extent) {
    float total = 0.0f;
    #pragma unroll
    for (int g = 0; g < 32; ++g) {
      total += partial[g][lane];
    }
    out[n] = __float2bfloat16_rn(total);
  }
}

void w4a16_gemv(torch::Tensor x, torch::Tensor q,
                 torch::Tensor scales, torch::Tensor zeros,
                 torch::Tensor out, int64_t n, int64_t k) {
  TORCH_CHECK(k == 4096, "decode kernel requires K=4096");
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  w4a16_gemv_kernel<<<(int(n) + 31) / 32, 1024, 0, stream>>>(
      reinterpret_cast<__nv_bfloat16 const*>(x.data_ptr()),
      reinterpret_cast<uint8_t const*>(q.data_ptr()),
      reinterpret_cast<__nv_bfloat16 const*>(scales.data_ptr()),
      reinterpret_cast<__nv_bfloat16 const*>(zeros.data_ptr()),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), int(n));
}

void w4a16_cutlass(torch::Tensor x, torch::Tensor q_transposed,
                   torch::Tensor scales, torch::Tensor zero_bias,
                   torch::Tensor out, int64_t m, int64_t n, int64_t k) {
  TORCH_CHECK(x.is_cuda() && q_transposed.is_cuda() && scales.is_cuda() &&
              zero_bias.is_cuda() && out.is_cuda(), "all tensors must be CUDA");
  TORCH_CHECK(q_transposed.is_contiguous(), "packed transposed weight must be contiguous");

  auto stride_a = cutlass::make_cute_packed_stride(
      StrideA{}, cute::make_shape(int(m), int(k), 1));
  auto stride_b = cutlass::make_cute_packed_stride(
      StrideB{}, cute::make_shape(int(n), int(k), 1));
  auto stride_s = cutlass::make_cute_packed_stride(
      StrideS{}, cute::make_shape(int(n), int(k / 128), 1));
  auto stride_c = cutlass::make_cute_packed_stride(
      StrideC{}, cute::make_shape(int(n), int(m), 1));
  auto stride_d = cutlass::make_cute_packed_stride(
      StrideD{}, cute::make_shape(int(n), int(m), 1));

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(n), int(m), int(k), 1},
      {
        reinterpret_cast<Narrow const*>(q_transposed.data_ptr()), stride_b,
        reinterpret_cast<Wide const*>(x.data_ptr()), stride_a,
        reinterpret_cast<ElementScale const*>(scales.data_ptr()), stride_s,
        128,
        reinterpret_cast<ElementZero const*>(zero_bias.data_ptr())
      },
      {
        {1.0f, 0.0f},
        nullptr, stride_c,
        reinterpret_cast<Wide*>(out.data_ptr()), stride_d
      }
  };

  Gemm gemm;
  auto status = gemm.can_implement(args);
  TORCH_CHECK(status == cutlass::Status::kSuccess,
              "CUTLASS cannot implement problem, status=", int(status));
  size_t workspace_size = Gemm::get_workspace_size(args);
  TORCH_CHECK(workspace_size == 0, "unexpected CUTLASS workspace requirement");
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  status = gemm.initialize(args, nullptr, stream);
  TORCH_CHECK(status == cutlass::Status::kSuccess,
              "CUTLASS initialize failed, status=", int(status));
  status = gemm.run(stream);
  TORCH_CHECK(status == cutlass::Status::kSuccess,
              "CUTLASS launch failed, status=", int(status));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a16", &w4a16_cutlass);
  m.def("gemv", &w4a16_gemv);
}

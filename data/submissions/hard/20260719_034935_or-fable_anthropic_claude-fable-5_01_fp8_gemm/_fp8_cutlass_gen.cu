
// SM90 fp8e4m3 x fp8e4m3 GEMM, D(M,N) bf16 = acc(M,N) fp32 * scale(N) fp32.
// A = x (M,K) row-major; B = w (N,K) row-major viewed as (K,N) column-major.
// KernelTmaWarpSpecializedPingpongFP8FastAccum, Tile 128x128x128, Cluster 2x1x1.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

using ElementAB  = cutlass::float_e4m3_t;
using ElementD   = cutlass::bfloat16_t;
using ElementAcc = float;
using TileShape    = Shape<_128, _128, _128>;
using ClusterShape = Shape<_2, _1, _1>;

using Accum  = cutlass::epilogue::fusion::Sm90AccFetch;
using ScaleN = cutlass::epilogue::fusion::Sm90RowBroadcast<
    0, TileShape, float, float, Stride<_0, _1, _0>>;
using Mul = cutlass::epilogue::fusion::Sm90Compute<
    cutlass::multiplies, ElementD, float,
    cutlass::FloatRoundStyle::round_to_nearest>;
using EVT = cutlass::epilogue::fusion::Sm90EVT<Mul, ScaleN, Accum>;

using CollectiveEpilogue =
    typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto,
        ElementAcc, float,
        void, cutlass::layout::RowMajor, 8,
        ElementD, cutlass::layout::RowMajor, 8,
        cutlass::epilogue::TmaWarpSpecialized, EVT>::CollectiveOp;

using CollectiveMainloop =
    typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        ElementAB, cutlass::layout::RowMajor, 16,
        ElementAB, cutlass::layout::ColumnMajor, 16,
        ElementAcc,
        TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<
            static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

void fp8_gemm_pingpong(const torch::Tensor& x, const torch::Tensor& w,
                       const torch::Tensor& scale, torch::Tensor& y) {
  int M = x.size(0), K = x.size(1), N = w.size(0);

  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  auto stride_A = cutlass::make_cute_packed_stride(StrideA{}, {M, K, 1});
  auto stride_B = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
  auto stride_D = cutlass::make_cute_packed_stride(StrideD{}, {M, N, 1});

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, 1},
      {reinterpret_cast<const ElementAB*>(x.data_ptr()), stride_A,
       reinterpret_cast<const ElementAB*>(w.data_ptr()), stride_B},
      {{}, nullptr, stride_D,
       reinterpret_cast<ElementD*>(y.data_ptr()), stride_D}};

  // Sm90EVT<Mul, ScaleN, Accum> arguments: {scale_args, accum_args, mul_args}
  args.epilogue.thread = {
      {scale.data_ptr<float>(), float(0), Stride<_0, _1, _0>{}},
      {},
      {},
  };

  static int sm_count = 0;
  if (sm_count == 0) {
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, x.get_device());
    sm_count = prop.multiProcessorCount;
  }
  args.hw_info.device_id = x.get_device();
  args.hw_info.sm_count = sm_count;

  Gemm op;
  TORCH_CHECK(Gemm::get_workspace_size(args) == 0, "unexpected workspace");
  auto stream = at::cuda::getCurrentCUDAStream(x.get_device());
  TORCH_CHECK(op.can_implement(args) == cutlass::Status::kSuccess,
              "cutlass cannot implement this problem");
  TORCH_CHECK(op.initialize(args, nullptr, stream) == cutlass::Status::kSuccess,
              "cutlass initialize failed");
  TORCH_CHECK(op.run(stream) == cutlass::Status::kSuccess, "cutlass run failed");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_gemm", &fp8_gemm_pingpong, "SM90 fp8 pingpong GEMM w/ per-col scale");
}

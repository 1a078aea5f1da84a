// FP8 e4m3 GEMM for SM120 — binding + dispatch. Kernels in fp8_cfgs_*.cu.
#include <torch/extension.h>

using RunFn = void (*)(const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, torch::Tensor&, int64_t, int64_t,
                       int64_t, int, int);
#define DECL(n) void n(const torch::Tensor&, const torch::Tensor&, \
    const torch::Tensor&, torch::Tensor&, int64_t, int64_t, int64_t, int, int);
DECL(run_cfg0) DECL(run_cfg1) DECL(run_cfg2) DECL(run_cfg3)
DECL(run_cfg4) DECL(run_cfg5) DECL(run_cfg6) DECL(run_cfg7)
DECL(run_cfg8) DECL(run_cfg9) DECL(run_cfg10) DECL(run_cfg11)

static RunFn kRunners[] = {run_cfg0, run_cfg1, run_cfg2,  run_cfg3,
                           run_cfg4, run_cfg5, run_cfg6,  run_cfg7,
                           run_cfg8, run_cfg9, run_cfg10, run_cfg11};

torch::Tensor fp8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor s,
                       int64_t impl, int64_t swizzle, int64_t splits) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && s.is_cuda());
  TORCH_CHECK(x.dtype() == torch::kFloat8_e4m3fn && w.dtype() == torch::kFloat8_e4m3fn);
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous());
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "K mismatch");
  TORCH_CHECK(K % 16 == 0, "K must be divisible by 16 (pad first)");
  auto y = torch::empty({M, N}, torch::TensorOptions().dtype(torch::kBFloat16).device(x.device()));
  int64_t n_impl = int64_t(sizeof(kRunners) / sizeof(kRunners[0]));
  TORCH_CHECK(impl >= 0 && impl < n_impl, "bad impl");
  kRunners[impl](x, w, s, y, M, N, K, int(swizzle), int(splits));
  return y;
}

int64_t num_impls() { return int64_t(sizeof(kRunners) / sizeof(kRunners[0])); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_gemm", &fp8_gemm, "fp8 gemm sm120 (x, w, s, impl, swizzle, splits)");
  m.def("num_impls", &num_impls);
}

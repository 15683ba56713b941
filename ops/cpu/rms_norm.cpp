// pagedserve::rms_norm / add_rms_norm on CPUs: one pass per row instead of the torch body's seven
// kernels, each of which costs ~5 us of dispatch at decode sizes (56+ calls a step).
// Rounds where the torch body (and transformers) round: residual + x in the input dtype, statistics in
// fp32, x * rsqrt(mean(x^2) + eps) cast to the input dtype, then the weight product rounded. Only the
// order of the fp32 sum of squares differs from torch's reduction (last-bit differences).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "bf16.h"

namespace {

using pagedserve_cpu::from_float;
using pagedserve_cpu::to_float;

// x (and residual, summed when residual is given): [rows, h] contiguous; w: [h].
template <typename T>
void norm_rows(const T* x, const T* residual, const T* w, T* out, T* summed, int64_t rows, int64_t h,
               float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * h;
      if (residual != nullptr) {
        const T* res = residual + r * h;
        T* sum = summed + r * h;
#pragma omp simd
        for (int64_t j = 0; j < h; ++j) sum[j] = from_float<T>(to_float(res[j]) + to_float(src[j]));
        src = sum;
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t j = 0; j < h; ++j) {
        const float v = to_float(src[j]);
        squares += v * v;
      }
      const float scale = 1.f / std::sqrt(squares / static_cast<float>(h) + eps);
      T* dst = out + r * h;
#pragma omp simd
      for (int64_t j = 0; j < h; ++j) {
        const float normed = to_float(from_float<T>(to_float(src[j]) * scale));
        dst[j] = from_float<T>(to_float(w[j]) * normed);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                       const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x and weight must be contiguous and of one dtype");
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = residual ? at::empty_like(x) : at::Tensor();
  PAGEDSERVE_DISPATCH_F32_BF16(x.scalar_type(), "rms_norm", [&] {
    const auto* res = residual ? static_cast<const scalar_t*>(residual->data_ptr()) : nullptr;
    norm_rows<scalar_t>(static_cast<const scalar_t*>(x.data_ptr()), res,
                        static_cast<const scalar_t*>(weight.data_ptr()), static_cast<scalar_t*>(out.data_ptr()),
                        residual ? static_cast<scalar_t*>(summed.data_ptr()) : nullptr, rows, h,
                        static_cast<float>(eps));
  });
  return {out, summed};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(run(x, c10::nullopt, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and match x");
  return run(x, residual, weight, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}

// pagedserve::rotary (neox style, full or partial) in one pass over q and k.
// Rounds exactly where the torch body (and transformers) round: cos/sin cast to the input dtype, each
// product rounded, then the difference/sum rounded. Built with -ffp-contract=off so no FMA merges them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "bf16.h"

namespace {

using pagedserve_cpu::from_float;
using pagedserve_cpu::to_float;

template <typename T>
inline float mul(T a, T b) {   // the product as the torch op stores it: rounded to T
  return to_float(from_float<T>(to_float(a) * to_float(b)));
}

// x, out: [T, H, D] contiguous. table: [P, rotary_dim] fp32.
template <typename T>
void rotate(const T* x, T* out, int64_t tokens, int64_t heads, int64_t dim, const int64_t* positions,
            const float* table, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = table + positions[t] * rotary_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = x + (t * heads + h) * dim;
        T* dst = out + (t * heads + h) * dim;
        for (int64_t j = 0; j < half; ++j) {
          const T cos = from_float<T>(cs[j]), sin = from_float<T>(cs[half + j]);
          const T x1 = src[j], x2 = src[half + j];
          dst[j] = from_float<T>(mul(x1, cos) - mul(x2, sin));
          dst[half + j] = from_float<T>(mul(x2, cos) + mul(x1, sin));
        }
        for (int64_t j = rotary_dim; j < dim; ++j) dst[j] = src[j];
      }
    }
  });
}

// Returns (q_out, k_out, -1), or (q, k, p) for the first position p outside the table (nothing computed).
std::tuple<at::Tensor, at::Tensor, int64_t> rotary(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& positions, const at::Tensor& cos_sin,
                                                   int64_t rotary_dim) {
  const auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < pos.numel(); ++t) {
    if (p[t] < 0 || p[t] >= cos_sin.size(0)) return {q, k, p[t]};
  }
  const auto qc = q.contiguous(), kc = k.contiguous(), table = cos_sin.contiguous();
  auto q_out = at::empty_like(qc), k_out = at::empty_like(kc);
  PAGEDSERVE_DISPATCH_F32_BF16(q.scalar_type(), "pagedserve_cpu::rotary", [&] {
    const auto* table_ptr = table.data_ptr<float>();
    rotate(static_cast<const scalar_t*>(qc.data_ptr()), static_cast<scalar_t*>(q_out.data_ptr()), q.size(0),
           q.size(1), q.size(2), p, table_ptr, rotary_dim);
    rotate(static_cast<const scalar_t*>(kc.data_ptr()), static_cast<scalar_t*>(k_out.data_ptr()), k.size(0),
           k.size(1), k.size(2), p, table_ptr, rotary_dim);
  });
  return {q_out, k_out, -1};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos_sin, int rotary_dim) -> (Tensor, Tensor, int)",
        &rotary);
}

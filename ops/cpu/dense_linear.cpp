// pagedserve_cpu::dense_linear: y = x @ W.T for the few rows of a decode step (W [N, K] fp32 or bf16,
// row-major as checkpoints store it). MKL's sgemm on this AMD CPU took 11.7 ms for 8 rows against a
// 8960x1536 fp32 weight, 4.7 GB/s of weight traffic; here each W row is read from memory once per call
// and the rows of x reuse it from cache, so a decode step streams the weights at memory speed.
// Threads split W's rows; each thread takes two W rows at a time against up to four x rows (eight
// accumulators of 8 lanes: the 16 AVX2 registers hold them with the loads).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16.h"
#include "vec.h"

namespace {

using pagedserve_cpu::from_float;
using pagedserve_cpu::to_float;
#ifdef __AVX2__
using pagedserve_cpu::hsum;
using pagedserve_cpu::load8;
#endif

constexpr int kRows = 4;       // x rows per pass over a pair of W rows
constexpr int64_t kPair = 2;   // W rows computed together
constexpr int64_t kPrefetch = 256;   // elements ahead in each W row
constexpr int64_t kSlice = 512;      // K values per pass when several row blocks share a W pair


// out[r][0], out[r][1] = x row r . w0, w1 over k values, for MR x rows `stride` apart. With one or two
// x rows each dot keeps two accumulators, so the FMA latency does not bound the loop.
template <int MR, typename T>
void pair_dots(const T* x, const T* w0, const T* w1, int64_t stride, int64_t k, float out[kRows][kPair]) {
  int64_t i = 0;
#ifdef __AVX2__
  constexpr int kSplit = MR <= 2 ? 2 : 1;
  __m256 acc[MR][kPair][kSplit];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kPair; ++c)
      for (int u = 0; u < kSplit; ++u) acc[r][c][u] = _mm256_setzero_ps();
  for (; i + 8 * kSplit <= k; i += 8 * kSplit) {
    __builtin_prefetch(w0 + i + kPrefetch);
    __builtin_prefetch(w1 + i + kPrefetch);
    for (int u = 0; u < kSplit; ++u) {
      const __m256 a = load8(w0 + i + 8 * u), b = load8(w1 + i + 8 * u);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = load8(x + r * stride + i + 8 * u);
        acc[r][0][u] = _mm256_fmadd_ps(xv, a, acc[r][0][u]);
        acc[r][1][u] = _mm256_fmadd_ps(xv, b, acc[r][1][u]);
      }
    }
  }
  for (; i + 8 <= k; i += 8) {
    const __m256 a = load8(w0 + i), b = load8(w1 + i);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = load8(x + r * stride + i);
      acc[r][0][0] = _mm256_fmadd_ps(xv, a, acc[r][0][0]);
      acc[r][1][0] = _mm256_fmadd_ps(xv, b, acc[r][1][0]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kPair; ++c) {
      __m256 sum = acc[r][c][0];
      for (int u = 1; u < kSplit; ++u) sum = _mm256_add_ps(sum, acc[r][c][u]);
      out[r][c] = hsum(sum);
    }
#else
  for (int r = 0; r < MR; ++r) out[r][0] = out[r][1] = 0.f;
#endif
  for (; i < k; ++i)
    for (int r = 0; r < MR; ++r) {
      const float xv = to_float(x[r * stride + i]);
      out[r][0] += xv * to_float(w0[i]);
      out[r][1] += xv * to_float(w1[i]);
    }
}

template <typename T>
void pair_dots_rows(int rows, const T* x, const T* w0, const T* w1, int64_t stride, int64_t k,
                    float out[kRows][kPair]) {
  switch (rows) {
    case 1: return pair_dots<1>(x, w0, w1, stride, k, out);
    case 2: return pair_dots<2>(x, w0, w1, stride, k, out);
    case 3: return pair_dots<3>(x, w0, w1, stride, k, out);
    default: return pair_dots<kRows>(x, w0, w1, stride, k, out);
  }
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "pagedserve_cpu::dense_linear";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous() &&
                  x.size(1) == weight.size(1) && x.scalar_type() == weight.scalar_type(),
              op, ": x [M, K] and weight [N, K] must be contiguous with one dtype, got x ", x.sizes(), " ",
              x.scalar_type(), " and weight ", weight.sizes(), " ", weight.scalar_type());
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  PAGEDSERVE_DISPATCH_F32_BF16(x.scalar_type(), op, [&] {
    const auto* xp = static_cast<const scalar_t*>(x.data_ptr());
    const auto* wp = static_cast<const scalar_t*>(weight.data_ptr());
    auto* y = static_cast<scalar_t*>(out.data_ptr());
    const int64_t pairs = (n + 1) / kPair;   // an odd last W row is paired with itself
    // Several row blocks share each W pair; K is cut in slices so that the x rows' slice and the W
    // pair's slice stay in L1 for all of them (whole rows of 8960 values spilled to L2).
    const int64_t slice = rows > kRows ? kSlice : k;
    at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
      float dots[kRows][kPair];
      std::vector<float> acc_out(rows * kPair);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t j = p * kPair, valid = std::min(kPair, n - j);
        const scalar_t* w0 = wp + j * k;
        const scalar_t* w1 = valid == kPair ? w0 + k : w0;
        for (int64_t k0 = 0; k0 < k; k0 += slice) {
          const int64_t len = std::min(slice, k - k0);
          for (int64_t m = 0; m < rows; m += kRows) {
            const int block = static_cast<int>(std::min<int64_t>(kRows, rows - m));
            pair_dots_rows(block, xp + m * k + k0, w0 + k0, w1 + k0, k, len, dots);
            for (int r = 0; r < block; ++r)
              for (int64_t c = 0; c < valid; ++c) {
                float& slot = acc_out[(m + r) * kPair + c];
                slot = k0 == 0 ? dots[r][c] : slot + dots[r][c];
              }
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < valid; ++c) y[r * n + j + c] = from_float<scalar_t>(acc_out[r * kPair + c]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight) -> Tensor", &dense_linear);
}

// pagedserve_cpu::dense_linear: y = x @ W.T for the rows of a decode or mixed step (W [N, K] fp32 or bf16,
// row-major as checkpoints store it). MKL's sgemm on this AMD CPU took 11.7 ms for 8 rows against a
// 8960x1536 fp32 weight, 4.7 GB/s of weight traffic, and reached only 45-75 GFLOP/s at 32 rows.
// Tiles of 4 x rows by 3 W rows: twelve accumulators of 8 lanes, with the three W loads and one x load
// the 16 AVX2 registers are full, and each load feeds three or four FMAs. Threads split W in groups of
// 3 rows; the first 4-row block of x streams a group's rows from memory (prefetching ahead in them), the
// later blocks find them in cache, and the second block prefetches the next group's rows, so that memory
// stays busy while it computes (0.6B layer shapes + head, same run, both orders: 8 rows 34.5-40.1 ->
// 29.7-35.0 ms, 1 row 24.2-27.6 -> 22.0-25.7, 16 and 32 rows unchanged). (Cutting K into 256-2,048-value
// slices so a group's slices stay in L1 was 3-15 % slower at 8 and 32 rows than whole rows.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "bf16.h"
#include "vec.h"

namespace {

using pagedserve_cpu::from_float;
using pagedserve_cpu::to_float;

#ifdef __AVX2__
using pagedserve_cpu::hsum;
using pagedserve_cpu::load8;

constexpr int kRows = 4;              // x rows per tile
constexpr int kCols = 3;              // W rows per tile
constexpr int64_t kGroups = 16;       // W row groups per unit of parallel work (48 rows)
// Elements ahead in each W row: 2,048 (8 KB fp32, past the next page) against 256, over the 0.6B layer
// shapes and the head, same run: 1 row 24-30 -> 24-25 ms, 8 rows 36-39 -> 31 ms.
constexpr int64_t kPrefetch = 2048;

// out[r][c] = (x row r . W row c) over `len` values (a multiple of 8), prefetching each cache line of the
// rows `pf` at the same offsets when kPrefetchRows. Every dot sums in the same order whatever MR is, so a
// row's outputs do not depend on the rows beside it in the batch (one or two rows with FMA latency bound
// are still faster than memory brings W).
// noinline: inlined into the driver's loops, GCC's register allocation made the 8-row case 1.5-2.6x
// slower (same source built as a separate function: 0.77 against 2.05 ms for 8 x 3072 -> 1024).
template <int MR, bool kPrefetchRows, typename T>
__attribute__((noinline)) void tile(const T* x, int64_t x_stride, const T* const w[kCols], const T* const pf[kCols],
                                    int64_t len, float out[kRows][kCols]) {
  __m256 acc[MR][kCols];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 8) {
    if (kPrefetchRows && i % (64 / sizeof(T)) == 0)
      for (int c = 0; c < kCols; ++c) __builtin_prefetch(pf[c] + i);
    __m256 a = load8(w[0] + i), b = load8(w[1] + i), d = load8(w[2] + i);
    // Each vector is loaded once into a register (the empty asm statements): left alone, GCC folded W's
    // or x's loads into every FMA, 15-16 loads for 12 FMAs instead of 7.
    asm("" : "+x"(a), "+x"(b), "+x"(d));
    for (int r = 0; r < MR; ++r) {
      __m256 xv = load8(x + r * x_stride + i);
      asm("" : "+x"(xv));
      acc[r][0] = _mm256_fmadd_ps(xv, a, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, b, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xv, d, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) out[r][c] = hsum(acc[r][c]);
}

template <bool kPrefetchRows, typename T>
void tile_rows(int rows, const T* x, int64_t x_stride, const T* const w[kCols], const T* const pf[kCols],
               int64_t len, float out[kRows][kCols]) {
  switch (rows) {
    case 1: return tile<1, kPrefetchRows>(x, x_stride, w, pf, len, out);
    case 2: return tile<2, kPrefetchRows>(x, x_stride, w, pf, len, out);
    case 3: return tile<3, kPrefetchRows>(x, x_stride, w, pf, len, out);
    default: return tile<kRows, kPrefetchRows>(x, x_stride, w, pf, len, out);
  }
}

template <typename T>
void dense_linear_avx2(const T* xp, const T* wp, T* y, int64_t rows, int64_t k, int64_t n) {
  const int64_t vec_k = k / 8 * 8;      // the vector part; the last k % 8 values are added per output
  at::parallel_for(0, (n + kCols - 1) / kCols, kGroups, [&](int64_t begin, int64_t end) {
    float dots[kRows][kCols];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n0 = group * kCols, cols = std::min<int64_t>(kCols, n - n0);
      const T* w[kCols];   // past W's last row, repeat it (computed, never written)
      for (int c = 0; c < kCols; ++c) w[c] = wp + (n0 + std::min<int64_t>(c, cols - 1)) * k;
      for (int64_t m = 0; m < rows; m += kRows) {
        const int block = static_cast<int>(std::min<int64_t>(kRows, rows - m));
        if (m == 0) {
          const T* ahead[kCols] = {w[0] + kPrefetch, w[1] + kPrefetch, w[2] + kPrefetch};
          tile_rows<true>(block, xp, k, w, ahead, vec_k, dots);
        } else if (m == kRows) {
          const T* next[kCols];
          for (int c = 0; c < kCols; ++c) next[c] = wp + std::min(n - 1, n0 + kCols + c) * k;
          tile_rows<true>(block, xp + m * k, k, w, next, vec_k, dots);
        } else {
          tile_rows<false>(block, xp + m * k, k, w, w, vec_k, dots);
        }
        for (int r = 0; r < block; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const T* xr = xp + (m + r) * k;
            float sum = dots[r][c];
            for (int64_t i = vec_k; i < k; ++i) sum += to_float(xr[i]) * to_float(w[c][i]);
            y[(m + r) * n + n0 + c] = from_float<T>(sum);
          }
      }
    }
  });
}
#endif

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "pagedserve_cpu::dense_linear";
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous() &&
                  x.size(1) == weight.size(1) && x.scalar_type() == weight.scalar_type(),
              op, ": x [M, K] and weight [N, K] must be contiguous with one dtype, got x ", x.sizes(), " ",
              x.scalar_type(), " and weight ", weight.sizes(), " ", weight.scalar_type());
#ifdef __AVX2__
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  PAGEDSERVE_DISPATCH_F32_BF16(x.scalar_type(), op, [&] {
    dense_linear_avx2(static_cast<const scalar_t*>(x.data_ptr()), static_cast<const scalar_t*>(weight.data_ptr()),
                      static_cast<scalar_t*>(out.data_ptr()), rows, k, n);
  });
  return out;
#else
  return at::linear(x, weight);   // this kernel is AVX2 only
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight) -> Tensor", &dense_linear);
}

// pagedserve_cpu::dense_linear: y = x @ W.T for the few rows of a decode step (W [N, K] fp32 or bf16,
// row-major as checkpoints store it). MKL's sgemm on this AMD CPU took 11.7 ms for 8 rows against a
// 8960x1536 fp32 weight, 4.7 GB/s of weight traffic, and reached only 55-75 GFLOP/s at 32 rows.
// Tiles of 4 x rows by 3 W rows: twelve accumulators of 8 lanes, with the three W loads and one x load
// the 16 AVX2 registers are full, and each load feeds three or four FMAs.
// Threads split W in chunks of 48 rows; each W row is read from memory once (a decode step streams the
// weights). With more than four x rows K is cut into slices of 512, so that a tile's three W slices
// (6 KB fp32) stay in L1 while every 4-row block of x passes over them.
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

constexpr int kRows = 4;              // x rows per tile
constexpr int kCols = 3;              // W rows per tile
constexpr int64_t kChunk = 48;        // W rows per unit of parallel work (a multiple of kCols)
constexpr int64_t kSlice = 512;       // K values per pass when several x blocks share a chunk
constexpr int64_t kPrefetch = 256;    // elements ahead in each W row

// part[r * kChunk + c] += (x row r . W row c) over `len` values (a multiple of 8), as 8-lane partial
// sums. One or two x rows use two accumulators per dot, so the FMA latency does not bound the loop.
// noinline: inlined into the driver's loops, GCC's register allocation made the M=8 case 1.5-2.6x
// slower (same source built as a separate function: 0.77 against 2.05 ms for 8 x 3072 -> 1024).
template <int MR, bool kStream, typename T>
__attribute__((noinline)) void tile(const T* x, int64_t x_stride, const T* const w[kCols], int64_t len, __m256* part, bool first) {
  constexpr int kSplit = MR <= 2 ? 2 : 1;
  __m256 acc[MR][kCols][kSplit];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c)
      for (int u = 0; u < kSplit; ++u)
        acc[r][c][u] = first || u ? _mm256_setzero_ps() : part[r * kChunk + c];
  for (int64_t i = 0; i < len; i += 8 * kSplit) {
    if (kStream)   // W comes from memory; later x blocks find it in L1, where prefetches only take load slots
      for (int c = 0; c < kCols; ++c) __builtin_prefetch(w[c] + i + kPrefetch);
    for (int u = 0; u < kSplit && i + 8 * u < len; ++u) {
      const int64_t at = i + 8 * u;
      __m256 a = load8(w[0] + at), b = load8(w[1] + at), d = load8(w[2] + at);
      // Each vector is loaded once into a register (the empty asm statements): left alone, GCC folded W's
      // or x's loads into every FMA, 15-16 loads for 12 FMAs instead of 7.
      asm("" : "+x"(a), "+x"(b), "+x"(d));
      for (int r = 0; r < MR; ++r) {
        __m256 xv = load8(x + r * x_stride + at);
        asm("" : "+x"(xv));
        acc[r][0][u] = _mm256_fmadd_ps(xv, a, acc[r][0][u]);
        acc[r][1][u] = _mm256_fmadd_ps(xv, b, acc[r][1][u]);
        acc[r][2][u] = _mm256_fmadd_ps(xv, d, acc[r][2][u]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kCols; ++c) {
      __m256 sum = acc[r][c][0];
      for (int u = 1; u < kSplit; ++u) sum = _mm256_add_ps(sum, acc[r][c][u]);
      part[r * kChunk + c] = sum;
    }
}

template <bool kStream, typename T>
void tile_rows(int rows, const T* x, int64_t x_stride, const T* const w[kCols], int64_t len, __m256* part,
               bool first) {
  switch (rows) {
    case 1: return tile<1, kStream>(x, x_stride, w, len, part, first);
    case 2: return tile<2, kStream>(x, x_stride, w, len, part, first);
    case 3: return tile<3, kStream>(x, x_stride, w, len, part, first);
    default: return tile<kRows, kStream>(x, x_stride, w, len, part, first);
  }
}

template <typename T>
void dense_linear_avx2(const T* xp, const T* wp, T* y, int64_t rows, int64_t k, int64_t n) {
  const int64_t vec_k = k / 8 * 8;      // the vector part; the last k % 8 values are added at the end
  const int64_t slice = rows > kRows ? kSlice : std::max<int64_t>(vec_k, 8);
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m256> part(rows * kChunk);
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n0 = chunk * kChunk, cols = std::min(kChunk, n - n0);
      for (int64_t c0 = 0; c0 < cols; c0 += kCols) {
        const T* w[kCols];   // past the chunk's last row, repeat it (computed, never written)
        for (int c = 0; c < kCols; ++c) w[c] = wp + (n0 + std::min<int64_t>(c0 + c, cols - 1)) * k;
        for (int64_t k0 = 0; k0 < vec_k; k0 += slice) {
          const int64_t len = std::min(slice, vec_k - k0);
          const T* ws[kCols] = {w[0] + k0, w[1] + k0, w[2] + k0};
          for (int64_t m = 0; m < rows; m += kRows) {
            const int block = static_cast<int>(std::min<int64_t>(kRows, rows - m));
            __m256* at = part.data() + m * kChunk + c0;
            if (m == 0)     // the first x block pulls W's slice from memory, the others find it in L1
              tile_rows<true>(block, xp + k0, k, ws, len, at, k0 == 0);
            else
              tile_rows<false>(block, xp + m * k + k0, k, ws, len, at, k0 == 0);
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const T* xr = xp + r * k;
          const T* wr = wp + (n0 + c) * k;
          float sum = vec_k ? hsum(part[r * kChunk + c]) : 0.f;
          for (int64_t i = vec_k; i < k; ++i) sum += to_float(xr[i]) * to_float(wr[i]);
          y[r * n + n0 + c] = from_float<T>(sum);
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

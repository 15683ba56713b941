// pagedserve::silu_and_mul on CPUs: silu(gate) * up in one pass over a fused gate/up row, where the torch
// body runs two kernels and allocates between them (28 calls a decode step of the default model).
// Rounds where torch does: silu in fp32 rounded to the input dtype, then the product rounded. silu(x) =
// x * sigmoid(x), sigmoid from e = exp(-|x|) (never overflows): 1 / (1 + e) for x >= 0, e / (1 + e) below,
// with simd.h's exp (a few ulp; torch's own differs in the last bits, so fp32 outputs may too).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>

#include "bf16.h"
#include "simd.h"

namespace {

using pagedserve_cpu::from_float;
using pagedserve_cpu::to_float;
namespace simd = pagedserve_cpu::simd;

#if defined(PAGEDSERVE_AVX512)
using Wide = simd::Avx512;
#elif defined(PAGEDSERVE_AVX2)
using Wide = simd::Avx2;
#endif

// bf16 storage as fp32, and fp32 rounded to bf16 (nearest-even, NaN as 0x7FC0, as bf16.h's from_float): the
// same bits as the scalar conversions, in registers

#if defined(PAGEDSERVE_AVX512)
inline __m512 load_as_float_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512i bf16_bits(__m512 v) {   // in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
#elif defined(PAGEDSERVE_AVX2)
inline __m256 load_as_float_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store_bf16(uint16_t* p, __m256 v) {   // packus interleaves the 128-bit lanes; the permute undoes it
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v), bf16_bits(v)), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline __m256 round_bf16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
#endif

// silu of x; every set evaluates the same formula, so a row's tail (Scalar) gets what a vector would give it
template <class S>
inline typename S::V silu(typename S::V x) {
  using V = typename S::V;
  const V one = S::set1(1.f);
  const V e = simd::exp_nonpositive<S>(S::min(x, S::mul(x, S::set1(-1.f))));
  return S::mul(x, S::div(S::where_negative(x, e, one), S::add(one, e)));
}

template <typename T>
inline float scalar_silu_and_mul(T g, T up) {
  return to_float(from_float<T>(silu<simd::Scalar>(to_float(g)))) * to_float(up);
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * 2 * half;
      const T* up = g + half;
      T* dst = out + r * half;
      int64_t j = 0;
#if defined(PAGEDSERVE_AVX2)
      for (; j + Wide::W <= half; j += Wide::W) {
        if constexpr (std::is_same_v<T, float>) {
          Wide::store(dst + j, Wide::mul(silu<Wide>(Wide::load(g + j)), Wide::load(up + j)));
        } else {
          const auto act = round_bf16(silu<Wide>(load_as_float_bf16(g + j)));
          store_bf16(dst + j, Wide::mul(act, load_as_float_bf16(up + j)));
        }
      }
#endif
      for (; j < half; ++j) dst[j] = from_float<T>(scalar_silu_and_mul(g[j], up[j]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.size(-1) % 2 == 0,
              "silu_and_mul: x must be contiguous [.., 2*I], got ", x.sizes());
  const int64_t half = x.size(-1) / 2, rows = half ? x.numel() / (2 * half) : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = half;
  at::Tensor out = at::empty(sizes, x.options());
  PAGEDSERVE_DISPATCH_F32_BF16(x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(static_cast<const scalar_t*>(x.data_ptr()), static_cast<scalar_t*>(out.data_ptr()),
                                rows, half);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("silu_and_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }

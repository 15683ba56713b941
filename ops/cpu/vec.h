// AVX2 helpers shared by the fp32 kernels: 8-value loads from fp32 or bf16 storage and a horizontal sum.
#pragma once

#ifdef __AVX2__
#include <immintrin.h>

#include <cstdint>

namespace pagedserve_cpu {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {   // 8 bf16 -> fp32: the bits move to the high half
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace pagedserve_cpu
#endif

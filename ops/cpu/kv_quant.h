// Block-quantized K/V rows (q8_0, q4_0; the format is described in ops/kv_quant.py): quantizing a row as
// write_kv stores it, the 32-point Walsh-Hadamard rotation of K (and of q in attention), and the vector
// loads of the decode attention, which dequantize 2W values of a row into two fp32 vectors in order.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace pagedserve_cpu::kv_quant {

using namespace pagedserve_cpu::simd;

constexpr int kBlock = 32;

// Cache element tags: rows of kBlockBytes-byte blocks, stored as bytes.
struct Q8_0 {
  static constexpr int kBlockBytes = 2 + kBlock;
};
struct Q4_0 {
  static constexpr int kBlockBytes = 2 + kBlock / 2;
};
template <class C>
constexpr bool kQuant = std::is_same_v<C, Q8_0> || std::is_same_v<C, Q4_0>;
// What a cache of C is addressed in: bytes for the quantized rows, else the values themselves.
template <class C>
using Elem = std::conditional_t<kQuant<C>, uint8_t, C>;

// Where value d of a row starts, in bytes (for quantized rows: its share of the row, for prefetching).
template <class C>
constexpr int64_t byte_of(int64_t d) {
  if constexpr (kQuant<C>)
    return d * C::kBlockBytes / kBlock;
  else
    return d * static_cast<int64_t>(sizeof(C));
}

// x[0..32) times H / sqrt(32): five butterfly stages, then one multiply (ops/kv_quant.py's `rotate`, the same
// operations in the same order, so write_kv stores the bytes the torch body stores).
inline void rotate_block(float* x) {
  for (int h = 1; h < kBlock; h *= 2)
    for (int i = 0; i < kBlock; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kBlock)));
  for (int i = 0; i < kBlock; ++i) x[i] *= norm;
}

inline float half_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One block of 32 values into `out` (kBlockBytes bytes), rounding as ops/kv_quant.py's `quantize` does.
template <class F>
inline void quantize_block(const float* x, uint8_t* out) {
  float pick;
  if constexpr (std::is_same_v<F, Q8_0>) {
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    pick = amax / 127.f;
  } else {
    float amax = std::fabs(x[0]), top = x[0];       // the first value of the largest magnitude
    for (int i = 1; i < kBlock; ++i)
      if (std::fabs(x[i]) > amax) amax = std::fabs(x[i]), top = x[i];
    pick = top / -8.f;
  }
  const c10::Half d(pick);
  std::memcpy(out, &d.x, 2);
  const float d32 = static_cast<float>(d), inv = d32 == 0.f ? 0.f : 1.f / d32;
  if constexpr (std::is_same_v<F, Q8_0>) {
    for (int i = 0; i < kBlock; ++i) {
      const float q = std::nearbyint(x[i] * inv);    // half to even, like torch.round
      out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.f, 127.f)));
    }
  } else {
    uint8_t nib[kBlock];
    for (int i = 0; i < kBlock; ++i)
      nib[i] = static_cast<uint8_t>(std::clamp(std::floor(x[i] * inv + 8.5f), 0.f, 15.f));
    for (int i = 0; i < kBlock / 2; ++i) out[2 + i] = static_cast<uint8_t>(nib[i] | (nib[i + kBlock / 2] << 4));
  }
}

// Value d of a row, dequantized (the scalar set's loads).
template <class F>
PAGEDSERVE_INLINE float value_at(const uint8_t* row, int64_t d) {
  const uint8_t* block = row + d / kBlock * F::kBlockBytes;
  const int i = static_cast<int>(d % kBlock);
  if constexpr (std::is_same_v<F, Q8_0>) return half_bits_to_float(block) * static_cast<int8_t>(block[2 + i]);
  const uint8_t byte = block[2 + i % (kBlock / 2)];
  return half_bits_to_float(block) * static_cast<float>((i < kBlock / 2 ? byte & 0x0F : byte >> 4) - 8);
}

#ifdef PAGEDSERVE_AVX2
// The block's fp16 scale at p in every lane: a broadcast load and one conversion (where converting one
// value and broadcasting it takes four instructions).
PAGEDSERVE_INLINE __m256 scale8(const uint8_t* p) {
  int16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm256_cvtph_ps(_mm_set1_epi16(bits));
}

// 16 nibbles of `bytes` as int8 values - 8: the low nibbles (values 0..15 of a q4_0 block) or the high ones
PAGEDSERVE_INLINE __m128i nibbles(__m128i bytes, bool high) {
  const __m128i n = _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
  return _mm_sub_epi8(n, _mm_set1_epi8(8));
}
#endif

// The 2W values [d, d + 2W) of a quantized row as two fp32 vectors in order (d a multiple of 2W; the
// sets' 2W divides 32, so they lie in one block): int8 values widened, times the block's scale.
template <class S, class F>
PAGEDSERVE_INLINE void load2_quant(const uint8_t* row, int64_t d, typename S::V& a, typename S::V& b) {
  const uint8_t* block = row + d / kBlock * F::kBlockBytes;
  const int off = static_cast<int>(d % kBlock);
  if constexpr (S::W == 1) {
    a = value_at<F>(row, d);
    b = value_at<F>(row, d + 1);
#ifdef PAGEDSERVE_AVX2
  } else if constexpr (S::W == 8) {
    const __m256 s = scale8(block);
    __m128i q;
    if constexpr (std::is_same_v<F, Q8_0>)
      q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + off));
    else
      q = nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)), off != 0);
    a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
    b = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), s);
#endif
#ifdef PAGEDSERVE_AVX512
  } else if constexpr (S::W == 16) {
    int16_t bits;
    std::memcpy(&bits, block, sizeof bits);
    const __m512 s = _mm512_cvtph_ps(_mm256_set1_epi16(bits));
    __m128i lo, hi;
    if constexpr (std::is_same_v<F, Q8_0>) {
      lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + kBlock / 2));
    } else {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      lo = nibbles(bytes, false);
      hi = nibbles(bytes, true);
    }
    a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), s);
    b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), s);
#endif
  }
}

}  // namespace pagedserve_cpu::kv_quant

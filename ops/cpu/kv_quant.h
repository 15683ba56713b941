// Block-quantized K/V rows (q8_0, q4_0) and the tiles a cache keeps them in (both described in
// ops/kv_quant.py): quantizing a row into its tile as write_kv stores it and reading it back as gather_kv does,
// the 32-point Walsh-Hadamard rotation of K (and of q in attention), and where the decode attention finds a
// tile's scales and values.
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
template <class C>
constexpr bool kQ8 = std::is_same_v<C, Q8_0>;
// What a cache of C is addressed in: bytes for the quantized rows, else the values themselves.
template <class C>
using Elem = std::conditional_t<kQuant<C>, uint8_t, C>;

// Bytes of one value of a cache of C (fp caches only: quantized ones are read tile by tile).
template <class C>
constexpr int64_t byte_of(int64_t d) {
  return d * static_cast<int64_t>(sizeof(C));
}

// A tile: kTile slots of one kv head, their scales first ([dim / 32][kTile] fp16, `scale_of`), then their
// values from `values_of(dim)` in 64-byte rows, in the K order (a slot per 32-bit word) or the V order (a
// value per 32-bit word, 4 slots in it).
constexpr int kTile = 16;
constexpr int64_t kRow = 64;
template <class F>
constexpr int64_t tile_bytes(int64_t dim) {
  return kTile * dim / kBlock * F::kBlockBytes;
}
constexpr int64_t scale_of(int64_t b, int j) { return (b * kTile + j) * 2; }
constexpr int64_t values_of(int64_t dim) { return dim / kBlock * kTile * 2; }
// The K row of 4 values (q8_0: values 4r..4r+3 of the head; q4_0: nibble pairs 4r..4r+3 of block b) and the
// V row of 16 values (q8_0: values 16r..16r+15; q4_0: the 16 nibble pairs of block r) of slots 4 * quad ..
template <class F>
constexpr int64_t k_row(int64_t dim, int64_t b, int64_t r) {
  return values_of(dim) + (std::is_same_v<F, Q8_0> ? 8 * b + r : 4 * b + r) * kRow;
}
constexpr int64_t v_row(int64_t dim, int64_t r, int quad) { return values_of(dim) + (r * (kTile / 4) + quad) * kRow; }

// A chunk of decode positions the integer kernels (attention_int8.h, attention_int16.h) read with one softmax
// update: up to kChunkTiles tiles of one kv head, `n` slots in all (the last tile may be partial), and where
// they exist the tiles two chunks on, prefetched while these are read (null past the row's end).
constexpr int kChunkTiles = 4;
constexpr int kChunk = kChunkTiles * kTile;
struct Chunk {
  const uint8_t* k[kChunkTiles];
  const uint8_t* v[kChunkTiles];
  const uint8_t* k_ahead[kChunkTiles];
  const uint8_t* v_ahead[kChunkTiles];
  int n;
};

// Where byte u of block b's values (q8_0: value u; q4_0: nibble pair u, values u and u + 16) of slot j lies in
// its tile, in the K order (`k`) or the V order.
template <class F>
constexpr int64_t value_byte(int64_t dim, int j, int64_t b, int u, bool k) {
  if (k) return k_row<F>(dim, b, u / 4) + j * 4 + u % 4;
  return v_row(dim, std::is_same_v<F, Q8_0> ? 2 * b + u / 16 : b, j / 4) + u % 16 * 4 + j % 4;
}

// Block b of a row (bytes[kBlockBytes], as quantize_block writes it) into slot j of its tile, and back.
template <class F>
inline void store_block(uint8_t* tile, int64_t dim, int j, int64_t b, const uint8_t* bytes, bool k) {
  std::memcpy(tile + scale_of(b, j), bytes, 2);
  for (int u = 0; u < F::kBlockBytes - 2; ++u) tile[value_byte<F>(dim, j, b, u, k)] = bytes[2 + u];
}
template <class F>
inline void load_block(const uint8_t* tile, int64_t dim, int j, int64_t b, uint8_t* bytes, bool k) {
  std::memcpy(bytes, tile + scale_of(b, j), 2);
  for (int u = 0; u < F::kBlockBytes - 2; ++u) bytes[2 + u] = tile[value_byte<F>(dim, j, b, u, k)];
}

// x[0..32) times H / sqrt(32): five butterfly stages (pairs (j, j + h) -> (a + b, a - b) for h = 1, 2, 4, 8,
// 16), then one multiply: ops/kv_quant.py's `rotate`, the same operations in the same order (the vector sets
// pair each lane with its partner's lane), so write_kv stores the bytes the torch body stores.
inline void rotate_block(float* x) {
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kBlock)));
#ifdef PAGEDSERVE_AVX512
  __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int h = 1; h < 16; h *= 2) {
    const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
    const __mmask16 second = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));    // lanes j + h: a - b
    for (__m512& y : v) {
      const __m512 other = _mm512_permutexvar_ps(partner, y);
      y = _mm512_mask_sub_ps(_mm512_add_ps(y, other), second, other, y);
    }
  }
  _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_add_ps(v[0], v[1]), _mm512_set1_ps(norm)));
  _mm512_storeu_ps(x + 16, _mm512_mul_ps(_mm512_sub_ps(v[0], v[1]), _mm512_set1_ps(norm)));
#else
  for (int h = 1; h < kBlock; h *= 2)
    for (int i = 0; i < kBlock; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  for (int i = 0; i < kBlock; ++i) x[i] *= norm;
#endif
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

// One block's 32 values back from its bytes: scale times value, in fp32 as ops/kv_quant.py's `dequantize`.
template <class F>
inline void dequantize_block(const uint8_t* bytes, float* out) {
  const float d = half_bits_to_float(bytes);
  for (int i = 0; i < kBlock; ++i) {
    if constexpr (std::is_same_v<F, Q8_0>)
      out[i] = d * static_cast<float>(static_cast<int8_t>(bytes[2 + i]));
    else
      out[i] = d * static_cast<float>((i < kBlock / 2 ? bytes[2 + i] & 0x0F : bytes[2 + i - kBlock / 2] >> 4) - 8);
  }
}

// W slots' (K order) or W values' (V order) values from the W 32-bit words at p, as fp32 lanes: byte c of each
// word (q8_0: an int8) or, for q4_0, its low or high nibble less 8.
template <class S, class F>
PAGEDSERVE_INLINE typename S::V word_lanes(const uint8_t* p, int c, bool high) {
  if constexpr (S::W == 1) {
    if constexpr (std::is_same_v<F, Q8_0>) return static_cast<float>(static_cast<int8_t>(p[c]));
    return static_cast<float>((high ? p[c] >> 4 : p[c] & 0x0F) - 8);
#ifdef PAGEDSERVE_AVX2
  } else if constexpr (S::W == 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<F, Q8_0>)
      return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 24 - 8 * c), 24));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(
        _mm256_and_si256(_mm256_srli_epi32(x, 8 * c + (high ? 4 : 0)), _mm256_set1_epi32(0x0F)), _mm256_set1_epi32(8)));
#endif
#ifdef PAGEDSERVE_AVX512
  } else {
    const __m512i x = _mm512_loadu_si512(p);
    if constexpr (std::is_same_v<F, Q8_0>)
      return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 24 - 8 * c), 24));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_and_si512(_mm512_srli_epi32(x, 8 * c + (high ? 4 : 0)), _mm512_set1_epi32(0x0F)), _mm512_set1_epi32(8)));
#endif
  }
}

// W consecutive fp16 scales at p as fp32 lanes.
template <class S>
PAGEDSERVE_INLINE typename S::V scale_lanes(const uint8_t* p) {
  if constexpr (S::W == 1) {
    return half_bits_to_float(p);
#ifdef PAGEDSERVE_AVX2
  } else if constexpr (S::W == 8) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
#ifdef PAGEDSERVE_AVX512
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
  }
}

}  // namespace pagedserve_cpu::kv_quant

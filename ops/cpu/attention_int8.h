// The decode attention for q8_0 / q4_0 caches on CPUs with AVX-512 VNNI (ops/cpu/paged_attention.cpp's
// run_int8 calls it in place of attention_tile.h's fp32 tiles, whose widening of every value to fp32 and
// FMA per value kept the FMA ports, not memory, the limit). Integer dot products instead:
//  - scores: VPDPBUSD, 64 byte products per instruction, of the stored keys' bytes with the (rotated)
//    query quantized like a q8_0 key (see Queries). The 16 keys of a tile are transposed in registers so
//    each 32-bit lane holds one key: scores come out one key per lane, with no horizontal sums.
//  - values: VPDPWSSD, two keys' int16 products per lane, with the softmax weight times the value block's
//    scale rounded to int16 steps of the chunk's largest block scale / 32767 (weights are at most 1).
// A chunk of 64 positions takes one softmax update and one pass over its values, so the per-update work
// (reductions, exps, converting the int32 sums back into the fp32 accumulators) is spread over 64 keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "simd.h"

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_INT8_DOT 1

namespace pagedserve_cpu::attention_int8 {

using namespace pagedserve_cpu::simd;
using kv_quant::kBlock;

constexpr int kTile = 16;        // keys scored together: one per 32-bit lane
constexpr int kChunk = 64;       // keys per softmax update and per pass of the values
constexpr int kMaxGroup = 8;     // query heads per pass over a chunk; larger GQA groups take several
constexpr int64_t kMaxBlocks = 8;   // 32-value blocks per head (head_dim <= 256; larger ones take the fp32 set)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A row's queries as the tile reads them: per query head, its (rotated) values as int8, round(x / d) with
// d = amax / 127 per 32-value block (as llama.cpp scores q8_0 keys), and per block the scale that turns
// the integer dot products into a score (d times the softmax scale) and the integer the stored keys' offset
// adds (q8_0 keys are read as k + 128, q4_0 nibbles as k + 8). A 16-bit query (a second int8 part for the
// remainder) doubled the scores' dot products and left the default model's perplexity with q8_0 K/V as
// it was.
struct Queries {
  std::vector<int8_t> values;    // [heads, dim]
  std::vector<float> scale;      // [heads, dim / 32]
  std::vector<int32_t> offset;   // [heads, dim / 32]: -(key offset) * the sum of the block's values
};

// acc + the dot products of VPDPBUSD (u: unsigned bytes, v: signed) and VPDPWSSD (int16 pairs), written in
// place: through the intrinsics GCC 12 copied every accumulator before each instruction and back after it
// (three instructions for one; this Xeon's move elimination hid the cost, a CPU without it would not).
PAGEDSERVE_INLINE __m512i dot_u8s8(__m512i acc, __m512i u, __m512i v) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v));
  return acc;
}
PAGEDSERVE_INLINE __m512i dot_s16(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

template <class C>
constexpr int32_t kKeyOffset = std::is_same_v<C, kv_quant::Q8_0> ? 128 : 8;

// x: [heads, dim] fp32 queries, already rotated.
template <class C>
void quantize_queries(const float* x, int64_t heads, int64_t dim, float softmax_scale, Queries& out) {
  const int64_t blocks = dim / kBlock;
  out.values.resize(heads * dim);
  out.scale.resize(heads * blocks);
  out.offset.resize(heads * blocks);
  for (int64_t hb = 0; hb < heads * blocks; ++hb) {
    const float* v = x + hb * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, inv = d == 0.f ? 0.f : 1.f / d;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const float y = std::nearbyint(v[i] * inv);
      out.values[hb * kBlock + i] = static_cast<int8_t>(y);
      sum += static_cast<int32_t>(y);
    }
    out.scale[hb] = d * softmax_scale;
    out.offset[hb] = -kKeyOffset<C> * sum;
  }
}

// Per thread: a chunk's scores (then softmax weights), its value blocks' scales and the weights as int16.
struct Scratch {
  alignas(64) float scores[kMaxGroup * kChunk];
  alignas(64) float v_scales[kMaxBlocks * kChunk];            // [blocks, 64]
  alignas(64) int16_t weights[kMaxGroup * kMaxBlocks * kChunk];  // [group, blocks, 64]
  float corr[kMaxGroup];
};

// The 32 stored values of block b of a row as unsigned bytes in order (q8_0: k + 128; q4_0: the nibbles).
template <class C>
PAGEDSERVE_INLINE __m256i block_bytes(const uint8_t* row, int64_t b) {
  const uint8_t* block = row + b * C::kBlockBytes + 2;
  if constexpr (std::is_same_v<C, kv_quant::Q8_0>) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)), _mm256_set1_epi8(-128));
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block)), mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), mask), _mm_and_si128(x, mask));
  }
}

// Block b of 16 rows as 8 vectors, t[c] lane j = bytes 4c..4c+3 of row j: an 8 x 8 transpose of 32-bit
// values in each 256-bit half (rows j and j + 8 share a vector).
template <class C>
PAGEDSERVE_INLINE void transpose_block(const uint8_t* const* rows, int64_t b, __m512i* t) {
  __m512i z[8], u[8], v[8];
  for (int j = 0; j < 8; ++j)
    z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(block_bytes<C>(rows[j], b)), block_bytes<C>(rows[j + 8], b), 1);
  for (int j = 0; j < 8; j += 2) {
    u[j] = _mm512_unpacklo_epi32(z[j], z[j + 1]);        // per 128-bit lane: (r_j, r_j+1) of dwords 0, 1
    u[j + 1] = _mm512_unpackhi_epi32(z[j], z[j + 1]);    // ... of dwords 2, 3
  }
  for (int j = 0; j < 8; j += 4)
    for (int i = 0; i < 2; ++i) {
      v[j + 2 * i] = _mm512_unpacklo_epi64(u[j + i], u[j + i + 2]);       // rows j..j+3 of dword (2i) per lane
      v[j + 2 * i + 1] = _mm512_unpackhi_epi64(u[j + i], u[j + i + 2]);   // ... of dword (2i + 1)
    }
  // v[c] (c < 4, rows 0..3) and v[c + 4] (rows 4..7): lane L of each half holds dword c + 4L; interleave the
  // halves' 128-bit lanes so rows run 0..15
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_permutex2var_epi64(v[c], low, v[c + 4]);
    t[c + 4] = _mm512_permutex2var_epi64(v[c], high, v[c + 4]);
  }
}

// The fp16 scales of block b of 16 rows (row j at origin + offsets[j]) as fp32 lanes, by 16 scalar loads:
// on Zen 4 one VPGATHERDD took longer than all of them.
PAGEDSERVE_INLINE __m512 block_scales(const uint8_t* origin, const int32_t* offsets, int64_t b, int64_t block_bytes) {
  alignas(32) uint16_t words[kTile];
  const uint8_t* at = origin + b * block_bytes;
  for (int j = 0; j < kTile; ++j) std::memcpy(&words[j], at + offsets[j], sizeof(uint16_t));
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(words)));
}

// Scores of 16 keys (rows[j], also at k_origin + offsets[j]) for G query heads into scores[g * 64 ...]: per
// block, the keys transposed once and G chains of dot products side by side.
template <class C, int G>
PAGEDSERVE_INLINE void score_tile(const Queries& q, int64_t h, const uint8_t* const* rows, const uint8_t* k_origin,
                                  const int32_t* offsets, int64_t dim, float* scores) {
  const int64_t blocks = dim / kBlock;
  __m512 sc[G];
  for (int g = 0; g < G; ++g) sc[g] = _mm512_setzero_ps();
  const auto part = [&](int g, int64_t b, int c) {    // 4 query values for the keys' bytes 4c..4c+3
    int32_t word;
    std::memcpy(&word, q.values.data() + (h + g) * dim + b * kBlock + 4 * c, sizeof word);
    return _mm512_set1_epi32(word);
  };
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i t[8], dot[G];
    transpose_block<C>(rows, b, t);
    for (int g = 0; g < G; ++g) dot[g] = _mm512_set1_epi32(q.offset[(h + g) * blocks + b]);
    for (int c = 0; c < 8; ++c)
      for (int g = 0; g < G; ++g) dot[g] = dot_u8s8(dot[g], t[c], part(g, b, c));
    const __m512 k_scale = block_scales(k_origin, offsets, b, C::kBlockBytes);
    for (int g = 0; g < G; ++g)
      sc[g] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[g]), k_scale),
                              _mm512_set1_ps(q.scale[(h + g) * blocks + b]), sc[g]);
  }
  for (int g = 0; g < G; ++g) _mm512_store_ps(scores + g * kChunk, sc[g]);
}

// G heads' online-softmax update over a chunk's `n` scores (s.scores, `tiles` vectors per head, keys from
// n on masked): the running max and sum, each head's correction of its accumulators in s.corr, and the
// weights in place of the scores.
template <int G>
PAGEDSERVE_INLINE void softmax_chunk(Scratch& s, int n, int tiles, float* run_max, float* run_sum) {
  float m[G];
  for (int g = 0; g < G; ++g) {
    float* sc = s.scores + g * kChunk;
    for (int i = 0; i < tiles; ++i) {
      const int left = std::clamp(n - i * kTile, 0, kTile);
      const __mmask16 real = static_cast<__mmask16>((1u << left) - 1);
      const __m512 x = _mm512_load_ps(sc + i * kTile);
      _mm512_store_ps(sc + i * kTile, _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), real, x));
    }
    __m512 top = _mm512_load_ps(sc);
    for (int i = 1; i < tiles; ++i) top = _mm512_max_ps(top, _mm512_load_ps(sc + i * kTile));
    m[g] = std::max(run_max[g], _mm512_reduce_max_ps(top));
  }
  for (int g = 0; g < G; ++g) {
    float* sc = s.scores + g * kChunk;
    s.corr[g] = exp_nonpositive<Scalar>(run_max[g] - m[g]);    // -inf on the first chunk: its correction is 0
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < tiles; ++i) {
      const __m512 e = exp_nonpositive<Avx512>(_mm512_sub_ps(_mm512_load_ps(sc + i * kTile), _mm512_set1_ps(m[g])));
      _mm512_store_ps(sc + i * kTile, e);
      total = _mm512_add_ps(total, e);
    }
    run_sum[g] = run_sum[g] * s.corr[g] + _mm512_reduce_add_ps(total);
    run_max[g] = m[g];
  }
}

// The weights of the values, per head and value block: softmax weight times the block's scale, as int16 in
// steps of the largest block scale of the chunk / 32767 (weights are at most 1, so they fit); returns the
// step of each block in step[b].
template <class C, int G>
PAGEDSERVE_INLINE void value_weights(Scratch& s, const uint8_t* v_origin, const int32_t* offsets, int tiles,
                                     int64_t blocks, float* step) {
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < tiles; ++i) {
      const __m512 d = block_scales(v_origin, offsets + i * kTile, b, C::kBlockBytes);
      _mm512_store_ps(s.v_scales + b * kChunk + i * kTile, d);
      top = _mm512_max_ps(top, _mm512_abs_ps(d));
    }
    const float largest = _mm512_reduce_max_ps(top);
    step[b] = largest / 32767.f;
    const __m512 inv = _mm512_set1_ps(largest == 0.f ? 0.f : 32767.f / largest);
    for (int i = 0; i < tiles; ++i) {
      const __m512 d = _mm512_mul_ps(_mm512_load_ps(s.v_scales + b * kChunk + i * kTile), inv);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_mul_ps(_mm512_load_ps(s.scores + g * kChunk + i * kTile), d);
        _mm256_store_si256(reinterpret_cast<__m256i*>(s.weights + (g * blocks + b) * kChunk + i * kTile),
                           _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(w)));
      }
    }
  }
}

// The 32 values of block b of a row as int16 (q4_0: nibble - 8).
template <class C>
PAGEDSERVE_INLINE __m512i value_block(const uint8_t* row, int64_t b) {
  if constexpr (std::is_same_v<C, kv_quant::Q8_0>)
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * C::kBlockBytes + 2)));
  else
    return _mm512_cvtepi8_epi16(_mm256_sub_epi8(block_bytes<C>(row, b), _mm256_set1_epi8(8)));
}

// Lines to prefetch into L2 while a chunk is read, a few per step of its values' loop rather than all at
// once (the core has few miss buffers; software prefetches wait for them like loads).
struct Prefetch {
  const char* const* lines;
  int count;
};

// acc[g][block b] = acc * corr[g] + step[b] * sum over the chunk's keys of weight * value, in int32 lanes:
// VPDPWSSD takes the keys in pairs (j, j + 1), their values interleaved by unpacking, so one instruction
// adds two keys' products for 16 values (lo: values 8L + 0..3 of each 128-bit lane L, hi: 8L + 4..7).
template <class C, int G>
PAGEDSERVE_INLINE void add_values(const Scratch& s, const uint8_t* const* rows, int n, int64_t blocks,
                                  const float* step, int64_t dim, float* acc, Prefetch ahead) {
  const int steps = static_cast<int>(blocks) * ((n + 1) / 2), per = (ahead.count + steps - 1) / steps;
  int issued = 0;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i lo_acc[G], hi_acc[G];
    for (int g = 0; g < G; ++g) lo_acc[g] = hi_acc[g] = _mm512_setzero_si512();
    const int32_t* pairs[G];
    for (int g = 0; g < G; ++g) pairs[g] = reinterpret_cast<const int32_t*>(s.weights + (g * blocks + b) * kChunk);
    for (int j = 0; j < n; j += 2) {
      for (int i = 0; i < per && issued < ahead.count; ++i) _mm_prefetch(ahead.lines[issued++], _MM_HINT_T1);
      const __m512i x = value_block<C>(rows[j], b), y = value_block<C>(rows[j + 1], b);
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      for (int g = 0; g < G; ++g) {
        const __m512i w = _mm512_set1_epi32(pairs[g][j / 2]);
        lo_acc[g] = dot_s16(lo_acc[g], lo, w);
        hi_acc[g] = dot_s16(hi_acc[g], hi, w);
      }
    }
    const __m512 d = _mm512_set1_ps(step[b]);
    for (int g = 0; g < G; ++g) {
      float* out = acc + g * dim + b * kBlock;
      const __m512 c = _mm512_set1_ps(s.corr[g]);
      const __m512 a = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo_acc[g], first, hi_acc[g]));
      const __m512 e = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo_acc[g], second, hi_acc[g]));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(a, d, _mm512_mul_ps(_mm512_loadu_ps(out), c)));
      _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(e, d, _mm512_mul_ps(_mm512_loadu_ps(out + 16), c)));
    }
  }
}

// `n` (<= 64) keys of one kv head against G of its query heads (those from h of q), with the online-softmax
// update of the heads' running max / sum / accumulators (acc [G, dim] in order). Row j's K and V are at
// k_origin / v_origin + offsets[j] (offsets[64]; those from n on repeat row 0, so every tile reads real rows
// and pairs stay whole; their weights are 0). The `ahead` lines are prefetched on the way.
template <class C, int G>
void attend_chunk(const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum, const uint8_t* k_origin,
                  const uint8_t* v_origin, const int32_t* offsets, int n, int64_t dim, Scratch& s, Prefetch ahead) {
  const int64_t blocks = dim / kBlock;
  const int tiles = (n + kTile - 1) / kTile;
  const uint8_t* keys[kChunk];
  const uint8_t* values[kChunk];
  for (int j = 0; j < kChunk; ++j) {
    keys[j] = k_origin + offsets[j];
    values[j] = v_origin + offsets[j];
  }
  for (int i = 0; i < tiles; ++i)
    score_tile<C, G>(q, h, keys + i * kTile, k_origin, offsets + i * kTile, dim, s.scores + i * kTile);
  softmax_chunk<G>(s, n, tiles, run_max, run_sum);
  float step[kMaxBlocks];
  value_weights<C, G>(s, v_origin, offsets, tiles, blocks, step);
  add_values<C, G>(s, values, n, blocks, step, dim, acc, ahead);
}

// attend_chunk for the 1 to kMaxGroup query heads of (a part of) a GQA group.
template <class C>
void attend_group(int group, const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum,
                  const uint8_t* k_origin, const uint8_t* v_origin,
                  const int32_t* offsets, int n, int64_t dim, Scratch& s, Prefetch ahead) {
  switch (group) {
#define PAGEDSERVE_GROUP(G)                                                                                    \
  case G:                                                                                                      \
    return attend_chunk<C, G>(q, h, acc, run_max, run_sum, k_origin, v_origin, offsets, n, dim, s, ahead);
    PAGEDSERVE_GROUP(1) PAGEDSERVE_GROUP(2) PAGEDSERVE_GROUP(3) PAGEDSERVE_GROUP(4)
    PAGEDSERVE_GROUP(5) PAGEDSERVE_GROUP(6) PAGEDSERVE_GROUP(7) PAGEDSERVE_GROUP(8)
#undef PAGEDSERVE_GROUP
  }
}

}  // namespace pagedserve_cpu::attention_int8

#endif

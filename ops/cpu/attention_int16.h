// The decode attention for q8_0 / q4_0 caches on AVX2 CPUs without AVX-512 VNNI (paged_attention.cpp's
// run_chunks calls it for the Avx2 set; attention_int8.h serves VNNI CPUs, attention_quant.h the other sets).
// It reads the same tiles (kv_quant.h) a chunk of 4 tiles of one kv head at a time, one softmax update per
// chunk (per tile, the softmax cost as much as the scores), with VPMADDWD: the values widened to int16 (q8_0's
// bytes, q4_0's nibbles less 8) and multiplied in pairs into int32 lanes, where the fp32 kernel converted
// every value to a float and spent one FMA per value and head. The widening is shared by a pass's heads.
//  - scores: 16 bytes of a K row are 4 values of 4 slots (q4_0: 4 nibble pairs, low then high nibbles read
//    as two rows); against 4 values of the (rotated) query, rounded to int8 per 32-value block as a q8_0 key
//    is (as attention_int8.h's queries are, here as int16), VPMADDWD gives each slot two partial sums, folded
//    by one VPHADDD per 8 slots at the block's end, then times the block's scales. Signed by signed: no offsets.
//  - values: 16 bytes of a V row are 4 values of 4 slots; against the 4 slots' softmax weights as int16
//    (relative to the chunk's max, times the value blocks' scales in steps of the chunk's largest magnitude:
//    15 bits and a sign, as q4_0's scales may be negative), VPMADDWD gives each value two partial sums,
//    folded the same way.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_tile.h"
#include "kv_quant.h"
#include "simd.h"

#ifdef PAGEDSERVE_AVX2

namespace pagedserve_cpu::attention_int16 {

using kv_quant::Chunk;
using kv_quant::kBlock;
using kv_quant::kChunk;
using kv_quant::kChunkTiles;
using kv_quant::kQ8;
using kv_quant::kTile;

constexpr int kMaxGroup = 6;                   // heads per pass: 2 accumulators each, with 3 operands, fill 16 registers
constexpr float kWeightSteps = 32767.f;        // the weights' int16 range (VPMADDWD's operands are signed)

// A row's queries as the scores read them: per head its rotated values rounded to int8 per 32-value block,
// round(x / d) with d = amax / 127, kept as int16, and per block d times the softmax scale.
struct Queries {
  std::vector<int16_t> values;   // [heads, dim]
  std::vector<float> scale;      // [heads, dim / 32]
};

// x: [heads, dim] fp32 queries, already rotated.
inline void quantize_queries(const float* x, int64_t heads, int64_t dim, float softmax_scale, Queries& out) {
  const int64_t blocks = dim / kBlock;
  out.values.resize(heads * dim);
  out.scale.resize(heads * blocks);
  for (int64_t hb = 0; hb < heads * blocks; ++hb) {
    const float* v = x + hb * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, inv = d == 0.f ? 0.f : 1.f / d;
    for (int i = 0; i < kBlock; ++i) out.values[hb * kBlock + i] = static_cast<int16_t>(std::nearbyint(v[i] * inv));
    out.scale[hb] = d * softmax_scale;
  }
}

// Per thread: a chunk's scores and weights per head (the weights per value block too, as int16), and each
// block's step.
struct Scratch {
  alignas(32) float scores[kMaxGroup][kChunk];
  std::vector<int16_t> weights;            // [G][dim / 32][kChunk]
  std::vector<float> step;                 // [dim / 32]
  float corr[kMaxGroup];                   // what the running accumulators are multiplied by
};

// acc + VPMADDWD(a, b) in place: through the intrinsics GCC summed a block's 8 products as a tree, every
// product held on the stack until the end.
PAGEDSERVE_INLINE __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
  __m256i product;
  asm("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(product) : "x"(a), "x"(b));
  return acc;
}

// The lanes VPHADDD leaves 8 slots (or values) in: its 128-bit halves interleave its two operands. The
// permutation is its own inverse, so the same vector restores the order.
PAGEDSERVE_INLINE __m256i hadd_order() { return _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); }

// The 16 values of the 16 bytes at p as int16: q8_0's int8, or q4_0's low (`high` false) or high nibbles less 8.
template <class C>
PAGEDSERVE_INLINE __m256i widen(const uint8_t* p, bool high = false) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kQ8<C>) return _mm256_cvtepi8_epi16(x);
  const __m256i y = _mm256_cvtepu8_epi16(x);
  const __m256i nibbles = high ? _mm256_srli_epi16(y, 4) : _mm256_and_si256(y, _mm256_set1_epi16(0x0F));
  return _mm256_sub_epi16(nibbles, _mm256_set1_epi16(8));
}

// The 4 int16 at p in every 64-bit lane.
PAGEDSERVE_INLINE __m256i broadcast4(const int16_t* p) {
  int64_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi64x(four);
}

PAGEDSERVE_INLINE void prefetch(const uint8_t* ahead, int64_t offset) {
  if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + offset), _MM_HINT_T1);
}

// The 16 fp16 scales of a tile's block b from slot `first` (8 of them) as fp32.
PAGEDSERVE_INLINE __m256 scales(const uint8_t* tile, int64_t b, int first) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + kv_quant::scale_of(b, first))));
}

// Lanes j < n of 8 as all ones bits (a mask: NaN * 0 would be NaN).
PAGEDSERVE_INLINE __m256 first_lanes(int n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}

// The scaled scores of slots 8 * half .. 8 * half + 7 of tile t for G heads from h into s.scores (slot order;
// slots from c.n on -inf), the tile two chunks on prefetched a K row per row read.
template <class C, int G>
PAGEDSERVE_INLINE void score_half(const Queries& q, int64_t h, const Chunk& c, int t, int half, int64_t dim,
                                  Scratch& s) {
  const int64_t blocks = dim / kBlock;
  const uint8_t* tile = c.k[t];
  __m256 sc[G];
  for (int g = 0; g < G; ++g) sc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i lo[G], hi[G];      // slots 0-3 and 4-7 of the half, two partial sums each
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
    // values 4r .. 4r + 3 of the block: q8_0's K row r; q4_0's row r % 4, its low nibbles then its high ones
    for (int r = 0; r < 8; ++r) {
      const int64_t at = kv_quant::k_row<C>(dim, b, kQ8<C> ? r : r % 4);
      const bool high = !kQ8<C> && r >= 4;
      if (half == 0 && !high) prefetch(c.k_ahead[t], at);
      const __m256i k0 = widen<C>(tile + at + half * 32, high), k1 = widen<C>(tile + at + half * 32 + 16, high);
      for (int g = 0; g < G; ++g) {
        const __m256i w = broadcast4(q.values.data() + (h + g) * dim + b * kBlock + 4 * r);
        lo[g] = madd_add(lo[g], k0, w);
        hi[g] = madd_add(hi[g], k1, w);
      }
    }
    const __m256 dk = _mm256_permutevar8x32_ps(scales(tile, b, half * 8), hadd_order());
    for (int g = 0; g < G; ++g)
      sc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[g], hi[g])),
                              _mm256_mul_ps(dk, _mm256_set1_ps(q.scale[(h + g) * blocks + b])), sc[g]);
  }
  const __m256 real = first_lanes(c.n - t * kTile - half * 8);
  for (int g = 0; g < G; ++g)
    _mm256_store_ps(s.scores[g] + t * kTile + half * 8,
                    _mm256_blendv_ps(_mm256_set1_ps(attention::kNegInf),
                                     _mm256_permutevar8x32_ps(sc[g], hadd_order()), real));
}

// The online-softmax update of G heads over a chunk's scores (`vectors` of 8 slots; slots from c.n on -inf):
// the running max and sum, s.corr, and per head and value block the weights exp(score - max) times the
// block's scales, as int16 in steps of the chunk's largest scale of that block (s.step).
template <int G>
PAGEDSERVE_INLINE void weigh_chunk(const Chunk& c, int vectors, int64_t blocks, float* run_max, float* run_sum,
                                   Scratch& s) {
  for (int g = 0; g < G; ++g) {
    __m256 top = _mm256_load_ps(s.scores[g]);
    for (int i = 1; i < vectors; ++i) top = _mm256_max_ps(top, _mm256_load_ps(s.scores[g] + 8 * i));
    const float m = std::max(run_max[g], simd::Avx2::hmax(top));
    s.corr[g] = simd::exp_nonpositive<simd::Scalar>(run_max[g] - m);    // 0 on the first chunk (-inf)
    __m256 total = _mm256_setzero_ps();
    for (int i = 0; i < vectors; ++i) {
      const __m256 e = simd::exp_nonpositive<simd::Avx2>(_mm256_sub_ps(_mm256_load_ps(s.scores[g] + 8 * i),
                                                                      _mm256_set1_ps(m)));
      _mm256_store_ps(s.scores[g] + 8 * i, e);
      total = _mm256_add_ps(total, e);
    }
    run_sum[g] = run_sum[g] * s.corr[g] + simd::Avx2::sum(total);
    run_max[g] = m;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 d[2 * kChunkTiles];
    __m256 top = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int i = 0; i < vectors; ++i) {        // slots past n weigh nothing
      d[i] = _mm256_and_ps(scales(c.v[i / 2], b, i % 2 * 8), first_lanes(c.n - 8 * i));
      top = _mm256_max_ps(top, _mm256_and_ps(d[i], magnitude));
    }
    const float largest = simd::Avx2::hmax(top);
    s.step[b] = largest / kWeightSteps;
    const __m256 inv = _mm256_set1_ps(largest > 0.f ? kWeightSteps / largest : 0.f);
    for (int i = 0; i < vectors; ++i) d[i] = _mm256_mul_ps(d[i], inv);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < vectors; i += 2) {   // packs interleaves the 128-bit halves; the permute restores them
        const __m256i w0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(s.scores[g] + 8 * i), d[i]));
        const __m256i w1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(s.scores[g] + 8 * i + 8), d[i + 1]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.weights.data() + (g * blocks + b) * kChunk + 8 * i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(w0, w1), 0xD8));
      }
  }
}

// acc[g][values 16 * row .. 16 * row + 15] = acc * corr[g] + step * the sum over the chunk's slots of weight *
// value, for the G heads: per 16 bytes (4 values of 4 slots) one VPMADDWD per head with the 4 slots' weights;
// the tiles two chunks on prefetched a V row per row read. Those values are q8_0's V row `row`, q4_0's low
// (even `row`) or high nibbles of V row row / 2.
template <class C, int G>
PAGEDSERVE_INLINE void add_row(const Chunk& c, int tiles, int64_t row, int64_t dim, const Scratch& s, float* acc) {
  const int64_t b = row / 2, blocks = dim / kBlock;
  for (int part = 0; part < 2; ++part) {        // values 8 * part .. 8 * part + 7 of the row's 16
    __m256i lo[G], hi[G];
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
    for (int t = 0; t < tiles; ++t)
      for (int quad = 0; quad < kTile / 4; ++quad) {
        const int64_t at = kv_quant::v_row(dim, kQ8<C> ? row : b, quad);
        const bool high = !kQ8<C> && row % 2;
        if (part == 0 && !high) prefetch(c.v_ahead[t], at);
        const __m256i x0 = widen<C>(c.v[t] + at + part * 32, high), x1 = widen<C>(c.v[t] + at + part * 32 + 16, high);
        for (int g = 0; g < G; ++g) {
          const __m256i w = broadcast4(s.weights.data() + (g * blocks + b) * kChunk + t * kTile + 4 * quad);
          lo[g] = madd_add(lo[g], x0, w);
          hi[g] = madd_add(hi[g], x1, w);
        }
      }
    for (int g = 0; g < G; ++g) {
      float* out = acc + g * dim + row * 16 + part * 8;
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo[g], hi[g]), hadd_order()));
      _mm256_storeu_ps(out, _mm256_fmadd_ps(sum, _mm256_set1_ps(s.step[b]),
                                            _mm256_mul_ps(_mm256_loadu_ps(out), _mm256_set1_ps(s.corr[g]))));
    }
  }
}

// A chunk of one kv head against G of its query heads (those from h of q), with the online-softmax update of
// their running max / sum / accumulators (acc: [G, dim] in order, head h's first).
template <class C, int G>
void attend_chunk(const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum, const Chunk& c,
                  int64_t dim, Scratch& s) {
  const int tiles = (c.n + kTile - 1) / kTile, vectors = (c.n + 7) / 8;
  const int64_t blocks = dim / kBlock;
  for (int t = 0; t < tiles; ++t) {
    for (int at = 0; at < kv_quant::values_of(dim); at += kv_quant::kRow) {   // the scales' lines
      prefetch(c.k_ahead[t], at);
      prefetch(c.v_ahead[t], at);
    }
    for (int half = 0; half < 2 && 16 * t + 8 * half < c.n; ++half) score_half<C, G>(q, h, c, t, half, dim, s);
  }
  s.weights.resize(G * blocks * kChunk);
  s.step.resize(blocks);
  weigh_chunk<G>(c, vectors, blocks, run_max, run_sum, s);
  if (vectors % 2)            // a chunk ending mid-tile: the last half tile's weights are 0
    for (int g = 0; g < G; ++g)
      for (int64_t b = 0; b < blocks; ++b)
        std::fill_n(s.weights.data() + (g * blocks + b) * kChunk + 8 * vectors, 8, int16_t{0});
  for (int64_t row = 0; row < dim / 16; ++row) add_row<C, G>(c, tiles, row, dim, s, acc);
}

// attend_chunk for 1 to kMaxGroup query heads of (a part of) a GQA group.
template <class C>
void attend_group(int group, const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum,
                  const Chunk& c, int64_t dim, Scratch& s) {
  simd::with_group<kMaxGroup>(group, [&](auto g) {
    attend_chunk<C, decltype(g)::value>(q, h, acc, run_max, run_sum, c, dim, s);
  });
}

}  // namespace pagedserve_cpu::attention_int16

#endif

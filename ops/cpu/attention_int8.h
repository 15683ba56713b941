// The decode attention for q8_0 / q4_0 caches on CPUs with AVX-512 VNNI (ops/cpu/paged_attention.cpp's
// run_chunks calls it; attention_int16.h serves AVX2 CPUs, attention_quant.h the rest). It reads a
// cache's tiles (kv_quant.h, ops/kv_quant.py) with integer dot products, a chunk of up to 4 tiles (64 slots)
// of one kv head at a time, with one softmax update per chunk:
//  - scores: VPDPBUSD, 64 byte products per instruction: a K row is 4 values of each of 16 slots, so one
//    instruction against 4 query values broadcast gives 16 slots' partial scores, one per 32-bit lane, with no
//    transposes. The (rotated) query is rounded to int8 per 32-value block as a q8_0 key is (see Queries).
//  - values: VPDPBUSD again: a V row is 16 values of 4 slots, so one instruction against the 4 slots' softmax
//    weights (as integers) adds their products into 16 output lanes. Weights are taken relative to the chunk's
//    own largest score (the chunk's share of the softmax is a factor applied once), times the value blocks'
//    scales, in steps of the chunk's largest scale, as two planes of bytes (two instructions per row, where one
//    plane of 8 bits added about as much error as q8_0's own rounding gives the attention): q8_0's 16 unsigned
//    bits against its signed values; q4_0's 15 bits and a sign (its scales may be negative) against its
//    nibbles, values + 8, the offset taken off once per chunk.
// The operand that is the same in all 16 lanes (4 query values, 4 slots' weights) is broadcast into a register
// first: VPDPBUSD broadcasting from memory itself ran ~1.35x slower here.
// A chunk's tiles are read in memory order, each from its first byte to its last, while the same tiles two
// chunks ahead are prefetched into L2 one 64-byte row per row read.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "simd.h"

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_INT8_DOT 1

namespace pagedserve_cpu::attention_int8 {

using namespace pagedserve_cpu::simd;
using kv_quant::Chunk;
using kv_quant::kBlock;
using kv_quant::kChunk;
using kv_quant::kChunkTiles;
using kv_quant::kQ8;
using kv_quant::kTile;

constexpr int kMaxGroup = 8;                  // query heads per pass over a chunk; larger GQA groups take several
constexpr int64_t kMaxBlocks = 8;             // 32-value blocks per head (head_dim <= 256; larger ones: fp32 kernel)
constexpr float kMasked = -1e30f;             // a score past the chunk's end: finite, so 2^(it - max) is 0

// A row's queries as the scores read them: per query head, its (rotated) values as int8, round(x / d) with
// d = amax / 127 per 32-value block (as llama.cpp scores q8_0 keys), and per block the scale that turns the
// integer dot products into a score (d times the softmax scale) and the integer the keys' offset adds (q8_0
// keys are read as k + 128, q4_0 nibbles as k + 8).
struct Queries {
  std::vector<int8_t> values;    // [heads, dim]
  std::vector<float> scale;      // [heads, dim / 32]
  std::vector<int32_t> offset;   // [heads, dim / 32]: -(key offset) * the sum of the block's values
};

// acc + the dot products of VPDPBUSD (u: unsigned bytes, v: signed), in place: through the intrinsic GCC 12
// copied every accumulator before each instruction and back after it.
PAGEDSERVE_INLINE __m512i dot_u8s8(__m512i acc, __m512i u, __m512i v) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(v));
  return acc;
}

// What the keys' unsigned bytes are read with added: q8_0's int8 as v + 128, q4_0's nibbles as they are.
template <class C>
constexpr int32_t kOffset = kQ8<C> ? 128 : 8;
// The weights' range and the bits of their low plane: q8_0 16 unsigned bits (its scales are never negative;
// the weights are the unsigned operand), q4_0 15 bits and a sign (the signed operand: a signed high byte and
// a low one of 7 bits).
template <class C>
constexpr float kWeightSteps = kQ8<C> ? 65535.f : 16383.f;
template <class C>
constexpr int kPlaneBits = kQ8<C> ? 8 : 7;

// A K (or q4_0 V) row's 64 bytes as unsigned: q8_0's int8 + 128; q4_0's low (`high` false) or high nibbles.
template <class C>
PAGEDSERVE_INLINE __m512i unsigned_row(const uint8_t* p, bool high = false) {
  const __m512i x = _mm512_loadu_si512(p);
  if constexpr (kQ8<C>) return _mm512_xor_si512(x, _mm512_set1_epi8(-128));
  const __m512i mask = _mm512_set1_epi8(0x0F);
  return high ? _mm512_and_si512(_mm512_srli_epi16(x, 4), mask) : _mm512_and_si512(x, mask);
}

// x: [heads, dim] fp32 queries, already rotated.
template <class C>
void quantize_queries(const float* x, int64_t heads, int64_t dim, float softmax_scale, Queries& out) {
  const int64_t blocks = dim / kBlock;
  out.values.resize(heads * dim);
  out.scale.resize(heads * blocks);
  out.offset.resize(heads * blocks);
  for (int64_t hb = 0; hb < heads * blocks; ++hb) {
    const __m512 a = _mm512_loadu_ps(x + hb * kBlock), b = _mm512_loadu_ps(x + hb * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, inv = d == 0.f ? 0.f : 1.f / d;
    // round half to even, as std::nearbyint and torch.round do
    const auto round = [&](__m512 v) {
      return _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    };
    const __m512i ya = round(a), yb = round(b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values.data() + hb * kBlock), _mm512_cvtsepi32_epi8(ya));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values.data() + hb * kBlock + 16), _mm512_cvtsepi32_epi8(yb));
    out.scale[hb] = d * softmax_scale;
    out.offset[hb] = -kOffset<C> * _mm512_reduce_add_epi32(_mm512_add_epi32(ya, yb));
  }
}

// Per thread: a chunk's scores, and the integer weights of its values, per head, block and plane (high,
// low): 64 bytes whose 32-bit word 4q + t holds the weights of slots 4q .. 4q + 3 of the chunk's tile t.
struct Scratch {
  alignas(64) float scores[kMaxGroup][kChunk];
  alignas(64) uint8_t weights[kMaxGroup][kMaxBlocks][2][kChunk];
  float corr[kMaxGroup];   // what the running accumulators are multiplied by
  float share[kMaxGroup];  // what the chunk's sums are multiplied by (its max against the running max)
};

PAGEDSERVE_INLINE __mmask16 first_lanes(int n) {
  return static_cast<__mmask16>(n >= kTile ? 0xFFFF : (1u << std::max(n, 0)) - 1);
}

// Prefetches the 64-byte row at `offset` of a tile two chunks ahead (nothing past the row's end).
PAGEDSERVE_INLINE void prefetch_row(const uint8_t* ahead, int64_t offset) {
  if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + offset), _MM_HINT_T1);
}

// Prefetches the scales of a tile two chunks ahead: all their lines (128 bytes at head_dim 128), since a line
// left out is a miss to memory on every tile.
PAGEDSERVE_INLINE void prefetch_scales(const uint8_t* ahead, int64_t dim) {
  for (int64_t at = 0; at < kv_quant::values_of(dim); at += kv_quant::kRow) prefetch_row(ahead, at);
}

// The scaled scores of T tiles (from tile t0 of the chunk) for G query heads from h: per 32-value block, the K
// rows' dot products with the query's int8 values in int32 lanes, then times the keys' and the query's scales.
template <class C, int G, int T>
PAGEDSERVE_INLINE void score_tiles(const Queries& q, int64_t h, const Chunk& c, int t0, int64_t dim,
                                   __m512 (&sc)[T][G]) {
  const int64_t blocks = dim / kBlock;
  for (int t = 0; t < T; ++t)
    for (int g = 0; g < G; ++g) sc[t][g] = _mm512_setzero_ps();
  for (int t = 0; t < T; ++t) prefetch_scales(c.k_ahead[t0 + t], dim);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[T][G];
    for (int g = 0; g < G; ++g) {
      const __m512i start = _mm512_set1_epi32(q.offset[(h + g) * blocks + b]);
      for (int t = 0; t < T; ++t) dot[t][g] = start;
    }
    const int8_t* qv = q.values.data() + h * dim + b * kBlock;
    // K row r: q8_0 values 4r .. 4r + 3 of the block; q4_0 nibble pairs 4r .. 4r + 3 (values 4r + i, 16 + 4r + i)
    for (int r = 0; r < (kQ8<C> ? 8 : 4); ++r) {
      const int64_t at = kv_quant::k_row<C>(dim, b, r);
      for (int half = 0; half < (kQ8<C> ? 1 : 2); ++half) {
        __m512i key[T];
        for (int t = 0; t < T; ++t) {
          if (half == 0) prefetch_row(c.k_ahead[t0 + t], at);
          key[t] = unsigned_row<C>(c.k[t0 + t] + at, half);
        }
        for (int g = 0; g < G; ++g) {
          const __m512i w = broadcast_word(qv + g * dim + 16 * half + 4 * r);
          for (int t = 0; t < T; ++t) dot[t][g] = dot_u8s8(dot[t][g], key[t], w);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 dk = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.k[t0 + t] + kv_quant::scale_of(b, 0))));
      for (int g = 0; g < G; ++g)
        sc[t][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][g]),
                                   _mm512_mul_ps(dk, _mm512_set1_ps(q.scale[(h + g) * blocks + b])), sc[t][g]);
    }
  }
}

// 2^t for finite t (the softmax's t <= 0, up to rounding): t = n + f with n an integer and |f| <= 1/2, 2^f by
// a polynomial fitted here (relative error 2.9e-6, a fifth of the weights' 16-bit step), 2^n by VSCALEFPS
// (0 far below: a masked slot's kMasked needs no clamp; under FlushDenormals no slow path either).
PAGEDSERVE_INLINE __m512 exp2_scalef(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.5828473732e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5906438943e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024098819e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312419112e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
constexpr float kLog2e = 1.44269504088896341f;

// G heads' softmax update over a chunk's scores (s.scores, slots from c.n on masked) and the integer weights
// of its values: the running max and sum, s.corr and s.share; per head and block the weights
// exp(score - the chunk's max) (at most 1) times the block's scale, in steps of the chunk's largest such
// scale / kWeightSteps (step[b] gets each block's step), as 16 bits split into s.weights' two planes.
template <class C, int G>
PAGEDSERVE_INLINE void weigh_chunk(Scratch& s, const Chunk& c, int tiles, int64_t blocks, float* run_max,
                                   float* run_sum, float* step) {
  __m512 scale[kMaxBlocks][kChunkTiles];    // the blocks' scales of each tile in steps of their block's largest
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 top = _mm512_setzero_ps();
    for (int t = 0; t < kChunkTiles; ++t) {
      // slots past the chunk's end (whatever their scales hold) and absent tiles weigh nothing
      scale[b][t] = t < tiles ? _mm512_maskz_mov_ps(first_lanes(c.n - t * kTile),
                                                    _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                        c.v[t] + kv_quant::scale_of(b, 0)))))
                              : _mm512_setzero_ps();
      top = _mm512_max_ps(top, _mm512_abs_ps(scale[b][t]));
    }
    const float largest = _mm512_reduce_max_ps(top);
    step[b] = largest / kWeightSteps<C>;
    const __m512 inv = _mm512_set1_ps(largest == 0.f ? 0.f : kWeightSteps<C> / largest);
    for (int t = 0; t < kChunkTiles; ++t) scale[b][t] = _mm512_mul_ps(scale[b][t], inv);
  }
  alignas(64) float top[16] = {}, old[16] = {}, now[16] = {};
  for (int g = 0; g < G; ++g) {
    __m512 m = _mm512_load_ps(s.scores[g]);
    for (int t = 1; t < tiles; ++t) m = _mm512_max_ps(m, _mm512_load_ps(s.scores[g] + t * kTile));
    top[g] = _mm512_reduce_max_ps(m);
    old[g] = run_max[g];
    now[g] = std::max(old[g], top[g]);
  }
  // both factors at once for all heads (old is -inf on the first chunk: clamped, its correction is 2^-126)
  const __m512 m = _mm512_load_ps(now);
  alignas(64) float corr[16], share[16];
  const auto exp_of = [&](const float* x) {
    return exp2_scalef(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(x), m), _mm512_set1_ps(kLog2e)),
                                      _mm512_set1_ps(-126.f)));
  };
  _mm512_store_ps(corr, exp_of(old));
  _mm512_store_ps(share, exp_of(top));
  for (int g = 0; g < G; ++g) {
    __m512 e[kChunkTiles], total = _mm512_setzero_ps();
    for (int t = 0; t < kChunkTiles; ++t) {
      e[t] = t < tiles ? exp2_scalef(_mm512_fmadd_ps(_mm512_load_ps(s.scores[g] + t * kTile), _mm512_set1_ps(kLog2e),
                                                     _mm512_set1_ps(-top[g] * kLog2e)))
                       : _mm512_setzero_ps();
      total = _mm512_add_ps(total, e[t]);
    }
    s.corr[g] = corr[g];
    s.share[g] = share[g];
    run_sum[g] = run_sum[g] * corr[g] + share[g] * _mm512_reduce_add_ps(total);
    run_max[g] = now[g];
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i w[kChunkTiles];
      for (int t = 0; t < kChunkTiles; ++t) w[t] = _mm512_cvtps_epi32(_mm512_mul_ps(e[t], scale[b][t]));
      // as 16 bits, split into the planes (w >> kPlaneBits, the low bits), as bytes: 128-bit lane q of the
      // packs holds tile 0's slots 4q .. 4q + 3, then tile 1's, 2's, 3's
      const __m512i w01 = kQ8<C> ? _mm512_packus_epi32(w[0], w[1]) : _mm512_packs_epi32(w[0], w[1]);
      const __m512i w23 = kQ8<C> ? _mm512_packus_epi32(w[2], w[3]) : _mm512_packs_epi32(w[2], w[3]);
      const __m512i low = _mm512_set1_epi16((1 << kPlaneBits<C>) - 1);
      const __m512i h01 = kQ8<C> ? _mm512_srli_epi16(w01, 8) : _mm512_srai_epi16(w01, kPlaneBits<C>);
      const __m512i h23 = kQ8<C> ? _mm512_srli_epi16(w23, 8) : _mm512_srai_epi16(w23, kPlaneBits<C>);
      const __m512i l01 = _mm512_and_si512(w01, low), l23 = _mm512_and_si512(w23, low);
      _mm512_store_si512(s.weights[g][b][0], kQ8<C> ? _mm512_packus_epi16(h01, h23) : _mm512_packs_epi16(h01, h23));
      _mm512_store_si512(s.weights[g][b][1], kQ8<C> ? _mm512_packus_epi16(l01, l23) : _mm512_packs_epi16(l01, l23));
    }
  }
}

// acc[g][values of block b] = acc * corr[g] + step[b] * share[g] * the sum over the chunk's slots of weight *
// value, for the P heads from g0: per V row (16 values of 4 slots) one VPDPBUSD per head and weight plane with
// the 4 slots' weights broadcast.
template <class C, int P>
PAGEDSERVE_INLINE void add_values(const Scratch& s, const Chunk& c, int g0, int tiles, int64_t blocks,
                                  const float* step, int64_t dim, float* acc) {
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i lo_h[P], lo_l[P], hi_h[P], hi_l[P];   // values 32b .. 32b + 15, 32b + 16 .. 32b + 31; weight planes
    for (int g = 0; g < P; ++g) lo_h[g] = lo_l[g] = hi_h[g] = hi_l[g] = _mm512_setzero_si512();
    for (int t = 0; t < tiles; ++t)
      for (int quad = 0; quad < kTile / 4; ++quad) {
        // values 32b .. 32b + 15 and 32b + 16 .. 32b + 31: q8_0's V rows 2b and 2b + 1, q4_0's row b's nibbles
        const int64_t at_lo = kv_quant::v_row(dim, kQ8<C> ? 2 * b : b, quad);
        const int64_t at_hi = kQ8<C> ? kv_quant::v_row(dim, 2 * b + 1, quad) : at_lo;
        if (g0 == 0) {
          prefetch_row(c.v_ahead[t], at_lo);
          if constexpr (kQ8<C>) prefetch_row(c.v_ahead[t], at_hi);
        }
        __m512i x, y;            // q8_0's signed values as they are, q4_0's nibbles
        if constexpr (kQ8<C>) {
          x = _mm512_loadu_si512(c.v[t] + at_lo);
          y = _mm512_loadu_si512(c.v[t] + at_hi);
        } else {
          x = unsigned_row<C>(c.v[t] + at_lo);
          y = unsigned_row<C>(c.v[t] + at_hi, true);
        }
        for (int g = 0; g < P; ++g) {
          const __m512i wh = broadcast_word(s.weights[g0 + g][b][0] + 16 * quad + 4 * t);
          const __m512i wl = broadcast_word(s.weights[g0 + g][b][1] + 16 * quad + 4 * t);
          if constexpr (kQ8<C>) {
            lo_h[g] = dot_u8s8(lo_h[g], wh, x);
            lo_l[g] = dot_u8s8(lo_l[g], wl, x);
            hi_h[g] = dot_u8s8(hi_h[g], wh, y);
            hi_l[g] = dot_u8s8(hi_l[g], wl, y);
          } else {
            lo_h[g] = dot_u8s8(lo_h[g], x, wh);
            lo_l[g] = dot_u8s8(lo_l[g], x, wl);
            hi_h[g] = dot_u8s8(hi_h[g], y, wh);
            hi_l[g] = dot_u8s8(hi_l[g], y, wl);
          }
        }
      }
    for (int g = 0; g < P; ++g) {
      // the high plane's sums shifted up onto the low one's (at most 64 * 255 * 128 * 256: within int32); q4_0
      // less 8 times the sum of the weights
      __m512i off = _mm512_setzero_si512();
      if constexpr (!kQ8<C>) {
        const __m512i ones = _mm512_set1_epi8(1);
        const __m512i sums = _mm512_add_epi32(
            _mm512_slli_epi32(dot_u8s8(_mm512_setzero_si512(), ones, _mm512_load_si512(s.weights[g0 + g][b][0])),
                              kPlaneBits<C>),
            dot_u8s8(_mm512_setzero_si512(), ones, _mm512_load_si512(s.weights[g0 + g][b][1])));
        off = _mm512_set1_epi32(kOffset<C> * _mm512_reduce_add_epi32(sums));
      }
      const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(lo_h[g], kPlaneBits<C>), lo_l[g]), off);
      const __m512i e = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi_h[g], kPlaneBits<C>), hi_l[g]), off);
      float* out = acc + (g0 + g) * dim + b * kBlock;
      const __m512 keep = _mm512_set1_ps(s.corr[g0 + g]), add = _mm512_set1_ps(step[b] * s.share[g0 + g]);
      _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), add, _mm512_mul_ps(_mm512_loadu_ps(out), keep)));
      _mm512_storeu_ps(out + 16,
                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), add, _mm512_mul_ps(_mm512_loadu_ps(out + 16), keep)));
    }
  }
}

// A chunk of one kv head against G of its query heads (those from h of q), with the online-softmax update of
// the heads' running max / sum / accumulators (acc [G, dim] in order: the pointer is to head h's). Scores
// take two tiles at a time where the registers hold both (their dot products interleave), else one.
template <class C, int G>
void attend_chunk(const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum, const Chunk& c,
                  int64_t dim, Scratch& s) {
  constexpr int T = G <= 6 ? 2 : 1;
  const int tiles = (c.n + kTile - 1) / kTile;
  for (int t0 = 0; t0 < tiles; t0 += T) {
    __m512 sc[T][G];
    if (T == 2 && t0 + 1 == tiles) {      // an odd last tile alone
      __m512 one[1][G];
      score_tiles<C, G, 1>(q, h, c, t0, dim, one);
      for (int g = 0; g < G; ++g) sc[0][g] = one[0][g];
    } else {
      score_tiles<C, G, T>(q, h, c, t0, dim, sc);
    }
    for (int t = 0; t < std::min(T, tiles - t0); ++t) {
      const __mmask16 real = first_lanes(c.n - (t0 + t) * kTile);
      for (int g = 0; g < G; ++g)
        _mm512_store_ps(s.scores[g] + (t0 + t) * kTile, _mm512_mask_mov_ps(_mm512_set1_ps(kMasked), real, sc[t][g]));
    }
  }
  float step[kMaxBlocks];
  const int64_t blocks = dim / kBlock;
  weigh_chunk<C, G>(s, c, tiles, blocks, run_max, run_sum, step);
  // the values' accumulators of up to 4 heads fit the registers (4 a head: GCC spilled all of them every
  // step for 6); more take two passes over the chunk's values, the second from L1
  constexpr int P = G <= 4 ? G : (G + 1) / 2;
  for (int t = 0; t < tiles; ++t) prefetch_scales(c.v_ahead[t], dim);
  add_values<C, P>(s, c, 0, tiles, blocks, step, dim, acc);
  if constexpr (P < G) add_values<C, G - P>(s, c, P, tiles, blocks, step, dim, acc);
}

// attend_chunk for the 1 to kMaxGroup query heads of (a part of) a GQA group.
template <class C>
void attend_group(int group, const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum,
                  const Chunk& c, int64_t dim, Scratch& s) {
  with_group<kMaxGroup>(group, [&](auto g) {
    attend_chunk<C, decltype(g)::value>(q, h, acc, run_max, run_sum, c, dim, s);
  });
}

}  // namespace pagedserve_cpu::attention_int8

#endif

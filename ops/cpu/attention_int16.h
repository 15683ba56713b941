// The decode attention for q8_0 caches on AVX2 CPUs without AVX-512 VNNI (paged_attention.cpp's run_quant
// calls it for the Avx2 set; attention_int8.h serves VNNI CPUs, attention_quant.h the other sets and q4_0).
// It reads the same tiles (kv_quant.h) tile by tile, with VPMADDWD: the int8 bytes widened to int16 and
// multiplied in pairs into int32 lanes, where the fp32 kernel converted every byte to a float and spent one
// FMA per byte and head.
//  - scores: 16 bytes of a K row are 4 values of 4 slots; against 4 values of the (rotated) query, rounded to
//    int8 per 32-value block as a q8_0 key is (attention_int8.h's Queries, here as int16), VPMADDWD gives each
//    slot two partial sums, folded by one VPHADDD per 8 slots at the block's end, then times the block's
//    scales. Signed by signed: no offsets.
//  - values: 16 bytes of a V row are 4 values of 4 slots; against the 4 slots' softmax weights as int16
//    (relative to the tile's max as the softmax gives them, times the value blocks' scales in steps of the
//    largest: 15 bits), VPMADDWD gives each value two partial sums, folded the same way.
// The softmax itself is the fp32 kernels' (attention_tile.h's softmax_tile).
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

using kv_quant::kBlock;
using kv_quant::kTile;
using kv_quant::Q8_0;

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

// Per thread: a tile's weights per head and block, as int16 for 16 slots, and each block's step.
struct Scratch {
  attention::Scratch<simd::Avx2> tile;     // the softmax's weights and corrections
  std::vector<int16_t> weights;            // [G][dim / 32][kTile]
  std::vector<float> step;                 // [dim / 32]
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

// 16 int8 at p as int16.
PAGEDSERVE_INLINE __m256i widen(const uint8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 4 int16 at p in every 64-bit lane.
PAGEDSERVE_INLINE __m256i broadcast4(const int16_t* p) {
  int64_t four;
  std::memcpy(&four, p, sizeof four);
  return _mm256_set1_epi64x(four);
}

// The scaled scores of slots 8 * half .. 8 * half + 7 of a tile for G heads from h, in slot order.
template <int G>
PAGEDSERVE_INLINE void score_half(const Queries& q, int64_t h, const uint8_t* tile, int half, int64_t dim,
                                  __m256 (&sc)[G]) {
  const int64_t blocks = dim / kBlock;
  for (int g = 0; g < G; ++g) sc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i lo[G], hi[G];      // slots 0-3 and 4-7 of the half, two partial sums each
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
    for (int r = 0; r < 8; ++r) {
      const uint8_t* row = tile + kv_quant::k_row<Q8_0>(dim, b, r) + half * 32;
      const __m256i k0 = widen(row), k1 = widen(row + 16);
      for (int g = 0; g < G; ++g) {
        const __m256i w = broadcast4(q.values.data() + (h + g) * dim + b * kBlock + 4 * r);
        lo[g] = madd_add(lo[g], k0, w);
        hi[g] = madd_add(hi[g], k1, w);
      }
    }
    const __m256 dk = _mm256_permutevar8x32_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + kv_quant::scale_of(b, half * 8)))),
        hadd_order());
    for (int g = 0; g < G; ++g)
      sc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[g], hi[g])),
                              _mm256_mul_ps(dk, _mm256_set1_ps(q.scale[(h + g) * blocks + b])), sc[g]);
  }
  for (int g = 0; g < G; ++g) sc[g] = _mm256_permutevar8x32_ps(sc[g], hadd_order());
}

// The softmax weights s.tile.p of G heads times the value blocks' scales, as int16 in steps of each block's
// largest scale (s.step[b]); slots from len on weigh nothing, whatever their scales hold.
template <int G>
PAGEDSERVE_INLINE void weigh_tile(const uint8_t* v_tile, int len, int64_t blocks, Scratch& s) {
  alignas(32) int32_t keep[kTile];      // all bits set for the slots that count (a mask: NaN * 0 is NaN)
  for (int j = 0; j < kTile; ++j) keep[j] = j < len ? -1 : 0;
  const __m256 keep0 = _mm256_load_ps(reinterpret_cast<const float*>(keep));
  const __m256 keep1 = _mm256_load_ps(reinterpret_cast<const float*>(keep + 8));
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = v_tile + kv_quant::scale_of(b, 0);
    const __m256 d0 = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))), keep0);
    const __m256 d1 =
        _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16))), keep1);
    const float largest = simd::Avx2::hmax(_mm256_max_ps(d0, d1));     // q8_0 scales are never negative
    s.step[b] = largest / kWeightSteps;
    const __m256 inv = _mm256_set1_ps(largest > 0.f ? kWeightSteps / largest : 0.f);
    const __m256 s0 = _mm256_mul_ps(d0, inv), s1 = _mm256_mul_ps(d1, inv);
    for (int g = 0; g < G; ++g) {
      const float* p = s.tile.p + g * kTile;
      const __m256i w0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(p), s0));
      const __m256i w1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(p + 8), s1));
      // packs interleaves the 128-bit halves; the permute puts slots back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.weights.data() + (g * blocks + b) * kTile),
                         _mm256_permute4x64_epi64(_mm256_packs_epi32(w0, w1), 0xD8));
    }
  }
}

// acc[g][values of V row `row`] = acc * corr[g] + step * the sum over the tile's slots of weight * value, for
// the G heads: per 16 bytes (4 values of 4 slots) one VPMADDWD per head with the 4 slots' weights.
template <int G>
PAGEDSERVE_INLINE void add_row(const uint8_t* v_tile, int64_t row, int64_t dim, const Scratch& s, float* acc) {
  const int64_t b = row / 2, blocks = dim / kBlock;
  const float step = s.step[b];
  for (int part = 0; part < 2; ++part) {        // values 8 * part .. 8 * part + 7 of the row's 16
    __m256i lo[G], hi[G];
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
    for (int quad = 0; quad < kTile / 4; ++quad) {
      const uint8_t* p = v_tile + kv_quant::v_row(dim, row, quad) + part * 32;
      const __m256i x0 = widen(p), x1 = widen(p + 16);
      for (int g = 0; g < G; ++g) {
        const __m256i w = broadcast4(s.weights.data() + (g * blocks + b) * kTile + 4 * quad);
        lo[g] = madd_add(lo[g], x0, w);
        hi[g] = madd_add(hi[g], x1, w);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* out = acc + g * dim + row * 16 + part * 8;
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo[g], hi[g]), hadd_order()));
      _mm256_storeu_ps(out, _mm256_fmadd_ps(sum, _mm256_set1_ps(step),
                                            _mm256_mul_ps(_mm256_loadu_ps(out), _mm256_set1_ps(s.tile.corr[g]))));
    }
  }
}

// `len` (<= kTile) slots of one tile of one kv head against G of its query heads (those from h of q), with the
// online-softmax update of their running max / sum / accumulators (acc: [G, dim] in order, head h's first).
template <int G>
void attend_tile(const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum, const uint8_t* k_tile,
                 const uint8_t* v_tile, int len, int64_t dim, Scratch& s) {
  __m256 sc[G][2];
  for (int half = 0; half < 2; ++half) {
    __m256 part[G];
    score_half<G>(q, h, k_tile, half, dim, part);
    for (int g = 0; g < G; ++g) sc[g][half] = part[g];
  }
  attention::softmax_tile<simd::Avx2, G, 2>(sc, len, run_max, run_sum, s.tile);
  const int64_t blocks = dim / kBlock;
  s.weights.resize(G * blocks * kTile);
  s.step.resize(blocks);
  weigh_tile<G>(v_tile, len, blocks, s);
  for (int64_t row = 0; row < dim / 16; ++row) add_row<G>(v_tile, row, dim, s, acc);
}

// attend_tile for 1 to kMaxGroup query heads of (a part of) a GQA group.
inline void attend_group(int group, const Queries& q, int64_t h, float* acc, float* run_max, float* run_sum,
                         const uint8_t* k_tile, const uint8_t* v_tile, int len, int64_t dim, Scratch& s) {
  switch (group) {
#define PAGEDSERVE_GROUP(G) \
  case G: return attend_tile<G>(q, h, acc, run_max, run_sum, k_tile, v_tile, len, dim, s);
    PAGEDSERVE_GROUP(1) PAGEDSERVE_GROUP(2) PAGEDSERVE_GROUP(3) PAGEDSERVE_GROUP(4)
    PAGEDSERVE_GROUP(5) PAGEDSERVE_GROUP(6)
#undef PAGEDSERVE_GROUP
  }
}

}  // namespace pagedserve_cpu::attention_int16

#endif

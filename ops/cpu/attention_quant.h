// The decode attention over the tiles of a q8_0 / q4_0 cache (kv_quant.h, ops/kv_quant.py) in fp32
// arithmetic, written once over the instruction sets of simd.h: it serves the sets the integer kernels do not
// (attention_int8.h on AVX-512 VNNI, attention_int16.h on the Avx2 set): AVX-512 CPUs without VNNI, the
// scalar set, and the tests' lanes 16 on VNNI CPUs. A tile's K order puts a slot in each
// 32-bit word, so W slots' scores come out in W lanes with no sums across lanes; its V order puts a value in
// each word, 4 slots in it, so each lane accumulates one output value. Scales multiply once per 32-value block:
// a block's scores are summed unscaled, then times the keys' scales; the softmax weights are multiplied by
// the values' scales before they weigh the values.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_tile.h"
#include "kv_quant.h"
#include "simd.h"

namespace pagedserve_cpu::attention_quant {

using namespace pagedserve_cpu::simd;
using attention::kMaxGroup;
using kv_quant::kBlock;
using kv_quant::kTile;

template <class S>
struct Scratch {
  attention::Scratch<S> tile;       // the softmax's weights and corrections
  std::vector<float> weights;       // [G][dim / 32][kTile]: weights times the values' scales
};

// The scaled scores of the tile's W-slot vector i: per 32-value block, each slot's byte (or nibble) c of a K
// row times the query value it meets, then times the block's scales.
template <class S, class F, int G>
PAGEDSERVE_INLINE void score_lanes(const float* q, const uint8_t* tile, int i, int64_t dim, float scale,
                                   typename S::V* sc) {
  using V = typename S::V;
  constexpr bool q8 = std::is_same_v<F, kv_quant::Q8_0>;
  for (int g = 0; g < G; ++g) sc[g] = S::zero();
  for (int64_t b = 0; b < dim / kBlock; ++b) {
    V part[G];
    for (int g = 0; g < G; ++g) part[g] = S::zero();
    for (int r = 0; r < (q8 ? 8 : 4); ++r) {
      const uint8_t* row = tile + kv_quant::k_row<F>(dim, b, r) + i * S::W * 4;
      for (int half = 0; half < (q8 ? 1 : 2); ++half)
        for (int c = 0; c < 4; ++c) {
          const V k = kv_quant::word_lanes<S, F>(row, c, half);
          const int64_t d = b * kBlock + 16 * half + 4 * r + c;
          for (int g = 0; g < G; ++g) part[g] = S::fmadd(k, S::set1(q[g * dim + d]), part[g]);
        }
    }
    const V dk = kv_quant::scale_lanes<S>(tile + kv_quant::scale_of(b, i * S::W));
    for (int g = 0; g < G; ++g) sc[g] = S::fmadd(part[g], dk, sc[g]);
  }
  for (int g = 0; g < G; ++g) sc[g] = S::mul(sc[g], S::set1(scale));
}

// `len` (<= kTile) slots of one tile of one kv head against G of its query heads (q: [G, dim] fp32, rotated),
// with the online-softmax update of their running max / sum / accumulators (acc: [G, dim] in order).
template <class S, class F, int G>
void attend_tile(const float* q, float* acc, float* run_max, float* run_sum, const uint8_t* k_tile,
                 const uint8_t* v_tile, int len, int64_t dim, float scale, Scratch<S>& s) {
  using V = typename S::V;
  constexpr int L = kTile / S::W;
  constexpr bool q8 = std::is_same_v<F, kv_quant::Q8_0>;
  const int64_t blocks = dim / kBlock;
  V sc[G][L];
  for (int i = 0; i < L; ++i) {
    V lanes[G];
    score_lanes<S, F, G>(q, k_tile, i, dim, scale, lanes);
    for (int g = 0; g < G; ++g) sc[g][i] = lanes[g];
  }
  attention::softmax_tile<S, G, L>(sc, len, run_max, run_sum, s.tile);
  s.weights.resize(kMaxGroup * blocks * kTile);
  for (int64_t b = 0; b < blocks; ++b)
    for (int i = 0; i < L; ++i) {
      const V dv = kv_quant::scale_lanes<S>(v_tile + kv_quant::scale_of(b, i * S::W));
      for (int g = 0; g < G; ++g)
        S::store(&s.weights[(g * blocks + b) * kTile + i * S::W], S::mul(S::load(s.tile.p + g * kTile + i * S::W), dv));
    }
  if (len < kTile)             // slots past the tile's end: weight 0 whatever their scales held
    for (int g = 0; g < G; ++g)
      for (int64_t b = 0; b < blocks; ++b) std::fill_n(&s.weights[(g * blocks + b) * kTile] + len, kTile - len, 0.f);
  // values 16r .. 16r + 15 (a V row of q8_0, the low or high nibbles of one of q4_0), W at a time
  for (int64_t r = 0; r < dim / 16; ++r) {
    const int64_t b = r / 2, d0 = r * 16, row = q8 ? r : b;
    const bool high = !q8 && r % 2;
    for (int at = 0; at < 16; at += S::W) {
      V out[G];
      for (int g = 0; g < G; ++g) out[g] = S::mul(S::load(acc + g * dim + d0 + at), S::set1(s.tile.corr[g]));
      for (int quad = 0; quad < kTile / 4; ++quad) {
        const uint8_t* words = v_tile + kv_quant::v_row(dim, row, quad) + at * 4;
        for (int c = 0; c < 4; ++c) {
          const V x = kv_quant::word_lanes<S, F>(words, c, high);
          for (int g = 0; g < G; ++g)
            out[g] = S::fmadd(x, S::set1(s.weights[(g * blocks + b) * kTile + 4 * quad + c]), out[g]);
        }
      }
      for (int g = 0; g < G; ++g) S::store(acc + g * dim + d0 + at, out[g]);
    }
  }
}

// attend_tile for the 1 to kMaxGroup query heads of (a part of) a GQA group.
template <class S, class F>
void attend_group(int group, const float* q, float* acc, float* run_max, float* run_sum, const uint8_t* k_tile,
                  const uint8_t* v_tile, int len, int64_t dim, float scale, Scratch<S>& s) {
  with_group<kMaxGroup>(group, [&](auto g) {
    attend_tile<S, F, decltype(g)::value>(q, acc, run_max, run_sum, k_tile, v_tile, len, dim, scale, s);
  });
}

}  // namespace pagedserve_cpu::attention_quant

// Register tiles of the decode attention (ops/cpu/paged_attention.cpp): one tile of up to 16 cached
// positions of one kv head against the G query heads of its GQA group, scores, the online-softmax update
// and the weighted sum of values, written once over the instruction sets of simd.h and the cache types fp32,
// bf16 and fp16 (quantized caches: attention_quant.h and attention_int8.h, which share softmax_tile).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kv_quant.h"
#include "simd.h"

namespace pagedserve_cpu::attention {

using namespace pagedserve_cpu::simd;
using kv_quant::Elem;

constexpr int kTile = 16;           // positions scored together (one transposing sum of 16 dot products)
constexpr int kMaxGroup = 8;        // query heads per register tile; larger GQA groups take several passes
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// How many keys (or pairs of value vectors) one register tile of G heads takes: what fits beside the
// G x n accumulators, a key vector each and one query vector (the dot-product set leaves two more); keys a
// power of two up to W (see score_keys). AVX-512 has 32 vector registers, AVX2 16 (the scalar path follows
// AVX2).
template <class S>
constexpr int kRegs = S::W == 16 ? 32 : 16;
constexpr int floor_pow2(int n) { return n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1; }
template <class S, int G>
constexpr int kKeys = std::min(S::W, floor_pow2((kRegs<S> - (kDotBf16<S> ? 3 : 1)) / (G + 1)));
template <class S, int G>
constexpr int kValuePairs = std::clamp((kRegs<S> - 3) / (2 * (G + 1)), 1, 4);

// The query dtype a set scores with: bf16 as stored for the dot-product set, else fp32.
template <class S>
using Query = std::conditional_t<kDotBf16<S>, c10::BFloat16, float>;

// Prefetches into L2 the lines of values [d, d + 2W) of a row: one step of a later block's K or V, issued
// while this block is scored. Into L2, not L1: the tile's working set already fills L1, which evicted the
// lines before they were used; and spread over the scoring loop, one step per step of the keys (issued all
// at once per block they arrived later). Forced inline, like every caller up to score_keys: GCC takes a
// function that only prefetches for one without effects and drops the calls to it. The lines are those of the
// range's first byte, every 64 bytes on, and its last: a fixed count, with no loop bound to compute per step.
template <class S, class C>
PAGEDSERVE_INLINE void prefetch_step(const Elem<C>* row, int64_t d) {
  constexpr int64_t bytes = kv_quant::byte_of<C>(2 * S::W);
  const auto* start = reinterpret_cast<const char*>(row) + kv_quant::byte_of<C>(d);
  for (int64_t off = 0; off < bytes; off += 64) S::prefetch(start + off);
  S::prefetch(start + bytes - 1);
}

// Keys [0, n) and their values of a later block, at the same 2W values as the keys being scored.
template <class S, class C>
PAGEDSERVE_INLINE void prefetch_keys(const Elem<C>* ahead_k, const Elem<C>* ahead_v, int n, int64_t stride,
                                     int64_t d) {
  if (ahead_k)
    for (int j = 0; j < n; ++j) {
      prefetch_step<S, C>(ahead_k + j * stride, d);
      prefetch_step<S, C>(ahead_v + j * stride, d);
    }
}

// Scores of G query heads against J keys from `k`, of which the first n are real (the others repeat key 0
// and the caller drops their scores): red[g * part_stride * W ...] gets one vector per head with the J dot
// products in order, each still a sum over W / J lanes (folded together while in registers, where storing
// every dot product for a reduction later cost as much as the products). With `ahead_k` (then also
// `ahead_v`), the same slots of a later block are prefetched.
template <class S, class C, int G, int J>
PAGEDSERVE_INLINE void score_keys(const Query<S>* q, const Elem<C>* k, int64_t stride, int n, int64_t dim,
                                  float* red, int part_stride, const Elem<C>* ahead_k, const Elem<C>* ahead_v) {
  typename S::V acc[G][J];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j) acc[g][j] = S::zero();
  const Elem<C>* keys[J];
  for (int j = 0; j < J; ++j) keys[j] = k + (j < n ? j : 0) * stride;
  if constexpr (kDotBf16<S>) {
    for (int64_t d = 0; d < dim; d += 2 * S::W) {
      typename S::B key[J];
      for (int j = 0; j < J; ++j) key[j] = S::load_bf16(keys[j] + d);   // (bf16 caches only)
      prefetch_keys<S, C>(ahead_k, ahead_v, n, stride, d);
      for (int g = 0; g < G; ++g) {
        const auto qv = S::keep(S::load_bf16(q + g * dim + d));
        for (int j = 0; j < J; ++j) acc[g][j] = S::dot2(acc[g][j], qv, key[j]);
      }
    }
  } else {
    // One of load2's halves at a time (simd.h's `lane` order), so a key takes one register, not two: on AVX2
    // a group of 6 heads then scores 2 keys a pass, not 1, and each query vector loaded serves two products.
    const auto half = [&](int64_t d, auto second) __attribute__((always_inline)) {
      typename S::V key[J];
      for (int j = 0; j < J; ++j) {
        typename S::V a, b;
        S::load2(keys[j] + d, a, b);   // the other half's conversion is dead code once inlined; keep: as for q
        key[j] = S::keep(second ? b : a);
      }
      for (int g = 0; g < G; ++g) {
        const typename S::V qv = S::keep(S::load(q + g * dim + d + (second ? S::W : 0)));
        for (int j = 0; j < J; ++j) acc[g][j] = S::fmadd(qv, key[j], acc[g][j]);
      }
    };
    for (int64_t d = 0; d < dim; d += 2 * S::W) {
      prefetch_keys<S, C>(ahead_k, ahead_v, n, stride, d);
      half(d, std::false_type{});
      half(d, std::true_type{});
    }
  }
  for (int g = 0; g < G; ++g) {
    fold_all<S, J, S::W / 2>(acc[g]);
    S::store(red + g * part_stride * S::W, acc[g][0]);
  }
}

// acc[g][d0 .. d0 + 2N*W) = acc * corr[g] + sum over the tile's keys j of p[g][j] * v_j: N pairs of value
// vectors of all G heads stay in registers across the keys.
template <class S, class C, int G, int N>
PAGEDSERVE_INLINE void add_values(const float* p, const float* corr, const Elem<C>* v, int64_t stride, int len,
                                  int64_t dim, int64_t d0, float* acc) {
  typename S::V out[G][2 * N];
  for (int g = 0; g < G; ++g) {
    const typename S::V c = S::set1(corr[g]);
    for (int i = 0; i < 2 * N; ++i) out[g][i] = S::mul(S::load(acc + g * dim + d0 + i * S::W), c);
  }
  for (int j = 0; j < len; ++j) {
    typename S::V val[2 * N];
    for (int n = 0; n < N; ++n) S::load2(v + j * stride + d0 + 2 * n * S::W, val[2 * n], val[2 * n + 1]);
    for (int g = 0; g < G; ++g) {
      const typename S::V w = S::set1(p[g * kTile + j]);
      for (int i = 0; i < 2 * N; ++i) out[g][i] = S::fmadd(w, val[i], out[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * N; ++i) S::store(acc + g * dim + d0 + i * S::W, out[g][i]);
}

// The dot-product set's add_values: key pairs (j, j+1) interleaved, weighed by bf16 pairs of their weights
// (a tile's odd last key is paired with zeros), N chunks of 2W values per pass.
template <class S, class C, int G, int N>
PAGEDSERVE_INLINE void add_values_dot(const uint32_t* pairs, const float* corr, const Elem<C>* v, int64_t stride,
                                      int len, int64_t dim, int64_t d0, float* acc) {
  typename S::V out[G][2 * N];
  for (int g = 0; g < G; ++g) {
    const typename S::V c = S::set1(corr[g]);
    for (int i = 0; i < 2 * N; ++i) out[g][i] = S::mul(S::load(acc + g * dim + d0 + i * S::W), c);
  }
  for (int j = 0; j < len; j += 2) {
    typename S::B lo[N], hi[N];
    for (int n = 0; n < N; ++n) {
      const int64_t at = j * stride + d0 + 2 * n * S::W;
      S::interleave(v + at, j + 1 < len ? v + at + stride : nullptr, lo[n], hi[n]);
    }
    for (int g = 0; g < G; ++g) {
      const typename S::B w = S::set1_pair(pairs[g * kTile / 2 + j / 2]);
      for (int n = 0; n < N; ++n) {
        out[g][2 * n] = S::dot2(out[g][2 * n], w, lo[n]);
        out[g][2 * n + 1] = S::dot2(out[g][2 * n + 1], w, hi[n]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * N; ++i) S::store(acc + g * dim + d0 + i * S::W, out[g][i]);
}

// Scratch of one thread: partial dot products, then weights, of one tile.
template <class S>
struct Scratch {
  alignas(64) float red[kMaxGroup * kTile * S::W];    // [G][kTile / J][W]
  alignas(64) float p[kMaxGroup * kTile];
  uint32_t pairs[kMaxGroup * kTile / 2];       // the weights as bf16 pairs (dot-product set)
  float corr[kMaxGroup];
};

// The online-softmax update of G heads over one tile's scaled scores sc[g] (W keys per vector; keys from len
// on get weight 0, whatever their score held): the running max and sum, each head's correction of its
// accumulators in s.corr and the weights in s.p (as bf16 pairs in s.pairs for the dot-product set). The heads
// run side by side: G independent dependency chains (sums, max, exp) that overlap, where one head at a time
// would wait on each.
template <class S, int G, int L>
PAGEDSERVE_INLINE void softmax_tile(typename S::V (&sc)[G][L], int len, float* run_max, float* run_sum,
                                    Scratch<S>& s) {
  using V = typename S::V;
  if (len < kTile) {
    alignas(64) float bias[kTile];
    std::fill(bias, bias + len, 0.f);
    std::fill(bias + len, bias + kTile, kNegInf);
    for (int i = 0; i < L; ++i)
      for (int g = 0; g < G; ++g) {
        const V b = S::load(bias + i * S::W);
        sc[g][i] = S::where_negative(b, b, sc[g][i]);
      }
  }
  V top[G];
  for (int g = 0; g < G; ++g) {
    top[g] = sc[g][0];
    for (int i = 1; i < L; ++i) top[g] = S::max(top[g], sc[g][i]);
  }
  float m[G], shift[G];
  for (int g = 0; g < G; ++g) {
    m[g] = std::max(run_max[g], S::hmax(top[g]));
    shift[g] = run_max[g] - m[g];    // -inf on the first tile: its correction is 0
  }
  for (int g = 0; g < G; ++g) s.corr[g] = exp_nonpositive<Scalar>(shift[g]);
  V total[G];
  for (int g = 0; g < G; ++g) {
    total[g] = S::zero();
    for (int i = 0; i < L; ++i) {
      const V e = exp_nonpositive<S>(S::add(sc[g][i], S::set1(-m[g])));
      if constexpr (kDotBf16<S>)
        S::store_pairs(s.pairs + g * kTile / 2 + i * S::W / 2, e);
      else
        S::store(s.p + g * kTile + i * S::W, e);
      total[g] = S::add(total[g], e);
    }
  }
  for (int g = 0; g < G; ++g) {
    run_sum[g] = run_sum[g] * s.corr[g] + S::sum(total[g]);
    run_max[g] = m[g];
  }
}

// `len` (<= kTile) keys of one kv head against G of its query heads, with the online-softmax update of
// their running max / sum / accumulators (and the prefetch of a later block's slots, if `ahead_k`).
template <class S, class C, int G>
void attend_tile(const Query<S>* q, float* acc, float* run_max, float* run_sum, const Elem<C>* k,
                 const Elem<C>* v, int64_t stride, int len, int64_t dim, float scale, Scratch<S>& s,
                 const Elem<C>* ahead_k, const Elem<C>* ahead_v) {
  using V = typename S::V;
  constexpr int J = kKeys<S, G>, M = kTile / J, L = kTile / S::W;   // M key groups, L vectors of scores
  const int used = (len + J - 1) / J;
  for (int m = 0; m < used; ++m) {
    const int64_t at = m * J * stride;
    score_keys<S, C, G, J>(q, k + at, stride, std::min(J, len - m * J), dim, s.red + m * S::W, M,
                           ahead_k ? ahead_k + at : ahead_k, ahead_v ? ahead_v + at : ahead_v);
  }
  V sc[G][L];
  for (int g = 0; g < G; ++g) {
    V parts[M];
    for (int m = 0; m < M; ++m) parts[m] = m < used ? S::load(s.red + (g * M + m) * S::W) : S::zero();
    for (int i = 0; i < L; ++i) {
      fold_all<S, S::W / J, S::W / (2 * J)>(parts + i * (S::W / J));
      sc[g][i] = S::mul(parts[i * (S::W / J)], S::set1(scale));
    }
  }
  softmax_tile<S, G, L>(sc, len, run_max, run_sum, s);
  constexpr int N = kValuePairs<S, G>;
  int64_t d0 = 0;
  if constexpr (kDotBf16<S>) {
    for (; d0 + 2 * N * S::W <= dim; d0 += 2 * N * S::W)
      add_values_dot<S, C, G, N>(s.pairs, s.corr, v, stride, len, dim, d0, acc);
    for (; d0 < dim; d0 += 2 * S::W) add_values_dot<S, C, G, 1>(s.pairs, s.corr, v, stride, len, dim, d0, acc);
  } else {
    for (; d0 + 2 * N * S::W <= dim; d0 += 2 * N * S::W)
      add_values<S, C, G, N>(s.p, s.corr, v, stride, len, dim, d0, acc);
    for (; d0 < dim; d0 += 2 * S::W) add_values<S, C, G, 1>(s.p, s.corr, v, stride, len, dim, d0, acc);
  }
}

// attend_tile for the 1 to kMaxGroup query heads of a (part of a) GQA group.
template <class S, class C>
void attend_group(int group, const Query<S>* q, float* acc, float* run_max, float* run_sum, const Elem<C>* k,
                  const Elem<C>* v, int64_t stride, int len, int64_t dim, float scale, Scratch<S>& s,
                  const Elem<C>* ahead_k, const Elem<C>* ahead_v) {
  with_group<kMaxGroup>(group, [&](auto g) {
    attend_tile<S, C, decltype(g)::value>(q, acc, run_max, run_sum, k, v, stride, len, dim, scale, s, ahead_k, ahead_v);
  });
}

}  // namespace pagedserve_cpu::attention

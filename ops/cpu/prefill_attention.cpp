// pagedserve_cpu::prefill_attention: the attention of one prefill row (a chunk of a prompt's new tokens after
// its cached prefix) over a bf16 paged cache, for bf16 queries, with VDPBF16PS (AVX-512 BF16; CPUs with AMX
// take torch's flash SDPA instead). The decode kernel (paged_attention.cpp) gives each token its own pass,
// scoring 16 positions against its query heads and folding each position's products across the lanes; here
// 16 tokens share every vector, one lane each:
//  - scores: a key's pair of values at a time, broadcast, times the 16 tokens' staged query pairs of a head:
//    one instruction per head, pair and position, no folds, and every key read serves G heads x 16 tokens;
//  - softmax: lane-wise online updates every kStep positions (each lane one token's running max and sum),
//    the causal limit a lane mask;
//  - values: two positions' weights, rounded to bf16 (one lane per token), times the two positions' value d,
//    broadcast from their V rows interleaved once per pair (Avx512Bf16::interleave, as the decode kernel
//    pairs them), into one accumulator per head and value.
// Work items are (kv head, up to kMaxGroup of its query heads, 16 tokens), each over the prefix its tokens see.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
using namespace pagedserve_cpu::simd;

constexpr int kLanes = 16;        // tokens per item
constexpr int kStep = 64;         // positions per softmax update
constexpr int kMaxGroup = 8;      // query heads per item; larger GQA groups take several
// Positions scored, and values accumulated, per pass of the registers: G x that many accumulators beside the
// operands fill 32 registers (values: a divisor of 32).
template <int G>
constexpr int kKeys = G <= 6 ? 4 : 3;
template <int G>
constexpr int kValues = G <= 6 ? 4 : 2;

PAGEDSERVE_INLINE __m512 dot(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));   // the intrinsic's copies: see attention_int8.h
  return acc;
}

// Value d of the staged word j of an interleaved V pair row (Avx512Bf16::interleave: per 32 values, lo holds
// d = 8L + 0..3 of each group L of 8, hi d = 8L + 4..7).
int value_of(int j) {
  const int r = j % 32;
  return j - r + 8 * (r % 16 / 4) + 4 * (r / 16) + r % 4;
}

struct Row {
  const c10::BFloat16* q;      // [n, Hq, D]
  const c10::BFloat16* k;      // cache [NB, BS, Hk, D]
  const c10::BFloat16* v;
  const int32_t* table;
  int64_t n, prefix, heads, dim, block_size, block_stride, slot_stride, head_stride;
  float scale;
  c10::BFloat16* out;          // [n, Hq, D]

  const c10::BFloat16* at(const c10::BFloat16* cache, int64_t pos, int64_t h) const {
    return cache + table[pos / block_size] * block_stride + pos % block_size * slot_stride + h * head_stride;
  }
  // Position pos's K and V rows into L2, a step before they are read: block tables scatter the blocks, which
  // the hardware prefetcher cannot follow.
  void prefetch(int64_t pos, int64_t h) const {
    for (const c10::BFloat16* row : {at(k, pos, h), at(v, pos, h)})
      for (int64_t d = 0; d < dim; d += 32) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T1);
  }
};

// One thread's buffers, each 64-byte aligned: their vectors are read whole, and a load across two lines
// costs two.
struct Scratch {
  Scratch(int64_t group, int64_t dim) : bytes(64 + 4 * (kLanes * group * (dim / 2 + kStep + kStep / 2 + dim) +
                                                        kStep / 2 * dim)) {
    auto* p = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
    const auto take = [&](int64_t words) { return std::exchange(p, p + words); };
    q = take(group * dim / 2 * kLanes);
    scores = reinterpret_cast<float*>(take(group * kStep * kLanes));
    w = take(group * kStep / 2 * kLanes);
    v = take(kStep / 2 * dim);
    acc = reinterpret_cast<float*>(take(group * dim * kLanes));
  }
  std::vector<uint8_t> bytes;
  uint32_t* q;        // [G][D / 2][16]: each token's pair of query values 2i, 2i + 1 of a head
  float* scores;      // [G][kStep][16]
  uint32_t* w;        // [G][kStep / 2][16]: two positions' bf16 weights per token
  uint32_t* v;        // [kStep / 2][D]: two positions' V rows interleaved
  float* acc;         // [G][D][16] by staged value order
};

// Tokens t0 .. t0 + 15 (those past n repeat the last, their outputs dropped) of query heads h0 .. h0 + G - 1
// (kv head kh) against the positions each sees.
template <int G, int D>
void attend_item(const Row& r, int64_t kh, int64_t h0, int64_t t0, Scratch& s) {
  constexpr int pairs = D / 2;
  alignas(64) int32_t limit[kLanes];
  for (int t = 0; t < kLanes; ++t) limit[t] = static_cast<int32_t>(r.prefix + std::min<int64_t>(t0 + t, r.n - 1));
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kLanes; ++t) {
      const c10::BFloat16* q = r.q + (std::min<int64_t>(t0 + t, r.n - 1) * r.heads + h0 + g) * D;
      for (int64_t i = 0; i < pairs; ++i) std::memcpy(&s.q[(g * pairs + i) * kLanes + t], q + 2 * i, 4);
    }
  std::fill(s.acc, s.acc + G * D * kLanes, 0.f);
  __m512 run_max[G], run_sum[G];
  for (int g = 0; g < G; ++g) {
    run_max[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    run_sum[g] = _mm512_setzero_ps();
  }
  const __m512i lim = _mm512_load_si512(limit);
  const int64_t last = limit[kLanes - 1];
  for (int64_t p0 = 0; p0 <= last; p0 += kStep) {
    const int n = static_cast<int>(std::min<int64_t>(kStep, last + 1 - p0));
    const int padded = (n + 1) / 2 * 2;        // a pair's missing second position: a copy of the last, masked
    const auto position = [&](int p) { return std::min<int64_t>(p0 + p, last); };
    constexpr int C = kKeys<G>;
    for (int c0 = 0; c0 < padded; c0 += C) {
      __m512 acc[G][C];
      const c10::BFloat16* key[C];
      for (int c = 0; c < C; ++c) key[c] = r.at(r.k, position(std::min(c0 + c, padded - 1)), kh);
      for (int c = 0; c < C; ++c)
        if (p0 + kStep + c0 + c <= last) r.prefetch(p0 + kStep + c0 + c, kh);
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t i = 0; i < pairs; ++i) {
        __m512i k[C];
        for (int c = 0; c < C; ++c) k[c] = broadcast_word(key[c] + 2 * i);
        for (int g = 0; g < G; ++g) {
          const __m512i q = _mm512_load_si512(&s.q[(g * pairs + i) * kLanes]);
          for (int c = 0; c < C; ++c) acc[g][c] = dot(acc[g][c], q, k[c]);
        }
      }
      for (int c = 0; c < std::min(C, padded - c0); ++c) {
        const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(p0 + c0 + c)), lim);
        const __m512 masked = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int g = 0; g < G; ++g)
          _mm512_store_ps(&s.scores[(g * kStep + c0 + c) * kLanes],
                           _mm512_mask_mul_ps(masked, seen, acc[g][c], _mm512_set1_ps(r.scale)));
      }
    }
    for (int pr = 0; pr < padded / 2; ++pr)
      for (int64_t d = 0; d < D; d += 32) {
        Avx512Bf16::B lo, hi;
        Avx512Bf16::interleave(r.at(r.v, position(2 * pr), kh) + d, r.at(r.v, position(2 * pr + 1), kh) + d, lo, hi);
        _mm512_store_si512(&s.v[pr * D + d], (__m512i)lo);
        _mm512_store_si512(&s.v[pr * D + d + 16], (__m512i)hi);
      }
    __m512 corr[G];
    for (int g = 0; g < G; ++g) {
      const float* sc = &s.scores[g * kStep * kLanes];
      __m512 top = run_max[g];
      for (int p = 0; p < padded; ++p) top = _mm512_max_ps(top, _mm512_load_ps(sc + p * kLanes));
      corr[g] = exp_nonpositive<Avx512>(_mm512_sub_ps(run_max[g], top));   // -inf first: 0
      __m512 total = _mm512_setzero_ps();
      for (int pr = 0; pr < padded / 2; ++pr) {
        const __m512 a = exp_nonpositive<Avx512>(_mm512_sub_ps(_mm512_load_ps(sc + 2 * pr * kLanes), top));
        const __m512 b = exp_nonpositive<Avx512>(_mm512_sub_ps(_mm512_load_ps(sc + (2 * pr + 1) * kLanes), top));
        total = _mm512_add_ps(total, _mm512_add_ps(a, b));
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
        _mm512_store_si512(&s.w[(g * kStep / 2 + pr) * kLanes], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
      run_sum[g] = _mm512_fmadd_ps(run_sum[g], corr[g], total);
      run_max[g] = top;
    }
    constexpr int V = kValues<G>;
    for (int64_t j0 = 0; j0 < D; j0 += V) {
      __m512 acc[G][V];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < V; ++c)
          acc[g][c] = _mm512_mul_ps(_mm512_load_ps(&s.acc[(g * D + j0 + c) * kLanes]), corr[g]);
      for (int pr = 0; pr < padded / 2; ++pr) {
        __m512i val[V];
        for (int c = 0; c < V; ++c) val[c] = broadcast_word(&s.v[pr * D + j0 + c]);
        for (int g = 0; g < G; ++g) {
          const __m512i w = _mm512_load_si512(&s.w[(g * kStep / 2 + pr) * kLanes]);
          for (int c = 0; c < V; ++c) acc[g][c] = dot(acc[g][c], w, val[c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < V; ++c) _mm512_store_ps(&s.acc[(g * D + j0 + c) * kLanes], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float inv[kLanes];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), run_sum[g]));
    for (int t = 0; t < kLanes && t0 + t < r.n; ++t) {
      c10::BFloat16* out = r.out + ((t0 + t) * r.heads + h0 + g) * D;
      for (int64_t j = 0; j < D; ++j) out[value_of(static_cast<int>(j))] = s.acc[(g * D + j) * kLanes + t] * inv[t];
    }
  }
}
#endif

// q: [n, Hq, D] bf16, the row's new tokens, the last at position context_len - 1; caches [NB, BS, Hk, D] bf16
// with unit stride in D (D 32, 64, 128 or 256); block_table: int32 [>= blocks of context_len].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_table, int64_t context_len, double scale) {
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  const bool dims = dim == 32 || dim == 64 || dim == 128 || dim == 256;
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && q.is_contiguous() && dims && k_cache.size(3) == dim &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  k_cache.stride(3) == 1 && heads % kv_heads == 0 && block_table.scalar_type() == at::kInt,
              "pagedserve_cpu::prefill_attention: bf16 q [n, Hq, D] and caches [NB, BS, Hk, D] alike with unit "
              "stride in D, D 32, 64, 128 or 256, int32 block table");
  const int64_t block_size = k_cache.size(1), blocks = (context_len + block_size - 1) / block_size;
  TORCH_CHECK(n >= 1 && context_len >= n && blocks <= block_table.size(0),
              "pagedserve_cpu::prefill_attention: ", n, " tokens need a context of at least as many, whose ",
              blocks, " blocks the table must hold");
  const auto table = block_table.contiguous();
  for (int64_t b = 0; b < blocks; ++b)
    TORCH_CHECK(table.data_ptr<int32_t>()[b] >= 0 && table.data_ptr<int32_t>()[b] < k_cache.size(0),
                "pagedserve_cpu::prefill_attention: block ", table.data_ptr<int32_t>()[b], " is not in the cache");
  at::Tensor out = at::empty_like(q);
  const Row r{q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
              table.data_ptr<int32_t>(), n, context_len - n, heads, dim, block_size, k_cache.stride(0),
              k_cache.stride(1), k_cache.stride(2), static_cast<float>(scale), out.data_ptr<c10::BFloat16>()};
  const int64_t group = heads / kv_heads, passes = (group + kMaxGroup - 1) / kMaxGroup;
  const int64_t token_groups = (n + kLanes - 1) / kLanes;
  at::parallel_for(0, kv_heads * passes * token_groups, 1, [&](int64_t first, int64_t end) {
    Scratch s(std::min<int64_t>(group, kMaxGroup), dim);
    for (int64_t i = first; i < end; ++i) {
      const int64_t kh = i / (passes * token_groups), pass = i / token_groups % passes;
      const int64_t t0 = i % token_groups * kLanes, h0 = kh * group + pass * kMaxGroup;
      const int64_t heads_here = std::min<int64_t>(kMaxGroup, group - pass * kMaxGroup);
      with_group<kMaxGroup>(static_cast<int>(heads_here), [&](auto gc) {
        constexpr int G = decltype(gc)::value;
        switch (dim) {
          case 32: return attend_item<G, 32>(r, kh, h0, t0, s);
          case 64: return attend_item<G, 64>(r, kh, h0, t0, s);
          case 128: return attend_item<G, 128>(r, kh, h0, t0, s);
          default: return attend_item<G, 256>(r, kh, h0, t0, s);
        }
      });
    }
  });
  return out;
#else
  TORCH_CHECK(false, "pagedserve_cpu::prefill_attention needs AVX-512 BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int context_len, "
        "float scale) -> Tensor",
        &prefill_attention);
}

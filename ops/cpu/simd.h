// The vector operations the attention kernel is written in, once per instruction set: Avx512 (16 lanes),
// Avx2 (8 lanes, with FMA and F16C) and Scalar (1 lane). The extension is built with -march=native per CPU
// (ops/cpu/build.py keys its cache by the CPU's flags), so a set is present exactly when this CPU has it.
//
// K/V are read 2W values at a time (`load2`) from fp32, bf16 (c10::BFloat16) or fp16 (c10::Half) storage
// as two fp32 vectors. For bf16 the pair is the even and the odd values of the 2W (one shift and one mask
// of a single load, where widening in order takes a shuffle and a shift per W values and the shuffles
// compete with the FMAs for the same ports): `lane` says where each value lands, and the kernel keeps
// queries and outputs in that order.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2 1
#endif
#if defined(PAGEDSERVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512 1
#endif

// Everything here is forced inline: a call boundary inside the kernel's loops would serialise the
// independent dependency chains the loops interleave (and GCC 12 passes vectors through memory there).
#define PAGEDSERVE_INLINE inline __attribute__((always_inline))

namespace pagedserve_cpu::simd {

// f(std::integral_constant<int, n>{}) for 1 <= n <= Max (nothing otherwise): the kernels are templated on the
// heads of a GQA group they serve per pass, a count known at run time.
template <int Max, class F>
inline void with_group(int n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) return f(std::integral_constant<int, Max>{});
    with_group<Max - 1>(n, f);
  }
}

PAGEDSERVE_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// exp(x) for x <= 0 to within a few ulp (Cephes' expf: 2^n times a degree-6 polynomial on the remainder);
// written once over any lane type so every set evaluates the same formula. Below -87 the result is 0, so
// the -inf scores of padded positions give weight 0.
template <class S, class V>
PAGEDSERVE_INLINE V exp_nonpositive(V x) {
  const V n = S::round(S::mul(x, S::set1(1.44269504088896341f)));
  V r = S::fmadd(n, S::set1(-0.693359375f), x);
  r = S::fmadd(n, S::set1(2.12194440e-4f), r);
  V p = S::set1(1.9875691500e-4f);
  p = S::fmadd(p, r, S::set1(1.3981999507e-3f));
  p = S::fmadd(p, r, S::set1(8.3334519073e-3f));
  p = S::fmadd(p, r, S::set1(4.1665795894e-2f));
  p = S::fmadd(p, r, S::set1(1.6666665459e-1f));
  p = S::fmadd(p, r, S::set1(5.0000001201e-1f));
  p = S::fmadd(p, S::mul(r, r), S::add(r, S::set1(1.f)));
  return S::zero_below(S::mul(p, S::pow2(n)), x, -87.f);
}

struct Scalar {
  static constexpr int W = 1;
  using V = float;
  PAGEDSERVE_INLINE static V zero() { return 0.f; }
  PAGEDSERVE_INLINE static V set1(float x) { return x; }
  PAGEDSERVE_INLINE static V load(const float* p) { return *p; }
  template <class C>
  PAGEDSERVE_INLINE static void load2(const C* p, V& a, V& b) {
    a = static_cast<float>(p[0]);
    b = static_cast<float>(p[1]);
  }
  PAGEDSERVE_INLINE static V keep(V v) { return v; }
  PAGEDSERVE_INLINE static void store(float* p, V v) { *p = v; }
  PAGEDSERVE_INLINE static V add(V a, V b) { return a + b; }
  PAGEDSERVE_INLINE static V mul(V a, V b) { return a * b; }
  PAGEDSERVE_INLINE static V div(V a, V b) { return a / b; }
  PAGEDSERVE_INLINE static V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
  PAGEDSERVE_INLINE static V min(V a, V b) { return a < b ? a : b; }
  PAGEDSERVE_INLINE static V where_negative(V x, V neg, V other) { return x < 0.f ? neg : other; }
  PAGEDSERVE_INLINE static V max(V a, V b) { return a > b ? a : b; }
  PAGEDSERVE_INLINE static V round(V x) { return std::nearbyint(x); }
  PAGEDSERVE_INLINE static V pow2(V n) {   // n < -126 only where zero_below then discards the result
    return n >= -126.f ? bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23) : 0.f;
  }
  PAGEDSERVE_INLINE static V zero_below(V v, V x, float lo) { return x < lo ? 0.f : v; }
  PAGEDSERVE_INLINE static float sum(V v) { return v; }
  PAGEDSERVE_INLINE static float hmax(V v) { return v; }
  PAGEDSERVE_INLINE static void prefetch(const void*) {}
};

#ifdef PAGEDSERVE_AVX2
// Denormal floats flushed to zero (inputs and results) while it lives: a running sum or accumulator times a
// correction of ~1e-38 made denormals, and each product with one takes a microcode assist (a chunk of the
// integer-dot kernel ran 5x slower). Such values weigh nothing next to the normal ones they are summed with.
struct FlushDenormals {
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }     // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

struct Avx2 {
  static constexpr int W = 8;
  using V = __m256;
  PAGEDSERVE_INLINE static V zero() { return _mm256_setzero_ps(); }
  PAGEDSERVE_INLINE static V set1(float x) { return _mm256_set1_ps(x); }
  PAGEDSERVE_INLINE static V load(const float* p) { return _mm256_loadu_ps(p); }
  PAGEDSERVE_INLINE static void load2(const float* p, V& a, V& b) {
    a = load(p);
    b = load(p + W);
  }
  PAGEDSERVE_INLINE static void load2(const c10::Half* p, V& a, V& b) {
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W)));
  }
  // a bf16 is the high half of the fp32 with the same value: even values shift up, odd ones are masked
  PAGEDSERVE_INLINE static void load2(const c10::BFloat16* p, V& a, V& b) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    b = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  // Keeps a value loaded once in a register: GCC otherwise re-reads it as a memory operand of every FMA
  // that uses it, and the loads, not the FMAs, then bound the loop.
  PAGEDSERVE_INLINE static V keep(V v) {
    asm("" : "+x"(v));
    return v;
  }
  PAGEDSERVE_INLINE static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  PAGEDSERVE_INLINE static V add(V a, V b) { return _mm256_add_ps(a, b); }
  PAGEDSERVE_INLINE static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  PAGEDSERVE_INLINE static V div(V a, V b) { return _mm256_div_ps(a, b); }
  PAGEDSERVE_INLINE static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  PAGEDSERVE_INLINE static V min(V a, V b) { return _mm256_min_ps(a, b); }
  PAGEDSERVE_INLINE static V where_negative(V x, V neg, V other) {
    return _mm256_blendv_ps(other, neg, _mm256_cmp_ps(x, zero(), _CMP_LT_OQ));
  }
  PAGEDSERVE_INLINE static V max(V a, V b) { return _mm256_max_ps(a, b); }
  PAGEDSERVE_INLINE static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  PAGEDSERVE_INLINE static V pow2(V n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  PAGEDSERVE_INLINE static V zero_below(V v, V x, float lo) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, set1(lo), _CMP_GE_OQ));
  }
  PAGEDSERVE_INLINE static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  PAGEDSERVE_INLINE static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  // Lanes [0, 4) = the halves of a's 2H-lane segments summed, [4, 8) = b's (see fold_all).
  template <int H>
  PAGEDSERVE_INLINE static V fold(V a, V b) {
    const V t = _mm256_permute2f128_ps(a, b, 0x20), u = _mm256_permute2f128_ps(a, b, 0x31);
    if constexpr (H == 4) return _mm256_add_ps(t, u);
    constexpr int lo = H == 2 ? _MM_SHUFFLE(1, 0, 1, 0) : _MM_SHUFFLE(2, 0, 2, 0);
    constexpr int hi = H == 2 ? _MM_SHUFFLE(3, 2, 3, 2) : _MM_SHUFFLE(3, 1, 3, 1);
    return _mm256_add_ps(_mm256_shuffle_ps(t, u, lo), _mm256_shuffle_ps(t, u, hi));
  }
  PAGEDSERVE_INLINE static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};
#endif

#ifdef PAGEDSERVE_AVX512
struct Avx512 {
  static constexpr int W = 16;
  using V = __m512;
  PAGEDSERVE_INLINE static V zero() { return _mm512_setzero_ps(); }
  PAGEDSERVE_INLINE static V set1(float x) { return _mm512_set1_ps(x); }
  PAGEDSERVE_INLINE static V load(const float* p) { return _mm512_loadu_ps(p); }
  PAGEDSERVE_INLINE static void load2(const float* p, V& a, V& b) {
    a = load(p);
    b = load(p + W);
  }
  PAGEDSERVE_INLINE static void load2(const c10::Half* p, V& a, V& b) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + W)));
  }
  PAGEDSERVE_INLINE static void load2(const c10::BFloat16* p, V& a, V& b) {
    const __m512i bits = _mm512_loadu_si512(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
  PAGEDSERVE_INLINE static V keep(V v) {
    asm("" : "+v"(v));
    return v;
  }
  PAGEDSERVE_INLINE static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  PAGEDSERVE_INLINE static V add(V a, V b) { return _mm512_add_ps(a, b); }
  PAGEDSERVE_INLINE static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  PAGEDSERVE_INLINE static V div(V a, V b) { return _mm512_div_ps(a, b); }
  PAGEDSERVE_INLINE static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  PAGEDSERVE_INLINE static V min(V a, V b) { return _mm512_min_ps(a, b); }
  PAGEDSERVE_INLINE static V where_negative(V x, V neg, V other) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_LT_OQ), other, neg);
  }
  PAGEDSERVE_INLINE static V max(V a, V b) { return _mm512_max_ps(a, b); }
  PAGEDSERVE_INLINE static V round(V x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  PAGEDSERVE_INLINE static V pow2(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  PAGEDSERVE_INLINE static V zero_below(V v, V x, float lo) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(lo), _CMP_GE_OQ), v);
  }
  PAGEDSERVE_INLINE static float sum(V v) { return _mm512_reduce_add_ps(v); }
  PAGEDSERVE_INLINE static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  // Lanes [0, 8) = the halves of a's 2H-lane segments summed, [8, 16) = b's (see fold_all).
  template <int H>
  PAGEDSERVE_INLINE static V fold(V a, V b) {
    alignas(64) static const int32_t lo[16] = {
        (0 / H) * 2 * H + 0 % H,      (1 / H) * 2 * H + 1 % H,      (2 / H) * 2 * H + 2 % H,
        (3 / H) * 2 * H + 3 % H,      (4 / H) * 2 * H + 4 % H,      (5 / H) * 2 * H + 5 % H,
        (6 / H) * 2 * H + 6 % H,      (7 / H) * 2 * H + 7 % H,      16 + (0 / H) * 2 * H + 0 % H,
        16 + (1 / H) * 2 * H + 1 % H, 16 + (2 / H) * 2 * H + 2 % H, 16 + (3 / H) * 2 * H + 3 % H,
        16 + (4 / H) * 2 * H + 4 % H, 16 + (5 / H) * 2 * H + 5 % H, 16 + (6 / H) * 2 * H + 6 % H,
        16 + (7 / H) * 2 * H + 7 % H};
    const __m512i first = _mm512_load_si512(lo), second = _mm512_add_epi32(first, _mm512_set1_epi32(H));
    return _mm512_add_ps(_mm512_permutex2var_ps(a, first, b), _mm512_permutex2var_ps(a, second, b));
  }
  PAGEDSERVE_INLINE static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};

// The 32-bit word at p in every lane: the operand a dot-product instruction's 16 lanes share (4 int8 query
// values or weights, a pair of bf16 values).
PAGEDSERVE_INLINE __m512i broadcast_word(const void* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return _mm512_set1_epi32(word);
}
#endif

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
// Avx512 for bf16 queries against bf16 K/V, with VDPBF16PS (32 products of bf16 pairs summed into 16 fp32
// lanes per instruction): scores pair query and key values as stored (exact products, no widening of the
// keys); values pair positions j and j+1 value by value, weighted by (p_j, p_{j+1}) rounded to bf16, as
// GPU flash attention rounds its weights to the values' dtype.
struct Avx512Bf16 : Avx512 {
  using B = __m512bh;
  using Avx512::keep;
  PAGEDSERVE_INLINE static B load_bf16(const c10::BFloat16* p) { return (B)_mm512_loadu_si512(p); }
  PAGEDSERVE_INLINE static B keep(B v) {
    asm("" : "+v"(v));
    return v;
  }
  PAGEDSERVE_INLINE static V dot2(V acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }
  // The 2W values at a and at b (zeros for b = null) paired value by value: lo holds (a_d, b_d) for
  // d = 8L + 0..3 of each 8-value group L, hi for d = 8L + 4..7.
  PAGEDSERVE_INLINE static void interleave(const c10::BFloat16* a, const c10::BFloat16* b, B& lo, B& hi) {
    const __m512i x = _mm512_loadu_si512(a), y = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
    lo = (B)_mm512_unpacklo_epi16(x, y);
    hi = (B)_mm512_unpackhi_epi16(x, y);
  }
  // 16 fp32 weights as 8 bf16 pairs (one 32-bit lane each): pair i = (w[2i], w[2i+1])
  PAGEDSERVE_INLINE static void store_pairs(uint32_t* dst, V w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(w));
  }
  PAGEDSERVE_INLINE static B set1_pair(uint32_t pair) { return (B)_mm512_set1_epi32(static_cast<int32_t>(pair)); }
};
#endif

template <class S>
constexpr bool kDotBf16 = false;
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
template <>
constexpr bool kDotBf16<Avx512Bf16> = true;
#endif

// Horizontal sums of N vectors at once: a transposing tree of N - 1 folds instead of N reductions. Each of
// v[0..N) holds sums in order, each spread over a segment of 2H lanes (H = W / 2 at the start: one sum per
// vector); fold<H> halves the segments of a and b and puts a's sums before b's. Afterwards v[0] holds all
// the sums of v[0..N) in order, each over 2H / N lanes.
template <class S, int N, int H>
PAGEDSERVE_INLINE void fold_all(typename S::V* v) {
  if constexpr (N > 1) {
    for (int i = 0; i < N / 2; ++i) v[i] = S::template fold<H>(v[2 * i], v[2 * i + 1]);
    fold_all<S, N / 2, H / 2>(v);
  }
}

// Where value d of a head sits in the lanes the kernel accumulates outputs in: load2's even/odd split of
// 2W bf16 values, Avx512Bf16's interleaved groups of 4, else in order.
template <class S, class C>
PAGEDSERVE_INLINE int64_t lane(int64_t d) {
  const int64_t r = d % (2 * S::W), base = d - r;
  if constexpr (kDotBf16<S>) return base + (r % 8 < 4 ? 0 : S::W) + 4 * (r / 8) + r % 4;
  if constexpr (S::W > 1 && std::is_same_v<C, c10::BFloat16>) return base + (r % 2) * S::W + r / 2;
  return d;
}

}  // namespace pagedserve_cpu::simd

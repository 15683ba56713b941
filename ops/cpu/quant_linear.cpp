// pagedserve::quant_linear on CPUs: y = x @ W.T with W in int4/int6/int8 groups of 32 (layout: ops/quant_weight.py).
// x is quantized to int8 per (row, 32-block) once per call; each (row, group) dot product is exact in int32
// (AVX2 maddubs/madd, or AVX-512 VNNI's dpbusd for int4 and int6), then scaled in fp32:
// acc += (scale * dx) * isum + min * (dx * sum xq).
// Two-level scales (K-quants) store uint8 sub-scales and -mins with an fp32 factor per 8 groups; a group's
// scale is their fp32 product. A call whose x rows fit one row block (decode) multiplies it out per group
// inside the tile kernel; larger calls multiply a tile's factors out once into fp32 for all its row blocks.
// int4 and int6 store each row's values 4 at a time side by side (k-interleaved), so that maddubs against 4
// x values broadcast, and one madd, leave each of the tile's 8 row sums in its own int32 lane: no horizontal
// adds (vphaddd takes 2 cycles on Zen 3; the row-paired layout before needed 3 a row and group). int8 keeps
// each row's group in one piece: k-interleaved it was 1.19-1.30x faster at 4 to 64 rows but 0.86-0.94x at
// one, where its sign handling and the broadcasts cost more than the horizontal adds they replace.
// int6 (Q6_K) weighs the int16 pair sums of each 16-value half by its int8 sub-scale inside that madd, takes
// 32 * (sub-scale * sum xq) per half off for the values' offset, and scales the exact int32 result by the
// group's super and dx.
// Threads split the weight's 8-row tiles; within a thread a chunk of x rows stays in L2 while its tiles
// stream by, and each tile-group of weights is unpacked once for up to row_block(bits) x rows.
// Calls with kMatrixRows or more x rows on a CPU with AMX-INT8 take pairs of tiles through matrix tiles
// instead (tile_pair, ops/cpu/quant_tiles.h): the same int32 sums and fp32 steps, so the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "bf16.h"
#include "quant_tiles.h"

namespace {

using pagedserve_cpu::from_float;
using pagedserve_cpu::to_float;
namespace mtile = pagedserve_cpu::tiles;

constexpr int64_t kGroup = 32;
constexpr int64_t kHalf = 16;             // values per int6 sub-scale
constexpr int32_t kInt6Offset = 32;       // an int6 q stands for q - 32
constexpr int64_t kSuper = 8;             // groups per two-level factor (the last of a row's may have fewer)
constexpr int64_t kTile = 8;              // output rows per weight tile
constexpr int kRowBlock = 4;              // x rows sharing one unpacked tile-group (register budget)
// int4 tiles need 2 ymm per row: with AVX-512's 32 registers 8 rows share a tile-group. A verify row of
// 5-8 tokens then unpacks its weights once, not twice (int6 and int8 need more registers a row)
#if defined(__AVX512VL__)
constexpr int kInt4RowBlock = 8;
#else
constexpr int kInt4RowBlock = kRowBlock;
#endif
constexpr int row_block(int64_t bits) { return bits == 4 ? kInt4RowBlock : kRowBlock; }
constexpr int64_t kMatrixRows = 6;        // calls with this many x rows use AMX tiles where the CPU has them
constexpr int64_t kChunkBytes = 256 << 10;  // quantized x rows kept hot per pass over a thread's tiles
// The weight stream is prefetched this far ahead of the group being read: with the hardware prefetcher
// alone a 17920x1536 int4 layer at M=1 took 0.77-1.09 ms, with this 0.69-0.72 (builds alternated).
constexpr int64_t kPrefetchBytes = 1024;

inline void prefetch_lines(const void* at, int lines) {
  for (int i = 0; i < lines; ++i) __builtin_prefetch(static_cast<const char*>(at) + kPrefetchBytes + 64 * i);
}

// x quantized per (row, block of 32): xq = round_half_even(x / dx), dx = amax / 127 (0 for a zero block).
struct Activations {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> dx;     // [M, G]
  std::vector<float> dx_sum; // [M, G] dx * sum(xq): what a group's min is multiplied by
  std::vector<int32_t> half_sums;  // [M, G] sum(xq) of the group's two halves as int16s, first in the low one
};

inline int32_t pack_halves(int32_t first, int32_t second) {
  return static_cast<int32_t>((static_cast<uint32_t>(second) << 16) | (static_cast<uint32_t>(first) & 0xFFFFu));
}

// The same fp32 operations as ops.quant_linear.quantize_activations (division, not a reciprocal), so
// the integers agree exactly with the torch reference.
template <typename T>
void quantize_block(const T* x, int8_t* q, float* dx_out, float* dx_sum_out, int32_t* halves_out) {
  float f[kGroup];
  float amax = 0.f;
  for (int i = 0; i < kGroup; ++i) {
    f[i] = to_float(x[i]);
    amax = std::max(amax, std::fabs(f[i]));
  }
  const float dx = amax / 127.f;
  int32_t first = 0, second = 0;   // sums of xq over values 0..15 and 16..31
  if (dx == 0.f) {
    std::fill(q, q + kGroup, int8_t{0});
  } else {
#ifdef __AVX2__
    const __m256 d = _mm256_set1_ps(dx);
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(f + 8 * j), d),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[j] = _mm256_cvtps_epi32(r);
    }
    // lane sums of [half 0 | half 1] pairs, then the two halves' totals in elements 0 and 1
    const __m256i s = _mm256_hadd_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    first = _mm_cvtsi128_si32(s4);
    second = _mm_extract_epi32(s4, 1);
    // packs interleave the 128-bit lanes; the permute puts the 32 values back in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < kGroup; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(f[i] / dx));
      (i < kHalf ? first : second) += q[i];
    }
#endif
  }
  *dx_out = dx;
  *dx_sum_out = dx * static_cast<float>(first + second);
  *halves_out = pack_halves(first, second);
}

// q has `padded` >= rows rows, the rows past `rows` zero (the matrix tiles read 16 rows at a time).
template <typename T>
Activations quantize_activations(const T* x, int64_t rows, int64_t padded, int64_t k) {
  const int64_t groups = k / kGroup;
  Activations a{std::vector<int8_t>(padded * k), std::vector<float>(padded * groups), std::vector<float>(padded * groups),
                std::vector<int32_t>(padded * groups)};
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      quantize_block(x + b * kGroup, a.q.data() + b * kGroup, &a.dx[b], &a.dx_sum[b], &a.half_sums[b]);
  });
  return a;
}

// What a tile kernel reads: one 8-row weight tile and `MR` consecutive quantized x rows.
struct TileArgs {
  const void* weight;     // the tile's [G, bytes per group]
  const float* scales;    // [G, 8]
  const float* mins;      // [G, 8] or nullptr
  const int8_t* xq;       // first x row, rows `k` apart
  const float* dx;        // [rows, G]
  const float* dx_sum;
  const int32_t* half_sums;
  int64_t k, groups;
  // two-level factors as stored, for the kernel to multiply out per group (then scales and mins are unused)
  const uint8_t* subs = nullptr;
  const uint8_t* sub_mins = nullptr;
  const float* supers = nullptr;   // the tile's [ceil(G/8), count, 8]
  int64_t super_count = 1;
  const int8_t* half_scales = nullptr;   // int6: the tile's [G, 8, 2] sub-scales (supers then has count 1)
};

#ifdef __AVX2__
// one group's 8 uint8 sub-values times their fp32 supers
inline __m256 sub_times_super(const uint8_t* sub, const float* super) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub));
  return _mm256_mul_ps(_mm256_loadu_ps(super), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
}
#endif

// A tile's two-level factors multiplied out to [G, 8] fp32 (which = 0: scales, 1: mins), once per tile
// rather than once per x row block: a batch's steps are compute-bound. At one row block this is pure
// extra work: group factors are multiplied out in the kernel then, a 17920x1536 int4 layer at M=1 took
// 0.63 instead of 0.96 ms, and a decode step of the default Q4_K_M model 43.5-47.0 instead of 46.5-51.7 ms
// (p10 of 14 alternations, two runs); at 8 and 64 rows the kernel's form was as fast or up to 10 % slower.
// supers: the tile's [ceil(G/8), count, 8].
void expand_factors(const uint8_t* subs, const float* supers, int which, int64_t count, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* super = supers + ((g / kSuper) * count + which) * kTile;
#ifdef __AVX2__
    _mm256_storeu_ps(out + g * kTile, sub_times_super(subs + g * kTile, super));
#else
    for (int r = 0; r < kTile; ++r) out[g * kTile + r] = super[r] * static_cast<float>(subs[g * kTile + r]);
#endif
  }
}

#ifdef __AVX2__

// acc plus, in each int32 lane, the sum of its 4 byte products u8 x s8: one AVX-512 VNNI instruction where the
// CPU has it (vpdpbusd), else maddubs, madd and add, which agree exactly for the tiles' operands (u < 64, so no
// int16 pair sum saturates). The tiles run either way (the op's `vnni` argument), so both are tested anywhere.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kHasVnni = true;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kHasVnni = false;
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// group g's scale and min for the tile's 8 rows. Forced inline: as a call (GCC 12 made it one once the tile
// kernels shrank) it passed the vectors through memory; a 17920x1536 int4 layer at M=1 on one thread ran
// at 0.83x the previous kernel's speed that way, 1.09x inlined (alternated in each run).
__attribute__((always_inline)) inline void group_factors(const TileArgs& a, int64_t g, bool has_mins, __m256& scale, __m256& min) {
  if (a.subs != nullptr) {
    const float* super = a.supers + (g / kSuper) * a.super_count * kTile;
    scale = sub_times_super(a.subs + g * kTile, super);
    min = has_mins ? sub_times_super(a.sub_mins + g * kTile, super + kTile) : _mm256_setzero_ps();
  } else {
    scale = _mm256_loadu_ps(a.scales + g * kTile);
    min = has_mins ? _mm256_loadu_ps(a.mins + g * kTile) : _mm256_setzero_ps();
  }
}

// x values 8p..8p+3 and 8p+4..8p+7 of a group (what vector p's low and high nibbles multiply), each 4 bytes
// broadcast to all 8 int32 lanes
inline void broadcast_quads(const int8_t* xr, int p, __m256i& lo, __m256i& hi) {
  int32_t first, second;
  std::memcpy(&first, xr + 8 * p, 4);
  std::memcpy(&second, xr + 8 * p + 4, 4);
  lo = _mm256_set1_epi32(first);
  hi = _mm256_set1_epi32(second);
}

inline __m256 group_sum_to_acc(__m256i isum, __m256 scale, __m256 min, bool has_mins, float dx, float dx_sum,
                               __m256 acc) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), acc);
  return has_mins ? _mm256_fmadd_ps(min, _mm256_set1_ps(dx_sum), acc) : acc;
}

// int4: 32-byte vector p of a tile-group holds, in bytes 4i..4i+3, row i's values k = 8p..8p+3 (low nibbles)
// and 8p+4..8p+7 (high). The maddubs pair sums of the whole group add up in int16 (at most
// 8 * 2 * 15 * 127 = 30480), then one madd with ones gives the 8 row sums in order.
template <int MR, bool Vnni>
void tile_int4(const TileArgs& a, float* out) {
  const auto* w = static_cast<const uint8_t*>(a.weight);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const bool has_mins = a.mins != nullptr || a.sub_mins != nullptr;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = w + g * 128;
    prefetch_lines(wg, 2);
    __m256i sums[MR];   // int16 pair sums, or (Vnni) the rows' int32 sums
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * p));
      const __m256i lo = _mm256_and_si256(v, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      for (int r = 0; r < MR; ++r) {
        __m256i x_lo, x_hi;
        broadcast_quads(a.xq + r * a.k + g * kGroup, p, x_lo, x_hi);
        if constexpr (Vnni) {
          sums[r] = dot4(dot4(p == 0 ? _mm256_setzero_si256() : sums[r], lo, x_lo), hi, x_hi);
        } else {
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi));
          sums[r] = p == 0 ? t : _mm256_add_epi16(sums[r], t);
          // Each vector's products join their row's sum at once: left alone, GCC 12 reassociated the int16
          // adds, kept every product of a group live and spilled them to the stack at 4 rows (16 ymm).
          asm("" : "+x"(sums[r]));
        }
      }
    }
    __m256 scale, min;
    group_factors(a, g, has_mins, scale, min);
    for (int r = 0; r < MR; ++r) {
      const int64_t at = r * a.groups + g;
      const __m256i isum = Vnni ? sums[r] : _mm256_madd_epi16(sums[r], ones);
      acc[r] = group_sum_to_acc(isum, scale, min, has_mins, a.dx[at], a.dx_sum[at], acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// int8: one row's group per 32-byte load; maddubs needs an unsigned operand, so |w| times x with w's sign.
// Two hadd levels leave rows 0..3 (and 4..7) in both lanes as partial sums; the lane swap adds them.
template <int MR>
void tile_int8(const TileArgs& a, float* out) {
  const auto* w = static_cast<const int8_t*>(a.weight);
  const __m256i ones = _mm256_set1_epi16(1);
  const bool has_mins = a.mins != nullptr || a.sub_mins != nullptr;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const int8_t* wg = w + g * 256;
    prefetch_lines(wg, 4);
    __m256i xv[MR], rows[MR][8];
    for (int r = 0; r < MR; ++r)
      xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + r * a.k + g * kGroup));
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * j));
      const __m256i magnitude = _mm256_sign_epi8(v, v);
      for (int r = 0; r < MR; ++r)
        rows[r][j] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv[r], v)), ones);
    }
    __m256 scale, min;
    group_factors(a, g, has_mins, scale, min);
    for (int r = 0; r < MR; ++r) {
      const __m256i* s = rows[r];
      const __m256i r03 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
      const __m256i r47 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
      const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(r03, r47, 0x20),
                                            _mm256_permute2x128_si256(r03, r47, 0x31));
      const int64_t at = r * a.groups + g;
      acc[r] = group_sum_to_acc(isum, scale, min, has_mins, a.dx[at], a.dx_sum[at], acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

// int6: the low nibbles unpack like int4's; the top two bits of the values in 32-byte vector p come from
// H[p / 2], shifted so that they land on bits 4-5. Vectors 0 and 1 hold the group's first 16-value half, 2 and
// 3 its second: a lane's int16 pair sums of one vector (below 2 * 2 * 63 * 127 = 32004) take one madd with
// that half's sub-scale of the lane's row.
template <int MR, bool Vnni>
void tile_int6(const TileArgs& a, float* out) {
  const auto* w = static_cast<const uint8_t*>(a.weight);
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  // shuffle controls: per int32 lane, its row's first (second) int16 sub-scale twice
  const __m256i pick_first = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                              0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i pick_second = _mm256_add_epi8(pick_first, _mm256_set1_epi8(2));
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* wg = w + g * 192;
    prefetch_lines(wg, 3);
    // int16 sub-scales: each row's (first, second) half side by side, rows 0..7 in order
    const __m256i sub = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.half_scales + g * 16)));
    const __m256i half_sub[2] = {_mm256_shuffle_epi8(sub, pick_first), _mm256_shuffle_epi8(sub, pick_second)};
    const __m256i high[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 128)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 160))};
    __m256i isum[MR], halves[MR][2];   // (Vnni) each half's int32 sums, weighed by its sub-scale once
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * p));
      const __m256i h = high[p / 2];
      __m256i lo_top, hi_top;   // bits 4-5 of the values in the low and the high nibbles
      if (p % 2 == 0) {
        lo_top = _mm256_slli_epi16(h, 4);
        hi_top = _mm256_slli_epi16(h, 2);
      } else {
        lo_top = h;
        hi_top = _mm256_srli_epi16(h, 2);
      }
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nibble), _mm256_and_si256(lo_top, top));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), _mm256_and_si256(hi_top, top));
      for (int r = 0; r < MR; ++r) {
        __m256i x_lo, x_hi;
        broadcast_quads(a.xq + r * a.k + g * kGroup, p, x_lo, x_hi);
        if constexpr (Vnni) {
          __m256i& h = halves[r][p / 2];
          h = dot4(dot4(p % 2 == 0 ? _mm256_setzero_si256() : h, lo, x_lo), hi, x_hi);
        } else {
          const __m256i t = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi)), half_sub[p / 2]);
          isum[r] = p == 0 ? t : _mm256_add_epi32(isum[r], t);
        }
      }
    }
    if constexpr (Vnni) {
      // per int32 lane (row): its first and its second half's sub-scale, sign-extended
      const __m256i first = _mm256_srai_epi32(_mm256_slli_epi32(sub, 16), 16), second = _mm256_srai_epi32(sub, 16);
      for (int r = 0; r < MR; ++r)
        isum[r] = _mm256_add_epi32(_mm256_mullo_epi32(halves[r][0], first), _mm256_mullo_epi32(halves[r][1], second));
    }
    const __m256 super = _mm256_loadu_ps(a.supers + (g / kSuper) * kTile);
    for (int r = 0; r < MR; ++r) {
      const int64_t at = r * a.groups + g;
      // per row: first sub-scale * first half's sum xq + second * second's, the offset's share
      const __m256i offset = _mm256_madd_epi16(sub, _mm256_set1_epi32(a.half_sums[at]));
      acc[r] = group_sum_to_acc(_mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5)), super, _mm256_setzero_ps(),
                                false, a.dx[at], 0.f, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * kTile, acc[r]);
}

#else  // portable path for hosts without AVX2: same layout, scalar loops

inline int32_t weight_q(const void* weight, int bits, int64_t g, int row, int i) {
  if (bits == 8) return static_cast<const int8_t*>(weight)[g * 256 + row * kGroup + i];
  const auto* tile_group = static_cast<const uint8_t*>(weight) + g * (bits == 4 ? 128 : 192);
  // value i sits in vector p = i / 8 at byte 4 * row + i % 4, in the high nibble when i % 8 >= 4
  const int p = i / 8, at = 4 * row + i % 4;
  const bool high = i % 8 >= 4;
  const uint8_t byte = tile_group[32 * p + at];
  const int32_t low = high ? byte >> 4 : byte & 0x0F;
  if (bits == 4) return low;
  // H[p / 2]: vector p's codes in bits 4 * (p % 2).., the high nibble's two bits above the low one's
  const uint8_t code = tile_group[128 + 32 * (p / 2) + at] >> (4 * (p % 2));
  return low | (((high ? code >> 2 : code) & 3) << 4);
}

// which = 0: scale, 1: min of (group g, tile row `row`)
inline float scalar_factor(const TileArgs& a, int64_t g, int row, int which) {
  if (a.subs == nullptr) return (which ? a.mins : a.scales)[g * kTile + row];
  const float* super = a.supers + ((g / kSuper) * a.super_count + which) * kTile;
  return super[row] * static_cast<float>((which ? a.sub_mins : a.subs)[g * kTile + row]);
}

template <int MR>
void tile_scalar(const TileArgs& a, int bits, float* out) {
  const bool has_mins = a.mins != nullptr || a.sub_mins != nullptr;
  std::fill(out, out + MR * kTile, 0.f);
  if (bits == 6) {
    for (int64_t g = 0; g < a.groups; ++g)
      for (int r = 0; r < MR; ++r)
        for (int row = 0; row < kTile; ++row) {
          const int8_t* xr = a.xq + r * a.k + g * kGroup;
          int32_t isum = 0;
          for (int i = 0; i < kGroup; ++i)
            isum += a.half_scales[(g * kTile + row) * 2 + i / kHalf] * (weight_q(a.weight, 6, g, row, i) - kInt6Offset) * xr[i];
          out[r * kTile + row] += a.supers[(g / kSuper) * kTile + row] * a.dx[r * a.groups + g] * static_cast<float>(isum);
        }
    return;
  }
  for (int64_t g = 0; g < a.groups; ++g)
    for (int r = 0; r < MR; ++r)
      for (int row = 0; row < kTile; ++row) {
        const int8_t* xr = a.xq + r * a.k + g * kGroup;
        int32_t isum = 0;
        for (int i = 0; i < kGroup; ++i) isum += weight_q(a.weight, bits, g, row, i) * xr[i];
        const int64_t at = r * a.groups + g;
        out[r * kTile + row] += scalar_factor(a, g, row, 0) * a.dx[at] * static_cast<float>(isum);
        if (has_mins) out[r * kTile + row] += scalar_factor(a, g, row, 1) * a.dx_sum[at];
      }
}

#endif

template <int MR>
void run_tile(const TileArgs& a, int bits, bool vnni, float* out) {
#ifdef __AVX2__
  if (bits == 4) vnni ? tile_int4<MR, true>(a, out) : tile_int4<MR, false>(a, out);
  else if (bits == 6) vnni ? tile_int6<MR, true>(a, out) : tile_int6<MR, false>(a, out);
  else tile_int8<MR>(a, out);
#else
  tile_scalar<MR>(a, bits, out);
#endif
}

void run_rows(const TileArgs& a, int bits, bool vnni, int rows, float* out) {
#if defined(__AVX2__) && defined(__AVX512VL__)
  if (bits == 4 && rows > kRowBlock) {
    switch (rows) {
      case 5: return vnni ? tile_int4<5, true>(a, out) : tile_int4<5, false>(a, out);
      case 6: return vnni ? tile_int4<6, true>(a, out) : tile_int4<6, false>(a, out);
      case 7: return vnni ? tile_int4<7, true>(a, out) : tile_int4<7, false>(a, out);
      default: return vnni ? tile_int4<8, true>(a, out) : tile_int4<8, false>(a, out);
    }
  }
#endif
  switch (rows) {
    case 1: return run_tile<1>(a, bits, vnni, out);
    case 2: return run_tile<2>(a, bits, vnni, out);
    case 3: return run_tile<3>(a, bits, vnni, out);
    default: return run_tile<kRowBlock>(a, bits, vnni, out);
  }
}

inline void point_at_rows(TileArgs& a, const Activations& act, int64_t m) {
  a.xq = act.q.data() + m * a.k;
  a.dx = act.dx.data() + m * a.groups;
  a.dx_sum = act.dx_sum.data() + m * a.groups;
  a.half_sums = act.half_sums.data() + m * a.groups;
}

// Matrix tiles (ops/cpu/quant_tiles.h) for two adjacent 8-row weight tiles (TileArgs with two-level factors in
// kernel form): acc [block, 16] = x rows m.. times the pair's 16 outputs. Each (row, output, group) gets the
// int32 sum the vector tiles compute and the same fp32 operations in the same order (scale * dx, then two
// fmas), so both paths give the same bits. Groups are unpacked just before their products, per 16 rows.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
inline __m512i join_bytes(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 join_floats(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// group g of both tiles as B (quant_tiles.h's layout)
inline void unpack_group(const TileArgs (&pair)[2], int bits, int64_t g, int8_t* b) {
  const int64_t group_bytes = bits == 4 ? 128 : 192;
  const auto* t0 = static_cast<const uint8_t*>(pair[0].weight) + g * group_bytes;
  const auto* t1 = static_cast<const uint8_t*>(pair[1].weight) + g * group_bytes;
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = join_bytes(t0 + 32 * p, t1 + 32 * p);
    __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if (bits == 6) {   // bits 4-5 from the code at H[p / 2], shifted by 4 * (p % 2); then the offset
      const int at = 128 + 32 * (p / 2);
      const __m512i h = join_bytes(t0 + at, t1 + at);
      const __m512i code = p % 2 ? _mm512_srli_epi16(h, 4) : h;
      lo = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(code, 4), top)), offset);
      hi = _mm512_sub_epi8(_mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(code, 2), top)), offset);
    }
    _mm512_store_si512(b + 128 * p, lo);
    _mm512_store_si512(b + 128 * p + 64, hi);
  }
}

// group g's 16 scales (and mins): two-level as sub * super, flat as stored, int6 the supers
__attribute__((always_inline)) inline void pair_factors(const TileArgs (&pair)[2], int bits, int64_t g, bool has_mins,
                                                       __m512& scale, __m512& min) {
  const TileArgs &a = pair[0], &b = pair[1];
  if (bits == 6) {
    scale = join_floats(a.supers + (g / kSuper) * kTile, b.supers + (g / kSuper) * kTile);
  } else if (a.subs != nullptr) {
    const int64_t at = (g / kSuper) * a.super_count * kTile;
    auto times_super = [&](const uint8_t* s0, const uint8_t* s1, int which) {
      const __m128i sub = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s0 + g * kTile)),
                                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s1 + g * kTile)));
      return _mm512_mul_ps(join_floats(a.supers + at + which * kTile, b.supers + at + which * kTile),
                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub)));
    };
    scale = times_super(a.subs, b.subs, 0);
    if (has_mins) min = times_super(a.sub_mins, b.sub_mins, 1);
  } else {
    scale = join_floats(a.scales + g * kTile, b.scales + g * kTile);
    if (has_mins) min = join_floats(a.mins + g * kTile, b.mins + g * kTile);
  }
}

template <int MR>
void tile_pair_rows(const TileArgs (&pair)[2], int bits, const mtile::Products& products, const Activations& act,
                    int64_t m, int block, float* acc) {
  constexpr int kC = mtile::kCols;
  const int64_t k = pair[0].k, groups = pair[0].groups;
  const bool has_mins = pair[0].sub_mins != nullptr || pair[0].mins != nullptr;
  const int8_t* xq = act.q.data() + m * k;
  const float* dx = act.dx.data() + m * groups;
  const float* dx_sum = act.dx_sum.data() + m * groups;
  alignas(64) int8_t b[3][2 * mtile::kGroupB];          // three units' B
  alignas(64) int32_t c[2][2][mtile::kRows * kC];   // two units' products
  __m512 sum[MR], scale, min = _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) sum[r] = _mm512_setzero_ps();
  auto add_group = [&](int64_t g, const int32_t* sums) {
    pair_factors(pair, bits, g, has_mins, scale, min);
    for (int r = 0; r < MR; ++r) {
      const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kC));
      sum[r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * groups + g])), sum[r]);
      if (has_mins) sum[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(dx_sum[r * groups + g]), sum[r]);
    }
  };
  // a unit is two groups (int4; an odd last group is computed twice, added once) or one group's two halves
  // (int6). The stages of three units overlap: unit u's sums are added while u + 1's products run and u + 2
  // is unpacked, so neither the vector stores before a tile load nor a tile store before the vector loads stall.
  const int64_t units = bits == 4 ? (groups + 1) / 2 : groups;
  auto unpack = [&](int64_t u) {
    int8_t* bu = b[u % 3];
    if (bits == 4) {
      unpack_group(pair, bits, 2 * u, bu);
      unpack_group(pair, bits, std::min(2 * u + 1, groups - 1), bu + mtile::kGroupB);
    } else {
      unpack_group(pair, bits, u, bu);
    }
  };
  auto multiply = [&](int64_t u) {
    const int8_t* bu = b[u % 3];
    int32_t* c0 = c[u % 2][0];
    int32_t* c1 = c[u % 2][1];
    if (bits == 4)
      products.two(xq + 2 * u * kGroup, bu, xq + std::min(2 * u + 1, groups - 1) * kGroup, bu + mtile::kGroupB, k,
                   c0, c1);
    else
      products.two(xq + u * kGroup, bu, xq + u * kGroup + kHalf, bu + mtile::kGroupB / 2, k, c0, c1);
  };
  auto finish = [&](int64_t u) {
    int32_t* c0 = c[u % 2][0];
    const int32_t* c1 = c[u % 2][1];
    if (bits == 4) {
      add_group(2 * u, c0);
      if (2 * u + 1 < groups) add_group(2 * u + 1, c1);
      return;
    }
    // int6: the halves' sums weighed by their sub-scales; per int32 lane (output) its first and its second
    // half's sub-scale, as the vector tiles take them
    const __m512i sub = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair[0].half_scales + u * 16))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(pair[1].half_scales + u * 16)), 1));
    const __m512i first = _mm512_srai_epi32(_mm512_slli_epi32(sub, 16), 16), second = _mm512_srai_epi32(sub, 16);
    for (int r = 0; r < MR; ++r) {
      const __m512i h0 = _mm512_load_si512(c0 + r * kC), h1 = _mm512_load_si512(c1 + r * kC);
      _mm512_store_si512(c0 + r * kC, _mm512_add_epi32(_mm512_mullo_epi32(h0, first), _mm512_mullo_epi32(h1, second)));
    }
    add_group(u, c0);
  };
  unpack(0);
  if (units > 1) unpack(1);
  multiply(0);
  for (int64_t u = 0; u < units; ++u) {
    if (u + 1 < units) multiply(u + 1);
    if (u + 2 < units) unpack(u + 2);
    finish(u);
  }
  for (int r = 0; r < block; ++r) _mm512_storeu_ps(acc + r * kC, sum[r]);
}

void tile_pair(const TileArgs (&pair)[2], int bits, const mtile::Products& products, const Activations& act,
               int64_t m, int block, float* acc) {
  if (block <= 8) tile_pair_rows<8>(pair, bits, products, act, m, block, acc);
  else if (block <= 12) tile_pair_rows<12>(pair, bits, products, act, m, block, acc);
  else tile_pair_rows<mtile::kRows>(pair, bits, products, act, m, block, acc);
}
#else   // the same sums and fp32 operations as plain loops (AVX-512 is what the tiles are fast with)
void tile_pair(const TileArgs (&pair)[2], int bits, const mtile::Products& products, const Activations& act,
               int64_t m, int block, float* acc) {
  constexpr int kC = mtile::kCols;
  const int64_t k = pair[0].k, groups = pair[0].groups;
  const bool has_mins = pair[0].sub_mins != nullptr || pair[0].mins != nullptr;
  const int8_t* xq = act.q.data() + m * k;
  alignas(64) int8_t b[mtile::kGroupB];
  alignas(64) int32_t c[2][mtile::kRows * kC];
  std::fill(acc, acc + block * kC, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t group_bytes = bits == 4 ? 128 : 192;
    const auto* t0 = static_cast<const uint8_t*>(pair[0].weight) + g * group_bytes;
    const auto* t1 = static_cast<const uint8_t*>(pair[1].weight) + g * group_bytes;
    if (bits == 4) {
      mtile::unpack_int4(t0, t1, b);
      products.two(xq + g * kGroup, b, xq + g * kGroup, b, k, c[0], c[1]);
    } else {
      mtile::unpack_int6(t0, t1, b);
      products.two(xq + g * kGroup, b, xq + g * kGroup + kHalf, b + mtile::kGroupB / 2, k, c[0], c[1]);
    }
    for (int j = 0; j < kC; ++j) {
      const TileArgs& a = pair[j / kTile];
      const int i = j % kTile;
      float scale, min = 0.f;
      if (bits == 6) {
        scale = a.supers[(g / kSuper) * kTile + i];
        const int8_t* half = a.half_scales + (g * kTile + i) * 2;
        for (int r = 0; r < block; ++r) c[0][r * kC + j] = c[0][r * kC + j] * half[0] + c[1][r * kC + j] * half[1];
      } else if (a.subs != nullptr) {
        const float* super = a.supers + (g / kSuper) * a.super_count * kTile;
        scale = super[i] * static_cast<float>(a.subs[g * kTile + i]);
        if (has_mins) min = super[kTile + i] * static_cast<float>(a.sub_mins[g * kTile + i]);
      } else {
        scale = a.scales[g * kTile + i];
        if (has_mins) min = a.mins[g * kTile + i];
      }
      for (int r = 0; r < block; ++r) {
        float& out = acc[r * kC + j];
        out = std::fma(static_cast<float>(c[0][r * kC + j]), scale * act.dx[(m + r) * groups + g], out);
        if (has_mins) out = std::fma(min, act.dx_sum[(m + r) * groups + g], out);
      }
    }
  }
}
#endif

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& supers,
                        int64_t bits, int64_t out_features, std::optional<bool> vnni_opt,
                        std::optional<bool> matrix_opt) {
  const char* op = "pagedserve_cpu::quant_linear";
#ifdef __AVX2__
  const bool vnni = vnni_opt.value_or(kHasVnni);   // false: the maddubs tiles (tests run both)
#else
  const bool vnni = false;
#endif
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, op, ": bits=", bits, "; allowed: 4, 6, 8");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kGroup == 0, op,
              ": x must be contiguous [M, K] with K a multiple of 32, got ", x.sizes());
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup, tiles = qweight.size(0);
  const int64_t group_bytes = kTile * kGroup * bits / 8;
  TORCH_CHECK(qweight.dim() == 3 && qweight.is_contiguous() && qweight.size(1) == groups &&
                  qweight.size(2) == group_bytes && qweight.element_size() == 1,
              op, ": qweight must be contiguous 1-byte [tiles, ", groups, ", ", group_bytes, "], got ", qweight.sizes());
  const bool has_mins = mins.has_value() && mins->defined();
  const bool two_level = supers.has_value() && supers->defined();
  const bool int6 = bits == 6;
  TORCH_CHECK(!int6 || (two_level && !has_mins), op, ": bits=6 needs supers and takes no mins");
  const auto factor_type = int6 ? at::kChar : two_level ? at::kByte : at::kFloat;
  const int64_t factor_dim = int6 ? 4 : 3;   // int6: a sub-scale per half group, [tiles, groups, 8, 2]
  for (const at::Tensor* t : {&scales, has_mins ? &*mins : &scales})
    TORCH_CHECK(t->scalar_type() == factor_type && t->is_contiguous() && t->dim() == factor_dim &&
                    t->size(0) == tiles && t->size(1) == groups && t->size(2) == kTile && (!int6 || t->size(3) == 2),
                op, ": scales and mins must be contiguous ", factor_type, " [", tiles, ", ", groups, ", 8",
                int6 ? ", 2]" : "]", ", got ", t->scalar_type(), " ", t->sizes());
  const int64_t super_count = has_mins ? 2 : 1, super_blocks = (groups + kSuper - 1) / kSuper;
  if (two_level)
    TORCH_CHECK((!int6 || groups % kSuper == 0) && supers->scalar_type() == at::kFloat && supers->is_contiguous() &&
                    supers->dim() == 4 && supers->size(0) == tiles && supers->size(1) == super_blocks &&
                    supers->size(2) == super_count && supers->size(3) == kTile,
                op, ": supers must be contiguous float32 [", tiles, ", ", super_blocks, ", ", super_count,
                ", 8] (int6: K a multiple of 256), got ", supers->sizes());
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile, op, ": out_features=",
              out_features, " does not fit ", tiles, " tiles of 8 rows");
  // matrix tiles: asked for (emulated without AMX), or by default where AMX runs and the call has enough rows
  const bool amx = mtile::hardware();
  const bool matrix = bits != 8 && matrix_opt.value_or(amx && rows >= kMatrixRows);
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  PAGEDSERVE_DISPATCH_F32_BF16(x.scalar_type(), op, [&] {
    const Activations act = quantize_activations(static_cast<const scalar_t*>(x.data_ptr()), rows,
                                                 matrix ? (rows + mtile::kRows - 1) / mtile::kRows * mtile::kRows : rows, k);
    auto* y = static_cast<scalar_t*>(out.data_ptr());
    const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
    // two-level: uint8 (int6: int8) sub-values and their supers; flat: the fp32 factors themselves
    const auto* subs = two_level ? static_cast<const uint8_t*>(scales.data_ptr()) : nullptr;
    const auto* sub_mins = two_level && has_mins ? mins->data_ptr<uint8_t>() : nullptr;
    const float* sup = two_level ? supers->data_ptr<float>() : nullptr;
    const float* flat_scales = two_level ? nullptr : scales.data_ptr<float>();
    const float* flat_mins = !two_level && has_mins ? mins->data_ptr<float>() : nullptr;
    const int64_t tile_factors = groups * kTile;
    const int block_rows = row_block(bits);
    const int64_t chunk = std::max<int64_t>(kInt4RowBlock, kChunkBytes / k / kInt4RowBlock * kInt4RowBlock);
    const bool in_kernel = int6 || (two_level && rows <= block_rows);   // see expand_factors
    // tile t's weights and factors; two-level factors multiplied out into `expanded` unless `in_kernel`
    auto tile_args = [&](int64_t t, bool in_kernel, std::vector<float>& expanded) {
      TileArgs args{w + t * groups * group_bytes, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, k, groups};
      const float* tile_supers = two_level ? sup + t * super_blocks * super_count * kTile : nullptr;
      if (int6) {
        args.half_scales = reinterpret_cast<const int8_t*>(subs) + t * tile_factors * 2;
        args.supers = tile_supers;
      } else if (two_level && in_kernel) {
        args.subs = subs + t * tile_factors;
        args.sub_mins = has_mins ? sub_mins + t * tile_factors : nullptr;
        args.supers = tile_supers;
        args.super_count = super_count;
      } else if (two_level) {
        expand_factors(subs + t * tile_factors, tile_supers, 0, super_count, groups, expanded.data());
        args.scales = expanded.data();
        if (has_mins) {
          expand_factors(sub_mins + t * tile_factors, tile_supers, 1, super_count, groups,
                         expanded.data() + tile_factors);
          args.mins = expanded.data() + tile_factors;
        }
      } else {
        args.scales = flat_scales + t * tile_factors;
        args.mins = has_mins ? flat_mins + t * tile_factors : nullptr;
      }
      return args;
    };
    auto write = [&](const float* acc, int64_t m, int block, int64_t n0, int64_t width) {
      const int64_t valid = std::min(width, out_features - n0);
      for (int r = 0; r < block; ++r)
        for (int64_t j = 0; j < valid; ++j) y[(m + r) * out_features + n0 + j] = from_float<scalar_t>(acc[r * width + j]);
    };
    // tile t times x rows [m0, m_end) on the vector kernels, block_rows rows at a time
    auto vector_rows = [&](TileArgs& args, int64_t t, int64_t m0, int64_t m_end, float* acc) {
      for (int64_t m = m0; m < m_end; m += block_rows) {
        const int block = static_cast<int>(std::min<int64_t>(block_rows, m_end - m));
        point_at_rows(args, act, m);
        run_rows(args, static_cast<int>(bits), vnni, block, acc);
        write(acc, m, block, t * kTile, kTile);
      }
    };
    if (matrix) {
      // tile pairs, then a lone last tile on the vector kernels
      const int64_t pairs = tiles / 2, tile_chunk = std::max<int64_t>(mtile::kRows, chunk / mtile::kRows * mtile::kRows);
      at::parallel_for(0, pairs + tiles % 2, 1, [&](int64_t begin, int64_t end) {
        const mtile::Products products(int6 ? kHalf : kGroup, static_cast<int>(std::min<int64_t>(rows, mtile::kRows)), amx);
        std::vector<float> unused;
        float acc[mtile::kRows * mtile::kCols];
        for (int64_t m0 = 0; m0 < rows; m0 += tile_chunk) {
          const int64_t m_end = std::min(rows, m0 + tile_chunk);
          for (int64_t i = begin; i < end; ++i) {
            if (i == pairs) {
              TileArgs args = tile_args(2 * i, true, unused);
              vector_rows(args, 2 * i, m0, m_end, acc);
              continue;
            }
            const TileArgs pair[2] = {tile_args(2 * i, true, unused), tile_args(2 * i + 1, true, unused)};
            for (int64_t m = m0; m < m_end; m += mtile::kRows) {
              const int block = static_cast<int>(std::min<int64_t>(mtile::kRows, m_end - m));
              tile_pair(pair, static_cast<int>(bits), products, act, m, block, acc);
              write(acc, m, block, 2 * i * kTile, mtile::kCols);
            }
          }
        }
      });
      return;
    }
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      float acc[kInt4RowBlock * kTile];
      std::vector<float> expanded(two_level && !in_kernel ? tile_factors * super_count : 0);
      for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t m_end = std::min(rows, m0 + chunk);
        for (int64_t t = begin; t < end; ++t) {
          TileArgs args = tile_args(t, in_kernel, expanded);
          vector_rows(args, t, m0, m_end, acc);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? supers, int bits, "
        "int out_features, bool? vnni=None, bool? matrix=None) -> Tensor",
        &quant_linear);
  m.def("quant_linear_matrix_rows() -> int", [] { return mtile::hardware() ? kMatrixRows : int64_t{0}; });
}

// The decode attention for bf16 queries against a bf16 cache on CPUs with AMX (ops/cpu/paged_attention.cpp's
// run_amx calls it). With VDPBF16PS (attention_tile.h's Avx512Bf16) one position of one kv head against a
// GQA group of 6 heads is 48 instructions, and the arithmetic, not the memory, set the pace; one TDPBF16PS
// does the work of 256 of them. The cache keeps its row order ([block, slot, kv head, dim]):
//  - scores: the K rows of 16 slots are the A tile as they lie in the cache (16 rows of 32 values, strided by
//    the slot), the B tile the G queries' values in pairs (staged once per row; the groups of as many tokens
//    of a prefill or verify row as fit in 16 columns side by side), so one tile product adds 32 values'
//    share to 16 slots x G scores. A chunk of up to 8 such tiles (128 positions) is scored and stored, then
//    gathered into one vector of 16 positions per head for the softmax.
//  - values: the A tile the G heads' softmax weights of 32 positions (bf16, one row per head), the B tile
//    the V rows of those positions paired position by position (two unpacks per 32 values of a pair, which
//    pair within 128-bit lanes: an output tile's columns hold a head's values in the order of
//    paged_attention.cpp's acc_index), one output tile per 16 values of the head. 4 output tiles live at
//    once, so a chunk is read in passes of 64 values, each pass reading its own cache lines of the V rows.
// The weights of a chunk are taken relative to the running max once the chunk is scored; the output tiles
// start from zero per chunk and are added to the fp32 accumulators with the chunk's correction. The slots a
// chunk on are prefetched into L2 while a chunk is read, all of a tile's bytes in memory order, each kv head
// a share (block tables scatter blocks, which the hardware prefetchers cannot follow).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "amx.h"
#include "simd.h"

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__) && defined(PAGEDSERVE_AMX_TILE) && defined(__AMX_BF16__)
#define PAGEDSERVE_AMX 1

namespace pagedserve_cpu::attention_amx {

using namespace pagedserve_cpu::simd;

constexpr int kTile = 16;            // positions per score tile (A rows), per output tile (values)
constexpr int kPairs = 16;           // pairs of values per tile row: 32 bf16 = 64 bytes
constexpr int kChunkTiles = 8;
constexpr int kChunk = kChunkTiles * kTile;   // positions per softmax update
constexpr int kMaxGroup = 16;        // query heads: the B tile's columns (scores), the A tile's rows (values)
constexpr int kOutTiles = 4;         // output tiles live at once: 64 values of a head per pass
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The tile shapes for G query heads (a GQA group, or the groups of a few tokens side by side): tmm0 scores
// (16 slots x G), tmm1 K rows or paired V rows (16 x 64 bytes), tmm2 the queries in pairs (16 pairs x G), tmm3
// the weights (G heads x 32 positions), tmm4..7 outputs (G heads x 16 values).
inline amx::TileConfig tile_config(int columns) {
  amx::TileConfig config;
  config.set(0, kTile, 4 * columns);
  config.set(1, kTile, 64);
  config.set(2, kPairs, 4 * columns);
  config.set(3, columns, 64);
  for (int t = 4; t < 4 + kOutTiles; ++t) config.set(t, columns, 64);
  return config;
}

// Tokens whose GQA groups share the tiles' columns: as many as fit in 16.
inline int tokens_per_tile(int64_t group) { return static_cast<int>(std::max<int64_t>(1, kMaxGroup / group)); }

// The queries of `count` consecutive tokens (q: the first; `columns` = tokens_per_tile * group) as B tiles:
// per kv head and 32 values of a head, 16 rows of `columns` pairs (q[2r], q[2r + 1]), token by token, each
// token's group in head order; the columns of missing tokens hold zeros.
inline void stage_queries(const c10::BFloat16* q, int64_t count, int64_t kv_heads, int64_t group, int64_t dim,
                          int64_t columns, std::vector<uint32_t>& out) {
  out.assign(kv_heads * columns * dim / 2, 0);
  const auto* bits = reinterpret_cast<const uint16_t*>(q);
  uint32_t* o = out.data();
  for (int64_t kv = 0; kv < kv_heads; ++kv)
    for (int64_t c = 0; c < dim; c += 2 * kPairs)
      for (int r = 0; r < kPairs; ++r, o += columns)
        for (int64_t t = 0; t < count; ++t)
          for (int64_t g = 0; g < group; ++g) {
            const uint16_t* h = bits + ((t * kv_heads + kv) * group + g) * dim + c + 2 * r;
            o[t * group + g] = h[0] | static_cast<uint32_t>(h[1]) << 16;
          }
}

// The query heads of a chunk's columns: where column g's accumulators (head_dim values), running max and
// sum are, and how many of the chunk's positions it sees (the tokens of a prefill row end at different
// places of their last chunk). Columns past `count` are not read.
struct Heads {
  float* acc[kMaxGroup];
  float* max[kMaxGroup];
  float* sum[kMaxGroup];
  int n[kMaxGroup];
  int count;
};

// The slots of one chunk of one kv head: tile t's K and V rows start at k[t], v[t] (slot stride `stride`
// values); `n` positions, the most any column sees. k_ahead[t] / v_ahead[t]: this kv head's share of the
// bytes of the 16 slots of tile t a chunk on, all kv heads' rows as they lie in memory (null past the row's
// end), `ahead_bytes` long.
struct Chunk {
  const c10::BFloat16* k[kChunkTiles];
  const c10::BFloat16* v[kChunkTiles];
  const char* k_ahead[kChunkTiles];
  const char* v_ahead[kChunkTiles];
  int64_t stride, ahead_bytes;
  int n;
};

// Per thread.
struct Scratch {
  alignas(64) float tile[kChunkTiles * kTile * kMaxGroup];   // a chunk's score tiles as stored: [tile][slot][head]
  alignas(64) float scores[kMaxGroup * kChunk];        // [head][position]
  alignas(64) uint16_t weights[kMaxGroup * kChunk];    // bf16 [head][position]: rows of the weight tiles
  alignas(64) uint16_t paired[kOutTiles * kPairs * 2 * kTile];   // V rows of 32 positions, one B tile per 16 values
  alignas(64) float out[kMaxGroup * kOutTiles * kTile];          // output tiles as stored: [head][64 values]
  float corr[kMaxGroup];
};

// Step i of prefetching the `lines` 64-byte lines at p into L2 in memory order, `per` lines a step.
PAGEDSERVE_INLINE void prefetch_step(const char* p, int64_t i, int64_t per, int64_t lines) {
  if (p)
    for (int64_t l = i * per; l < std::min((i + 1) * per, lines); ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
}

// Scores of the chunk's tiles into s.scores, times `scale`: [column][position], the first `count` columns.
inline void score_chunk(const uint32_t* queries, const Chunk& c, int columns, int count, int64_t dim, float scale,
                        Scratch& s) {
  const int64_t row_bytes = c.stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t lines = c.ahead_bytes / 64, steps = dim / (2 * kPairs), per = (lines + steps - 1) / steps;
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(kMaxGroup));
  for (int t = 0; t * kTile < c.n; ++t) {
    _tile_zero(0);
    for (int64_t d = 0; d < dim; d += 2 * kPairs) {
      prefetch_step(c.k_ahead[t], d / (2 * kPairs), per, lines);
      _tile_loadd(1, c.k[t] + d, row_bytes);
      _tile_loadd(2, queries + d / 2 * columns, 4 * columns);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, s.tile + t * kTile * kMaxGroup, 4 * kMaxGroup);
  }
  for (int t = 0; t * kTile < c.n; ++t)     // all tiles stored first: a load right after a tile store waits
    for (int g = 0; g < count; ++g) {
      const float* tile = s.tile + t * kTile * kMaxGroup;
      const __m512 x = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(g)), tile, 4);
      _mm512_store_ps(s.scores + g * kChunk + t * kTile, _mm512_mul_ps(x, _mm512_set1_ps(scale)));
    }
}

// The online-softmax update of the heads over the chunk's scores: running max and sum, the accumulators'
// correction in s.corr, the weights (bf16, positions past the head's n weigh 0) in s.weights.
inline void softmax_chunk(const Chunk& c, const Heads& heads, Scratch& s) {
  const int vectors = (c.n + kTile - 1) / kTile;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int g = 0; g < heads.count; ++g) {
    float* run_max = heads.max[g];
    float* run_sum = heads.sum[g];
    __m512 x[kChunkTiles + 1];
    __m512 top = _mm512_set1_ps(kNegInf);
    for (int i = 0; i < vectors; ++i) {
      const __mmask16 real = _mm512_cmplt_epi32_mask(lanes, _mm512_set1_epi32(heads.n[g] - i * kTile));
      x[i] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), real, _mm512_load_ps(s.scores + g * kChunk + i * kTile));
      top = _mm512_max_ps(top, x[i]);
    }
    x[vectors] = _mm512_set1_ps(kNegInf);
    const float m = std::max(*run_max, _mm512_reduce_max_ps(top));
    s.corr[g] = exp_nonpositive<Scalar>(*run_max - m);     // -inf on the first chunk: 0
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < vectors; i += 2) {
      const __m512 a = exp_nonpositive<Avx512>(_mm512_sub_ps(x[i], _mm512_set1_ps(m)));
      const __m512 b = exp_nonpositive<Avx512>(_mm512_sub_ps(x[i + 1], _mm512_set1_ps(m)));
      total = _mm512_add_ps(total, _mm512_add_ps(a, b));
      _mm512_store_si512(s.weights + g * kChunk + i * kTile, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    *run_sum = *run_sum * s.corr[g] + _mm512_reduce_add_ps(total);
    *run_max = m;
  }
}

// Output tile i of a pass lives in tmm(4 + i): the tile intrinsics take their registers as literal numbers.
#define PAGEDSERVE_OUT_TILES(OP) OP(0, 4) OP(1, 5) OP(2, 6) OP(3, 7)

// acc[g][d0 .. d0 + 16 * Tiles) = acc * corr[g] + the chunk's weighted values: per 32 positions, their V
// rows paired position by position (positions past the chunk's n as zeros, whatever their slots hold) into
// one B tile per 16 values, against the 32 weights of each head.
template <int Tiles>
PAGEDSERVE_INLINE void add_values(const Chunk& c, const Heads& heads, int64_t dim, int64_t d0, Scratch& s) {
  static_assert(Tiles % 2 == 0, "the unpacks fill two output tiles from each 32 values of a V row");
  constexpr int kPass = kOutTiles * kTile, kRow = 2 * kTile;     // values per pass; bf16 per B tile row
  const int64_t passes = (dim + kPass - 1) / kPass, pass = d0 / kPass;
  const int64_t lines = c.ahead_bytes / 64, per = (lines + passes * kPairs - 1) / (passes * kPairs);
#define PAGEDSERVE_ZERO(i, reg) \
  if constexpr (Tiles > i) _tile_zero(reg);
  PAGEDSERVE_OUT_TILES(PAGEDSERVE_ZERO)
#undef PAGEDSERVE_ZERO
  for (int p0 = 0; p0 < c.n; p0 += 2 * kPairs) {
    for (int r = 0; r < kPairs; ++r) {
      const int a = p0 + 2 * r, b = a + 1, t = a / kTile;      // (a and b share a tile)
      prefetch_step(c.v_ahead[t], pass * kPairs + r, per, lines);
      prefetch_step(c.v_ahead[t ^ 1], pass * kPairs + r, per, lines);
      for (int i = 0; i < Tiles; i += 2) {
        const int64_t at = d0 + i * kTile;
        const __m512i x = a < c.n ? _mm512_loadu_si512(c.v[t] + a % kTile * c.stride + at) : _mm512_setzero_si512();
        const __m512i y = b < c.n ? _mm512_loadu_si512(c.v[t] + b % kTile * c.stride + at) : _mm512_setzero_si512();
        _mm512_store_si512(s.paired + (i * kPairs + r) * kRow, _mm512_unpacklo_epi16(x, y));
        _mm512_store_si512(s.paired + ((i + 1) * kPairs + r) * kRow, _mm512_unpackhi_epi16(x, y));
      }
    }
    _tile_loadd(3, s.weights + p0, kChunk * sizeof(uint16_t));
#define PAGEDSERVE_PRODUCT(i, reg)                          \
  if constexpr (Tiles > i) {                                \
    _tile_loadd(1, s.paired + i * kPairs * kRow, 64);       \
    _tile_dpbf16ps(reg, 3, 1);                              \
  }
    PAGEDSERVE_OUT_TILES(PAGEDSERVE_PRODUCT)
#undef PAGEDSERVE_PRODUCT
  }
  constexpr int out_bytes = kPass * sizeof(float);
#define PAGEDSERVE_STORE(i, reg) \
  if constexpr (Tiles > i) _tile_stored(reg, s.out + i * kTile, out_bytes);
  PAGEDSERVE_OUT_TILES(PAGEDSERVE_STORE)
#undef PAGEDSERVE_STORE
  for (int g = 0; g < heads.count; ++g) {
    const __m512 corr = _mm512_set1_ps(s.corr[g]);
    for (int i = 0; i < Tiles; ++i) {
      float* a = heads.acc[g] + d0 + i * kTile;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), corr, _mm512_load_ps(s.out + g * kPass + i * kTile)));
    }
  }
}

// One chunk of one kv head against the query heads in the tiles' `columns` (as configured): queries as
// staged for the kv head. head_dim is a multiple of 32 (the caller checks), so a pass of 64 values may
// leave 32.
inline void attend_chunk(const uint32_t* queries, const Chunk& c, int columns, const Heads& heads, int64_t dim,
                         float scale, Scratch& s) {
  score_chunk(queries, c, columns, heads.count, dim, scale, s);
  softmax_chunk(c, heads, s);
  int64_t d0 = 0;
  for (; d0 + kOutTiles * kTile <= dim; d0 += kOutTiles * kTile) add_values<kOutTiles>(c, heads, dim, d0, s);
  if (d0 < dim) add_values<2>(c, heads, dim, d0, s);
}

#undef PAGEDSERVE_OUT_TILES

}  // namespace pagedserve_cpu::attention_amx

#endif

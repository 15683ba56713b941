// Decode rows of pagedserve::paged_attention (one new token per row) against the paged K/V cache, for K/V
// stored as fp32, bf16 or fp16 (each K/V vector widened to fp32 in registers as it is read; attention_tile.h),
// or as q8_0 / q4_0 rows kept in tiles of 16 slots of one kv head (kv_quant.h): on CPUs with AVX-512 VNNI read
// with integer dot products a chunk of 4 tiles at a time (attention_int8.h), on the Avx2 set the same way with
// VPMADDWD (attention_int16.h; both through run_chunks), elsewhere dequantized to fp32 in registers tile by
// tile (attention_quant.h, run_quant). The softmax and accumulators stay in fp32.
// Quantized K is stored rotated (a 32-point Hadamard transform per block), so the queries are rotated the
// same way as they are staged; V is not rotated, so outputs need nothing. bf16 queries against a bf16 cache
// use AMX tile products where the CPU has them (attention_amx.h, run_amx; blocks of a multiple of 16 slots),
// else the bf16 dot products where it has those (simd.h's Avx512Bf16).
//
// A row of several new tokens (up to the caller's `max_tokens`: speculative verify rows, and on AVX-512 CPUs
// prefill chunks) is attended as one decode row per token, each over the context its token sees (causal),
// where torch's SDPA with a bottom-right causal mask cost ~30x a decode row per layer for a verify row. Its
// tokens of as many blocks take the same positions in turn, so their K/V come from memory once per group.
//
// Flash-decoding: each long decode row is cut into up to one piece per thread (by its own length only: the
// batch beside a row never changes its rounding) and the threads take equal runs of pieces, so a single long row
// keeps every core busy and ragged rows balance. A piece keeps a running max, sum and unnormalised output
// per query head; the pieces of a row that was cut are merged at the end.
// Within a piece the kernel walks the row's blocks; for each kv head it scores and accumulates the G query
// heads of the GQA group together (register tiles of G heads x a few keys), so K/V come from memory once,
// while a later block is prefetched (block tables scatter blocks, which the hardware prefetcher cannot
// follow). Queries and outputs are kept in the lane order of simd.h's `lane`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_int16.h"
#include "attention_int8.h"
#include "attention_quant.h"
#include "attention_rows.h"
#include "attention_tile.h"

namespace {

using namespace pagedserve_cpu::attention;
namespace kv_quant = pagedserve_cpu::kv_quant;
namespace attention_quant = pagedserve_cpu::attention_quant;
using kv_quant::kQuant;
#ifdef PAGEDSERVE_INT8_DOT
namespace attention_int8 = pagedserve_cpu::attention_int8;
#endif
#ifdef PAGEDSERVE_AMX
namespace attention_amx = pagedserve_cpu::attention_amx;
#endif

constexpr int64_t kMinPiece = 256;  // positions below which a piece of a row is not worth a thread of its own
// How far ahead of the block being read its row's K/V is prefetched, in bytes (2 to 8 blocks): a distance in
// blocks undershot small blocks (few kv heads, short heads), whose loads then waited on memory.
constexpr int64_t kAheadBytes = 32 << 10;
// Positions a token of a group attends before the next token takes them (Decode::operator()): a whole number
// of every set's chunks, and few enough that a group's K/V stay in the core's L2 between its tokens.
constexpr int64_t kStep = 128;
static_assert(kStep % kTile == 0 && kStep % kv_quant::kTile == 0 && kStep % kv_quant::kChunk == 0);
#ifdef PAGEDSERVE_AMX
static_assert(kStep % pagedserve_cpu::attention_amx::kChunk == 0);
#endif

struct Cache {
  int64_t block_stride, slot_stride, head_stride, num_blocks, block_size, dim;
};

// Running state of one share of one row: per query head the max, sum and unnormalised output.
struct Partial {
  std::vector<float> max, sum, acc;
  void reset(int64_t heads, int64_t dim) {
    max.assign(heads, kNegInf);
    sum.assign(heads, 0.f);
    acc.assign(heads * dim, 0.f);
  }
};

// The set of attention_int8.h: integer dot products for quantized caches (scores and values).
#ifdef PAGEDSERVE_INT8_DOT
struct Int8Dot : Avx512 {};
using Int8Queries = attention_int8::Queries;
using Int8Scratch = attention_int8::Scratch;
#else
struct Int8Dot {};
struct Int8Queries {};
struct Int8Scratch {};
#endif
template <class S>
constexpr bool kInt8 = std::is_same_v<S, Int8Dot>;

// The Avx2 set reads quantized caches with attention_int16.h's integer products.
#ifdef PAGEDSERVE_AVX2
namespace attention_int16 = pagedserve_cpu::attention_int16;
template <class S, class C>
constexpr bool kInt16 = std::is_same_v<S, Avx2> && kQuant<C>;
using Int16Queries = attention_int16::Queries;
using Int16Scratch = attention_int16::Scratch;
template <class S, class C>
constexpr int64_t kGroupPass = kInt16<S, C> ? attention_int16::kMaxGroup : kMaxGroup;   // heads per pass
#ifdef PAGEDSERVE_INT8_DOT
static_assert(pagedserve_cpu::attention_int8::kMaxGroup == kMaxGroup);   // Int8Dot's pass is the default
#endif
#else
template <class S, class C>
constexpr bool kInt16 = false;
template <class S, class C>
constexpr int64_t kGroupPass = kMaxGroup;
struct Int16Queries {};
struct Int16Scratch {};
#endif

// The set of attention_amx.h: tile products for bf16 queries against a bf16 cache.
#ifdef PAGEDSERVE_AMX
struct AmxBf16 : Avx512 {};
using AmxScratch = attention_amx::Scratch;
#else
struct AmxBf16 {};
struct AmxScratch {};
#endif
template <class S>
constexpr bool kAmx = std::is_same_v<S, AmxBf16>;

// A row's queries as a set reads them: in the keys' lane order (fp32, or bf16 for the dot-product set), as
// int8 blocks (Int8Dot; int16 for the Avx2 set's quantized kernel), or as B tiles (AmxBf16).
template <class S>
struct Staged {
  std::vector<Query<S>> values;
  Int8Queries int8;
  Int16Queries int16;
  std::vector<uint32_t> tiles;
};

// One thread's scratch for whichever set runs.
template <class S>
struct ThreadScratch {
  Scratch<S> vec{};
  attention_quant::Scratch<S> quant;
  Int8Scratch int8;
  Int16Scratch int16;
  AmxScratch amx;
};

// The tile registers configured for a call (tile_config) on the AMX set's threads (nothing on the others).
#ifdef PAGEDSERVE_AMX
template <class S>
using TileScope = std::conditional_t<kAmx<S>, pagedserve_cpu::amx::Tiles, pagedserve_cpu::amx::NoTiles>;
#else
template <class S>
using TileScope = pagedserve_cpu::amx::NoTiles;
#endif

template <class S, class C>
struct Decode {
  const void* q;         // [T, Hq, D], fp32 or bf16 (bf16 for the dot-product set)
  void* out;             // [T, Hq, D], q's dtype
  bool bf16;             // q's and out's dtype: bf16, else fp32 (read and written here, where ATen's
                         // conversions before and after the call cost more than a long row's merge)
  const Elem<C>* k_cache;
  const Elem<C>* v_cache;
  Cache cache;
  const int32_t* tokens;      // per decode row: its token's index in q and out
  const int32_t* lens;        // per decode row: the positions its token attends (its own included)
  const int32_t* table_rows;  // per decode row: its row of the block table
  const int32_t* table;
  int64_t width, q_heads, kv_heads;
  float scale;

  // Value i of q (bf16 values convert exactly).
  float query(int64_t i) const {
    return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(q)[i]) : static_cast<const float*>(q)[i];
  }

  // Stores value i of the output, rounded to bf16 (to nearest even, as Tensor.to rounds) for bf16 queries.
  void put(int64_t i, float x) const {
    if (bf16)
      static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(x);
    else
      static_cast<float*>(out)[i] = x;
  }

  // Where value d of a head sits in the accumulators.
  static int64_t acc_index(int64_t d) {
    if constexpr (kAmx<S>)   // attention_amx.h's add_values: value 8j + 4h + k of 32 in column 16h + 4j + k
      return (d & ~31) | (d >> 2 & 1) << 4 | (d >> 3 & 3) << 2 | (d & 3);
    else
      return lane<S, C>(d);
  }

  // Decode rows staged and attended together: the AMX set puts the GQA groups of as many tokens of a prefill
  // or verify row as fit side by side in its tiles; the others take one row at a time.
  int64_t rows_per_stage() const {
#ifdef PAGEDSERVE_AMX
    if constexpr (kAmx<S>) return attention_amx::tokens_per_tile(q_heads / kv_heads);
#endif
    return 1;
  }

  // The query heads side by side in the AMX set's tiles: rows_per_stage() GQA groups.
  int tile_columns() const { return static_cast<int>(rows_per_stage() * (q_heads / kv_heads)); }

  // The tile shapes of the call's set (none for the sets without tiles).
  pagedserve_cpu::amx::TileConfig tile_config() const {
#ifdef PAGEDSERVE_AMX
    if constexpr (kAmx<S>) return attention_amx::tile_config(tile_columns());
#endif
    return {};
  }

  // The queries of `count` (up to rows_per_stage()) consecutive decode rows of one row, from `row`, as the
  // set reads them (see Staged).
  void stage(int64_t row, int64_t count, Staged<S>& staged) const {
    const int64_t dim = cache.dim, n = q_heads * dim, first = static_cast<int64_t>(tokens[row]) * n;
#ifdef PAGEDSERVE_AMX
    if constexpr (kAmx<S>)
      return attention_amx::stage_queries(static_cast<const c10::BFloat16*>(q) + first, count, kv_heads,
                                          q_heads / kv_heads, dim, tile_columns(), staged.tiles);
#endif
    (void)count;
    std::vector<Query<S>>& qs = staged.values;
    qs.resize(n);
    for (int64_t h = 0; h < q_heads; ++h)
      for (int64_t d = 0; d < dim; ++d)
        qs[h * dim + (kDotBf16<S> ? d : lane<S, C>(d))] = static_cast<Query<S>>(query(first + h * dim + d));
    if constexpr (kQuant<C>)      // like K, block by block (lanes are in order for quantized rows; Query is fp32)
      for (int64_t at = 0; at < n; at += kv_quant::kBlock) kv_quant::rotate_block(qs.data() + at);
#ifdef PAGEDSERVE_INT8_DOT
    if constexpr (kInt8<S>) attention_int8::quantize_queries<C>(qs.data(), q_heads, dim, scale, staged.int8);
#endif
#ifdef PAGEDSERVE_AVX2
    if constexpr (kInt16<S, C>) attention_int16::quantize_queries(qs.data(), q_heads, dim, scale, staged.int16);
#endif
  }

  const int32_t* table_of(int64_t row) const { return table + static_cast<int64_t>(table_rows[row]) * width; }

  // The row's block for position `pos`, checked against the cache (a bad entry fails the call).
  int64_t block_at(const int32_t* blocks, int64_t pos) const {
    const int64_t block = blocks[pos / cache.block_size];
    TORCH_CHECK(block >= 0 && block < cache.num_blocks, "pagedserve::paged_attention: block_tables entry ",
                block, " for position ", pos, " is outside the cache's ", cache.num_blocks, " blocks");
    return block;
  }

  // The block for position `pos` of a row of `len` positions if there is one (prefetching: past the piece
  // too, but not past the row; a bad entry is reported on its turn), else -1.
  int64_t block_ahead(const int32_t* blocks, int64_t pos, int64_t len) const {
    if (pos >= len) return -1;
    const int64_t block = blocks[pos / cache.block_size];
    return block >= 0 && block < cache.num_blocks ? block : -1;
  }

  // Blocks [first, last) of `row` into `st` (already reset): fp caches.
  void run(int64_t row, int64_t first, int64_t last, const Query<S>* qs, Partial& st, Scratch<S>& scratch) const {
    const int64_t bs = cache.block_size, dim = cache.dim, group = q_heads / kv_heads, ctx = lens[row];
    const int32_t* blocks = table_of(row);
    const int64_t block_bytes = 2 * kv_heads * bs * kv_quant::byte_of<C>(dim);
    const int64_t ahead_blocks = std::clamp<int64_t>(kAheadBytes / block_bytes, 2, 8);
    for (int64_t b = first; b < last; ++b) {
      const int64_t block = block_at(blocks, b * bs), next = block_ahead(blocks, (b + ahead_blocks) * bs, ctx);
      const int len = static_cast<int>(std::min(bs, ctx - b * bs));
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        const int64_t base = block * cache.block_stride + kv * cache.head_stride;
        const int64_t base_ahead = next * cache.block_stride + kv * cache.head_stride;
        for (int t0 = 0; t0 < len; t0 += kTile) {
          const int n = std::min(kTile, len - t0);
          const int64_t tile = base + t0 * cache.slot_stride, tile_ahead = base_ahead + t0 * cache.slot_stride;
          for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
            const int64_t h = kv * group + g0;
            const bool fetch = next >= 0 && g0 == 0;
            attend_group<S, C>(static_cast<int>(std::min<int64_t>(kMaxGroup, group - g0)), qs + h * dim,
                               st.acc.data() + h * dim, st.max.data() + h, st.sum.data() + h, k_cache + tile,
                               v_cache + tile, cache.slot_stride, n, dim, scale, scratch,
                               fetch ? k_cache + tile_ahead : nullptr, fetch ? v_cache + tile_ahead : nullptr);
          }
        }
      }
    }
  }

  // Where the tile of position `pos` of kv head `kv` starts in block `block`.
  int64_t tile_at(int64_t block, int64_t pos, int64_t kv) const {
    const int64_t tiles = cache.block_size / kv_quant::kTile, tile = pos % cache.block_size / kv_quant::kTile;
    return block * cache.block_stride + (kv * tiles + tile) * kv_quant::tile_bytes<C>(cache.dim);
  }

  // run() for a quantized cache on the fp32 sets: tile by tile, each tile's K and V in a later block
  // prefetched whole as it starts.
  void run_quant(int64_t row, int64_t first, int64_t last, const float* qs, Partial& st,
                 attention_quant::Scratch<S>& scratch) const {
    const int64_t bs = cache.block_size, dim = cache.dim, group = q_heads / kv_heads, ctx = lens[row];
    const int32_t* blocks = table_of(row);
    const int64_t tile_bytes = kv_quant::tile_bytes<C>(dim);
    for (int64_t b = first; b < last; ++b) {
      const int64_t block = block_at(blocks, b * bs), next = block_ahead(blocks, (b + 2) * bs, ctx);
      const int len = static_cast<int>(std::min(bs, ctx - b * bs));
      for (int64_t kv = 0; kv < kv_heads; ++kv)
        for (int t0 = 0; t0 < len; t0 += kv_quant::kTile) {
          if (next >= 0)
            for (int64_t at = 0; at < tile_bytes; at += 64)
              for (const Elem<C>* c : {k_cache, v_cache}) S::prefetch(c + tile_at(next, t0, kv) + at);
          const int64_t tile = tile_at(block, t0, kv);
          for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
            const int64_t h = kv * group + g0;
            attention_quant::attend_group<S, C>(static_cast<int>(std::min<int64_t>(kMaxGroup, group - g0)),
                                                qs + h * dim, st.acc.data() + h * dim, st.max.data() + h,
                                                st.sum.data() + h, k_cache + tile, v_cache + tile,
                                                std::min(kv_quant::kTile, len - t0), dim, scale, scratch);
          }
        }
    }
  }

#ifdef PAGEDSERVE_AVX2
  // run() for the integer kernels (Int8Dot; the Avx2 set's quantized caches): positions in chunks of 4 tiles,
  // each kv head's chunk in turn, the tiles two chunks on prefetched as these are read.
  void run_chunks(int64_t row, int64_t first, int64_t last, const Staged<S>& staged, Partial& st,
                  ThreadScratch<S>& s) const {
    using kv_quant::kChunk;
    using kv_quant::kChunkTiles;
    const FlushDenormals flush;
    const int64_t bs = cache.block_size, dim = cache.dim, group = q_heads / kv_heads, ctx = lens[row];
    const int32_t* blocks = table_of(row);
    const int64_t lo = first * bs, hi = std::min<int64_t>(last * bs, ctx);
    const auto* k = reinterpret_cast<const uint8_t*>(k_cache);
    const auto* v = reinterpret_cast<const uint8_t*>(v_cache);
    for (int64_t p0 = lo; p0 < hi; p0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, hi - p0));
      int64_t here[kChunkTiles], ahead[kChunkTiles];
      for (int t = 0; t < kChunkTiles; ++t) {
        const int64_t pos = p0 + t * kv_quant::kTile;
        here[t] = pos < p0 + n ? block_at(blocks, pos) : -1;
        ahead[t] = block_ahead(blocks, pos + 2 * kChunk, ctx);
      }
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        kv_quant::Chunk c{};
        c.n = n;
        for (int t = 0; t < kChunkTiles; ++t) {
          const int64_t pos = p0 + t * kv_quant::kTile;
          if (here[t] >= 0) c.k[t] = k + tile_at(here[t], pos, kv), c.v[t] = v + tile_at(here[t], pos, kv);
          if (ahead[t] >= 0)
            c.k_ahead[t] = k + tile_at(ahead[t], pos, kv), c.v_ahead[t] = v + tile_at(ahead[t], pos, kv);
        }
        for (int64_t g0 = 0; g0 < group; g0 += kGroupPass<S, C>) {
          const int64_t h = kv * group + g0;
          const int part = static_cast<int>(std::min<int64_t>(kGroupPass<S, C>, group - g0));
          float* acc = st.acc.data() + h * dim;
#ifdef PAGEDSERVE_INT8_DOT
          if constexpr (kInt8<S>)
            attention_int8::attend_group<C>(part, staged.int8, h, acc, st.max.data() + h, st.sum.data() + h, c,
                                            dim, s.int8);
          else
#endif
            attention_int16::attend_group<C>(part, staged.int16, h, acc, st.max.data() + h, st.sum.data() + h,
                                             c, dim, s.int16);
        }
      }
    }
  }
#endif

#ifdef PAGEDSERVE_AMX
  // run() for the AMX set, for `count` consecutive decode rows of one row from `row` (of as many blocks, so
  // they end in the same chunk, each seeing at least one of its positions), queries staged together: positions
  // in chunks of up to 8 tiles of 16 slots (whole tiles of one block: block sizes are multiples of 16 here),
  // each kv head's chunk in turn, the same slots a chunk on prefetched.
  void run_amx(int64_t row, int64_t count, int64_t first, int64_t last, const std::vector<uint32_t>& queries,
               Partial* const* st, AmxScratch& s) const {
    using attention_amx::kChunk;
    using attention_amx::kChunkTiles;
    using attention_amx::kTile;
    const FlushDenormals flush;
    const int64_t bs = cache.block_size, dim = cache.dim, group = q_heads / kv_heads;
    const int columns = tile_columns();
    const int32_t* blocks = table_of(row);
    const int64_t ctx = *std::max_element(lens + row, lens + row + count);
    const int64_t lo = first * bs, hi = std::min<int64_t>(last * bs, ctx);
    for (int64_t p0 = lo; p0 < hi; p0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, hi - p0));
      int64_t here[kChunkTiles], ahead[kChunkTiles];
      for (int t = 0; t < kChunkTiles; ++t) {
        const int64_t pos = p0 + t * kTile;
        here[t] = pos < p0 + n ? block_at(blocks, pos) : -1;
        ahead[t] = block_ahead(blocks, pos + kChunk, ctx);
      }
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        attention_amx::Chunk c{};
        c.n = n;
        c.stride = cache.slot_stride;
        c.ahead_bytes = kTile * cache.slot_stride * static_cast<int64_t>(sizeof(c10::BFloat16)) / kv_heads;
        const auto slot = [&](int64_t block, int64_t pos) { return block * cache.block_stride + pos % bs * cache.slot_stride; };
        for (int t = 0; t < kChunkTiles; ++t) {
          const int64_t pos = p0 + t * kTile;
          if (here[t] >= 0) {
            c.k[t] = k_cache + slot(here[t], pos) + kv * cache.head_stride;
            c.v[t] = v_cache + slot(here[t], pos) + kv * cache.head_stride;
          }
          if (ahead[t] >= 0) {
            const int64_t later = slot(ahead[t], pos + kChunk);
            c.k_ahead[t] = reinterpret_cast<const char*>(k_cache + later) + kv * c.ahead_bytes;
            c.v_ahead[t] = reinterpret_cast<const char*>(v_cache + later) + kv * c.ahead_bytes;
          }
        }
        attention_amx::Heads heads;
        heads.count = static_cast<int>(count * group);
        for (int64_t i = 0; i < count; ++i) {
          const int seen = static_cast<int>(std::min<int64_t>(std::min<int64_t>(last * bs, lens[row + i]) - p0, n));
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g, column = i * group + g;
            heads.acc[column] = st[i]->acc.data() + h * dim;
            heads.max[column] = st[i]->max.data() + h;
            heads.sum[column] = st[i]->sum.data() + h;
            heads.n[column] = seen;
          }
        }
        attention_amx::attend_chunk(queries.data() + kv * columns * dim / 2, c, columns, heads, dim, scale, s);
      }
    }
  }
#endif

  void finish(int64_t row, const Partial& st) const {
    const int64_t dim = cache.dim, first = static_cast<int64_t>(tokens[row]) * q_heads * dim;
    for (int64_t h = 0; h < q_heads; ++h) {
      const float inv = 1.f / st.sum[h];
      for (int64_t d = 0; d < dim; ++d) put(first + h * dim + d, st.acc[h * dim + acc_index(d)] * inv);
    }
  }

  // A row's output from the pieces it was cut into (parts of one softmax, rescaled to a common max).
  void merge(int64_t row, const std::vector<const Partial*>& parts) const {
    const int64_t dim = cache.dim, first = static_cast<int64_t>(tokens[row]) * q_heads * dim;
    std::vector<float> o(dim);
    for (int64_t h = 0; h < q_heads; ++h) {
      float m = kNegInf, total = 0.f;
      for (const Partial* p : parts) m = std::max(m, p->max[h]);
      std::fill(o.begin(), o.end(), 0.f);
      for (const Partial* p : parts) {
        const float w = exp_nonpositive<Scalar>(p->max[h] - m);
        total += p->sum[h] * w;
        for (int64_t d = 0; d < dim; ++d) o[d] += p->acc[h * dim + acc_index(d)] * w;
      }
      for (int64_t d = 0; d < dim; ++d) put(first + h * dim + d, o[d] / total);
    }
  }

  // Blocks [first, last) of `count` decode rows staged together (see stage) into their states st[0..count),
  // with the call's set.
  void run_rows(int64_t row, int64_t count, int64_t first, int64_t last, const Staged<S>& staged,
                Partial* const* st, ThreadScratch<S>& s) const {
#ifdef PAGEDSERVE_AMX
    if constexpr (kAmx<S>)
      return run_amx(row, count, first, last, staged.tiles, st, s.amx);
#endif
#ifdef PAGEDSERVE_AVX2
    if constexpr (kInt8<S> || kInt16<S, C>)
      return run_chunks(row, first, last, staged, *st[0], s);
#endif
    if constexpr (kQuant<C>)
      run_quant(row, first, last, staged.values.data(), *st[0], s.quant);
    else
      run(row, first, last, staged.values.data(), *st[0], s.vec);
  }

  // Cuts each decode row into equal pieces, one per thread at most and none shorter than kMinPiece
  // positions (`pieces` > 0: that many, at most one per block), and hands the pieces to the threads in equal
  // runs. Where a row is cut depends on its own length only, so its output does not depend on the batch
  // beside it: a verify row's tokens match decode steps bit for bit.
  // The tokens of a verify or prefill row that have as many blocks (so are cut at the same places) are read
  // together, piece by piece: each token (or each stage of rows_per_stage() tokens) in turn attends kStep
  // positions, so the others find those K/V in cache and a prefill chunk reads its context from memory once
  // per group rather than once per token. Each token's arithmetic is the same as alone (kStep is a whole
  // number of every set's chunks; a tile product's columns do not mix).
  void operator()(int64_t rows, int64_t pieces) const {
    if (rows == 0) return;                           // prefill rows only: nothing here (nor a group to form)
    const int64_t bs = cache.block_size, threads = at::get_num_threads();
    const int64_t min_blocks = std::max<int64_t>(1, kMinPiece / bs), step = kStep / std::gcd(kStep, bs);
    const int64_t per = rows_per_stage();
    const auto blocks_of = [&](int64_t r) { return (lens[r] + bs - 1) / bs; };
    const auto pieces_of = [&](int64_t r) {
      const int64_t blocks = blocks_of(r);
      return std::min(blocks, pieces > 0 ? pieces : std::clamp<int64_t>(blocks / min_blocks, 1, threads));
    };
    std::vector<int64_t> first(rows + 1, 0);         // global index of each row's first piece
    std::vector<int64_t> group{0};                   // each group's first row, then `rows`
    for (int64_t r = 0; r < rows; ++r) {
      first[r + 1] = first[r] + pieces_of(r);
      if (r > 0 && (table_rows[r] != table_rows[r - 1] || blocks_of(r) != blocks_of(r - 1))) group.push_back(r);
    }
    group.push_back(rows);
    const int64_t groups = static_cast<int64_t>(group.size()) - 1;
    std::vector<int64_t> work(groups + 1, 0);        // global index of each group's first piece
    for (int64_t g = 0; g < groups; ++g) work[g + 1] = work[g] + pieces_of(group[g]);
    const int64_t total = work[groups];
    if (total == 0) return;
    const int64_t shares = std::min(total, threads);
    std::vector<Partial> partial(first[rows]);       // the pieces of rows that were cut
    at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
      ThreadScratch<S> scratch;
      [[maybe_unused]] const TileScope<S> tiles(tile_config());
      std::vector<Partial> whole;                    // the states of a group's rows that were not cut
      std::vector<Staged<S>> staged;
      std::vector<Partial*> target;
      int64_t staged_group = -1;
      for (int64_t sh = begin; sh < end; ++sh) {
        const int64_t lo = total * sh / shares, hi = total * (sh + 1) / shares;
        int64_t g = std::upper_bound(work.begin(), work.end(), lo) - work.begin() - 1;
        for (int64_t piece = lo; piece < hi; ++piece) {
          while (work[g + 1] <= piece) ++g;
          const int64_t r0 = group[g], members = group[g + 1] - r0, cut = work[g + 1] - work[g];
          const int64_t j = piece - work[g], blocks = blocks_of(r0);
          const int64_t from = blocks * j / cut, to = blocks * (j + 1) / cut;
          if (g != staged_group) {
            staged.resize(std::max<int64_t>((members + per - 1) / per, staged.size()));
            for (int64_t m = 0; m < members; m += per) stage(r0 + m, std::min(per, members - m), staged[m / per]);
            staged_group = g;
          }
          whole.resize(std::max<int64_t>(members, whole.size()));
          target.resize(members);
          for (int64_t m = 0; m < members; ++m) {
            target[m] = cut == 1 ? &whole[m] : &partial[first[r0 + m] + j];
            target[m]->reset(q_heads, cache.dim);
          }
          const int64_t span = members <= per ? to - from : step;
          for (int64_t b = from; b < to; b += span)
            for (int64_t m = 0; m < members; m += per)
              run_rows(r0 + m, std::min(per, members - m), b, std::min(b + span, to), staged[m / per],
                       target.data() + m, scratch);
          if (cut == 1)
            for (int64_t m = 0; m < members; ++m) finish(r0 + m, whole[m]);
        }
      }
    });
    std::vector<const Partial*> parts;
    for (int64_t r = 0; r < rows; ++r) {
      if (first[r + 1] - first[r] < 2) continue;
      parts.clear();
      for (int64_t piece = first[r]; piece < first[r + 1]; ++piece) parts.push_back(&partial[piece]);
      merge(r, parts);
    }
  }
};

template <class C>
void decode(const at::Tensor& q, at::Tensor& out, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const DecodeRows& rows, const at::Tensor& tables, double scale, int64_t pieces, int64_t lanes) {
  const Cache cache{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.size(0), k_cache.size(1),
                    q.size(2)};
  auto run = [&](auto isa) {
    using S = decltype(isa);
    const Decode<S, C> job{q.data_ptr(), out.data_ptr(), q.scalar_type() == at::kBFloat16,
                           static_cast<const Elem<C>*>(k_cache.data_ptr()),
                           static_cast<const Elem<C>*>(v_cache.data_ptr()), cache, rows.tokens.data(),
                           rows.lens.data(), rows.table_rows.data(), tables.data_ptr<int32_t>(), tables.size(1),
                           q.size(1), k_cache.size(2), static_cast<float>(scale)};
    job(static_cast<int64_t>(rows.tokens.size()), pieces);
  };
  // the widest vectors (of at most `lanes`, if > 0) whose pairs divide head_dim (model head_dims are
  // multiples of 32; so are quantized rows', so every set reads whole pieces of one block)
  const auto fits = [&](int width) { return cache.dim % (2 * width) == 0 && (lanes <= 0 || width <= lanes); };
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, c10::BFloat16>)
    if (q.scalar_type() == at::kBFloat16 && fits(Avx512::W)) {
#ifdef PAGEDSERVE_AMX
      // (lanes 16 asks for the VDPBF16PS set)
      if (lanes <= 0 && cache.block_size % attention_amx::kTile == 0 &&
          q.size(1) / k_cache.size(2) <= attention_amx::kMaxGroup && pagedserve_cpu::amx::available())
        return run(AmxBf16{});
#endif
      return run(Avx512Bf16{});
    }
#endif
#ifdef PAGEDSERVE_INT8_DOT
  // (lanes 16 asks for the fp32 set below)
  if constexpr (kQuant<C>)
    if (fits(Avx512::W) && lanes != Avx512::W && cache.dim <= attention_int8::kMaxBlocks * kv_quant::kBlock)
      return run(Int8Dot{});
#endif
#ifdef PAGEDSERVE_AVX512
  if (fits(Avx512::W)) return run(Avx512{});
#endif
#ifdef PAGEDSERVE_AVX2
  if (fits(Avx2::W)) return run(Avx2{});
#endif
  run(Scalar{});
}

// Output like q, zero except the rows with 1 to `max_tokens` new tokens (decode rows, verify rows), which
// get their attention, and prefill_rows' count (with -1 the output is all zeros).
// q: [T, Hq, D] fp32 or bf16, contiguous (out has its dtype, the kernel's fp32 results rounded to it); caches
// [NB, BS, Hk, D] fp32, bf16 or fp16 with unit stride in D, D even, or contiguous uint8 [NB, BS, Hk, row bytes]
// of q8_0 / q4_0 rows in tiles (D a multiple of 32; the row bytes say which; K stored rotated). `pieces` > 0
// cuts each row into that many pieces (tests force cuts on small inputs); `lanes` > 0 caps the vector width
// (tests run the narrower sets).
std::tuple<at::Tensor, int64_t> paged_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& query_start_loc,
                                                       const at::Tensor& context_lens, const at::Tensor& block_tables,
                                                       double scale, int64_t pieces, int64_t lanes,
                                                       int64_t max_tokens) {
  const int64_t dim = q.size(2);
  const bool quantized = k_cache.scalar_type() == at::kByte;
  const int64_t q8_bytes = dim / kv_quant::kBlock * kv_quant::Q8_0::kBlockBytes;
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && dim % 2 == 0,
              "pagedserve_cpu::paged_attention_decode: the caches must share dtype and strides, with unit "
              "stride in an even head_dim");
  TORCH_CHECK(q.is_contiguous() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  q.size(1) % k_cache.size(2) == 0 &&
                  (quantized ? dim % kv_quant::kBlock == 0 &&
                                   (k_cache.size(3) == q8_bytes ||
                                    k_cache.size(3) == dim / kv_quant::kBlock * kv_quant::Q4_0::kBlockBytes) &&
                                   k_cache.is_contiguous() && k_cache.size(1) % kv_quant::kTile == 0
                             : dim == k_cache.size(3)),
              "pagedserve_cpu::paged_attention_decode: q must be contiguous fp32 or bf16, its heads a multiple "
              "of the cache's kv heads, with the cache's head_dim (a multiple of 32 in q8_0 or q4_0 rows, in a "
              "contiguous cache of blocks of a multiple of 16 slots)");
  auto out = at::zeros(q.sizes(), q.options());
  const auto qsl = query_start_loc.contiguous();
  const auto ctx = context_lens.contiguous();
  const auto tables = block_tables.contiguous();
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* lens = ctx.data_ptr<int32_t>();
  const int64_t prefill = prefill_rows(starts, lens, ctx.size(0), tables.size(1) * k_cache.size(1), q.size(0),
                                       max_tokens);
  if (prefill < 0) return {out, prefill};
  const DecodeRows rows(starts, lens, ctx.size(0), max_tokens);
  switch (k_cache.scalar_type()) {
    case at::kFloat: decode<float>(q, out, k_cache, v_cache, rows, tables, scale, pieces, lanes); break;
    case at::kBFloat16:
      decode<c10::BFloat16>(q, out, k_cache, v_cache, rows, tables, scale, pieces, lanes);
      break;
    case at::kHalf: decode<c10::Half>(q, out, k_cache, v_cache, rows, tables, scale, pieces, lanes); break;
    case at::kByte:
      if (k_cache.size(3) == q8_bytes)
        decode<kv_quant::Q8_0>(q, out, k_cache, v_cache, rows, tables, scale, pieces, lanes);
      else
        decode<kv_quant::Q4_0>(q, out, k_cache, v_cache, rows, tables, scale, pieces, lanes);
      break;
    default:
      TORCH_CHECK(false, "pagedserve_cpu::paged_attention_decode: K/V cache dtype ", k_cache.scalar_type(),
                  " has no kernel; allowed: float32, bfloat16, float16, uint8 (q8_0, q4_0)");
  }
  return {out, prefill};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
        "Tensor context_lens, Tensor block_tables, float scale, int pieces=0, int lanes=0, int max_tokens=1) "
        "-> (Tensor, int)",
        &paged_attention_decode);
}

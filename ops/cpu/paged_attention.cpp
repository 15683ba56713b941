// Decode rows of pagedserve::paged_attention (one new token per row) against the paged K/V cache, for K/V
// stored as fp32, bf16 or fp16, or as q8_0 / q4_0 rows (kv_quant.h): each K/V vector is widened (or
// dequantized: int8 widened, times its block's scale) to fp32 in registers as it is read, and the softmax and
// accumulators stay in fp32. Quantized K is stored rotated (a 32-point Hadamard transform per block), so the
// queries are rotated the same way as they are staged; V is not rotated, so outputs need nothing. bf16
// queries against a bf16 cache use the bf16 dot products where the CPU has them (simd.h's Avx512Bf16). A
// quantized cache on a CPU with AVX-512 VNNI is read by attention_int8.h instead: integer dot products
// over chunks of 64 positions (run_int8), where widening every value to fp32 kept the FMA ports, not
// memory, the limit.
//
// A row of several new tokens (up to the caller's `max_tokens`: speculative verify rows, and on AVX-512 CPUs
// prefill chunks) is attended as one decode row per token, each over the context its token sees (causal):
// its K/V are read once per token, mostly from cache, where torch's SDPA with a bottom-right causal mask
// cost ~30x a decode row per layer for a verify row.
//
// Flash-decoding: each long decode row is cut into up to one piece per thread (by its own length only: the
// batch beside a row never changes its rounding) and the threads take equal runs of pieces, so a single long row
// keeps every core busy and ragged rows balance. A piece keeps a running max, sum and unnormalised output
// per query head; the pieces of a row that was cut are merged at the end.
// Within a piece the kernel walks the row's blocks; for each kv head it scores and accumulates the G query
// heads of the GQA group together (attention_tile.h: register tiles of G heads x a few keys), so K/V come
// from memory once, while a later block is prefetched (block tables scatter blocks, which the hardware
// prefetcher cannot follow). Queries and outputs are kept in the lane order of simd.h's `lane`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention_int8.h"
#include "attention_rows.h"
#include "attention_tile.h"

namespace {

using namespace pagedserve_cpu::attention;
namespace kv_quant = pagedserve_cpu::kv_quant;
#ifdef PAGEDSERVE_INT8_DOT
namespace attention_int8 = pagedserve_cpu::attention_int8;
#endif

constexpr int64_t kMinPiece = 256;  // positions below which a piece of a row is not worth a thread of its own
// How far ahead of the block being read its row's K/V is prefetched, in bytes (2 to 8 blocks): a distance in
// blocks undershot small blocks (few kv heads, short heads), whose loads then waited on memory.
constexpr int64_t kAheadBytes = 32 << 10;

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

template <class S, class C>
struct Decode {
  const void* q;         // [T, Hq, D], fp32 (bf16 for the dot-product set)
  float* out;            // [T, Hq, D] fp32
  const Elem<C>* k_cache;
  const Elem<C>* v_cache;
  Cache cache;
  const int32_t* tokens;      // per decode row: its token's index in q and out
  const int32_t* lens;        // per decode row: the positions its token attends (its own included)
  const int32_t* table_rows;  // per decode row: its row of the block table
  const int32_t* table;
  int64_t width, q_heads, kv_heads;
  float scale;

  // The row's queries in the keys' lane order (bf16 dot products pair keys and queries as stored).
  void stage(int64_t row, std::vector<Query<S>>& qs, Int8Queries& qi) const {
    const int64_t dim = cache.dim, n = q_heads * dim;
    const auto* src = static_cast<const Query<S>*>(q) + static_cast<int64_t>(tokens[row]) * n;
    qs.resize(n);
    for (int64_t h = 0; h < q_heads; ++h)
      for (int64_t d = 0; d < dim; ++d) qs[h * dim + (kDotBf16<S> ? d : lane<S, C>(d))] = src[h * dim + d];
    if constexpr (kQuant<C>) {    // like K, block by block (lanes are in order for quantized rows)
      float x[kv_quant::kBlock];
      for (int64_t at = 0; at < n; at += kv_quant::kBlock) {
        for (int i = 0; i < kv_quant::kBlock; ++i) x[i] = static_cast<float>(qs[at + i]);
        kv_quant::rotate_block(x);
        for (int i = 0; i < kv_quant::kBlock; ++i) qs[at + i] = static_cast<Query<S>>(x[i]);
      }
    }
#ifdef PAGEDSERVE_INT8_DOT
    if constexpr (kInt8<S>) attention_int8::quantize_queries<C>(qs.data(), q_heads, dim, scale, qi);
#endif
  }

  // Blocks [first, last) of `row` into `st` (already reset).
  void run(int64_t row, int64_t first, int64_t last, const Query<S>* qs, Partial& st, Scratch<S>& scratch) const {
    const int64_t bs = cache.block_size, dim = cache.dim, group = q_heads / kv_heads, ctx = lens[row];
    const int32_t* blocks = table + static_cast<int64_t>(table_rows[row]) * width;
    const int64_t block_bytes = 2 * kv_heads * bs * kv_quant::byte_of<C>(dim);
    const int64_t ahead_blocks = std::clamp<int64_t>(kAheadBytes / block_bytes, 2, 8);
    for (int64_t b = first; b < last; ++b) {
      const int64_t block = blocks[b];
      TORCH_CHECK(block >= 0 && block < cache.num_blocks, "pagedserve::paged_attention: block_tables entry ",
                  block, " for position ", b * bs, " is outside the cache's ", cache.num_blocks, " blocks");
      const int64_t next = (b + ahead_blocks) * bs < ctx ? blocks[b + ahead_blocks] : -1;   // past the piece too
      const bool ahead = next >= 0 && next < cache.num_blocks;     // a bad entry is reported on its turn
      const int len = static_cast<int>(std::min(bs, ctx - b * bs));
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        const int64_t base = block * cache.block_stride + kv * cache.head_stride;
        const int64_t base_ahead = next * cache.block_stride + kv * cache.head_stride;
        for (int t0 = 0; t0 < len; t0 += kTile) {
          const int n = std::min(kTile, len - t0);
          const int64_t tile = base + t0 * cache.slot_stride, tile_ahead = base_ahead + t0 * cache.slot_stride;
          for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
            const int64_t h = kv * group + g0;
            const bool fetch = ahead && g0 == 0;
            attend_group<S, C>(static_cast<int>(std::min<int64_t>(kMaxGroup, group - g0)), qs + h * dim,
                               st.acc.data() + h * dim, st.max.data() + h, st.sum.data() + h, k_cache + tile,
                               v_cache + tile, cache.slot_stride, n, dim, scale, scratch,
                               fetch ? k_cache + tile_ahead : nullptr, fetch ? v_cache + tile_ahead : nullptr);
          }
        }
      }
    }
  }

#ifdef PAGEDSERVE_INT8_DOT
  // run() for the integer-dot set: positions in chunks of 64 (across cache blocks), each kv head's rows
  // addressed by byte offsets from the cache's start (the caller checked they fit 32 bits); the slots of
  // the chunk after next are prefetched into L2 while this one is read, spread over its calls.
  void run_int8(int64_t row, int64_t first, int64_t last, const Int8Queries& qi, Partial& st,
                Int8Scratch& s) const {
    using attention_int8::kChunk;
    const int64_t bs = cache.block_size, dim = cache.dim, group = q_heads / kv_heads;
    const int32_t* table_row = table + static_cast<int64_t>(table_rows[row]) * width;
    const int64_t lo = first * bs, hi = std::min<int64_t>(last * bs, lens[row]), row_end = lens[row];
    const auto slot_of = [&](int64_t pos) {
      const int64_t block = table_row[pos / bs];
      TORCH_CHECK(block >= 0 && block < cache.num_blocks, "pagedserve::paged_attention: block_tables entry ",
                  block, " for position ", pos, " is outside the cache's ", cache.num_blocks, " blocks");
      return block * cache.block_stride + pos % bs * cache.slot_stride;
    };
    alignas(64) int32_t offsets[kChunk];
    std::vector<const char*> lines;
    for (int64_t p0 = lo; p0 < hi; p0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, hi - p0));
      lines.clear();
      // a block's run of slots at a time, past the piece's end too
      for (int64_t pos = p0 + 2 * kChunk; pos < std::min(row_end, p0 + 3 * kChunk);) {
        const int64_t block = table_row[pos / bs], end = std::min({row_end, p0 + 3 * kChunk, (pos / bs + 1) * bs});
        if (block >= 0 && block < cache.num_blocks) {       // a bad entry is reported on its turn
          const int64_t from = block * cache.block_stride + pos % bs * cache.slot_stride;
          const int64_t bytes = (end - pos) * cache.slot_stride;
          for (int64_t at = 0; at < bytes + 63; at += 64) {
            const int64_t line = from + std::min(at, bytes - 1);
            lines.push_back(reinterpret_cast<const char*>(k_cache + line));
            lines.push_back(reinterpret_cast<const char*>(v_cache + line));
          }
        }
        pos = end;
      }
      const int passes = static_cast<int>((group + attention_int8::kMaxGroup - 1) / attention_int8::kMaxGroup);
      const int calls = static_cast<int>(kv_heads) * passes;
      int call = 0;
      int64_t slots[kChunk];
      for (int j = 0; j < n; ++j) slots[j] = slot_of(p0 + j);
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        for (int j = 0; j < kChunk; ++j)
          offsets[j] = static_cast<int32_t>(slots[j < n ? j : 0] + kv * cache.head_stride);
        for (int64_t g0 = 0; g0 < group; g0 += attention_int8::kMaxGroup) {
          const int64_t h = kv * group + g0;
          const int share = static_cast<int>(lines.size()) / calls, at = share * call++;
          const attention_int8::Prefetch ahead{lines.data() + at,
                                               call == calls ? static_cast<int>(lines.size()) - at : share};
          attention_int8::attend_group<C>(static_cast<int>(std::min<int64_t>(attention_int8::kMaxGroup, group - g0)),
                                          qi, h, st.acc.data() + h * dim, st.max.data() + h, st.sum.data() + h,
                                          k_cache, v_cache, offsets, n, dim, s, ahead);
        }
      }
    }
  }
#endif

  void finish(int64_t row, const Partial& st) const {
    const int64_t dim = cache.dim;
    float* o = out + static_cast<int64_t>(tokens[row]) * q_heads * dim;
    for (int64_t h = 0; h < q_heads; ++h) {
      const float inv = 1.f / st.sum[h];
      for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = st.acc[h * dim + lane<S, C>(d)] * inv;
    }
  }

  // A row's output from the pieces it was cut into (parts of one softmax, rescaled to a common max).
  void merge(int64_t row, const std::vector<const Partial*>& parts) const {
    const int64_t dim = cache.dim;
    float* o = out + static_cast<int64_t>(tokens[row]) * q_heads * dim;
    for (int64_t h = 0; h < q_heads; ++h) {
      float m = kNegInf, total = 0.f;
      for (const Partial* p : parts) m = std::max(m, p->max[h]);
      std::fill(o + h * dim, o + (h + 1) * dim, 0.f);
      for (const Partial* p : parts) {
        const float w = exp_nonpositive<Scalar>(p->max[h] - m);
        total += p->sum[h] * w;
        for (int64_t d = 0; d < dim; ++d) o[h * dim + d] += p->acc[h * dim + lane<S, C>(d)] * w;
      }
      for (int64_t d = 0; d < dim; ++d) o[h * dim + d] /= total;
    }
  }

  // Cuts each decode row into equal pieces, one per thread at most and none shorter than kMinPiece
  // positions (`pieces` > 0: that many, at most one per block), and hands the pieces to the threads in equal
  // runs. Where a row is cut depends on its own length only, so its output does not depend on the batch
  // beside it: a verify row's tokens match decode steps bit for bit.
  void operator()(int64_t rows, int64_t pieces) const {
    const int64_t bs = cache.block_size, threads = at::get_num_threads();
    const int64_t min_blocks = std::max<int64_t>(1, kMinPiece / bs);
    const auto blocks_of = [&](int64_t r) { return (lens[r] + bs - 1) / bs; };
    const auto pieces_of = [&](int64_t r) {
      const int64_t blocks = blocks_of(r);
      return std::min(blocks, pieces > 0 ? pieces : std::clamp<int64_t>(blocks / min_blocks, 1, threads));
    };
    std::vector<int64_t> first(rows + 1, 0);         // global index of each row's first piece
    for (int64_t r = 0; r < rows; ++r) first[r + 1] = first[r] + pieces_of(r);
    const int64_t total = first[rows];
    if (total == 0) return;
    const int64_t shares = std::min(total, threads);
    std::vector<Partial> partial(total);             // the pieces of rows that were cut
    at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
      Scratch<S> scratch{};
      Int8Scratch scratch8;
      Partial st;
      std::vector<Query<S>> qs;
      Int8Queries qi;
      int64_t staged = -1;
      for (int64_t sh = begin; sh < end; ++sh) {
        const int64_t lo = total * sh / shares, hi = total * (sh + 1) / shares;
        int64_t row = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
        for (int64_t piece = lo; piece < hi; ++piece) {
          while (first[row + 1] <= piece) ++row;
          const bool whole = first[row + 1] - first[row] == 1;
          Partial& target = whole ? st : partial[piece];
          target.reset(q_heads, cache.dim);
          if (row != staged) stage(row, qs, qi);
          staged = row;
          const int64_t cut = first[row + 1] - first[row], j = piece - first[row], blocks = blocks_of(row);
          const int64_t from = blocks * j / cut, to = blocks * (j + 1) / cut;
#ifdef PAGEDSERVE_INT8_DOT
          if constexpr (kInt8<S>)
            run_int8(row, from, to, qi, target, scratch8);
          else
#endif
            run(row, from, to, qs.data(), target, scratch);
          if (whole) finish(row, st);
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
  auto run = [&](auto isa, const at::Tensor& queries) {
    using S = decltype(isa);
    const Decode<S, C> job{queries.data_ptr(), out.data_ptr<float>(),
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
    if (q.scalar_type() == at::kBFloat16 && fits(Avx512::W)) return run(Avx512Bf16{}, q);
#endif
  const auto qf = q.to(at::kFloat);
#ifdef PAGEDSERVE_INT8_DOT
  // (lanes 16 asks for the fp32 set below; byte offsets into the cache are 32-bit)
  if constexpr (kQuant<C>)
    if (fits(Avx512::W) && lanes != Avx512::W && cache.dim <= attention_int8::kMaxBlocks * kv_quant::kBlock &&
        k_cache.numel() < std::numeric_limits<int32_t>::max())
      return run(Int8Dot{}, qf);
#endif
#ifdef PAGEDSERVE_AVX512
  if (fits(Avx512::W)) return run(Avx512{}, qf);
#endif
#ifdef PAGEDSERVE_AVX2
  if (fits(Avx2::W)) return run(Avx2{}, qf);
#endif
  run(Scalar{}, qf);
}

// Output like q, zero except the rows with 1 to `max_tokens` new tokens (decode rows, verify rows), which
// get their attention, and prefill_rows' count (with -1 the output is all zeros).
// q: [T, Hq, D] fp32 or bf16, contiguous; caches [NB, BS, Hk, D] fp32, bf16 or fp16 with unit stride in D,
// D even, or uint8 [NB, BS, Hk, row bytes] of q8_0 / q4_0 rows (D a multiple of 32; the row bytes say
// which; K stored rotated). `pieces` > 0 cuts each row into that many pieces
// (tests force cuts on small inputs); `lanes` > 0 caps the vector width (tests run the narrower sets).
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
  TORCH_CHECK(q.is_contiguous() && q.size(1) % k_cache.size(2) == 0 &&
                  (quantized ? dim % kv_quant::kBlock == 0 &&
                                   (k_cache.size(3) == q8_bytes ||
                                    k_cache.size(3) == dim / kv_quant::kBlock * kv_quant::Q4_0::kBlockBytes)
                             : dim == k_cache.size(3)),
              "pagedserve_cpu::paged_attention_decode: q must be contiguous, its heads a multiple of the "
              "cache's kv heads, with the cache's head_dim (a multiple of 32 in q8_0 or q4_0 rows)");
  auto out = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  const auto qsl = query_start_loc.contiguous();
  const auto ctx = context_lens.contiguous();
  const auto tables = block_tables.contiguous();
  const int32_t* starts = qsl.data_ptr<int32_t>();
  const int32_t* lens = ctx.data_ptr<int32_t>();
  const int64_t prefill = prefill_rows(starts, lens, ctx.size(0), tables.size(1) * k_cache.size(1), q.size(0),
                                       max_tokens);
  if (prefill < 0) return {out.to(q.scalar_type()), prefill};
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
  return {out.to(q.scalar_type()), prefill};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("paged_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
        "Tensor context_lens, Tensor block_tables, float scale, int pieces=0, int lanes=0, int max_tokens=1) "
        "-> (Tensor, int)",
        &paged_attention_decode);
}

// The reads of a decode attention call without its arithmetic, for bench/attention_bandwidth.py --reads:
// every decode row's K and V bytes through its block table, rows cut into one piece per thread as the
// kernel cuts them, each block's K and V bytes as they lie in memory, line by line, prefetching the block
// two ahead a line per line read. The time it takes is the most a kernel reading the cache could reach (the
// integer kernel, ops/cpu/attention_int8.h, reads a quantized cache's tiles in this order, a kv head at a
// time). Sums come back so nothing is optimized away.
// `work` > 0 adds that many fp32 multiply-adds (16 lanes each) per 64-byte line pair read, on values made from
// the bytes (in [1, 2): no denormals), four independent chains: arithmetic that needs the data, as a kernel's
// does, with none of a kernel's other costs. Its time with K/V in cache (--hot) is that arithmetic alone; with
// K/V in memory, set against the reads alone, it shows how much of the arithmetic the machine hides under
// the reads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef long long Line __attribute__((vector_size(64)));
typedef float Floats __attribute__((vector_size(64)));
typedef int Words __attribute__((vector_size(64)));
constexpr int64_t kMinPiece = 256, kBlocksAhead = 2;

Line load(const uint8_t* p) {
  Line x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

struct Cache {
  const uint8_t* k;
  const uint8_t* v;
  int64_t block_stride, slot_stride, head_stride, row_bytes, block_size, kv_heads;
};

// Floats in [1, 2) from the bits of x: its mantissa bits under the exponent of 1.0.
Floats unit(Line x) {
  return reinterpret_cast<Floats>((reinterpret_cast<Words>(x) & 0x007FFFFF) | 0x3F800000);
}

Line block_order(const Cache& c, const int32_t* table, int64_t len, int64_t from, int64_t to, int64_t work) {
  const int64_t bytes = c.block_size * c.slot_stride;
  Line acc = {};
  Floats chain[4] = {};
  for (int64_t b = from / c.block_size; b * c.block_size < to; ++b) {
    const int64_t at = table[b] * c.block_stride;
    const bool ahead = (b + kBlocksAhead) * c.block_size < len;
    const int64_t next = ahead ? table[b + kBlocksAhead] * c.block_stride : 0;
    for (int64_t i = 0; i < bytes; i += 64) {
      if (ahead) {
        prefetch(c.k + next + i);
        prefetch(c.v + next + i);
      }
      const Line x = load(c.k + at + i) + load(c.v + at + i);
      acc += x;
      if (work > 0) {
        const Floats f = unit(x) * 0.499f;     // chains that shrink: they stay finite
        for (int64_t w = 0; w < work; ++w) chain[w % 4] = chain[w % 4] * f + 0.25f;
      }
    }
  }
  return acc + reinterpret_cast<Line>(chain[0] + chain[1] + chain[2] + chain[3]);
}

// q: [T, Hq, D] with one new token per row; caches [NB, BS, Hk, row] of any dtype; `work` as above. Returns
// [rows] sums.
at::Tensor paged_reads(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                       const at::Tensor& block_tables, double scale, int64_t work) {
  (void)q, (void)query_start_loc, (void)scale;
  const int64_t elem = k_cache.element_size();
  const Cache c{static_cast<const uint8_t*>(k_cache.data_ptr()), static_cast<const uint8_t*>(v_cache.data_ptr()),
                k_cache.stride(0) * elem, k_cache.stride(1) * elem, k_cache.stride(2) * elem,
                k_cache.size(3) * elem, k_cache.size(1), k_cache.size(2)};
  TORCH_CHECK(c.row_bytes >= 64 && k_cache.is_contiguous() && v_cache.strides() == k_cache.strides(),
              "paged_reads: contiguous caches with rows of at least 64 bytes");
  const auto lens = context_lens.contiguous(), tables = block_tables.contiguous();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int64_t rows = lens.size(0), width = tables.size(1), threads = at::get_num_threads();
  struct Piece { int64_t row, from, to; };
  std::vector<Piece> pieces;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t bs = c.block_size, blocks = (len[r] + bs - 1) / bs;
    const int64_t cut =
        std::min(blocks, std::clamp<int64_t>(blocks / std::max<int64_t>(1, kMinPiece / bs), 1, threads));
    for (int64_t j = 0; j < cut; ++j)
      pieces.push_back({r, std::min<int64_t>(len[r], blocks * j / cut * bs),
                        std::min<int64_t>(len[r], blocks * (j + 1) / cut * bs)});
  }
  std::vector<double> partial(pieces.size());
  const int64_t total = static_cast<int64_t>(pieces.size()), shares = std::min(total, threads);
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = total * begin / shares; i < total * end / shares; ++i) {
      const Piece& p = pieces[i];
      const int32_t* table = tables.data_ptr<int32_t>() + p.row * width;
      const Line acc = block_order(c, table, len[p.row], p.from, p.to, work);
      for (int l = 0; l < 8; ++l) partial[i] += static_cast<double>(acc[l]);
    }
  });
  auto sums = at::zeros({rows}, at::kDouble);
  for (int64_t i = 0; i < total; ++i) sums.data_ptr<double>()[pieces[i].row] += partial[i];
  return sums;
}

}  // namespace

TORCH_LIBRARY(pagedserve_bench, m) {
  m.def("paged_reads(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor context_lens, "
        "Tensor block_tables, float scale, int work=0) -> Tensor");
  m.impl("paged_reads", c10::DispatchKey::CPU, &paged_reads);
}

// pagedserve_cpu::gather_kv: the K and V of some blocks of q8_0 / q4_0 caches, dequantized into
// [n, BS, Hk, D] fp32 or bf16 (K still rotated): ops/paged_attention.py's gather_kv, the same values (scale
// times value in fp32, rounded to nearest even), for prefill rows that attend a long quantized prefix through
// torch's flash SDPA, without the torch body's byte gathers and fp32 temporaries.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "kv_quant.h"

namespace {

namespace kv_quant = pagedserve_cpu::kv_quant;
using kv_quant::kBlock;
using kv_quant::kTile;

template <class F, typename Out>
void dequantize_blocks(const at::Tensor& cache, const int64_t* blocks, int64_t n, bool k, at::Tensor& out) {
  const int64_t block_size = cache.size(1), heads = cache.size(2), dim = out.size(3);
  const int64_t tiles = block_size / kTile, tile_bytes = kv_quant::tile_bytes<F>(dim);
  const uint8_t* src = cache.data_ptr<uint8_t>();
  Out* dst = static_cast<Out*>(out.data_ptr());
  at::parallel_for(0, n * heads * tiles, 16, [&](int64_t first, int64_t last) {
    uint8_t bytes[F::kBlockBytes];
    float values[kBlock];
    for (int64_t i = first; i < last; ++i) {
      const int64_t row = i / (heads * tiles), h = i / tiles % heads, t = i % tiles;
      const uint8_t* tile = src + blocks[row] * cache.stride(0) + (h * tiles + t) * tile_bytes;
      for (int j = 0; j < kTile; ++j) {
        Out* slot = dst + ((row * block_size + t * kTile + j) * heads + h) * dim;
        for (int64_t b = 0; b < dim / kBlock; ++b) {
          kv_quant::load_block<F>(tile, dim, j, b, bytes, k);
          kv_quant::dequantize_block<F>(bytes, values);
          for (int u = 0; u < kBlock; ++u) slot[b * kBlock + u] = static_cast<Out>(values[u]);
        }
      }
    }
  });
}

template <class F>
void dequantize_into(const at::Tensor& cache, const int64_t* blocks, int64_t n, bool k, at::Tensor& out) {
  if (out.scalar_type() == at::kBFloat16)
    dequantize_blocks<F, c10::BFloat16>(cache, blocks, n, k, out);
  else
    dequantize_blocks<F, float>(cache, blocks, n, k, out);
}

// k_cache, v_cache: contiguous uint8 [NB, BS, Hk, row bytes] in tiles (BS a multiple of 16); blocks: int64 [n].
std::tuple<at::Tensor, at::Tensor> gather_kv(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                             const at::Tensor& blocks, int64_t head_dim, bool bf16) {
  const int64_t row_bytes = k_cache.size(3);
  const bool q8 = row_bytes == head_dim / kBlock * kv_quant::Q8_0::kBlockBytes;
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && head_dim % kBlock == 0 && k_cache.size(1) % kTile == 0 &&
                  (q8 || row_bytes == head_dim / kBlock * kv_quant::Q4_0::kBlockBytes),
              "pagedserve_cpu::gather_kv: the caches must be contiguous uint8 rows of q8_0 or q4_0 for head_dim ",
              head_dim, " in blocks of a multiple of ", kTile, " slots");
  const auto ids = blocks.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), num_blocks = k_cache.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "pagedserve_cpu::gather_kv: block ", id[i],
                " is not in the cache's [0, ", num_blocks, ")");
  const auto options = at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat);
  at::Tensor keys = at::empty({n, k_cache.size(1), k_cache.size(2), head_dim}, options);
  at::Tensor values = at::empty_like(keys);
  if (q8) {
    dequantize_into<kv_quant::Q8_0>(k_cache, id, n, true, keys);
    dequantize_into<kv_quant::Q8_0>(v_cache, id, n, false, values);
  } else {
    dequantize_into<kv_quant::Q4_0>(k_cache, id, n, true, keys);
    dequantize_into<kv_quant::Q4_0>(v_cache, id, n, false, values);
  }
  return {keys, values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("gather_kv(Tensor k_cache, Tensor v_cache, Tensor blocks, int head_dim, bool bf16) -> (Tensor, Tensor)",
        &gather_kv);
}

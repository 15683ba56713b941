// pagedserve::write_kv: copy each token's K and V rows into its cache slot, converted to the cache's storage
// dtype (a memcpy per (token, head) when the dtypes match; else through fp32, rounding to nearest even as
// Tensor.to does, so the torch body and this kernel store the same bits). A uint8 cache of q8_0 / q4_0 rows
// gets each row quantized block by block, K rotated first, its bytes stored where the slot's tile keeps them
// (kv_quant.h), again the torch body's bytes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "kv_quant.h"

namespace {

using pagedserve_cpu::kv_quant::kBlock;
using pagedserve_cpu::kv_quant::Q4_0;
using pagedserve_cpu::kv_quant::Q8_0;

template <typename Src, typename Dst>
void copy_row(const Src* src, Dst* dst, int64_t n) {
  if constexpr (std::is_same_v<Src, Dst>) {
    std::memcpy(dst, src, n * sizeof(Src));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Dst>(static_cast<float>(src[i]));
  }
}

template <typename Src, typename Dst>
void write_rows(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slot, int64_t tokens) {
  const int64_t heads = rows.size(1), dim = rows.size(2), block_size = cache.size(1);
  auto* dst = static_cast<Dst*>(cache.data_ptr());
  const auto* src = static_cast<const Src*>(rows.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    for (int64_t h = 0; h < heads; ++h)
      copy_row(src + (t * heads + h) * dim,
               dst + block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2), dim);
  }
}

// Rows of `rows` ([T, Hk, D]) quantized into a contiguous uint8 cache's tiles: K (rotated first) or V.
template <typename Src, class F>
void quantize_rows(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slot, int64_t tokens, bool k) {
  namespace kv_quant = pagedserve_cpu::kv_quant;
  const int64_t heads = rows.size(1), dim = rows.size(2), block_size = cache.size(1);
  const int64_t tile = kv_quant::tile_bytes<F>(dim), tiles = block_size / kv_quant::kTile;
  auto* dst = cache.data_ptr<uint8_t>();
  const auto* src = static_cast<const Src*>(rows.data_ptr());
  float x[kBlock];
  uint8_t bytes[F::kBlockBytes];
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    const int j = static_cast<int>(offset % kv_quant::kTile);
    for (int64_t h = 0; h < heads; ++h) {
      const Src* in = src + (t * heads + h) * dim;
      uint8_t* out = dst + block * cache.stride(0) + (h * tiles + offset / kv_quant::kTile) * tile;
      for (int64_t b = 0; b < dim / kBlock; ++b) {
        for (int i = 0; i < kBlock; ++i) x[i] = static_cast<float>(in[b * kBlock + i]);
        if (k) kv_quant::rotate_block(x);
        kv_quant::quantize_block<F>(x, bytes);
        kv_quant::store_block<F>(out, dim, j, b, bytes, k);
      }
    }
  }
}

template <typename Src>
void write_from(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slot, int64_t tokens,
                bool k) {
  if (cache.scalar_type() == at::kByte) {
    const int64_t dim = rows.size(2);
    TORCH_CHECK(dim % kBlock == 0 && cache.size(1) % pagedserve_cpu::kv_quant::kTile == 0 && cache.is_contiguous(),
                "pagedserve_cpu::write_kv: quantized rows need head_dim a multiple of ", kBlock,
                " in a contiguous cache of blocks of a multiple of ", pagedserve_cpu::kv_quant::kTile, " slots");
    if (cache.size(3) == dim / kBlock * Q8_0::kBlockBytes)
      return quantize_rows<Src, Q8_0>(cache, rows, slot, tokens, k);
    TORCH_CHECK(cache.size(3) == dim / kBlock * Q4_0::kBlockBytes, "pagedserve_cpu::write_kv: a uint8 cache "
                "needs rows of q8_0 or q4_0 bytes for head_dim ", dim, ", got ", cache.size(3));
    return quantize_rows<Src, Q4_0>(cache, rows, slot, tokens, k);
  }
  switch (cache.scalar_type()) {
    case at::kFloat: return write_rows<Src, float>(cache, rows, slot, tokens);
    case at::kBFloat16: return write_rows<Src, c10::BFloat16>(cache, rows, slot, tokens);
    case at::kHalf: return write_rows<Src, c10::Half>(cache, rows, slot, tokens);
    default:
      TORCH_CHECK(false, "pagedserve_cpu::write_kv: cache dtype ", cache.scalar_type(),
                  " has no kernel; allowed: float32, bfloat16, float16, uint8 (q8_0, q4_0)");
  }
}

void write(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slot, int64_t tokens, bool k) {
  switch (rows.scalar_type()) {
    case at::kFloat: return write_from<float>(cache, rows, slot, tokens, k);
    case at::kBFloat16: return write_from<c10::BFloat16>(cache, rows, slot, tokens, k);
    case at::kHalf: return write_from<c10::Half>(cache, rows, slot, tokens, k);
    default:
      TORCH_CHECK(false, "pagedserve_cpu::write_kv: k/v dtype ", rows.scalar_type(),
                  " has no kernel; allowed: float32, bfloat16, float16");
  }
}

// Returns -1 when every slot was written, else the first slot past the cache (and then writes nothing).
// Slots < 0 are padding tokens and are skipped.
int64_t write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "pagedserve_cpu::write_kv: the caches need unit stride in head_dim");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t tokens = slots.numel(), num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] >= num_slots) return slot[t];
  }
  write(k_cache, k.contiguous(), slot, tokens, true);     // (K: rotated and in the K order, if quantized)
  write(v_cache, v.contiguous(), slot, tokens, false);
  return -1;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> int",
        &write_kv);
}

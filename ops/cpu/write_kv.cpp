// pagedserve::write_kv: copy each token's K and V rows into its cache slot, one memcpy per (token, head).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace {

// Returns -1 when every slot was written, else the first slot past the cache (and then writes nothing).
// Slots < 0 are padding tokens and are skipped.
int64_t write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "pagedserve_cpu::write_kv: the caches need unit stride in head_dim");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t tokens = slots.numel(), block_size = k_cache.size(1);
  const int64_t num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] >= num_slots) return slot[t];
  }
  const auto kc = k.contiguous(), vc = v.contiguous();
  const int64_t heads = k.size(1), row_bytes = k.size(2) * k.element_size(), item = k.element_size();
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const auto* k_src = static_cast<const char*>(kc.data_ptr());
  const auto* v_src = static_cast<const char*>(vc.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t src = (t * heads + h) * row_bytes;
      std::memcpy(k_dst + (block * k_cache.stride(0) + offset * k_cache.stride(1) + h * k_cache.stride(2)) * item,
                  k_src + src, row_bytes);
      std::memcpy(v_dst + (block * v_cache.stride(0) + offset * v_cache.stride(1) + h * v_cache.stride(2)) * item,
                  v_src + src, row_bytes);
    }
  }
  return -1;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> int",
        &write_kv);
}

// pagedserve::quant_rows on CPUs: rows of a QuantizedWeight (layout: ops/quant_weight.py) dequantized, one
// output row per id, where the torch body unpacks each id's whole 8-row tile with a few dozen small ops.
// The same fp32 operations as QuantizedWeight.dequantize: two-level factors multiplied out (super * sub),
// then q * scale and + min as two roundings (int6: (q - 32) * sub, exact, then * super), cast at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "bf16.h"

namespace {

using pagedserve_cpu::from_float;

constexpr int64_t kGroup = 32, kTile = 8, kSuper = 8;

// Value k of row r in a tile-group: int8 rows are stored whole; int4 and int6 keep 4 values of a row side by
// side per vector p = k / 8 (byte 4r + k % 4, the low nibble for k % 8 < 4), int6's top two bits as 2-bit codes
// in the same order after the first 128 bytes (vector p in nibble p % 2 of byte block p / 2).
inline int32_t value(const uint8_t* group, int bits, int64_t r, int64_t k) {
  if (bits == 8) return static_cast<int8_t>(group[r * kGroup + k]);
  const int64_t p = k / 8, j = k % 4, upper = (k % 8) / 4, at = 4 * r + j;
  const int32_t low = (group[p * 32 + at] >> (4 * upper)) & 0xF;
  if (bits == 4) return low;
  const int32_t codes = (group[128 + (p / 2) * 32 + at] >> (4 * (p % 2))) & 0xF;
  return low | (((codes >> (2 * upper)) & 3) << 4);
}

template <typename T>
void dequantize_rows(const int64_t* ids, int64_t n, const uint8_t* w, const void* scales, const void* mins,
                     const float* supers, int bits, int64_t groups, T* out) {
  const int64_t group_bytes = kTile * kGroup * bits / 8, blocks = (groups + kSuper - 1) / kSuper;
  const int64_t super_count = mins != nullptr ? 2 : 1;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = ids[i] / kTile, r = ids[i] % kTile;
      T* dst = out + i * groups * kGroup;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = w + (t * groups + g) * group_bytes;
        const int64_t f = (t * groups + g) * kTile + r;       // the row's factor in [T, G, 8]
        const float* super =
            supers == nullptr ? nullptr : supers + ((t * blocks + g / kSuper) * super_count) * kTile + r;
        if (bits == 6) {
          const int8_t* subs = static_cast<const int8_t*>(scales) + f * 2;
          for (int64_t k = 0; k < kGroup; ++k) {
            const float exact = static_cast<float>(value(group, 6, r, k) - 32) * static_cast<float>(subs[k / 16]);
            dst[g * kGroup + k] = from_float<T>(exact * super[0]);
          }
          continue;
        }
        float scale, min = 0.f;
        if (super != nullptr) {
          scale = super[0] * static_cast<float>(static_cast<const uint8_t*>(scales)[f]);
          if (mins != nullptr) min = super[kTile] * static_cast<float>(static_cast<const uint8_t*>(mins)[f]);
        } else {
          scale = static_cast<const float*>(scales)[f];
          if (mins != nullptr) min = static_cast<const float*>(mins)[f];
        }
        for (int64_t k = 0; k < kGroup; ++k) {
          const float product = static_cast<float>(value(group, bits, r, k)) * scale;
          dst[g * kGroup + k] = from_float<T>(mins != nullptr ? product + min : product);
        }
      }
    }
  });
}

// (rows, the position of the first id outside [0, out_features), or -1); the op's Python side checked the
// tensors' forms
std::tuple<at::Tensor, int64_t> quant_rows(const at::Tensor& ids, const at::Tensor& qweight, const at::Tensor& scales,
                                           const std::optional<at::Tensor>& mins,
                                           const std::optional<at::Tensor>& supers, int64_t bits,
                                           int64_t out_features, bool bf16) {
  const int64_t n = ids.size(0), groups = qweight.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (id[i] < 0 || id[i] >= out_features) return {at::Tensor(), i};
  at::Tensor out = at::empty({n, groups * kGroup}, qweight.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const bool has_mins = mins.has_value() && mins->defined(), two_level = supers.has_value() && supers->defined();
  const void* m = has_mins ? mins->data_ptr() : nullptr;
  const float* s = two_level ? supers->data_ptr<float>() : nullptr;
  const auto* w = static_cast<const uint8_t*>(qweight.data_ptr());
  if (bf16)
    dequantize_rows(id, n, w, scales.data_ptr(), m, s, static_cast<int>(bits), groups,
                    static_cast<uint16_t*>(out.data_ptr()));
  else
    dequantize_rows(id, n, w, scales.data_ptr(), m, s, static_cast<int>(bits), groups, out.data_ptr<float>());
  return {out, -1};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quant_rows(Tensor ids, Tensor qweight, Tensor scales, Tensor? mins, Tensor? supers, int bits, "
        "int out_features, bool bf16) -> (Tensor, int)",
        &quant_rows);
}

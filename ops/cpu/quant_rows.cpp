// pagedserve::quant_rows on CPUs: rows of a QuantizedWeight (layout: ops/quant_weight.py) dequantized, one
// output row per id, where the torch body takes a few dozen small ops per tile.
// The same fp32 operations as QuantizedWeight.dequantize: two-level factors multiplied out (super * sub),
// then q * scale and + min as two roundings (int6: (q - 32) * sub, exact, then * super), cast at the end.
// Also quant_linear's dense path (quant_dense_linear): the whole weight dequantized to bf16 the same way,
// then torch's bf16 GEMM (oneDNN, on AMX tiles where the CPU has them), for calls with many x rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

using pagedserve_cpu::from_float;

constexpr int64_t kGroup = 32, kTile = 8, kSuper = 8;
// Most bytes of bf16 weights the dense path dequantizes per GEMM: one GEMM over all output rows ran ~1.8x
// faster than GEMMs over blocks of 512 at 512 x rows (each call packs x again), so only tables as large as
// an output head are split.
constexpr int64_t kDenseBlockBytes = 64 << 20;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// An int4 or int6 tile-group's values, row by row: dword r of vector p holds row r's k = 8p..8p+3 in its low
// nibbles and 8p+4..8p+7 in its high ones, so gathering dwords r, 8 + r, 16 + r, 24 + r puts row r in one
// 128-bit lane (4 rows a register), and interleaving the lane's low and high nibbles by dword orders it.
inline void tile_group_values(const uint8_t* group, int bits, int8_t* q) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int half = 0; half < 2; ++half) {       // rows 0..3, then 4..7
    const int r = 4 * half;
    const __m512i rows = _mm512_permutex2var_epi32(
        _mm512_loadu_si512(group), _mm512_setr_epi32(r, 8 + r, 16 + r, 24 + r, r + 1, 9 + r, 17 + r, 25 + r,
                                                     r + 2, 10 + r, 18 + r, 26 + r, r + 3, 11 + r, 19 + r, 27 + r),
        _mm512_loadu_si512(group + 64));
    __m512i low = _mm512_and_si512(rows, nibble);
    __m512i high = _mm512_and_si512(_mm512_srli_epi16(rows, 4), nibble);
    if (bits == 6) {    // vector p's 2-bit codes: dword r of block p / 2, nibble p % 2
      const __m512i codes = _mm512_srlv_epi32(
          _mm512_permutexvar_epi32(_mm512_setr_epi32(r, r, 8 + r, 8 + r, r + 1, r + 1, 9 + r, 9 + r, r + 2, r + 2,
                                                     10 + r, 10 + r, r + 3, r + 3, 11 + r, 11 + r),
                                   _mm512_loadu_si512(group + 128)),
          _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
      low = _mm512_or_si512(low, _mm512_slli_epi16(_mm512_and_si512(codes, _mm512_set1_epi8(0x03)), 4));
      high = _mm512_or_si512(high, _mm512_slli_epi16(_mm512_and_si512(codes, _mm512_set1_epi8(0x0C)), 2));
    }
    const __m512i first = _mm512_unpacklo_epi32(low, high), second = _mm512_unpackhi_epi32(low, high);
    for (int lane = 0; lane < 4; ++lane) {
      int8_t* row = q + (r + lane) * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm512_extracti32x4_epi32(first, lane));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16), _mm512_extracti32x4_epi32(second, lane));
    }
  }
}
#endif

// A tile-group's 8 rows of 32 values as stored, q[8][32] (int6: 0..63, standing for q - 32). int8 rows are
// stored whole; int4 and int6 keep 4 values of a row side by side per vector p = k / 8 (byte 4r + k % 4, the
// low nibble for k % 8 < 4), int6's top two bits as 2-bit codes in the same order after the first 128 bytes
// (vector p in nibble p % 2 of byte block p / 2).
inline void group_values(const uint8_t* group, int bits, int8_t* q) {
  if (bits == 8) {
    std::memcpy(q, group, kTile * kGroup);
    return;
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  tile_group_values(group, bits, q);
#else
  for (int r = 0; r < kTile; ++r)
    for (int k = 0; k < kGroup; ++k) {
      const int p = k / 8, at = p * 32 + 4 * r + k % 4, upper = (k % 8) / 4;
      const int low = (group[at] >> (4 * upper)) & 0xF;
      const int codes = bits == 6 ? (group[128 + (p / 2) * 32 + 4 * r + k % 4] >> (4 * (p % 2))) & 0xF : 0;
      q[r * kGroup + k] = static_cast<int8_t>(low | (((codes >> (2 * upper)) & 3) << 4));
    }
#endif
}

struct Weight {
  const uint8_t* q;
  const void* scales;
  const void* mins;      // nullptr: none
  const float* supers;   // nullptr: flat fp32 scales and mins
  int bits;
  int64_t groups;
};

enum class Then { kNothing, kAddMin, kTimesSuper };

// 16 values of a row's group, cast to T: (q + offset) * scale, then (one more rounding) + or * `by`.
template <typename T>
inline void scale_half(const int8_t* q, int offset, float scale, Then then, float by, T* dst) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_cvtepi8_epi32(bytes), _mm512_set1_epi32(offset)));
  __m512 f = _mm512_mul_ps(v, _mm512_set1_ps(scale));
  if (then == Then::kAddMin) f = _mm512_add_ps(f, _mm512_set1_ps(by));
  if (then == Then::kTimesSuper) f = _mm512_mul_ps(f, _mm512_set1_ps(by));
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, f);
  } else {    // from_float's rounding: nearest-even on the bits, NaN as 0x7FC0
    const __m512i u = _mm512_castps_si512(f);
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(rounded));
  }
#else
  for (int k = 0; k < 16; ++k) {
    float f = static_cast<float>(q[k] + offset) * scale;
    if (then == Then::kAddMin) f = f + by;
    if (then == Then::kTimesSuper) f = f * by;
    dst[k] = from_float<T>(f);
  }
#endif
}

// Rows [first, first + count) of tile t (count <= 8) dequantized into out, row i at out + i * K.
template <typename T>
void dequantize_tile(const Weight& w, int64_t t, int first, int count, T* out) {
  const int64_t group_bytes = kTile * kGroup * w.bits / 8, blocks = (w.groups + kSuper - 1) / kSuper;
  const int64_t super_count = w.mins != nullptr ? 2 : 1, k_total = w.groups * kGroup;
  int8_t q[kTile * kGroup];
  for (int64_t g = 0; g < w.groups; ++g) {
    group_values(w.q + (t * w.groups + g) * group_bytes, w.bits, q);
    for (int r = first; r < first + count; ++r) {
      const int64_t f = (t * w.groups + g) * kTile + r;       // the row's factor in [T, G, 8]
      const float* super =
          w.supers == nullptr ? nullptr : w.supers + ((t * blocks + g / kSuper) * super_count) * kTile + r;
      const int8_t* qr = q + r * kGroup;
      T* dst = out + (r - first) * k_total + g * kGroup;
      if (w.bits == 6) {    // (q - 32) * sub is exact
        const int8_t* subs = static_cast<const int8_t*>(w.scales) + f * 2;
        for (int h = 0; h < 2; ++h)
          scale_half(qr + 16 * h, -32, static_cast<float>(subs[h]), Then::kTimesSuper, super[0], dst + 16 * h);
        continue;
      }
      float scale, min = 0.f;
      if (super != nullptr) {
        scale = super[0] * static_cast<float>(static_cast<const uint8_t*>(w.scales)[f]);
        if (w.mins != nullptr) min = super[kTile] * static_cast<float>(static_cast<const uint8_t*>(w.mins)[f]);
      } else {
        scale = static_cast<const float*>(w.scales)[f];
        if (w.mins != nullptr) min = static_cast<const float*>(w.mins)[f];
      }
      const Then then = w.mins != nullptr ? Then::kAddMin : Then::kNothing;
      for (int h = 0; h < 2; ++h) scale_half(qr + 16 * h, 0, scale, then, min, dst + 16 * h);
    }
  }
}

Weight weight_of(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                 const std::optional<at::Tensor>& supers, int64_t bits) {
  const bool has_mins = mins.has_value() && mins->defined(), two_level = supers.has_value() && supers->defined();
  return {static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr(), has_mins ? mins->data_ptr() : nullptr,
          two_level ? supers->data_ptr<float>() : nullptr, static_cast<int>(bits), qweight.size(1)};
}

// (rows, the position of the first id outside [0, out_features), or -1); the op's Python side checked the
// tensors' forms
std::tuple<at::Tensor, int64_t> quant_rows(const at::Tensor& ids, const at::Tensor& qweight, const at::Tensor& scales,
                                           const std::optional<at::Tensor>& mins,
                                           const std::optional<at::Tensor>& supers, int64_t bits,
                                           int64_t out_features, bool bf16) {
  const int64_t n = ids.size(0), k = qweight.size(1) * kGroup;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (id[i] < 0 || id[i] >= out_features) return {at::Tensor(), i};
  at::Tensor out = at::empty({n, k}, qweight.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const Weight w = weight_of(qweight, scales, mins, supers, bits);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int r = static_cast<int>(id[i] % kTile);
      if (bf16)
        dequantize_tile(w, id[i] / kTile, r, 1, static_cast<uint16_t*>(out.data_ptr()) + i * k);
      else
        dequantize_tile(w, id[i] / kTile, r, 1, out.data_ptr<float>() + i * k);
    }
  });
  return {out, -1};
}

// y = x @ W.T for bf16 x: the weights dequantized to bf16 (in blocks of output rows under kDenseBlockBytes;
// `block` rows when given, rounded down to whole tiles), then one GEMM per block into its columns of y (sums
// in fp32, rounded to bf16 once).
at::Tensor quant_dense_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& supers,
                              int64_t bits, int64_t out_features, std::optional<int64_t> block_opt) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "quant_dense_linear: x must be contiguous bf16");
  const int64_t k = qweight.size(1) * kGroup;
  const Weight w = weight_of(qweight, scales, mins, supers, bits);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  const int64_t block_rows = std::max<int64_t>(kTile, block_opt.value_or(kDenseBlockBytes / (2 * k)) / kTile * kTile);
  // kept between calls: a fresh buffer over glibc's mmap threshold (32 MB) page-faults in on every call,
  // which took as long as the GEMM itself for the default model's 55 MB gate/up weights at 512 rows
  static thread_local std::vector<uint16_t> kept;
  kept.resize(std::max<size_t>(kept.size(), std::min(block_rows, out_features) * k));
  uint16_t* rows = kept.data();
  at::Tensor block = at::from_blob(rows, {std::min(block_rows, out_features), k}, x.options());
  for (int64_t n0 = 0; n0 < out_features; n0 += block_rows) {
    const int64_t n = std::min(block_rows, out_features - n0);
    at::parallel_for(0, n / kTile, 4, [&](int64_t begin, int64_t end) {   // block_rows: whole tiles
      for (int64_t t = begin; t < end; ++t) dequantize_tile(w, n0 / kTile + t, 0, kTile, rows + t * kTile * k);
    });
    if (n % kTile) dequantize_tile(w, (n0 + n) / kTile, 0, static_cast<int>(n % kTile), rows + n / kTile * kTile * k);
    at::Tensor columns = y.narrow(1, n0, n);
    at::mm_out(columns, x, block.narrow(0, 0, n).t());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quant_rows(Tensor ids, Tensor qweight, Tensor scales, Tensor? mins, Tensor? supers, int bits, "
        "int out_features, bool bf16) -> (Tensor, int)",
        &quant_rows);
  m.def("quant_dense_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? supers, int bits, "
        "int out_features, int? block=None) -> Tensor",
        &quant_dense_linear);
}

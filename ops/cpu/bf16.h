// bf16 <-> fp32 on raw uint16_t bits, written so gcc vectorizes the loops that use them (c10::BFloat16's
// converting constructor, with its NaN branch, keeps loops scalar). Rounding: nearest-even, like c10.
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedserve_cpu {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float f);

template <>
inline float from_float<float>(float f) { return f; }

template <>
inline uint16_t from_float<uint16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

}  // namespace pagedserve_cpu

// Runs the lambda with `scalar_t` = float for fp32 tensors and uint16_t (bf16 bits) for bf16 ones.
#define PAGEDSERVE_DISPATCH_F32_BF16(dtype, name, ...)                                          \
  [&] {                                                                                         \
    if ((dtype) == at::kFloat) {                                                                \
      using scalar_t = float;                                                                   \
      return __VA_ARGS__();                                                                     \
    }                                                                                           \
    TORCH_CHECK((dtype) == at::kBFloat16, name, ": dtype ", (dtype), " has no C++ kernel; allowed: " \
                "float32, bfloat16");                                                           \
    using scalar_t = uint16_t;                                                                  \
    return __VA_ARGS__();                                                                       \
  }()

// Which instruction sets this build of the kernels uses (build.py compiles for one -march), so Python and the
// tests follow the build rather than the CPU's flags: a build for the AVX2 baseline on an AVX-512 CPU
// (PAGEDSERVE_CPU_MARCH=x86-64-v3) runs the paths a Zen 3 runs.
#include <torch/library.h>

#include <string>

#include "amx.h"
#include "simd.h"

namespace {

// Comma-separated: avx2, avx512, avx512_vnni, avx512_bf16, amx_bf16, amx_int8 (AMX where the process may also
// use the tiles).
std::string instruction_sets() {
  std::string sets;
  const auto add = [&](const char* name) { sets += sets.empty() ? name : std::string(",") + name; };
#ifdef PAGEDSERVE_AVX2
  add("avx2");
#endif
#ifdef PAGEDSERVE_AVX512
  add("avx512");
#if defined(__AVX512VNNI__)
  add("avx512_vnni");
#endif
#if defined(__AVX512BF16__)
  add("avx512_bf16");
#endif
#endif
  if (pagedserve_cpu::amx::available()) {
#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__) && defined(__AMX_BF16__)
    add("amx_bf16");    // attention_amx.h's condition
#endif
#ifdef PAGEDSERVE_AMX_INT8
    add("amx_int8");    // quant_tiles.h's
#endif
  }
  return sets;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("instruction_sets() -> str", &instruction_sets); }

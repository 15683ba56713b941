// Matrix tiles for quant_linear's many-row calls (verify rows, prefill): int8 products of 16 x rows by 16
// outputs per instruction with AMX-INT8 (tdpbssd) where the CPU has it and Linux grants the tile state, and
// the same integer sums in scalar code elsewhere, so the layout code around them is tested on every machine.
//
// B, the weight operand, is K/4 rows of 64 bytes: 4 consecutive k of each of 16 outputs. An int4 tile-group's
// 32-byte vector p already holds, for each of its 8 rows, k = 8p..8p+3 in the low nibbles and 8p+4..8p+7 in
// the high ones, so B's rows 2p and 2p+1 for two adjacent tiles are their vectors p side by side, nibbles
// split: no shuffles. int6 adds each value's top two bits and its -32 offset, and splits each group into its
// two 16-value halves (each has its own sub-scale). A, the x operand, is the quantized rows as they are.
#pragma once

#include <cstdint>

#include "amx.h"

namespace pagedserve_cpu::tiles {

constexpr int kRows = 16;        // x rows per product (A's rows)
constexpr int kCols = 16;        // outputs per product: two 8-row weight tiles
constexpr int kBRow = 64;        // bytes per row of B: 4 k of each output
constexpr int kGroupB = 512;     // one group's unpacked B: int4 8 rows; int6 two halves of 4 rows

// Whether this process can run AMX-INT8 tiles.
inline bool hardware() {
#ifdef PAGEDSERVE_AMX_INT8
  return amx::available();
#else
  return false;
#endif
}

// Two independent products per call, C = A . B: A [`rows` (at most 16) rows `stride` apart, kbytes int8],
// B [kbytes / 4, 64], C [rows, 16] int32. A thread makes one Products for a run of calls (AMX keeps its
// configuration per thread); fewer rows make the tile loads and stores cheaper.
class Products {
 public:
  Products(int kbytes, int rows, bool use_amx) : kbytes_(kbytes), rows_(rows), amx_(use_amx) {
#ifdef PAGEDSERVE_AMX_INT8
    if (amx_) {
      amx::TileConfig config;
      for (int t = 0; t < 2; ++t) {
        config.set(t, rows, kCols * 4);         // tmm0-1: C
        config.set(2 + t, rows, kbytes);        // tmm2-3: A
        config.set(4 + t, kbytes / 4, kBRow);   // tmm4-5: B
      }
      amx::configure(config);
    }
#endif
  }
  ~Products() {
#ifdef PAGEDSERVE_AMX_INT8
    if (amx_) _tile_release();
#endif
  }
  Products(const Products&) = delete;
  Products& operator=(const Products&) = delete;

  void two(const int8_t* a0, const int8_t* b0, const int8_t* a1, const int8_t* b1, int64_t stride, int32_t* c0,
           int32_t* c1) const {
#ifdef PAGEDSERVE_AMX_INT8
    if (amx_) {
      _tile_loadd(2, a0, stride);
      _tile_loadd(4, b0, kBRow);
      _tile_loadd(3, a1, stride);
      _tile_loadd(5, b1, kBRow);
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbssd(0, 2, 4);
      _tile_dpbssd(1, 3, 5);
      _tile_stored(0, c0, kCols * 4);
      _tile_stored(1, c1, kCols * 4);
      return;
    }
#endif
    one(a0, b0, stride, c0);
    one(a1, b1, stride, c1);
  }

 private:
  void one(const int8_t* a, const int8_t* b, int64_t stride, int32_t* c) const {
    for (int r = 0; r < rows_; ++r)
      for (int n = 0; n < kCols; ++n) {
        int32_t sum = 0;
        for (int q = 0; q < kbytes_ / 4; ++q)
          for (int j = 0; j < 4; ++j) sum += a[r * stride + 4 * q + j] * b[q * kBRow + 4 * n + j];
        c[r * kCols + n] = sum;
      }
  }
  int kbytes_, rows_;
  bool amx_;
};

// One group of two adjacent 8-row tiles as B: int4 (128 bytes a tile-group) into 8 rows, values 0..15.
inline void unpack_int4(const uint8_t* t0, const uint8_t* t1, int8_t* b) {
  for (int p = 0; p < 4; ++p)
    for (int half = 0; half < 2; ++half) {
      const uint8_t* v = (half ? t1 : t0) + 32 * p;
      int8_t* lo = b + (2 * p) * kBRow + 32 * half;
      int8_t* hi = lo + kBRow;
      for (int i = 0; i < 32; ++i) {
        lo[i] = static_cast<int8_t>(v[i] & 0x0F);
        hi[i] = static_cast<int8_t>(v[i] >> 4);
      }
    }
}

// int6 (192 bytes a tile-group: the low nibbles as int4's, then H[0], H[1] with the top bits): values q - 32,
// half h's 4 rows at b + 256 h (vectors 2h and 2h + 1 of the group).
inline void unpack_int6(const uint8_t* t0, const uint8_t* t1, int8_t* b) {
  for (int p = 0; p < 4; ++p)
    for (int half = 0; half < 2; ++half) {
      const uint8_t* tile = half ? t1 : t0;
      const uint8_t* v = tile + 32 * p;
      const uint8_t* h = tile + 128 + 32 * (p / 2);
      const int shift = 4 * (p % 2);   // vector p's codes: low nibble's two bits, then the high nibble's
      int8_t* lo = b + (2 * p) * kBRow + 32 * half;
      int8_t* hi = lo + kBRow;
      for (int i = 0; i < 32; ++i) {
        const int code = h[i] >> shift;
        lo[i] = static_cast<int8_t>(((v[i] & 0x0F) | ((code & 3) << 4)) - 32);
        hi[i] = static_cast<int8_t>(((v[i] >> 4) | (((code >> 2) & 3) << 4)) - 32);
      }
    }
}

}  // namespace pagedserve_cpu::tiles

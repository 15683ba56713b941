// AMX tile registers, shared by the kernels that use them (attention_amx.h, quant_tiles.h): the permission
// Linux wants before a process touches them, their shapes, and a scope that configures them.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_AMX_TILE 1
#if defined(__AMX_INT8__)
#define PAGEDSERVE_AMX_INT8 1
#endif
#endif

namespace pagedserve_cpu::amx {

// Whether this process can run tiles: built for them and granted the tile-data state (asked once; later
// asks are no-ops).
inline bool available() {
#ifdef PAGEDSERVE_AMX_TILE
  constexpr long kReqPerm = 0x1023, kTileData = 18;    // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  return granted;
#else
  return false;
#endif
}

// The shapes of tiles 0..7 (palette 1): rows, and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int r, int bytes) {
    rows[tile] = static_cast<uint8_t>(r);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

#ifdef PAGEDSERVE_AMX_TILE
// Loads the shapes into this thread's tile registers (the shapes live in each core's registers).
inline void configure(const TileConfig& config) {
  // (through asm: GCC 12 took _tile_loadconfig for a call that reads nothing and dropped the stores)
  asm volatile("ldtilecfg %0" : : "m"(config));
}

// The tile registers configured while it lives (released after: a thread holding them costs every context
// switch their 8 KB).
struct Tiles {
  explicit Tiles(const TileConfig& config) { configure(config); }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};
#endif

// What a set without tiles holds in their place.
struct NoTiles {
  explicit NoTiles(const TileConfig&) {}
};

}  // namespace pagedserve_cpu::amx

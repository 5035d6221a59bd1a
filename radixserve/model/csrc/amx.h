// Intel AMX tiles for the CPU kernels: the tile configuration and the process's permission.
//
// A tile is up to 16 rows of 64 bytes in a register file of eight; TDPBF16PS multiplies a
// tile of bf16 pairs by another into a tile of floats (16 x 16 x 32 products an instruction).
// Built where the compiler targets AMX (-march=native on a CPU that has it) and used where
// Linux lets the process have the tile state, which it must ask for once.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && RADIXSERVE_VEC_BF16
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RADIXSERVE_AMX 1
#else
#define RADIXSERVE_AMX 0
#endif

namespace radixserve_cpu {

#if RADIXSERVE_AMX
// LDTILECFG's 64-byte operand (palette 1): per tile, its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int n_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(n_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

// Whether this process may run tile instructions: Linux hands out the 8 KB of tile state
// per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), and a
// tile instruction without it is a fatal signal. RADIXSERVE_CPU_AMX=0 declines them, so
// the kernels take their AVX-512 paths (for comparing the two on one machine).
inline bool amx_usable() {
  static const bool usable = [] {
    const char* env = std::getenv("RADIXSERVE_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}
#else
inline bool amx_usable() { return false; }
#endif

}  // namespace radixserve_cpu

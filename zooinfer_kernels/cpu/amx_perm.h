// Whether this process may run AMX tile instructions: the CPU reports AMX-TILE and the tile
// product a caller needs (CPUID 7.0 EDX bit 22 AMX-BF16, bit 25 AMX-INT8), and Linux granted the
// tile data state. Linux hands that state to a process only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18); without it the first tile
// instruction faults. The request is made once per process, whichever kernel asks first.
// Also the tile configuration every AMX kernel loads (`TileConfig`, `load_config`).
#pragma once

#include <cstdint>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace zooinfer_amx {

constexpr int kBf16 = 22;  // CPUID 7.0 EDX bit of TDPBF16PS
constexpr int kInt8 = 25;  // CPUID 7.0 EDX bit of TDPBSSD / TDPBSUD

inline bool tile_data_granted() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

// AMX-TILE, the product at CPUID 7.0 EDX bit `product_bit`, and the kernel's permission.
inline bool ready(int product_bit) {
#if defined(__linux__) && defined(__x86_64__)
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  if (!((d >> 24) & 1) || !((d >> product_bit) & 1)) return false;
  return tile_data_granted();
#else
  (void)product_bit;
  return false;
#endif
}

// `ready(kBf16)`, asked once per process (the bf16 screens: screened_argmax.cpp, head_amx.cpp).
inline bool bf16_ready() {
  static const bool ok = ready(kBf16);
  return ok;
}

// The 64-byte operand of ldtilecfg (palette 1): bytes per row and rows of each of the 16 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads `cfg` as this thread's tile configuration. Not _tile_loadconfig: GCC 12's declares a
// pointer-sized memory operand, so the compiler may drop the stores of the rows and columns before
// it (the tiles then stay unconfigured: SIGILL); the whole struct is the asm operand here.
inline void load_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }

// Tiles 0-7 as 16 rows x 64 bytes each (the bf16 screens' configuration).
inline void load_full_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  load_config(cfg);
}

}  // namespace zooinfer_amx

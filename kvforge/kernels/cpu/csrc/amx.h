// AMX's tile registers, shared by the kernels that use them (bf16_gemm.cpp, quant_panels_amx.cpp): the tile
// configuration's layout and the permission Linux asks for. Only the AVX-512 build includes the AMX code.
#pragma once

#if defined(__x86_64__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#define KVFORGE_AMX 1

namespace kvforge_cpu {

// ldtilecfg's 64 bytes: palette 1, then each tile's bytes a row and rows
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux gives a process the AMX tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); granted once, it
// holds for every thread of the process.
inline bool amx_tile_data_permitted() {
  if (!__builtin_cpu_supports("amx-tile")) return false;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;  // NOTE: a fact of the CPU and the kernel, asked once
}

}  // namespace kvforge_cpu
#endif

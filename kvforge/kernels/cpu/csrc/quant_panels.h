// Shared by the panel kernel's two paths (quant_panels.cpp: AVX-512 VNNI, any number of rows of x;
// quant_panels_amx.cpp: AMX-INT8, prompt-size steps): the layout's sizes and the arguments of a multiplication. The
// layout is pictured in quant_panels.cpp and kvforge/kernels/cpu/quant_panels.py.
#pragma once

#include "quant_gemv.h"

#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFORGE_PANELS_VNNI 1
#endif

namespace kvforge_cpu {

#ifdef KVFORGE_PANELS_VNNI

constexpr int64_t kPanel = 16;  // weight rows per panel: one int32 lane each of a 512-bit vector

template <int BITS>
constexpr int64_t vectors_per_block() { return 32 * BITS / 8 / 4; }  // of 64 bytes

// Vectors a group's run holds per block it covers: a whole block's, or half of them (groups of 16 columns).
template <int BITS, bool HALF_BLOCKS>
constexpr int64_t vectors_per_chunk() { return vectors_per_block<BITS>() / (HALF_BLOCKS ? 2 : 1); }

// Panels interleaved in a tile.
template <int BITS>
constexpr int tile_panels() { return BITS == 8 ? 2 : 4; }

// The zero point of a symmetric weight's codes, negated (its offsets are -zero * scales).
template <int BITS>
constexpr float minus_zero() { return BITS == 8 ? -128.f : BITS == 6 ? -32.f : -8.f; }

struct PanelArgs {
  const int8_t* xq;  // [M, K]
  const float* dx;   // [M, K / 32]
  const float* xsum; // [M, G]
  float* out;        // [M, N]
  int64_t M, N, K, G;
  int64_t panel_bytes;
  float factor;
};

inline Avx512::V load_halves(const uint8_t* p) {
  return Avx512::load_half<false>(reinterpret_cast<const uint16_t*>(p));
}

// run(bits, half_blocks, sym) with each as a compile-time constant (std::integral_constant, std::bool_constant)
template <class Run>
void with_layout(int bits, bool half_blocks, bool sym, Run&& run) {
  const auto with_sym = [&](auto bits_c, auto half_c) {
    if (sym) run(bits_c, half_c, std::true_type{});
    else run(bits_c, half_c, std::false_type{});
  };
  const auto with_half = [&](auto bits_c) {
    if (half_blocks) with_sym(bits_c, std::true_type{});
    else with_sym(bits_c, std::false_type{});
  };
  if (bits == 8) with_half(std::integral_constant<int, 8>{});
  else if (bits == 6) with_half(std::integral_constant<int, 6>{});
  else with_half(std::integral_constant<int, 4>{});
}

// Rows of x from which a step takes the AMX path (where the CPU and Linux allow it); below, the VNNI loops.
// NOTE: measured per row of x against the VNNI loops at 31 rows (one thread, 2048 x 2048, 8192 x 2048 and 2048 x 8192
// weights of 4-, 6- and 8-bit codes, min of 10, the Xeon VM under load): at 32 rows 0.83-1.33x, at 64 rows
// 1.07-1.61x, at 512 rows 1.10-1.66x.
constexpr int64_t kAmxMinRows = 64;

// Whether this CPU multiplies int8 tiles and this process may use them.
bool panels_amx_ready();

// The AMX path of quant_gemm_panels: the same sums and float work as the VNNI loops, so the same bits. x's rows
// (xq, dx and xsum) are padded with zeros to a multiple of 16 (the outputs of the padding are not written).
void panel_gemm_amx(const PanelArgs& a, const uint8_t* weight, int64_t parts, int64_t per_part, int64_t part_stride,
                    int bits, bool half_blocks, bool sym);

#endif

}  // namespace kvforge_cpu

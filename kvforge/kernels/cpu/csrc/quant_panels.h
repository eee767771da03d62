// Shared by the panel kernel's two paths (quant_panels.cpp: AVX-512 VNNI, any number of rows of x;
// quant_panels_amx.cpp: AMX-INT8, prompt-size steps): the layout's sizes and the arguments of a multiplication. The
// layout is pictured in quant_panels.cpp and kvforge/kernels/cpu/quant_panels.py.
#pragma once

#include "quant_gemv.h"

#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFORGE_PANELS_VNNI 1
#endif

namespace kvforge_cpu {

constexpr int64_t kPanel = 16;  // weight rows per panel: one int32 lane each of a 512-bit vector

// How a layout groups its columns: into runs of whole 32-column blocks, half blocks (groups of 16 columns), or
// super-blocks of 256 columns: symmetric, 6-bit codes whose 16 sub-blocks of 16 columns have an int8 scale per row
// beside the super-block's float32 one (GGUF's Q6_K as it is stored); or with mins, 4- or 5-bit codes whose 8
// sub-blocks of 32 columns have a 6-bit scale and a 6-bit min per row beside the super-block's half d and dmin
// (GGUF's Q4_K and Q5_K as they are stored).
enum class Groups { kBlocks, kHalves, kSuper };

constexpr int64_t kSuperCols = 256, kSubCols = 16, kSubBlocks = kSuperCols / kSubCols;
constexpr int64_t kSuperHeader = kSubBlocks * kPanel + 4 * kPanel;  // a panel's int8 sub-block scales, float32 ones
// with mins: sc uint8 [8 sub-blocks, 16 rows] | m uint8 [2 quads, 16 rows, 4 sub-blocks] | d, dmin half [16 rows]
constexpr int64_t kMinsSubBlocks = kSuperCols / 32, kMinsHeader = 2 * kMinsSubBlocks * kPanel + 4 * kPanel;

// A panel's bytes of a super-block's scales
template <bool SYM>
constexpr int64_t super_header() { return SYM ? kSuperHeader : kMinsHeader; }

#ifdef KVFORGE_PANELS_VNNI

template <int BITS>
constexpr int64_t vectors_per_block() { return 32 * BITS / 8 / 4; }  // of 64 bytes

// Vectors a group's run holds per block it covers: a whole block's, or half of them (groups of 16 columns).
template <int BITS, Groups GROUPS>
constexpr int64_t vectors_per_chunk() { return vectors_per_block<BITS>() / (GROUPS == Groups::kHalves ? 2 : 1); }

// Panels interleaved in a tile.
template <int BITS>
constexpr int tile_panels() { return BITS == 8 ? 2 : 4; }

// The zero point of a symmetric weight's codes, negated (its offsets are -zero * scales).
template <int BITS>
constexpr float minus_zero() { return -static_cast<float>(1 << (BITS - 1)); }

struct PanelArgs {
  const int8_t* xq;     // [M, K]
  const float* dx;      // [M, K / 32] (kSuper: [M, G], a super-block's)
  const float* xsum;    // [M, G] (kSuper: none)
  const int32_t* xsub;  // kSuper: [M, K / 16], the sum of each 16 columns' q
  const int8_t* xmin;   // kSuper with mins: [M, G, 16], each 32-column sub-block s's sum of q as 64 hi + lo:
                        // lo (0 .. 63) in byte s, hi in byte 8 + s
  float* out;        // [M, N]
  int64_t M, N, K, G;
  int64_t panel_bytes;
  float factor;
};

inline Avx512::I broadcast4(const int8_t* q) {
  int32_t word;
  std::memcpy(&word, q, sizeof(word));
  return _mm512_set1_epi32(word);
}

// Super-blocks with mins: each row's sum over the 8 sub-blocks s of m[s] * (x's sum of q over s), from the rows' m
// (quads[h]: sub-blocks 4 h .. 4 h + 3 in a row's lane) and x's sums as bytes lo | hi at xmin (64 hi + lo each)
inline Avx512::I min_sums(const Avx512::I (&quads)[2], const int8_t* xmin) {
  Avx512::I low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    low = Avx512::dot_u8s8(low, quads[h], broadcast4(xmin + 4 * h));
    high = Avx512::dot_u8s8(high, quads[h], broadcast4(xmin + 8 + 4 * h));
  }
  return _mm512_add_epi32(_mm512_slli_epi32(high, 6), low);
}

inline Avx512::V load_halves(const uint8_t* p) {
  return Avx512::load_half<false>(reinterpret_cast<const uint16_t*>(p));
}

// A 6-bit triple [nibbles 2h | nibbles 2h + 1 | top bits h] at `at` (the next vector `next` bytes on): the codes
// of columns 16 h + 8 s .. + 3 (low) and + 4 .. + 7 (high) of each row, s = 0, 1.
template <class Use>
inline void six_bit_codes(const uint8_t* at, int64_t next, Use&& use) {
  const Avx512::I low_nibbles = _mm512_set1_epi8(0x0F), top_bits = _mm512_set1_epi8(0x30);
  const Avx512::I top = Avx512::load_bytes(at + 2 * next);
  for (int s = 0; s < 2; ++s) {
    const Avx512::I words = Avx512::load_bytes(at + s * next);
    // bits 4-5 of the codes: planes 2s and 2s + 1 of the top byte
    const Avx512::I top_low = s == 0 ? _mm512_slli_epi16(top, 4) : top;
    const Avx512::I top_high = s == 0 ? _mm512_slli_epi16(top, 2) : _mm512_srli_epi16(top, 2);
    const Avx512::I low = _mm512_ternarylogic_epi32(_mm512_and_si512(words, low_nibbles), top_low, top_bits,
                                                    0xF8);  // a | (b & c)
    const Avx512::I high = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles),
                                                     top_high, top_bits, 0xF8);
    use(s, low, high);
  }
}

// 5-bit codes of a block: its 4-bit vector j's nibbles (low, then high: the vpdpbusd s = 2 j, 2 j + 1 of the
// block) with bit 4 of each code from the block's top-bit vector, whose byte c of a row holds in bit s bit 4 of
// the code of column 4 s + c.
inline Avx512::I five_bit_codes(Avx512::I nibbles, Avx512::I top, int s) {
  // (16-bit shifts: after the mask no bit crosses into another byte)
  const Avx512::I shifted = s < 4 ? _mm512_slli_epi16(top, 4 - s) : _mm512_srli_epi16(top, s - 4);
  return _mm512_ternarylogic_epi32(nibbles, shifted, _mm512_set1_epi8(0x10), 0xF8);  // a | (b & c)
}

// The codes of a 4- or 5-bit block's vectors at `at` (the next vector `next` bytes on): use(j, low, high) for j < 4,
// the codes of columns 8 j .. 8 j + 3 (low) and 8 j + 4 .. 8 j + 7 (high) of the block in each row's lane.
template <int BITS, class Use>
inline void nibble_codes(const uint8_t* at, int64_t next, Use&& use) {
  const Avx512::I low_nibbles = _mm512_set1_epi8(0x0F);
  const Avx512::I top = BITS == 5 ? Avx512::load_bytes(at + 4 * next) : _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const Avx512::I words = Avx512::load_bytes(at + j * next);
    const Avx512::I low = _mm512_and_si512(words, low_nibbles);
    const Avx512::I high = _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles);
    if constexpr (BITS == 5) use(j, five_bit_codes(low, top, 2 * j), five_bit_codes(high, top, 2 * j + 1));
    else use(j, low, high);
  }
}

template <Groups GROUPS>
using GroupsConstant = std::integral_constant<Groups, GROUPS>;

// run(bits, groups, sym) with each as a compile-time constant (std::integral_constant, std::bool_constant); super-
// blocks come with 6-bit symmetric codes, or 4- or 5-bit ones with mins
template <class Run>
void with_layout(int bits, Groups groups, bool sym, Run&& run) {
  if (groups == Groups::kSuper) {
    using Super = GroupsConstant<Groups::kSuper>;
    TORCH_CHECK(sym ? bits == 6 : bits == 4 || bits == 5, "super-blocks hold 6-bit symmetric codes or 4- or 5-bit "
                "ones with mins, not ", bits, "-bit ", sym ? "symmetric" : "asymmetric", " ones");
    if (sym) return run(std::integral_constant<int, 6>{}, Super{}, std::true_type{});
    if (bits == 5) return run(std::integral_constant<int, 5>{}, Super{}, std::false_type{});
    return run(std::integral_constant<int, 4>{}, Super{}, std::false_type{});
  }
  const auto with_sym = [&](auto bits_c, auto groups_c) {
    if (sym) run(bits_c, groups_c, std::true_type{});
    else run(bits_c, groups_c, std::false_type{});
  };
  const auto with_half = [&](auto bits_c) {
    if (groups == Groups::kHalves) with_sym(bits_c, GroupsConstant<Groups::kHalves>{});
    else with_sym(bits_c, GroupsConstant<Groups::kBlocks>{});
  };
  if (bits == 5) {  // (GGUF's 5-bit types come in groups of 32 columns)
    TORCH_CHECK(groups == Groups::kBlocks, "5-bit codes come in groups of whole 32-column blocks");
    return with_sym(std::integral_constant<int, 5>{}, GroupsConstant<Groups::kBlocks>{});
  }
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
                    int bits, Groups groups, bool sym);

#endif

}  // namespace kvforge_cpu

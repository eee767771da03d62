// A panel-layout weight (quant_panels.cpp, pictured in kvforge/kernels/cpu/quant_panels.py) dequantized to bfloat16,
// transposed: out [K, N] = W^T, for a GEMM of many rows of x in bfloat16 (oneDNN's, on AVX-512 BF16 and AMX), which
// there is several times the int8 panel kernel's rate (kvforge/kernels/cpu/quant_panels.py: panel_gemm_bf16).
//
// The layout's vectors hold 4 columns of a panel's 16 rows, a row an int32 lane, and its scales and offsets are 16
// halves, a row a lane: so each byte c of the lanes is column c of all 16 rows, one conversion and one multiply-add
// away from 16 weights of one column of W, which are 16 consecutive bfloat16 of a row of W^T (32 bytes; a tile of 4
// panels writes 128 consecutive bytes of each row of W^T). Thread t unpacks part t.
//
// NOTE: float -> bfloat16 rounds to nearest even in integer ops (AVX-512 F), not with AVX-512 BF16's vcvtneps2bf16:
// the shipped AVX-512 build does not assume that extension (kernels/cpu/builds.py), and the weights are finite.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVFORGE_PANEL_UNPACK 1
#endif

namespace kvforge_cpu {

#ifdef KVFORGE_PANEL_UNPACK
namespace {

constexpr int64_t kPanelRows = 16;
constexpr int64_t kBlockColumns = 32;

struct UnpackArgs {
  uint16_t* out;  // [K, N] bfloat16
  int64_t N, G, blocks, panel_bytes;  // blocks: of 32 columns, K / 32
  float factor;
};

inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats -> 16 bfloat16, rounded to nearest even.
inline __m256i to_bf16(__m512 w) {
  const __m512i bits = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// Columns k .. k + 3 of the panel's rows (byte c of each int32 lane of `codes` is column k + c) into W^T's rows
// k .. k + 3 at `out` (column n of W^T: the panel's first row), the `mask` rows of the panel that exist.
inline void store_columns(__m512i codes, __m512 scale, __m512 offset, uint16_t* out, int64_t N, __mmask16 mask) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int c = 0; c < 4; ++c) {
    const __m512i code = _mm512_and_si512(_mm512_srli_epi32(codes, 8 * c), byte);
    const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale, offset);
    _mm256_mask_storeu_epi16(out + c * N, mask, to_bf16(w));
  }
}

// The tile of W panels at `tile` (its first panel p0). A group is `chunks` runs of V vectors a panel (whole blocks),
// or with HALF_BLOCKS one half block (group g: columns 16 g .. 16 g + 15 of block g / 2).
template <int BITS, bool HALF_BLOCKS, bool SYM, int W>
void unpack_tile(const UnpackArgs& a, const uint8_t* tile, int64_t p0, int64_t g) {
  constexpr int64_t V = 32 * BITS / 8 / 4 / (HALF_BLOCKS ? 2 : 1);  // 64-byte vectors a panel, a chunk
  constexpr int64_t header = SYM ? 32 : 64;
  const int64_t chunks = HALF_BLOCKS ? 1 : a.blocks / a.G;
  const int64_t group_bytes = W * (header + chunks * V * 64);
  const __m512 factor = _mm512_set1_ps(a.factor);
  const __m512 minus_zero = _mm512_set1_ps(BITS == 8 ? -128.f : BITS == 6 ? -32.f : -8.f);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  int panels = 0;  // of the tile that hold rows of W
  __mmask16 masks[W];
  for (; panels < W; ++panels) {
    const int64_t valid = std::min<int64_t>(kPanelRows, a.N - (p0 + panels) * kPanelRows);
    if (valid <= 0) break;  // padding panels, at the end of the last part
    masks[panels] = valid >= kPanelRows ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
  }
  {
    const uint8_t* const group = tile + g * group_bytes;
    for (int p = 0; p < panels; ++p) {
      const int64_t n = (p0 + p) * kPanelRows;
      const __mmask16 mask = masks[p];
      const __m512 scale = _mm512_mul_ps(load_halves(group + 32 * p), factor);
      const __m512 offset = SYM ? _mm512_mul_ps(scale, minus_zero)
                                : _mm512_mul_ps(load_halves(group + 32 * (W + p)), factor);
      for (int64_t i = 0; i < chunks; ++i) {
        const int64_t b = HALF_BLOCKS ? g / 2 : g * chunks + i;
        const int64_t column = kBlockColumns * b + (HALF_BLOCKS ? 16 * (g % 2) : 0);
        const uint8_t* const vectors = group + header * W + 64 * (i * V * W + p);
        uint16_t* const out = a.out + column * a.N + n;
        const auto vector = [&](int64_t j) { return _mm512_loadu_si512(vectors + 64 * j * W); };
        if constexpr (BITS == 8) {
          for (int64_t j = 0; j < V; ++j) store_columns(vector(j), scale, offset, out + 4 * j * a.N, a.N, mask);
        } else if constexpr (BITS == 4) {
          for (int64_t j = 0; j < V; ++j) {
            const __m512i words = vector(j);
            store_columns(_mm512_and_si512(words, low_nibbles), scale, offset, out + 8 * j * a.N, a.N, mask);
            store_columns(_mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles), scale, offset,
                          out + (8 * j + 4) * a.N, a.N, mask);
          }
        } else {
          // [nibbles 2h | nibbles 2h + 1 | top bits h]: the top bits of columns 16h + 4i + c in bits 2i, 2i + 1
          const __m512i top_bits = _mm512_set1_epi8(0x30);
          for (int64_t h = 0; h < V / 3; ++h) {
            const __m512i top = vector(3 * h + 2);
            for (int s = 0; s < 2; ++s) {
              const __m512i words = vector(3 * h + s);
              const __m512i top_low = s == 0 ? _mm512_slli_epi16(top, 4) : top;
              const __m512i top_high = s == 0 ? _mm512_slli_epi16(top, 2) : _mm512_srli_epi16(top, 2);
              const __m512i low = _mm512_ternarylogic_epi32(_mm512_and_si512(words, low_nibbles), top_low, top_bits,
                                                            0xF8);  // a | (b & c)
              const __m512i high = _mm512_ternarylogic_epi32(
                  _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles), top_high, top_bits, 0xF8);
              uint16_t* const at = out + (16 * h + 8 * s) * a.N;
              store_columns(low, scale, offset, at, a.N, mask);
              store_columns(high, scale, offset, at + 4 * a.N, a.N, mask);
            }
          }
        }
      }
    }
  }
}

// One part of `count` panels (its first is panel p0), a group at a time: its tiles of tile_panels panels, then the
// last of the rest. NOTE: a group of every tile before the next group writes W^T's rows whole, one after another; a
// whole tile before the next (every row of W^T 128 bytes at a time, 4-16 KiB apart, whose cache lines evict each
// other before they are whole) took 1.7-2.2x as long on the 1B model's shapes (Xeon VM, 2 threads).
template <int BITS, bool HALF_BLOCKS, bool SYM>
void unpack_part(const UnpackArgs& a, const uint8_t* part, int64_t p0, int64_t count) {
  constexpr int T = BITS == 8 ? 2 : 4;
  constexpr bool H = HALF_BLOCKS;
  for (int64_t g = 0; g < a.G; ++g) {
    int64_t s = 0;
    for (; s + T <= count; s += T) unpack_tile<BITS, H, SYM, T>(a, part + s * a.panel_bytes, p0 + s, g);
    const uint8_t* const last = part + s * a.panel_bytes;
    switch (count - s) {
      case 3: if constexpr (T > 3) unpack_tile<BITS, H, SYM, 3>(a, last, p0 + s, g); break;
      case 2: if constexpr (T > 2) unpack_tile<BITS, H, SYM, 2>(a, last, p0 + s, g); break;
      case 1: unpack_tile<BITS, H, SYM, 1>(a, last, p0 + s, g); break;
      default: break;
    }
  }
}

}  // namespace
#endif

// The panel-layout weight [T, S, G, group bytes] of `bits`-bit codes and out_features rows, times factor, into out
// (bfloat16 [K, out_features], contiguous): W^T.
void panel_unpack_bf16(at::Tensor weight, int64_t bits, int64_t out_features, double factor, at::Tensor out) {
#ifdef KVFORGE_PANEL_UNPACK
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 4 && weight.device().is_cpu(),
              "weight must be a uint8 [parts, panels, groups, group bytes] CPU tensor");
  const int64_t parts = weight.size(0), per_part = weight.size(1), G = weight.size(2), group_bytes = weight.size(3);
  const int64_t vector_bytes = 64 * bits;  // of codes, a 32-column block's
  const bool sym = group_bytes % 64 == 32;
  const int64_t codes_bytes = group_bytes - (sym ? 32 : 64);
  const bool half_blocks = codes_bytes == vector_bytes / 2;
  TORCH_CHECK(G > 0 && codes_bytes > 0 && (codes_bytes % vector_bytes == 0 || (half_blocks && G % 2 == 0)),
              "a group of ", group_bytes, " bytes is not a panel layout's group of ", bits, "-bit codes");
  const int64_t K = half_blocks ? G * kBlockColumns / 2 : G * codes_bytes / vector_bytes * kBlockColumns;
  const int64_t panel_bytes = G * group_bytes;
  TORCH_CHECK(weight.stride(3) == 1 && weight.stride(2) == group_bytes && weight.stride(1) == panel_bytes &&
                  (parts == 1 || weight.stride(0) >= per_part * panel_bytes),
              "each part of the weight must be contiguous");
  TORCH_CHECK(out_features > 0 && per_part == ((out_features + kPanelRows - 1) / kPanelRows + parts - 1) / parts,
              "out_features ", out_features, " does not fill ", parts, " parts of ", per_part, " panels");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == K &&
                  out.size(1) == out_features && out.device().is_cpu(),
              "out must be a contiguous bfloat16 [", K, ", ", out_features, "] CPU tensor");
  const UnpackArgs args{reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out_features, G, K / kBlockColumns,
                        panel_bytes, static_cast<float>(factor)};
  const uint8_t* const codes = weight.data_ptr<uint8_t>();
  const int64_t part_stride = weight.stride(0);
  const auto run = [&](auto bits_c, auto half_c, auto sym_c) {
    at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t)
        unpack_part<decltype(bits_c)::value, decltype(half_c)::value, decltype(sym_c)::value>(
            args, codes + t * part_stride, t * per_part, per_part);
    });
  };
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
#else
  TORCH_CHECK(false, "unpacking the panel layout needs a build with AVX-512");
#endif
}

bool panel_unpack_available() {
#ifdef KVFORGE_PANEL_UNPACK
  return true;
#else
  return false;
#endif
}

}  // namespace kvforge_cpu

TORCH_LIBRARY_FRAGMENT(kvforge_cpu, m) {
  m.def("panel_unpack_bf16(Tensor weight, int bits, int out_features, float factor, Tensor(a!) out) -> ()");
  m.def("panel_unpack_available() -> bool", &kvforge_cpu::panel_unpack_available);
}

TORCH_LIBRARY_IMPL(kvforge_cpu, CPU, m) { m.impl("panel_unpack_bf16", &kvforge_cpu::panel_unpack_bf16); }

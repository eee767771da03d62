// The panel kernel at prompt sizes on CPUs with AMX-INT8 (quant_gemm_panels takes this path from kAmxMinRows rows
// of x): the same int8 rounding of x, the same exact int32 sums and then the same float operations, in the same order
// for each output, as the VNNI loops of quant_panels.cpp. A row of x therefore gets the same bits from either path,
// and a request's tokens do not depend on how many other rows share its step.
//
// Four panels (64 weight rows) at a time, their codes are first unpacked from the layout (quant_panels.cpp) to one
// byte a code, as the B tiles of _tile_dpbsud read them: per chunk of columns (a 32-column block, or half of one for
// groups of 16), chunk_cols / 4 rows of 64 bytes, row j holding columns 4 j .. 4 j + 3 of each of the 16 weight rows:
//
//   codes   uint8 [chunks, panel, chunk_cols / 4, 16 rows, 4 columns]    (K * 16 bytes a panel)
//   scales  float [panel, G, 16], offsets float [panel, G, 16]           (times 2^e, as in the layout; SYM: -zero * scale)
//
// then, for each tile of 16 rows of x (A: 16 rows of int8, one chunk's columns; x's rounding laid out as these tiles
// once a step, [M / 16, chunks, 16 rows, chunk_cols], each tile's 16 rows one run of memory), one
// _tile_dpbsud a panel and chunk makes the 16 x 16 int32 sums (C) that 16 row-steps of the VNNI loop make with 8
// vpdpbusd each (one A tile serves the four panels), and the float work is the VNNI loop's, one vector a row of x and
// panel:
//
//   acc[m] = fma(offsets[g], xsum[m, g], acc[m])                         once per group, before its chunks
//   acc[m] = fma(float(C[m]), scales[g] * dx[m, b], acc[m])              once per chunk
//   out[m] = acc[m] * factor
//
// Rows of x are taken in passes of kRowsPerPass (their int8 codes stay in L2), each pass over every panel of the
// thread's part; a panel's codes are unpacked once per pass.
// NOTE: the accumulators live in memory (16 rows x 4 panels of vectors): the C tiles reach the vector registers only
// through memory anyway. Measured (a throwaway C++ loop, 128 rows of x, K = 2048, min of 3000 runs, one core of the
// Xeon VM under load): 4 panels sharing the A tile 313-336 GMAC/s, one panel with its 16 accumulators in registers
// 182-278; the VNNI loops ~110-150 at 15 rows.
#include "amx.h"
#include "quant_panels.h"

#include <utility>
#include <vector>

namespace kvforge_cpu {

#ifdef KVFORGE_PANELS_VNNI  // (amx.h: every AVX-512 build has the AMX code)
namespace {

#define AMX_INT8_FUNCTION __attribute__((target("amx-tile,amx-int8")))

using F = Avx512;

constexpr int64_t kRowTile = 16;      // rows of x in an A (and C) tile
constexpr int64_t kRowsPerPass = 128; // rows of x that every panel of a part meets before the next rows
constexpr int64_t kPanelsAtOnce = 4;  // panels whose B tiles meet each A tile

// Tiles 0-3: C, int32 sums (16 rows of x, 16 weight rows), one a panel; 4: A, 16 rows of x's codes, a chunk's
// columns; 5-7: B, a chunk's weight codes, chunk_cols / 4 rows of 64 bytes (panel p's in tile 5 + p % 3).
AMX_INT8_FUNCTION void configure_tiles(int64_t chunk_cols) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = t < 4 ? kRowTile : static_cast<uint8_t>(chunk_cols / 4);
  }
  config.colsb[4] = static_cast<uint16_t>(chunk_cols);
  config.rows[4] = kRowTile;
  // NOTE: the barrier keeps the stores above: the intrinsic tells the compiler it reads only the first 8 bytes
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

AMX_INT8_FUNCTION void release_tiles() { _tile_release(); }

// Panel `first` of the tile of W panels at `tile`: its codes one byte each (chunk c at codes + c * kPanelsAtOnce *
// chunk_bytes: the picture above) and its groups' scales and offsets as floats, the VNNI loop's unpacking and offsets.
template <int BITS, Groups GROUPS, bool SYM>
void unpack_panel(const uint8_t* tile, int64_t W, int64_t first, int64_t K, int64_t G, uint8_t* codes, float* scales,
                  float* offsets) {
  constexpr bool HALF_BLOCKS = GROUPS == Groups::kHalves;
  constexpr int64_t V = vectors_per_chunk<BITS, GROUPS>();
  constexpr int64_t header = SYM ? 32 : 64;
  constexpr int64_t chunk_bytes = (HALF_BLOCKS ? 16 : 32) * 16;  // unpacked: chunk_cols / 4 rows of 64 bytes
  const int64_t chunks = HALF_BLOCKS ? 1 : K / kBlock / G;  // chunks a group's run holds
  const int64_t group_bytes = W * (header + chunks * V * 64);
  const F::I low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* const group = tile + g * group_bytes;
    const F::V scale = load_halves(group + 32 * first);
    F::store(scales + 16 * g, scale);
    F::store(offsets + 16 * g, SYM ? F::mul(scale, F::set1(minus_zero<BITS>())) : load_halves(group + 32 * (W + first)));
    for (int64_t i = 0; i < chunks; ++i) {
      uint8_t* const out = codes + (g * chunks + i) * kPanelsAtOnce * chunk_bytes;
      const auto vector = [&](int64_t j) { return F::load_bytes(group + header * W + 64 * ((i * V + j) * W + first)); };
      const auto store = [&](int64_t row, F::I v) { _mm512_storeu_si512(out + 64 * row, v); };
      if constexpr (BITS == 8) {
        for (int64_t j = 0; j < V; ++j) store(j, vector(j));
      } else if constexpr (BITS == 4 || BITS == 5) {
        const F::I top = BITS == 5 ? vector(4) : _mm512_setzero_si512();  // 5 bits: after 4 nibble vectors
        for (int64_t j = 0; j < (BITS == 5 ? 4 : V); ++j) {
          const F::I words = vector(j), low = _mm512_and_si512(words, low_nibbles);
          const F::I high = _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles);
          store(2 * j, BITS == 5 ? five_bit_codes(low, top, 2 * j) : low);
          store(2 * j + 1, BITS == 5 ? five_bit_codes(high, top, 2 * j + 1) : high);
        }
      } else {
        for (int64_t h = 0; h < V / 3; ++h)
          six_bit_codes(group + header * W + 64 * ((i * V + 3 * h) * W + first), 64 * W,
                        [&](int s, F::I low, F::I high) {
                          store(4 * h + 2 * s, low);
                          store(4 * h + 2 * s + 1, high);
                        });
      }
    }
  }
}

// One chunk of 16 rows of x (`x`, an A tile's rows one after another) against NP panels' unpacked codes (panel p's
// at codes + p * stride): sums[p] [16 rows of x, 16 int32] = C of panel p. (The tile intrinsics take their tile
// numbers as literals.)
template <int NP>
AMX_INT8_FUNCTION inline void chunk_sums(const int8_t* x, int64_t chunk_cols, const uint8_t* codes, int64_t stride,
                                         int32_t (*sums)[kRowTile * 16]) {
  _tile_loadd(4, x, chunk_cols);
  _tile_loadd(5, codes, 64);
  _tile_zero(0);
  _tile_dpbsud(0, 4, 5);
  if constexpr (NP > 1) {
    _tile_loadd(6, codes + stride, 64);
    _tile_zero(1);
    _tile_dpbsud(1, 4, 6);
  }
  if constexpr (NP > 2) {
    _tile_loadd(7, codes + 2 * stride, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 4, 7);
  }
  if constexpr (NP > 3) {
    _tile_loadd(5, codes + 3 * stride, 64);
    _tile_zero(3);
    _tile_dpbsud(3, 4, 5);
  }
  _tile_stored(0, sums[0], 64);
  if constexpr (NP > 1) _tile_stored(1, sums[1], 64);
  if constexpr (NP > 2) _tile_stored(2, sums[2], 64);
  if constexpr (NP > 3) _tile_stored(3, sums[3], 64);
}

// A row tile's sums acc [16 rows of x, NP * 16] times the weight's factor into out's rows m0 .. (those of x) and
// columns n .. n + 16 NP - 1, the last panel's first `valid` of them.
template <int NP>
inline void store_row_tile(const PanelArgs& a, int64_t m0, int64_t n, int64_t valid, const float (*acc)[NP * 16]) {
  const F::V factor = F::set1(a.factor);
  const __mmask16 all = 0xFFFF, last = valid >= kPanel ? all : static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < kRowTile && m0 + m < a.M; ++m)
    for (int p = 0; p < NP; ++p)
      _mm512_mask_storeu_ps(a.out + (m0 + m) * a.N + n + 16 * p, p == NP - 1 ? last : all,
                            F::mul(F::load(acc[m] + 16 * p), factor));
}

// Rows m0 .. m0 + 15 of x (padded; `x_tiles` their A tiles) against NP unpacked panels (panel p's codes at codes +
// p * chunk_bytes, scales and offsets + p * G * 16), whose outputs are columns n .. n + 16 NP - 1, the last panel's
// `valid` of them.
template <bool HALF_BLOCKS, int NP>
AMX_INT8_FUNCTION void row_tile(const PanelArgs& a, int64_t m0, const int8_t* x_tiles, const uint8_t* codes,
                                const float* scales, const float* offsets, int64_t n, int64_t valid) {
  const int64_t K = a.K, G = a.G, blocks = K / kBlock, chunks = HALF_BLOCKS ? 1 : blocks / G;
  constexpr int64_t chunk_cols = HALF_BLOCKS ? 16 : 32, chunk_bytes = chunk_cols * 16;
  const float* const dx = a.dx + m0 * blocks;
  const float* const xsum = a.xsum + m0 * G;
  alignas(64) int32_t sums[NP][kRowTile * 16];
  alignas(64) float acc[kRowTile][NP * 16] = {};
  int64_t c = 0;  // chunks so far
  for (int64_t g = 0; g < G; ++g) {
    F::V scale[NP], offset[NP];
    for (int p = 0; p < NP; ++p) {
      scale[p] = F::load(scales + (p * G + g) * 16);
      offset[p] = F::load(offsets + (p * G + g) * 16);
    }
    for (int64_t i = 0; i < chunks; ++i, ++c) {
      const int64_t b = HALF_BLOCKS ? g / 2 : g * chunks + i;
      chunk_sums<NP>(x_tiles + c * kRowTile * chunk_cols, chunk_cols, codes + c * kPanelsAtOnce * chunk_bytes,
                     chunk_bytes, sums);
      const bool group_starts = i == 0;
#pragma GCC unroll 16
      for (int m = 0; m < kRowTile; ++m) {
        const F::V d = F::set1(dx[m * blocks + b]), group_sum = F::set1(xsum[m * G + g]);
        for (int p = 0; p < NP; ++p) {
          F::V sum = F::load(acc[m] + 16 * p);
          if (group_starts) sum = F::fma(offset[p], group_sum, sum);  // the group's, before its chunks
          sum = F::fma(F::to_float(F::load_bytes(sums[p] + 16 * m)), F::mul(scale[p], d), sum);
          F::store(acc[m] + 16 * p, sum);
        }
      }
    }
  }
  store_row_tile<NP>(a, m0, n, valid, acc);
}

template <bool HALF_BLOCKS>
void row_tile(int np, const PanelArgs& a, int64_t m0, const int8_t* x_tiles, const uint8_t* codes,
              const float* scales, const float* offsets, int64_t n, int64_t valid) {
  switch (np) {
    case 4: return row_tile<HALF_BLOCKS, 4>(a, m0, x_tiles, codes, scales, offsets, n, valid);
    case 3: return row_tile<HALF_BLOCKS, 3>(a, m0, x_tiles, codes, scales, offsets, n, valid);
    case 2: return row_tile<HALF_BLOCKS, 2>(a, m0, x_tiles, codes, scales, offsets, n, valid);
    default: return row_tile<HALF_BLOCKS, 1>(a, m0, x_tiles, codes, scales, offsets, n, valid);
  }
}

// One part of `count` panels at `part` (its first is panel p0), in tiles of tile_panels<BITS>() panels (the last
// 1 ..): its panels four at a time (or the 1-3 left, or the last before the padding) against every tile of x's rows.
template <int BITS, Groups GROUPS, bool SYM>
void part_gemm(const PanelArgs& a, const int8_t* x_tiles, const uint8_t* part, int64_t p0, int64_t count) {
  constexpr bool HALF_BLOCKS = GROUPS == Groups::kHalves;
  constexpr int64_t T = tile_panels<BITS>(), kPanels = kPanelsAtOnce, chunk_bytes = (HALF_BLOCKS ? 16 : 32) * 16;
  const int64_t K = a.K, G = a.G;
  std::vector<uint8_t> codes(static_cast<size_t>(kPanels * K * 16));
  std::vector<float> scales(kPanels * G * 16), offsets(kPanels * G * 16);
  const int64_t tiled = count;  // the part's panels, padding included, as its tiles are laid out
  count = std::min(count, (a.N + kPanel - 1) / kPanel - p0);  // without the padding panels
  configure_tiles(HALF_BLOCKS ? 16 : 32);
  const int64_t rows = (a.M + kRowTile - 1) / kRowTile * kRowTile;
  for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
    for (int64_t s = 0; s < count; s += kPanels) {
      const int np = static_cast<int>(std::min(kPanels, count - s));
      for (int p = 0; p < np; ++p) {
        const int64_t tile_start = (s + p) / T * T;  // the panel's tile, of W panels
        unpack_panel<BITS, GROUPS, SYM>(part + tile_start * a.panel_bytes, std::min(T, tiled - tile_start),
                                        s + p - tile_start, K, G, codes.data() + p * chunk_bytes,
                                        scales.data() + p * G * 16, offsets.data() + p * G * 16);
      }
      const int64_t n = (p0 + s) * kPanel, valid = std::min<int64_t>(kPanel, a.N - n - kPanel * (np - 1));
      for (int64_t m0 = pass; m0 < std::min(rows, pass + kRowsPerPass); m0 += kRowTile)
        row_tile<HALF_BLOCKS>(np, a, m0, x_tiles + m0 * K, codes.data(), scales.data(), offsets.data(), n, valid);
    }
  }
  release_tiles();
}

// Super-blocks (Groups::kSuper): each weight's sub-block scale goes into its codes, w = sc[s] * (code - zero) (zero 32
// for 6-bit symmetric codes, 0 for 4- and 5-bit ones with mins), an integer of up to 13 bits cut into two int8 tiles,
// w = 64 hi + lo (lo in [0, 64)), so two _tile_dpbssd of the full depth (64 columns) make 64 * C(hi) + C(lo), the
// exact int32 sum of the VNNI loop; C accumulates over a super-block's four chunks of 64 columns, and the float work,
// one vector a row of x and panel, is the VNNI loop's, once per super-block (with mins, msum of min_sums: the rows' m
// against x's sub-block sums, as the VNNI loop makes it):
//
//   acc[m] = fma(float(64 C(hi)[m] + C(lo)[m]), d[g] * dx[m, g], acc[m])
//   acc[m] = fma(float(msum[m]), dmin[g] * -dx[m, g], acc[m])                  then, with mins
//
//   codes   int8 [K / 64 chunks, hi | lo, 16 rows of 64 bytes (4 columns of the 16 weight rows)]    a panel's
//   d       float [G, 16], then (mins) dmin float [G, 16]
//   m       (mins) uint8 [G, 2 quads, 64 bytes], as the layout holds them
constexpr int64_t kSuperChunk = 64;                         // columns of an A tile
constexpr int64_t kSuperChunkBytes = 2 * kSuperChunk * 16;  // a chunk's hi and lo tiles
constexpr int64_t kSuperPanels = 2;                         // panels (4 C tiles) that meet each A tile

// w = sc * (code - zero) of a vector of codes (byte 4 r + c: weight row r) as (hi, lo), sc the 16 rows' int8 scales
inline std::pair<F::I, F::I> scaled_codes(F::I codes, F::I sc, int zero) {
  // each row's scale in its 4 bytes: lane L of 128 bits holds rows 4 L .. 4 L + 3
  const F::I spread = _mm512_shuffle_epi8(
      sc, _mm512_set_epi32(0x0F0F0F0F, 0x0E0E0E0E, 0x0D0D0D0D, 0x0C0C0C0C, 0x0B0B0B0B, 0x0A0A0A0A, 0x09090909,
                           0x08080808, 0x07070707, 0x06060606, 0x05050505, 0x04040404, 0x03030303, 0x02020202,
                           0x01010101, 0x00000000));
  const F::I centred = _mm512_sub_epi8(codes, _mm512_set1_epi8(static_cast<char>(zero)));
  F::I hi[2], lo[2];
  for (int half = 0; half < 2; ++half) {
    const __m256i c = half == 0 ? _mm512_castsi512_si256(centred) : _mm512_extracti64x4_epi64(centred, 1);
    const __m256i e = half == 0 ? _mm512_castsi512_si256(spread) : _mm512_extracti64x4_epi64(spread, 1);
    const F::I product = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(c), _mm512_cvtepi8_epi16(e));
    hi[half] = _mm512_srai_epi16(product, 6);
    lo[half] = _mm512_and_si512(product, _mm512_set1_epi16(63));
  }
  const auto bytes = [](F::I (&v)[2]) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(v[0])), _mm512_cvtepi16_epi8(v[1]), 1);
  };
  return {bytes(hi), bytes(lo)};
}

// Panel `first` of the tile of W panels at `tile`: its codes times their sub-block scales as hi and lo tiles, its
// super-blocks' float scales d (and dmin), and (mins) its m (the picture above).
template <int BITS, bool SYM>
void unpack_super_panel(const uint8_t* tile, int64_t W, int64_t first, int64_t G, int8_t* codes, float* d,
                        uint8_t* mins) {
  constexpr int64_t V = vectors_per_block<BITS>(), blocks = kSuperCols / kBlock, header = super_header<SYM>();
  constexpr int64_t subs = SYM ? kSubBlocks : kMinsSubBlocks;  // sub-blocks: their int8 scales [subs, 16 rows]
  const int64_t group_bytes = W * (header + blocks * V * 64);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* const group = tile + g * group_bytes;
    if constexpr (SYM) {
      F::store(d + 16 * g, F::load(reinterpret_cast<const float*>(group + subs * kPanel * W) + kPanel * first));
    } else {
      const uint8_t* const halves = group + 2 * subs * kPanel * W;  // d [W, 16], then dmin [W, 16]
      F::store(d + 16 * g, load_halves(halves + 32 * first));
      F::store(d + 16 * (G + g), load_halves(halves + 32 * (W + first)));
      std::memcpy(mins + 128 * g, group + subs * kPanel * W + 128 * first, 128);
    }
    const auto sub_scales = [&](int64_t sub) {
      return _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + subs * kPanel * first + kPanel * sub)));
    };
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t* const chunk = codes + (g * blocks + b) / 2 * kSuperChunkBytes;  // two blocks a chunk
      const auto store = [&](int64_t row, F::I sc, F::I low, F::I high) {  // columns 4 row .. of the chunk's tiles
        for (int k = 0; k < 2; ++k) {
          const auto [hi, lo] = scaled_codes(k == 0 ? low : high, sc, SYM ? 32 : 0);
          _mm512_storeu_si512(chunk + 64 * (row + k), hi);
          _mm512_storeu_si512(chunk + kSuperChunkBytes / 2 + 64 * (row + k), lo);
        }
      };
      const uint8_t* const vectors = group + header * W + 64 * (b * V * W + first);
      if constexpr (SYM) {
        for (int64_t h = 0; h < 2; ++h) {  // the block's two sub-blocks
          const F::I sc = sub_scales(2 * b + h);
          six_bit_codes(vectors + 64 * 3 * h * W, 64 * W, [&](int s, F::I low, F::I high) {
            store(8 * (b % 2) + 4 * h + 2 * s, sc, low, high);
          });
        }
      } else {
        const F::I sc = sub_scales(b);
        nibble_codes<BITS>(vectors, 64 * W,
                           [&](int j, F::I low, F::I high) { store(8 * (b % 2) + 2 * j, sc, low, high); });
      }
    }
  }
}

// Rows m0 .. m0 + 15 of x (padded; `x_tiles` their A tiles of 64 columns) against NP unpacked panels (panel p's
// codes at codes + p * stride, d (and dmin) at d + p * 2 G * 16, m at mins + p * G * 128), whose outputs are columns
// n .. n + 16 NP - 1, the last panel's `valid`.
template <bool SYM, int NP>
AMX_INT8_FUNCTION void super_row_tile(const PanelArgs& a, int64_t m0, const int8_t* x_tiles, const int8_t* codes,
                                      int64_t stride, const float* d, const uint8_t* mins, int64_t n, int64_t valid) {
  const int64_t G = a.G;
  const float* const dx = a.dx + m0 * G;
  alignas(64) int32_t sums[2 * NP][kRowTile * 16];
  alignas(64) float acc[kRowTile][NP * 16] = {};
  for (int64_t g = 0; g < G; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NP > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t c = 4 * g; c < 4 * g + 4; ++c) {
      const int8_t* const chunk = codes + c * kSuperChunkBytes;
      _tile_loadd(4, x_tiles + c * kRowTile * kSuperChunk, kSuperChunk);
      _tile_loadd(5, chunk, 64);
      _tile_dpbssd(0, 4, 5);
      _tile_loadd(6, chunk + kSuperChunkBytes / 2, 64);
      _tile_dpbssd(1, 4, 6);
      if constexpr (NP > 1) {
        _tile_loadd(7, chunk + stride, 64);
        _tile_dpbssd(2, 4, 7);
        _tile_loadd(5, chunk + stride + kSuperChunkBytes / 2, 64);
        _tile_dpbssd(3, 4, 5);
      }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    if constexpr (NP > 1) {
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
    }
    F::V scale[NP], min[NP];
    F::I quads[NP][2];
    for (int p = 0; p < NP; ++p) {
      scale[p] = F::load(d + (2 * p * G + g) * 16);
      if constexpr (!SYM) {
        min[p] = F::load(d + (2 * p * G + G + g) * 16);
        for (int h = 0; h < 2; ++h) quads[p][h] = F::load_bytes(mins + (p * G + g) * 128 + 64 * h);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < kRowTile; ++m) {
      const F::V dxm = F::set1(dx[m * G + g]);
      for (int p = 0; p < NP; ++p) {
        const F::I total = _mm512_add_epi32(_mm512_slli_epi32(F::load_bytes(sums[2 * p] + 16 * m), 6),
                                            F::load_bytes(sums[2 * p + 1] + 16 * m));
        F::V sum = F::fma(F::to_float(total), F::mul(scale[p], dxm), F::load(acc[m] + 16 * p));
        if constexpr (!SYM) {
          const F::I msum = min_sums(quads[p], a.xmin + ((m0 + m) * G + g) * 16);
          sum = F::fma(F::to_float(msum), F::mul(min[p], F::set1(-dx[m * G + g])), sum);
        }
        F::store(acc[m] + 16 * p, sum);
      }
    }
  }
  store_row_tile<NP>(a, m0, n, valid, acc);
}

// part_gemm of super-blocks: panels two at a time against every tile of x's rows.
template <int BITS, bool SYM>
void super_part_gemm(const PanelArgs& a, const int8_t* x_tiles, const uint8_t* part, int64_t p0, int64_t count) {
  constexpr int64_t T = tile_panels<BITS>();
  const int64_t K = a.K, G = a.G, panel_codes = K / kSuperChunk * kSuperChunkBytes;
  std::vector<int8_t> codes(static_cast<size_t>(kSuperPanels * panel_codes));
  std::vector<float> d(kSuperPanels * 2 * G * 16);
  std::vector<uint8_t> mins(SYM ? 0 : kSuperPanels * G * 128);
  const int64_t tiled = count;  // the part's panels, padding included, as its tiles are laid out
  count = std::min(count, (a.N + kPanel - 1) / kPanel - p0);  // without the padding panels
  configure_tiles(kSuperChunk);
  const int64_t rows = (a.M + kRowTile - 1) / kRowTile * kRowTile;
  for (int64_t pass = 0; pass < rows; pass += kRowsPerPass) {
    for (int64_t s = 0; s < count; s += kSuperPanels) {
      const int np = static_cast<int>(std::min(kSuperPanels, count - s));
      for (int p = 0; p < np; ++p) {
        const int64_t tile_start = (s + p) / T * T;  // the panel's tile, of W panels
        unpack_super_panel<BITS, SYM>(part + tile_start * a.panel_bytes, std::min(T, tiled - tile_start),
                                      s + p - tile_start, G, codes.data() + p * panel_codes,
                                      d.data() + p * 2 * G * 16, SYM ? nullptr : mins.data() + p * G * 128);
      }
      const int64_t n = (p0 + s) * kPanel, valid = std::min<int64_t>(kPanel, a.N - n - kPanel * (np - 1));
      for (int64_t m0 = pass; m0 < std::min(rows, pass + kRowsPerPass); m0 += kRowTile) {
        const int8_t* const x = x_tiles + m0 * K;
        if (np == 2) super_row_tile<SYM, 2>(a, m0, x, codes.data(), panel_codes, d.data(), mins.data(), n, valid);
        else super_row_tile<SYM, 1>(a, m0, x, codes.data(), panel_codes, d.data(), mins.data(), n, valid);
      }
    }
  }
  release_tiles();
}

// x's int8 rows [rows (a multiple of 16), K] as A tiles: [rows / 16, K / chunk_cols, 16 rows, chunk_cols]
std::vector<int8_t> x_as_tiles(const int8_t* xq, int64_t rows, int64_t K, int64_t chunk_cols) {
  std::vector<int8_t> tiles(rows * K);
  const int64_t chunks = K / chunk_cols;
  at::parallel_for(0, rows / kRowTile, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t r = 0; r < kRowTile; ++r)
          std::memcpy(tiles.data() + ((t * chunks + c) * kRowTile + r) * chunk_cols,
                      xq + (t * kRowTile + r) * K + c * chunk_cols, chunk_cols);
  });
  return tiles;
}

template <int BITS, Groups GROUPS, bool SYM>
void panel_gemm(const PanelArgs& a, const uint8_t* weight, int64_t parts, int64_t per_part, int64_t part_stride) {
  const int64_t chunk_cols = GROUPS == Groups::kSuper ? kSuperChunk : GROUPS == Groups::kHalves ? 16 : 32;
  const std::vector<int8_t> x_tiles = x_as_tiles(a.xq, (a.M + kRowTile - 1) / kRowTile * kRowTile, a.K, chunk_cols);
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      if (t * per_part * kPanel >= a.N) continue;  // padding alone
      if constexpr (GROUPS == Groups::kSuper)
        super_part_gemm<BITS, SYM>(a, x_tiles.data(), weight + t * part_stride, t * per_part, per_part);
      else part_gemm<BITS, GROUPS, SYM>(a, x_tiles.data(), weight + t * part_stride, t * per_part, per_part);
    }
  });
}

}  // namespace

bool panels_amx_ready() {
  return __builtin_cpu_supports("amx-int8") && amx_tile_data_permitted();
}

void panel_gemm_amx(const PanelArgs& a, const uint8_t* weight, int64_t parts, int64_t per_part, int64_t part_stride,
                    int bits, Groups groups, bool sym) {
  with_layout(bits, groups, sym, [&](auto bits_c, auto groups_c, auto sym_c) {
    panel_gemm<decltype(bits_c)::value, decltype(groups_c)::value, decltype(sym_c)::value>(a, weight, parts, per_part,
                                                                                           part_stride);
  });
}

#endif

}  // namespace kvforge_cpu

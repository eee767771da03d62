// Weight-only quantized matmul over row panels with int8 activations and AVX-512 VNNI, for any number of rows of x
// (decode, batched decode, prefill chunks). Layout (made and pictured in kvforge/kernels/cpu/quant_panels.py):
//
//   weight   uint8 [T, S, G, 64 + B * V * 64]   T parts of S panels of 16 weight rows (panel t S + s holds rows
//                                               16 (t S + s) ..; panels past the weight's rows are zeros); each part
//                                               in tiles of W panels (4-bit: W = 4, 8-bit: W = 2; the last tile of a
//                                               part 1 .. W), each tile per group of B 32-column blocks one run:
//              scales half [W, 16] | offsets half [W, 16]   (each panel's rows side by side, times 2^e)
//              then per block, V vectors per panel of 64 bytes, [V, W, 64]: each 4 bytes of every row of the panel
//              (an int32 lane a row):
//                8 bits (V = 8): vector j, row r, byte c = code[r, 32 b + 4 j + c]
//                4 bits (V = 4): low nibble code[r, 32 b + 8 j + c], high nibble code[r, 32 b + 8 j + 4 + c]
//                5 bits (V = 5): j < 4 the low 4 bits as the 4-bit vector j, j = 4 bit 4 of columns 32 b + 4 s + c
//                                in bit s of byte c (GGUF's Q5_1, Q5_K: 0.625 bytes a weight)
//                6 bits (V = 6): j = 3 h + v: v < 2 the low 4 bits as the 4-bit vector 2 h + v, v = 2 the top 2
//                                bits of columns 32 b + 16 h + 4 i + c in bits 2 i, 2 i + 1 of byte c (GGUF's 5- and
//                                6-bit types: 0.75 bytes a weight where 8-bit codes take 1)
//              or groups of 16 columns (GGUF's Q6_K, Q3_K, Q2_K: G even, the last dimension 64 + V/2 * 64): group
//              g holds half of block g / 2, its vectors V/2 (g % 2) .. V/2 (g % 2) + V/2 - 1, [V/2, W, 64]
//              or super-blocks (Groups::kSuper, 6-bit symmetric codes: G = K / 256, the last dimension
//              kSuperHeader + 8 * 6 * 64): sc int8 [W, 16 sub-blocks, 16] | d float32 [W, 16] | 8 blocks' vectors
//              or super-blocks with mins (Groups::kSuper, 4- or 5-bit codes: the last dimension kMinsHeader +
//              8 * V * 64): sc uint8 [W, 8 sub-blocks, 16] | m uint8 [W, 2 quads, 16 rows, 4 sub-blocks] |
//              d half [W, 16] | dmin half [W, 16] | 8 blocks' vectors
//            the parts may lie apart (any stride between them, a multiple of 64 bytes); each part is contiguous
//
//   W[n, k] = (code[n, k] * scales[n, g] + offsets[n, g]) * factor,   factor = 2^-e
//   (super-blocks: W[n, k] = (code[n, k] - 32) * sc[n, k / 16] * d[n, g] * factor, x rounded per 256 columns:
//   super_tile; with mins W[n, k] = code[n, k] * sc[n, k / 32] * d[n, g] - m[n, k / 32] * dmin[n, g]: mins_tile)
//
// x is rounded to int8 per 32 columns (dx = max |x| / 127, q = round(x / dx), as quant_gemv_int8.cpp), in its own
// column order. One _mm512_dpbusd_epi32 multiplies 4 columns of all 16 rows by 4 broadcast bytes of q and adds them
// into the rows' int32 lanes, so a block of 32 columns is 8 instructions for 16 x 32 products, and the float work,
//
//   out[m, rows] += float(isum[m, rows]) * scales[g, rows] * dx[m, b]        once per block
//   out[m, rows] += offsets[g, rows] * xsum[m, g]                            once per group
//
// is one conversion and two multiply-adds per 512 products (a float GEMM needs 32 FMAs for them), and factor is
// applied once per output. With groups of 16 columns, a block's int32 sums are two, one a half block, the first line
// is once per half block, and xsum[m, g] is the sum of the half block's q times its block's dx. Thread t multiplies
// part t (with fewer threads than parts, a run of parts each). A step loads each weight vector once for a whole tile
// against up to whole_tile_rows rows of x, reading the tile's bytes in order; with more rows, for two panels of the
// tile against 4 rows of x.
//
// NOTE: the tile is what makes one row of x stream at the copy's rate: in it one row reads one run of memory, where
// panels one after another (each panel's codes, then all scales, then all offsets, in three arrays) took four runs a
// thread and prefetches 4 tiles ahead. And one
// part a thread lets the loader put part t of every weight of a model, one after another in the order the model
// calls them, into one region of memory (quantization/weight_only_kernels.py, interleave_panel_parts): each thread
// then reads one run of memory through a whole decode step. Measured, the default model's 30 layers (random codes)
// called from a C++ loop, against the layout before, both kernels in one process in turns with a 1 GiB copy, median
// ratio of 15 rounds (Zen 4 EPYC VM, 2 threads, a throwaway script): 4-bit, 1 row of x 1.14-1.24x (faster in 12-15
// of 15 rounds), 2 rows 1.18-1.20x, 3 rows 1.08x, 4 rows 1.01-1.03x, 16 rows 0.95-1.00x, 64 rows 0.94-0.98x;
// 8-bit, 1 row 1.16-1.19x, 2 rows 0.93-0.95x, 3 rows 1.11x, 16 rows 1.01-1.03x, 64 rows 0.97x. Weights in cache
// (one layer's, reused), 4-bit: 1 row 1.25x, 16 rows 1.01x. The same tiles with each weight whole instead of in
// per-thread regions: within 0-9% below (1 row 1.12-1.17x).
// NOTE: each load prefetches (to L2, prefetcht1) the same byte of the next tile: at 16 rows, 4-bit, 1.00x the layout
// before; 2 tiles ahead 0.93x, 4 tiles 0.90x, 8 tiles 0.84x, half a tile 0.92x (Zen 4). At 1-3 rows of x it was left
// to the hardware prefetchers until measured on the Intel Xeon VM (2 threads, 8192 x 2048 weights, ~1.1 GB of them
// out of cache, best of 15; `ahead` the next tile): 1 row, 4-bit asymmetric 22.3 -> 25.7 GB/s, symmetric 21.5 ->
// 24.5, 5-bit 19.0 -> 25.0, 6-bit super-blocks 19.1 -> 24.4, 8-bit 23.6 -> 25.3 (the 1 GiB copy 26.9); 2 rows 4-bit
// 20.9 -> 25.0, 6-bit 18.6 -> 24.4; weights in L3 (~130 MB), 1 row 1.4-1.7x. Whole
// 4-bit tiles against 3 rows of x a step (12 sums and 12 accumulators) instead of pairs of panels against 4, at 16
// rows: 0.83x; against 2 rows, 0.90x.
// NOTE: 8-bit weights take tiles of 2 panels. In tiles of 4, 2-3 rows of x read 0.64-0.87x the layout before and 16
// rows 0.80-1.00x, in whole tiles or pairs, prefetching 1, 2 or 4 tiles ahead or not at all; in tiles of 2 (above),
// 2 rows 0.93-0.95x, 3 rows 1.11x, 16 rows 1.01-1.03x.
// NOTE: a tile reads its pointers into locals once, and prefetches without a branch (where the target lies past
// the part, a tile prefetches its own bytes). With a branch at each load and the fields read through the
// arguments, GCC 12 kept each loaded vector on the stack and read it back for each nibble: 1.72x slower in cache.
// NOTE: symmetric weights (SYM: every zero point 8 for 4-bit codes, 32 for 6-bit, 128 for 8-bit: GGUF's Q4_0, Q8_0,
// Q5_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS, whose decoders shift codes to those zero points) keep only the scales in a group's
// header (32 bytes a panel), and the kernel makes each offset as -zero * scale: 0.5625 bytes a 4-bit weight in groups
// of 32 columns (GGUF's Q4_0 bytes) instead of 0.625, 0.875 a 6-bit one in groups of 16 instead of 1.
// NOTE: groups of half a block are a template parameter (HALF_BLOCKS), not a branch in the loop: groups of whole
// blocks compile to the same instructions as before there were halves (GCC 12, their disassembly compared).
#include "quant_panels.h"

#include <cstring>
#include <type_traits>
#include <vector>

namespace kvforge_cpu {

#ifdef KVFORGE_PANELS_VNNI
namespace {

using F = Avx512;

// Up to these rows of x, a step multiplies a whole tile (super-blocks hold a third set of int32 sums: 2 rows).
template <int BITS, Groups GROUPS>
constexpr int64_t whole_tile_rows() { return GROUPS == Groups::kSuper ? 2 : BITS == 4 ? 3 : BITS == 8 ? 1 : 2; }

// out[m0 .. m0 + MT, rows of panels first .. first + NP of a tile whose first panel is p0] = acc * factor
template <int MT, int NP>
void store_rows(const PanelArgs& a, F::V (&acc)[MT][NP], int64_t p0, int first, int64_t m0) {
  const F::V factor = F::set1(a.factor);
  for (int p = 0; p < NP; ++p) {
    const int64_t n = (p0 + first + p) * kPanel, valid = std::min<int64_t>(kPanel, a.N - n);
    if (valid <= 0) break;  // padding panels, at the end of the last part
    const __mmask16 mask = valid >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    for (int m = 0; m < MT; ++m)
      _mm512_mask_storeu_ps(a.out + (m0 + m) * a.N + n, mask, F::mul(acc[m][p], factor));
  }
}

// Row m's int32 sums of the 4 columns at q (x's codes) and 4 + q, times each row's codes in low and high.
template <int MT, int NP>
inline void dot8(F::I (&sums)[MT][NP], int p, F::I low, F::I high, const int8_t* q, int64_t K) {
  for (int m = 0; m < MT; ++m) {
    sums[m][p] = F::dot_u8s8(sums[m][p], low, broadcast4(q + m * K));
    sums[m][p] = F::dot_u8s8(sums[m][p], high, broadcast4(q + m * K + 4));
  }
}

// panel_tile of super-blocks: per 16-column sub-block s of super-block g, each row's int32 sum of (code - 32) * q
// (the VNNI sum of code * q, less 32 times the sub-block's sum of q) times the row's int8 scale sc[s], added up in
// int32 over the super-block (exact: |sum| <= 256 * 128 * 32 * 127 < 2^31); then once per super-block
//
//   out[m, rows] += float(isum[m, rows]) * (d[g, rows] * dx[m, g])
template <int MT, int NP, int W>
void super_tile(const PanelArgs& a, const uint8_t* tile, const uint8_t* ahead, int64_t p0, int first, int64_t m0) {
  constexpr int64_t V = vectors_per_block<6>(), blocks = kSuperCols / kBlock;
  const int64_t K = a.K, G = a.G, subs = K / kSubCols;
  const int64_t group_bytes = W * (kSuperHeader + blocks * V * 64), next = 64 * W;
  const int8_t* const xq = a.xq + m0 * K;
  const float* const dx = a.dx + m0 * G;
  const int32_t* const xsub = a.xsub + m0 * subs;
  F::V acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = F::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* const group = tile + g * group_bytes;
    F::I total[MT][NP];
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < NP; ++p) total[m][p] = _mm512_setzero_si512();
    for (int64_t s = 0; s < kSubBlocks; ++s) {  // half s % 2 of block s / 2
      F::I sums[MT][NP];
      for (int m = 0; m < MT; ++m)
        for (int p = 0; p < NP; ++p) sums[m][p] = _mm512_setzero_si512();
      for (int p = 0; p < NP; ++p) {
        const int64_t at = g * group_bytes + kSuperHeader * W + 64 * ((s / 2 * V + 3 * (s % 2)) * W + first + p);
        for (int64_t v = 0; v < 3; ++v) prefetch<kToL2>(ahead + at + v * next);
        six_bit_codes(tile + at, next, [&](int half, F::I low, F::I high) {
          dot8(sums, p, low, high, xq + kSuperCols * g + kSubCols * s + 8 * half, K);
        });
      }
      for (int p = 0; p < NP; ++p) {
        const F::I sc = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + kSubBlocks * kPanel * (first + p) + kPanel * s)));
        for (int m = 0; m < MT; ++m) {
          const F::I x_sum = _mm512_set1_epi32(32 * xsub[m * subs + kSubBlocks * g + s]);  // of the -32s
          const F::I centred = _mm512_sub_epi32(sums[m][p], x_sum);
          total[m][p] = _mm512_add_epi32(total[m][p], _mm512_mullo_epi32(centred, sc));
        }
      }
    }
    for (int p = 0; p < NP; ++p) {
      const F::V d = F::load(reinterpret_cast<const float*>(group + kSubBlocks * kPanel * W) + kPanel * (first + p));
      for (int m = 0; m < MT; ++m)
        acc[m][p] = F::fma(F::to_float(total[m][p]), F::mul(d, F::set1(dx[m * G + g])), acc[m][p]);
    }
  }
  store_rows(a, acc, p0, first, m0);
}

// panel_tile of super-blocks with mins (4- or 5-bit codes): per 32-column sub-block s of super-block g, each row's
// int32 sum of code * q times the row's sc[s], added up over the super-block (|sum| <= 8 * 63 * 32 * 31 * 127 <
// 2^31), and its mins against x's sub-block sums (min_sums); then once per super-block
//
//   out[m, rows] += float(isum[m, rows]) * (d[g, rows] * dx[m, g]) + float(msum[m, rows]) * (dmin[g, rows] * -dx[m, g])
template <int BITS, int MT, int NP, int W>
void mins_tile(const PanelArgs& a, const uint8_t* tile, const uint8_t* ahead, int64_t p0, int first, int64_t m0) {
  constexpr int64_t V = vectors_per_block<BITS>(), subs = kMinsSubBlocks;
  const int64_t K = a.K, G = a.G;
  const int64_t group_bytes = W * (kMinsHeader + subs * V * 64), next = 64 * W;
  const int8_t* const xq = a.xq + m0 * K;
  const float* const dx = a.dx + m0 * G;
  const int8_t* const xmin = a.xmin + m0 * G * 16;
  F::V acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = F::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* const group = tile + g * group_bytes;
    F::I total[MT][NP];
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < NP; ++p) total[m][p] = _mm512_setzero_si512();
    for (int64_t s = 0; s < subs; ++s) {
      F::I sums[MT][NP];
      for (int m = 0; m < MT; ++m)
        for (int p = 0; p < NP; ++p) sums[m][p] = _mm512_setzero_si512();
      for (int p = 0; p < NP; ++p) {
        const int64_t at = g * group_bytes + kMinsHeader * W + 64 * (s * V * W + first + p);
        for (int64_t v = 0; v < V; ++v) prefetch<kToL2>(ahead + at + v * next);
        nibble_codes<BITS>(tile + at, next, [&](int j, F::I low, F::I high) {
          dot8(sums, p, low, high, xq + kSuperCols * g + 32 * s + 8 * j, K);
        });
      }
      for (int p = 0; p < NP; ++p) {
        const F::I sc = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + subs * kPanel * (first + p) + kPanel * s)));
        for (int m = 0; m < MT; ++m) total[m][p] = _mm512_add_epi32(total[m][p], _mm512_mullo_epi32(sums[m][p], sc));
      }
    }
    const uint8_t* const mins = group + subs * kPanel * W;  // [W, 2 quads, 64 bytes]
    const uint8_t* const d = mins + subs * kPanel * W;  // half [W, 16], then dmin half [W, 16]
    for (int p = 0; p < NP; ++p) {
      const F::I quads[2] = {F::load_bytes(mins + 128 * (first + p)), F::load_bytes(mins + 128 * (first + p) + 64)};
      const F::V scale = load_halves(d + 32 * (first + p)), min = load_halves(d + 32 * (W + first + p));
      for (int m = 0; m < MT; ++m) {
        const F::I msum = min_sums(quads, xmin + (m * G + g) * 16);
        acc[m][p] = F::fma(F::to_float(msum), F::mul(min, F::set1(-dx[m * G + g])),
                           F::fma(F::to_float(total[m][p]), F::mul(scale, F::set1(dx[m * G + g])), acc[m][p]));
      }
    }
  }
  store_rows(a, acc, p0, first, m0);
}

// out[m0 .. m0 + MT, rows of panels first .. first + NP of the tile of W panels at `tile`, whose first panel is p0),
// prefetching the same bytes at `ahead`. A group is `chunks` runs of V vectors: whole blocks, or with
// HALF_BLOCKS one half block (G = 2 * blocks; group g the columns 16 g .. 16 g + 15 of block g / 2, and its dx).
template <int BITS, Groups GROUPS, bool SYM, int MT, int NP, int W>
void block_tile(const PanelArgs& a, const uint8_t* tile, const uint8_t* ahead, int64_t p0, int first, int64_t m0) {
  constexpr bool HALF_BLOCKS = GROUPS == Groups::kHalves;
  constexpr int64_t V = vectors_per_chunk<BITS, GROUPS>();
  const int64_t K = a.K, G = a.G, blocks = K / kBlock, chunks = HALF_BLOCKS ? 1 : blocks / G;
  constexpr int64_t header = SYM ? 32 : 64;  // a panel's bytes of a group's scales (and offsets)
  const int64_t group_bytes = W * (header + chunks * V * 64);
  const F::V negated_zero = F::set1(minus_zero<BITS>());  // SYM: -zero * scales
  const int8_t* const xq = a.xq + m0 * K;
  const float* const dx = a.dx + m0 * blocks;
  const float* const xsum = a.xsum + m0 * G;
  const F::I low_nibbles = _mm512_set1_epi8(0x0F);
  F::V acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = F::zero();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t group = g * group_bytes;
    F::V scale[NP];
    for (int p = 0; p < NP; ++p) {
      prefetch<kToL2>(ahead + group + 64 * (first + p));
      scale[p] = load_halves(tile + group + 32 * (first + p));
      const F::V offset =
          SYM ? F::mul(scale[p], negated_zero) : load_halves(tile + group + 32 * (W + first + p));
      for (int m = 0; m < MT; ++m)
        acc[m][p] = F::fma(offset, F::set1(xsum[m * G + g]), acc[m][p]);
    }
    for (int64_t i = 0; i < chunks; ++i) {
      const int64_t b = HALF_BLOCKS ? g / 2 : g * chunks + i;
      const int64_t half = HALF_BLOCKS ? 16 * (g % 2) : 0;  // the chunk's first column in its block
      F::I sums[MT][NP];
      for (int m = 0; m < MT; ++m)
        for (int p = 0; p < NP; ++p) sums[m][p] = _mm512_setzero_si512();
      if constexpr (BITS == 6) {
        // pairs of nibble vectors and their top bits: [nibbles 2h | nibbles 2h + 1 | top bits h], h < V / 3
        for (int64_t h = 0; h < V / 3; ++h)
          for (int p = 0; p < NP; ++p) {
            const int64_t at = group + header * W + 64 * ((i * V + 3 * h) * W + first + p), next = 64 * W;
            for (int64_t v = 0; v < 3; ++v) prefetch<kToL2>(ahead + at + v * next);
            six_bit_codes(tile + at, next, [&](int s, F::I low, F::I high) {
              dot8(sums, p, low, high, xq + 32 * b + half + 16 * h + 8 * s, K);
            });
          }
      } else if constexpr (BITS == 5) {
        // 4 nibble vectors, then the top bits: [nibbles 0 | .. | nibbles 3 | top bits]
        for (int p = 0; p < NP; ++p) {
          const int64_t at = group + header * W + 64 * (i * V * W + first + p), next = 64 * W;
          for (int64_t v = 0; v < V; ++v) prefetch<kToL2>(ahead + at + v * next);
          nibble_codes<5>(tile + at, next, [&](int j, F::I low, F::I high) {
            dot8(sums, p, low, high, xq + 32 * b + half + 8 * j, K);
          });
        }
      } else {
        for (int64_t j = 0; j < V; ++j)
          for (int p = 0; p < NP; ++p) {
            const int64_t at = group + header * W + 64 * ((i * V + j) * W + first + p);
            prefetch<kToL2>(ahead + at);
            const F::I words = F::load_bytes(tile + at);
            if (BITS == 8) {
              for (int m = 0; m < MT; ++m)
                sums[m][p] = F::dot_u8s8(sums[m][p], words, broadcast4(xq + m * K + 32 * b + half + 4 * j));
            } else {
              dot8(sums, p, _mm512_and_si512(words, low_nibbles),
                   _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles), xq + 32 * b + half + 8 * j, K);
            }
          }
      }
      for (int m = 0; m < MT; ++m) {
        const F::V d = F::set1(dx[m * blocks + b]);
        for (int p = 0; p < NP; ++p)
          acc[m][p] = F::fma(F::to_float(sums[m][p]), F::mul(scale[p], d), acc[m][p]);
      }
    }
  }
  store_rows(a, acc, p0, first, m0);
}

template <int BITS, Groups GROUPS, bool SYM, int MT, int NP, int W>
void panel_tile(const PanelArgs& a, const uint8_t* tile, const uint8_t* ahead, int64_t p0, int first, int64_t m0) {
  if constexpr (GROUPS == Groups::kSuper && SYM) super_tile<MT, NP, W>(a, tile, ahead, p0, first, m0);
  else if constexpr (GROUPS == Groups::kSuper) mins_tile<BITS, MT, NP, W>(a, tile, ahead, p0, first, m0);
  else block_tile<BITS, GROUPS, SYM, MT, NP, W>(a, tile, ahead, p0, first, m0);
}

// Panels first .. first + NP of a tile against `rows` (1 .. 3) rows of x from m0, in one step.
template <int BITS, Groups GROUPS, bool SYM, int NP, int W>
void few_rows(const PanelArgs& a, const uint8_t* tile, const uint8_t* ahead, int64_t p0, int first, int64_t m0,
              int64_t rows) {
  switch (rows) {
    case 3: panel_tile<BITS, GROUPS, SYM, 3, NP, W>(a, tile, ahead, p0, first, m0); break;
    case 2: panel_tile<BITS, GROUPS, SYM, 2, NP, W>(a, tile, ahead, p0, first, m0); break;
    case 1: panel_tile<BITS, GROUPS, SYM, 1, NP, W>(a, tile, ahead, p0, first, m0); break;
    default: break;
  }
}

// Panels first .. first + NP of a tile against every row of x: steps of 4 rows of x, then the 1-3 left.
template <int BITS, Groups GROUPS, bool SYM, int NP, int W>
void pair_rows(const PanelArgs& a, const uint8_t* tile, const uint8_t* ahead, int64_t p0, int first) {
  int64_t m0 = 0;
  for (; m0 + 4 <= a.M; m0 += 4)
    panel_tile<BITS, GROUPS, SYM, 4, NP, W>(a, tile, ahead, p0, first, m0);
  few_rows<BITS, GROUPS, SYM, NP, W>(a, tile, ahead, p0, first, m0, a.M - m0);
}

// The tile of W panels at `tile` (panel p0 on, `end` the end of its part) against every row of x: all W panels a
// step up to whole_tile_rows rows of x, else pairs of panels against 4 rows of x a step.
template <int BITS, Groups GROUPS, bool SYM, int W>
void tile_rows(const PanelArgs& a, const uint8_t* tile, const uint8_t* end, int64_t p0) {
  const uint8_t* ahead = tile + tile_panels<BITS>() * a.panel_bytes;  // the next tile
  if (ahead + W * a.panel_bytes > end) ahead = tile;
  if (a.M <= whole_tile_rows<BITS, GROUPS>()) {
    few_rows<BITS, GROUPS, SYM, W, W>(a, tile, ahead, p0, 0, 0, a.M);
    return;
  }
  int first = 0;
  if constexpr (W >= 2)
    for (; first + 2 <= W; first += 2) pair_rows<BITS, GROUPS, SYM, 2, W>(a, tile, ahead, p0, first);
  if (first < W) pair_rows<BITS, GROUPS, SYM, 1, W>(a, tile, ahead, p0, first);
}

// One part of `count` panels at `part` (its first is panel p0): its whole tiles, then its last tile of the 1 .. W - 1
// panels left.
template <int BITS, Groups GROUPS, bool SYM>
void part_gemm(const PanelArgs& a, const uint8_t* part, int64_t p0, int64_t count) {
  const uint8_t* const end = part + count * a.panel_bytes;
  int64_t s = 0;
  constexpr int T = tile_panels<BITS>();
  constexpr Groups H = GROUPS;
  for (; s + T <= count; s += T) tile_rows<BITS, H, SYM, T>(a, part + s * a.panel_bytes, end, p0 + s);
  switch (count - s) {
    case 3: if constexpr (T > 3) tile_rows<BITS, H, SYM, 3>(a, part + s * a.panel_bytes, end, p0 + s); break;
    case 2: if constexpr (T > 2) tile_rows<BITS, H, SYM, 2>(a, part + s * a.panel_bytes, end, p0 + s); break;
    case 1: tile_rows<BITS, H, SYM, 1>(a, part + s * a.panel_bytes, end, p0 + s); break;
    default: break;
  }
}

template <int BITS, Groups GROUPS, bool SYM>
void panel_gemm(const PanelArgs& a, const uint8_t* weight, int64_t parts, int64_t per_part, int64_t part_stride) {
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      if (t * per_part * kPanel >= a.N) continue;  // padding alone
      part_gemm<BITS, GROUPS, SYM>(a, weight + t * part_stride, t * per_part, per_part);
    }
  });
}

// q of x [M, K] rounded to int8 per 256 columns (dx = max |x| / 127 a super-block, q = round(x / dx)), the sum of
// each 16 columns' q, and (xmin not null) each 32 columns' sum as its bytes lo = sum & 63 and hi = sum >> 6
void quantize_super_rows(const float* x, int8_t* xq, float* dx, int32_t* xsub, int8_t* xmin, int64_t M, int64_t K) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / kSuperCols; ++g) {
      const float* const in = x + m * K + g * kSuperCols;
      F::V amax = F::zero();
      for (int64_t i = 0; i < kSubBlocks; ++i) amax = _mm512_max_ps(amax, _mm512_abs_ps(F::load(in + 16 * i)));
      const float d = _mm512_reduce_max_ps(amax) / 127.f;
      dx[m * (K / kSuperCols) + g] = d;
      for (int64_t i = 0; i < kSubBlocks; ++i) {
        // NOTE: x / d and round half to even, as torch.round(x / dx) (the tests' reference), not x * (1 / d)
        const F::V scaled = _mm512_div_ps(F::load(in + 16 * i), F::set1(d));
        const F::I q = d == 0.f ? _mm512_setzero_si512()
                                : _mm512_cvtps_epi32(_mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT |
                                                                                      _MM_FROUND_NO_EXC));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + g * kSuperCols + 16 * i), _mm512_cvtepi32_epi8(q));
        xsub[m * (K / kSubCols) + g * kSubBlocks + i] = _mm512_reduce_add_epi32(q);
      }
      if (xmin == nullptr) continue;
      for (int64_t s = 0; s < kMinsSubBlocks; ++s) {
        const int32_t* const pair = xsub + m * (K / kSubCols) + g * kSubBlocks + 2 * s;
        const int32_t sum = pair[0] + pair[1];  // |sum| <= 32 * 127: hi in [-64, 63]
        xmin[(m * (K / kSuperCols) + g) * 16 + s] = static_cast<int8_t>(sum & 63);
        xmin[(m * (K / kSuperCols) + g) * 16 + 8 + s] = static_cast<int8_t>(sum >> 6);
      }
    }
}

// q (in x's column order), dx and xsum of x [M, K]: groups of whole blocks, or of half a block (G = 2 * blocks).
void quantize_rows(const float* x, int8_t* xq, float* dx, float* xsum, int64_t M, int64_t K, int64_t G) {
  const int64_t blocks = K / kBlock, blocks_per_group = blocks / G;
  if (G == 2 * blocks) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        int8_t* const q = xq + m * K + b * kBlock;
        const int32_t q_sum = quantize_block(x + m * K + b * kBlock, q, dx + m * blocks + b);
        int32_t first = 0;  // of the first half block's q
        for (int64_t k = 0; k < kBlock / 2; ++k) first += q[k];
        xsum[m * G + 2 * b] = dx[m * blocks + b] * static_cast<float>(first);
        xsum[m * G + 2 * b + 1] = dx[m * blocks + b] * static_cast<float>(q_sum - first);
      }
    return;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const int32_t q_sum = quantize_block(x + m * K + b * kBlock, xq + m * K + b * kBlock, dx + m * blocks + b);
        sum += dx[m * blocks + b] * static_cast<float>(q_sum);
      }
      xsum[m * G + g] = sum;
    }
}

}  // namespace
#endif

// x [M, K] float32 -> x W^T [M, out_features] float32, W in the panel layout above.
at::Tensor quant_gemm_panels(at::Tensor x, at::Tensor weight, int64_t bits, int64_t out_features,
                                double factor) {
#ifdef KVFORGE_PANELS_VNNI
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 4 && weight.device().is_cpu(),
              "weight must be a uint8 [parts, panels, groups, group bytes] CPU tensor");
  const int64_t parts = weight.size(0), per_part = weight.size(1), G = weight.size(2), group_bytes = weight.size(3);
  // the layout, told by the bytes of a group's scales (its header): whole blocks or half a block of codes after 32
  // bytes a panel (symmetric) or 64; a super-block's 256 columns of codes after kSuperHeader
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.device().is_cpu(),
              "x must be a float32 [M, K] CPU tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && K / G % (kBlock / 2) == 0, "x's ", K, " columns do not make ", G, " groups");
  const int64_t codes_bytes = K / G * bits * 2, header = group_bytes - codes_bytes;  // 16 rows * bits / 8 a column
  const bool super_header = bits == 6 ? header == kSuperHeader : header == kMinsHeader;
  const Groups groups = K / G == kSuperCols && super_header ? Groups::kSuper
                        : K / G == kBlock / 2                ? Groups::kHalves
                                                             : Groups::kBlocks;
  const bool sym = groups == Groups::kSuper ? bits == 6 : header == 32;
  TORCH_CHECK((groups == Groups::kSuper || header == 32 || header == 64) &&
                  (groups != Groups::kBlocks || K / G % kBlock == 0) && (groups != Groups::kHalves || G % 2 == 0),
              "a group of ", group_bytes, " bytes is not 64 bytes of scales and offsets (or 32 of scales) and ",
              K / G, " columns of ", bits, "-bit codes (whole 32-column blocks, or half of one of an even number of "
              "groups)");
  const int64_t panel_bytes = G * group_bytes;
  TORCH_CHECK(weight.stride(3) == 1 && weight.stride(2) == group_bytes && weight.stride(1) == panel_bytes &&
                  (parts == 1 || (weight.stride(0) >= per_part * panel_bytes && weight.stride(0) % 64 == 0)),
              "each part of the weight must be contiguous, the parts apart by a multiple of 64 bytes");
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  TORCH_CHECK(out_features > 0 && per_part == (panels + parts - 1) / parts, "out_features ", out_features,
              " does not fill ", parts, " parts of ", per_part, " panels");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  const bool amx = M >= kAmxMinRows && panels_amx_ready();
  const int64_t rows = amx ? (M + 15) / 16 * 16 : M;  // the AMX path reads x in tiles of 16 rows: zeros pad them
  const bool super = groups == Groups::kSuper, mins = super && !sym;
  std::vector<int8_t> xq(rows * K), xmin(mins ? rows * G * 16 : 0);
  std::vector<float> dx(rows * (super ? G : K / kBlock)), xsum(super ? 0 : rows * G);
  std::vector<int32_t> xsub(super ? rows * (K / kSubCols) : 0);
  const float* const x_data = x.data_ptr<float>();
  const int64_t scales_a_row = super ? G : K / kBlock;
  at::parallel_for(0, M, 16, [&](int64_t first, int64_t last) {  // (each row's rounding its own)
    if (super)
      quantize_super_rows(x_data + first * K, xq.data() + first * K, dx.data() + first * G,
                          xsub.data() + first * (K / kSubCols), mins ? xmin.data() + first * G * 16 : nullptr,
                          last - first, K);
    else
      quantize_rows(x_data + first * K, xq.data() + first * K, dx.data() + first * scales_a_row,
                    xsum.data() + first * G, last - first, K, G);
  });
  const PanelArgs args{xq.data(), dx.data(), xsum.data(), xsub.data(), xmin.data(), out.data_ptr<float>(),
                       M,         out_features, K,        G,           panel_bytes, static_cast<float>(factor)};
  const uint8_t* const codes = weight.data_ptr<uint8_t>();
  const int64_t part_stride = weight.stride(0);
  if (amx) {
    panel_gemm_amx(args, codes, parts, per_part, part_stride, static_cast<int>(bits), groups, sym);
    return out;
  }
  with_layout(static_cast<int>(bits), groups, sym, [&](auto bits_c, auto groups_c, auto sym_c) {
    panel_gemm<decltype(bits_c)::value, decltype(groups_c)::value, decltype(sym_c)::value>(args, codes, parts,
                                                                                           per_part, part_stride);
  });
  return out;
#else
  TORCH_CHECK(false, "the panel kernels need a build with AVX-512 VNNI");
#endif
}

bool quant_panels_available() {
#ifdef KVFORGE_PANELS_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace kvforge_cpu

// Shared by the two decode GEMVs over the packed weight layout: quant_gemv.cpp (fp32 activations, every machine)
// and quant_gemv_int8.cpp (activations rounded to int8, AVX2 only). The layout is pictured in quant_gemv.cpp and
// kvforge/kernels/cpu/quant_gemv.py. The panel kernel (quant_panels.cpp) takes its rounding of x from here too.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops.h"
#include "vec.h"

namespace kvforge_cpu {

constexpr int64_t kBlock = 32;     // columns per scale of x (int8 path), and the group-size unit
constexpr int64_t kRowBlock = 64;  // weight rows that all tiles of x pass over while they stay in cache

// NOTE: the kernels prefetch the weight rows kPrefetchTiles tiles ahead of the tile they multiply (codes, scales and
// offsets). The hardware prefetcher alone left the 4-bit int8 GEMV over a model's layers at ~40% of the read rate
// of a large sum; with this, ~60% (9.5 -> 6.4 ms a token, two builds side by side, AVX2 EPYC, 2 threads). 1, 4 and 8
// tiles ahead measured the same within noise.
constexpr int64_t kPrefetchTiles = 2;

// The scales and offsets of weight rows [n, n + rows), G groups a row.
inline void prefetch_factors(const float* scales, const float* offsets, int64_t G, int64_t n, int64_t rows) {
  for (int64_t i = n * G; i < (n + rows) * G; i += kCacheLine / static_cast<int64_t>(sizeof(float))) {
    prefetch(scales + i);
    prefetch(offsets + i);
  }
}

template <int BITS>
constexpr int64_t block_columns() { return 8 * 32 / BITS; }  // columns of 32 bytes of codes

#ifdef __AVX2__
// x rounded to int8 per 32 columns (quant_gemv_int8.cpp, quant_panels.cpp): q of 32 columns of x (in column order)
// and their dx = max |x| / 127; returns the sum of q.
inline int32_t quantize_block(const float* x, int8_t* q, float* dx) {
  Avx2::V v[4], amax = Avx2::zero();
  for (int i = 0; i < 4; ++i) {
    v[i] = Avx2::load(x + 8 * i);
    amax = _mm256_max_ps(amax, Avx2::abs(v[i]));
  }
  *dx = Avx2::max(amax) / 127.f;
  if (*dx == 0.f) {
    std::memset(q, 0, kBlock);
    return 0;
  }
  const Avx2::V d = Avx2::set1(*dx);
  alignas(32) int32_t codes[kBlock];
  for (int i = 0; i < 4; ++i) {
    // NOTE: x / dx and round half to even, as torch.round(x / dx) (the tests' reference), not x * (1 / dx).
    const Avx2::V rounded = _mm256_round_ps(_mm256_div_ps(v[i], d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i), _mm256_cvtps_epi32(rounded));
  }
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    q[k] = static_cast<int8_t>(codes[k]);
    sum += codes[k];
  }
  return sum;
}

#endif

// Raises unless qweight, scales and offsets are the layout of 4- or 8-bit codes in groups of whole 32-column blocks.
void check_layout(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& offsets,
                  int64_t bits);

// x [M, K] float32 -> x W^T [M, N] float32 with x rounded to int8 per 32 columns (quant_gemv_int8.cpp). Layout
// checked by the caller; defined in AVX2 builds only.
at::Tensor quant_gemv_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t bits);

// out[m0 .. m0 + MT, n0 .. n0 + NR] for n0 = begin, begin + NR, ..., then single weight rows up to end.
template <int MT, int NR, class Tiles>
void tiles_over_rows(const Tiles& tiles, int64_t m0, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + NR <= end; n += NR) tiles.template run<MT, NR>(m0, n);
  for (; n < end; ++n) tiles.template run<MT, 1>(m0, n);
}

// Every tile of out [M, N]: tiles.template run<MT, NR>(m0, n0) computes out[m0 .. m0 + MT, n0 .. n0 + NR]. Work is
// split over output rows n, kRowBlock at a time, which every tile of rows of x passes over in turn. Tiles are 4 rows
// of x by 2 weight rows (8 accumulator chains), then the rest of x's rows; a single row of x goes with 4 weight
// rows, which decoding the codes bounds. Measured on an AVX2 EPYC.
template <class Tiles>
void for_each_tile(const Tiles& tiles, int64_t M, int64_t N, int64_t K) {
  // NOTE: a chunk of at least ~64k multiply-adds, so that small layers do not pay a thread fork per row.
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * M));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowBlock) {
      const int64_t n1 = std::min(end, n0 + kRowBlock);
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) tiles_over_rows<4, 2>(tiles, m0, n0, n1);
      switch (M - m0) {
        case 3: tiles_over_rows<3, 2>(tiles, m0, n0, n1); break;
        case 2: tiles_over_rows<2, 2>(tiles, m0, n0, n1); break;
        case 1: tiles_over_rows<1, 4>(tiles, m0, n0, n1); break;
        default: break;
      }
    }
  });
}

}  // namespace kvforge_cpu

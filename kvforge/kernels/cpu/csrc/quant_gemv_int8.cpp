// The decode GEMV of quant_gemv.cpp with int8 activations (AVX2): x is rounded to int8 once per call, and 32 columns
// of a weight row times a row of x become one integer dot product, converted to float once. Per 32 codes that is
// a few integer instructions instead of four decodes, four conversions and four fp32 FMAs.
//
//   x[m, k] ~ dx[m, b] q[m, k],   b = k / 32,   dx[m, b] = max_{k in b} |x[m, k]| / 127,   q = round(x / dx)
//
//   out[m, n] = sum_b scales[n, g(b)] dx[m, b] (sum_{k in b} code[n, k] q[m, k]) + sum_g offsets[n, g] xsum[m, g]
//   xsum[m, g] = sum_{b in g} dx[m, b] sum_{k in b} q[m, k]              (the sum of the x the dot products see)
//
// q is in [-127, 127] and the integer sums are exact:
//   4 bits: _mm256_maddubs_epi16 multiplies the unsigned codes (0..15) by q and adds pairs to int16 (|.| <= 2 * 15 *
//           127), and _mm256_madd_epi16 with ones adds pairs to int32.
//   8 bits: maddubs would saturate (2 * 255 * 127 > 32767), so the codes are taken as c = code - 128 in [-128, 127]:
//           c q = |c| (q with the sign of c), at most 128 * 127 a product, and the 128 scales move to the offsets:
//           W = c scales + (offsets + 128 scales).
//
// The codes are used in the order they are stored; q is stored in the same order (x_column below), once per call.
// A 4-bit block of 64 columns holds two x blocks: its low nibbles (and its high ones) take bytes 0-1 of each word from
// x block 0 and bytes 2-3 from x block 1, so the int16 pairs of maddubs alternate between the two, and one byte
// shuffle brings pairs of one block together before madd: the int32 lanes then alternate (block 0, block 1), and so
// does the vector of scales they are multiplied by.
#include "quant_gemv.h"

#ifdef __AVX2__
#include <cstring>
#include <vector>

namespace kvforge_cpu {
namespace {

// The column (within its block of codes) of the code at byte position p of the block, in the order q is stored:
//   8 bits: byte j of word i = column 8j + i.
//   4 bits: 64 bytes of q per 32 bytes of codes, first for the low nibbles, then the high: nibble h of byte c of word
//           i (p = 32h + 4i + c) = nibble 2c + h of the word = column 8 (2c + h) + i.
template <int BITS>
constexpr int64_t x_column(int64_t p) {
  if (BITS == 8) return 8 * (p % 4) + p / 4;
  return 16 * (p % 4) + 8 * (p / 32) + p % 32 / 4;
}

struct Int8Args {
  const int8_t* xq;            // [M, K]: q, each block in the codes' order (x_column)
  const float* dx;             // [M, K / 32]
  const float* xsum;           // [M, G]
  const int32_t* block_group;  // [K / 32]: the group of each 32 columns
  const uint8_t* qweight;
  const float* scales;         // [N, G]
  const float* offsets;        // [N, G]
  float* out;                  // [M, N]
  int64_t M, N, K, G, row_bytes;
};

// [v[0], v[1], v[0], v[1], ...]: the scales of two consecutive 32-column blocks, in the int32 lanes' order.
inline Avx2::V broadcast_pair(const float* v) {
  int64_t pair;
  std::memcpy(&pair, v, sizeof(pair));
  return _mm256_castsi256_ps(_mm256_set1_epi64x(pair));
}

// xq, dx and xsum of x [M, K] (the math at the top), q of each block of codes in their order.
template <int BITS>
void quantize_x(const float* x, const int32_t* block_group, int8_t* xq, float* dx, float* xsum, int64_t M,
                int64_t K, int64_t G) {
  constexpr int64_t columns = block_columns<BITS>();
  std::fill(xsum, xsum + M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < K; k0 += columns) {
      int8_t q[columns];  // in column order
      for (int64_t h = 0; h < columns; h += kBlock) {
        const int64_t b = (k0 + h) / kBlock;
        const int32_t sum = quantize_block(x + m * K + k0 + h, q + h, dx + m * (K / kBlock) + b);
        xsum[m * G + block_group[b]] += dx[m * (K / kBlock) + b] * static_cast<float>(sum);
      }
      for (int64_t p = 0; p < columns; ++p) xq[m * K + k0 + p] = q[x_column<BITS>(p)];
    }
}

// The codes of one block of a weight row, ready to multiply by q; dot(q) -> int32 sums, each of one x block.
template <int BITS>
struct Codes;

template <>
struct Codes<4> {
  __m256i low, high;  // the low and the high nibbles, one per byte
  explicit Codes(__m256i words)
      : low(_mm256_and_si256(words, _mm256_set1_epi8(0x0F))),
        high(_mm256_and_si256(_mm256_srli_epi16(words, 4), _mm256_set1_epi8(0x0F))) {}
  __m256i dot(const int8_t* q) const {
    const __m256i pairs = _mm256_add_epi16(
        _mm256_maddubs_epi16(low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
        _mm256_maddubs_epi16(high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32))));
    // int16 lanes (block 0, block 1, block 0, block 1, ...) -> (0, 0, 1, 1, ...): lanes 0 2 1 3 4 6 5 7 per 128 bits
    const __m256i together = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                              0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    return _mm256_madd_epi16(_mm256_shuffle_epi8(pairs, together), _mm256_set1_epi16(1));
  }
};

template <>
struct Codes<8> {
  __m256i centered, magnitude;  // code - 128 as int8, and its absolute value as uint8
  explicit Codes(__m256i words)
      : centered(_mm256_xor_si256(words, _mm256_set1_epi8(static_cast<char>(0x80)))),
        magnitude(_mm256_abs_epi8(centered)) {}
  __m256i dot(const int8_t* q) const {
    const __m256i signed_q = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), centered);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), _mm256_set1_epi16(1));
  }
};

// The factors of the int32 lanes of dot() for block of codes t: x's dx of its x blocks, and a weight row's scales
// of their groups g0 (and g1, the group of the second x block of 4-bit codes).
template <int BITS>
inline Avx2::V x_factors(const float* dx, int64_t t) {
  return BITS == 8 ? _mm256_broadcast_ss(dx + t) : broadcast_pair(dx + 2 * t);
}
template <int BITS>
inline Avx2::V weight_factors(const float* scales, int32_t g0, int32_t g1) {
  if (BITS == 8) return _mm256_broadcast_ss(scales + g0);
  return _mm256_blend_ps(_mm256_broadcast_ss(scales + g0), _mm256_broadcast_ss(scales + g1), 0xAA);
}

// sum_g offsets[g] xsum[g], with the 8-bit codes' 128 scales moved into the offsets (see the top).
template <int BITS>
inline float offset_dot(const float* offsets, const float* scales, const float* xsum, int64_t G) {
  const float shift = BITS == 8 ? 128.f : 0.f;
  Avx2::V acc = Avx2::zero();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const Avx2::V offset =
        Avx2::fma(Avx2::set1(shift), Avx2::load(scales + g), Avx2::load(offsets + g));
    acc = Avx2::fma(offset, Avx2::load(xsum + g), acc);
  }
  float sum = Avx2::sum(acc);
  for (; g < G; ++g) sum += (offsets[g] + shift * scales[g]) * xsum[g];
  return sum;
}

template <int BITS>
struct Int8Tiles {
  const Int8Args& a;

  // out[m0 .. m0 + MT, n0 .. n0 + NR]: one accumulator per (row of x, weight row), over the blocks of codes.
  template <int MT, int NR>
  void run(int64_t m0, int64_t n0) const {
    const int64_t num_blocks = a.row_bytes / 32, x_blocks = a.K / kBlock;
    const int32_t* block_group = a.block_group;
    const uint8_t* rows[NR];
    const float* scales[NR];
    for (int r = 0; r < NR; ++r) {
      rows[r] = a.qweight + (n0 + r) * a.row_bytes;
      scales[r] = a.scales + (n0 + r) * a.G;
    }
    const int8_t* xq[MT];
    const float* dx[MT];
    for (int m = 0; m < MT; ++m) {
      xq[m] = a.xq + (m0 + m) * a.K;
      dx[m] = a.dx + (m0 + m) * x_blocks;
    }
    const int64_t ahead = kPrefetchTiles * NR;  // rows
    prefetch_factors(a.scales, a.offsets, a.G, n0 + ahead, NR);
    Avx2::V acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = Avx2::zero();
    for (int64_t t = 0; t < num_blocks; ++t) {
      Avx2::V x_factor[MT];
      for (int m = 0; m < MT; ++m) x_factor[m] = x_factors<BITS>(dx[m], t);
      const int64_t b = t * block_columns<BITS>() / kBlock;  // the first x block of the codes
      const int32_t g0 = block_group[b], g1 = block_group[b + block_columns<BITS>() / kBlock - 1];
      for (int r = 0; r < NR; ++r) {
        prefetch(rows[r] + 32 * t + ahead * a.row_bytes);
        const Codes<BITS> codes(Avx2::load_bytes(rows[r] + 32 * t));
        const Avx2::V scale = weight_factors<BITS>(scales[r], g0, g1);
        for (int m = 0; m < MT; ++m) {
          const __m256i sums = codes.dot(xq[m] + t * block_columns<BITS>());
          acc[m][r] = Avx2::fma(Avx2::to_float(sums), Avx2::mul(scale, x_factor[m]), acc[m][r]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) {
        const int64_t n = n0 + r;
        const float* xsum = a.xsum + (m0 + m) * a.G;
        a.out[(m0 + m) * a.N + n] = Avx2::sum(acc[m][r]) + offset_dot<BITS>(a.offsets + n * a.G, a.scales + n * a.G,
                                                                        xsum, a.G);
      }
  }
};

}  // namespace

at::Tensor quant_gemv_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t bits) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = scales.size(1);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  std::vector<int32_t> block_group(K / kBlock);
  for (int64_t b = 0; b < K / kBlock; ++b) block_group[b] = static_cast<int32_t>(b * kBlock / (K / G));
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / kBlock)), xsum(M * G);
  const auto quantize = bits == 8 ? quantize_x<8> : quantize_x<4>;
  quantize(x.data_ptr<float>(), block_group.data(), xq.data(), dx.data(), xsum.data(), M, K, G);
  const Int8Args args{xq.data(), dx.data(), xsum.data(), block_group.data(), qweight.data_ptr<uint8_t>(),
                      scales.data_ptr<float>(), offsets.data_ptr<float>(), out.data_ptr<float>(),
                      M, N, K, G, qweight.size(1)};
  if (bits == 8) for_each_tile(Int8Tiles<8>{args}, M, N, K);
  else for_each_tile(Int8Tiles<4>{args}, M, N, K);
  return out;
}

}  // namespace kvforge_cpu
#endif  // __AVX2__

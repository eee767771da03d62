// The quantized matmul of quant_gemv.cpp with int8 activations (AVX2, and AVX-512 VNNI where the machine has it): x
// is rounded to int8 once per call, and 32 columns of a weight row times a row of x become one integer dot product,
// converted to float once. Per 32 codes that is a few integer instructions instead of four decodes, four
// conversions and four fp32 FMAs, so it serves decode (a few rows of x) and batches (tens to hundreds) alike.
//
//   x[m, k] ~ dx[m, b] q[m, k],   b = k / 32,   dx[m, b] = max_{k in b} |x[m, k]| / 127,   q = round(x / dx)
//
//   out[m, n] = sum_b scales[n, g(b)] dx[m, b] (sum_{k in b} code[n, k] q[m, k]) + sum_g offsets[n, g] xsum[m, g]
//   xsum[m, g] = sum_{b in g} dx[m, b] sum_{k in b} q[m, k]              (the sum of the x the dot products see)
//
// q is in [-127, 127] and the integer sums are exact. The kernel walks a weight row in steps of one vector of codes,
// each covering one or two x blocks; a step's integer sums land in int32 lanes, each lane within one x block.
//
// AVX2, a step is one 32-byte block of codes:
//   4 bits: _mm256_maddubs_epi16 multiplies the unsigned codes (0..15) by q and adds pairs to int16 (|.| <= 2 * 15 *
//           127), and _mm256_madd_epi16 with ones adds pairs to int32.
//   8 bits: maddubs would saturate (2 * 255 * 127 > 32767), so the codes are taken as c = code - 128 in [-128, 127]:
//           c q = |c| (q with the sign of c), at most 128 * 127 a product, and the 128 scales move to the offsets:
//           W = c scales + (offsets + 128 scales).
//   A 4-bit block of 64 columns holds two x blocks: its low nibbles (and its high ones) take bytes 0-1 of each word
//   from x block 0 and bytes 2-3 from x block 1, so the int16 pairs of maddubs alternate between the two, and one
//   byte shuffle brings pairs of one block together before madd: the int32 lanes then alternate (block 0, block 1),
//   and so does the vector of scales they are multiplied by.
//
// AVX-512 VNNI, a step is 64 columns (two x blocks) in a 512-bit vector; _mm512_dpbusd_epi32 multiplies unsigned
// codes by q and adds each four products into an int32 lane in one instruction:
//   8 bits: two 32-byte blocks of codes as stored, unsigned (no shift): lanes 0-7 are x block 0, 8-15 block 1. A row
//           of an odd number of blocks ends with a half step (the upper half of the codes loaded as zeros).
//   4 bits: one block of codes; each word's bytes 0-1 (x block 0) and 2-3 (x block 1) are widened to an int32 lane
//           of their own, [lo(b0), lo(b1), hi(b0), hi(b1)] with lo/hi the low and high nibbles: lanes alternate.
//
// The codes are used in the order they are stored; q is stored in the same order (x_column below), once per call.
#include "quant_gemv.h"

#ifdef __AVX2__
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFORGE_INT8_VNNI512 1
#endif

namespace kvforge_cpu {
namespace {

#ifdef KVFORGE_INT8_VNNI512
using FVec = __m512;
using IVec = __m512i;
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec fmadd_sums(IVec sums, FVec f, FVec acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), f, acc); }
inline float fsum(FVec v) { return _mm512_reduce_add_ps(v); }
template <int BITS>
constexpr int64_t step_columns() { return 64; }
constexpr float kCodeShift8 = 0.f;  // 8-bit codes are multiplied unsigned
// Lanes of x block 0 of a step get f0, of block 1 f1.
template <int BITS>
inline FVec per_block(float f0, float f1) {
  return _mm512_mask_blend_ps(BITS == 4 ? 0xAAAA : 0xFF00, _mm512_set1_ps(f0), _mm512_set1_ps(f1));
}
#else
using FVec = __m256;
using IVec = __m256i;
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec fmadd_sums(IVec sums, FVec f, FVec acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), f, acc); }
inline float fsum(FVec v) { return hsum(v); }
template <int BITS>
constexpr int64_t step_columns() { return block_columns<BITS>(); }
constexpr float kCodeShift8 = 128.f;  // 8-bit codes are multiplied as code - 128
template <int BITS>
inline FVec per_block(float f0, float f1) {
  if (BITS == 8) return _mm256_set1_ps(f0);  // a step is one x block
  return _mm256_blend_ps(_mm256_set1_ps(f0), _mm256_set1_ps(f1), 0xAA);
}
#endif

template <int BITS>
constexpr int64_t step_bytes() { return step_columns<BITS>() * BITS / 8; }

// The column (within its step) of the code at byte position p of the step's q, in the order q is stored:
//   8 bits: byte j of word i of block c = column 32c + 8j + i.
//   4 bits, AVX2: 64 bytes of q per 32 bytes of codes, first for the low nibbles, then the high: nibble h of byte c
//           of word i (p = 32h + 4i + c) = nibble 2c + h of the word = column 8 (2c + h) + i.
//   4 bits, VNNI: byte c of int32 lane L = 2i + h (p = 4L + c) is nibble 4h + (0, 2, 1, 3)[c] of word i, column
//           8 nibble + i.
template <int BITS>
constexpr int64_t x_column(int64_t p) {
  if (BITS == 8) return 32 * (p / 32) + 8 * (p % 4) + p % 32 / 4;
#ifdef KVFORGE_INT8_VNNI512
  const int64_t lane = p / 4, c = p % 4;
  return 8 * (4 * (lane % 2) + (c == 1 ? 2 : c == 2 ? 1 : c)) + lane / 2;
#else
  return 16 * (p % 4) + 8 * (p / 32) + p % 32 / 4;
#endif
}

struct Int8Args {
  const int8_t* xq;            // [M, Kq]: q, each step in the codes' order (x_column), zeros past K
  const float* dx;             // [M, Kq / 32]
  const float* xsum;           // [M, G]
  const int32_t* block_group;  // [Kq / 32]: the group of each 32 columns (past K: the last group)
  const uint8_t* qweight;
  const float* scales;         // [N, G]
  const float* offsets;        // [N, G]
  float* out;                  // [M, N]
  int64_t M, N, K, Kq, G, row_bytes;  // Kq: K rounded up to whole steps
};

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// q of 32 columns of x (in column order) and their dx; returns the sum of q.
inline int32_t quantize_block(const float* x, int8_t* q, float* dx) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  *dx = hmax(amax) / 127.f;
  if (*dx == 0.f) {
    std::memset(q, 0, kBlock);
    return 0;
  }
  const __m256 d = _mm256_set1_ps(*dx);
  alignas(32) int32_t codes[kBlock];
  for (int i = 0; i < 4; ++i) {
    // NOTE: x / dx and round half to even, as torch.round(x / dx) (the tests' reference), not x * (1 / dx).
    const __m256 rounded = _mm256_round_ps(_mm256_div_ps(v[i], d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 8 * i), _mm256_cvtps_epi32(rounded));
  }
  int32_t sum = 0;
  for (int64_t k = 0; k < kBlock; ++k) {
    q[k] = static_cast<int8_t>(codes[k]);
    sum += codes[k];
  }
  return sum;
}

// xq, dx and xsum of x [M, K] (the math at the top), q of each step in the codes' order.
template <int BITS>
void quantize_x(const float* x, const int32_t* block_group, int8_t* xq, float* dx, float* xsum, int64_t M,
                int64_t K, int64_t Kq, int64_t G) {
  constexpr int64_t columns = step_columns<BITS>();
  std::fill(xsum, xsum + M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < Kq; k0 += columns) {
      int8_t q[columns] = {};  // in column order
      for (int64_t h = 0; h < columns; h += kBlock) {
        const int64_t b = (k0 + h) / kBlock;
        float* d = dx + m * (Kq / kBlock) + b;
        if (k0 + h >= K) {
          *d = 0.f;
          continue;
        }
        const int32_t sum = quantize_block(x + m * K + k0 + h, q + h, d);
        xsum[m * G + block_group[b]] += *d * static_cast<float>(sum);
      }
      for (int64_t p = 0; p < columns; ++p) xq[m * Kq + k0 + p] = q[x_column<BITS>(p)];
    }
}

// The codes of one step of a weight row (bytes_left of the row from there), ready to multiply by q; dot(q) -> int32
// sums, each lane within one x block.
template <int BITS>
struct Codes;

#ifdef KVFORGE_INT8_VNNI512
template <>
struct Codes<4> {
  __m512i nibbles;  // per int32 lane [lo(b0), lo(b1), hi(b0), hi(b1)] of a half word
  Codes(const uint8_t* codes, int64_t) {
    const __m512i halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    // (halves | halves << 12) & 0x0F0F0F0F: bytes 0-1 keep the low nibbles, 2-3 take the high ones
    nibbles = _mm512_ternarylogic_epi32(halves, _mm512_slli_epi32(halves, 12), _mm512_set1_epi8(0x0F), 0xA8);
  }
  __m512i dot(const int8_t* q) const {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), nibbles, _mm512_loadu_si512(q));
  }
};

template <>
struct Codes<8> {
  __m512i codes;
  Codes(const uint8_t* p, int64_t bytes_left)
      : codes(bytes_left >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p)) {}
  __m512i dot(const int8_t* q) const {
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(q));
  }
};
#else
template <>
struct Codes<4> {
  __m256i low, high;  // the low and the high nibbles, one per byte
  Codes(const uint8_t* codes, int64_t) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    low = _mm256_and_si256(words, _mm256_set1_epi8(0x0F));
    high = _mm256_and_si256(_mm256_srli_epi16(words, 4), _mm256_set1_epi8(0x0F));
  }
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
  Codes(const uint8_t* codes, int64_t)
      : centered(_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)),
                                  _mm256_set1_epi8(static_cast<char>(0x80)))),
        magnitude(_mm256_abs_epi8(centered)) {}
  __m256i dot(const int8_t* q) const {
    const __m256i signed_q = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), centered);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), _mm256_set1_epi16(1));
  }
};
#endif

// sum_g offsets[g] xsum[g], with the 8-bit codes' shift (scales times kCodeShift8) moved into the offsets.
template <int BITS>
inline float offset_dot(const float* offsets, const float* scales, const float* xsum, int64_t G) {
  const float shift = BITS == 8 ? kCodeShift8 : 0.f;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256 offset =
        _mm256_fmadd_ps(_mm256_set1_ps(shift), _mm256_loadu_ps(scales + g), _mm256_loadu_ps(offsets + g));
    acc = _mm256_fmadd_ps(offset, _mm256_loadu_ps(xsum + g), acc);
  }
  float sum = hsum(acc);
  for (; g < G; ++g) sum += (offsets[g] + shift * scales[g]) * xsum[g];
  return sum;
}

template <int BITS>
struct Int8Tiles {
  const Int8Args& a;

  // out[m0 .. m0 + MT, n0 .. n0 + NR]: one accumulator per (row of x, weight row), over the steps of a row.
  template <int MT, int NR>
  void run(int64_t m0, int64_t n0) const {
    constexpr int64_t columns = step_columns<BITS>(), bytes = step_bytes<BITS>();
    constexpr int64_t last_block = columns / kBlock - 1;  // of a step: 0 or 1
    const int64_t num_steps = a.Kq / columns, x_blocks = a.Kq / kBlock;
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
      xq[m] = a.xq + (m0 + m) * a.Kq;
      dx[m] = a.dx + (m0 + m) * x_blocks;
    }
    const int64_t ahead = kPrefetchTiles * NR;  // rows
    prefetch_factors(a.scales, a.offsets, a.G, n0 + ahead, NR);
    FVec acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = fzero();
    for (int64_t s = 0; s < num_steps; ++s) {
      const int64_t b = s * columns / kBlock;  // the first x block of the step
      FVec x_factor[MT];
      for (int m = 0; m < MT; ++m) x_factor[m] = per_block<BITS>(dx[m][b], dx[m][b + last_block]);
      const int32_t g0 = block_group[b], g1 = block_group[b + last_block];
      for (int r = 0; r < NR; ++r) {
        prefetch(rows[r] + bytes * s + ahead * a.row_bytes);
        const Codes<BITS> codes(rows[r] + bytes * s, a.row_bytes - bytes * s);
        const FVec scale = per_block<BITS>(scales[r][g0], scales[r][g1]);
        for (int m = 0; m < MT; ++m)
          acc[m][r] = fmadd_sums(codes.dot(xq[m] + s * columns), fmul(scale, x_factor[m]), acc[m][r]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) {
        const int64_t n = n0 + r;
        const float* xsum = a.xsum + (m0 + m) * a.G;
        a.out[(m0 + m) * a.N + n] = fsum(acc[m][r]) + offset_dot<BITS>(a.offsets + n * a.G, a.scales + n * a.G,
                                                                        xsum, a.G);
      }
  }
};

}  // namespace

torch::Tensor quant_gemv_int8(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                              const torch::Tensor& offsets, int64_t bits) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = scales.size(1);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t step = bits == 8 ? step_columns<8>() : step_columns<4>();
  const int64_t Kq = (K + step - 1) / step * step;
  std::vector<int32_t> block_group(Kq / kBlock);
  for (int64_t b = 0; b < Kq / kBlock; ++b)
    block_group[b] = static_cast<int32_t>(std::min<int64_t>(b * kBlock / (K / G), G - 1));
  std::vector<int8_t> xq(M * Kq);
  std::vector<float> dx(M * (Kq / kBlock)), xsum(M * G);
  const auto quantize = bits == 8 ? quantize_x<8> : quantize_x<4>;
  quantize(x.data_ptr<float>(), block_group.data(), xq.data(), dx.data(), xsum.data(), M, K, Kq, G);
  const Int8Args args{xq.data(), dx.data(), xsum.data(), block_group.data(), qweight.data_ptr<uint8_t>(),
                      scales.data_ptr<float>(), offsets.data_ptr<float>(), out.data_ptr<float>(),
                      M, N, K, Kq, G, qweight.size(1)};
  if (bits == 8) for_each_tile(Int8Tiles<8>{args}, M, N, K);
  else for_each_tile(Int8Tiles<4>{args}, M, N, K);
  return out;
}

const char* quant_gemv_int8_isa() {
#ifdef KVFORGE_INT8_VNNI512
  return "avx512-vnni";
#else
  return "avx2";
#endif
}

}  // namespace kvforge_cpu
#endif  // __AVX2__

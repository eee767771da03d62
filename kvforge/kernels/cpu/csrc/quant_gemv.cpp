// Weight-only quantized matmul for the CPU at decode sizes (a few rows of activations), fp32 accumulation.
//
// At one token per step the whole model's weights stream from memory once per token, so bytes per weight is
// the speed: the kernel reads the 8-bit or 4-bit codes as they are stored and never materializes a float
// weight. Layout (made and pictured in kvforge/kernels/cpu/quant_gemv.py):
//
//   qweight  uint8 [N, K * BITS / 8]   codes, in blocks of eight 32-bit words: lane i of word vector j holds
//                                      column 8j + i of the block (BITS = 8: 32 columns, 4: 64 columns)
//   scales   float [N, G], offsets float [N, G]   (G groups along K, group_size a multiple of 32)
//
//   W[n, k] = code[n, k] * scales[n, g] + offsets[n, g],   g = k / group_size
//
// so out[m, n] = sum_g scales[n, g] * (sum_{k in g} x[m, k] code[n, k]) + offsets[n, g] * xsum[m, g], with
// xsum[m, g] the sum of x over the group, computed once per call.
//
// Two kernels compute it. With int8_activations (AVX2 only, quant_gemv_int8.cpp), x is rounded to int8 per 32
// columns and the inner sums are integer dot products: fewer instructions per code than the fp32 kernel below,
// which is the portable one and the exact one (x as given).
//
// fp32 kernel: decoding vector j of a block is one AND with a mask at bit BITS * j and a conversion to float: the
// float is code * 2^(BITS j). x is pre-scaled once per call by 2^-(BITS j) per column (exact: a power of two), so
// the product is code * x. The top vector is shifted down instead (its mask would set the sign bit).
//
// Work is split over output rows n; each weight row is decoded once per tile of up to 4 rows of x, and
// several weight rows go together, so that several accumulator chains are in flight (for_each_tile, quant_gemv.h).
#include "quant_gemv.h"

namespace kvforge_cpu {
namespace {

template <int BITS>
constexpr int top_vector() { return 32 / BITS - 1; }
// 2^-(BITS j): the scale of x's columns under vector j of a block.
template <int BITS>
inline float lane_factor(int j) { return j == top_vector<BITS>() ? 1.f : 1.f / static_cast<float>(1u << (BITS * j)); }

#ifdef __AVX2__
using F = Avx2;

using Block = F::I;
template <int BITS>
inline Block load_block(const uint8_t* row, int64_t k) {
  return F::load_bytes(row + k / block_columns<BITS>() * 32);
}
// code * 2^(BITS J) in each lane (just code for the top vector).
template <int BITS, int J>
inline F::V decode_vec(Block words) {
  if (J == top_vector<BITS>()) return F::to_float(_mm256_srli_epi32(words, 32 - BITS));
  return F::to_float(_mm256_and_si256(words, _mm256_set1_epi32(((1 << BITS) - 1) << (BITS * J))));
}
#else
using F = Scalar8;  // the same structure, eight lanes in an array

using Block = const uint8_t*;  // the block's 32 bytes
template <int BITS>
inline Block load_block(const uint8_t* row, int64_t k) {
  return row + k / block_columns<BITS>() * 32;
}
template <int BITS, int J>
inline F::V decode_vec(Block bytes) {
  const float factor = 1.f / lane_factor<BITS>(J);
  F::V r;
  for (int i = 0; i < 8; ++i) {
    const int bit = BITS * J;  // of word i, stored little-endian in bytes 4i .. 4i + 3
    const int code = (bytes[4 * i + bit / 8] >> (bit % 8)) & ((1 << BITS) - 1);
    r.v[i] = static_cast<float>(code) * factor;
  }
  return r;
}
#endif

struct GemvArgs {
  const float* x;        // [M, K], pre-scaled by lane_factor per column
  const float* xsum;     // [M, G], of the unscaled x
  const uint8_t* qweight;
  const float* scales;   // [N, G]
  const float* offsets;  // [N, G]
  float* out;            // [M, N]
  int64_t M, N, K, G, group_size, row_bytes;
};

// Vector J of the blocks of NR weight rows, times the matching 8 columns of MT rows of x.
template <int BITS, int MT, int NR, int J>
inline void fma_vec(const GemvArgs& a, const float* x, const Block* blocks, int64_t column, F::V (&acc)[MT][NR]) {
  for (int r = 0; r < NR; ++r) {
    const F::V w = decode_vec<BITS, J>(blocks[r]);
    for (int m = 0; m < MT; ++m) acc[m][r] = F::fma(w, F::load(x + m * a.K + column), acc[m][r]);
  }
}

// The 32 columns at k: vectors 4 HALF .. 4 HALF + 3 of their block (HALF = 1: second half of a 4-bit block).
template <int BITS, int MT, int NR, int HALF>
inline void fma_columns(const GemvArgs& a, const float* x, const uint8_t* const* rows, int64_t k, F::V (&acc)[MT][NR]) {
  Block blocks[NR];
  for (int r = 0; r < NR; ++r) blocks[r] = load_block<BITS>(rows[r], k);
  fma_vec<BITS, MT, NR, 4 * HALF + 0>(a, x, blocks, k + 0, acc);
  fma_vec<BITS, MT, NR, 4 * HALF + 1>(a, x, blocks, k + 8, acc);
  fma_vec<BITS, MT, NR, 4 * HALF + 2>(a, x, blocks, k + 16, acc);
  fma_vec<BITS, MT, NR, 4 * HALF + 3>(a, x, blocks, k + 24, acc);
}

// out[m0 .. m0 + MT, n0 .. n0 + NR]: one accumulator chain per (row of x, weight row).
template <int BITS, int MT, int NR>
inline void dot_tile(const GemvArgs& a, int64_t m0, int64_t n0) {
  const float* x = a.x + m0 * a.K;
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = a.qweight + (n0 + r) * a.row_bytes;
  const int64_t ahead = kPrefetchTiles * NR;  // rows
  prefetch_factors(a.scales, a.offsets, a.G, n0 + ahead, NR);
  F::V total[MT][NR];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NR; ++r) total[m][r] = F::zero();
  for (int64_t g = 0; g < a.G; ++g) {
    F::V acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = F::zero();
    for (int64_t k = g * a.group_size; k < (g + 1) * a.group_size; k += kBlock) {
      for (int r = 0; r < NR; ++r) prefetch(rows[r] + k * BITS / 8 + ahead * a.row_bytes);
      if (BITS == 4 && (k & 32)) fma_columns<BITS, MT, NR, 1>(a, x, rows, k, acc);
      else fma_columns<BITS, MT, NR, 0>(a, x, rows, k, acc);
    }
    for (int r = 0; r < NR; ++r) {
      const F::V scale = F::set1(a.scales[(n0 + r) * a.G + g]);
      for (int m = 0; m < MT; ++m) total[m][r] = F::fma(acc[m][r], scale, total[m][r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float* offsets = a.offsets + (n0 + r) * a.G;
    for (int m = 0; m < MT; ++m) {
      const float* xsum = a.xsum + (m0 + m) * a.G;
      float offset_dot = 0.f;
      for (int64_t g = 0; g < a.G; ++g) offset_dot += offsets[g] * xsum[g];
      a.out[(m0 + m) * a.N + n0 + r] = F::sum(total[m][r]) + offset_dot;
    }
  }
}

template <int BITS>
struct FloatTiles {
  const GemvArgs& a;
  template <int MT, int NR>
  void run(int64_t m0, int64_t n0) const { dot_tile<BITS, MT, NR>(a, m0, n0); }
};

template <int BITS, int J>
inline void dequantize_vec(float* out, const Block& block, float scale, F::V offset) {
  F::store(out, F::fma(decode_vec<BITS, J>(block), F::set1(scale * lane_factor<BITS>(J)), offset));
}

template <int BITS, int HALF>
inline void dequantize_columns(float* out_row, const uint8_t* row, int64_t k, float scale, float offset) {
  const Block block = load_block<BITS>(row, k);
  const F::V shift = F::set1(offset);
  dequantize_vec<BITS, 4 * HALF + 0>(out_row + k + 0, block, scale, shift);
  dequantize_vec<BITS, 4 * HALF + 1>(out_row + k + 8, block, scale, shift);
  dequantize_vec<BITS, 4 * HALF + 2>(out_row + k + 16, block, scale, shift);
  dequantize_vec<BITS, 4 * HALF + 3>(out_row + k + 24, block, scale, shift);
}

template <int BITS>
void dequantize_kernel(float* out, const uint8_t* qweight, const float* scales, const float* offsets, int64_t N,
                       int64_t K, int64_t G) {
  const int64_t group_size = K / G, row_bytes = K * BITS / 8;
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; k += kBlock) {
        const int64_t g = n * G + k / group_size;
        float* out_row = out + n * K;
        const uint8_t* row = qweight + n * row_bytes;
        if (BITS == 4 && (k & 32)) dequantize_columns<BITS, 1>(out_row, row, k, scales[g], offsets[g]);
        else dequantize_columns<BITS, 0>(out_row, row, k, scales[g], offsets[g]);
      }
  });
}

}  // namespace

void check_layout(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& offsets,
                  int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be a contiguous uint8 [N, K * bits / 8]");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits;
  for (const auto* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N,
                "scales and offsets must be contiguous float32 [N, G] with N = ", N);
  }
  TORCH_CHECK(offsets.size(1) == scales.size(1), "scales and offsets have different group counts");
  const int64_t G = scales.size(1);
  TORCH_CHECK(K > 0 && G > 0 && K % G == 0 && (K / G) % kBlock == 0, "group size K / G = ", K, " / ", G,
              " must be a whole multiple of ", kBlock);
  TORCH_CHECK(qweight.size(1) % 32 == 0, "rows of qweight must be whole blocks of 32 bytes, got ",
              qweight.size(1));
  for (const auto* t : {&qweight, &scales, &offsets}) {
    TORCH_CHECK(t->device().is_cpu(), "tensors must be on the CPU");
  }
}

namespace {

// x_lanes [M, K] = x times the lane factor of each column; xsum [M, G] = sums of x over the groups.
template <int BITS>
void prepare_x(const float* x, float* x_lanes, float* xsum, int64_t M, int64_t K, int64_t G) {
  float factors[block_columns<BITS>()];
  for (int64_t c = 0; c < block_columns<BITS>(); ++c) factors[c] = lane_factor<BITS>(static_cast<int>(c / 8));
  const int64_t group_size = K / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        sum += x[m * K + k];
        x_lanes[m * K + k] = x[m * K + k] * factors[k % block_columns<BITS>()];
      }
      xsum[m * G + g] = sum;
    }
}

// The fp32 kernel: x [M, K] float32 contiguous -> x W^T [M, N] float32.
at::Tensor quant_gemv_float(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const at::Tensor& offsets, int64_t bits) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = scales.size(1);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  auto x_lanes = at::empty_like(x);
  auto xsum = at::empty({M, G}, x.options());
  const auto prepare = bits == 8 ? prepare_x<8> : prepare_x<4>;
  prepare(x.data_ptr<float>(), x_lanes.data_ptr<float>(), xsum.data_ptr<float>(), M, K, G);
  const GemvArgs args{x_lanes.data_ptr<float>(), xsum.data_ptr<float>(), qweight.data_ptr<uint8_t>(),
                      scales.data_ptr<float>(), offsets.data_ptr<float>(), out.data_ptr<float>(),
                      M, N, K, G, K / G, qweight.size(1)};
  if (bits == 8) for_each_tile(FloatTiles<8>{args}, M, N, K);
  else for_each_tile(FloatTiles<4>{args}, M, N, K);
  return out;
}

}  // namespace

// x: [M, K] float32 -> x W^T: [M, N] float32, W in the layout above; int8_activations: x rounded to int8 per 32
// columns (AVX2 builds only, see quant_gemv_vectorized).
at::Tensor quant_gemv(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor offsets,
                         int64_t bits, bool int8_activations) {
  check_layout(qweight, scales, offsets, bits);
  const int64_t K = qweight.size(1) * 8 / bits;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "x must be a float32 [M, ", K, "] CPU tensor");
  x = x.contiguous();
#ifdef __AVX2__
  if (int8_activations) return quant_gemv_int8(x, qweight, scales, offsets, bits);
#else
  TORCH_CHECK(!int8_activations, "int8 activations need the AVX2 build of the CPU kernels");
#endif
  return quant_gemv_float(x, qweight, scales, offsets, bits);
}

// The float32 weight [N, K] the layout stands for (larger batches multiply it with a float GEMM).
at::Tensor quant_dequantize(at::Tensor qweight, at::Tensor scales, at::Tensor offsets, int64_t bits) {
  check_layout(qweight, scales, offsets, bits);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits, G = scales.size(1);
  auto out = at::empty({N, K}, scales.options());
  const auto kernel = bits == 8 ? dequantize_kernel<8> : dequantize_kernel<4>;
  kernel(out.data_ptr<float>(), qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), N,
         K, G);
  return out;
}

// Whether the kernels above are the AVX2 ones (and int8 activations are available); elsewhere they are the portable
// fallback, correct but slower than a float GEMM, and the caller should not pick them.
bool quant_gemv_vectorized() {
#ifdef __AVX2__
  return true;
#else
  return false;
#endif
}

// The instruction set the int8-activation kernels were built for: "avx512-vnni" (the panel kernel,
// quant_panels.cpp), "avx2" (the GEMV, quant_gemv_int8.cpp), or "portable" where there are none.
std::string quant_gemv_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace kvforge_cpu

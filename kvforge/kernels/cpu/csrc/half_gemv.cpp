// The decode GEMV of 16-bit weights (a GGUF file's F16 and BF16 matrices, kept as stored): x [M, K] float32 times a
// row-major float16 or bfloat16 weight W [N, K], out = x W^T [M, N] float32. The weight is read in 16 bits and
// widened to float32 in registers, so a pass streams half the bytes of a float32 weight and no float32 copy of it
// exists; x and the sums stay float32 (kernels/cpu/half_gemv.py routes the rows, the reference is F.linear on the
// weight widened to float32).
//
//   weight row n:  [ k 0..V-1 | V..2V-1 | ... ]  V 16-bit values at a time, widened and FMA'd into one chain per
//                  (row of x, row of W); the columns past the last whole vector (K % V) are added one by one.
//
// Widening:  float16   vcvtph2ps (F16C; AVX-512F for 16 lanes)
//            bfloat16  the 16 bits moved to the top half of a 32-bit lane (zero-extend, shift left by 16): exact
//
// Two vector widths, both in every AVX-512 build (vector_bits picks one, 0 the widest built): V = 8 with AVX2 + F16C
// registers (vec.h's Avx2, the only path of the AVX2 build) and V = 16 with AVX-512 ones (Avx512). The tiles and
// the prefetching are quant_gemv.h's, as dense_gemv.cpp's.
#include "quant_gemv.h"

namespace kvforge_cpu {

#if defined(__AVX2__) && defined(__F16C__)
namespace {

template <class Isa, bool BF16>
struct HalfTiles {
  const float* x;          // [M, K]
  const uint16_t* weight;  // [N, K], float16 or bfloat16 bits
  float* out;              // [M, N]
  int64_t N, K;

  template <int MT, int NR>
  void run(int64_t m0, int64_t n0) const {
    constexpr int64_t V = Isa::kWidth;
    constexpr int64_t kLineValues = kCacheLine / sizeof(uint16_t);
    const uint16_t* rows[NR];
    for (int r = 0; r < NR; ++r) rows[r] = weight + (n0 + r) * K;
    const int64_t ahead = kPrefetchTiles * NR * K;  // values
    typename Isa::V acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = Isa::zero();
    int64_t k = 0;
    for (; k + V <= K; k += V) {
      typename Isa::V xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = Isa::load(x + (m0 + m) * K + k);
      for (int r = 0; r < NR; ++r) {
        if (k % kLineValues == 0) prefetch(rows[r] + k + ahead);
        const auto w = Isa::template load_half<BF16>(rows[r] + k);
        for (int m = 0; m < MT; ++m) acc[m][r] = Isa::fma(w, xv[m], acc[m][r]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) {
        float sum = Isa::sum(acc[m][r]);
        for (int64_t j = k; j < K; ++j) sum += x[(m0 + m) * K + j] * Avx2::widen_half<BF16>(rows[r][j]);
        out[(m0 + m) * N + n0 + r] = sum;
      }
  }
};

template <class Isa>
void run_tiles(const float* x, const uint16_t* weight, float* out, int64_t M, int64_t N, int64_t K, bool bf16) {
  if (bf16) for_each_tile(HalfTiles<Isa, true>{x, weight, out, N, K}, M, N, K);
  else for_each_tile(HalfTiles<Isa, false>{x, weight, out, N, K}, M, N, K);
}

}  // namespace
#endif

// 512 where this build has AVX-512 registers, else 256; 0 where it has no vectorized path (the portable build).
int64_t half_gemv_widest() {
#if defined(__AVX512F__) && defined(__F16C__)
  return 512;
#elif defined(__AVX2__) && defined(__F16C__)
  return 256;
#else
  return 0;
#endif
}

// x: [M, K] float32, weight: [N, K] float16 or bfloat16 contiguous -> x W^T [M, N] float32. vector_bits: 256 (AVX2)
// or 512 (AVX-512), 0 for the widest this build has.
at::Tensor half_gemv(at::Tensor x, at::Tensor weight, int64_t vector_bits) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || weight.scalar_type() == at::kHalf) && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              "weight must be a contiguous float16 or bfloat16 [N, K] CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "x must be a float32 [M, ", K, "] CPU tensor");
  const int64_t widest = half_gemv_widest();
  if (vector_bits == 0) vector_bits = widest;
  TORCH_CHECK(vector_bits == 256 || vector_bits == 512, "vector_bits must be 0, 256 or 512, not ", vector_bits);
  TORCH_CHECK(vector_bits <= widest, "this build of the CPU kernels has no ", vector_bits, "-bit half GEMV (widest: ",
              widest, ")");
  auto out = at::empty({x.size(0), N}, x.options());
#if defined(__AVX2__) && defined(__F16C__)
  x = x.contiguous();
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return out;
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
#ifdef __AVX512F__
  if (vector_bits == 512) {
    run_tiles<Avx512>(x.data_ptr<float>(), w, out.data_ptr<float>(), M, N, K, bf16);
    return out;
  }
#endif
  run_tiles<Avx2>(x.data_ptr<float>(), w, out.data_ptr<float>(), M, N, K, bf16);
#endif
  return out;
}

}  // namespace kvforge_cpu

// The decode GEMV of float32 layers: x [M, K] times a row-major float32 weight W [N, K], out = x W^T [M, N], for the
// few rows of a decode step (the reference is F.linear; kernels/cpu/dense_gemv.py routes the rows to it).
//
// At one row of x, F.linear streams a model's layers at ~43% of the machine's copy bandwidth (AVX2 EPYC, 2 threads);
// this kernel walks W in the tiles of quant_gemv.h (several weight rows at once, each read once per tile of x
// rows) and prefetches kPrefetchTiles tiles ahead: ~72% over the layers, the full copy rate on a large LM head
// (python -m kvforge.benchmarks.quant_gemv_cpu).
//
//   weight row n:  [ k 0..7 | 8..15 | ... ]  one 8-float vector at a time, an FMA chain per (row of x, row of W);
//                  the columns past the last whole vector (K % 8) are added one by one.
#include "quant_gemv.h"

namespace kvforge_cpu {

#ifdef __AVX2__
namespace {

using F = Avx2;  // 8-float vectors, as GCC's tuning has them for the AVX-512 CPUs too
constexpr int64_t kLineFloats = kCacheLine / sizeof(float);

struct DenseTiles {
  const float* x;       // [M, K]
  const float* weight;  // [N, K]
  float* out;           // [M, N]
  int64_t N, K;

  template <int MT, int NR>
  void run(int64_t m0, int64_t n0) const {
    const float* rows[NR];
    for (int r = 0; r < NR; ++r) rows[r] = weight + (n0 + r) * K;
    const int64_t ahead = kPrefetchTiles * NR * K;  // floats
    F::V acc[MT][NR];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = F::zero();
    int64_t k = 0;
    for (; k + F::kWidth <= K; k += F::kWidth) {
      F::V xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = F::load(x + (m0 + m) * K + k);
      for (int r = 0; r < NR; ++r) {
        if (k % kLineFloats == 0) prefetch(rows[r] + k + ahead);
        const F::V w = F::load(rows[r] + k);
        for (int m = 0; m < MT; ++m) acc[m][r] = F::fma(w, xv[m], acc[m][r]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NR; ++r) {
        float sum = F::sum(acc[m][r]);
        for (int64_t j = k; j < K; ++j) sum += x[(m0 + m) * K + j] * rows[r][j];
        out[(m0 + m) * N + n0 + r] = sum;
      }
  }
};

}  // namespace
#endif

// x: [M, K] float32, weight: [N, K] float32 contiguous -> x W^T [M, N] float32 (AVX2 builds only).
at::Tensor dense_gemv(at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.device().is_cpu(),
              "weight must be a contiguous float32 [N, K] CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "x must be a float32 [M, ", K, "] CPU tensor");
#ifdef __AVX2__
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0)
    for_each_tile(DenseTiles{x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), N, K}, M, N, K);
  return out;
#else
  TORCH_CHECK(false, "dense_gemv needs the AVX2 build of the CPU kernels");
#endif
}

// x [M, K] W^T + bias by oneDNN's matmul on the row-major weight or on a copy packed in oneDNN's blocked layout
// (dense_gemv.py: pack_for_onednn): the op torch registers for its own compiled CPU graphs
// (mkldnn::_linear_pointwise), which Inductor cannot lower on a weight it did not pack, called here so that a
// compiled step sees one opaque op. Above a few rows it beats F.linear's BLAS on every layer shape of the default
// model (kernels/cpu/dense_gemv.py has the figures).
at::Tensor onednn_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace kvforge_cpu

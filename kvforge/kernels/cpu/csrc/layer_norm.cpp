// LayerNorm with the residual add fused in, for the encoder models' post-norm layers (models/bert.py) in eager
// steps: out = (row - mean) / sqrt(var + eps) * weight + bias, row = x (+ residual). With a residual, torch runs the
// add as a pass of its own into a fresh temporary before its layer_norm; here each row is read from memory once (the
// second and third passes over it hit the L1 cache: a row is a few KiB) and written once. Measured (1900 rows of
// 384, 2 threads): a plain LayerNorm as fast as torch's, an add + LayerNorm 1.96x faster.
//
// float32 only (the encoders run in float32; kernels/cpu/layer_ops.py sends other dtypes to the reference). The
// mean and variance are two-pass sums in float32 of small numbers: the mean sums each value less the row's first
// (a row far from zero keeps its digits), the variance the squared deviations (not E[x^2] - E[x]^2). vec.h's
// Lanes16 is one zmm register in the AVX-512 build and two ymm in the AVX2 one; `layer_norm_scalar` below is the
// plain loop, the reference each build's vector code is tested against.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace kvforge_cpu {
namespace {

using Vec = Lanes16;
constexpr int64_t kLanes = Vec::kWidth;
constexpr int64_t kGrainElements = 16384;  // elements of rows per thread's chunk, at least

// One row, vectorized: row = x (+ residual, kept in scratch for the later passes).
void norm_row_vec(float* out, const float* x, const float* residual, const float* weight, const float* bias,
                  int64_t hidden, float eps, float* scratch) {
  const int64_t body = hidden - hidden % kLanes;
  const float pivot = residual == nullptr ? x[0] : x[0] + residual[0];
  Vec::V acc = {};
  float tail = 0.f;
  const float* row = x;
  if (residual != nullptr) {
    for (int64_t d = 0; d < body; d += kLanes) {
      const Vec::V v = Vec::load(x + d) + Vec::load(residual + d);
      Vec::store(scratch + d, v);
      acc += v - pivot;
    }
    for (int64_t d = body; d < hidden; ++d) tail += (scratch[d] = x[d] + residual[d]) - pivot;
    row = scratch;
  } else {
    for (int64_t d = 0; d < body; d += kLanes) acc += Vec::load(x + d) - pivot;
    for (int64_t d = body; d < hidden; ++d) tail += x[d] - pivot;
  }
  const float mean = pivot + (Vec::sum(acc) + tail) / static_cast<float>(hidden);
  Vec::V squares = {};
  tail = 0.f;
  for (int64_t d = 0; d < body; d += kLanes) {
    const Vec::V dev = Vec::load(row + d) - mean;
    squares += dev * dev;
  }
  for (int64_t d = body; d < hidden; ++d) tail += (row[d] - mean) * (row[d] - mean);
  const float rstd = 1.f / std::sqrt((Vec::sum(squares) + tail) / static_cast<float>(hidden) + eps);
  for (int64_t d = 0; d < body; d += kLanes)
    Vec::store(out + d, (Vec::load(row + d) - mean) * rstd * Vec::load(weight + d) + Vec::load(bias + d));
  for (int64_t d = body; d < hidden; ++d) out[d] = (row[d] - mean) * rstd * weight[d] + bias[d];
}

// The same row, one element at a time: the reference for the vector code.
void norm_row_scalar(float* out, const float* x, const float* residual, const float* weight, const float* bias,
                     int64_t hidden, float eps, float* scratch) {
  for (int64_t d = 0; d < hidden; ++d) scratch[d] = residual == nullptr ? x[d] : x[d] + residual[d];
  float sum = 0.f;
  for (int64_t d = 0; d < hidden; ++d) sum += scratch[d] - scratch[0];
  const float mean = scratch[0] + sum / static_cast<float>(hidden);
  float squares = 0.f;
  for (int64_t d = 0; d < hidden; ++d) squares += (scratch[d] - mean) * (scratch[d] - mean);
  const float rstd = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  for (int64_t d = 0; d < hidden; ++d) out[d] = (scratch[d] - mean) * rstd * weight[d] + bias[d];
}

at::Tensor run_rows(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                    const at::Tensor& bias, double eps, bool vectorized, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              op, ": x is [rows, hidden] float32 with contiguous rows");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(hidden > 0, op, ": rows of at least one value");
  for (const at::Tensor* param : {&weight, &bias})
    TORCH_CHECK(param->dim() == 1 && param->is_contiguous() && param->size(0) == hidden &&
                    param->scalar_type() == at::kFloat,
                op, ": weight and bias are [hidden] float32, contiguous");
  const float* r = nullptr;
  int64_t r_stride = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 && residual->scalar_type() == at::kFloat,
                op, ": residual is like x");
    r = residual->data_ptr<float>();
    r_stride = residual->stride(0);
  }
  auto out = at::empty({rows, hidden}, x.options());
  const float* xp = x.data_ptr<float>();
  const float *w = weight.data_ptr<float>(), *b = bias.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const auto norm_row = vectorized ? norm_row_vec : norm_row_scalar;
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, hidden)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<float> scratch(hidden);
                     for (int64_t i = begin; i < end; ++i)
                       norm_row(o + i * hidden, xp + i * x.stride(0), r == nullptr ? nullptr : r + i * r_stride, w,
                                b, hidden, static_cast<float>(eps), scratch.data());
                   });
  return out;
}

}  // namespace

// x [rows, hidden] float32 (contiguous rows), residual like x or None, weight and bias [hidden] -> [rows, hidden].
at::Tensor layer_norm(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, at::Tensor bias,
                      double eps) {
  return run_rows(x, residual, weight, bias, eps, true, "layer_norm");
}

// layer_norm's arguments, one element at a time (tests: the vector code of this build against it).
at::Tensor layer_norm_scalar(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, at::Tensor bias,
                             double eps) {
  return run_rows(x, residual, weight, bias, eps, false, "layer_norm_scalar");
}

}  // namespace kvforge_cpu

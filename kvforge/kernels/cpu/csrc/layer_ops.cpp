// The per-token ops between a layer's matmuls, for the steps a CPU engine runs eagerly (prefill chunks, mixed
// steps, --enforce-eager): RMSNorm with the residual add fused in, SiLU-and-mul, rotary embedding. Each reads its
// rows once and writes its result once; their torch references (kernels/rms_norm.py, activation.py, rotary.py) run
// 4-6 ops each, every one a pass over memory into a fresh temporary. A compiled step does not call these: Inductor
// fuses the references into its own loops (kernels/cpu/layer_ops.py picks).
//
// Each kernel computes in fp32 and rounds to the input dtype where its reference does, so bf16 and fp16 rows
// match it up to the order of a row's sum. Rows are split over the threads in chunks of about kGrainElements.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "fast_exp.h"

namespace kvforge_cpu {
namespace {

constexpr int64_t kGrainElements = 16384;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// out[r] = round(row * inv_rms) * weight, row = x[r] (+ residual[r], rounded and written to residual_out[r]).
template <typename T>
void rms_norm_rows(T* out, T* residual_out, const T* x, int64_t x_stride, const T* residual, int64_t r_stride,
                   const T* weight, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      if (residual != nullptr) {
        const T* rr = residual + r * r_stride;
        T* ro = residual_out + r * hidden;
        for (int64_t d = 0; d < hidden; ++d) {
          const T sum = static_cast<T>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
          ro[d] = sum;
          row[d] = static_cast<float>(sum);
        }
      } else {
        for (int64_t d = 0; d < hidden; ++d) row[d] = static_cast<float>(xr[d]);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < hidden; ++d) squares += row[d] * row[d];
      const float inv_rms = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t d = 0; d < hidden; ++d)
        o[d] = static_cast<T>(static_cast<float>(static_cast<T>(row[d] * inv_rms)) * static_cast<float>(weight[d]));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x is [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              op, ": weight is [hidden], contiguous, in x's dtype");
}

// x [rows, 2 * d] = [gate | up] -> silu(gate) * up [rows, d]; silu's result rounded before the multiply.
template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t x_stride, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + d;
      T* o = out + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T silu = static_cast<T>(g / (1.f + exp_clamped(-g)));
        o[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
      }
    }
  });
}

// Heads [tokens, heads, head_dim] (any token and head strides, contiguous features) -> contiguous out, the first
// rot_dim features of each head rotated by its token's angles, the rest copied. cos_sin [max_position, rot_dim]:
// cos in the first half, sin in the second. neox pairs feature i with i + rot_dim / 2; GPT-J pairs 2i with 2i + 1.
template <typename T, typename P>
void rotate_heads(T* out, const T* x, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads,
                  int64_t head_dim, const P* positions, const float* cos_sin, int64_t max_position, int64_t rot_dim,
                  bool is_neox) {
  const int64_t half = rot_dim / 2;
  at::parallel_for(0, tokens, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t position = positions[t];
      TORCH_CHECK(position >= 0 && position < max_position, "rotary_embedding: position ", position,
                  " outside the table's ", max_position);
      const float* cos = cos_sin + position * rot_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * token_stride + h * head_stride;
        T* oh = out + (t * heads + h) * head_dim;
        if (is_neox) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(xh[i]), x2 = static_cast<float>(xh[i + half]);
            oh[i] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
            oh[i + half] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(xh[2 * i]), x2 = static_cast<float>(xh[2 * i + 1]);
            oh[2 * i] = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
            oh[2 * i + 1] = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
          }
        }
        std::copy(xh + rot_dim, xh + head_dim, oh + rot_dim);
      }
    }
  });
}

}  // namespace

// x [rows, hidden] (contiguous rows), weight [hidden] in x's dtype -> [rows, hidden].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), nullptr, x.data_ptr<scalar_t>(), x.stride(0), nullptr, 0,
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// (rms_norm(x + residual), x + residual), both [rows, hidden]; residual like x.
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(at::Tensor x, at::Tensor residual,
                                                            at::Tensor weight, double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual is like x");
  auto out = at::empty(x.sizes(), x.options());
  auto residual_out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), residual_out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                            x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0),
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {out, residual_out};
}

// x [rows, 2 * d] (contiguous rows) -> [rows, d].
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x is [rows, 2 * d] with contiguous rows");
  const int64_t d = x.size(1) / 2;
  auto out = at::empty({x.size(0), d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0), x.size(0), d);
  });
  return out;
}

// positions [tokens] int32/int64; query [tokens, heads, head_dim], key [tokens, kv_heads, head_dim] (contiguous
// features); cos_sin_cache [max_position, rot_dim] float32 -> (query, key) rotated, contiguous.
std::tuple<at::Tensor, at::Tensor> rotary_embedding(at::Tensor positions, at::Tensor query,
                                                          at::Tensor key, at::Tensor cos_sin_cache,
                                                          bool is_neox) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1 &&
                  query.size(0) == key.size(0) && query.size(2) == key.size(2) &&
                  query.scalar_type() == key.scalar_type(),
              "rotary_embedding: query and key are [tokens, heads, head_dim] with contiguous features");
  TORCH_CHECK(positions.dim() == 1 && positions.is_contiguous() && positions.size(0) == query.size(0) &&
                  (positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt),
              "rotary_embedding: positions is [tokens] int32 or int64");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.size(1) % 2 == 0 &&
                  cos_sin_cache.size(1) <= query.size(2),
              "rotary_embedding: cos_sin_cache is [max_position, rot_dim] float32, rot_dim even and <= head_dim");
  auto q_out = at::empty(query.sizes(), query.options());
  auto k_out = at::empty(key.sizes(), key.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_embedding", [&] {
    AT_DISPATCH_INDEX_TYPES(positions.scalar_type(), "rotary_embedding_positions", [&] {
      for (auto [out, x] : {std::pair{&q_out, &query}, std::pair{&k_out, &key}})
        rotate_heads<scalar_t, index_t>(out->data_ptr<scalar_t>(), x->data_ptr<scalar_t>(), x->stride(0),
                                        x->stride(1), x->size(0), x->size(1), x->size(2),
                                        positions.data_ptr<index_t>(), cos_sin_cache.data_ptr<float>(),
                                        cos_sin_cache.size(0), cos_sin_cache.size(1), is_neox);
    });
  });
  return {q_out, k_out};
}

}  // namespace kvforge_cpu

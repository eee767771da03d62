// Paged decode attention for the CPU: one query token per sequence, keys and values read straight
// from the paged cache through the block table (no gathered copy), softmax in fp32.
//
// Work item = (sequence, kv head): the `group` query heads that share a kv head walk its context once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * static_cast<float>(v[d]);
}

template <typename T>
void decode_kernel(T* out, const T* query, const T* key_cache, const T* value_cache,
                   const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the cache
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int32_t* table = block_tables + seq * max_blocks;
      for (int64_t i = 0; i < group * head_dim; ++i)
        q[i] = static_cast<float>(query[(seq * num_heads + kv_head * group) * head_dim + i]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {  // block by block: no division per token
        const T* k = key_cache + (static_cast<int64_t>(table[t0 / block_size]) * block_size) * token_stride
                     + kv_head * head_dim;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t, k += token_stride)
          for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q.data() + g * head_dim, k, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        const float max_score = *std::max_element(row, row + len);
        float denom = 0.f;
        for (int64_t t = 0; t < len; ++t) denom += (row[t] = std::exp(row[t] - max_score));
        const float inv = 1.f / denom;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const T* v = value_cache + (static_cast<int64_t>(table[t0 / block_size]) * block_size) * token_stride
                     + kv_head * head_dim;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t, v += token_stride)
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], v, acc.data() + g * head_dim, head_dim);
      }
      T* o = out + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

// out, query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32. All contiguous, on the CPU.
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(out.data_ptr<scalar_t>(), query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                            value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                            seq_lens.data_ptr<int32_t>(), query.size(0), query.size(1), key_cache.size(2),
                            query.size(2), key_cache.size(1), block_tables.size(1), static_cast<float>(scale));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }

// Paged decode attention for the CPU: one query token per sequence, keys and values read straight
// from the paged cache through the block table (no gathered copy), softmax in fp32.
//
// Work item = (sequence, kv head): the `group` query heads that share a kv head walk its context once.
//
// A quantized cache holds int8 or fp8 (e4m3) codes C and one float scale per (token, kv head). Each cached
// row is widened to floats once for the whole group, and its scale is factored out of the head_dim loops:
//     score[t] = k_scale[t] * (q . k_codes[t])        acc += (p[t] * v_scale[t]) * v_codes[t]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// fp8 e4m3 codes are widened through a 256-entry table, built once from c10's conversion.
inline const float* fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int bits = 0; bits < 256; ++bits)
      t[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// One cached row (a token's key or value for one kv head) as floats: converted once, then read by
// every query head of the group. Float caches are read in place.
template <typename C>
inline const float* widen_row(const C* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<C, float>) {
    return src;
  } else if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    const float* table = fp8_e4m3_table();
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
    for (int64_t d = 0; d < n; ++d) dst[d] = table[bits[d]];
    return dst;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
    return dst;
  }
}

inline float dot(const float* q, const float* k, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * k[d];
  return sum;
}

inline void axpy(float a, const float* v, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * v[d];
}

// T: query and output dtype; C: cache element dtype (T itself, or codes with k_scale/v_scale non-null:
// [num_blocks * block_size, num_kv_heads] floats).
template <typename T, typename C>
void decode_kernel(T* out, const T* query, const C* key_cache, const C* value_cache, const float* key_scale,
                   const float* value_scale, const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between consecutive slots of the cache
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = seq_lens[seq];
      T* o = out + (seq * num_heads + kv_head * group) * head_dim;
      if (len <= 0) {  // a padding row of a decode bucket: nothing to attend to
        std::fill(o, o + group * head_dim, static_cast<T>(0));
        continue;
      }
      const int32_t* table = block_tables + seq * max_blocks;
      for (int64_t i = 0; i < group * head_dim; ++i)
        q[i] = static_cast<float>(query[(seq * num_heads + kv_head * group) * head_dim + i]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {  // block by block: no division per token
        const int64_t slot0 = static_cast<int64_t>(table[t0 / block_size]) * block_size;
        const C* k = key_cache + slot0 * token_stride + kv_head * head_dim;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t, k += token_stride) {
          const float k_scale = key_scale ? key_scale[(slot0 + t - t0) * num_kv_heads + kv_head] : 1.f;
          const float* k_row = widen_row(k, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g)
            scores[g * len + t] = k_scale * dot(q.data() + g * head_dim, k_row, head_dim);
        }
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
        const int64_t slot0 = static_cast<int64_t>(table[t0 / block_size]) * block_size;
        const C* v = value_cache + slot0 * token_stride + kv_head * head_dim;
        for (int64_t t = t0; t < std::min(t0 + block_size, len); ++t, v += token_stride) {
          const float v_scale = value_scale ? value_scale[(slot0 + t - t0) * num_kv_heads + kv_head] : 1.f;
          const float* v_row = widen_row(v, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * len + t] * v_scale, v_row, acc.data() + g * head_dim, head_dim);
        }
      }
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T, typename C>
void launch(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const float* key_scale, const float* value_scale,
            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale) {
  decode_kernel<T, C>(out.data_ptr<T>(), query.data_ptr<T>(), key_cache.data_ptr<C>(), value_cache.data_ptr<C>(),
                      key_scale, value_scale, block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                      query.size(0), query.size(1), key_cache.size(2), query.size(2), key_cache.size(1),
                      block_tables.size(1), static_cast<float>(scale));
}

}  // namespace

// query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (0: a padding row, output zeros).
// All contiguous, on the CPU. key_scale, value_scale: None for caches in the query dtype, or
// [num_blocks, block_size, num_kv_heads] float32 for int8 / float8_e4m3fn codes. Returns [num_seqs, num_heads,
// head_dim] in the query dtype.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           c10::optional<torch::Tensor> key_scale, c10::optional<torch::Tensor> value_scale) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode takes contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens are int32");
  const float* k_scale = key_scale.has_value() ? key_scale->data_ptr<float>() : nullptr;
  const float* v_scale = value_scale.has_value() ? value_scale->data_ptr<float>() : nullptr;
  TORCH_CHECK((k_scale == nullptr) == (v_scale == nullptr), "key_scale and value_scale go together");
  auto out = torch::empty_like(query);
  const auto cache_type = key_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    if (k_scale == nullptr) {
      launch<scalar_t, scalar_t>(out, query, key_cache, value_cache, nullptr, nullptr, block_tables, seq_lens, scale);
    } else if (cache_type == at::kChar) {
      launch<scalar_t, int8_t>(out, query, key_cache, value_cache, k_scale, v_scale, block_tables, seq_lens, scale);
    } else if (cache_type == at::kFloat8_e4m3fn) {
      launch<scalar_t, c10::Float8_e4m3fn>(out, query, key_cache, value_cache, k_scale, v_scale, block_tables,
                                           seq_lens, scale);
    } else {
      TORCH_CHECK(false, "paged_decode: quantized caches hold int8 or float8_e4m3fn codes, got ", cache_type);
    }
  });
  return out;
}

// Row copy into the paged cache: rows [num_tokens, *row_shape] (contiguous, the cache's dtype) go to the slots of
// slot_mapping [num_tokens] (int64; negative: a padding token, skipped); cache [num_blocks, block_size, *row_shape]
// with contiguous rows, its two leading dims strided as they may be (e.g. the K half of a joint K/V tensor).
//   slot s -> cache[s / block_size, s % block_size]
void cache_write(torch::Tensor rows, torch::Tensor cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type(), "cache_write: rows of ", rows.scalar_type(),
              " into a cache of ", cache.scalar_type());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "cache_write: slot_mapping is contiguous int64");
  TORCH_CHECK(rows.is_contiguous() && cache.dim() >= 2 && rows.size(0) == slot_mapping.size(0),
              "cache_write: rows [num_tokens, ...] contiguous, one slot each");
  const int64_t block_size = cache.size(1);
  const int64_t row_bytes = rows.numel() == 0 ? 0 : rows.nbytes() / rows.size(0);
  TORCH_CHECK(cache.numel() / (cache.size(0) * block_size) * cache.element_size() == row_bytes,
              "cache_write: rows do not match the cache's token shape");
  const int64_t element = cache.element_size();
  const int64_t block_stride = cache.stride(0) * element, slot_stride = cache.stride(1) * element;
  const int64_t num_slots = cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(rows.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  for (int64_t i = 0; i < rows.size(0); ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "cache_write: slot ", slot, " beyond the cache's ", num_slots);
    std::memcpy(dst + (slot / block_size) * block_stride + (slot % block_size) * slot_stride, src + i * row_bytes,
                row_bytes);
  }
}

TORCH_LIBRARY_FRAGMENT(kvforge_cpu, m) {
  m.def("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, Tensor? key_scale=None, Tensor? value_scale=None) -> Tensor");
  m.def("cache_write(Tensor rows, Tensor(a!) cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvforge_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("cache_write", &cache_write);
}

// torch.utils.cpp_extension.load imports the build as a Python module: this one has no functions of its own.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

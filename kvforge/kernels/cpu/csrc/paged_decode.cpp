// Paged decode attention for the CPU: one query token per sequence, keys and values read straight
// from the paged cache through the block table (no gathered copy), softmax in fp32.
//
// Work item = (sequence, kv head, part of the context): the `group` query heads that share a kv head walk the
// part's tokens once. A sequence's context is cut into parts only when there are too few (sequence, kv head)
// pairs to keep every thread busy (one stream of a 3-kv-head model on 2 threads: 3 items, one thread idle half
// the time). Each part keeps its own softmax max m_p, sum l_p and unnormalized output acc_p; the parts then merge:
//     M = max_p m_p      out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p
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

// exp(x) for x <= 0 (a score minus its row's max), in a form the compiler vectorizes (std::exp is a call per
// element): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (relative error under 1e-7),
// times 2^n built in the exponent bits. x is clamped at -87, where float's normal range ends (exp(-87) ~ 1.6e-38
// is nothing beside the row's largest term, 1).
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float n = (clamped * 1.44269504088896341f + 12582912.f) - 12582912.f;  // nearest integer (1.5 * 2^23)
  const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;  // ln2 in two parts
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

inline void prefetch_rows(const void* first, int64_t rows, int64_t stride_bytes, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r, p += stride_bytes)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// The cache and the geometry every work item reads.
template <typename C>
struct Paged {
  const C* key_cache;
  const C* value_cache;
  const float* key_scale;    // null for a float cache
  const float* value_scale;
  const int32_t* block_tables;
  int64_t num_kv_heads, head_dim, block_size, max_blocks;

  int64_t token_stride() const { return num_kv_heads * head_dim; }  // between consecutive slots of the cache
};

// visit(t, slot, row) for tokens [t_begin, t_end) of one kv head's rows in cache (keys or values), block by block
// through the sequence's block table, the next block's rows prefetched while this one's are used. A part starts on a
// block boundary, so token t's slot is its block's first slot plus its offset.
template <typename C, class Visit>
inline void walk_rows(const Paged<C>& c, const C* cache, const int32_t* table, int64_t kv_head, int64_t D,
                      int64_t t_begin, int64_t t_end, Visit visit) {
  const int64_t bs = c.block_size, stride = c.token_stride();
  for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
    const int64_t slot0 = static_cast<int64_t>(table[t0 / bs]) * bs, t1 = std::min(t0 + bs, t_end);
    if (t1 < t_end)
      prefetch_rows(cache + static_cast<int64_t>(table[t0 / bs + 1]) * bs * stride + kv_head * D,
                    std::min(bs, t_end - t1), stride * static_cast<int64_t>(sizeof(C)), D * sizeof(C));
    const C* row = cache + slot0 * stride + kv_head * D;
    for (int64_t t = t0; t < t1; ++t, row += stride) visit(t, slot0 + t - t0, row);
  }
}

// Tokens [t_begin, t_end) of one (sequence, kv head): q [group, head_dim] (already scaled) against them. Writes
// the part's max m[g] and sum l[g] of exp(score - m), and acc [group, head_dim] = sum_t exp(score - m) v_t.
template <int HD, typename C>
void attend_part(const Paged<C>& c, const float* q, int64_t group, int64_t seq, int64_t kv_head, int64_t t_begin,
                 int64_t t_end, float* m, float* l, float* acc, std::vector<float>& scores, float* row) {
  const int64_t len = t_end - t_begin, D = HD ? HD : c.head_dim;
  const int32_t* table = c.block_tables + seq * c.max_blocks;
  scores.assign(group * len, 0.f);
  walk_rows(c, c.key_cache, table, kv_head, D, t_begin, t_end, [&](int64_t t, int64_t slot, const C* k) {
    const float k_scale = c.key_scale ? c.key_scale[slot * c.num_kv_heads + kv_head] : 1.f;
    const float* k_row = widen_row(k, row, D);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t - t_begin] = k_scale * dot(q + g * D, k_row, D);
  });
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    float max_score = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : max_score)
    for (int64_t t = 0; t < len; ++t) max_score = s[t] > max_score ? s[t] : max_score;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = exp_nonpositive(s[t] - max_score);
      sum += s[t];
    }
    m[g] = max_score;
    l[g] = sum;
  }
  std::fill(acc, acc + group * D, 0.f);
  walk_rows(c, c.value_cache, table, kv_head, D, t_begin, t_end, [&](int64_t t, int64_t slot, const C* v) {
    const float v_scale = c.value_scale ? c.value_scale[slot * c.num_kv_heads + kv_head] : 1.f;
    const float* v_row = widen_row(v, row, D);
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t - t_begin] * v_scale, v_row, acc + g * D, D);
  });
}

// Tokens a part holds: a whole number of blocks, few enough parts that each is worth a work item, and enough
// that every thread gets about kItemsPerThread items. 0: one part per sequence.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kMinPartTokens = 64;

int64_t part_tokens(int64_t pairs, int64_t max_len, int64_t block_size) {
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  if (pairs >= wanted || max_len <= kMinPartTokens) return 0;
  const int64_t parts = (wanted + pairs - 1) / pairs;
  const int64_t tokens = std::max(kMinPartTokens, (max_len + parts - 1) / parts);
  return (tokens + block_size - 1) / block_size * block_size;
}

// T: query and output dtype; C: cache element dtype (T itself, or codes with key_scale/value_scale non-null:
// [num_blocks * block_size, num_kv_heads] floats).
template <typename T, typename C>
void decode_kernel(T* out, const T* query, const Paged<C>& c, const int32_t* seq_lens, int64_t num_seqs,
                   int64_t num_heads, float scale) {
  const int64_t kvh = c.num_kv_heads, D = c.head_dim, group = num_heads / kvh;
  const int64_t max_len = num_seqs ? *std::max_element(seq_lens, seq_lens + num_seqs) : 0;
  const int64_t part = part_tokens(num_seqs * kvh, max_len, c.block_size);
  const int64_t max_parts = part ? (max_len + part - 1) / part : 1;
  // per (sequence, kv head, part): m and l [group], acc [group, D]; the merge reads them when a sequence has parts
  std::vector<float> part_m, part_l, part_acc;
  if (max_parts > 1) {
    part_m.resize(num_seqs * kvh * max_parts * group);
    part_l.resize(part_m.size());
    part_acc.resize(part_m.size() * D);
  }
  at::parallel_for(0, num_seqs * kvh * max_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * D), acc(group * D), row(D), scores, m(group), l(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / max_parts, p = item % max_parts, seq = pair / kvh, kv_head = pair % kvh;
      const int64_t len = seq_lens[seq], parts = part ? (len + part - 1) / part : 1;
      T* o = out + (seq * num_heads + kv_head * group) * D;
      if (len <= 0) {  // a padding row of a decode bucket: nothing to attend to
        if (p == 0) std::fill(o, o + group * D, static_cast<T>(0));
        continue;
      }
      if (p >= parts) continue;  // a shorter sequence than the longest
      for (int64_t i = 0; i < group * D; ++i)
        q[i] = static_cast<float>(query[(seq * num_heads + kv_head * group) * D + i]) * scale;
      const int64_t t_begin = part ? p * part : 0, t_end = part ? std::min(len, t_begin + part) : len;
      const bool whole = parts == 1;
      float* acc_out = whole ? acc.data() : part_acc.data() + item * group * D;
      float* m_out = whole ? m.data() : part_m.data() + item * group;
      float* l_out = whole ? l.data() : part_l.data() + item * group;
      const auto attend = D == 64 ? attend_part<64, C> : D == 128 ? attend_part<128, C> : attend_part<0, C>;
      attend(c, q.data(), group, seq, kv_head, t_begin, t_end, m_out, l_out, acc_out, scores, row.data());
      if (!whole) continue;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(acc[g * D + d] / l[g]);
    }
  });
  if (max_parts == 1) return;
  at::parallel_for(0, num_seqs * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(D);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = pair / kvh, kv_head = pair % kvh, len = seq_lens[seq];
      const int64_t parts = (len + part - 1) / part;
      if (parts <= 1) continue;  // written by its item
      T* o = out + (seq * num_heads + kv_head * group) * D;
      for (int64_t g = 0; g < group; ++g) {
        float top = -INFINITY;
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_m[(pair * max_parts + p) * group + g]);
        float denom = 0.f;
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t at = (pair * max_parts + p) * group + g;
          const float w = std::exp(part_m[at] - top);
          denom += w * part_l[at];
          axpy(w, part_acc.data() + at * D, sum.data(), D);
        }
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(sum[d] / denom);
      }
    }
  });
}

template <typename T, typename C>
void launch(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const float* key_scale, const float* value_scale,
            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale) {
  const Paged<C> cache{key_cache.data_ptr<C>(), value_cache.data_ptr<C>(), key_scale, value_scale,
                       block_tables.data_ptr<int32_t>(), key_cache.size(2), query.size(2), key_cache.size(1),
                       block_tables.size(1)};
  decode_kernel<T, C>(out.data_ptr<T>(), query.data_ptr<T>(), cache, seq_lens.data_ptr<int32_t>(), query.size(0),
                      query.size(1), static_cast<float>(scale));
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

// Paged decode attention for the CPU: one query token per sequence, keys and values read straight
// from the paged cache through the block table (no gathered copy), softmax in fp32.
//
// Work item = (sequence, kv head, part of the context): the `group` query heads that share a kv head walk the
// part's tokens once. A sequence's context is cut into parts only when there are too few (sequence, kv head)
// pairs to keep every thread busy (one stream of a 3-kv-head model on 2 threads: 3 items, one thread idle half
// the time). Each part keeps its own softmax max m_p, sum l_p and unnormalized output acc_p; the parts then merge:
//     M = max_p m_p      out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p
//
// A work item reads its keys, then its values, in tiles of 16 tokens. Keys: each query head's products with a row
// are summed into a vector of 16 partials per token, and the 16 tokens' vectors fold into their 16 scores at once
// (lane_sums), instead of one horizontal sum per (token, head). Values: the accumulators of a block of heads stay
// in registers while the tile's rows stream past. NOTE: measured with `python -m kvforge.benchmarks.paged_decode_cpu`
// (Zen 4 EPYC, 2 threads, 64 sequences x 214 tokens, 30 layers): the per-token dots and axpys took ~2x as long;
// prefetching the next block to L2 (hint 2) rather than L1 is worth ~30% of that; prefetching 2 or 4 blocks ahead,
// or the whole block's rows for all kv heads, and one pass with an online softmax were no faster.
//
// A quantized cache holds int8 or fp8 (e4m3) codes C and one float scale per (token, kv head). Each cached
// row is widened to floats once for the whole group, and its scale is factored out of the head_dim loops:
//     score[t] = k_scale[t] * (q . k_codes[t])        acc += (p[t] * v_scale[t]) * v_codes[t]
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "fast_exp.h"
#include "ops.h"
#include "paged_cache.h"

namespace {

using namespace kvforge_cpu::paged;

inline void axpy(float a, const float* v, float* acc, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += a * v[d];
}

// Two vectors whose lanes hold runs of 2h partial sums (one run per token) -> one vector of runs of h, each the
// sum of its run's halves; a's tokens first, then b's:
//   h = 2:  a = [a0 a0 a0 a0 | a1 a1 a1 a1 | ...]  ->  [a0 a0 | a1 a1 | ... | b0 b0 | b1 b1 | ...]
constexpr int fold_lane(int i, int h) { return (i < 8 ? 0 : 16) + i % 8 / h * 2 * h + i % h; }

template <int h, int... I>
inline Vec::V fold(Vec::V a, Vec::V b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, fold_lane(I, h)...) + __builtin_shufflevector(a, b, (fold_lane(I, h) + h)...);
}

template <int h>
inline Vec::V fold(Vec::V a, Vec::V b) {
  return fold<h>(a, b, std::make_integer_sequence<int, kLanes>{});
}

// The lane sums of 16 vectors (16 tokens' partial dot products) as one vector, in token order: 15 folds, where a
// horizontal sum per token would be a chain of dependent adds each.
inline Vec::V lane_sums(const Vec::V* p) {
  Vec::V a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold<8>(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold<4>(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = fold<2>(b[2 * i], b[2 * i + 1]);
  return fold<1>(c[0], c[1]);
}

// With a sliding window the context starts at the first key the query sees (first_key), mid-block where it falls;
// a soft cap bends each score, and the sinks join the denominator where the output is normalised (Options).
//
// Tokens [t_begin, t_end) of one (sequence, kv head): q [group, Dp] (already scaled, zero past head_dim) against
// them. Writes the part's max m[g] and sum l[g] of exp(score - m), and acc [group, Dp] = sum_t exp(score - m) v_t.
// Keys: a block of heads' partial products with a tile's 16 tokens fold into their 16 scores at once (lane_sums).
// Values: a block of heads' accumulators stays in registers through a tile's tokens.
template <typename C>
void attend_part(const Paged<C>& c, const Options& o, const float* q, int64_t group, int64_t seq, int64_t kv_head,
                 int64_t t_begin, int64_t t_end, float* m, float* l, float* acc, std::vector<float>& scores,
                 float* tile) {
  const int64_t len = t_end - t_begin, kvh = c.num_kv_heads;
  const int64_t Dp = (c.head_dim + kLanes - 1) / kLanes * kLanes, chunks = Dp / kLanes;
  const int32_t* table = c.block_tables + seq * c.max_blocks;
  scores.resize(group * len);
  walk_tiles(c, c.key_cache, table, kv_head, Dp, t_begin, t_end, tile,
             [&](int64_t t0, auto n, const float* rows, int64_t stride, int64_t slot) {
    float k_scale[kLanes] = {};
    for (int64_t i = 0; i < n; ++i) k_scale[i] = c.key_scale ? c.key_scale[(slot + i) * kvh + kv_head] : 1.f;
    for (int64_t g0 = 0; g0 < group; g0 += kHeadBlock) {
      with_block<kHeadBlock>(group - g0, [&](auto heads) {
        constexpr int G = decltype(heads)::value;
        Vec::V p[G][kLanes] = {};  // p[g][i]: head g0 + g's partial products with token t0 + i
        for (int64_t c0 = 0; c0 < chunks; c0 += kChunkBlock) {
          with_block<kChunkBlock>(chunks - c0, [&](auto chunk_block) {
            constexpr int CB = decltype(chunk_block)::value;
            Vec::V qr[G][CB];
            for (int g = 0; g < G; ++g)
              for (int ch = 0; ch < CB; ++ch) qr[g][ch] = Vec::load(q + (g0 + g) * Dp + (c0 + ch) * kLanes);
            for (int64_t i = 0; i < n; ++i) {
              Vec::V sum[G] = {};
              for (int ch = 0; ch < CB; ++ch) {
                const Vec::V k = Vec::load(rows + i * stride + (c0 + ch) * kLanes);
                for (int g = 0; g < G; ++g) sum[g] += qr[g][ch] * k;
              }
              for (int g = 0; g < G; ++g) p[g][i] += sum[g];
            }
          });
        }
        for (int g = 0; g < G; ++g) {
          float out[kLanes];
          Vec::store(out, lane_sums(p[g]) * Vec::load(k_scale));
          std::memcpy(scores.data() + (g0 + g) * len + t0 - t_begin, out, n * sizeof(float));
        }
      });
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * len;
    if (o.softcap > 0.f)
      for (int64_t t = 0; t < len; ++t) s[t] = o.cap(s[t]);
    float max_score = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : max_score)
    for (int64_t t = 0; t < len; ++t) max_score = s[t] > max_score ? s[t] : max_score;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = kvforge_cpu::exp_clamped(s[t] - max_score);
      sum += s[t];
    }
    m[g] = max_score;
    l[g] = sum;
  }
  std::fill(acc, acc + group * Dp, 0.f);
  walk_tiles(c, c.value_cache, table, kv_head, Dp, t_begin, t_end, tile,
             [&](int64_t t0, auto n, const float* rows, int64_t stride, int64_t slot) {
    float v_scale[kLanes];
    for (int64_t i = 0; i < n; ++i) v_scale[i] = c.value_scale ? c.value_scale[(slot + i) * kvh + kv_head] : 1.f;
    for (int64_t g0 = 0; g0 < group; g0 += kHeadBlock) {
      with_block<kHeadBlock>(group - g0, [&](auto heads) {
        constexpr int G = decltype(heads)::value;
        float w[G][kLanes];  // the tile's softmax weights, value scales folded in
        for (int g = 0; g < G; ++g)
          for (int64_t i = 0; i < n; ++i) w[g][i] = scores[(g0 + g) * len + t0 - t_begin + i] * v_scale[i];
        for (int64_t c0 = 0; c0 < chunks; c0 += kChunkBlock) {
          with_block<kChunkBlock>(chunks - c0, [&](auto chunk_block) {
            constexpr int CB = decltype(chunk_block)::value;
            Vec::V a[G][CB];
            for (int g = 0; g < G; ++g)
              for (int ch = 0; ch < CB; ++ch) a[g][ch] = Vec::load(acc + (g0 + g) * Dp + (c0 + ch) * kLanes);
            for (int64_t i = 0; i < n; ++i)
              for (int ch = 0; ch < CB; ++ch) {
                const Vec::V v = Vec::load(rows + i * stride + (c0 + ch) * kLanes);
                for (int g = 0; g < G; ++g) a[g][ch] += w[g][i] * v;
              }
            for (int g = 0; g < G; ++g)
              for (int ch = 0; ch < CB; ++ch) Vec::store(acc + (g0 + g) * Dp + (c0 + ch) * kLanes, a[g][ch]);
          });
        }
      });
    }
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
void decode_kernel(T* out, const T* query, const Paged<C>& c, const Options& opt, const int32_t* seq_lens,
                   int64_t num_seqs, int64_t num_heads, float scale) {
  const int64_t kvh = c.num_kv_heads, D = c.head_dim, group = num_heads / kvh;
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;  // q, acc and widened rows: zero past D
  // the keys each query sees: [first_key, len), len - first_key of them
  auto first_key = [&](int64_t seq) { return opt.first_key(seq_lens[seq] - 1); };
  int64_t max_len = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) max_len = std::max<int64_t>(max_len, seq_lens[seq] - first_key(seq));
  const int64_t part = part_tokens(num_seqs * kvh, max_len, c.block_size);
  const int64_t max_parts = part ? (max_len + part - 1) / part : 1;
  // per (sequence, kv head, part): m and l [group], acc [group, Dp]; the merge reads them when a sequence has parts
  std::vector<float> part_m, part_l, part_acc;
  if (max_parts > 1) {
    part_m.resize(num_seqs * kvh * max_parts * group);
    part_l.resize(part_m.size());
    part_acc.resize(part_m.size() * Dp);
  }
  at::parallel_for(0, num_seqs * kvh * max_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * Dp), acc(group * Dp), tile(kLanes * Dp), scores, m(group), l(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / max_parts, p = item % max_parts, seq = pair / kvh, kv_head = pair % kvh;
      const int64_t len = seq_lens[seq], first = len > 0 ? first_key(seq) : 0;
      const int64_t parts = part ? (len - first + part - 1) / part : 1;
      T* o = out + (seq * num_heads + kv_head * group) * D;
      if (len <= 0) {  // a padding row of a decode bucket: nothing to attend to
        if (p == 0) std::fill(o, o + group * D, static_cast<T>(0));
        continue;
      }
      if (p >= parts) continue;  // a shorter sequence than the longest
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          q[g * Dp + d] = static_cast<float>(query[(seq * num_heads + kv_head * group + g) * D + d]) * scale;
      const int64_t t_begin = first + p * part, t_end = part ? std::min(len, t_begin + part) : len;
      const bool whole = parts == 1;
      float* acc_out = whole ? acc.data() : part_acc.data() + item * group * Dp;
      float* m_out = whole ? m.data() : part_m.data() + item * group;
      float* l_out = whole ? l.data() : part_l.data() + item * group;
      attend_part(c, opt, q.data(), group, seq, kv_head, t_begin, t_end, m_out, l_out, acc_out, scores,
                  tile.data());
      if (!whole) continue;
      for (int64_t g = 0; g < group; ++g) {
        const float norm = opt.norm(kv_head * group + g, m[g], l[g]);
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(acc[g * Dp + d] * norm);
      }
    }
  });
  if (max_parts == 1) return;
  // The merge, on this thread: parts exist only when (sequence, kv head) pairs are few, so it is a few rows of
  // work, not worth a second parallel region. NOTE: `python -m kvforge.benchmarks.paged_decode_cpu --seqs 1` (Zen 4
  // EPYC, 2 threads, builds in turns) measured no difference beyond noise: 0.99 / 0.92 ms with the parallel merge,
  // 0.92 / 1.04 ms without.
  std::vector<float> sum(D);
  for (int64_t pair = 0; pair < num_seqs * kvh; ++pair) {
    const int64_t seq = pair / kvh, kv_head = pair % kvh, len = seq_lens[seq];
    const int64_t parts = len > 0 ? (len - first_key(seq) + part - 1) / part : 0;
    if (parts <= 1) continue;  // written by its item
    T* o = out + (seq * num_heads + kv_head * group) * D;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = kv_head * group + g;
      float top = opt.sinks ? opt.sinks[head] : -INFINITY;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_m[(pair * max_parts + p) * group + g]);
      float denom = opt.sinks ? std::exp(opt.sinks[head] - top) : 0.f;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at = (pair * max_parts + p) * group + g;
        const float w = std::exp(part_m[at] - top);
        denom += w * part_l[at];
        axpy(w, part_acc.data() + at * Dp, sum.data(), D);
      }
      for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(sum[d] / denom);
    }
  }
}

}  // namespace

// query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (0: a padding row, output zeros).
// All contiguous, on the CPU. key_scale, value_scale: None for caches in the query dtype, or
// [num_blocks, block_size, num_kv_heads] float32 for int8 / float8_e4m3fn codes. Returns [num_seqs, num_heads,
// head_dim] in the query dtype.
// sliding_window, softcap, sinks ([num_heads] float32): see Options (0, 0, None: plain causal attention).
at::Tensor kvforge_cpu::paged_decode(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                           at::Tensor block_tables, at::Tensor seq_lens, double scale,
                           std::optional<at::Tensor> key_scale, std::optional<at::Tensor> value_scale,
                           int64_t sliding_window, double softcap, std::optional<at::Tensor> sinks) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode takes contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens are int32");
  const Options options = make_options(query, sliding_window, softcap, sinks, "paged_decode");
  auto out = at::empty_like(query);
  dispatch_paged(query, key_cache, value_cache, block_tables, key_scale, value_scale, "paged_decode",
                 [&](auto t, const auto& cache) {
    using T = decltype(t);
    decode_kernel(out.data_ptr<T>(), query.data_ptr<T>(), cache, options, seq_lens.data_ptr<int32_t>(),
                  query.size(0), query.size(1), static_cast<float>(scale));
  });
  return out;
}

// Row copy into the paged cache: rows [num_tokens, *row_shape] (contiguous, the cache's dtype) go to the slots of
// slot_mapping [num_tokens] (int64; negative: a padding token, skipped); cache [num_blocks, block_size, *row_shape]
// with contiguous rows, its two leading dims strided as they may be (e.g. the K half of a joint K/V tensor).
//   slot s -> cache[s / block_size, s % block_size]
void kvforge_cpu::cache_write(at::Tensor rows, at::Tensor cache, at::Tensor slot_mapping) {
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

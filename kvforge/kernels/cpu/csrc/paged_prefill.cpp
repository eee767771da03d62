// Paged prefill attention for the CPU: the query tokens of every sequence that has more than one (a prompt, a
// chunk of one, a prompt after cached blocks), causal, over keys and values in the paged cache, softmax in fp32.
// Sequences with one query token (decodes) are left to paged_decode.cpp.
//
// Query token i of a sequence with L tokens of context, Q of them queries, sits at position L - Q + i and sees
// keys 0 .. L - Q + i. First each (sequence, kv head)'s keys are staged once in transposed tiles of 16 tokens
// ([Dp, 16], scales folded in), shared by all its query tiles; values too when the cache holds codes. Then work item
// = (sequence, kv head, tile of query tokens): its R rows are the tile's tokens times the `group` query heads that
// share the kv head (row r: token r / group, head r % group), at most kTileRows. The item walks the key tiles up to
// its last token's position, flash-style:
//
//   S [R, 16] = Q kt: per row, 16 scores in one vector, a broadcast multiply-add per d
//   per row, over the keys it may see: m' = max(m, max_j s_j)   c = exp(m - m')   p_j = exp(s_j - m')
//                                      l = c l + sum_j p_j      acc = c acc + sum_j p_j v_j
//
// acc += P V keeps a block of rows x column chunks in registers while the tile's value rows stream past (the decode
// kernel's blocking). With a sliding window (Options) an item starts at the key tile of the first key its first
// token sees, and the keys before each sequence's first seen one are never staged (their blocks may be gone); a soft
// cap bends the scores, and the sinks join the denominator at the end. Items differ in cost (a tile late in a long prompt sees more keys): they are handed out
// costliest first to whichever thread is free.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "ops.h"
#include "paged_cache.h"

namespace {

using namespace kvforge_cpu::paged;

// Rows per work item: enough that a key tile serves many rows, few enough that the item's queries and accumulators
// (2 x R x Dp floats) stay in L1 for head dims up to 64.
constexpr int64_t kTileRows = 48;
// A row's running max m is raised only when a tile's max passes it by more than this (in log units): the weights
// exp(s - m) then stay below e^8 and the softmax is the same, but most tiles skip rescaling the row's accumulator.
constexpr float kMaxSlack = 8.f;

struct Item {
  int64_t seq, kv_head, first_token, tokens, keys;  // keys: how many the item's last token sees (its cost)
  int64_t first_key;  // the first key its first token sees
};

// Where the items read their keys and values: per (sequence, kv head), keys in transposed tiles [tiles, Dp, 16]
// with their scales folded in, built once for all the sequence's query tiles; values as float rows [tiles * 16, Dp]
// (scales folded in) unless the cache is read in place (float, D == Dp, blocks of whole tiles).
template <typename C>
struct Staged {
  const Paged<C>& c;
  int64_t Dp;
  bool values_in_place;
  std::vector<int64_t> first_tile;  // per (sequence, kv head): its first tile in the buffers; -1 without queries
  std::vector<int64_t> first_key;  // per sequence: the first key any of its queries sees (earlier ones stay zero)
  std::vector<float> keys, values;

  const float* key_tile(int64_t seq, int64_t kv_head, int64_t tile) const {
    return keys.data() + (first_tile[seq * c.num_kv_heads + kv_head] + tile) * Dp * kLanes;
  }
  // Value row t0 of (seq, kv_head) and the distance between rows.
  const float* value_rows(int64_t seq, int64_t kv_head, int64_t t0, int64_t& stride) const {
    if (values_in_place) {
      const int64_t bs = c.block_size, slot = static_cast<int64_t>(c.block_tables[seq * c.max_blocks + t0 / bs]) * bs;
      stride = c.token_stride();
      return reinterpret_cast<const float*>(c.value_cache) + (slot + t0 % bs) * stride + kv_head * c.head_dim;
    }
    stride = Dp;
    return values.data() + (first_tile[seq * c.num_kv_heads + kv_head] * kLanes + t0) * Dp;
  }
};

// Tile `tile` of (seq, kv_head) into the staged buffers; row: head_dim floats of scratch.
template <typename C>
void stage_tile(Staged<C>& st, int64_t seq, int64_t kv_head, int64_t tile, int64_t len, float* row) {
  const Paged<C>& c = st.c;
  const int64_t D = c.head_dim, Dp = st.Dp, bs = c.block_size, kvh = c.num_kv_heads, t0 = tile * kLanes;
  const int64_t n = std::min(kLanes, len - t0), at = st.first_tile[seq * kvh + kv_head] + tile;
  float* kt = st.keys.data() + at * Dp * kLanes;
  float* v = st.values_in_place ? nullptr : st.values.data() + at * kLanes * Dp;
  std::fill(kt, kt + Dp * kLanes, 0.f);
  if (v != nullptr) std::fill(v, v + kLanes * Dp, 0.f);
  for (int64_t j = std::max<int64_t>(0, st.first_key[seq] - t0); j < n; ++j) {
    const int64_t t = t0 + j, slot = static_cast<int64_t>(c.block_tables[seq * c.max_blocks + t / bs]) * bs + t % bs;
    const int64_t at_row = slot * c.token_stride() + kv_head * D;
    widen_row(c.key_cache + at_row, row, D);
    const float k_scale = c.key_scale ? c.key_scale[slot * kvh + kv_head] : 1.f;
    for (int64_t d = 0; d < D; ++d) kt[d * kLanes + j] = row[d] * k_scale;
    if (v == nullptr) continue;
    widen_row(c.value_cache + at_row, v + j * Dp, D);
    const float v_scale = c.value_scale ? c.value_scale[slot * kvh + kv_head] : 1.f;
    for (int64_t d = 0; d < D; ++d) v[j * Dp + d] *= v_scale;
  }
}

// S rows [r0, r0 + RB) against one transposed key tile: s[rb] = sum_d q[r0 + rb][d] kt[d].
template <int RB>
inline void tile_scores(const float* q, const float* kt, int64_t Dp, int64_t r0, float* s) {
  Vec::V acc[RB] = {};
  const float* rows[RB];
  for (int rb = 0; rb < RB; ++rb) rows[rb] = q + (r0 + rb) * Dp;
  for (int64_t d = 0; d < Dp; ++d) {
    const Vec::V k = Vec::load(kt + d * kLanes);
    for (int rb = 0; rb < RB; ++rb) acc[rb] += rows[rb][d] * k;
  }
  for (int rb = 0; rb < RB; ++rb) Vec::store(s + (r0 + rb) * kLanes, acc[rb]);
}

template <typename T, typename C>
void attend_item(const Staged<C>& st, const Options& opt, const Item& item, const T* query, T* out, int64_t num_heads,
                 int64_t pos0, float scale, float* q, float* acc, float* m, float* l, float* s) {
  const Paged<C>& c = st.c;
  const int64_t group = num_heads / c.num_kv_heads, D = c.head_dim, Dp = st.Dp, chunks = Dp / kLanes;
  const int64_t R = item.tokens * group;
  for (int64_t r = 0; r < R; ++r) {
    const T* src = query + ((item.first_token + r / group) * num_heads + item.kv_head * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) q[r * Dp + d] = static_cast<float>(src[d]) * scale;
    std::fill(q + r * Dp + D, q + (r + 1) * Dp, 0.f);
  }
  std::fill(acc, acc + R * Dp, 0.f);
  std::fill(m, m + R, -INFINITY);
  std::fill(l, l + R, 0.f);
  for (int64_t t0 = item.first_key / kLanes * kLanes; t0 < item.keys; t0 += kLanes) {
    const int64_t n = std::min(kLanes, item.keys - t0);
    const float* kt = st.key_tile(item.seq, item.kv_head, t0 / kLanes);
    for (int64_t r0 = 0; r0 < R; r0 += 4)
      with_block<4>(R - r0, [&](auto rows) { tile_scores<decltype(rows)::value>(q, kt, Dp, r0, s); });
    // The softmax update; s becomes the weights p_j (0 for keys a row may not see).
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * kLanes;
      const int64_t pos = pos0 + item.first_token + r / group;
      const int64_t seen = std::min(n, pos - t0 + 1), from = std::max<int64_t>(0, opt.first_key(pos) - t0);
      if (seen <= from) {  // the tile is past this row's position, or before its window
        std::fill(sr, sr + kLanes, 0.f);
        continue;
      }
      if (opt.softcap > 0.f)
        for (int64_t j = from; j < seen; ++j) sr[j] = opt.cap(sr[j]);
      float top = -INFINITY;
      for (int64_t j = from; j < seen; ++j) top = std::max(top, sr[j]);
      if (top > m[r] + kMaxSlack) {  // a new running max: the row's sums so far shrink by exp(m - top)
        const float carry = kvforge_cpu::exp_clamped(m[r] - top);  // ~0 while m is -inf
        l[r] *= carry;
        for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] *= carry;
        m[r] = top;
      }
      const float base = m[r];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kLanes; ++j) {
        const float p = j >= from && j < seen ? kvforge_cpu::exp_clamped(sr[j] - base) : 0.f;
        sum += p;
        sr[j] = p;
      }
      l[r] += sum;
    }
    int64_t v_stride;
    const float* v_rows = st.value_rows(item.seq, item.kv_head, t0, v_stride);
    for (int64_t r0 = 0; r0 < R; r0 += kHeadBlock) {
      with_block<kHeadBlock>(R - r0, [&](auto rows) {
        constexpr int RB = decltype(rows)::value;
        for (int64_t c0 = 0; c0 < chunks; c0 += kChunkBlock) {
          with_block<kChunkBlock>(chunks - c0, [&](auto chunk_block) {
            constexpr int CB = decltype(chunk_block)::value;
            Vec::V a[RB][CB];
            for (int rb = 0; rb < RB; ++rb)
              for (int ch = 0; ch < CB; ++ch) a[rb][ch] = Vec::load(acc + (r0 + rb) * Dp + (c0 + ch) * kLanes);
            for (int64_t j = 0; j < n; ++j)
              for (int ch = 0; ch < CB; ++ch) {
                const Vec::V v = Vec::load(v_rows + j * v_stride + (c0 + ch) * kLanes);
                for (int rb = 0; rb < RB; ++rb) a[rb][ch] += s[(r0 + rb) * kLanes + j] * v;
              }
            for (int rb = 0; rb < RB; ++rb)
              for (int ch = 0; ch < CB; ++ch) Vec::store(acc + (r0 + rb) * Dp + (c0 + ch) * kLanes, a[rb][ch]);
          });
        }
      });
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t head = item.kv_head * group + r % group;
    T* dst = out + ((item.first_token + r / group) * num_heads + head) * D;
    const float norm = opt.norm(head, m[r], l[r]);
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * Dp + d] * norm);
  }
}

template <typename T, typename C>
void prefill_kernel(T* out, const T* query, const Paged<C>& c, const Options& opt, const int32_t* query_start_loc,
                    const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads, float scale) {
  const int64_t kvh = c.num_kv_heads, group = num_heads / kvh;
  const int64_t Dp = (c.head_dim + kLanes - 1) / kLanes * kLanes;
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group), rows = tile_tokens * group;
  // NOTE: values are read in place only without a window, where no row before a query's window may hold NaN
  Staged<C> st{c, Dp, std::is_same_v<C, float> && c.head_dim == Dp && c.block_size % kLanes == 0 && opt.window == 0,
               std::vector<int64_t>(num_seqs * kvh, -1), std::vector<int64_t>(num_seqs, 0), {}, {}};
  std::vector<Item> items;
  std::vector<std::array<int64_t, 3>> tiles;  // (sequence, kv head, tile) to stage
  std::vector<int64_t> pos0(num_seqs);
  int64_t staged = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t first = query_start_loc[seq], q_len = query_start_loc[seq + 1] - first, len = seq_lens[seq];
    pos0[seq] = len - q_len - first;  // token index t of the flat query is at position pos0 + t
    if (q_len <= 1) continue;
    const int64_t seq_tiles = (len + kLanes - 1) / kLanes;
    st.first_key[seq] = opt.first_key(len - q_len);
    for (int64_t h = 0; h < kvh; ++h) {
      st.first_tile[seq * kvh + h] = staged;
      staged += seq_tiles;
      for (int64_t tile = st.first_key[seq] / kLanes; tile < seq_tiles; ++tile) tiles.push_back({seq, h, tile});
      for (int64_t t = 0; t < q_len; t += tile_tokens) {
        const int64_t tokens = std::min(tile_tokens, q_len - t);
        items.push_back({seq, h, first + t, tokens, len - q_len + t + tokens, opt.first_key(len - q_len + t)});
      }
    }
  }
  st.keys.resize(staged * Dp * kLanes);
  if (!st.values_in_place) st.values.resize(staged * kLanes * Dp);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(c.head_dim);
    for (int64_t i = begin; i < end; ++i)
      stage_tile(st, tiles[i][0], tiles[i][1], tiles[i][2], seq_lens[tiles[i][0]], row.data());
  });
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> q(rows * Dp), acc(rows * Dp), m(rows), l(rows), s(rows * kLanes);
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++)
      attend_item(st, opt, items[i], query, out, num_heads, pos0[items[i].seq], scale, q.data(), acc.data(),
                  m.data(), l.data(), s.data());
  });
}

}  // namespace

// query: [num_tokens, num_heads, head_dim], the tokens of each sequence consecutive: sequence s has tokens
// [query_start_loc[s], query_start_loc[s + 1]) and seq_lens[s] tokens of context, the queries its last ones. Caches,
// block tables and scales as paged_decode takes them. Returns [num_tokens, num_heads, head_dim] in the query dtype:
// the rows of sequences with more than one query token; those of the others are left unwritten.
at::Tensor kvforge_cpu::paged_prefill(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_tables, at::Tensor query_start_loc, at::Tensor seq_lens,
                            double scale, std::optional<at::Tensor> key_scale,
                            std::optional<at::Tensor> value_scale, int64_t sliding_window, double softcap,
                            std::optional<at::Tensor> sinks) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_tables.is_contiguous() && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "paged_prefill takes contiguous tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "paged_prefill: block_tables, query_start_loc and seq_lens are int32");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1, "paged_prefill: query_start_loc has num_seqs + 1 entries");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s] && starts[s + 1] <= query.size(0) &&
                    (lens[s] + key_cache.size(1) - 1) / key_cache.size(1) <= block_tables.size(1),
                "paged_prefill: sequence ", s, " has ", q_len, " query tokens and ", lens[s],
                " of context, which its queries and block table do not hold");
  }
  const Options options = make_options(query, sliding_window, softcap, sinks, "paged_prefill");
  auto out = at::empty_like(query);
  dispatch_paged(query, key_cache, value_cache, block_tables, key_scale, value_scale, "paged_prefill",
                 [&](auto t, const auto& cache) {
    using T = decltype(t);
    prefill_kernel(out.data_ptr<T>(), query.data_ptr<T>(), cache, options, starts, lens, num_seqs, query.size(1),
                   static_cast<float>(scale));
  });
  return out;
}

// Attention within each sequence of a packed batch and no KV cache (the pooling runner's steps: BERT encoders, and
// decoders run as embedders): the tokens of S sequences lie one after another, sequence s at rows
// query_start_loc[s] .. query_start_loc[s + 1] of q, k and v [T, H, D] (rows strided: views of one qkv projection's
// output are read in place), and each of its queries sees all of its keys (causal: those up to its own). No padding
// to the longest sequence and no mask: softmax in fp32, one parallel region per call.
//
// Work item = (sequence, kv head), handed out costliest first (L^2) to whichever thread is free. An item stages its
// keys once as transposed tiles of 16 tokens kt [tiles, Dp, 16] and its values as rows v [L, Dp] (zero-padded to
// Dp, head_dim rounded up to 16), then takes its query rows (the `group` query heads of each token that share the kv
// head) in blocks of up to 4:
//
//   s [rows, Lp] = (scale q) kt      16 scores in one vector, a broadcast multiply-add per d
//   p = exp(s - max s) over the keys a row sees (0 past them);  out = (p v) / sum p
//
// p v keeps a block of rows x column chunks in registers while the value rows stream past (paged_prefill.cpp's
// blocking).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fast_exp.h"
#include "ops.h"
#include "paged_cache.h"

namespace {

using namespace kvforge_cpu::paged;

constexpr int kRowBlock = 4;  // query rows scored at once against each key tile

struct Rows {  // one of q, k, v: [T, heads, D] with unit-stride heads of D values and any row stride
  const void* data;
  int64_t row_stride;
};

struct Scratch {
  std::vector<float> kt, v, s, q;
  Scratch(int64_t Lp, int64_t Dp) : kt(Lp * Dp), v(Lp * Dp), s(kRowBlock * Lp), q(kRowBlock * Dp) {}
};

template <typename T>
inline const T* row_of(const Rows& r, int64_t token, int64_t head, int64_t D) {
  return static_cast<const T*>(r.data) + token * r.row_stride + head * D;
}

// Keys as transposed tiles kt[tile][d][16] and values as rows v[j][Dp], zero past the sequence and past D.
template <typename T>
void stage(const Rows& k, const Rows& v, int64_t first, int64_t L, int64_t kv_head, int64_t D, int64_t Dp,
           Scratch& sc) {
  const int64_t Lp = (L + kLanes - 1) / kLanes * kLanes;
  std::fill(sc.kt.begin(), sc.kt.begin() + Lp * Dp, 0.f);
  std::fill(sc.v.begin(), sc.v.begin() + Lp * Dp, 0.f);
  float* row = sc.q.data();  // scratch of D floats (q is staged later)
  for (int64_t j = 0; j < L; ++j) {
    widen_row(row_of<T>(k, first + j, kv_head, D), row, D);
    float* tile = sc.kt.data() + (j / kLanes) * Dp * kLanes + j % kLanes;
    for (int64_t d = 0; d < D; ++d) tile[d * kLanes] = row[d];
    widen_row(row_of<T>(v, first + j, kv_head, D), sc.v.data() + j * Dp, D);
  }
}

// Rows r0 .. r0 + RB of the item's query rows (row r: token r / group, query head kv_head * group + r % group).
template <int RB, typename T>
void attend_rows(const Rows& q, T* out, int64_t first, int64_t L, int64_t r0, int64_t kv_head, int64_t group,
                 int64_t num_heads, int64_t D, int64_t Dp, float scale, bool causal, Scratch& sc) {
  const int64_t Lp = (L + kLanes - 1) / kLanes * kLanes, chunks = Dp / kLanes;
  float* qs = sc.q.data();
  int64_t seen[RB];
  for (int rb = 0; rb < RB; ++rb) {
    const int64_t r = r0 + rb, token = r / group;
    widen_row(row_of<T>(q, first + token, kv_head * group + r % group, D), qs + rb * Dp, D);
    for (int64_t d = 0; d < D; ++d) qs[rb * Dp + d] *= scale;
    std::fill(qs + rb * Dp + D, qs + (rb + 1) * Dp, 0.f);
    seen[rb] = causal ? token + 1 : L;
  }
  for (int64_t t0 = 0; t0 < Lp; t0 += kLanes) {
    const float* kt = sc.kt.data() + t0 * Dp;
    Vec::V acc[RB] = {};
    for (int64_t d = 0; d < Dp; ++d) {
      const Vec::V kd = Vec::load(kt + d * kLanes);
      for (int rb = 0; rb < RB; ++rb) acc[rb] += qs[rb * Dp + d] * kd;
    }
    for (int rb = 0; rb < RB; ++rb) Vec::store(sc.s.data() + rb * Lp + t0, acc[rb]);
  }
  float inv_sum[RB];
  for (int rb = 0; rb < RB; ++rb) {
    float* sr = sc.s.data() + rb * Lp;
    float top = -INFINITY;
    for (int64_t j = 0; j < seen[rb]; ++j) top = std::max(top, sr[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < Lp; ++j) {
      const float p = j < seen[rb] ? kvforge_cpu::exp_clamped(sr[j] - top) : 0.f;
      sum += p;
      sr[j] = p;
    }
    inv_sum[rb] = 1.f / sum;
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += kChunkBlock) {
    with_block<kChunkBlock>(chunks - c0, [&](auto chunk_block) {
      constexpr int CB = decltype(chunk_block)::value;
      Vec::V a[RB][CB] = {};
      for (int64_t j = 0; j < L; ++j)
        for (int ch = 0; ch < CB; ++ch) {
          const Vec::V vj = Vec::load(sc.v.data() + j * Dp + (c0 + ch) * kLanes);
          for (int rb = 0; rb < RB; ++rb) a[rb][ch] += sc.s[rb * Lp + j] * vj;
        }
      for (int rb = 0; rb < RB; ++rb) {
        const int64_t r = r0 + rb;
        T* dst = out + ((first + r / group) * num_heads + kv_head * group + r % group) * D;
        float chunk[kLanes];
        for (int ch = 0; ch < CB; ++ch) {
          Vec::store(chunk, a[rb][ch] * inv_sum[rb]);
          const int64_t d0 = (c0 + ch) * kLanes, n = std::min<int64_t>(kLanes, D - d0);
          for (int64_t d = 0; d < n; ++d) dst[d0 + d] = static_cast<T>(chunk[d]);
        }
      }
    });
  }
}

template <typename T>
void varlen_kernel(const Rows& q, const Rows& k, const Rows& v, T* out, const int64_t* starts, int64_t num_seqs,
                   int64_t num_heads, int64_t num_kv_heads, int64_t D, float scale, bool causal) {
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes, group = num_heads / num_kv_heads;
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, kv head)
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    longest = std::max(longest, starts[s + 1] - starts[s]);
    if (starts[s + 1] > starts[s])
      for (int64_t h = 0; h < num_kv_heads; ++h) items.emplace_back(s, h);
  }
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
    return starts[a.first + 1] - starts[a.first] > starts[b.first + 1] - starts[b.first];
  });
  const int64_t Lp = (longest + kLanes - 1) / kLanes * kLanes;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch sc(Lp, Dp);
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
      const auto [s, h] = items[i];
      const int64_t first = starts[s], L = starts[s + 1] - first, rows = L * group;
      stage<T>(k, v, first, L, h, D, Dp, sc);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock)
        with_block<kRowBlock>(rows - r0, [&](auto block) {
          attend_rows<decltype(block)::value>(q, out, first, L, r0, h, group, num_heads, D, Dp, scale, causal, sc);
        });
    }
  });
}

Rows rows_of(const at::Tensor& t, const at::Tensor& query, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == query.size(0) && t.size(2) == query.size(2) &&
                  t.scalar_type() == query.scalar_type() && t.stride(2) == 1 && t.stride(1) == t.size(2),
              "varlen_attention: ", name, " must be [num_tokens, heads, head_dim] in the query's dtype, each row's "
              "heads side by side");
  return {t.data_ptr(), t.stride(0)};
}

}  // namespace

// query [T, H, D], key and value [T, Hkv, D] (row strides free, each row's heads contiguous), query_start_loc
// [S + 1] int64: sequence s is rows query_start_loc[s] .. query_start_loc[s + 1]. Returns [T, H, D] contiguous in
// the query dtype: each query attended over its sequence's keys (causal: those up to it).
at::Tensor kvforge_cpu::varlen_attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor query_start_loc,
                            double scale, bool causal) {
  const Rows q = rows_of(query, query, "query"), k = rows_of(key, query, "key"), v = rows_of(value, query, "value");
  TORCH_CHECK(key.sizes() == value.sizes() && query.size(1) % key.size(1) == 0,
              "varlen_attention: key and value have the same shape, and query heads a multiple of theirs");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kLong && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) >= 1,
              "varlen_attention: query_start_loc is a contiguous int64 [num_seqs + 1]");
  const int64_t num_seqs = query_start_loc.size(0) - 1;
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == query.size(0),
              "varlen_attention: query_start_loc runs from 0 to the number of tokens");
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(starts[s + 1] >= starts[s], "varlen_attention: query_start_loc must not decrease");
  auto out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "varlen_attention", [&] {
    varlen_kernel<scalar_t>(q, k, v, out.data_ptr<scalar_t>(), starts, num_seqs, query.size(1), key.size(1),
                            query.size(2), static_cast<float>(scale), causal);
  });
  return out;
}

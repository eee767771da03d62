// The paged KV cache as the CPU attention kernels read it (paged_decode.cpp, paged_prefill.cpp): its geometry, rows
// widened to floats, tiles of up to 16 tokens within a block, and the 16-float vector the kernels compute with.
//
// Cache: [num_blocks, block_size, num_kv_heads, head_dim] in the query dtype, in float16 / bfloat16 under float32
// queries (the CPU's default cache: half the bytes a decode step reads), or int8 / fp8 (e4m3) codes with one float
// scale per (slot, kv head); a sequence's token t is in slot block_tables[seq][t / block_size] * block_size +
// t % block_size.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "vec.h"

namespace kvforge_cpu::paged {

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

using Vec = kvforge_cpu::Lanes16;  // the kernels' vector (vec.h), for those that use this namespace
constexpr int64_t kLanes = Vec::kWidth;

// One cached row (a token's key or value for one kv head) as floats.
template <typename C>
inline void widen_row(const C* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    const float* table = fp8_e4m3_table();
    const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
    for (int64_t d = 0; d < n; ++d) dst[d] = table[bits[d]];
  } else if constexpr (std::is_same_v<C, c10::Half>) {
    int64_t d = 0;
#if defined(__AVX512F__)
    using F = Avx512;
#elif defined(__AVX2__) && defined(__F16C__)
    using F = Avx2;
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
    for (; d + F::kWidth <= n; d += F::kWidth)
      F::store(dst + d, F::template load_half<false>(reinterpret_cast<const uint16_t*>(src + d)));
#endif
    for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  } else if constexpr (std::is_same_v<C, c10::BFloat16>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;  // bfloat16: float's high half
  } else {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

// A layer's attention options (kernels/paged_attention.py): the query at position p sees keys first_key(p) .. p
// (a sliding window of `window` keys; 0: every earlier key), scores s become softcap * tanh(s / softcap) (0: kept),
// and each query head's sink logit (null: none) joins the softmax's denominator.
struct Options {
  int64_t window;
  float softcap;
  const float* sinks;

  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  float cap(float s) const { return softcap > 0.f ? softcap * std::tanh(s / softcap) : s; }
  // The factor of a row's accumulator that gives its output, for a row of running max m and sum l of exp(s - m):
  //   1 / l, or with a sink z: exp(m - M) / (l exp(m - M) + exp(z - M)), M = max(m, z)
  float norm(int64_t head, float m, float l) const {
    if (sinks == nullptr) return 1.f / l;
    const float top = std::max(m, sinks[head]), carry = std::exp(m - top);
    return carry / (l * carry + std::exp(sinks[head] - top));
  }
};

// The checked Options of an op's arguments (sinks: [num_heads] float32, contiguous).
inline Options make_options(const at::Tensor& query, int64_t window, double softcap,
                            const c10::optional<at::Tensor>& sinks, const char* name) {
  TORCH_CHECK(window >= 0 && softcap >= 0, name, ": sliding_window and softcap are >= 0 (0: none)");
  if (sinks.has_value())
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == query.size(1),
                name, ": sinks are [num_heads] contiguous float32");
  return Options{window, static_cast<float>(softcap), sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
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

// Rows [slot, slot + n) of one kv head in cache (keys or values) as floats: row i is at returned[i * stride], Dp
// floats. The cache itself when it holds floats and D == Dp; else `tile` [n, Dp], into which they are widened (columns
// D.. stay as the caller zeroed them).
template <typename C>
inline const float* rows_as_floats(const Paged<C>& c, const C* cache, int64_t slot, int64_t kv_head, int64_t n, int64_t Dp,
                              float* tile, int64_t& stride) {
  const int64_t D = c.head_dim, token_stride = c.token_stride();
  const C* rows = cache + slot * token_stride + kv_head * D;
  if constexpr (std::is_same_v<C, float>) {
    if (D == Dp) {
      stride = token_stride;
      return rows;
    }
  }
  for (int64_t i = 0; i < n; ++i) widen_row(rows + i * token_stride, tile + i * Dp, D);
  stride = Dp;
  return tile;
}

// visit(t0, n, rows, stride, slot0) for tokens [t_begin, t_end) of one kv head's rows in cache (keys or values), in
// tiles of up to kLanes tokens within a block, through the sequence's block table; the next block's rows are
// prefetched while this one's are used. Token t0 + i is rows[i * stride, + Dp) as floats: the cache itself when it
// holds floats and D == Dp, else `tile` [kLanes, Dp], into which the rows were widened (columns D.. stay as the
// caller zeroed them). A tile never crosses a block, so token t0 + i has slot slot0 + i (t_begin may fall mid-block,
// where a sliding window starts).
template <typename C, class Visit>
inline void walk_tiles(const Paged<C>& c, const C* cache, const int32_t* table, int64_t kv_head, int64_t Dp,
                       int64_t t_begin, int64_t t_end, float* tile, Visit visit) {
  const int64_t bs = c.block_size, stride = c.token_stride(), D = c.head_dim;
  for (int64_t b0 = t_begin, b1; b0 < t_end; b0 = b1) {
    const int64_t block = b0 / bs, slot0 = static_cast<int64_t>(table[block]) * bs;
    b1 = std::min((block + 1) * bs, t_end);
    if (b1 < t_end)
      prefetch_rows<kToL2>(cache + static_cast<int64_t>(table[block + 1]) * bs * stride + kv_head * D,
                           std::min(bs, t_end - b1), stride * static_cast<int64_t>(sizeof(C)), D * sizeof(C));
    for (int64_t t0 = b0; t0 < b1; t0 += kLanes) {
      const int64_t n = std::min(kLanes, b1 - t0), slot = slot0 + t0 - block * bs;
      int64_t tile_stride;
      const float* rows = rows_as_floats(c, cache, slot, kv_head, n, Dp, tile, tile_stride);
      if (n == kLanes)  // a full tile: its loops have a fixed trip count, unrolled with their vectors in registers
        visit(t0, std::integral_constant<int64_t, kLanes>{}, rows, tile_stride, slot);
      else
        visit(t0, n, rows, tile_stride, slot);
    }
  }
}

// Register blocking of the tile loops: kHeadBlock query heads x kChunkBlock 16-float column chunks of accumulators
// stay in registers while a tile's rows stream past, so each row chunk is loaded once for the block's heads.
#ifdef __AVX512F__
constexpr int kHeadBlock = 4, kChunkBlock = 4;  // 16 vectors of accumulators in 32 zmm registers
#else
constexpr int kHeadBlock = 2, kChunkBlock = 2;  // 4 vectors (8 of 16 ymm registers)
#endif

// f(std::integral_constant<int, min(n, Max)>{}) for n >= 1: a loop's block size as a compile-time constant.
template <int Max, class F>
inline void with_block(int64_t n, F f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_block<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>{});
}

// f(T{}, cache) with the query dtype T and the cache as Paged<C>, C its element type: T itself, float16 / bfloat16
// values under other queries, or int8 / fp8 codes when key_scale and value_scale are given (float32, one per slot
// and kv head; both or neither).
template <class F>
void dispatch_paged(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& block_tables, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& value_scale, const char* name, F f) {
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), name, ": key_scale and value_scale go together");
  const float* k_scale = key_scale.has_value() ? key_scale->data_ptr<float>() : nullptr;
  const float* v_scale = value_scale.has_value() ? value_scale->data_ptr<float>() : nullptr;
  auto call = [&](auto t, auto c) {
    using C = decltype(c);
    f(t, Paged<C>{key_cache.data_ptr<C>(), value_cache.data_ptr<C>(), k_scale, v_scale,
                  block_tables.data_ptr<int32_t>(), key_cache.size(2), key_cache.size(3), key_cache.size(1),
                  block_tables.size(1)});
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    if (k_scale == nullptr && key_cache.scalar_type() == query.scalar_type()) {
      call(scalar_t{}, scalar_t{});
    } else if (k_scale == nullptr && key_cache.scalar_type() == at::kHalf) {
      call(scalar_t{}, c10::Half{});
    } else if (k_scale == nullptr && key_cache.scalar_type() == at::kBFloat16) {
      call(scalar_t{}, c10::BFloat16{});
    } else if (k_scale == nullptr) {
      TORCH_CHECK(false, name, ": a cache of ", key_cache.scalar_type(), " values under ", query.scalar_type(),
                  " queries; value caches hold the query dtype, float16 or bfloat16");
    } else if (key_cache.scalar_type() == at::kChar) {
      call(scalar_t{}, int8_t{});
    } else if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {
      call(scalar_t{}, c10::Float8_e4m3fn{});
    } else {
      TORCH_CHECK(false, name, ": quantized caches hold int8 or float8_e4m3fn codes, got ", key_cache.scalar_type());
    }
  });
}

}  // namespace kvforge_cpu::paged

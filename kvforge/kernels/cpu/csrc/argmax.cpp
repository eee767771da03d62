// Greedy token ids: the index of the first maximum of each row of float32 logits, as torch.max(dim=-1).indices
// (a NaN counts as the maximum: the first NaN wins). Its reference is kernels/cpu/argmax.py's argmax_rows_ref.
//
// Each of 16 lanes keeps its own best value and index over the columns c = lane (mod 16), replaced only by a
// strictly larger value (or by a NaN where it holds none), so each lane keeps its first maximum; the lanes then
// reduce to the largest value at the smallest index. Rows are split over the threads.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace kvforge_cpu {
namespace {

using Vec = Lanes16;
constexpr int64_t kLanes = Vec::kWidth;
constexpr int64_t kGrainElements = 65536;

// a takes b's place where b is larger, or where b is a NaN and a is not
inline Vec::I takes(Vec::V a, Vec::V b) { return (b > a) | ((b != b) & (a == a)); }

int64_t argmax_row(const float* row, int64_t n) {
  const Vec::I lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Vec::V best = {};
  Vec::I index = lanes;
  int64_t c = 0;
  if (n >= kLanes) {
    best = Vec::load(row);
    for (c = kLanes; c + kLanes <= n; c += kLanes) {
      const Vec::V v = Vec::load(row + c);
      const Vec::I take = takes(best, v);
      best = take ? v : best;
      index = take ? lanes + static_cast<int32_t>(c) : index;
    }
  }
  float top = c > 0 ? best[0] : row[0];
  int64_t at = c > 0 ? index[0] : 0;
  auto offer = [&](float v, int64_t i) {
    const bool larger = v > top || (std::isnan(v) && !std::isnan(top));
    const bool tie = (v == top || (std::isnan(v) && std::isnan(top))) && i < at;
    if (larger || tie) top = v, at = i;
  };
  if (c > 0)
    for (int lane = 1; lane < kLanes; ++lane) offer(best[lane], index[lane]);
  for (; c < n; ++c) offer(row[c], c);
  return at;
}

}  // namespace

// logits [rows, vocab] float32 -> [rows] int64
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() && logits.is_cpu(),
              "argmax_rows takes contiguous float32 [rows, vocab] CPU logits");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: rows of no elements have no maximum");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
  });
  return out;
}

}  // namespace kvforge_cpu

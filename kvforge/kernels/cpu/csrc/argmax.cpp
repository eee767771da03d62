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

#include "vec16.h"

namespace kvforge_cpu {
namespace {

typedef int32_t ivec16 __attribute__((vector_size(64)));  // a vec16's lanes' column indices
constexpr int64_t kGrainElements = 65536;

// a takes b's place where b is larger, or where b is a NaN and a is not
inline ivec16 takes(vec16 a, vec16 b) { return (b > a) | ((b != b) & (a == a)); }

int64_t argmax_row(const float* row, int64_t n) {
  const ivec16 lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vec16 best = {};
  ivec16 index = lanes;
  int64_t c = 0;
  if (n >= kLanes) {
    best = load16(row);
    for (c = kLanes; c + kLanes <= n; c += kLanes) {
      const vec16 v = load16(row + c);
      const ivec16 take = takes(best, v);
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

TORCH_LIBRARY_FRAGMENT(kvforge_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvforge_cpu, CPU, m) { m.impl("argmax_rows", &kvforge_cpu::argmax_rows); }

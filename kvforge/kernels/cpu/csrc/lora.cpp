// Batched LoRA on the CPU, in place: each row t of y gains its own adapter's update, y[t] += (x[t] A[s]^T) B[s]^T
// with s = slots[t] (-1: the base model, the row is left alone). The reference is kernels/lora.py (lora_fused_ref);
// kernels/lora.py's docstring has the shapes.
//
// The rows are grouped by slot (a counting sort), and each task multiplies up to kRows rows of one adapter: the
// shrink reads each row of A[s] once for the task's rows, the expand each row of B[s]^T once. Only the adapters of
// the step's rows are read, and a row of slot -1 costs nothing.
//
//   a      [S, W, K]     W = M * R: the shrink of every checkpoint matrix m of a merged layer (q/k/v, gate/up)
//   bt[m]  [S, R, N_m]   B^T of matrix m, rank-major, so the expand is a broadcast FMA along y's columns
//   y      [T, N]        the columns of matrix m start at N_0 + ... + N_{m-1}
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "vec.h"

namespace kvforge_cpu {
namespace {

using Vec = Lanes16;
constexpr int64_t kLanes = Vec::kWidth;
constexpr int64_t kRows = 4;  // rows of one adapter per task (4 accumulators: registers to spare on AVX2)

struct LoRATask {
  int64_t slot;
  int64_t first;  // index into the rows sorted by slot
  int64_t count;  // <= kRows
};

// h[i, w] = x[rows[i]] . a[w] for the task's rows (n of them) and every w < W
void shrink(const float* x, int64_t K, const float* a, int64_t W, const int64_t* rows, int64_t n, float* h) {
  const float* xr[kRows];
  for (int64_t i = 0; i < n; ++i) xr[i] = x + rows[i] * K;
  for (int64_t w = 0; w < W; ++w) {
    const float* aw = a + w * K;
    Vec::V acc[kRows] = {};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const Vec::V av = Vec::load(aw + k);
      for (int64_t i = 0; i < n; ++i) acc[i] += av * Vec::load(xr[i] + k);
    }
    for (int64_t i = 0; i < n; ++i) {
      float sum = Vec::sum(acc[i]);
      for (int64_t j = k; j < K; ++j) sum += aw[j] * xr[i][j];
      h[i * W + w] = sum;
    }
  }
}

// y[rows[i], cols] += sum_r h[i, r] * bt[r, cols] over the R ranks, for the N columns of one matrix
void expand(const float* h, int64_t W, const float* bt, int64_t R, int64_t N, float* y, int64_t stride_y,
            const int64_t* rows, int64_t n) {
  float* yr[kRows];
  for (int64_t i = 0; i < n; ++i) yr[i] = y + rows[i] * stride_y;
  int64_t c = 0;
  for (; c + kLanes <= N; c += kLanes) {
    Vec::V acc[kRows];
    for (int64_t i = 0; i < n; ++i) acc[i] = Vec::load(yr[i] + c);
    for (int64_t r = 0; r < R; ++r) {
      const Vec::V bv = Vec::load(bt + r * N + c);
      for (int64_t i = 0; i < n; ++i) acc[i] += h[i * W + r] * bv;
    }
    for (int64_t i = 0; i < n; ++i) Vec::store(yr[i] + c, acc[i]);
  }
  for (; c < N; ++c)
    for (int64_t i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < R; ++r) sum += h[i * W + r] * bt[r * N + c];
      yr[i][c] += sum;
    }
}

}  // namespace

// y [T, N] float32 (rows contiguous, updated in place), x [T, K], a [S, M * R, K], bt: M tensors [S, R, N_m]
// (sum N_m = N), slots [T] int64 (-1: none); all float32 contiguous except y's row stride.
void lora_apply(at::Tensor y, at::Tensor x, at::Tensor a, std::vector<at::Tensor> bt, at::Tensor slots) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "lora_apply: x, a and y must be float32");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1),
              "lora_apply: x [T, K] and a [S, W, K] contiguous");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1, "lora_apply: y [T, N] with unit columns");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == x.size(0) &&
                  slots.is_contiguous(),
              "lora_apply: slots [T] contiguous int64");
  const int64_t T = x.size(0), K = x.size(1), S = a.size(0), W = a.size(1), M = bt.size();
  TORCH_CHECK(M > 0 && W % M == 0, "lora_apply: a's ", W, " rows are not ", M, " matrices' ranks");
  const int64_t R = W / M;
  std::vector<int64_t> offsets(M + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(bt[m].scalar_type() == at::kFloat && bt[m].dim() == 3 && bt[m].is_contiguous() &&
                    bt[m].size(0) == S && bt[m].size(1) == R,
                "lora_apply: bt[", m, "] must be a contiguous float32 [", S, ", ", R, ", N]");
    offsets[m + 1] = offsets[m] + bt[m].size(2);
  }
  TORCH_CHECK(offsets[M] == y.size(1), "lora_apply: the matrices' ", offsets[M], " columns are not y's ", y.size(1));

  // the rows sorted by slot (counting sort), and tasks of up to kRows rows of one slot
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  std::vector<int64_t> starts(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot_of[t] < S, "lora_apply: slot ", slot_of[t], " beyond the ", S, " slots");
    if (slot_of[t] >= 0) ++starts[slot_of[t] + 1];
  }
  for (int64_t s = 0; s < S; ++s) starts[s + 1] += starts[s];
  std::vector<int64_t> sorted(starts[S]), next(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    if (slot_of[t] >= 0) sorted[next[slot_of[t]]++] = t;
  std::vector<LoRATask> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t first = starts[s]; first < starts[s + 1]; first += kRows)
      tasks.push_back({s, first, std::min(kRows, starts[s + 1] - first)});
  if (tasks.empty()) return;

  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t stride_y = y.stride(0);
  std::vector<const float*> btp(M);
  for (int64_t m = 0; m < M; ++m) btp[m] = bt[m].data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kRows * W);
    for (int64_t i = begin; i < end; ++i) {
      const LoRATask& task = tasks[i];
      const int64_t* rows = sorted.data() + task.first;
      shrink(xp, K, ap + task.slot * W * K, W, rows, task.count, h.data());
      for (int64_t m = 0; m < M; ++m) {
        const int64_t N = offsets[m + 1] - offsets[m];
        expand(h.data() + m * R, W, btp[m] + task.slot * R * N, R, N, yp + offsets[m], stride_y, rows, task.count);
      }
    }
  });
}

}  // namespace kvforge_cpu

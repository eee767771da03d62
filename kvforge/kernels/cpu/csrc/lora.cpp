// Batched LoRA on the CPU, in place: each row t of y gains its own adapter's update, y[t] += (x[t] A[s]^T) B[s]^T
// with s = slots[t] (-1: the base model, the row is left alone). The reference is kernels/lora.py (lora_fused_ref);
// kernels/lora.py's docstring has the shapes.
//
// The rows are grouped by slot (a counting sort), and each task multiplies up to kRows rows of one adapter: the
// shrink reads each row of A[s]^T once for the task's rows, the expand each row of B[s]^T once. Only the adapters of
// the step's rows are read, and a row of slot -1 costs nothing. Both products run along the contiguous axis of
// their weight (W for the shrink, N for the expand): a broadcast FMA per weight vector, no sums across lanes.
//
//   a      [S, K, W]     A^T of every checkpoint matrix m of a merged layer (q/k/v, gate/up), K-major: its columns
//                        m * R ...; W = M * R rounded up to whole 16-float vectors (the columns past M * R zero)
//   bt[m]  [S, R, N_m]   B^T of matrix m, rank-major
//   y      [T, N]        the columns of matrix m start at N_0 + ... + N_{m-1}
//
// The weights (a and every bt[m]) are float32, bfloat16 or float16, all of one type; x, h, y and the sums are
// float32. A 16-bit weight vector is widened in registers as it is loaded (vec.h's load_half: bfloat16 by a shift,
// exact; float16 by vcvtph2ps), so a step streams half the bytes of float32 adapters. The scalar tails widen one
// value at a time (c10's conversions).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace kvforge_cpu {
namespace {

using Vec = Lanes16;
constexpr int64_t kLanes = Vec::kWidth;
constexpr int64_t kRows = 4;  // rows of one adapter per task
#ifdef __AVX512F__
constexpr int64_t kRegistersPerVector = 1;  // one zmm
// vectors per row in flight (of h in the shrink, of y in the expand)
constexpr int64_t kShrinkVectors = 4;  // 16 accumulators in 32 zmm registers
constexpr int64_t kExpandVectors = 2;  // 8 accumulators
#else
constexpr int64_t kRegistersPerVector = 2;  // two ymm
constexpr int64_t kShrinkVectors = 1;       // 4 accumulators (8 of 16 ymm registers)
constexpr int64_t kExpandVectors = 1;
#endif
// FMAs in flight that keep both FMA ports busy through an FMA's latency (4 cycles): fewer independent accumulators
// than that latency-bind a loop, so the shrink then splits its K axis over two sets of them
constexpr int64_t kChains = 8;

// kLanes weights from p, widened to float32 lanes
template <typename T>
Vec::V load_weights(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::load(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return Vec::load_half<true>(reinterpret_cast<const uint16_t*>(p));
  } else {
#if defined(__AVX512F__) || defined(__F16C__)
    return Vec::load_half<false>(reinterpret_cast<const uint16_t*>(p));
#else
    float wide[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) wide[i] = static_cast<float>(p[i]);
    return Vec::load(wide);
#endif
  }
}

struct LoRATask {
  int64_t slot;
  int64_t first;  // index into the rows sorted by slot
  int64_t count;  // <= kRows
};

// h[i, w0 : w0 + V * kLanes] = x[rows[i]] A^T[:, those columns] for the task's N rows (A^T [K, stride_a]). N and V
// are constants, so the accumulators stay in registers.
template <typename T, int64_t N, int64_t V>
void shrink_block(const float* const* xr, int64_t K, const T* at, int64_t stride_a, int64_t w0, float* h) {
  constexpr int64_t kSplit = N * V * kRegistersPerVector < kChains ? 2 : 1;
  Vec::V acc[kSplit][N][V] = {};
  int64_t k = 0;
  for (; k + kSplit <= K; k += kSplit)
    for (int64_t part = 0; part < kSplit; ++part) {
      const T* row = at + (k + part) * stride_a + w0;
      Vec::V av[V];
      for (int64_t v = 0; v < V; ++v) av[v] = load_weights(row + v * kLanes);
      for (int64_t i = 0; i < N; ++i) {
        const float xk = xr[i][k + part];
        for (int64_t v = 0; v < V; ++v) acc[part][i][v] += xk * av[v];
      }
    }
  for (; k < K; ++k)
    for (int64_t v = 0; v < V; ++v) {
      const Vec::V av = load_weights(at + k * stride_a + w0 + v * kLanes);
      for (int64_t i = 0; i < N; ++i) acc[0][i][v] += xr[i][k] * av;
    }
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v) {
      Vec::V sum = acc[0][i][v];
      for (int64_t part = 1; part < kSplit; ++part) sum += acc[part][i][v];
      Vec::store(h + i * stride_a + w0 + v * kLanes, sum);
    }
}

// h[i, :] = x[rows[i]] A^T for the task's N rows; h [kRows, stride_a], stride_a: whole vectors
template <typename T, int64_t N>
void shrink(const float* const* xr, int64_t K, const T* at, int64_t stride_a, float* h) {
  for (int64_t w0 = 0; w0 < stride_a;) {  // blocks of kShrinkVectors vectors, the rest in one block (q/k/v: 3)
    switch (std::min<int64_t>(kShrinkVectors, (stride_a - w0) / kLanes)) {
      case 4: shrink_block<T, N, 4>(xr, K, at, stride_a, w0, h); w0 += 4 * kLanes; break;
      case 3: shrink_block<T, N, 3>(xr, K, at, stride_a, w0, h); w0 += 3 * kLanes; break;
      case 2: shrink_block<T, N, 2>(xr, K, at, stride_a, w0, h); w0 += 2 * kLanes; break;
      default: shrink_block<T, N, 1>(xr, K, at, stride_a, w0, h); w0 += kLanes;
    }
  }
}

// y[rows[i], c0 : c0 + V * kLanes] += sum_r h[i, r] * bt[r, those columns] over the R ranks, for the task's N rows
template <typename T, int64_t N, int64_t V>
void expand_block(const float* h, int64_t stride_h, const T* bt, int64_t R, int64_t cols, float* const* yr,
                  int64_t c0) {
  Vec::V acc[N][V];
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v) acc[i][v] = Vec::load(yr[i] + c0 + v * kLanes);
  for (int64_t r = 0; r < R; ++r) {
    Vec::V bv[V];
    for (int64_t v = 0; v < V; ++v) bv[v] = load_weights(bt + r * cols + c0 + v * kLanes);
    for (int64_t i = 0; i < N; ++i) {
      const float hr = h[i * stride_h + r];
      for (int64_t v = 0; v < V; ++v) acc[i][v] += hr * bv[v];
    }
  }
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v) Vec::store(yr[i] + c0 + v * kLanes, acc[i][v]);
}

// y[rows[i], :cols] += sum_r h[i, r] * bt[r, :cols] over the R ranks, for the columns of one matrix
template <typename T, int64_t N>
void expand(const float* h, int64_t stride_h, const T* bt, int64_t R, int64_t cols, float* const* yr) {
  int64_t c = 0;
  constexpr int64_t kBlock = kExpandVectors * kLanes;
  for (; c + kBlock <= cols; c += kBlock) {
    // NOTE: a block reads one piece of each of the R rank rows, R strided streams that the hardware prefetchers do
    // not keep up with; the lines two blocks ahead are asked for here (measured, one decode step's 120 calls of the
    // default model, 1 thread: bfloat16 1.23x faster, float32 1.10x)
    if (c + 2 * kBlock < cols) prefetch_rows(bt + c + 2 * kBlock, R, cols * sizeof(T), kBlock * sizeof(T));
    expand_block<T, N, kExpandVectors>(h, stride_h, bt, R, cols, yr, c);
  }
  for (; c + kLanes <= cols; c += kLanes) expand_block<T, N, 1>(h, stride_h, bt, R, cols, yr, c);
  for (; c < cols; ++c)
    for (int64_t i = 0; i < N; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < R; ++r) sum += h[i * stride_h + r] * static_cast<float>(bt[r * cols + c]);
      yr[i][c] += sum;
    }
}

// one task: its N rows' shrink, then each matrix's expand into its columns of y
template <typename T>
struct TaskArgs {
  const float* x;
  int64_t K;
  const T* at;  // the slot's A^T [K, W]
  int64_t W, R;  // W: whole vectors, also h's row stride
  const T* const* bt;  // each matrix's B^T of the slot [R, N_m]
  const int64_t* offsets;  // [M + 1] each matrix's first column in y
  int64_t M;
  float* y;
  int64_t stride_y;
  float* h;  // [kRows, W]
};

template <typename T, int64_t N>
void run_task(const TaskArgs<T>& t, const int64_t* rows) {
  const float* xr[N];
  float* yr[N];
  for (int64_t i = 0; i < N; ++i) {
    xr[i] = t.x + rows[i] * t.K;
    yr[i] = t.y + rows[i] * t.stride_y;
  }
  shrink<T, N>(xr, t.K, t.at, t.W, t.h);
  for (int64_t m = 0; m < t.M; ++m) {
    float* ym[N];
    for (int64_t i = 0; i < N; ++i) ym[i] = yr[i] + t.offsets[m];
    expand<T, N>(t.h + m * t.R, t.W, t.bt[m], t.R, t.offsets[m + 1] - t.offsets[m], ym);
  }
}

// every task over weights of type T
template <typename T>
void run_tasks(const std::vector<LoRATask>& tasks, const std::vector<int64_t>& sorted, const float* x, int64_t K,
               const at::Tensor& a, const std::vector<at::Tensor>& bt, const std::vector<int64_t>& offsets, int64_t R,
               float* y, int64_t stride_y) {
  const int64_t M = bt.size(), W = a.size(2);
  const T* ap = a.data_ptr<T>();
  std::vector<const T*> btp(M);
  for (int64_t m = 0; m < M; ++m) btp[m] = bt[m].data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kRows * W);
    std::vector<const T*> bt_slot(M);
    for (int64_t i = begin; i < end; ++i) {
      const LoRATask& task = tasks[i];
      for (int64_t m = 0; m < M; ++m) bt_slot[m] = btp[m] + task.slot * R * (offsets[m + 1] - offsets[m]);
      const TaskArgs<T> args{x, K, ap + task.slot * K * W, W, R, bt_slot.data(), offsets.data(), M, y, stride_y,
                             h.data()};
      const int64_t* rows = sorted.data() + task.first;
      static_assert(kRows == 4, "run_task's cases");
      switch (task.count) {
        case 4: run_task<T, 4>(args, rows); break;
        case 3: run_task<T, 3>(args, rows); break;
        case 2: run_task<T, 2>(args, rows); break;
        default: run_task<T, 1>(args, rows);
      }
    }
  });
}

}  // namespace

// y [T, N] float32 (rows contiguous, updated in place), x [T, K] float32, a = A^T [S, K, W], bt: M tensors [S, R, N_m]
// (sum N_m = N), the weights float32, bfloat16 or float16 (one type), slots [T] int64 (-1: none); all contiguous
// except y's row stride.
void lora_apply(at::Tensor y, at::Tensor x, at::Tensor a, std::vector<at::Tensor> bt, at::Tensor slots) {
  const at::ScalarType weight_type = a.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "lora_apply: x and y must be float32");
  TORCH_CHECK(weight_type == at::kFloat || weight_type == at::kBFloat16 || weight_type == at::kHalf,
              "lora_apply: a must be float32, bfloat16 or float16, not ", weight_type);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && a.dim() == 3 && a.is_contiguous() && a.size(1) == x.size(1),
              "lora_apply: x [T, K] and a = A^T [S, K, W] contiguous");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.stride(1) == 1, "lora_apply: y [T, N] with unit columns");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == x.size(0) &&
                  slots.is_contiguous(),
              "lora_apply: slots [T] contiguous int64");
  const int64_t T = x.size(0), K = x.size(1), S = a.size(0), W = a.size(2), M = bt.size();
  TORCH_CHECK(M > 0, "lora_apply: no matrices");
  const int64_t R = bt[0].size(1);
  TORCH_CHECK(W == (M * R + kLanes - 1) / kLanes * kLanes, "lora_apply: A^T's ", W, " columns are not ", M,
              " matrices' rank ", R, " rounded up to whole ", kLanes, "-float vectors");
  std::vector<int64_t> offsets(M + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(bt[m].scalar_type() == weight_type && bt[m].dim() == 3 && bt[m].is_contiguous() &&
                    bt[m].size(0) == S && bt[m].size(1) == R,
                "lora_apply: bt[", m, "] must be a contiguous ", weight_type, " [", S, ", ", R, ", N] (a's type)");
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
  float* yp = y.data_ptr<float>();
  if (weight_type == at::kBFloat16)
    run_tasks<c10::BFloat16>(tasks, sorted, xp, K, a, bt, offsets, R, yp, y.stride(0));
  else if (weight_type == at::kHalf)
    run_tasks<c10::Half>(tasks, sorted, xp, K, a, bt, offsets, R, yp, y.stride(0));
  else
    run_tasks<float>(tasks, sorted, xp, K, a, bt, offsets, R, yp, y.stride(0));
}

}  // namespace kvforge_cpu

// out = act(x W^T + b) for float32 x [M, K] and out [M, N], with bfloat16 products: W is rounded to bfloat16 once, at
// load (bf16_gemm_pack), each row of x when it is read, and the products are summed in float32 by AMX's
// TDPBF16PS. The bias and the activation are applied to each 32 x 32 block of the output while it is in cache.
//
// The packed weight is the layout AMX's B tiles load: for each 16 output columns (a column block) and each 32 inputs
// (a step), a tile of 16 rows of 16 pairs, row p holding inputs 2p and 2p + 1 of each column (1 KiB, contiguous):
//
//     packed[nb][s][p][n][t] = W[16 nb + n][32 s + 2 p + t]        shape [N / 16, K / 32, 16, 32] (bfloat16)
//
// A thread takes 32-row blocks of x; for each it rounds the 32 rows to bfloat16 once (zero rows past M) and then
// runs every 32 x 32 output block of them: four accumulator tiles (C), two tiles of x's rows (A), two of the weight
// (B), over all of K; the block's sums go to a 4 KiB buffer in L1 for the epilogue. The whole packed weight (at most a
// few MiB) stays in each core's L2 cache across the row blocks. NOTE: measured (CPU time, one thread), a pass over K
// in chunks of 384 inputs, the sums of all the row block's columns kept between them, was 1.05-1.23x slower.
//
//     C0 C1      A0 = rows  0..15 of the block    B0 = columns  0..15
//     C2 C3      A1 = rows 16..31                 B1 = columns 16..31      Ci += Ar . Bc, 32 inputs a step
//
// Rounding is to nearest even, as torch's float -> bfloat16 conversion (the reference the tests compare against:
// torch's float32 matmul of the bfloat16-rounded x and W). The AMX code is compiled in the AVX-512 build with the
// instructions enabled for its functions alone, and runs where bf16_gemm_supported() says the CPU has AMX-BF16 and
// Linux lets this process use the tile registers; elsewhere callers keep their float32 matmul.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "amx.h"
#include "fast_exp.h"
#include "ops.h"

namespace kvforge_cpu {
namespace {

constexpr int64_t kBlock = 32;      // rows and columns of an output block
constexpr int64_t kTileCols = 16;   // columns of a weight tile (and of a C tile)
constexpr int64_t kStep = 32;       // inputs per tile step: 32 bfloat16 = one 64-byte tile row
constexpr int64_t kTileElems = 512; // bfloat16 values of a packed weight tile

enum Activation : int64_t { kNone = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3 };

// float -> bfloat16 bits, rounded to nearest even (NaN stays a NaN); a loop of these vectorizes
inline uint16_t to_bf16(float value) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef KVFORGE_AMX
#define AMX_FUNCTION __attribute__((target("amx-tile,amx-bf16")))
// NOTE: 512-bit vectors for the elementwise loops (rounding x, the epilogue), which the build's 256-bit preference
// (vectorized sums kept in one order: builds.py) does not concern; measured: the GELU epilogue 2.3x faster so
#define WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))

// erf by Abramowitz and Stegun 7.1.26 (absolute error under 1.5e-7), in a form the compiler vectorizes
inline float erf_approx(float x) {
  const float a = std::fabs(x);
  const float t = 1.f / (1.f + 0.3275911f * a);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const float y = 1.f - p * t * exp_clamped(-a * a);
  return x < 0.f ? -y : y;
}

template <int64_t kAct>
inline float activate(float v) {
  if constexpr (kAct == kGelu) return 0.5f * v * (1.f + erf_approx(v * 0.70710678118654752f));
  if constexpr (kAct == kGeluTanh) {
    const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
    return v * (1.f - 1.f / (exp_clamped(2.f * u) + 1.f));  // 0.5 v (1 + tanh u)
  }
  if constexpr (kAct == kRelu) return v > 0.f ? v : 0.f;
  return v;
}

// out rows [0, num_rows) of one block, columns [0, 32): act(c + bias)
template <int64_t kAct>
WIDE_VECTORS void epilogue(float* out, int64_t ldo, const float* c, const float* bias, int64_t num_rows) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* row = out + r * ldo;
    const float* acc = c + r * kBlock;
#pragma omp simd simdlen(16)
    for (int64_t j = 0; j < kBlock; ++j) row[j] = activate<kAct>(acc[j] + (bias != nullptr ? bias[j] : 0.f));
  }
}

void apply_epilogue(int64_t act, float* out, int64_t ldo, const float* c, const float* bias, int64_t num_rows) {
  switch (act) {
    case kGelu: return epilogue<kGelu>(out, ldo, c, bias, num_rows);
    case kGeluTanh: return epilogue<kGeluTanh>(out, ldo, c, bias, num_rows);
    case kRelu: return epilogue<kRelu>(out, ldo, c, bias, num_rows);
    default: return epilogue<kNone>(out, ldo, c, bias, num_rows);
  }
}

// rows [0, num_rows) of x (row stride ldx, k columns) rounded to bfloat16 into rows (k apart), rows past them zero
WIDE_VECTORS void round_rows(uint16_t* rows, const float* x, int64_t ldx, int64_t k, int64_t num_rows) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* src = x + r * ldx;
    uint16_t* dst = rows + r * k;
#pragma omp simd simdlen(16)
    for (int64_t j = 0; j < k; ++j) dst[j] = to_bf16(src[j]);
  }
  std::fill(rows + num_rows * k, rows + kBlock * k, uint16_t{0});
}


// eight tiles of 16 rows of 64 bytes (C: 16 floats; A and B: 32 bfloat16)
AMX_FUNCTION void configure_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // NOTE: the barrier keeps the stores above: the intrinsic tells the compiler it reads only the first 8 bytes
  __asm__ __volatile__("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// c [32, 32] = a [32 rows of lda bfloat16] . the two weight column blocks b0, b1 (packed: consecutive tiles of 32
// inputs), over num_steps tiles of 32 inputs
AMX_FUNCTION void block_product(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1,
                                int64_t num_steps, float* c) {
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(uint16_t));
  constexpr int64_t c_stride = kBlock * sizeof(float);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < num_steps; ++s) {
    _tile_loadd(4, a + s * kStep, a_stride);
    _tile_loadd(5, a + 16 * lda + s * kStep, a_stride);
    _tile_loadd(6, b0 + s * kTileElems, 64);
    _tile_loadd(7, b1 + s * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + kTileCols, c_stride);
  _tile_stored(2, c + 16 * kBlock, c_stride);
  _tile_stored(3, c + 16 * kBlock + kTileCols, c_stride);
}

AMX_FUNCTION void release_tiles() { _tile_release(); }

#endif

}  // namespace

bool bf16_gemm_supported() {
#ifdef KVFORGE_AMX
  return __builtin_cpu_supports("amx-bf16") && amx_tile_data_permitted();
#else
  return false;
#endif
}

at::Tensor bf16_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "bf16_gemm_pack: a float32 [N, K] weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % kStep == 0, "bf16_gemm_pack: N and K must be multiples of 32, got ", n, ", ", k);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({n / kTileCols, k / kStep, 16, 2 * kTileCols}, weight.options().dtype(at::kBFloat16));
  const float* src = w.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t num_steps = k / kStep;
  at::parallel_for(0, n / kTileCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int64_t s = 0; s < num_steps; ++s) {
        uint16_t* tile = dst + (nb * num_steps + s) * kTileElems;
        for (int64_t p = 0; p < 16; ++p)
          for (int64_t col = 0; col < kTileCols; ++col)
            for (int64_t t = 0; t < 2; ++t)
              tile[p * 32 + col * 2 + t] = to_bf16(src[(nb * kTileCols + col) * k + s * kStep + 2 * p + t]);
      }
    }
  });
  return packed;
}

at::Tensor bf16_gemm(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias, int64_t activation) {
  TORCH_CHECK(bf16_gemm_supported(), "bf16_gemm: this CPU (or this build) has no AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "bf16_gemm: float32 rows of x");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_gemm: a weight packed by bf16_gemm_pack");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kTileCols, num_steps = packed.size(1);
  TORCH_CHECK(num_steps * kStep == k, "bf16_gemm: x has ", k, " columns, the weight ", num_steps * kStep);
  TORCH_CHECK(activation >= kNone && activation <= kRelu, "bf16_gemm: activation ", activation);
  [[maybe_unused]] const float* bias_data = nullptr;  // (the build without AMX has refused above)
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "bf16_gemm: a float32 bias of ", n);
    bias_data = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#ifdef KVFORGE_AMX
  const float* x_data = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* out_data = out.data_ptr<float>();
  const int64_t num_row_blocks = (m + kBlock - 1) / kBlock, num_col_blocks = n / kBlock;
  // NOTE: row blocks split over the threads whole where there are enough of them (each rounds its rows once);
  // a few rows (a short batch) split their column blocks too
  const int64_t grain = num_row_blocks >= at::get_num_threads() ? num_col_blocks : 1;
  at::parallel_for(0, num_row_blocks * num_col_blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> rows(kBlock * k);  // the row block's x, rounded to bfloat16
    alignas(64) float block_sums[kBlock * kBlock];  // one output block's sums, before the epilogue
    configure_tiles();
    for (int64_t index = begin; index < end;) {
      const int64_t rb = index / num_col_blocks, first = index % num_col_blocks;
      const int64_t last = std::min(num_col_blocks, first + end - index);  // this row block's column blocks
      index += last - first;
      const int64_t row0 = rb * kBlock, num_rows = std::min(kBlock, m - row0);
      round_rows(rows.data(), x_data + row0 * ldx, ldx, k, num_rows);
      for (int64_t cb = first; cb < last; ++cb) {
        const uint16_t* b0 = w + 2 * cb * num_steps * kTileElems;
        block_product(rows.data(), k, b0, b0 + num_steps * kTileElems, num_steps, block_sums);
        apply_epilogue(activation, out_data + row0 * n + cb * kBlock, n, block_sums,
                       bias_data != nullptr ? bias_data + cb * kBlock : nullptr, num_rows);
      }
    }
    release_tiles();
  });
#endif
  return out;
}

}  // namespace kvforge_cpu

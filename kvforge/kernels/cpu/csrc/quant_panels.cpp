// Weight-only quantized matmul over row panels with int8 activations and AVX-512 VNNI, for any number of rows of x
// (decode, batched decode, prefill chunks). Layout (made and pictured in kvforge/kernels/cpu/quant_panels.py):
//
//   codes    uint8 [P, K / 32, V, 16, 4]   P panels of 16 weight rows; per 32-column block, V vectors of 64 bytes,
//                                          each 4 bytes of every row of the panel (an int32 lane per row):
//                                            8 bits (V = 8): vector j, row r, byte c = code[r, 32 b + 4 j + c]
//                                            4 bits (V = 4): low nibble code[r, 32 b + 8 j + c], high nibble
//                                                            code[r, 32 b + 8 j + 4 + c]
//   scales   half [P, G, 16], offsets half [P, G, 16]   (per group, the panel's 16 rows side by side, times 2^e)
//
//   W[n, k] = (code[n, k] * scales[n, g] + offsets[n, g]) * factor,   factor = 2^-e
//
// x is rounded to int8 per 32 columns (dx = max |x| / 127, q = round(x / dx), as quant_gemv_int8.cpp), in its own
// column order. One _mm512_dpbusd_epi32 multiplies 4 columns of all 16 rows by 4 broadcast bytes of q and adds them
// into the rows' int32 lanes, so a block of 32 columns is 8 instructions for 16 x 32 products, and the float work,
//
//   out[m, rows] += float(isum[m, rows]) * scales[g, rows] * dx[m, b]        once per block
//   out[m, rows] += offsets[g, rows] * xsum[m, g]                            once per group
//
// is one conversion and two multiply-adds per 512 products (a float GEMM needs 32 FMAs for them), and factor is
// applied once per output. Each weight vector is loaded once per tile of up to 4 rows of x and two panels (32 weight
// rows; four panels when x has one row).
//
// NOTE: each load prefetches the same vector kPrefetchTiles tiles on (NP panels a tile), and each group that tile's
// scales and offsets, against 2 blocks ahead in the same panel: 30 layers of 4-bit weights at one row of x, each
// build streaming its own copy from memory, 3.80 -> 3.56 ms, and 4.20 -> 3.95 ms after a 512 MiB flush (two builds
// side by side; Xeon VNNI VM, 2 threads); 16 and 64 rows 4-5% faster (weights warm), 8-bit alike.
// NOTE: the prefetches go to L2 (prefetcht1), 4 tiles ahead, and one row of x takes tiles of 4 panels: a load that
// waits for L1's few miss buffers stalls the stream, and at one row the work between loads is short. Builds side by
// side, each streaming its own 30 layers (Zen 4 EPYC VM, 2 threads, fastest of 21-31 rounds): 4-bit, one row
// 3.38 -> 2.92 ms (60% -> 69% of copy); 8-bit, one row 6.75 -> 5.08 ms; 16 rows unchanged (8.2 ms: compute-bound,
// ~50 of the 64 multiply-adds a cycle one core's vpdpbusd zmm gives). Hint T1 and T2 measured alike, 4 and 8 tiles
// ahead alike; the next tile alone, or T0, 13-22% slower; separate sums for the low and high nibbles no faster.
// NOTE: past the end of its part of a weight, a thread prefetches the start of its part of the next weight the
// caller names (the model's next matmul), so the stream does not stop while the caller gets from one call to the
// next, nor restart cold at each call. 30 layers of 4-bit weights at one row, each call naming the next weight
// against none, fastest of 9 alternating rounds (Zen 4 EPYC VM, 2 threads, a throwaway script): calls from a C++
// loop 2.66 -> 2.34 ms, from Inductor's C++ wrapper (the compiled single-stream step) 3.59 -> 3.16, from Python
// 4.00 -> 3.75.
// NOTE: a tile reads its pointers, and where each of its panels prefetches, into locals once, and prefetches without
// a branch (a panel whose target lies past both parts prefetches its own vectors). With a branch at each load and
// the fields read through the arguments, GCC 12 kept each loaded vector on the stack and read it back for each
// nibble. The 30 layers' calls at one row from a C++ loop, builds in turns (Zen 4 EPYC VM, 2 threads, a throwaway
// script): weights in cache (one layer's, reused), 4-bit 13.1 -> 7.6 us a call; 8-bit 1024 x 576, 9.8 -> 7.3 us;
// weights from memory, 4-bit 32.2 -> 35.2 GB/s (the copy 38.7); 16 rows, 4-bit 7-10% and 8-bit 27% faster.
#include "ops.h"
#include "quant_gemv.h"

#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFORGE_PANELS_VNNI 1
#endif

namespace kvforge_cpu {

#ifdef KVFORGE_PANELS_VNNI
namespace {

constexpr int64_t kPanel = 16;  // weight rows per panel: one int32 lane each of a 512-bit vector
constexpr int64_t kPrefetchTiles = 4;

inline void prefetch_to_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

template <int BITS>
constexpr int64_t vectors_per_block() { return 32 * BITS / 8 / 4; }  // of 64 bytes

// Where a thread's prefetches go: ahead in its own part of one array of the weight (codes, scales or offsets),
// and past that part's end on into its part of the same array of the next weight, if the caller named one.
template <typename T>
struct Stream {
  const T* end = nullptr;
  const T* next = nullptr;
  const T* next_end = nullptr;

  // Where a panel's prefetches go (`panel`: its codes, or its scales or offsets, span elements): the panel
  // panels_on further on while that lies in this part, past the part's end the same distance on in the next weight's
  // part, and the panel itself (data the thread loads anyway) where that runs past both.
  const T* ahead(const T* panel, int64_t span, int64_t panels_on) const {
    const T* p = panel + panels_on * span;
    if (p + span <= end) return p;
    if (p >= end && (p - end) + span <= next_end - next) return next + (p - end);
    return panel;
  }
};

struct PanelArgs {
  const int8_t* xq;  // [M, K]
  const float* dx;   // [M, K / 32]
  const float* xsum; // [M, G]
  const uint8_t* codes;
  const at::Half* scales;   // [P, G, 16]
  const at::Half* offsets;  // [P, G, 16]
  float* out;               // [M, N]
  int64_t M, N, K, G;
  float factor;
  Stream<uint8_t> codes_stream;  // the calling thread's
  Stream<at::Half> scales_stream, offsets_stream;
};

// A weight's panels split in parts, one per thread: each part at least ~32 KiB of codes a row of x, so small
// layers do not pay a thread fork per panel. Thread t takes part t of every weight, so that its prefetches past
// the end of its part of one weight land in its own part of the next.
struct Parts {
  int64_t count, size;  // in panels
};

Parts parts_of(int64_t panels, int64_t panel_bytes, int64_t M) {
  const int64_t grain = std::max<int64_t>(1, 32768 / (panel_bytes * M));
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (panels + grain - 1) / grain));
  return {count, (panels + count - 1) / count};
}

// The next weight a thread's prefetches run on into: a weight in the same layout, or none (codes == nullptr).
struct NextWeight {
  const uint8_t* codes = nullptr;
  const at::Half* scales = nullptr;
  const at::Half* offsets = nullptr;
  int64_t panels = 0, panel_bytes = 0, G = 0;
};

inline __m512 load_halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i broadcast4(const int8_t* q) {
  int32_t word;
  std::memcpy(&word, q, sizeof(word));
  return _mm512_set1_epi32(word);
}

// out[m0 .. m0 + MT, rows of panels p0 .. p0 + NP).
template <int BITS, int MT, int NP>
void panel_tile(const PanelArgs& a, int64_t m0, int64_t p0) {
  constexpr int64_t V = vectors_per_block<BITS>(), block_bytes = 64 * V;
  const int64_t K = a.K, G = a.G, blocks = K / kBlock, blocks_per_group = blocks / G;
  const int64_t panel_bytes = blocks * block_bytes, panel_halves = G * kPanel;
  const uint8_t* const codes = a.codes + p0 * panel_bytes;
  const at::Half* const scales = a.scales + p0 * panel_halves;
  const at::Half* const offsets = a.offsets + p0 * panel_halves;
  const int8_t* const xq = a.xq + m0 * K;
  const float* const dx = a.dx + m0 * blocks;
  const float* const xsum = a.xsum + m0 * G;
  // each panel's prefetches: the same place kPrefetchTiles tiles (NP panels a tile) on
  const uint8_t* codes_ahead[NP];
  const at::Half *scales_ahead[NP], *offsets_ahead[NP];
  for (int p = 0; p < NP; ++p) {
    codes_ahead[p] = a.codes_stream.ahead(codes + p * panel_bytes, panel_bytes, kPrefetchTiles * NP);
    scales_ahead[p] = a.scales_stream.ahead(scales + p * panel_halves, panel_halves, kPrefetchTiles * NP);
    offsets_ahead[p] = a.offsets_stream.ahead(offsets + p * panel_halves, panel_halves, kPrefetchTiles * NP);
  }
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 scale[NP];
    for (int p = 0; p < NP; ++p) {
      const int64_t at = p * panel_halves + g * kPanel;
      prefetch_to_l2(scales_ahead[p] + g * kPanel);
      prefetch_to_l2(offsets_ahead[p] + g * kPanel);
      scale[p] = load_halves(scales + at);
      const __m512 offset = load_halves(offsets + at);
      for (int m = 0; m < MT; ++m)
        acc[m][p] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m * G + g]), acc[m][p]);
    }
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      __m512i sums[MT][NP];
      for (int m = 0; m < MT; ++m)
        for (int p = 0; p < NP; ++p) sums[m][p] = _mm512_setzero_si512();
      for (int64_t j = 0; j < V; ++j)
        for (int p = 0; p < NP; ++p) {
          // NOTE: the load's offset from the tile's codes, the prefetch's from the panel's target; with both from the
          // panel (the load at codes + p * panel_bytes + offset) this loop read 0.90x in cache (GCC 12, builds in turns)
          const int64_t at = p * panel_bytes + b * block_bytes + 64 * j;
          prefetch_to_l2(codes_ahead[p] + (at - p * panel_bytes));
          const __m512i words = _mm512_loadu_si512(codes + at);
          if (BITS == 8) {
            for (int m = 0; m < MT; ++m)
              sums[m][p] = _mm512_dpbusd_epi32(sums[m][p], words, broadcast4(xq + m * K + 32 * b + 4 * j));
          } else {
            const __m512i low = _mm512_and_si512(words, low_nibbles);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(words, 4), low_nibbles);
            for (int m = 0; m < MT; ++m) {
              const int8_t* q = xq + m * K + 32 * b + 8 * j;
              sums[m][p] = _mm512_dpbusd_epi32(sums[m][p], low, broadcast4(q));
              sums[m][p] = _mm512_dpbusd_epi32(sums[m][p], high, broadcast4(q + 4));
            }
          }
        }
      for (int m = 0; m < MT; ++m) {
        const __m512 d = _mm512_set1_ps(dx[m * blocks + b]);
        for (int p = 0; p < NP; ++p)
          acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m][p]), _mm512_mul_ps(scale[p], d), acc[m][p]);
      }
    }
  }
  const __m512 factor = _mm512_set1_ps(a.factor);
  for (int p = 0; p < NP; ++p) {
    const int64_t n = (p0 + p) * kPanel, valid = std::min<int64_t>(kPanel, a.N - n);
    const __mmask16 mask = valid >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    for (int m = 0; m < MT; ++m)
      _mm512_mask_storeu_ps(a.out + (m0 + m) * a.N + n, mask, _mm512_mul_ps(acc[m][p], factor));
  }
}

// Panels p0 .. p0 + NP against every row of x, tiles of 4 rows of x, then the remainder.
template <int BITS, int NP>
void panel_rows(const PanelArgs& a, int64_t p0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= a.M; m0 += 4) panel_tile<BITS, 4, NP>(a, m0, p0);
  switch (a.M - m0) {
    case 3: panel_tile<BITS, 3, NP>(a, m0, p0); break;
    case 2: panel_tile<BITS, 2, NP>(a, m0, p0); break;
    case 1: panel_tile<BITS, 1, NP>(a, m0, p0); break;
    default: break;
  }
}

template <int BITS>
void panel_gemm(const PanelArgs& args, int64_t P, const NextWeight& next) {
  const int64_t panel_bytes = args.K / kBlock * 64 * vectors_per_block<BITS>();
  const Parts parts = parts_of(P, panel_bytes, args.M);
  const Parts next_parts = next.codes != nullptr ? parts_of(next.panels, next.panel_bytes, args.M) : Parts{0, 0};
  const int64_t group_halves = args.G * kPanel, next_group_halves = next.G * kPanel;  // a panel's scales, offsets
  at::parallel_for(0, parts.count, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t begin = t * parts.size, end = std::min(P, begin + parts.size);
      // this thread's part of the next weight: panels [from, to), none where from == to
      const int64_t from = t < next_parts.count ? t * next_parts.size : 0;
      const int64_t to = t < next_parts.count ? std::min(next.panels, from + next_parts.size) : 0;
      PanelArgs a = args;
      a.codes_stream = {a.codes + end * panel_bytes, next.codes + from * next.panel_bytes,
                        next.codes + to * next.panel_bytes};
      a.scales_stream = {a.scales + end * group_halves, next.scales + from * next_group_halves,
                         next.scales + to * next_group_halves};
      a.offsets_stream = {a.offsets + end * group_halves, next.offsets + from * next_group_halves,
                          next.offsets + to * next_group_halves};
      int64_t p = begin;
      if (a.M == 1)
        for (; p + 4 <= end; p += 4) panel_rows<BITS, 4>(a, p);
      for (; p + 2 <= end; p += 2) panel_rows<BITS, 2>(a, p);
      if (p < end) panel_rows<BITS, 1>(a, p);
    }
  });
}

// A weight's three arrays in the layout: codes uint8 [P, panel bytes], scales and offsets float16 [P, G, 16]
// (`name` begins the arguments' names in the errors: "" or "next_").
void check_layout(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets,
                  const char* name) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(), name,
              "codes must be a contiguous uint8 [P, panel bytes]");
  const int64_t P = codes.size(0);
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == P &&
                    t->size(2) == kPanel && t->size(1) == scales.size(1),
                name, "scales and ", name, "offsets must be contiguous float16 [P, G, 16] with P = ", P);
}

// q (in x's column order), dx and xsum of x [M, K].
void quantize_rows(const float* x, int8_t* xq, float* dx, float* xsum, int64_t M, int64_t K, int64_t G) {
  const int64_t blocks = K / kBlock, blocks_per_group = blocks / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const int32_t q_sum = quantize_block(x + m * K + b * kBlock, xq + m * K + b * kBlock, dx + m * blocks + b);
        sum += dx[m * blocks + b] * static_cast<float>(q_sum);
      }
      xsum[m * G + g] = sum;
    }
}

}  // namespace
#endif

// x [M, K] float32 -> x W^T [M, out_features] float32, W in the panel layout above.
torch::Tensor quant_gemm_panels(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                                int64_t bits, int64_t out_features, double factor,
                                const std::optional<torch::Tensor>& next_codes,
                                const std::optional<torch::Tensor>& next_scales,
                                const std::optional<torch::Tensor>& next_offsets) {
#ifdef KVFORGE_PANELS_VNNI
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  check_layout(codes, scales, offsets, "");
  const int64_t P = codes.size(0), K = codes.size(1) * 8 / bits / kPanel;
  TORCH_CHECK(K % kBlock == 0 && K > 0, "panel rows of ", K, " columns are not whole 32-column blocks");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && (K / kBlock) % G == 0, "groups must be whole 32-column blocks: K = ", K, ", G = ", G);
  TORCH_CHECK(out_features > (P - 1) * kPanel && out_features <= P * kPanel, "out_features ", out_features,
              " does not fill ", P, " panels");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "x must be a float32 [M, ", K, "] CPU tensor");
  NextWeight next;
  if (next_codes.has_value() || next_scales.has_value() || next_offsets.has_value()) {
    TORCH_CHECK(next_codes.has_value() && next_scales.has_value() && next_offsets.has_value(),
                "the next weight needs its codes, scales and offsets");
    check_layout(*next_codes, *next_scales, *next_offsets, "next_");
    next = {next_codes->data_ptr<uint8_t>(), next_scales->data_ptr<at::Half>(), next_offsets->data_ptr<at::Half>(),
            next_codes->size(0), next_codes->size(1), next_scales->size(1)};
  }
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = torch::empty({M, out_features}, x.options());
  if (M == 0) return out;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / kBlock)), xsum(M * G);
  quantize_rows(x.data_ptr<float>(), xq.data(), dx.data(), xsum.data(), M, K, G);
  const PanelArgs args{xq.data(), dx.data(), xsum.data(), codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                       offsets.data_ptr<at::Half>(), out.data_ptr<float>(), M, out_features, K, G,
                       static_cast<float>(factor)};
  if (bits == 8) panel_gemm<8>(args, P, next);
  else panel_gemm<4>(args, P, next);
  return out;
#else
  TORCH_CHECK(false, "the panel kernels need a build with AVX-512 VNNI");
#endif
}

bool quant_panels_available() {
#ifdef KVFORGE_PANELS_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace kvforge_cpu

TORCH_LIBRARY_FRAGMENT(kvforge_cpu, m) {
  m.def("quant_gemm_panels(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int out_features, "
        "float factor, Tensor? next_codes, Tensor? next_scales, Tensor? next_offsets) -> Tensor");
  m.def("quant_panels_available() -> bool", &kvforge_cpu::quant_panels_available);
}

TORCH_LIBRARY_IMPL(kvforge_cpu, CPU, m) { m.impl("quant_gemm_panels", &kvforge_cpu::quant_gemm_panels); }

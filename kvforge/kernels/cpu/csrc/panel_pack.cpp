// A weight's codes, scales and offsets written into the panel layout of quant_panels.cpp (pictured in
// kvforge/kernels/cpu/quant_panels.py) in one pass, tiles in parallel: the fast path of pack_panels there, whose torch
// reference (pack_panels_ref) gives the same bytes.
//
//   codes uint8 [N, K], scales and offsets float32 [N, G] (offsets absent: a symmetric layout, no offsets stored),
//   times `multiplier` and rounded to half -> uint8 [T, part bytes], each part padded with zeros to 64 bytes
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cstring>

namespace kvforge_cpu {
namespace {

constexpr int64_t kPanel = 16, kBlock = 32;

// Row n's 4 bytes of vector u of a panel: u = 8 b + j of 8-bit codes, columns 4u .. 4u + 3; u = 4 b + j of 4-bit
// ones, columns 8u .. 8u + 3 in the low nibbles, 8u + 4 .. 8u + 7 in the high ones; u = 6 b + 3 h + v of 6-bit ones,
// the low 4 bits as the 4-bit ones' vectors 4 b + 2 h + v (v < 2), and v = 2 their top 2 bits, of columns
// 32 b + 16 h + 4 i + c in bits 2i, 2i + 1 of byte c
inline void lane(const uint8_t* row, int64_t u, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, row + 4 * u, 4);
    return;
  }
  if (bits == 6 && u % 3 == 2) {
    const uint8_t* c = row + 32 * (u / 6) + 16 * (u % 6 / 3);
    for (int64_t i = 0; i < 4; ++i)
      out[i] = (c[i] >> 4) | (c[i + 4] >> 4) << 2 | (c[i + 8] >> 4) << 4 | (c[i + 12] >> 4) << 6;
    return;
  }
  const uint8_t* c = row + (bits == 6 ? 32 * (u / 6) + 16 * (u % 6 / 3) + 8 * (u % 3) : 8 * u);
  for (int64_t i = 0; i < 4; ++i) out[i] = (c[i] & 15) | (c[i + 4] & 15) << 4;
}

}  // namespace

at::Tensor pack_panels(at::Tensor codes, at::Tensor scales, c10::optional<at::Tensor> offsets,
                          int64_t bits, int64_t parts, double multiplier) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.device().is_cpu(),
              "codes must be a uint8 [N, K] CPU tensor");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N,
              "scales must be float32 [", N, ", groups]");
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && K % kBlock == 0 && (K / G) % (kBlock / 2) == 0, "no panel layout for width ",
              K, " in ", G, " groups");
  TORCH_CHECK(!offsets.has_value() || (offsets->scalar_type() == at::kFloat && offsets->sizes() == scales.sizes()),
              "offsets must be float32 of the scales' shape");
  TORCH_CHECK(parts >= 1, "parts must be at least 1, got ", parts);
  codes = codes.contiguous();
  scales = scales.contiguous();
  const at::Tensor offs = offsets.has_value() ? offsets->contiguous() : at::Tensor();
  const int64_t V = bits;                                  // vectors a 32-column block
  const int64_t group_vectors = V * (K / G) / kBlock;      // vectors a group (a half block: V / 2)
  const int64_t header = offs.defined() ? 64 : 32;         // a panel's bytes of scales (and offsets)
  const int64_t panel_group = header + 64 * group_vectors;  // a panel's bytes of a group
  const int64_t W = bits == 8 ? 2 : 4;                     // panels a tile
  const int64_t per_part = (N + kPanel * parts - 1) / (kPanel * parts);
  const int64_t part_bytes = (per_part * G * panel_group + 63) / 64 * 64;
  auto out = at::empty({parts, part_bytes}, codes.options());
  const uint8_t* const c = codes.data_ptr<uint8_t>();
  const float* const s = scales.data_ptr<float>();
  const float* const o = offs.defined() ? offs.data_ptr<float>() : nullptr;
  uint8_t* const base = out.data_ptr<uint8_t>();
  const float mult = static_cast<float>(multiplier);
  const int64_t tiles = (per_part + W - 1) / W;
  const std::vector<uint8_t> zero_row(K, 0);
  at::parallel_for(0, parts * tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t t = i / tiles, first_panel = i % tiles * W, w = std::min(W, per_part - first_panel);
      uint8_t* dst = base + t * part_bytes + first_panel * G * panel_group;
      const int64_t first_row = (t * per_part + first_panel) * kPanel;
      const auto halves = [&](const float* factors, int64_t g) {  // [w, 16] halves of group g's factors
        for (int64_t p = 0; p < w * kPanel; ++p, dst += 2) {
          const int64_t n = first_row + p;
          const c10::Half h(n < N ? factors[n * G + g] * mult : 0.f);
          std::memcpy(dst, &h, 2);
        }
      };
      for (int64_t g = 0; g < G; ++g) {
        halves(s, g);
        if (o != nullptr) halves(o, g);
        for (int64_t v = 0; v < group_vectors; ++v)
          for (int64_t p = 0; p < w; ++p)
            for (int64_t r = 0; r < kPanel; ++r, dst += 4) {
              const int64_t n = first_row + p * kPanel + r;
              lane(n < N ? c + n * K : zero_row.data(), g * group_vectors + v, bits, dst);
            }
      }
    }
  });
  const int64_t used = per_part * G * panel_group;
  for (int64_t t = 0; t < parts; ++t) std::memset(base + t * part_bytes + used, 0, part_bytes - used);
  return out;
}

}  // namespace kvforge_cpu

TORCH_LIBRARY_FRAGMENT(kvforge_cpu, m) {
  m.def("pack_panels(Tensor codes, Tensor scales, Tensor? offsets, int bits, int parts, float multiplier) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvforge_cpu, CPU, m) { m.impl("pack_panels", &kvforge_cpu::pack_panels); }

// A weight's codes, scales and zero points written into the panel layout of quant_panels.cpp (pictured in
// kvforge/kernels/cpu/quant_panels.py) in one pass, tiles in parallel: the fast path of pack_panels there, whose torch
// reference (pack_panels_ref) gives the same bytes.
//
//   the weight's rows in shards stacked in order (a merged layer's q, k, v: no copy of them into one tensor), shard
//   s: codes uint8 [N_s, K], scales and zeros float32 [N_s, G_s], G_s dividing G (a shard in groups of 32 repeats
//   each scale and zero point for its two groups of 16) -> out uint8 [T, >= part bytes] (the parts may lie apart:
//   a view into the loader's arena), each part's bytes past the weight's zeroed to the next 64
//
//   panel_factors: whether every zero point is 2^(bits - 1) (symmetric: no offsets stored) and the largest |scale|
//   (and |offset| = |zero * scale| unless symmetric), which the caller turns into the power-of-two multiplier
//
//   panel_super_scales: symmetric 6-bit codes, each shard's d float32 [N_s, K / 256] with its scales [N_s, K / 16] =
//   d * sc exactly for int8 sc in every super-block of 16 of them, d = s / -128 or else s / 127 (s the super-block's
//   first largest |scale|, signed; GGUF's Q6_K gives it sc -128); 4- or 5-bit codes with zero points in groups of 32,
//   each shard's (d, dmin) [N_s, K / 256, 2] (halves, as float32) with each group's scale d * sc and zero * scale
//   dmin * m for sc, m in [0, 63] (scale_and_min, super_factor: GGUF's Q4_K and Q5_K); or no tensors where some
//   super-block has none (_super_scales and _super_mins in quant_panels.py are the reference)
#include "quant_panels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <array>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace kvforge_cpu {
namespace {

// A row's 4 bytes of vector u of a panel: u = 8 b + j of 8-bit codes, columns 4u .. 4u + 3; u = 4 b + j of 4-bit
// ones, columns 8u .. 8u + 3 in the low nibbles, 8u + 4 .. 8u + 7 in the high ones; u = 6 b + 3 h + v of 6-bit ones,
// the low 4 bits as the 4-bit ones' vectors 4 b + 2 h + v (v < 2), and v = 2 their top 2 bits, of columns
// 32 b + 16 h + 4 i + c in bits 2i, 2i + 1 of byte c; u = 5 b + v of 5-bit ones, v < 4 the low 4 bits as the 4-bit
// ones' vector 4 b + v, v = 4 bit 4 of columns 32 b + 4 s + c in bit s of byte c. Found once per vector (where in
// the row, which bits), then made for each row.
struct Lane {
  enum Kind { kBytes, kNibbles, kTwoTopBits, kFifthBits } kind;
  int64_t column;  // the first of the row's codes it takes
};

inline Lane lane_of(int64_t u, int64_t bits) {
  if (bits == 8) return {Lane::kBytes, 4 * u};
  if (bits == 5)
    return u % 5 == 4 ? Lane{Lane::kFifthBits, 32 * (u / 5)} : Lane{Lane::kNibbles, 32 * (u / 5) + 8 * (u % 5)};
  if (bits == 6) {
    const int64_t half = 32 * (u / 6) + 16 * (u % 6 / 3);
    return u % 3 == 2 ? Lane{Lane::kTwoTopBits, half} : Lane{Lane::kNibbles, half + 8 * (u % 3)};
  }
  return {Lane::kNibbles, 8 * u};
}

inline uint32_t word_at(const uint8_t* c) {
  uint32_t word;
  std::memcpy(&word, c, 4);
  return word;
}

// (4 bytes at a time, byte i of a word the code at c + i: a shift by 4 moves no bit that the mask after it keeps
// into another byte)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "lane_bytes reads 4 codes as one little-endian word");
inline void lane_bytes(const uint8_t* c, Lane::Kind kind, uint8_t* out) {
  uint32_t word = 0;
  switch (kind) {
    case Lane::kBytes:
      word = word_at(c);
      break;
    case Lane::kNibbles:  // byte i: c[i] & 15 | (c[i + 4] & 15) << 4
      word = (word_at(c) & 0x0F0F0F0Fu) | (word_at(c + 4) & 0x0F0F0F0Fu) << 4;
      break;
    case Lane::kTwoTopBits:  // byte i, bits 2k, 2k + 1: bits 4-5 of c[i + 4k]
      for (int64_t k = 0; k < 4; ++k) word |= (word_at(c + 4 * k) >> 4 & 0x03030303u) << (2 * k);
      break;
    case Lane::kFifthBits:  // byte i, bit s: bit 4 of c[4s + i]
      for (int64_t s = 0; s < 8; ++s) word |= (word_at(c + 4 * s) >> 4 & 0x01010101u) << s;
      break;
  }
  std::memcpy(out, &word, 4);
}

// Where each row of the stacked shards lies: its codes, scales and zeros, and how many of the weight's groups each
// of its own groups covers
struct RowSource {
  const uint8_t* codes;
  const float *scales, *zeros;
  int64_t repeat;
  const float* super_scale;  // super-blocks: the row's [K / 256] (with mins [K / 256, 2])
};

std::vector<RowSource> row_sources(const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
                                   const std::vector<at::Tensor>& zeros, const std::vector<at::Tensor>& super_scales,
                                   int64_t K, int64_t G) {
  std::vector<RowSource> rows;
  for (size_t s = 0; s < codes.size(); ++s) {
    const int64_t n = codes[s].size(0), groups = scales[s].size(1);
    const float* const supers = super_scales.empty() ? nullptr : super_scales[s].data_ptr<float>();
    for (int64_t r = 0; r < n; ++r)
      rows.push_back({codes[s].data_ptr<uint8_t>() + r * K, scales[s].data_ptr<float>() + r * groups,
                      zeros[s].data_ptr<float>() + r * groups, G / groups,
                      supers == nullptr ? nullptr : supers + r * super_scales[s].stride(0)});
  }
  return rows;
}

// The shards' tensors made contiguous, checked: codes uint8 [N_s, K] (K the first's), scales and zeros float32
// [N_s, G_s]; returns K
int64_t checked_shards(std::vector<at::Tensor>& codes, std::vector<at::Tensor>& scales,
                       std::vector<at::Tensor>& zeros) {
  TORCH_CHECK(!scales.empty() && scales.size() == zeros.size() && (codes.empty() || codes.size() == scales.size()),
              "one scales and zeros tensor (and codes tensor) per shard, at least one shard");
  const int64_t K = codes.empty() ? 0 : codes[0].size(1);
  for (size_t s = 0; s < scales.size(); ++s) {
    TORCH_CHECK(scales[s].scalar_type() == at::kFloat && scales[s].dim() == 2 && scales[s].sizes() == zeros[s].sizes()
                    && zeros[s].scalar_type() == at::kFloat && scales[s].device().is_cpu() && zeros[s].device().is_cpu(),
                "shard ", s, ": scales and zeros must be float32 [rows, groups] CPU tensors of one shape");
    scales[s] = scales[s].contiguous();
    zeros[s] = zeros[s].contiguous();
    if (codes.empty()) continue;
    TORCH_CHECK(codes[s].scalar_type() == at::kByte && codes[s].dim() == 2 && codes[s].size(1) == K &&
                    codes[s].size(0) == scales[s].size(0) && codes[s].device().is_cpu(),
                "shard ", s, ": codes must be a uint8 [", scales[s].size(0), ", ", K, "] CPU tensor");
    codes[s] = codes[s].contiguous();
  }
  return K;
}

// A super-block's factor f of its `n` values v: each v / f within tolerance * |v / f| of an integer q in [lo, hi]
// (q = round(v / f); tolerance 0: q * f == v), for f = largest / k (half: rounded to a half) of the first k of `ks`
// that fits, largest the first of the largest |v| (signed); 0 where every v is 0, NaN where no k fits. (No product
// is added to anything: the compiler has no multiply-add to contract, and the reference in torch ops gives the same
// f.)
template <size_t KS>
inline float super_factor(const float* v, int64_t n, const std::array<float, KS>& ks, float lo, float hi,
                          float tolerance, bool half) {
  float largest = 0.f;
  for (int64_t j = 0; j < n; ++j)
    if (std::fabs(v[j]) > std::fabs(largest)) largest = v[j];
  if (largest == 0.f) return 0.f;
  for (const float k : ks) {
    const float factor = half ? static_cast<float>(c10::Half(largest / k)) : largest / k;
    bool fits = factor != 0.f;
    for (int64_t j = 0; j < n && fits; ++j) {
      const float ratio = v[j] / factor, q = std::nearbyint(ratio);
      fits = q >= lo && q <= hi && std::fabs(q - ratio) <= tolerance * std::fabs(ratio) &&
             (tolerance > 0.f || q * factor == v[j]);
    }
    if (fits) return factor;
  }
  return std::numeric_limits<float>::quiet_NaN();
}

// Symmetric super-blocks: k of their largest int8 sc (GGUF's Q6_K: -128; 127 from a quantizer that gives it that)
constexpr std::array<float, 2> kSymmetricRange = {-128.f, 127.f};

// Super-blocks with mins: the candidates k of the largest 6-bit sc or m (GGUF's quantizers give 63 without an
// importance matrix, and may give less with one), and how near min / dmin must come to an integer m. d and dmin are
// halves, as GGUF stores them: a scale d * sc is exact in float32, so d is found exactly; a min is the weight's
// zero * scale, GGUF's dmin * m divided by the scale and multiplied back in float32, within 2^-22 of it, so
// largest / k rounded to a half is the file's dmin, and min / dmin within 2^-20 of m
constexpr std::array<float, 63> kMinsRange = [] {
  std::array<float, 63> ks{};
  for (int i = 0; i < 63; ++i) ks[i] = static_cast<float>(63 - i);
  return ks;
}();
constexpr float kMinsTolerance = 0x1p-20f;

// A 32-column group of a 4- or 5-bit weight with mins as (scale, min), its weights code * scale - min: (scale, zero *
// scale), or for a group of codes 0 and zero point -1 whose scale is not positive (GGUF's decoder's group of scale 0,
// every weight its `scale`), (0, -scale)
inline std::pair<float, float> scale_and_min(const uint8_t* codes, float scale, float zero) {
  if (zero == -1.f && scale <= 0.f && std::all_of(codes, codes + 32, [](uint8_t c) { return c == 0; }))
    return {0.f, -scale};
  return {scale, zero * scale};
}

}  // namespace

std::tuple<bool, double> panel_factors(std::vector<at::Tensor> scales, std::vector<at::Tensor> zeros,
                                       int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8, got ", bits);
  std::vector<at::Tensor> no_codes;
  checked_shards(no_codes, scales, zeros);
  const float symmetric_zero = static_cast<float>(int64_t{1} << (bits - 1));
  struct Found {
    bool symmetric = true;
    float scale = 0.f, offset = 0.f;  // the largest |scale| and |offset|
  };
  Found all;
  for (size_t s = 0; s < scales.size(); ++s) {
    const float *sc = scales[s].data_ptr<float>(), *z = zeros[s].data_ptr<float>();
    const int64_t n = scales[s].numel();
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096));
    std::vector<Found> found(chunks);
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        bool symmetric = true;
        float scale = 0.f, offset = 0.f;
        for (int64_t i = n * c / chunks; i < n * (c + 1) / chunks; ++i) {
          symmetric &= z[i] == symmetric_zero;
          scale = std::max(scale, std::fabs(sc[i]));
          offset = std::max(offset, std::fabs(-z[i] * sc[i]));
        }
        found[c] = {symmetric, scale, offset};
      }
    });
    for (const Found& f : found) all = {all.symmetric && f.symmetric, std::max(all.scale, f.scale),
                                        std::max(all.offset, f.offset)};
  }
  return {all.symmetric, all.symmetric ? all.scale : std::max(all.scale, all.offset)};
}

std::vector<at::Tensor> panel_super_scales(std::vector<at::Tensor> codes, std::vector<at::Tensor> scales,
                                           std::vector<at::Tensor> zeros, int64_t bits, bool symmetric) {
  const bool mins = !symmetric;
  TORCH_CHECK(mins ? bits == 4 || bits == 5 : bits == 6, "super-blocks hold 6-bit symmetric codes or 4- or 5-bit ones "
              "with mins, not ", bits, "-bit ", symmetric ? "symmetric" : "asymmetric", " ones");
  const int64_t K = checked_shards(codes, scales, zeros), group = mins ? 32 : kSubCols, subs = kSuperCols / group;
  std::vector<at::Tensor> found;
  for (size_t s = 0; s < scales.size(); ++s) {
    TORCH_CHECK(K % kSuperCols == 0 && scales[s].size(1) * group == K, "shard ", s, ": ", scales[s].size(1),
                " groups of ", K, " columns are not sub-blocks of ", group);
    const int64_t n = scales[s].numel() / subs;  // super-blocks
    at::Tensor factors = at::empty({scales[s].size(0), K / kSuperCols, mins ? 2 : 1}, scales[s].options());
    const float *const sc = scales[s].data_ptr<float>(), *const z = zeros[s].data_ptr<float>();
    const uint8_t* const c = codes[s].data_ptr<uint8_t>();
    float* const out = factors.data_ptr<float>();
    std::atomic<bool> exact{true};
    at::parallel_for(0, n, 4096, [&](int64_t first, int64_t last) {
      float scale[kSubBlocks], min[kSubBlocks];
      for (int64_t i = first; i < last && exact.load(std::memory_order_relaxed); ++i) {
        if (!mins) {
          out[i] = super_factor(sc + i * subs, subs, kSymmetricRange, -128.f, 127.f, 0.f, false);
        } else {
          for (int64_t j = 0; j < subs; ++j)
            std::tie(scale[j], min[j]) = scale_and_min(c + (i * subs + j) * group, sc[i * subs + j], z[i * subs + j]);
          out[2 * i] = super_factor(scale, subs, kMinsRange, 0.f, 63.f, 0.f, true);
          out[2 * i + 1] = super_factor(min, subs, kMinsRange, 0.f, 63.f, kMinsTolerance, true);
        }
        if (std::isnan(out[(mins ? 2 : 1) * i]) || (mins && std::isnan(out[2 * i + 1]))) exact = false;
      }
    });
    if (!exact) return {};
    found.push_back(mins ? factors : factors.squeeze(2));
  }
  return found;
}

void pack_panels(std::vector<at::Tensor> codes, std::vector<at::Tensor> scales, std::vector<at::Tensor> zeros,
                 std::vector<at::Tensor> super_scales, int64_t bits, bool symmetric, double multiplier,
                 at::Tensor out) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(!codes.empty(), "at least one shard of codes");
  const int64_t K = checked_shards(codes, scales, zeros);
  int64_t N = 0, G = 0;
  for (size_t s = 0; s < codes.size(); ++s) {
    N += codes[s].size(0);
    G = std::max(G, scales[s].size(1));
  }
  for (size_t s = 0; s < scales.size(); ++s)
    TORCH_CHECK(scales[s].size(1) > 0 && G % scales[s].size(1) == 0, "shard ", s, ": ", scales[s].size(1),
                " groups do not divide the weight's ", G);
  TORCH_CHECK(G > 0 && K % G == 0 && K % kBlock == 0 && (K / G) % (kBlock / 2) == 0, "no panel layout for width ",
              K, " in ", G, " groups");
  // super-blocks: each shard's scales [N_s, K / 16] are its float32 super_scales [N_s, K / 256] times int8 ones; with
  // mins, its scales [N_s, K / 32] and zero * scale are its super_scales [N_s, K / 256, 2] (d, dmin) times 6-bit ones
  const bool super = !super_scales.empty(), mins = super && !symmetric;
  if (super) {
    TORCH_CHECK((mins ? (bits == 4 || bits == 5) && K / G == 32 : bits == 6 && K / G == kSubCols) &&
                    K % kSuperCols == 0 && super_scales.size() == scales.size(),
                "super-blocks hold 6-bit symmetric codes in sub-blocks of 16 columns, or 4- or 5-bit ones with mins "
                "in sub-blocks of 32, a shard's super scales each");
    for (size_t s = 0; s < super_scales.size(); ++s) {
      TORCH_CHECK(super_scales[s].scalar_type() == at::kFloat && super_scales[s].dim() == (mins ? 3 : 2) &&
                      super_scales[s].size(0) == scales[s].size(0) && super_scales[s].size(1) == K / kSuperCols &&
                      (!mins || super_scales[s].size(2) == 2) && scales[s].size(1) == G,
                  "shard ", s, ": super scales must be float32 [rows, ", K / kSuperCols, mins ? ", 2]" : "]");
      super_scales[s] = super_scales[s].contiguous();
    }
  }
  const int64_t parts = out.dim() == 2 ? out.size(0) : 0;
  TORCH_CHECK(parts >= 1 && out.scalar_type() == at::kByte && out.stride(1) == 1 && out.device().is_cpu(),
              "out must be a uint8 [parts >= 1, bytes] CPU tensor, each part contiguous");
  const int64_t layout_groups = super ? K / kSuperCols : G;
  const int64_t V = bits;                                               // vectors a 32-column block
  const int64_t group_vectors = V * (K / layout_groups) / kBlock;       // vectors a group (a half block: V / 2)
  const int64_t header = super ? (mins ? kMinsHeader : kSuperHeader) : symmetric ? 32 : 64;  // a panel's scales' bytes
  const int64_t panel_group = header + 64 * group_vectors;             // a panel's bytes of a group
  const int64_t W = bits == 8 ? 2 : 4;                     // panels a tile
  const int64_t per_part = (N + kPanel * parts - 1) / (kPanel * parts);
  const int64_t used = per_part * layout_groups * panel_group, part_bytes = (used + 63) / 64 * 64;
  TORCH_CHECK(out.size(1) >= part_bytes, "out holds ", out.size(1), " bytes a part, the layout takes ", part_bytes);
  const std::vector<RowSource> rows = row_sources(codes, scales, zeros, super_scales, K, G);
  uint8_t* const base = out.data_ptr<uint8_t>();
  const int64_t part_stride = out.stride(0);
  const float mult = static_cast<float>(multiplier);
  const int64_t tiles = (per_part + W - 1) / W;
  const std::vector<uint8_t> zero_row(K, 0);
  at::parallel_for(0, parts * tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t t = i / tiles, first_panel = i % tiles * W, w = std::min(W, per_part - first_panel);
      uint8_t* dst = base + t * part_stride + first_panel * layout_groups * panel_group;
      const int64_t first_row = (t * per_part + first_panel) * kPanel;
      const auto halves = [&](bool offsets, int64_t g) {  // [w, 16] halves of group g's scales or offsets
        for (int64_t p = 0; p < w * kPanel; ++p, dst += 2) {
          const int64_t n = first_row + p;
          float factor = 0.f;
          if (n < N) {
            const RowSource& row = rows[n];
            const float scale = row.scales[g / row.repeat];
            factor = offsets ? -row.zeros[g / row.repeat] * scale : scale;  // (-zero) * scale, as the reference
          }
          const c10::Half h(factor * mult);
          std::memcpy(dst, &h, 2);
        }
      };
      // a super-block's header: int8 [w, 16 sub-blocks, 16 rows] = scale / super scale, then float32 [w, 16 rows]
      const auto super_header = [&](int64_t g) {
        for (int64_t p = 0; p < w; ++p)
          for (int64_t sub = 0; sub < kSubBlocks; ++sub)
            for (int64_t r = 0; r < kPanel; ++r, ++dst) {
              const int64_t n = first_row + p * kPanel + r;
              const float d = n < N ? rows[n].super_scale[g] : 0.f;
              *dst = d == 0.f ? 0 : static_cast<uint8_t>(static_cast<int8_t>(
                                        std::nearbyint(rows[n].scales[g * kSubBlocks + sub] / d)));
            }
        for (int64_t p = 0; p < w * kPanel; ++p, dst += 4) {
          const int64_t n = first_row + p;
          const float d = n < N ? rows[n].super_scale[g] : 0.f;
          std::memcpy(dst, &d, 4);
        }
      };
      // with mins: sc uint8 [w, 8 sub-blocks, 16 rows], m uint8 [w, 2 quads, 16 rows, 4 sub-blocks], then d and
      // dmin half [w, 16 rows] each
      const auto mins_header = [&](int64_t g) {
        const auto sub_block = [&](int64_t n, int64_t sub, int64_t which) -> uint8_t {  // sc (which 0) or m (1)
          const RowSource& row = rows[n];
          const int64_t group = g * kMinsSubBlocks + sub;
          const float factor = row.super_scale[2 * g + which];
          const std::pair<float, float> scale_min = scale_and_min(row.codes + 32 * group, row.scales[group],
                                                                  row.zeros[group]);
          const float value = which == 0 ? scale_min.first : scale_min.second;
          return factor == 0.f ? 0 : static_cast<uint8_t>(std::nearbyint(value / factor));
        };
        for (int64_t p = 0; p < w; ++p)
          for (int64_t sub = 0; sub < kMinsSubBlocks; ++sub)
            for (int64_t r = 0; r < kPanel; ++r, ++dst) {
              const int64_t n = first_row + p * kPanel + r;
              *dst = n < N ? sub_block(n, sub, 0) : 0;
            }
        for (int64_t p = 0; p < w; ++p)
          for (int64_t r = 0; r < kPanel; ++r)
            for (int64_t sub = 0; sub < kMinsSubBlocks; ++sub) {
              const int64_t n = first_row + p * kPanel + r;
              dst[128 * p + 64 * (sub / 4) + 4 * r + sub % 4] = n < N ? sub_block(n, sub, 1) : 0;
            }
        dst += w * 2 * 64;
        for (int64_t which = 0; which < 2; ++which)
          for (int64_t p = 0; p < w * kPanel; ++p, dst += 2) {
            const int64_t n = first_row + p;
            const c10::Half factor(n < N ? rows[n].super_scale[2 * g + which] : 0.f);  // a half: super_factor
            std::memcpy(dst, &factor, 2);
          }
      };
      for (int64_t g = 0; g < layout_groups; ++g) {
        if (mins) mins_header(g);
        else if (super) super_header(g);
        else halves(false, g);
        if (!symmetric && !super) halves(true, g);
        for (int64_t v = 0; v < group_vectors; ++v) {
          const Lane lane = lane_of(g * group_vectors + v, bits);
          for (int64_t n = first_row; n < first_row + w * kPanel; ++n, dst += 4)
            lane_bytes((n < N ? rows[n].codes : zero_row.data()) + lane.column, lane.kind, dst);
        }
      }
    }
  });
  for (int64_t t = 0; t < parts; ++t) std::memset(base + t * part_stride + used, 0, part_bytes - used);
}

}  // namespace kvforge_cpu

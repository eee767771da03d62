// GGUF's quantized blocks decoded as "codes + per-group scale + zero point", in one pass over the blocks, rows in
// parallel: the fast path of kvforge/quantization/gguf_blocks.py, whose numpy decoders (the reference, and the path
// without this extension) picture each block layout and the codes, scales and zero points it becomes. The two give
// the same bytes and the same float32 values: each scale, offset and zero point is the same float32 operations in
// the same order (the build contracts no multiply-add here: none is written as one).
//
//   blocks uint8 [N, B, block bytes] -> codes uint8 [N, K], scales float32 [N, G], zeros float32 [N, G]
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <cstring>

namespace kvforge_cpu {
namespace {

// GGUF's type ids (ggml_type) of the block types decoded here
enum GGUFType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23,
};

// IQ4's 4-bit index -> its code, kvalues[q] + 128
constexpr uint8_t kIQ4Codes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One group of `size` codes q (already in codes) whose weights are scale * q + offset, as (q - zero) * scale; a group
// of scale 0 (`size` copies of offset) as codes 0, zero -1 and scale offset.
inline void affine(uint8_t* codes, int64_t size, float scale, float offset, float* scale_out, float* zero_out) {
  if (scale == 0.f) {
    std::memset(codes, 0, size);
    *scale_out = offset;
    *zero_out = -1.f;
    return;
  }
  *scale_out = scale;
  *zero_out = -(offset / scale);
}

// The low nibbles of qs[0 .. n), then the high ones
inline void nibbles(const uint8_t* qs, int64_t n, uint8_t* q) {
  for (int64_t j = 0; j < n; ++j) {
    q[j] = qs[j] & 15;
    q[j + n] = qs[j] >> 4;
  }
}

// Q5_0 / Q5_1's 32 five-bit q from qh [4] (bit i: bit 4 of q[i]) and qs [16]
inline void five_bits(const uint8_t* qh, const uint8_t* qs, uint8_t* q) {
  nibbles(qs, 16, q);
  for (int64_t i = 0; i < 32; ++i) q[i] |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
}

// Q4_K / Q5_K's 6-bit sub-block scales sc[8] and mins m[8] from their 12 bytes
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int64_t i = 0; i < 4; ++i) {
    sc[i] = s[i] & 63;
    m[i] = s[4 + i] & 63;
    sc[4 + i] = (s[8 + i] & 15) | ((s[i] >> 2) & 48);
    m[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 48);
  }
}

void q8_0(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  for (int64_t i = 0; i < 32; ++i) codes[i] = b[2 + i] ^ 0x80;
  scales[0] = half_at(b);
  zeros[0] = 128.f;
}

void q4_0(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  nibbles(b + 2, 16, codes);
  scales[0] = half_at(b);
  zeros[0] = 8.f;
}

void q4_1(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  nibbles(b + 4, 16, codes);
  affine(codes, 32, half_at(b), half_at(b + 2), scales, zeros);
}

void q5_0(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  five_bits(b + 2, b + 6, codes);
  for (int64_t i = 0; i < 32; ++i) codes[i] += 16;
  scales[0] = half_at(b);
  zeros[0] = 32.f;
}

void q5_1(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  five_bits(b + 4, b + 8, codes);
  affine(codes, 32, half_at(b), half_at(b + 2), scales, zeros);
}

void iq4_nl(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  nibbles(b + 2, 16, codes);
  for (int64_t i = 0; i < 32; ++i) codes[i] = kIQ4Codes[codes[i]];
  scales[0] = half_at(b);
  zeros[0] = 128.f;
}

// Q4_K / Q5_K (high: Q5_K's qh [32], else null): 8 sub-blocks of 32, q[64c + l] | q[64c + 32 + l] << 4 = qs[32c + l]
void q45_k(const uint8_t* b, const uint8_t* high, const uint8_t* qs, uint8_t* codes, float* scales, float* zeros) {
  const float d = half_at(b), dmin = half_at(b + 2);
  uint8_t sc[8], m[8];
  k_scales(b + 4, sc, m);
  for (int64_t c = 0; c < 4; ++c)
    for (int64_t l = 0; l < 32; ++l) {
      codes[64 * c + l] = qs[32 * c + l] & 15;
      codes[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  if (high != nullptr)
    for (int64_t s = 0; s < 8; ++s)
      for (int64_t l = 0; l < 32; ++l) codes[32 * s + l] |= ((high[l] >> s) & 1) << 4;
  for (int64_t s = 0; s < 8; ++s)
    affine(codes + 32 * s, 32, d * static_cast<float>(sc[s]), -(dmin * static_cast<float>(m[s])), scales + s,
           zeros + s);
}

void q4_k(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  q45_k(b, nullptr, b + 16, codes, scales, zeros);
}

void q5_k(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  q45_k(b, b + 16, b + 48, codes, scales, zeros);
}

void q6_k(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  const uint8_t *ql = b, *qh = b + 128;
  const float d = half_at(b + 208);
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t l = 0; l < 64; ++l) {
      codes[128 * h + l] = ql[64 * h + l] & 15;
      codes[128 * h + 64 + l] = ql[64 * h + l] >> 4;
    }
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t l = 0; l < 32; ++l) codes[128 * h + 32 * j + l] |= ((qh[32 * h + l] >> (2 * j)) & 3) << 4;
  }
  for (int64_t s = 0; s < 16; ++s) {
    scales[s] = d * static_cast<float>(static_cast<int8_t>(b[192 + s]));
    zeros[s] = 32.f;
  }
}

void q3_k(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = half_at(b + 108);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t l = 0; l < 32; ++l) codes[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
  for (int64_t j = 0; j < 8; ++j)
    for (int64_t l = 0; l < 32; ++l) codes[32 * j + l] = (codes[32 * j + l] | ((hmask[l] >> j) & 1) << 2) + 4;
  for (int64_t s = 0; s < 16; ++s) {
    const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    scales[s] = d * (static_cast<float>(low | high << 4) - 32.f);
    zeros[s] = 8.f;
  }
}

void q2_k(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  const uint8_t *sc = b, *qs = b + 16;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t l = 0; l < 32; ++l) codes[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
  for (int64_t s = 0; s < 16; ++s)
    affine(codes + 16 * s, 16, d * static_cast<float>(sc[s] & 15), -(dmin * static_cast<float>(sc[s] >> 4)),
           scales + s, zeros + s);
}

void iq4_xs(const uint8_t* b, uint8_t* codes, float* scales, float* zeros) {
  const float d = half_at(b);
  const int scales_h = b[2] | b[3] << 8;
  const uint8_t *scales_l = b + 4, *qs = b + 8;
  for (int64_t s = 0; s < 8; ++s) {
    const int ls = ((scales_l[s / 2] >> (4 * (s % 2))) & 15) | ((scales_h >> (2 * s)) & 3) << 4;
    scales[s] = d * (static_cast<float>(ls) - 32.f);
    zeros[s] = 128.f;
    for (int64_t j = 0; j < 16; ++j) {
      codes[32 * s + j] = kIQ4Codes[qs[16 * s + j] & 15];
      codes[32 * s + 16 + j] = kIQ4Codes[qs[16 * s + j] >> 4];
    }
  }
}

struct Layout {
  int64_t block_size, block_bytes, group_size;
  void (*decode)(const uint8_t*, uint8_t*, float*, float*);
};

Layout layout_of(int64_t type) {
  switch (type) {
    case Q8_0: return {32, 34, 32, q8_0};
    case Q4_0: return {32, 18, 32, q4_0};
    case Q4_1: return {32, 20, 32, q4_1};
    case Q5_0: return {32, 22, 32, q5_0};
    case Q5_1: return {32, 24, 32, q5_1};
    case IQ4_NL: return {32, 18, 32, iq4_nl};
    case Q4_K: return {256, 144, 32, q4_k};
    case Q5_K: return {256, 176, 32, q5_k};
    case Q6_K: return {256, 210, 16, q6_k};
    case Q3_K: return {256, 110, 16, q3_k};
    case Q2_K: return {256, 84, 16, q2_k};
    case IQ4_XS: return {256, 136, 32, iq4_xs};
    default: TORCH_CHECK(false, "GGUF type ", type, " has no block decoder here");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_decode(at::Tensor blocks, int64_t type) {
  const Layout layout = layout_of(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == layout.block_bytes &&
                  blocks.is_contiguous() && blocks.device().is_cpu(),
              "blocks must be a contiguous uint8 [rows, blocks, ", layout.block_bytes, "] CPU tensor");
  const int64_t N = blocks.size(0), B = blocks.size(1), K = B * layout.block_size, G = K / layout.group_size;
  const int64_t groups_per_block = layout.block_size / layout.group_size;
  auto codes = at::empty({N, K}, blocks.options());
  auto scales = at::empty({N, G}, blocks.options().dtype(at::kFloat));
  auto zeros = at::empty({N, G}, scales.options());
  const uint8_t* const in = blocks.data_ptr<uint8_t>();
  uint8_t* const c = codes.data_ptr<uint8_t>();
  float *const s = scales.data_ptr<float>(), *const z = zeros.data_ptr<float>();
  at::parallel_for(0, N * B, 1024, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)  // block i of all: row i / B, block i % B
      layout.decode(in + i * layout.block_bytes, c + i * layout.block_size, s + i * groups_per_block,
                    z + i * groups_per_block);
  });
  return {codes, scales, zeros};
}

}  // namespace kvforge_cpu

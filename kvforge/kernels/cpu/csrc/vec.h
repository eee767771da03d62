// The vectors the CPU kernels compute with, and the instructions they share, one section per instruction set. A
// kernel names its instruction set once (`using F = Avx2;`, or a template argument) and calls the operations of that
// struct, which have the same names in each: V (the float register), I (the integer one), kWidth (float lanes),
// zero, set1, load, store, mul, fma, to_float, sum, load_bytes, load_half (16-bit floats widened), and what one
// section alone has (Avx2's max and abs, Avx512's VNNI dot product). What one kernel does with the bits of its own
// format (unpacking a block's codes, say) stays in that kernel, in its section's instructions.
//
//   Lanes16   every build: 16 floats as a GCC vector, lowered to the registers -march gives (one zmm with AVX-512,
//             two ymm with AVX2); arithmetic and comparisons by operators. The attention kernels, argmax and LoRA.
//   Scalar8   every build: 8 floats in an array, loops the compiler may vectorize; the portable build's GEMV.
//   Avx2      AVX2 + FMA (x86-64-v3, with F16C): 8 floats in a ymm.
//   Avx512    AVX-512F (+ VNNI for the int8 dot product): 16 floats in a zmm.
//
// Loads and stores are unaligned (rows need no alignment). Prefetching, for every build: prefetch<Locality>(p) for a
// line, prefetch_rows for the lines of strided rows.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvforge_cpu {

// ---- prefetching (every build) --------------------------------------------------------------------------------

constexpr int64_t kCacheLine = 64;  // bytes
// The locality hints of __builtin_prefetch that the kernels use: to every cache level (prefetcht0), or to L2 and
// below (prefetcht1), where a whole block's rows ahead would evict the rows in use from L1.
constexpr int kToL1 = 3, kToL2 = 2;

template <int Locality = kToL1>
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, Locality); }

// The lines of `rows` rows of row_bytes bytes each, stride_bytes apart, from `first`.
template <int Locality = kToL1>
inline void prefetch_rows(const void* first, int64_t rows, int64_t stride_bytes, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r, p += stride_bytes)
    for (int64_t b = 0; b < row_bytes; b += kCacheLine) prefetch<Locality>(p + b);
}

// ---- Lanes16 (every build) ------------------------------------------------------------------------------------

struct Lanes16 {
  typedef float V __attribute__((vector_size(64)));
  typedef int32_t I __attribute__((vector_size(64)));  // lane masks of comparisons, lane indices
  static constexpr int64_t kWidth = 16;

  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  // The sum of the 16 lanes, first to last.
  static float sum(V v) {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
  }
  // 16 bfloat16 (BF16) or float16 values widened to floats: bfloat16 moved to the top half of a 32-bit lane (exact,
  // every build); float16 by vcvtph2ps (AVX-512F, or F16C on two halves; a build without either widens its own).
  template <bool BF16>
  static V load_half(const uint16_t* p) {
    if constexpr (BF16) {
      typedef uint16_t Bits __attribute__((vector_size(32)));
      typedef uint32_t Wide __attribute__((vector_size(64)));
      Bits bits;
      std::memcpy(&bits, p, sizeof bits);
      const Wide wide = __builtin_convertvector(bits, Wide) << 16;
      V v;
      std::memcpy(&v, &wide, sizeof v);
      return v;
    } else {
#if defined(__AVX512F__)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
      const __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
      V v;
      std::memcpy(&v, halves, sizeof v);
      return v;
#else
      static_assert(BF16, "float16 needs AVX-512F or F16C");
#endif
    }
  }
};

// ---- Scalar8 (every build) ------------------------------------------------------------------------------------

struct Scalar8 {
  struct V {
    float v[8];
  };
  static constexpr int64_t kWidth = 8;

  static V zero() { return V{}; }
  static V set1(float s) {
    V r;
    for (int i = 0; i < 8; ++i) r.v[i] = s;
    return r;
  }
  static V load(const float* p) {
    V r;
    for (int i = 0; i < 8; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, V v) {
    for (int i = 0; i < 8; ++i) p[i] = v.v[i];
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < 8; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static float sum(V v) {
    float s = 0.f;
    for (int i = 0; i < 8; ++i) s += v.v[i];
    return s;
  }
};

// ---- Avx2 ---------------------------------------------------------------------------------------------------------

#ifdef __AVX2__
struct Avx2 {
  using V = __m256;
  using I = __m256i;
  static constexpr int64_t kWidth = 8;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float s) { return _mm256_set1_ps(s); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static V abs(V v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
  // The sum of the 8 lanes.
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // The largest of the 8 lanes.
  static float max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static I load_bytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  // 8 bfloat16 (BF16) or float16 values widened to floats: bfloat16 moved to the top half of a 32-bit lane (exact),
  // float16 by vcvtph2ps (F16C).
  template <bool BF16>
  static V load_half(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (BF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
#ifdef __F16C__
      return _mm256_cvtph_ps(bits);
#else
      static_assert(BF16, "float16 needs F16C");
#endif
    }
  }
  // One such value widened.
  template <bool BF16>
  static float widen_half(uint16_t bits) {
    if constexpr (BF16) {
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;
      float value;
      std::memcpy(&value, &wide, sizeof value);
      return value;
    } else {
#ifdef __F16C__
      return _cvtsh_ss(bits);
#endif
    }
  }
};
#endif

// ---- Avx512 -------------------------------------------------------------------------------------------------------

#ifdef __AVX512F__
struct Avx512 {
  using V = __m512;
  using I = __m512i;
  static constexpr int64_t kWidth = 16;

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float s) { return _mm512_set1_ps(s); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static I load_bytes(const void* p) { return _mm512_loadu_si512(p); }
  // 16 bfloat16 (BF16) or float16 values widened to floats.
  template <bool BF16>
  static V load_half(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    else return _mm512_cvtph_ps(bits);
  }
#ifdef __AVX512VNNI__
  // acc plus the int32 sums of 4 adjacent products of unsigned bytes u and signed bytes s (vpdpbusd).
  static I dot_u8s8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
};
#endif

}  // namespace kvforge_cpu

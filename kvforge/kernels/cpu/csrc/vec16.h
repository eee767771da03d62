// 16 floats, the vector the hand-written CPU kernels compute with (paged_cache.h's attention kernels, argmax.cpp):
// GCC and clang lower it to the registers -march gives (one zmm with AVX-512, two ymm with AVX2). Loads and stores go
// through memcpy, so rows need no alignment.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvforge_cpu {

typedef float vec16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof v); }

}  // namespace kvforge_cpu

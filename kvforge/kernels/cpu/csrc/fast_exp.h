// exp(x) in a form the compiler vectorizes (std::exp is a call per element), shared by the kernels that need it.
#pragma once

#include <cstdint>

namespace kvforge_cpu {

// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (relative error under 1e-7), times 2^n built
// in the exponent bits. x is clamped to [-87, 88], float's normal range: exp(-87) ~ 1.6e-38 is nothing beside any
// term a softmax or a sigmoid adds it to, and exp(88) ~ 1.7e38 stays finite.
__attribute__((always_inline)) inline float exp_clamped(float x) {
  const float clamped = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = (clamped * 1.44269504088896341f + 12582912.f) - 12582912.f;  // nearest integer (1.5 * 2^23)
  const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-06f;  // ln2 in two parts
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace kvforge_cpu

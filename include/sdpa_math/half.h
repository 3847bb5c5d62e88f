// fp16 and bf16 <-> fp32 conversion in software, round-to-nearest-even, NaN and infinity kept.
// Plain integer code, so the CPU kernels need no compiler extension and vectorise, and the
// results are bit-identical to the hardware conversions (tests/cpp/test_half.cpp checks all
// 65,536 values of each type). Not valid under -ffast-math (the subnormal rounding relies on an
// exact float addition).
#pragma once

#include <cstdint>
#include <cstring>

namespace sdpa_math {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u)  // infinity, or NaN kept quiet with its top payload bits
    return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5f leaves a float whose last mantissa bit
    // is worth 2^-24, the subnormal half step, so the float adder does the rounding.
    uint32_t r = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t odd = (a >> 13) & 1u;
  a += 0xc8000fffu + odd;  // rebias the exponent (127 -> 15) and round to nearest even
  return static_cast<uint16_t>(sign | (a >> 13));
}

inline float bfloat16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace sdpa_math

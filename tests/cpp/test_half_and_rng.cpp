// The software fp16/bf16 conversions against the compiler's own (every 16-bit pattern, and float
// inputs around every rounding boundary), and the counter-based dropout stream.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "sdpa_math/dropout_rng.h"
#include "sdpa_math/half.h"

namespace sdpa_math {
namespace {

#if defined(__FLT16_MAX__)
TEST(Half, AllPatternsMatchTheCompilersFloat16) {
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 x;
    uint16_t bits = static_cast<uint16_t>(h);
    std::memcpy(&x, &bits, 2);
    const float want = static_cast<float>(x), got = half_to_float(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
      continue;
    }
    EXPECT_EQ(float_bits(got), float_bits(want)) << h;
    EXPECT_EQ(float_to_half(want), bits) << h;  // exact round trip
  }
}

TEST(Half, RoundingMatchesTheCompiler) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> any;
  for (int n = 0; n < 2'000'000; ++n) {
    uint32_t u = any(rng);
    if (n % 2) u = (u & 0x8FFFFFFFu) | 0x30000000u;  // half of them near half's range
    float f = bits_float(u);
    if (std::isnan(f)) continue;
    _Float16 h = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(float_to_half(f), want) << std::hexfloat << f;
  }
}
#endif

TEST(BFloat16, RoundTripAndRoundToNearestEven) {
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = bfloat16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(f))));
      continue;
    }
    EXPECT_EQ(float_to_bfloat16(f), b);
  }
  // Ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
}

// Philox4x32-10 known-answer vectors from Random123's kat_vectors (Salmon et al., SC'11).
TEST(Philox, KnownAnswers) {
  Philox4 zero = philox4x32_10(0, 0, 0);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  Philox4 ones = philox4x32_10(0xffffffffffffffffull, 0xffffffffffffffffull, 0xffffffffffffffffull);
  EXPECT_EQ(ones.v[0], 0x408f276du);
  EXPECT_EQ(ones.v[1], 0x41c83b0eu);
  EXPECT_EQ(ones.v[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.v[3], 0x6d5451fdu);
}

TEST(Dropout, ThresholdEdges) {
  EXPECT_EQ(dropout_threshold(0.0), 0u);
  EXPECT_EQ(dropout_threshold(1.0), 1u << 24);
  EXPECT_TRUE(dropout_keep_bits(0u, dropout_threshold(0.0)));
  EXPECT_FALSE(dropout_keep_bits(0xffffffffu, dropout_threshold(1.0)));
  EXPECT_EQ(dropout_threshold(0.5), 1u << 23);
}

TEST(Dropout, KeepRateAndIndependenceOfNeighbours) {
  const uint32_t thr = dropout_threshold(0.25);
  int64_t kept = 0, both = 0;
  const int64_t n = 400000;
  bool prev = false;
  for (int64_t i = 0; i < n; ++i) {
    bool k = dropout_keep(1234, 77, static_cast<uint64_t>(i), thr);
    kept += k;
    both += k && prev;
    prev = k;
  }
  // Binomial: sd of the rate is sqrt(0.1875 / n) ~ 7e-4; allow 5 sd.
  EXPECT_NEAR(static_cast<double>(kept) / n, 0.75, 0.0035);
  EXPECT_NEAR(static_cast<double>(both) / n, 0.5625, 0.004);
}

}  // namespace
}  // namespace sdpa_math

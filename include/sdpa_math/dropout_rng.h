// Counter-based random dropout. Element n of the dropout stream (seed, offset) is decided by one
// Philox4x32-10 draw, so any backend (CPU threads, GPU blocks) reproduces any element without
// state and the backward sees the forward's mask without storing it.
//
//   block  = philox4x32_10(key = {lo(seed), hi(seed)}, counter = {lo(n/4), hi(n/4), lo(offset), hi(offset)})
//   bits   = block[n % 4]
//   keep(n) = (bits >> 8) >= ceil(p * 2^24)      (i.e. u = (bits >> 8) / 2^24 >= p)
//
// n is the element's index in P laid out contiguously: ((lead * L) + i) * S + j.
// Philox4x32-10: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11); the
// round constants below are the published ones.
#pragma once

#include <cmath>
#include <cstdint>

#include "sdpa_math/host_device.h"

namespace sdpa_math {

struct Philox4 {
  uint32_t v[4];
};

SDPA_MATH_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

SDPA_MATH_HD Philox4 philox4x32_10(uint64_t seed, uint64_t counter_lo, uint64_t counter_hi) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The integer threshold of a dropout probability: keep iff (bits >> 8) >= threshold.
// p = 0 keeps everything, p = 1 drops everything.
SDPA_MATH_HD uint32_t dropout_threshold(double p) {
  if (p <= 0.0) return 0u;
  if (p >= 1.0) return 1u << 24;
  return static_cast<uint32_t>(std::ceil(p * 16777216.0));
}

SDPA_MATH_HD bool dropout_keep_bits(uint32_t bits, uint32_t threshold) {
  return (bits >> 8) >= threshold;
}

// The keep decision of element n of stream (seed, offset).
SDPA_MATH_HD bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t n, uint32_t threshold) {
  Philox4 block = philox4x32_10(seed, n >> 2, offset);
  return dropout_keep_bits(block.v[n & 3], threshold);
}

}  // namespace sdpa_math

// 16-float vectors for the CPU kernels, through GCC/Clang vector extensions: one AVX-512
// register, or split by the compiler into narrower ones on older ISAs. GCC does not vectorise
// the scalar forms of the softmax's loops (std::max, std::floor keep NaN and rounding-mode
// semantics that need -ffast-math to drop), so the kernels are written on these.
#pragma once

#include "isa.h"

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

SDPA_MATH_CPU_BEGIN

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

// Loads and stores go through memcpy, which compiles to unaligned vector moves (an
// under-aligned typedef would lose its attribute as a template argument).
template <class V = f32x16>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V>
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
inline f32x16 splat(float x) { return f32x16{} + x; }

// A store that bypasses the caches (non-temporal) where the ISA has one for V and p is aligned
// to V's size, else a plain store: for results written once and not read again soon, whose
// cache lines would otherwise be read in before being overwritten. Callers end with
// streaming_fence() before another thread reads what they wrote.
template <class V>
inline void store_streaming(float* p, V v) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(V) == 0) {
#if SDPA_MATH_CPU_LEVEL >= 4
    if constexpr (sizeof(V) == 64) return _mm512_stream_ps(p, reinterpret_cast<__m512&>(v));
#endif
#if SDPA_MATH_CPU_LEVEL >= 3
    if constexpr (sizeof(V) == 32) return _mm256_stream_ps(p, reinterpret_cast<__m256&>(v));
#endif
  }
  store<V>(p, v);
}
inline void streaming_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Lane t of the result is the sum of the 16 lanes of x[t]. Four rounds of pairwise shuffles and
// adds: each round halves the lanes per vector and doubles the vectors per lane group, so 15
// combines replace 16 horizontal sums. Combining (u, w) puts u's and w's halves side by side;
// after four rounds lane t holds the vector at the bit-reversed index of t, so the inputs are
// taken in bit-reversed order.
inline f32x16 sum_each(const f32x16 (&x)[16]) {
  static constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  f32x16 v[16];
  for (int t = 0; t < 16; ++t) v[t] = x[kBitReversed[t]];
  // Round 1: lane groups of 16 -> two groups of 8 (u's, then w's).
  for (int t = 0; t < 8; ++t)
    v[t] = __builtin_shufflevector(v[2 * t], v[2 * t + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * t], v[2 * t + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  // Round 2: in each group of 8, u's first 4 and w's first 4, plus the second 4s.
  for (int t = 0; t < 4; ++t)
    v[t] = __builtin_shufflevector(v[2 * t], v[2 * t + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * t], v[2 * t + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                   31);
  // Round 3: groups of 4 -> pairs.
  for (int t = 0; t < 2; ++t)
    v[t] = __builtin_shufflevector(v[2 * t], v[2 * t + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(v[2 * t], v[2 * t + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                   31);
  // Round 4: pairs -> single lanes.
  return __builtin_shufflevector(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// A 16 x 16 block transposed in registers: rows[i] lane l becomes rows[l] lane i. Four rounds;
// the round with distance s swaps, for every pair of rows (i, i + s) with i & s == 0, the
// elements (i, l + s) and (i + s, l) for the lanes l with l & s == 0: one two-source permute per
// row per round (64 in all, against 256 scalar loads and stores).
namespace detail {
template <int s>
constexpr int first_of_pair(int l) { return (l & s) ? 16 + l - s : l; }  // row i: keep l, take row i+s's l-s
template <int s>
constexpr int second_of_pair(int l) { return (l & s) ? 16 + l : l + s; }  // row i+s: take row i's l+s
#define SDPA_MATH_LANES(f) f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7), f(8), f(9), f(10), f(11), f(12), f(13), f(14), f(15)
template <int s>
inline void transpose_round(f32x16 (&rows)[16]) {
  for (int i = 0; i < 16; ++i) {
    if (i & s) continue;
    const f32x16 u = rows[i], w = rows[i + s];
    rows[i] = __builtin_shufflevector(u, w, SDPA_MATH_LANES(first_of_pair<s>));
    rows[i + s] = __builtin_shufflevector(u, w, SDPA_MATH_LANES(second_of_pair<s>));
  }
}
#undef SDPA_MATH_LANES
}  // namespace detail

inline void transpose16(f32x16 (&rows)[16]) {
  detail::transpose_round<1>(rows);
  detail::transpose_round<2>(rows);
  detail::transpose_round<4>(rows);
  detail::transpose_round<8>(rows);
}

// sum_j a[j] * b[j] in fp32.
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t full = n - n % kLanes;
  f32x16 acc = f32x16{};
  for (int64_t j = 0; j < full; j += kLanes) acc += load(a + j) * load(b + j);
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  for (int64_t j = full; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

SDPA_MATH_CPU_END

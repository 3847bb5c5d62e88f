// The level's vector of floats, through GCC/Clang vector extensions: one register of the level's
// ISA, 16 floats (AVX-512), 8 (AVX2) or 4 (the baseline's SSE2), so that every operation on it is
// one instruction. (A wider type is legal, and the compiler splits its arithmetic, but GCC 12
// lowers its compares and selects lane by lane through the stack: with 16-float vectors on AVX2
// the forward ran about 20x slower, its products' tile and the softmax's compares together.)
// GCC does not vectorise the scalar forms of the softmax's loops
// (std::max, std::floor keep NaN and rounding-mode semantics that need -ffast-math to drop), so
// the kernels are written on these.
#pragma once

#include "isa.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

SDPA_MATH_CPU_BEGIN

#if SDPA_MATH_CPU_LEVEL >= 4
constexpr size_t kVectorBytes = 64;
#elif SDPA_MATH_CPU_LEVEL >= 3
constexpr size_t kVectorBytes = 32;
#else
constexpr size_t kVectorBytes = 16;
#endif
typedef float vf32 __attribute__((vector_size(kVectorBytes)));
typedef int32_t vi32 __attribute__((vector_size(kVectorBytes)));
// Half a vector of floats, and as doubles: one vector's bytes again.
typedef float vf32_half __attribute__((vector_size(kVectorBytes / 2)));
typedef double vf64 __attribute__((vector_size(kVectorBytes)));
constexpr int64_t kLanes = kVectorBytes / sizeof(float);
// Eight floats, the products' narrowest panel on AVX-512.
typedef float f32x8 __attribute__((vector_size(32)));

// Loads and stores go through memcpy, which compiles to unaligned vector moves (an
// under-aligned typedef would lose its attribute as a template argument).
template <class V = vf32>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V>
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
inline vf32 splat(float x) { return vf32{} + x; }

// A store that bypasses the caches (non-temporal) where the ISA has one for V and p is aligned
// to V's size, else a plain store: for results written once and not read again soon, whose
// cache lines would otherwise be read in before being overwritten. Callers end with
// streaming_fence() before another thread reads what they wrote. No 16-byte (SSE) form: the
// baseline's 8-float panels wrote half of each row's cache line per panel, 16 bytes at a time,
// and a decode backward ran several times slower on a Xeon than with plain stores.
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

namespace detail {
// Shuffle indices over kLanes lanes, as a pack (__builtin_shufflevector takes them as constants).
template <class F, size_t... L>
constexpr auto lanes_of(F f, std::index_sequence<L...>) {
  return std::integer_sequence<int, f(static_cast<int>(L))...>{};
}

// One round of sum_each with distance d: 2d vectors become d. The result of combining (u, w) has
// u's partial sums in the even chunks of d lanes and w's in the odd ones: lane l adds lanes l and
// l + d of u (even chunk) or lanes l - d and l of w (odd chunk); w's lanes are numbered from
// kLanes in the shuffle.
template <int d>
constexpr int sum_first(int l) { return (l / d) % 2 == 0 ? l : int(kLanes) + l - d; }
template <int d>
constexpr int sum_second(int l) { return (l / d) % 2 == 0 ? l + d : int(kLanes) + l; }
template <int... First, int... Second>
inline vf32 add_pair(vf32 u, vf32 w, std::integer_sequence<int, First...>, std::integer_sequence<int, Second...>) {
  return __builtin_shufflevector(u, w, First...) + __builtin_shufflevector(u, w, Second...);
}
template <int d>
inline void sum_round(vf32* v) {
  constexpr auto lanes = std::make_index_sequence<kLanes>{};
  for (int t = 0; t < d; ++t)
    v[t] = add_pair(v[2 * t], v[2 * t + 1], lanes_of([](int l) { return sum_first<d>(l); }, lanes),
                    lanes_of([](int l) { return sum_second<d>(l); }, lanes));
  if constexpr (d > 1) sum_round<d / 2>(v);
}
constexpr int bit_reversed(int t) {
  int r = 0;
  for (int bit = 1, rbit = int(kLanes) / 2; bit < int(kLanes); bit <<= 1, rbit >>= 1)
    if (t & bit) r |= rbit;
  return r;
}

// One round of transpose_block with distance s: for every pair of rows (i, i + s) with
// i & s == 0, the elements (i, l + s) and (i + s, l) swap for the lanes l with l & s == 0.
template <int s>
constexpr int first_of_pair(int l) { return (l & s) ? int(kLanes) + l - s : l; }  // row i: keep l, take row i+s's l-s
template <int s>
constexpr int second_of_pair(int l) { return (l & s) ? int(kLanes) + l : l + s; }  // row i+s: take row i's l+s
template <int... I>
inline vf32 shuffle2(vf32 u, vf32 w, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(u, w, I...);
}
template <int s>
inline void transpose_round(vf32 (&rows)[kLanes]) {
  constexpr auto lanes = std::make_index_sequence<kLanes>{};
  constexpr auto first = lanes_of([](int l) { return first_of_pair<s>(l); }, lanes);
  constexpr auto second = lanes_of([](int l) { return second_of_pair<s>(l); }, lanes);
  for (int i = 0; i < int(kLanes); ++i) {
    if (i & s) continue;
    const vf32 u = rows[i], w = rows[i + s];
    rows[i] = shuffle2(u, w, first);
    rows[i + s] = shuffle2(u, w, second);
  }
  if constexpr (s * 2 < int(kLanes)) transpose_round<s * 2>(rows);
}
}  // namespace detail

// Lane t of the result is the sum of the kLanes lanes of x[t]. log2(kLanes) rounds of pairwise
// shuffles and adds: each round halves the lanes per vector and doubles the vectors per lane
// group, so kLanes - 1 combines replace kLanes horizontal sums. After the last round lane t holds
// the vector at the bit-reversed index of t, so the inputs are taken in bit-reversed order.
inline vf32 sum_each(const vf32 (&x)[kLanes]) {
  vf32 v[kLanes];
  for (int t = 0; t < int(kLanes); ++t) v[t] = x[detail::bit_reversed(t)];
  detail::sum_round<int(kLanes) / 2>(v);
  return v[0];
}

// A kLanes x kLanes block transposed in registers: rows[i] lane l becomes rows[l] lane i.
// log2(kLanes) rounds of one two-source permute per row (at 16 lanes: 64 in all, against 256
// scalar loads and stores).
inline void transpose_block(vf32 (&rows)[kLanes]) { detail::transpose_round<1>(rows); }

// sum_j a[j] * b[j] in fp32.
inline float dot(const float* a, const float* b, int64_t n) {
  const int64_t full = n - n % kLanes;
  vf32 acc = vf32{};
  for (int64_t j = 0; j < full; j += kLanes) acc += load(a + j) * load(b + j);
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  for (int64_t j = full; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

SDPA_MATH_CPU_END

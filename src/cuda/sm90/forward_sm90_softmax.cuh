// The Hopper forward's softmax pieces: a row's max and sum of exponents over the accumulator
// fragment a thread holds, and the exponent's two forms (base-2 and natural units).
//
// A thread of a consumer warpgroup holds, of an m64nNk16 accumulator, rows g and g + 8 of its
// warp's 16 (accumulator row r = 0, 1) at keys 8n + 2t and 8n + 2t + 1: elements s[4n + 2r] and
// s[4n + 2r + 1].
#pragma once

#include "../mma.cuh"
#include "forward_sm90_shell.cuh"

namespace sdpa_math::cuda::sm90::fwd {

// Max over this thread's elements of accumulator row r as a tree, not a 32-long chain of
// dependent instructions.
template <int N>
SDPA_MATH_D float row_max(const float (&s)[N], int r) {
  float v[N / 4];
#pragma unroll
  for (int n = 0; n < N / 4; ++n) v[n] = max_nan(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]);
  static_assert(N == 64, "the tree below halves 16 values four times");
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = max_nan(v[i], v[i + 8]);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = max_nan(v[i], v[i + 4]);
  return max_nan(max_nan(v[0], v[2]), max_nan(v[1], v[3]));
}

// exp(logit - m) for a logit x: base-2 logits (unmasked, bool and fp16 masks) take 2^(x·mul − m)
// in one multiply-add, where mul folds in the scale for raw scores; natural ones (bf16 and fp32
// masks, on the tiles the mask changes: see exponent_of) take 2^((x − m)·log2 e), the difference
// first, since x and m near a float mask's finfo.min would overflow fp32 times log2 e.
template <bool NATURAL>
SDPA_MATH_D float exp_from(float x, float mul, float m) {
  if constexpr (NATURAL) return fast_exp2((x - m) * 1.4426950408889634f);
  else return fast_exp2(fmaf(x, mul, -m));
}

// The multiply-add of a row's exponents over one tile, 2^(x·mul − off). Base-2 kernels: mul and
// m as exp_from. Natural kernels: a tile the mask changes has had m subtracted first
// (shift_row), then 2^(x·log2 e), as exp_from; a tile of raw scores (clean, its pairs neutral,
// the scale folded) takes the base-2 kernels' one multiply-add, 2^(s·scale·log2 e − m·log2 e),
// where logits scaled it first and the exponent took a subtract and a multiply. Safe from the
// overflow above: the row's max is at least the tile's largest scaled score, so m·log2 e cannot
// run to −inf. Towards +inf (a mask value near fp32's largest somewhere else in the row) off is
// +inf and the tile's exponents 0, their value's limit; scores themselves past FLT_MAX / log2 e
// are then limited as in the unmasked kernels.
struct Exponent {
  float mul, off;
};
template <bool NATURAL>
SDPA_MATH_D Exponent exponent_of(bool raw, float mul, float m, float scale_log2) {
  if constexpr (!NATURAL) return {mul, m};
  else return raw ? Exponent{scale_log2, m * 1.4426950408889634f} : Exponent{1.4426950408889634f, 0.0f};
}

// x − m in place over the elements of accumulator row r (a natural kernel's tile the mask changes).
template <int N>
SDPA_MATH_D void shift_row(float (&s)[N], int r, float m) {
#pragma unroll
  for (int n = 0; n < N / 4; ++n) {
    s[4 * n + 2 * r] -= m;
    s[4 * n + 2 * r + 1] -= m;
  }
}

// Σ 2^(x·mul − off) over the same elements as row_max, in four independent partial sums.
template <int N>
SDPA_MATH_D float row_sum_exp(const float (&s)[N], int r, const Exponent& e) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < N / 4; ++n)
    acc[n % 4] += exp_from<false>(s[4 * n + 2 * r], e.mul, e.off) + exp_from<false>(s[4 * n + 2 * r + 1], e.mul, e.off);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace sdpa_math::cuda::sm90::fwd

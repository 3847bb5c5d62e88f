// The normalized problem (core::Problem) as the CUDA kernels see it, and the contract's rules on
// device: where an element lives, what the mask does to a score, what dropout does to a
// probability. Every CUDA kernel applies these functions, so each rule is written once per layer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sdpa_math/dropout_rng.h"
#include "sdpa_math/host_device.h"
#include "sdpa_math/tensor_view.h"

namespace sdpa_math::cuda {

// One operand: memory strides over the output's lead dims (0 = broadcast), over its last two
// dims, and the same for the dense fp32 buffer its gradient accumulates in.
struct DevOperand {
  char* data = nullptr;
  DType dtype = DType::Float32;
  int64_t head_group = 1;
  int64_t lead[kMaxDims] = {};
  int64_t row = 0, col = 0;
  int64_t dense_lead[kMaxDims] = {};
  int64_t dense_row = 0, dense_col = 0;
};

enum class Dropout : int { None = 0, ExplicitMask = 1, Random = 2 };

struct DevProblem {
  int lead_ndim = 0;
  int64_t lead_shape[kMaxDims] = {};
  int64_t num_lead = 0, L = 0, S = 0, E = 0, Ev = 0;
  DevOperand q, k, v, mask, dmask;        // inputs (mask/dmask: data == nullptr when absent)
  DevOperand out, probs, lse;             // forward outputs (lse: col unused)
  DevOperand grad_out, grad_probs;        // backward inputs (absent = zero)
  bool mask_is_bool = false;
  bool causal = false;
  Dropout dropout = Dropout::None;
  uint32_t drop_threshold = 0;
  double keep_scale = 1.0;  // c of contract §8/§9 (0 for random p = 1)
  double scale = 1.0;
  uint64_t seed = 0, offset = 0;
  const uint64_t* rng = nullptr;  // when set, seed and offset in device memory (AttentionOptions::rng_device)
};

// Where forward_stats writes the statistics of P (attention.h, StatsOutputs), with the output
// operands' strides (data nullptr: not wanted): column sums (*lead, S) and row entropy (*lead, L),
// and P's rows rows_first + k * rows_step, k < rows_count (*lead, rows_count, S). The Hopper
// statistics kernel (sm90/forward_sm90.cu) and the decode kernels (decode/) both take it.
struct StatsTargets {
  DevOperand col_sum, entropy, rows;
  int64_t rows_first = 0, rows_step = 1, rows_count = 0;
};

#define SDPA_MATH_D __device__ __forceinline__

// The device twin of core::unravel (src/core/validate.cpp): the offset of lead index `lead`.
// Host code may call it too (the fp32 path checks its layouts with it), as output_factor.
// NARROW divides in 32 bits where the index and the extent fit (every real shape; a 64-bit
// division is a long call on the GPU): lead_off_narrow, for decode_partial_tc,
// decode_finalize_rows and the Hopper backward's delta_rows, whose warps each compute a few
// offsets and little else. The other kernels keep the 64-bit form: with the 32-bit one their
// register spills moved both ways and their times did not change by more than the machine's
// run-to-run spread, so the narrower form bought nothing measurable there.
template <bool NARROW = false>
SDPA_MATH_HD int64_t unravel(const DevProblem& p, const int64_t* strides, int64_t group, int64_t lead) {
  int64_t off = 0;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    const int64_t n = p.lead_shape[d];
    int64_t c;
    if (NARROW && ((lead | n) >> 31) == 0) {
      const uint32_t l32 = static_cast<uint32_t>(lead), n32 = static_cast<uint32_t>(n);
      c = l32 % n32;
      lead = l32 / n32;
    } else {
      c = lead % n;
      lead /= n;
    }
    if (d == p.lead_ndim - 1) c /= group;
    off += c * strides[d];
  }
  return off;
}
SDPA_MATH_HD int64_t lead_off(const DevProblem& p, const DevOperand& op, int64_t lead) {
  return unravel(p, op.lead, op.head_group, lead);
}
SDPA_MATH_HD int64_t lead_off_narrow(const DevProblem& p, const DevOperand& op, int64_t lead) {
  return unravel<true>(p, op.lead, op.head_group, lead);
}
SDPA_MATH_D int64_t dense_lead_off(const DevProblem& p, const DevOperand& op, int64_t lead) {
  return unravel(p, op.dense_lead, op.head_group, lead);
}

// Any floating (or bool) element to Acc, and back.
template <typename Acc>
SDPA_MATH_D Acc load_elem(DType t, const char* base, int64_t i) {
  switch (t) {
    case DType::Float16: return static_cast<Acc>(__half2float(reinterpret_cast<const __half*>(base)[i]));
    case DType::BFloat16: return static_cast<Acc>(__bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]));
    case DType::Float32: return static_cast<Acc>(reinterpret_cast<const float*>(base)[i]);
    case DType::Float64: return static_cast<Acc>(reinterpret_cast<const double*>(base)[i]);
    case DType::Bool: return reinterpret_cast<const uint8_t*>(base)[i] != 0 ? Acc(1) : Acc(0);
    default: return Acc(0);
  }
}
template <typename Acc>
SDPA_MATH_D void store_elem(DType t, char* base, int64_t i, Acc v) {
  switch (t) {
    case DType::Float16: reinterpret_cast<__half*>(base)[i] = __float2half_rn(static_cast<float>(v)); break;
    case DType::BFloat16: reinterpret_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
    case DType::Float32: reinterpret_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DType::Float64: reinterpret_cast<double*>(base)[i] = static_cast<double>(v); break;
    default: break;
  }
}

template <typename Acc>
SDPA_MATH_D Acc neg_inf() { return -static_cast<Acc>(INFINITY); }

// Contract §3-§5: the logit of (i, j) from the raw dot product q_i . k_j.
// mask_base is lead_off(mask) for the row's lead index.
template <typename Acc>
SDPA_MATH_D Acc masked_logit(const DevProblem& p, Acc dot, int64_t mask_base, int64_t i, int64_t j) {
  if (p.causal && j > i) return neg_inf<Acc>();
  Acc s = dot * static_cast<Acc>(p.scale);
  if (p.mask.data != nullptr) {
    const Acc m = load_elem<Acc>(p.mask.dtype, p.mask.data, mask_base + i * p.mask.row + j * p.mask.col);
    if (p.mask_is_bool) return m != Acc(0) ? s : neg_inf<Acc>();
    s += m;
  }
  return s;
}

// Contract §6: softmax from the row's log-sum-exp; a fully masked row (lse = -inf) is zeros.
template <typename Acc>
SDPA_MATH_D Acc prob_from_lse(Acc logit, Acc lse) {
  if (lse == neg_inf<Acc>()) return Acc(0);
  if constexpr (sizeof(Acc) == 8) return exp(logit - lse);
  else return __expf(logit - lse);
}

// The same from the row's max and sum, as the forward has them: exact also where m + log(l)
// rounds to m (rows whose logits are all near finfo.min). A fully masked row (l = 0) is zeros;
// a row with a NaN logit (l = NaN, see lse_combine) is NaN throughout, as the math op's softmax.
template <typename Acc>
SDPA_MATH_D Acc prob_from_max_sum(Acc logit, Acc m, Acc l) {
  if (l == Acc(0)) return Acc(0);
  if constexpr (sizeof(Acc) == 8) return exp(logit - m) / l;
  else return __expf(logit - m) / l;
}
// The same with the row's 1 / l taken once (kernels that write a whole row): inv_l from
// inv_row_sum, 0 for a fully masked row (whose P is zeros) and NaN for a NaN row.
SDPA_MATH_D float inv_row_sum(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }
SDPA_MATH_D float prob_from_max_inv_sum(float logit, float m, float inv_l) {
  return inv_l == 0.0f ? 0.0f : __expf(logit - m) * inv_l;
}

// P at a key the row does not attend to, for kernels that never form its logit (causal-hidden
// keys): zero, but NaN in a row with a NaN logit, since the math op's softmax is NaN over the
// whole row (its -inf there does not rescue the key).
template <typename Acc>
SDPA_MATH_D Acc prob_of_hidden_key(Acc l) {
  return l != l ? l : Acc(0);
}

// Contract §6 and the math op: the row's log-sum-exp from its max and sum; -inf for a fully
// masked row (l = 0), NaN for a row with a NaN logit (l = NaN).
template <typename Acc>
SDPA_MATH_D Acc lse_from_max_sum(Acc m, Acc l) {
  if (l > Acc(0)) {
    if constexpr (sizeof(Acc) == 8) return m + log(l);
    else return m + logf(l);
  }
  return l == Acc(0) ? neg_inf<Acc>() : l;
}

// The row's running (max, sum of exp) pair (m, l) combined with another (m2, l2); a logit s adds
// as (s, 1). -inf maxima carry no mass, so fully masked rows keep l = 0. A NaN logit makes the
// pair (NaN, NaN) for good: comparisons would otherwise skip it (m2 > m is false for NaN) and
// leave a finite max, where the math op's softmax gives a NaN row.
template <typename Acc>
SDPA_MATH_D void lse_combine(Acc& m, Acc& l, Acc m2, Acc l2) {
  if (m2 == neg_inf<Acc>()) return;
  if (m2 != m2 || m != m) {
    m = l = static_cast<Acc>(NAN);
    return;
  }
  if (m == neg_inf<Acc>()) {
    m = m2;
    l = l2;
    return;
  }
  if (m2 > m) {
    l = l * exp(m - m2) + l2;
    m = m2;
  } else {
    l += l2 * exp(m2 - m);
  }
}

// Contract §8/§9: the keep mask M of element (lead, i, j) as 0/1 (1 without dropout).
template <typename Acc>
SDPA_MATH_D Acc keep_of(const DevProblem& p, int64_t dmask_base, int64_t lead, int64_t i, int64_t j) {
  switch (p.dropout) {
    case Dropout::ExplicitMask:
      return load_elem<Acc>(p.dmask.dtype, p.dmask.data, dmask_base + i * p.dmask.row + j * p.dmask.col) != Acc(0)
                 ? Acc(1) : Acc(0);
    case Dropout::Random: {
      const uint64_t n = static_cast<uint64_t>((lead * p.L + i) * p.S + j);
      const uint64_t seed = p.rng ? __ldg(p.rng) : p.seed, offset = p.rng ? __ldg(p.rng + 1) : p.offset;
      return dropout_keep(seed, offset, n, p.drop_threshold) ? Acc(1) : Acc(0);
    }
    default: return Acc(1);
  }
}

// What forward returns as P for softmax value a and keep m, and W, the weight on V before the
// final factor (explicit-mask dropout scales O by c once at the end, as native does).
template <typename Acc>
SDPA_MATH_D Acc returned_prob(const DevProblem& p, Acc a, Acc m) {
  if (p.dropout == Dropout::Random) return a * m * static_cast<Acc>(p.keep_scale);
  return a * m;
}
template <typename Acc>
SDPA_MATH_HD Acc output_factor(const DevProblem& p) {
  return p.dropout == Dropout::ExplicitMask ? static_cast<Acc>(p.keep_scale) : Acc(1);
}

// Contract §11: dA from g = (dO . v_j) and dP, and the weight W_ij that multiplied V
// (dV = W^T dO).
template <typename Acc>
SDPA_MATH_D Acc grad_softmax(const DevProblem& p, Acc g, Acc dp, Acc m) {
  const Acc c = static_cast<Acc>(p.keep_scale);
  switch (p.dropout) {
    case Dropout::ExplicitMask: return m * (c * g + dp);
    case Dropout::Random: return c * m * (g + dp);
    default: return g + dp;
  }
}
template <typename Acc>
SDPA_MATH_D Acc value_weight(const DevProblem& p, Acc a, Acc m) {
  return p.dropout == Dropout::None ? a : a * m * static_cast<Acc>(p.keep_scale);
}

}  // namespace sdpa_math::cuda

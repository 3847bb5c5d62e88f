// The generic CUDA path (any dtype, any head size; fp32 and float64 accumulation).
#pragma once

#include "device_problem.cuh"
#include "launch.cuh"

namespace sdpa_math::cuda {

// Dense accumulation buffers of the backward (nullptr = not requested), zeroed by the caller,
// each of its operand's own shape and indexed by the operand's dense strides; delta has one
// entry per (lead, query row).
template <typename Acc>
struct BackwardBuffers {
  Acc* dq = nullptr;
  Acc* dk = nullptr;
  Acc* dv = nullptr;
  Acc* dmask = nullptr;
  Acc* delta = nullptr;
  // The tensor-core backward only: dK (dV) written straight into the gradient's own memory, in
  // the inputs' dtype, when it is contiguous and each of its rows belongs to one CTA (then dk (dv)
  // is nullptr: no accumulator, no zeroing, no conversion).
  void* dk_out = nullptr;
  void* dv_out = nullptr;
};

template <typename Acc>
void generic_forward(const DevProblem& p, cudaStream_t stream);
// delta = rowsum(A . dA) alone, recomputed from Q, K, V (when O and P are not at hand).
template <typename Acc>
void generic_delta(const DevProblem& p, Acc* delta, cudaStream_t stream);
template <typename Acc>
void generic_backward(const DevProblem& p, const BackwardBuffers<Acc>& g, cudaStream_t stream);

}  // namespace sdpa_math::cuda

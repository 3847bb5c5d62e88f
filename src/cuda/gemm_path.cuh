// The fp32 path: attention as batched fp32 matrix products on cuBLAS (CUDA cores, never TF32: the
// contract keeps fp32 accuracy) around row kernels that apply the contract's rules. The forward
// computes the scores in P's own memory, turns each row into probabilities in place, then O = P V;
// the backward reads the saved P and needs one L x S scratch (dO V^T, then dS in place). It takes
// fp32 problems whose heads are evenly spaced in memory (one batch stride per operand; GQA as the
// G query heads of a key head stacked into one batch of G L rows); the generic path takes the
// rest.
#pragma once

#include <functional>

#include "../core/problem.h"
#include "device_problem.cuh"

namespace sdpa_math::cuda {

// Why the forward (backward) does not take the problem, or nullptr; the plan runs it only on
// problems it takes.
const char* gemm_forward_declines(const DevProblem& dp);
const char* gemm_backward_declines(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out);
void gemm_forward(const DevProblem& dp, cudaStream_t stream);
// `scratch(n)` returns n floats of device memory (uninitialised) that live until the call ends.
void gemm_backward(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out,
                   const std::function<float*(int64_t)>& scratch, cudaStream_t stream);

}  // namespace sdpa_math::cuda

// The tensor-core kernels (fp16 and bf16 inputs, mma.sync m16n8k16 with fp32 accumulation,
// sm_80 and newer): sm80/forward_sm80.cu and sm80/backward_sm80.cu. Each entry returns false
// when the problem is not one they take (dtype, head size), and the caller runs the generic path
// instead.
#pragma once

#include "device_problem.cuh"
#include "generic.cuh"

namespace sdpa_math::cuda {

// The largest head size (E and Ev) the tensor-core kernels take.
constexpr int64_t kTensorCoreMaxHead = 256;

bool tensor_core_forward(const DevProblem& p, cudaStream_t stream);
// Whether tensor_core_backward takes the problem (dtype, head size, dtypes of dO, dP and P).
bool tensor_core_backward_applies(const DevProblem& p);
bool tensor_core_backward(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream);
inline bool tensor_core_backward(const DevProblem&, const BackwardBuffers<double>&, cudaStream_t) { return false; }

}  // namespace sdpa_math::cuda

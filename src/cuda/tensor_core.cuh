// The tensor-core kernels (fp16 and bf16 inputs, mma.sync m16n8k16 with fp32 accumulation,
// sm_80 and newer): sm80/forward_sm80.cu and sm80/backward_sm80.cu. Each path says why it would
// not take a problem (route.h); the backend's plan runs it only on problems it takes.
#pragma once

#include "device_problem.cuh"
#include "generic.cuh"

namespace sdpa_math::cuda {

// The largest head size (E and Ev) the tensor-core kernels take.
constexpr int64_t kTensorCoreMaxHead = 256;

// Why the forward does not take the problem, or nullptr: fp16/bf16, 0 < E, head sizes up to 256,
// a key tile that fits the device's shared memory; any strides, masks and dropout.
const char* tensor_core_forward_declines(const DevProblem& p);
void tensor_core_forward(const DevProblem& p, cudaStream_t stream);
// The same of the backward: also dO, P and dP in the inputs' dtype.
const char* tensor_core_backward_declines(const DevProblem& p);
// delta = rowsum(A . dA) into g.delta (zeroed): from the saved O and P where given, else
// recomputed. The tensor-core and decode backwards start from it.
void tensor_core_delta(const DevProblem& p, float* delta, cudaStream_t stream);
void tensor_core_backward(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream);

}  // namespace sdpa_math::cuda

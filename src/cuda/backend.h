// The CUDA backend (built when CMake finds a CUDA compiler): fp16/bf16 on tensor cores where the
// head size allows (split over keys for up to 4 query rows), fp32 on cuBLAS products where the
// layout allows, everything else on the generic path; route.h orders the paths. Kernels run on
// the given stream.
#pragma once

#include "../core/problem.h"

namespace sdpa_math::cuda {

void forward(const core::Problem& p, const ForwardOutputs& out, const CudaExecution& ex);
void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out, const CudaExecution& ex);
// Statistics of P without writing it: up to 4 query rows on the decode kernels (decode/stats.cu,
// any GPU), more on the Hopper kernel (sm90/forward_sm90.cu, STATS); throws BackendUnavailable,
// before anything is written, for a problem no kernel takes.
void forward_stats(const core::Problem& p, const StatsOutputs& out, const CudaExecution& ex);
// The plan each of the three would run (route.h), as attention.h's Route.
Route explain_forward(const core::Problem& p, const ForwardOutputs& out);
Route explain_backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out);
Route explain_stats(const core::Problem& p, const StatsOutputs& out);
// What the statistics kernels take, for error messages.
inline constexpr const char* stats_kernel_requirements =
    "(up to 4 query rows: float16, bfloat16 or float32 inputs, head sizes up to 256, k and v with unit column "
    "stride and 16-byte aligned rows; more rows: a Hopper GPU (compute capability 9.0) and a build with its "
    "kernels; float16 or bfloat16 inputs "
    "without dropout; head sizes E and Ev that are multiples of 8, up to 128, both at most 64 or both above; "
    "q, k and v with unit column stride and 16-byte aligned strides; a mask that is bool, float32 or the "
    "inputs' dtype with even row strides; float32 statistics; rows in the inputs' dtype with an even key count)";

// kl_to's pieces (attention.h): the KL's rows on any GPU (kl.cu); the gradient on the Hopper
// backward's KL form (throws BackendUnavailable, before anything is written, elsewhere).
void kl_rows(const KlRowsArgs& args, const TensorView& kl, const TensorView& row_sum, const CudaExecution& ex);
void softmax_rows(const SoftmaxRowsArgs& args, const TensorView& out, const CudaExecution& ex);
void kl_backward(const core::Problem& p, const KlBackwardArgs& args, const BackwardOutputs& out, const CudaExecution& ex);
bool kl_backward_applies(const core::Problem& p, const KlBackwardArgs& args);
void kl_forward(const core::Problem& p, const KlForwardArgs& args, const TensorView& kl, const TensorView& row_sum,
                const CudaExecution& ex);
bool kl_forward_applies(const core::Problem& p, const KlForwardArgs& args);

// cuBLAS handles this process has created (gemm_path.cu's pool), for tests.
int64_t cublas_handles_created();

}  // namespace sdpa_math::cuda

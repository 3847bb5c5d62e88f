// The CUDA backend (built when CMake finds a CUDA compiler): fp16/bf16 on tensor cores where the
// head size allows (split over keys for up to 4 query rows), fp32 on cuBLAS products where the
// layout allows, everything else on the generic path. Kernels run on the given stream.
#pragma once

#include "../core/problem.h"

namespace sdpa_math::cuda {

void forward(const core::Problem& p, const ForwardOutputs& out, const CudaExecution& ex);
void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out, const CudaExecution& ex);
// cuBLAS handles this process has created (gemm_path.cu's pool), for tests.
int64_t cublas_handles_created();

}  // namespace sdpa_math::cuda

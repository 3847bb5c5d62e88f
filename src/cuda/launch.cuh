// Host-side helpers shared by the CUDA launchers: error checks and shared-memory opt-in.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sdpa_math/error.h"

namespace sdpa_math::cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw Error(ErrorCode::CudaFailure, std::string(what) + ": " + cudaGetErrorString(err));
}

inline void check_launch(const char* kernel) {
  check_cuda(cudaGetLastError(), (std::string("launching the ") + kernel + " kernel").c_str());
}

// Kernels using more than 48 KB of dynamic shared memory must opt in.
inline void set_smem_limit(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
               "raising the shared-memory limit");
}

}  // namespace sdpa_math::cuda

// SDPA_MATH_HD: a small function the CPU code and the CUDA kernels share (compiled for both by
// nvcc, inline for the host compiler). One definition for every header that needs it.
#pragma once

#if defined(__CUDACC__)
#define SDPA_MATH_HD __host__ __device__ __forceinline__
#else
#define SDPA_MATH_HD inline
#endif

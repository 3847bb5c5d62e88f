// How many base-2 exponentials an H200 SM takes per clock: MUFU.EX2 (ex2.approx.ftz.f32) alone, a
// polynomial 2^x on the FMA pipe alone, and the two interleaved half and half. A measuring tool
// for the forward's softmax (how many exponentials a tile may cost), no sdpa_math code.
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -o mufu_rate tests/gpu/mufu_rate.cu && ./mufu_rate
//
// Each thread runs 8 independent chains (x <- 2^x · c, kept in a narrow range) so latency is hidden
// by the chains; one CTA per SM; cycles from clock64 around the loop, exps per clock per SM from
// the slowest warp of the CTA.
#include <cuda_runtime.h>

#include <cstdio>

__device__ __forceinline__ float ex2_mufu(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x for x <= 0 on the FMA and integer pipes only: x = j + f with j = round(x) taken by the
// 1.5 · 2^23 trick (no F2I or FRND, which run at the MUFU's rate), 2^f for |f| <= 1/2 by a degree-5
// polynomial (Taylor coefficients: relative error about 2e-6, enough for counting throughput), and
// j added to the exponent bits.
__device__ __forceinline__ float ex2_poly(float x) {
  x = fmaxf(x, -126.0f);
  const float t = x + 12582912.0f;  // j in the low mantissa bits
  const float f = x - (t - 12582912.0f);
  float p = 1.3333558146e-3f;
  p = fmaf(p, f, 9.6181291076e-3f);
  p = fmaf(p, f, 5.5504108665e-2f);
  p = fmaf(p, f, 2.4022650696e-1f);
  p = fmaf(p, f, 6.9314718056e-1f);
  p = fmaf(p, f, 1.0f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

template <int MODE>  // 0: MUFU, 1: polynomial, 2: half and half
__global__ void rate(float* out, long long* cycles, int iters) {
  float x[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) x[c] = -0.25f * (c + 1) - threadIdx.x * 1e-6f;
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float y = MODE == 0 ? ex2_mufu(x[c]) : MODE == 1 ? ex2_poly(x[c]) : (c & 1 ? ex2_poly(x[c]) : ex2_mufu(x[c]));
      x[c] = fmaf(y, -0.5f, -0.25f);  // back into [-0.75, -0.25]
    }
  }
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) s += x[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x % 32 == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = t1 - t0;
}

template <int MODE>
void measure(const char* name, int warps, int sms) {
  const int iters = 4096, threads = warps * 32;
  float* out;
  long long* cyc;
  cudaMalloc(&out, sizeof(float) * sms * threads);
  cudaMalloc(&cyc, sizeof(long long) * sms * warps);
  rate<MODE><<<sms, threads>>>(out, cyc, iters);  // warm
  rate<MODE><<<sms, threads>>>(out, cyc, iters);
  cudaDeviceSynchronize();
  long long* h = new long long[sms * warps];
  cudaMemcpy(h, cyc, sizeof(long long) * sms * warps, cudaMemcpyDeviceToHost);
  long long worst = 0;
  for (int i = 0; i < warps; ++i) worst = h[i] > worst ? h[i] : worst;  // CTA 0's slowest warp
  const double exps = double(iters) * 8 * threads;
  printf("%-14s %2d warps/SM: %8lld cycles, %.2f exps per clock per SM (%.1f cycles per warp-wide exp per SMSP)\n", name,
         warps, worst, exps / worst, double(worst) / (iters * 8.0 * warps / 4));
  delete[] h;
  cudaFree(out);
  cudaFree(cyc);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int warps : {4, 8, 16}) {
    measure<0>("MUFU.EX2", warps, sms);
    measure<1>("FMA polynomial", warps, sms);
    measure<2>("half and half", warps, sms);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

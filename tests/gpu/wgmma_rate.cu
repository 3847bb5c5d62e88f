// How fast one warpgroup's chain of wgmma products runs on an H200 SM, alone and beside other
// warpgroups doing the same: the forward's products (S = Q Kᵀ: m64 x n x k128, operands in shared
// memory) issued as the forward issues them (k/16 instructions, commit, wait for the group), for
// n = 128 (the kernel's key tiles) and n = 64 (half-size tiles). A measuring tool for the forward's
// design (what a tile's products cost at each occupancy), built on the kernels' own wrappers (src/cuda/sm90/hopper.cuh).
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -Iinclude -Isrc -o wgmma_rate tests/gpu/wgmma_rate.cu && ./wgmma_rate
//
// One CTA per SM; each warpgroup runs `iters` products on its own A tile against a shared B tile
// (zeros: the values do not change the rate). Cycles from clock64 around the loop, the slowest
// warpgroup of CTA 0; the SM's share adds the warpgroups' multiply-adds per clock up against 2048,
// the dense fp16 rate (989 TFLOP/s at 1.83 GHz over 132 SMs).
#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/sm90/hopper.cuh"

using namespace sdpa_math::cuda::sm90;

constexpr int kK = 128;  // the head size (the products' k)

// DEPTH products in flight per warpgroup: 1 = issue, commit, wait for it (the forward's way);
// 2 = the next product is issued before the last one is waited for.
template <int N, int DEPTH>
__global__ void __launch_bounds__(384, 1) rate(long long* cycles, float* sink, int iters) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int wg = threadIdx.x / 128;
  const int wgs = blockDim.x / 128;
  __half* b_tile = reinterpret_cast<__half*>(base);                    // [kK / 64 blocks][N rows][64]
  __half* a_tiles = reinterpret_cast<__half*>(base + N * kK * 2);      // per warpgroup [kK / 64][64][64]
  for (int i = threadIdx.x; i < (N * kK + wgs * 64 * kK) / 2; i += blockDim.x) reinterpret_cast<uint32_t*>(base)[i] = 0u;
  __syncthreads();
  const __half* a = a_tiles + wg * 64 * kK;
  float d[DEPTH][N / 2];
#pragma unroll
  for (int j = 0; j < DEPTH; ++j)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[j][i] = 0.0f;
  auto issue = [&](float (&acc)[N / 2]) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
      const int blk = kk / 4, off = (kk % 4) * 16;
      Wgmma<__half, N>::template ss<0, 0>(acc, desc_sw128(a + blk * 64 * 64 + off, 16, 1024),
                                          desc_sw128(b_tile + blk * N * 64 + off, 16, 1024), 1);
    }
    wgmma_commit();
  };
  __syncthreads();
  const long long t0 = clock64();
  if constexpr (DEPTH == 1) {
    for (int it = 0; it < iters; ++it) {
      fence_regs(d[0]);
      issue(d[0]);
      wgmma_wait<0>();
      fence_regs(d[0]);
    }
  } else {
    fence_regs(d[0]);
    issue(d[0]);
    for (int it = 1; it < iters; it += 2) {
      fence_regs(d[1]);
      issue(d[1]);
      wgmma_wait<1>();
      fence_regs(d[0]);
      issue(d[0]);
      wgmma_wait<1>();
      fence_regs(d[1]);
    }
    wgmma_wait<0>();
    fence_regs(d[0]);
  }
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < DEPTH; ++j)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s += d[j][i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 3 + wg] = t1 - t0;
}

template <int N, int DEPTH>
void measure(int wgs, int sms) {
  const int iters = 2048;
  long long* cyc;
  float* sink;
  cudaMalloc(&cyc, sizeof(long long) * sms * 3);
  cudaMalloc(&sink, sizeof(float) * sms * 384);
  const size_t smem = 1024 + N * kK * 2 + wgs * 64 * kK * 2;
  cudaFuncSetAttribute(rate<N, DEPTH>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  rate<N, DEPTH><<<sms, 128 * wgs, smem>>>(cyc, sink, iters);  // warm
  rate<N, DEPTH><<<sms, 128 * wgs, smem>>>(cyc, sink, iters);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return;
  }
  long long h[3] = {0, 0, 0};
  cudaMemcpy(h, cyc, sizeof(h), cudaMemcpyDeviceToHost);  // CTA 0
  long long worst = 0;
  for (int w = 0; w < wgs; ++w) worst = h[w] > worst ? h[w] : worst;
  const double fma_per_product = 64.0 * N * kK;
  const double per_product = double(worst) / iters;
  printf("m64 n%-3d k%d, %d in flight, %d warpgroup(s): %6.0f cycles a product per warpgroup; SM at %4.0f %% of 2048 FMA/clock\n",
         N, kK, DEPTH, wgs, per_product, 100.0 * wgs * fma_per_product / per_product / 2048.0);
  cudaFree(cyc);
  cudaFree(sink);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int wgs : {1, 2, 3}) {
    measure<128, 1>(wgs, sms);
    measure<64, 1>(wgs, sms);
    measure<128, 2>(wgs, sms);
    measure<64, 2>(wgs, sms);
  }
  return 0;
}

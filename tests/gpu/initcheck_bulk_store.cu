// Does compute-sanitizer's initcheck follow global memory written by the bulk-copy (TMA) unit?
// Three kernels fill one 8 KiB buffer each: (a) ordinary st.global from registers; (b) shared
// memory, then one non-tensor bulk copy to global (cp.async.bulk.global.shared::cta); (c) shared
// memory, then one TMA tensor store (cp.async.bulk.tensor.2d.global.shared::cta) of a 64 x 64 fp16
// box. The host checks every byte came back right, and copies each buffer to the host: under
//     compute-sanitizer --tool initcheck ./initcheck_bulk_store
// a report of "uninitialized ... cudaMemcpy source" for (b) or (c) but not (a), with the values
// correct, means initcheck does not see writes made by the bulk-copy unit. Standalone on purpose:
// nothing of sdpa_math is involved. Build: nvcc -arch=sm_90a -o initcheck_bulk_store initcheck_bulk_store.cu
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kRows = 64, kCols = 64, kElems = kRows * kCols;  // fp16: 8 KiB

__device__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__global__ void plain_store(__half* out) {
  for (int i = threadIdx.x; i < kElems; i += blockDim.x) out[i] = __float2half(static_cast<float>(i % 1000));
}

__global__ void bulk_store(__half* out) {
  __shared__ alignas(128) __half tile[kElems];
  for (int i = threadIdx.x; i < kElems; i += blockDim.x) tile[i] = __float2half(static_cast<float>(i % 1000));
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(out), "r"(smem_addr(tile)),
                 "r"(static_cast<uint32_t>(kElems * 2))
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

__global__ void tensor_store(const __grid_constant__ CUtensorMap map) {
  __shared__ alignas(128) __half tile[kElems];
  for (int i = threadIdx.x; i < kElems; i += blockDim.x) tile[i] = __float2half(static_cast<float>(i % 1000));
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(&map)),
                 "r"(smem_addr(tile)), "r"(0), "r"(0)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
}

static bool check(const char* what, cudaError_t e) {
  if (e != cudaSuccess) std::printf("%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

int main() {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (!check("entry point", cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found)))
    return 1;
  __half* buf[3];
  for (auto& b : buf)
    if (!check("malloc", cudaMalloc(&b, kElems * 2))) return 1;
  CUtensorMap map;
  const cuuint64_t dims[2] = {kCols, kRows}, strides[1] = {kCols * 2};
  const cuuint32_t box[2] = {kCols, kRows}, unit[2] = {1, 1};
  if (reinterpret_cast<Encode>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, buf[2], dims, strides, box, unit,
                                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                   CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::printf("encoding the tensor map failed\n");
    return 1;
  }
  plain_store<<<1, 128>>>(buf[0]);
  bulk_store<<<1, 128>>>(buf[1]);
  tensor_store<<<1, 128>>>(map);
  if (!check("kernels", cudaDeviceSynchronize())) return 1;
  const char* names[3] = {"plain st.global", "bulk copy", "TMA tensor store"};
  int bad = 0;
  for (int k = 0; k < 3; ++k) {
    std::vector<__half> host(kElems);
    std::printf("copying back the buffer written by %s\n", names[k]);
    std::fflush(stdout);
    if (!check("memcpy", cudaMemcpy(host.data(), buf[k], kElems * 2, cudaMemcpyDeviceToHost))) return 1;
    int wrong = 0;
    for (int i = 0; i < kElems; ++i) wrong += __half2float(host[i]) != static_cast<float>(i % 1000);
    std::printf("  %s: %d of %d elements wrong\n", names[k], wrong, kElems);
    bad += wrong;
  }
  return bad == 0 ? 0 : 2;
}

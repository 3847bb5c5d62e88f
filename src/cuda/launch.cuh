// Host-side helpers shared by the CUDA launchers: error checks and shared-memory opt-in.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
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

// Runs on the tensors' device, its primary context current on this thread; restores the
// caller's current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    // cudaSetDevice even when the device is already the current one: a thread that has made no
    // runtime call that needs a context yet (autograd's device thread, when our backward is the
    // first op it runs) reports device 0 with no context bound, and the driver's tensor-map
    // encoder then fails, so the Hopper kernels were declined there (kl_to's backward as the
    // first op of that thread raised "the TMA unit cannot address q or k").
    if (index >= 0) {
      check_cuda(cudaSetDevice(index), "cudaSetDevice");
      changed_ = index != previous_;
    }
  }
  // Restores only what the constructor changed: an unconditional cudaSetDevice(previous) would
  // create a context on the previous device (cuda:0 by default) when all work is on another.
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// The most shared memory one block of the current device may have (dynamic, after opting in):
// 227 KB on Hopper, 163 KB on A100, 99 KB on RTX 30/40, L4 and L40S. The launchers pick tiles
// that fit it. SDPA_MATH_SMEM_LIMIT (bytes) lowers it, to run a smaller GPU's tile choices on a
// bigger one (tests/python/test_cuda.py).
inline size_t smem_optin_limit() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0: not read yet
  static const long long lowered = [] {
    const char* env = std::getenv("SDPA_MATH_SMEM_LIMIT");
    return env && *env ? std::atoll(env) : 0LL;
  }();
  int device = 0;
  check_cuda(cudaGetDevice(&device), "reading the current device");
  int bytes = device < kMaxDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (bytes == 0) {
    check_cuda(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "reading the shared-memory limit");
    if (device < kMaxDevices) cached[device].store(bytes, std::memory_order_relaxed);
  }
  return lowered > 0 && lowered < bytes ? static_cast<size_t>(lowered) : static_cast<size_t>(bytes);
}

// The x dimension of a grid of `blocks` blocks. CUDA takes at most 2^31 - 1 there (65535 in y
// and z): a problem that needs more gets an error naming the kernel, before anything runs, and
// the count never wraps around in a cast. Every launcher sizes its grid through these.
inline unsigned grid_x(int64_t blocks, const char* kernel) {
  if (blocks > 2147483647LL)
    throw Error(ErrorCode::CudaFailure, std::string("too many blocks for one launch of the ") + kernel + " kernel (" +
                                            std::to_string(blocks) + " > 2^31 - 1)");
  return static_cast<unsigned>(blocks);
}
inline unsigned grid_yz(int64_t blocks, const char* kernel) {
  if (blocks > 65535)
    throw Error(ErrorCode::CudaFailure, std::string("too many blocks in the second grid dimension of the ") + kernel +
                                            " kernel (" + std::to_string(blocks) + " > 65535)");
  return static_cast<unsigned>(blocks);
}

// Kernels using more than 48 KB of dynamic shared memory must opt in.
inline void set_smem_limit(const void* kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
               "raising the shared-memory limit");
}

}  // namespace sdpa_math::cuda

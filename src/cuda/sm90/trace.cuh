// A timeline of the Hopper forward's steps, for finding where its time goes (a measuring tool,
// not part of the product): built only with -DSDPA_MATH_FWD_TRACE, otherwise every stamp is empty.
//
// In a trace build each of the first kCtas CTAs records, for its producer thread and the first
// thread of each consumer warpgroup, a stamp per step: clock64() (the SM's own cycle counter) in
// the low 56 bits and the step's code in the top 8. The launch then waits for the kernel, copies the
// stamps back and writes them to the file named by SDPA_MATH_TRACE_FILE (overwritten by each
// launch, so the file holds the last one). tests/gpu/trace_forward.py runs a shape and reads the file.
//
// Included through forward_sm90_shell.cuh by the forward's translation units: each has a buffer
// of its own (an anonymous namespace), and a kernel's launch, in the unit that compiles the
// kernel (forward_sm90_kernel.cuh), clears and reads that one.
#pragma once

#include <cstdint>
#ifdef SDPA_MATH_FWD_TRACE
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>
#endif

namespace sdpa_math::cuda::sm90::trace {

constexpr int kCtas = 1024;  // CTAs traced (blockIdx.x below this)
constexpr int kRoles = 3;    // producer, consumer warpgroup 0, consumer warpgroup 1
constexpr int kSlots = 640;  // stamps per role and CTA (a 32-tile row block takes 14 a tile)

// Step codes. Producer: a K or V stage acquired (its empty barrier passed), just before its loads.
// Consumers, per tile of pass 1 (1x) and pass 2 (2x): loop top, K stage full, product turn
// acquired, product done, (pass 2:) P's buffer free, P staged, P's store issued, V stage full,
// P·V turn acquired, P·V done.
enum Code : uint8_t {
  kProdK = 1, kProdV = 2,
  kStart = 10,  // Q has arrived
  kP1Top = 11, kP1KFull = 12, kP1Turn = 13, kP1Done = 14,
  kP2Top = 21, kP2KFull = 22, kP2Turn = 23, kP2Done = 24, kP2Written = 25, kP2VFull = 26, kP2PvTurn = 27,
  kP2PvDone = 28,
  kEnd = 30,  // O stored
  kP2PFree = 31,    // pass 2: the P tile's shared memory free again (the last TMA store has read it)
  kP2PStaged = 32,  // pass 2: P's stmatrix stores issued
};

#ifdef SDPA_MATH_FWD_TRACE
namespace {
// [cta][role][slot]; info: [cta] = {SM id, globaltimer at start, globaltimer at end}.
__device__ unsigned long long g_stamps[kCtas][kRoles][kSlots];
__device__ unsigned long long g_info[kCtas][3];

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp(int role, int& slot, uint8_t code) {
  if (blockIdx.x < kCtas && slot < kSlots)
    g_stamps[blockIdx.x][role][slot++] = (static_cast<unsigned long long>(code) << 56) |
                                         (static_cast<unsigned long long>(clock64()) & ((1ull << 56) - 1));
}
__device__ __forceinline__ void cta_info(int which) {  // 1: start, 2: end
  if (blockIdx.x >= kCtas) return;
  if (which == 1) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    g_info[blockIdx.x][0] = sm;
  }
  g_info[blockIdx.x][which] = global_ns();
}

// The trace build's launch epilogue: wait for the kernel, write its stamps to SDPA_MATH_TRACE_FILE
// (header: "SDPAFWDT", then kCtas, kRoles, kSlots and the grid as int32; then the stamps, then
// the CTAs' info).
inline void write(cudaStream_t stream, unsigned grid) {
  const char* path = std::getenv("SDPA_MATH_TRACE_FILE");
  if (path == nullptr) return;
  std::vector<unsigned long long> stamps(size_t(kCtas) * kRoles * kSlots), info(kCtas * 3);
  cudaStreamSynchronize(stream);
  cudaMemcpyFromSymbol(stamps.data(), g_stamps, stamps.size() * 8);
  cudaMemcpyFromSymbol(info.data(), g_info, info.size() * 8);
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr) return;
  const int32_t head[4] = {kCtas, kRoles, kSlots, static_cast<int32_t>(grid)};
  std::fwrite("SDPAFWDT", 1, 8, f);
  std::fwrite(head, 4, 4, f);
  std::fwrite(stamps.data(), 8, stamps.size(), f);
  std::fwrite(info.data(), 8, info.size(), f);
  std::fclose(f);
}
inline void clear(cudaStream_t stream) {
  void* at = nullptr;
  cudaGetSymbolAddress(&at, g_stamps);
  cudaMemsetAsync(at, 0, sizeof(g_stamps), stream);
}
}  // namespace
#endif

}  // namespace sdpa_math::cuda::sm90::trace

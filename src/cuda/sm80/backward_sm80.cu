// The tensor-core backward's host side (fp16/bf16 on mma.sync, sm_80 and newer): which problems
// it takes (tensor_core_backward_declines); delta = rowsum(A . dA), which it and the decode
// backward take first (tensor_core_delta) -- from memory as rowsum(dO . O) + rowsum(P . dP) when
// the forward's O and P are given (delta_from_memory, the one kernel of this file), else
// recomputed on the generic path; then the choice of head tile and key block for the kernel. The kernel (backward_tc, its design and launch function) is in
// backward_sm80_kernel.cuh and compiles in the instantiation files
// (backward_sm80_<dtype>_d<head>.cu), one per dtype and head tile, so that a parallel build does
// not wait on one file of all ten tiles; this file declares their launch functions `extern
// template`.
#include "../launch.cuh"
#include "backward_sm80_kernel.cuh"

namespace sdpa_math::cuda {
namespace sm80 {

// The launch functions of the 10 tiles, compiled elsewhere (one file per dtype and head tile).
SDPA_MATH_SM80_BWD_TILE(extern template, __half, 64, 64)
SDPA_MATH_SM80_BWD_TILE(extern template, __half, 128, 64)
SDPA_MATH_SM80_BWD_TILE(extern template, __half, 128, 32)
SDPA_MATH_SM80_BWD_TILE(extern template, __half, 256, 32)
SDPA_MATH_SM80_BWD_TILE(extern template, __half, 256, 16)
SDPA_MATH_SM80_BWD_TILE(extern template, __nv_bfloat16, 64, 64)
SDPA_MATH_SM80_BWD_TILE(extern template, __nv_bfloat16, 128, 64)
SDPA_MATH_SM80_BWD_TILE(extern template, __nv_bfloat16, 128, 32)
SDPA_MATH_SM80_BWD_TILE(extern template, __nv_bfloat16, 256, 32)
SDPA_MATH_SM80_BWD_TILE(extern template, __nv_bfloat16, 256, 16)

}  // namespace sm80

namespace {

using sm80::BackwardFlags;
using sm80::key_block_fits;
using sm80::kThreads;
using sm80::launch_backward;

// delta_i = dO_i . O_i + P_i . dP_i, G lanes per row: a warp, or the whole CTA for rows as long
// as decode's (few rows of many keys, where a warp per row left the chip idle). P and dP move 16
// bytes a lane where their rows are contiguous and aligned, with independent sums in flight.
template <typename T, int G>
__global__ void __launch_bounds__(kThreads) delta_from_memory(DevProblem p, float* delta) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads / G) + threadIdx.x / G;
  const int t = threadIdx.x % G;
  const bool live = row < p.num_lead * p.L;  // the same for all G lanes of a row
  float acc = 0.0f;
  if (live) {
    const int64_t lead = row / p.L, i = row % p.L;
    if (p.grad_out.data) {
      const int64_t go = lead_off(p, p.grad_out, lead) + i * p.grad_out.row, o = lead_off(p, p.out, lead) + i * p.out.row;
      for (int64_t e = t; e < p.Ev; e += G)
        acc += load_elem<float>(p.grad_out.dtype, p.grad_out.data, go + e * p.grad_out.col) *
               load_elem<float>(p.out.dtype, p.out.data, o + e * p.out.col);
    }
    if (p.grad_probs.data) {
      const T* gp = reinterpret_cast<const T*>(p.grad_probs.data) + lead_off(p, p.grad_probs, lead) + i * p.grad_probs.row;
      const T* pr = reinterpret_cast<const T*>(p.probs.data) + lead_off(p, p.probs, lead) + i * p.probs.row;
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      int64_t j_tail = 0;
      if (p.grad_probs.col == 1 && p.probs.col == 1 && reinterpret_cast<uintptr_t>(gp) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(pr) % 16 == 0) {
        const int64_t chunks = p.S / 8;
        for (int64_t c = t; c < chunks; c += G) {
          const uint4 x = __ldg(reinterpret_cast<const uint4*>(gp) + c), y = __ldg(reinterpret_cast<const uint4*>(pr) + c);
          T xs[8], ys[8];
          memcpy(xs, &x, 16);
          memcpy(ys, &y, 16);
#pragma unroll
          for (int n = 0; n < 8; ++n) part[n % 4] += to_float<T>(xs[n]) * to_float<T>(ys[n]);
        }
        j_tail = chunks * 8;
      }
#pragma unroll 4
      for (int64_t j = j_tail + t; j < p.S; j += G)
        part[0] += to_float<T>(gp[j * p.grad_probs.col]) * to_float<T>(pr[j * p.probs.col]);
      acc += (part[0] + part[1]) + (part[2] + part[3]);
    }
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if constexpr (G > 32) {
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0 && live) {
      float total = 0.0f;
      for (int w = 0; w < kThreads / 32; ++w) total += red[w];
      delta[row] = total;
    }
  } else {
    if (t == 0 && live) delta[row] = acc;
  }
}

template <typename T>
void launch_delta_from_memory(const DevProblem& p, float* delta, cudaStream_t stream) {
  const int64_t rows = p.num_lead * p.L;
  if (p.S >= 1024) delta_from_memory<T, kThreads><<<grid_x(rows, "delta"), kThreads, 0, stream>>>(p, delta);
  else delta_from_memory<T, 32><<<grid_x((rows + 3) / 4, "delta"), kThreads, 0, stream>>>(p, delta);
  check_launch("delta");
}

template <typename T>
void backward_for(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  BackwardFlags f;
  f.q_vec = rows_vectorizable(p.q, p.lead_ndim, p.E, 2, 8);
  f.k_vec = rows_vectorizable(p.k, p.lead_ndim, p.E, 2, 8);
  f.v_vec = rows_vectorizable(p.v, p.lead_ndim, p.Ev, 2, 8);
  f.go_vec = rows_vectorizable(p.grad_out, p.lead_ndim, p.Ev, 2, 8);
  // P and dP tiles start at key j0 (a multiple of 8): their rows move 16 bytes at a time when
  // S is a multiple of 8 too.
  f.p_vec = rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 8);
  f.gp_vec = rows_vectorizable(p.grad_probs, p.lead_ndim, p.S, 2, 8);
  f.a_from_probs = p.probs.data != nullptr && p.dropout == Dropout::None;
  const bool general = p.mask.data != nullptr || p.dropout != Dropout::None || !f.a_from_probs;
  if (head <= 64) launch_backward<T, 64, 64>(p, g, f, general, stream);
  else if (head <= 128 && key_block_fits<T, 128, 64>()) launch_backward<T, 128, 64>(p, g, f, general, stream);
  else if (head <= 128) launch_backward<T, 128, 32>(p, g, f, general, stream);
  else if (key_block_fits<T, 256, 32>()) launch_backward<T, 256, 32>(p, g, f, general, stream);
  else launch_backward<T, 256, 16>(p, g, f, general, stream);
}

}  // namespace

const char* tensor_core_backward_declines(const DevProblem& p) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return "inputs not float16 or bfloat16";
  if (p.E == 0) return "head size E = 0";
  if (head > kTensorCoreMaxHead) return "a head size above 256";
  // The narrowest key block of the head tile must fit the device's shared memory (fp16 and bf16
  // alike).
  const bool fits = head <= 64    ? key_block_fits<__half, 64, 64>()
                    : head <= 128 ? key_block_fits<__half, 128, 32>()
                                  : key_block_fits<__half, 256, 16>();
  if (!fits) return "no key block of the head size fits this GPU's shared memory";
  // dO, P and dP are read as tiles of the inputs' dtype.
  if ((p.grad_out.data && p.grad_out.dtype != p.q.dtype) || (p.grad_probs.data && p.grad_probs.dtype != p.q.dtype) ||
      (p.probs.data && p.probs.dtype != p.q.dtype))
    return "dO, dP or the saved P not in the inputs' dtype";
  return nullptr;
}

void tensor_core_delta(const DevProblem& p, float* delta, cudaStream_t stream) {
  if (p.num_lead * p.L == 0) return;
  const bool delta_in_memory = (!p.grad_out.data || p.out.data) && (!p.grad_probs.data || p.probs.data);
  if (!delta_in_memory) generic_delta<float>(p, delta, stream);
  else if (p.q.dtype == DType::Float16) launch_delta_from_memory<__half>(p, delta, stream);
  else launch_delta_from_memory<__nv_bfloat16>(p, delta, stream);
}

void tensor_core_backward(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream) {
  if (p.num_lead * p.L == 0) return;
  if (p.q.dtype == DType::Float16) backward_for<__half>(p, g, stream);
  else backward_for<__nv_bfloat16>(p, g, stream);
}

}  // namespace sdpa_math::cuda

// The tensor-core forward's host side (fp16/bf16 on mma.sync, sm_80 and newer): which problems it
// takes (tensor_core_forward), the kernel's flags, and the choice of head tile and of the widest
// key tile that fits the device's shared memory. The kernel (forward_tc, its design and launch
// function) is in forward_sm80_kernel.cuh and compiles in the instantiation files
// (forward_sm80_<dtype>_d<head>.cu), one per dtype and head tile, so that a parallel build does
// not wait on one file of all the tiles; this file declares their launch functions `extern
// template`.
#include "../launch.cuh"
#include "forward_sm80_kernel.cuh"

namespace sdpa_math::cuda {
namespace sm80 {

// The launch functions of the 8 tiles, compiled elsewhere (one file per dtype and head tile).
SDPA_MATH_SM80_FWD_TILE(extern template, __half, 64, 64)
SDPA_MATH_SM80_FWD_TILE(extern template, __half, 128, 64)
SDPA_MATH_SM80_FWD_TILE(extern template, __half, 256, 32)
SDPA_MATH_SM80_FWD_TILE(extern template, __half, 256, 16)
SDPA_MATH_SM80_FWD_TILE(extern template, __nv_bfloat16, 64, 64)
SDPA_MATH_SM80_FWD_TILE(extern template, __nv_bfloat16, 128, 64)
SDPA_MATH_SM80_FWD_TILE(extern template, __nv_bfloat16, 256, 32)
SDPA_MATH_SM80_FWD_TILE(extern template, __nv_bfloat16, 256, 16)

}  // namespace sm80

namespace {

using sm80::ForwardFlags;
using sm80::forward_smem_bytes;
using sm80::kBM;
using sm80::launch_forward;

// The first key-tile width BN, from the widest, whose tiles fit the device's shared memory (with
// the kernel's static nan_row); false when none does, and a later path takes the problem.
template <typename T, int DT, int BN, int... Narrower>
bool launch_fitting(const DevProblem& p, const ForwardFlags& f, bool general, cudaStream_t stream) {
  if (forward_smem_bytes<T, DT, BN>() + kBM * sizeof(bool) <= smem_optin_limit()) {
    launch_forward<T, DT, BN>(p, f, general, stream);
    return true;
  }
  if constexpr (sizeof...(Narrower) > 0) return launch_fitting<T, DT, Narrower...>(p, f, general, stream);
  return false;
}

template <typename T>
bool forward_for(const DevProblem& p, cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  ForwardFlags f;
  f.q_vec = rows_vectorizable(p.q, p.lead_ndim, p.E, 2, 8);
  f.k_vec = rows_vectorizable(p.k, p.lead_ndim, p.E, 2, 8);
  f.v_vec = rows_vectorizable(p.v, p.lead_ndim, p.Ev, 2, 8);
  const bool same = p.probs.dtype == p.q.dtype;
  f.p_pair = same && rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 2);
  f.p_vec8 = same && rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 8);
  const bool general = p.mask.data != nullptr || p.dropout != Dropout::None || !f.p_pair;
  if (head <= 64) return launch_fitting<T, 64, 64>(p, f, general, stream);
  if (head <= 128) return launch_fitting<T, 128, 64>(p, f, general, stream);
  return launch_fitting<T, 256, 32, 16>(p, f, general, stream);  // 16 keys: 99 KB GPUs (RTX 30/40, L4)
}

}  // namespace

bool tensor_core_forward(const DevProblem& p, cudaStream_t stream) {
  if ((p.E > p.Ev ? p.E : p.Ev) > kTensorCoreMaxHead || p.E == 0) return false;
  if (p.q.dtype == DType::Float16) return forward_for<__half>(p, stream);
  if (p.q.dtype == DType::BFloat16) return forward_for<__nv_bfloat16>(p, stream);
  return false;
}

}  // namespace sdpa_math::cuda

// The tensor-core forward's host side (fp16/bf16 on mma.sync, sm_80 and newer): which problems it
// takes (tensor_core_forward_declines), the kernel's flags, and the choice of head tile and of the widest
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

// The widest key-tile width BN, from the first, whose tiles fit the device's shared memory (with
// the kernel's static nan_row); 0 when none does.
template <typename T, int DT, int BN, int... Narrower>
int fitting_key_tile() {
  if (forward_smem_bytes<T, DT, BN>() + kBM * sizeof(bool) <= smem_optin_limit()) return BN;
  if constexpr (sizeof...(Narrower) > 0) return fitting_key_tile<T, DT, Narrower...>();
  return 0;
}

// The key tile of the problem's head tile (the same for fp16 and bf16: equal sizes), or 0.
int key_tile(const DevProblem& p) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  if (head <= 64) return fitting_key_tile<__half, 64, 64>();
  if (head <= 128) return fitting_key_tile<__half, 128, 64>();
  return fitting_key_tile<__half, 256, 32, 16>();  // 16 keys: 99 KB GPUs (RTX 30/40, L4)
}

template <typename T>
void forward_for(const DevProblem& p, cudaStream_t stream) {
  const int64_t head = p.E > p.Ev ? p.E : p.Ev;
  ForwardFlags f;
  f.q_vec = rows_vectorizable(p.q, p.lead_ndim, p.E, 2, 8);
  f.k_vec = rows_vectorizable(p.k, p.lead_ndim, p.E, 2, 8);
  f.v_vec = rows_vectorizable(p.v, p.lead_ndim, p.Ev, 2, 8);
  const bool same = p.probs.dtype == p.q.dtype;
  f.p_pair = same && rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 2);
  f.p_vec8 = same && rows_vectorizable(p.probs, p.lead_ndim, p.S, 2, 8);
  const bool general = p.mask.data != nullptr || p.dropout != Dropout::None || !f.p_pair;
  if (head <= 64) launch_forward<T, 64, 64>(p, f, general, stream);
  else if (head <= 128) launch_forward<T, 128, 64>(p, f, general, stream);
  else if (key_tile(p) == 32) launch_forward<T, 256, 32>(p, f, general, stream);
  else launch_forward<T, 256, 16>(p, f, general, stream);
}

}  // namespace

const char* tensor_core_forward_declines(const DevProblem& p) {
  if (p.q.dtype != DType::Float16 && p.q.dtype != DType::BFloat16) return "inputs not float16 or bfloat16";
  if (p.E == 0) return "head size E = 0";
  if ((p.E > p.Ev ? p.E : p.Ev) > kTensorCoreMaxHead) return "a head size above 256";
  if (key_tile(p) == 0) return "no key tile of the head size fits this GPU's shared memory";
  return nullptr;
}

void tensor_core_forward(const DevProblem& p, cudaStream_t stream) {
  if (p.q.dtype == DType::Float16) forward_for<__half>(p, stream);
  else forward_for<__nv_bfloat16>(p, stream);
}

}  // namespace sdpa_math::cuda

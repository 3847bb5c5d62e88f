// kl_to's row sums of the reference map on any GPU (attention.h, kl_reference_rows): per row of r,
// R = Σ_j r, H = Σ_j r log r (0 log 0 = 0) and, under causality, the mass on hidden keys. One warp
// a row; 16-byte loads where the rows allow (16-bit r, unit column stride, 16-byte aligned rows),
// so a long row streams at copy bandwidth. Sums in the outputs' dtype (fp32, or fp64).
#include <cuda_runtime.h>

#include "backend.h"
#include "device_problem.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace sdpa_math::cuda {
namespace {

// A view's strides over the reference's first nd - 1 dims (its rows), row-major unravel.
struct RowsLayout {
  int nd = 0;  // dims of the reference
  int64_t shape[kMaxDims] = {};
  int64_t ref[kMaxDims] = {};     // strides of r (all nd dims)
  int64_t out[3][kMaxDims] = {};  // strides of R, H and the hidden mass (nd - 1 dims)
};

SDPA_MATH_D int64_t row_offset(const RowsLayout& d, const int64_t* strides, int64_t n) {
  int64_t off = 0;
  for (int k = d.nd - 2; k >= 0; --k) {
    off += (n % d.shape[k]) * strides[k];
    n /= d.shape[k];
  }
  return off;
}

template <typename T, typename Acc, bool VEC>
__global__ void __launch_bounds__(256) kl_rows_kernel(const T* __restrict__ r, RowsLayout d, Acc* row_sum, Acc* xlogx,
                                                      Acc* hidden, int64_t rows, bool causal) {
  const int64_t n = blockIdx.x * 8LL + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= rows) return;
  const int64_t L = d.shape[d.nd - 2], S = d.shape[d.nd - 1], i = n % L, col = d.ref[d.nd - 1];
  const T* row = r + row_offset(d, d.ref, n);
  Acc sum = 0, h = 0, hid = 0;
  // h sums x log2 x (times ln 2 at the end) with the hardware's log2 for fp32: an absolute error
  // of about 2^-22 a term, R · 2^-22 a row, where the accurate logf cost 4x the row's memory time
  // (0.137 against ~0.035 ms for 128 MB, run v53). 0 log 0 = 0; a negative entry gives NaN.
  auto add = [&](Acc x, int64_t j) {
    sum += x;
    if constexpr (sizeof(Acc) == 8) h += x != Acc(0) ? x * log2(x) : Acc(0);
    else h += x != 0.0f ? x * __log2f(x) : 0.0f;
    hid += causal && j > i ? x : Acc(0);
  };
  if constexpr (VEC) {  // 8 16-bit elements a load
#pragma unroll 4
    for (int64_t j = lane * 8; j < S; j += 256) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + j);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const T* pair = reinterpret_cast<const T*>(&w[k]);
        add(to_float<T>(pair[0]), j + 2 * k);
        add(to_float<T>(pair[1]), j + 2 * k + 1);
      }
    }
  } else {
    for (int64_t j = lane; j < S; j += 32) {
      if constexpr (sizeof(T) == 2) add(to_float<T>(row[j * col]), j);
      else add(static_cast<Acc>(row[j * col]), j);
    }
  }
  for (int s = 16; s > 0; s >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, s);
    h += __shfl_xor_sync(0xffffffffu, h, s);
    hid += __shfl_xor_sync(0xffffffffu, hid, s);
  }
  if (lane == 0) {
    row_sum[row_offset(d, d.out[0], n)] = sum;
    xlogx[row_offset(d, d.out[1], n)] = h * Acc(0.69314718055994530942);
    hidden[row_offset(d, d.out[2], n)] = hid;
  }
}

template <typename T, typename Acc>
void launch_rows(const TensorView& r, const RowsLayout& d, const TensorView (&outs)[3], int64_t rows, bool causal,
                 cudaStream_t stream) {
  const int64_t S = d.shape[d.nd - 1];
  bool vec = sizeof(T) == 2 && d.ref[d.nd - 1] == 1 && S % 8 == 0 && reinterpret_cast<uintptr_t>(r.data) % 16 == 0;
  for (int k = 0; k < d.nd - 1; ++k) vec = vec && (d.shape[k] == 1 || d.ref[k] % 8 == 0);
  const unsigned grid = grid_x((rows + 7) / 8, "KL reference rows");
  auto* out0 = static_cast<Acc*>(outs[0].data);
  auto* out1 = static_cast<Acc*>(outs[1].data);
  auto* out2 = static_cast<Acc*>(outs[2].data);
  const T* data = static_cast<const T*>(r.data);
  if constexpr (sizeof(T) == 2) {
    if (vec) {
      kl_rows_kernel<T, Acc, true><<<grid, 256, 0, stream>>>(data, d, out0, out1, out2, rows, causal);
      check_launch("KL reference rows");
      return;
    }
  }
  kl_rows_kernel<T, Acc, false><<<grid, 256, 0, stream>>>(data, d, out0, out1, out2, rows, causal);
  check_launch("KL reference rows");
}

template <typename Acc>
void rows_for(const TensorView& r, const RowsLayout& d, const TensorView (&outs)[3], int64_t rows, bool causal,
              cudaStream_t stream) {
  switch (r.dtype) {
    case DType::Float16: return launch_rows<__half, Acc>(r, d, outs, rows, causal, stream);
    case DType::BFloat16: return launch_rows<__nv_bfloat16, Acc>(r, d, outs, rows, causal, stream);
    case DType::Float32: return launch_rows<float, Acc>(r, d, outs, rows, causal, stream);
    default: return launch_rows<double, Acc>(r, d, outs, rows, causal, stream);
  }
}

}  // namespace

void kl_reference_rows(const TensorView& r, bool is_causal, const TensorView& row_sum, const TensorView& row_xlogx,
                       const TensorView& hidden_mass, const CudaExecution& ex) {
  const TensorView outs[3] = {row_sum, row_xlogx, hidden_mass};  // one dtype (the core checked)
  if (row_sum.numel() == 0) return;
  DeviceGuard guard(r.device.index);
  RowsLayout d;
  d.nd = r.ndim();
  for (int k = 0; k < d.nd; ++k) {
    d.shape[k] = r.shape.dims[k];
    d.ref[k] = r.strides[k];
  }
  for (int o = 0; o < 3; ++o)
    for (int k = 0; k < d.nd - 1; ++k) d.out[o][k] = outs[o].strides[k];
  const int64_t rows = row_sum.numel();
  auto stream = static_cast<cudaStream_t>(ex.stream);
  if (row_sum.dtype == DType::Float64) rows_for<double>(r, d, outs, rows, is_causal, stream);
  else rows_for<float>(r, d, outs, rows, is_causal, stream);
}

}  // namespace sdpa_math::cuda

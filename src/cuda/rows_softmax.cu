// softmax_rows on any GPU (attention.h): one block of 256 threads per row of fp32 logits. The
// row is read twice: once for its max and sum (each thread keeps its own running max and sum of
// exp(x − max), flash attention's online form, and the block merges them), and once to write
// P = exp(x − max) / sum in the output's dtype. A 4K-key row is 16 KB, so the second read comes
// from L2. This replaces PyTorch's separate mask, softmax and cast passes over the window's
// logits (python/sdpa_math/stats.py, _rows_alone: ~54 µs of a 64-row window on
// long4k_d128_causal, of which ~12 µs is the traffic one pass needs; run s24-v81).
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "backend.h"
#include "launch.cuh"
#include "mma.cuh"

namespace sdpa_math::cuda {
namespace {

constexpr int kRowThreads = 256;

struct RowsSoftmaxLayout {
  int nd = 0;
  int64_t shape[kMaxDims] = {};
  int64_t x_stride[kMaxDims] = {};    // the logits' strides (the last: along a row)
  int64_t out_stride[kMaxDims] = {};  // the output's
  int64_t rows = 0, w = 0, S = 0;
  bool causal = false;
  int64_t first = 0, step = 1;
};

template <typename T>
SDPA_MATH_D T from_float_any(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return from_float<T>(x);
}

// (m, l): a running max and the sum of exp(x − m). Merging two: both sums move to the larger
// max; a side that has seen no finite logit (m = -inf) adds nothing.
SDPA_MATH_D void merge(float& m, float& l, float m2, float l2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    l = l2;
    return;
  }
  const float mx = fmaxf(m, m2);
  l = l * expf(m - mx) + l2 * expf(m2 - mx);
  m = mx;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads) softmax_rows_kernel(const float* __restrict__ x, T* __restrict__ out,
                                                                   const RowsSoftmaxLayout d) {
  __shared__ float sm[kRowThreads / 32], sl[kRowThreads / 32];
  __shared__ int sbad[kRowThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t n = blockIdx.x; n < d.rows; n += gridDim.x) {
    int64_t xo = 0, oo = 0, rest = n;
    for (int k = d.nd - 2; k >= 0; --k) {
      const int64_t idx = rest % d.shape[k];
      rest /= d.shape[k];
      xo += idx * d.x_stride[k];
      oo += idx * d.out_stride[k];
    }
    const float* xr = x + xo;
    T* orow = out + oo;
    const int64_t xs = d.x_stride[d.nd - 1], os = d.out_stride[d.nd - 1];
    // Keys past `visible` are hidden by the causal mask (top-left: row i sees keys j <= i).
    const int64_t i = d.first + (n % d.w) * d.step;
    const int64_t visible = d.causal ? (i + 1 < d.S ? i + 1 : d.S) : d.S;
    float m = -INFINITY, l = 0.0f;
    bool bad = false;  // a NaN or +inf logit: torch.softmax's row is NaN (inf − inf)
    for (int64_t j = threadIdx.x; j < visible; j += kRowThreads) {
      const float v = xr[j * xs];
      bad |= v != v || v == INFINITY;
      if (v > m) {
        l = l * expf(m - v) + 1.0f;  // m = -inf at first: exp(-inf) = 0
        m = v;
      } else if (v > -INFINITY) {
        l += expf(v - m);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
      merge(m, l, m2, l2);
    }
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
      sm[warp] = m;
      sl[warp] = l;
      sbad[warp] = bad;
    }
    __syncthreads();
    m = sm[0];
    l = sl[0];
    bad = sbad[0];
    for (int k = 1; k < kRowThreads / 32; ++k) {
      merge(m, l, sm[k], sl[k]);
      bad |= sbad[k] != 0;
    }
    __syncthreads();  // the next row's partials go to the same shared memory
    // No finite visible logit (all -inf): torch.softmax gives NaN (-inf − -inf).
    bad |= m == -INFINITY;
    for (int64_t j = threadIdx.x; j < d.S; j += kRowThreads) {
      float p;
      if (bad) p = NAN;
      else if (j >= visible) p = 0.0f;
      else p = expf(xr[j * xs] - m) / l;
      orow[j * os] = from_float_any<T>(p);
    }
  }
}

}  // namespace

void softmax_rows(const SoftmaxRowsArgs& a, const TensorView& out, const CudaExecution& ex) {
  const TensorView& x = a.logits;
  const int nd = x.ndim();
  RowsSoftmaxLayout d;
  d.nd = nd;
  for (int k = 0; k < nd; ++k) {
    d.shape[k] = x.shape.dims[k];
    d.x_stride[k] = x.strides[k];
    d.out_stride[k] = out.strides[k];
  }
  d.w = x.shape.dims[nd - 2];
  d.S = x.shape.dims[nd - 1];
  d.rows = d.S > 0 ? x.numel() / d.S : 0;
  d.causal = a.is_causal;
  d.first = a.first;
  d.step = a.step;
  if (d.rows == 0) return;
  DeviceGuard guard(x.device.index);
  auto stream = static_cast<cudaStream_t>(ex.stream);
  // One block a row, at most 2^20 blocks (each loops over its share of the rows beyond that).
  const unsigned grid = grid_x(d.rows < (int64_t(1) << 20) ? d.rows : (int64_t(1) << 20), "softmax rows");
  const auto* xp = static_cast<const float*>(x.data);
  switch (out.dtype) {
    case DType::Float16:
      softmax_rows_kernel<__half><<<grid, kRowThreads, 0, stream>>>(xp, static_cast<__half*>(out.data), d);
      break;
    case DType::BFloat16:
      softmax_rows_kernel<__nv_bfloat16><<<grid, kRowThreads, 0, stream>>>(xp, static_cast<__nv_bfloat16*>(out.data), d);
      break;
    default:
      softmax_rows_kernel<float><<<grid, kRowThreads, 0, stream>>>(xp, static_cast<float*>(out.data), d);
      break;
  }
  check_launch("softmax rows");
}

}  // namespace sdpa_math::cuda

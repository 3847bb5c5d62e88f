// softmax_rows on any GPU (attention.h): one block of 256 threads per row of fp32 logits.
// Rows of at most 4096 keys, contiguous and 16-byte aligned (the logits the package sdpa_math.stats's
// `rows` alone forms), take softmax_rows_vec_kernel: each thread loads its share of the row as
// float4s, all issued before the first is used, keeps them in registers, and the block reduces the
// max, then the sum, then writes P with 8-byte (16-bit types) stores. Other rows take
// softmax_rows_kernel, which reads the row twice: once for its max and sum (each thread keeps a
// running max and sum of exp(x − max), flash attention's online form, and the block merges them),
// once to write P = exp(x − max) / sum. That form's loads are serial per thread (each feeds the
// next max), so on windows of many short rows it runs at a fraction of the memory rate, several
// times slower than PyTorch's softmax and cast on the same rows: hence the vector form. Both replace
// PyTorch's separate mask, softmax and cast passes over the window's logits (_rows_alone).
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

// Where row n (counted over the leading dims, row-major) starts in the logits (xo) and the
// output (oo), in elements.
SDPA_MATH_D void row_offsets(const RowsSoftmaxLayout& d, int64_t n, int64_t& xo, int64_t& oo) {
  xo = oo = 0;
  for (int k = d.nd - 2; k >= 0; --k) {
    const int64_t idx = n % d.shape[k];
    n /= d.shape[k];
    xo += idx * d.x_stride[k];
    oo += idx * d.out_stride[k];
  }
}

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
    int64_t xo, oo;
    row_offsets(d, n, xo, oo);
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


// 4 values to 4 consecutive elements of T at p (16-byte aligned for float, 8-byte otherwise).
template <typename T>
SDPA_MATH_D void store4(T* p, float a, float b, float c, float e) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, e);
  } else {
    union {
      T h[4];
      uint2 u;
    } pack;
    pack.h[0] = from_float<T>(a);
    pack.h[1] = from_float<T>(b);
    pack.h[2] = from_float<T>(c);
    pack.h[3] = from_float<T>(e);
    *reinterpret_cast<uint2*>(p) = pack.u;
  }
}

// A warp's max (and any-of `bad`), then the block's, through `red`/`rbad` (one slot a warp);
// every thread gets the result. Ends with a barrier so the slots may be reused.
SDPA_MATH_D float block_max(float m, bool& bad, float* red, int* rbad) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  bad = __any_sync(0xffffffffu, bad);
  if (lane == 0) {
    red[warp] = m;
    rbad[warp] = bad;
  }
  __syncthreads();
  m = red[0];
  for (int k = 1; k < kRowThreads / 32; ++k) {
    m = fmaxf(m, red[k]);
    bad |= rbad[k] != 0;
  }
  __syncthreads();
  return m;
}

SDPA_MATH_D float block_sum(float l, float* red) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
  if (lane == 0) red[warp] = l;
  __syncthreads();
  l = 0.0f;
  for (int k = 0; k < kRowThreads / 32; ++k) l += red[k];
  __syncthreads();
  return l;
}

// Rows of S <= kVecs * 4 * kRowThreads keys, S % 4 == 0, contiguous along the row, every row's
// start 16-byte aligned in x (and 4 elements aligned in out).
template <typename T, int kVecs>
__global__ void __launch_bounds__(kRowThreads) softmax_rows_vec_kernel(const float* __restrict__ x, T* __restrict__ out,
                                                                       const RowsSoftmaxLayout d) {
  __shared__ float red[kRowThreads / 32];
  __shared__ int rbad[kRowThreads / 32];
  for (int64_t n = blockIdx.x; n < d.rows; n += gridDim.x) {
    int64_t xo, oo;
    row_offsets(d, n, xo, oo);
    const float4* xr = reinterpret_cast<const float4*>(x + xo);
    const int64_t i = d.first + (n % d.w) * d.step;
    const int64_t visible = d.causal ? (i + 1 < d.S ? i + 1 : d.S) : d.S;
    float v[kVecs][4];
#pragma unroll
    for (int t = 0; t < kVecs; ++t) {
      const int64_t j4 = threadIdx.x + t * kRowThreads;
      const float4 q = 4 * j4 < d.S ? xr[j4] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      v[t][0] = q.x;
      v[t][1] = q.y;
      v[t][2] = q.z;
      v[t][3] = q.w;
    }
    float m = -INFINITY;
    bool bad = false;  // a NaN or +inf visible logit: torch.softmax's row is NaN (inf − inf)
#pragma unroll
    for (int t = 0; t < kVecs; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t j = 4 * (threadIdx.x + t * kRowThreads) + c;
        if (j < visible) {
          bad |= v[t][c] != v[t][c] || v[t][c] == INFINITY;
          m = fmaxf(m, v[t][c]);
        } else {
          v[t][c] = -INFINITY;  // hidden (or past the row): exp gives 0
        }
      }
    m = block_max(m, bad, red, rbad);
    // No finite visible logit (all -inf): torch.softmax gives NaN (-inf − -inf).
    bad |= m == -INFINITY;
    float l = 0.0f;
#pragma unroll
    for (int t = 0; t < kVecs; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        v[t][c] = bad ? 0.0f : expf(v[t][c] - m);
        l += v[t][c];
      }
    l = block_sum(l, red);
    const float inv = bad ? NAN : 1.0f;
#pragma unroll
    for (int t = 0; t < kVecs; ++t) {
      const int64_t j4 = threadIdx.x + t * kRowThreads;
      if (4 * j4 < d.S)
        store4(out + oo + 4 * j4, inv * (v[t][0] / l), inv * (v[t][1] / l), inv * (v[t][2] / l), inv * (v[t][3] / l));
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
  // The register form: rows that fit (4 float4s a thread), unit stride along the row, and every
  // row start aligned (leading strides multiples of 4 elements, 16-byte aligned data).
  bool vec = d.S % 4 == 0 && d.S <= 4 * 4 * kRowThreads && d.x_stride[nd - 1] == 1 && d.out_stride[nd - 1] == 1 &&
             reinterpret_cast<uintptr_t>(x.data) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(out.data) % (4 * dtype_size(out.dtype)) == 0;
  for (int k = 0; k + 1 < nd; ++k) vec = vec && d.x_stride[k] % 4 == 0 && d.out_stride[k] % 4 == 0;
  const int vecs = static_cast<int>((d.S + 4 * kRowThreads - 1) / (4 * kRowThreads));
  auto launch = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    if (!vec) {
      softmax_rows_kernel<T><<<grid, kRowThreads, 0, stream>>>(xp, op, d);
    } else if (vecs <= 1) {
      softmax_rows_vec_kernel<T, 1><<<grid, kRowThreads, 0, stream>>>(xp, op, d);
    } else if (vecs == 2) {
      softmax_rows_vec_kernel<T, 2><<<grid, kRowThreads, 0, stream>>>(xp, op, d);
    } else {
      softmax_rows_vec_kernel<T, 4><<<grid, kRowThreads, 0, stream>>>(xp, op, d);
    }
  };
  switch (out.dtype) {
    case DType::Float16:
      launch(static_cast<__half*>(out.data));
      break;
    case DType::BFloat16:
      launch(static_cast<__nv_bfloat16*>(out.data));
      break;
    default:
      launch(static_cast<float*>(out.data));
      break;
  }
  check_launch("softmax rows");
}

}  // namespace sdpa_math::cuda

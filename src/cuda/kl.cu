// kl_to's forward rows on any GPU (attention.h, kl_rows): per row of the reference r one warp
// streams the row once for R = Σ_j r, H = Σ_j r log r (0 log 0 = 0) and, under causality, the mass
// on hidden keys, then adds q_i · u_i (u = r K, the caller's product) and the lse:
// KL = H − scale q·u + R lse (0 for a row with R = 0), +inf where the hidden mass is positive. 16-byte loads where the rows
// allow (16-bit r, unit column stride, 16-byte aligned rows), so a long row streams at copy
// bandwidth. Sums in the outputs' dtype (fp32, or fp64).
#include <cuda_runtime.h>

#include <type_traits>

#include "../core/kl_row.h"
#include "backend.h"
#include "device_problem.cuh"
#include "launch.cuh"
#include "mma.cuh"

namespace sdpa_math::cuda {
namespace {

// The views' strides over the reference's rows (its first nd - 1 dims, row-major) and their
// column strides. Row n's index is unravelled once per warp and each view's offset is a dot
// product of it: the int64 divisions cost as much as a 1K-key row's arithmetic when they were
// repeated for every view (the kernel then ran at less than half its memory time).
enum View { kRef, kQuery, kKeys, kLse, kKl, kRowSum, kViews };
struct RowsLayout {
  int nd = 0;                           // dims of the reference
  int64_t shape[kMaxDims] = {};         // the reference's
  int64_t row[kViews][kMaxDims] = {};   // strides over the first nd - 1 dims
  int64_t col[kViews] = {};             // column strides (r: keys; q, u: head elements)
  int64_t E = 0;                        // head size of q and u
  DType query = DType::Float16, keys = DType::Float32, lse = DType::Float32;
};

template <typename Acc, typename T>
SDPA_MATH_D Acc as_acc(T x) {
  if constexpr (sizeof(T) == 2) return static_cast<Acc>(to_float<T>(x));
  else return static_cast<Acc>(x);
}

// Eight rows (warps) a block, at least four blocks an SM (at most 64 registers). The kernel is a
// stream: every load a warp needs is issued before the first is used (the row vectors first,
// then four 16-byte chunks of the row a lane), so a row costs one memory latency, not several.
// (A first version summed q·u in a loop of dependent loads after the row: a fraction of the
// memory rate.)
// TYPED_QU: q in r's dtype and u in Acc's, both with unit column stride and E ≤ 256 (8 a lane),
// loaded directly; other layouts go through the dtype switch one element at a time.
template <typename T, typename Acc, bool VEC, bool TYPED_QU>
__global__ void __launch_bounds__(256, 4) kl_rows_kernel(const T* __restrict__ r, const char* __restrict__ q,
                                                         const char* __restrict__ u, const char* __restrict__ lse,
                                                         RowsLayout d, Acc* kl, Acc* row_sum, int64_t rows, Acc scale,
                                                         bool causal) {
  const int64_t n = blockIdx.x * 8LL + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= rows) return;
  int64_t off[kViews] = {};
  int64_t i = 0;  // the row's query index
  // The unravel in 32 bits where the row count allows (always, short of 2^31 rows): a 64-bit
  // division is a ~70-instruction call, and three of them cost a warp as much as a 1K-key row.
  auto unravel = [&](auto rest) {
    using I = decltype(rest);
#pragma unroll 1  // unrolled over kMaxDims, it held every view's strides in registers
    for (int k = d.nd - 2; k >= 0; --k) {
      const I dim = static_cast<I>(d.shape[k]), idx = rest % dim;
      rest /= dim;
      if (k == d.nd - 2) i = idx;
#pragma unroll
      for (int v = 0; v < kViews; ++v) off[v] += static_cast<int64_t>(idx) * d.row[v][k];
    }
  };
  if (rows < (int64_t(1) << 31)) unravel(static_cast<uint32_t>(n));
  else unravel(n);
  const Acc l = lane == 0 ? load_elem<Acc>(d.lse, lse, off[kLse]) : Acc(0);
  Acc qu = 0;  // q_i · u_i, the row's Σ_j r x before the scale
  if constexpr (TYPED_QU) {
    const T* qr = reinterpret_cast<const T*>(q) + off[kQuery];
    const Acc* ur = reinterpret_cast<const Acc*>(u) + off[kKeys];
    T qe[8];
    Acc ue[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int e = lane + 32 * k;
      if (e < d.E) {
        qe[k] = qr[e];
        ue[k] = ur[e];
      }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (lane + 32 * k < d.E) qu += as_acc<Acc>(qe[k]) * ue[k];
  } else {
#pragma unroll 1  // unrolled, the two dtype switches took ~90 registers
    for (int64_t e = lane; e < d.E; e += 32)
      qu += load_elem<Acc>(d.query, q, off[kQuery] + e * d.col[kQuery]) * load_elem<Acc>(d.keys, u, off[kKeys] + e * d.col[kKeys]);
  }
  const int64_t S = d.shape[d.nd - 1];
  const T* row = r + off[kRef];
  Acc sum = 0, h = 0, hid = 0;
  // h sums x log2 x (times ln 2 at the end) with the hardware's log2 for fp32: an absolute error
  // of about 2^-22 a term, R · 2^-22 a row, where the accurate logf made the kernel several
  // times slower than its memory time. 0 log 0 = 0; a negative entry gives NaN.
  auto add = [&](Acc x) {
    sum += x;
    if constexpr (sizeof(Acc) == 8) h += x != Acc(0) ? x * log2(x) : Acc(0);
    else h += x != 0.0f ? x * __log2f(x) : 0.0f;
  };
  if constexpr (VEC) {  // 8 16-bit elements a 16-byte load, four loads a lane in flight
    for (int64_t j0 = lane * 8; j0 < S; j0 += 4 * 256) {
      uint4 raw[4];
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (j0 + b * 256 < S) raw[b] = __ldcs(reinterpret_cast<const uint4*>(row + j0 + b * 256));  // read once: streamed
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int64_t j = j0 + b * 256;
        if (j >= S) break;
        const T* e = reinterpret_cast<const T*>(&raw[b]);
        Acc x[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          x[k] = as_acc<Acc>(e[k]);
          add(x[k]);
        }
        if (causal && j + 7 > i) {  // the chunk reaches past the diagonal: its hidden keys
#pragma unroll
          for (int k = 0; k < 8; ++k) hid += j + k > i ? x[k] : Acc(0);
        }
      }
    }
  } else {
    const int64_t col = d.col[kRef];
    for (int64_t j = lane; j < S; j += 32) {
      const Acc x = as_acc<Acc>(row[j * col]);
      add(x);
      if (causal && j > i) hid += x;
    }
  }
  for (int s = 16; s > 0; s >>= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, s);
    h += __shfl_xor_sync(0xffffffffu, h, s);
    hid += __shfl_xor_sync(0xffffffffu, hid, s);
    qu += __shfl_xor_sync(0xffffffffu, qu, s);
  }
  if (lane == 0) {
    // A row with no reference mass has KL 0 whatever q and the lse hold (a NaN there would
    // otherwise come through q·u = NaN · 0); one with hidden mass +inf.
    kl[off[kKl]] = core::kl_of_row<Acc>(h * Acc(0.69314718055994530942), scale * qu, sum, l, hid);
    row_sum[off[kRowSum]] = sum;
  }
}

template <typename T, typename Acc>
void launch_rows(const KlRowsArgs& a, const RowsLayout& d, const TensorView& kl, const TensorView& row_sum, int64_t rows,
                 cudaStream_t stream) {
  const int64_t S = d.shape[d.nd - 1];
  bool vec = sizeof(T) == 2 && d.col[kRef] == 1 && S % 8 == 0 && reinterpret_cast<uintptr_t>(a.reference.data) % 16 == 0;
  for (int k = 0; k < d.nd - 1; ++k) vec = vec && (d.shape[k] == 1 || d.row[kRef][k] % 8 == 0);
  const unsigned grid = grid_x((rows + 7) / 8, "KL rows");
  auto* out_kl = static_cast<Acc*>(kl.data);
  auto* out_r = static_cast<Acc*>(row_sum.data);
  const T* data = static_cast<const T*>(a.reference.data);
  const auto* q = static_cast<const char*>(a.query.data);
  const auto* u = static_cast<const char*>(a.ref_keys.data);
  const auto* lse = static_cast<const char*>(a.logsumexp.data);
  const Acc scale = static_cast<Acc>(a.scale);
  const bool typed_qu = a.query.dtype == a.reference.dtype && a.ref_keys.dtype == (sizeof(Acc) == 8 ? DType::Float64 : DType::Float32) &&
                        d.col[kQuery] == 1 && d.col[kKeys] == 1 && d.E <= 256;
  auto run = [&](auto vec, auto typed) {
    kl_rows_kernel<T, Acc, decltype(vec)::value, decltype(typed)::value>
        <<<grid, 256, 0, stream>>>(data, q, u, lse, d, out_kl, out_r, rows, scale, a.is_causal);
    check_launch("KL rows");
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if constexpr (sizeof(T) == 2) {
    if (vec) return typed_qu ? run(Yes{}, Yes{}) : run(Yes{}, No{});
  }
  return typed_qu ? run(No{}, Yes{}) : run(No{}, No{});
}

template <typename Acc>
void rows_for(const KlRowsArgs& a, const RowsLayout& d, const TensorView& kl, const TensorView& row_sum, int64_t rows,
              cudaStream_t stream) {
  switch (a.reference.dtype) {
    case DType::Float16: return launch_rows<__half, Acc>(a, d, kl, row_sum, rows, stream);
    case DType::BFloat16: return launch_rows<__nv_bfloat16, Acc>(a, d, kl, row_sum, rows, stream);
    case DType::Float32: return launch_rows<float, Acc>(a, d, kl, row_sum, rows, stream);
    default: return launch_rows<double, Acc>(a, d, kl, row_sum, rows, stream);
  }
}

}  // namespace

void kl_rows(const KlRowsArgs& a, const TensorView& kl, const TensorView& row_sum, const CudaExecution& ex) {
  if (row_sum.numel() == 0) return;
  DeviceGuard guard(a.reference.device.index);
  RowsLayout d;
  d.nd = a.reference.ndim();
  for (int k = 0; k < d.nd; ++k) d.shape[k] = a.reference.shape.dims[k];
  const TensorView* views[kViews] = {&a.reference, &a.query, &a.ref_keys, &a.logsumexp, &kl, &row_sum};
  for (int v = 0; v < kViews; ++v)
    for (int k = 0; k < d.nd - 1; ++k) d.row[v][k] = views[v]->strides[k];
  d.col[kRef] = a.reference.strides[d.nd - 1];
  d.col[kQuery] = a.query.strides[d.nd - 1];
  d.col[kKeys] = a.ref_keys.strides[d.nd - 1];
  d.E = a.query.shape.dims[d.nd - 1];
  d.query = a.query.dtype;
  d.keys = a.ref_keys.dtype;
  d.lse = a.logsumexp.dtype;
  const int64_t rows = row_sum.numel();
  auto stream = static_cast<cudaStream_t>(ex.stream);
  if (row_sum.dtype == DType::Float64) rows_for<double>(a, d, kl, row_sum, rows, stream);
  else rows_for<float>(a, d, kl, row_sum, rows, stream);
}

}  // namespace sdpa_math::cuda

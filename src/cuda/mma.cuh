// Warp-level tensor-core pieces shared by the forward and backward kernels: the m16n8k16 product
// with fp32 accumulation, fp32 <-> packed 16-bit conversions, and tile loads into shared memory.
//
// Fragment layout of mma.m16n8k16 (lane = 4 g + t): A (16x16, row-major) a0 = (g, 2t..2t+1),
// a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..); B (16x8, k-major) b0 = (k 2t..2t+1, n g),
// b1 = (k 2t+8.., n g); C (16x8) c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_problem.cuh"

namespace sdpa_math::cuda {

template <typename T>
SDPA_MATH_D void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);

template <>
SDPA_MATH_D void mma_16816<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
SDPA_MATH_D void mma_16816<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
SDPA_MATH_D T from_float(float x);
template <>
SDPA_MATH_D __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
SDPA_MATH_D __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T>
SDPA_MATH_D float to_float(T x);
template <>
SDPA_MATH_D float to_float<__half>(__half x) { return __half2float(x); }
template <>
SDPA_MATH_D float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// Two fp32 values rounded and packed (lo in the low half), as a fragment register holds them:
// one cvt instruction for the pair.
template <typename T>
SDPA_MATH_D uint32_t pack2(float lo, float hi);
template <>
SDPA_MATH_D uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
SDPA_MATH_D uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// The two 16-bit values of a fragment register (lo first) in fp32: pack2's inverse.
template <typename T>
SDPA_MATH_D float2 unpack2(uint32_t raw) {
  const T* h = reinterpret_cast<const T*>(&raw);
  return make_float2(to_float<T>(h[0]), to_float<T>(h[1]));
}
// The sum over the quad of lanes that holds one row of an m16n8 (or wgmma) accumulator.
SDPA_MATH_D float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// The larger of a and b, NaN if either is NaN: a row maximum that keeps a NaN score, as the math
// op's softmax does (fmaxf returns the other operand).
SDPA_MATH_D float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// max_nan over the quad of lanes that holds one row (as quad_sum).
SDPA_MATH_D float quad_max_nan(float x) {
  x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return max_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
// The sum and max_nan over the 8 lanes of one t (lanes t, t + 4, ..., t + 28), which hold one
// column of an m16n8 accumulator (a query row of decode's transposed products).
SDPA_MATH_D float col_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}
SDPA_MATH_D float col_max_nan(float x) {
  x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return max_nan(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
// An 8x8 matrix of 16-bit values in fragment layout (lane 4 g + t holds row g, columns 2t and
// 2t + 1, as one register) transposed across the warp: lane 4 g + t gets (2t, g) and (2t + 1, g).
SDPA_MATH_D uint32_t transpose8x8_b16(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// A row at the end of the tensor-core forwards' first pass, from its quad's partial sums `l` of
// exp(x - m) and its max `m` (logits in natural units, or base 2): 1/l (0 for a fully masked row,
// NaN for a NaN row), the lse in natural units (-inf fully masked, NaN for a NaN row), and whether
// the row is NaN. A fully masked row's m becomes 0, so that every exponent after is of -inf (P = 0).
struct RowEnd {
  float inv_l, lse;
  bool nan;
};
template <bool NATURAL>
SDPA_MATH_D RowEnd end_of_row(float l, float& m) {
  const float total = quad_sum(l);
  const bool nan = total != total;
  const float lse = total > 0.0f ? (NATURAL ? m + logf(total) : (m + log2f(total)) / 1.4426950408889634f)
                    : nan        ? total
                                 : -INFINITY;
  if (!(total > 0.0f) && !nan) m = 0.0f;
  return {total > 0.0f ? 1.0f / total : nan ? total : 0.0f, lse, nan};
}
// 2^x on the special-function unit (relative error ~2^-22; 2^-inf = 0).
SDPA_MATH_D float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two 16-bit values from two places.
SDPA_MATH_D uint32_t pack_raw(const uint16_t* lo, const uint16_t* hi) {
  return static_cast<uint32_t>(*lo) | (static_cast<uint32_t>(*hi) << 16);
}
SDPA_MATH_D uint32_t load32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Whether an operand's rows can be moved `vec` elements at a time: unit column stride, and
// every row start aligned to vec elements (strides, base pointer and row length).
inline bool rows_vectorizable(const DevOperand& op, int lead_ndim, int64_t cols, int elem_bytes, int vec) {
  if (op.data == nullptr || op.col != 1 || op.row % vec != 0 || cols % vec != 0) return false;
  for (int d = 0; d < lead_ndim; ++d)
    if (op.lead[d] % vec != 0) return false;
  return reinterpret_cast<uintptr_t>(op.data) % (static_cast<uintptr_t>(vec) * elem_bytes) == 0;
}

// Loads a ROWS x COLS tile of 16-bit elements (rows `r0..` of an operand based at `base`) into
// shared memory with leading dimension LD; out-of-range elements become zero, so products over
// the whole tile are exact.
template <typename T, int ROWS, int COLS, int LD, int THREADS>
SDPA_MATH_D void load_tile(T* s, const DevOperand& op, int64_t base, int64_t r0, int64_t rows, int64_t cols,
                           bool vec) {
  const T* g = reinterpret_cast<const T*>(op.data);
  const T zero = from_float<T>(0.0f);
  if (vec) {
    constexpr int kChunks = COLS / 8;
    for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r0 + r < rows && c < cols) val = *reinterpret_cast<const uint4*>(g + base + (r0 + r) * op.row + c);
      *reinterpret_cast<uint4*>(s + r * LD + c) = val;
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
      const int r = idx / COLS, c = idx % COLS;
      T val = zero;
      if (r0 + r < rows && c < cols) val = g[base + (r0 + r) * op.row + c * op.col];
      s[r * LD + c] = val;
    }
  }
}

}  // namespace sdpa_math::cuda

namespace sdpa_math::cuda {

// B fragment (b0, b1) of m16n8k16 from a row-major [k][n] tile in shared memory: rows k0..k0+15,
// columns n0..n0+7 (`row0` points at element (k0, n0), ld in elements, 16-byte aligned rows).
template <typename T>
SDPA_MATH_D void load_b_trans(const T* row0, int ld, int lane, uint32_t& b0, uint32_t& b1) {
  const T* addr = row0 + (lane & 15) * ld;
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(s));
}

}  // namespace sdpa_math::cuda

namespace sdpa_math::cuda {

// Asynchronous 16-byte global -> shared copies (sm_80+): a tile's loads are all in flight at
// once and overlap the products on the previous tile. pred = false writes zeros.
SDPA_MATH_D void cp_async16(void* smem, const void* gmem, bool pred) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
SDPA_MATH_D void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
SDPA_MATH_D void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Starts loading a ROWS x COLS tile like load_tile (not transposed). Rows that cannot move 16
// bytes at a time (`vec` false) are loaded synchronously instead; either way the tile is in
// shared memory after the matching cp_async_wait and a __syncthreads.
template <typename T, int ROWS, int COLS, int LD, int THREADS>
SDPA_MATH_D void load_tile_async(T* s, const DevOperand& op, int64_t base, int64_t r0, int64_t rows, int64_t cols,
                                 bool vec) {
  if (!vec) {
    load_tile<T, ROWS, COLS, LD, THREADS>(s, op, base, r0, rows, cols, false);
    return;
  }
  const T* g = reinterpret_cast<const T*>(op.data);
  constexpr int kChunks = COLS / 8;
  static_assert((ROWS * kChunks) % THREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / THREADS; ++it) {
    const int idx = it * THREADS + threadIdx.x;
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const bool ok = r0 + r < rows && c < cols;
    cp_async16(s + r * LD + c, ok ? g + base + (r0 + r) * op.row + c : g, ok);
  }
}

}  // namespace sdpa_math::cuda

namespace sdpa_math::cuda {

SDPA_MATH_D uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Four 8x8 16-bit matrices from shared memory, one register each; lane l gives the address of
// row (l & 7) of matrix (l >> 3).
SDPA_MATH_D void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
SDPA_MATH_D void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}

// The A fragment of rows m0..m0+15, columns k0..k0+15 of a row-major [m][k] tile.
template <typename T>
SDPA_MATH_D void load_a_frag(uint32_t (&a)[4], const T* tile, int ld, int m0, int k0, int lane) {
  ldmatrix_x4(a, tile + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 8);
}
// B fragments {b0, b1} of two neighbouring 8-column tiles (n0..n0+7 and n0+8..n0+15) for
// k0..k0+15, from a tile stored [n][k] (rows = the product's columns, e.g. K for Q K^T).
template <typename T>
SDPA_MATH_D void load_b_pair_nk(uint32_t (&b)[4], const T* tile, int ld, int n0, int k0, int lane) {
  ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}
// The same from a tile stored [k][n] (e.g. V for P V), transposed on the way.
template <typename T>
SDPA_MATH_D void load_b_pair_kn(uint32_t (&b)[4], const T* tile, int ld, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

}  // namespace sdpa_math::cuda

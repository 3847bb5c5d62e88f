#include "gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace sdpa_math::cpu {
namespace {

// GCC/Clang vector extensions: 16 floats (one AVX-512 register, or split by the compiler into
// narrower ones on older ISAs). Loads and stores go through memcpy, which compiles to unaligned
// vector moves (an under-aligned typedef would lose its attribute as a template argument).
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

template <class V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V>
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }

// MR rows by NV vectors of W floats: MR*NV accumulators stay in registers for the whole K loop
// (8 x 2 x 16 = 16 of the 32 AVX-512 registers).
template <int MR, int NV, class V, int W>
inline void micro(int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                  int64_t ldc, bool accumulate) {
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{} ;
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load<V>(B + k * ldb + v * W);
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];  // scalar * vector: a broadcast, not an add to a zero vector
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      V res = acc[r][v] * alpha;
      if (accumulate) res += load<V>(C + r * ldc + v * W);
      store<V>(C + r * ldc + v * W, res);
    }
}

template <int NV, class V, int W>
void column_panel(int64_t M, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + 8 <= M; i += 8) micro<8, NV, V, W>(K, alpha, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  for (; i + 4 <= M; i += 4) micro<4, NV, V, W>(K, alpha, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  for (; i < M; ++i) micro<1, NV, V, W>(K, alpha, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
}

}  // namespace

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) column_panel<2, v16, 16>(M, K, alpha, A, lda, B + j, ldb, C + j, ldc, accumulate);
  for (; j + 16 <= N; j += 16) column_panel<1, v16, 16>(M, K, alpha, A, lda, B + j, ldb, C + j, ldc, accumulate);
  for (; j + 8 <= N; j += 8) column_panel<1, v8, 8>(M, K, alpha, A, lda, B + j, ldb, C + j, ldc, accumulate);
  for (; j < N; ++j)  // fewer than 8 columns left
    for (int64_t i = 0; i < M; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[i * lda + k] * B[k * ldb + j];
      C[i * ldc + j] = alpha * acc + (accumulate ? C[i * ldc + j] : 0.0f);
    }
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const int64_t r1 = std::min(rows, r0 + 32);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * ld + c];
  }
}

void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, bool accumulate) {
  // B's rows are C's columns. Each panel of up to 32 of them is transposed into a small buffer
  // (K x 32 floats: 8 KB at K = 64, in L1) that every row block of A then streams, so B is read
  // once, row by row, whatever M is: no per-head transposed copy of K, which cost as much as the
  // whole product when M is 1 (decode).
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(K) * 32);
  auto transpose_panel = [&](int64_t j, int64_t width) { transpose(B + j * ldb, width, K, ldb, panel.data()); };
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) {
    transpose_panel(j, 32);
    column_panel<2, v16, 16>(M, K, alpha, A, lda, panel.data(), 32, C + j, ldc, accumulate);
  }
  for (; j + 16 <= N; j += 16) {
    transpose_panel(j, 16);
    column_panel<1, v16, 16>(M, K, alpha, A, lda, panel.data(), 16, C + j, ldc, accumulate);
  }
  for (; j + 8 <= N; j += 8) {
    transpose_panel(j, 8);
    column_panel<1, v8, 8>(M, K, alpha, A, lda, panel.data(), 8, C + j, ldc, accumulate);
  }
  for (; j < N; ++j)  // fewer than 8 columns left: dot products
    for (int64_t i = 0; i < M; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += A[i * lda + k] * B[j * ldb + k];
      C[i * ldc + j] = alpha * acc + (accumulate ? C[i * ldc + j] : 0.0f);
    }
}

}  // namespace sdpa_math::cpu

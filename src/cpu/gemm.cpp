#include "gemm.h"

#include <algorithm>
#include <vector>

#include "simd.h"

SDPA_MATH_CPU_BEGIN
namespace {

// A as seen by the register block: element (r, k) at a[r * row + k * step]. A plain product has
// step 1; A^T B reads A's columns with row 1 and step lda. Either way each a is one broadcast
// load, so the transposed product costs what the plain one does, with no transposed copy.
struct AView {
  const float* a;
  int64_t row, step;
  const float* at(int64_t r) const { return a + r * row; }
};

// MR rows by NV vectors of W floats: MR*NV accumulators stay in registers for the whole K loop
// (8 x 2 x 16 = 16 of the 32 AVX-512 registers).
template <int MR, int NV, class V, int W>
inline void micro(int64_t K, float alpha, AView A, const float* B, int64_t ldb, float* C, int64_t ldc,
                  Out out) {
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = V{};
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load<V>(B + k * ldb + v * W);
    for (int r = 0; r < MR; ++r) {
      const float a = A.a[r * A.row + k * A.step];  // scalar * vector: a broadcast
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      V res = acc[r][v] * alpha;
      if (out == Out::Add) res += load<V>(C + r * ldc + v * W);
      if (out == Out::Stream) store_streaming<V>(C + r * ldc + v * W, res);
      else store<V>(C + r * ldc + v * W, res);
    }
}

template <int NV, class V, int W>
void column_panel(int64_t M, int64_t K, float alpha, AView A, const float* B, int64_t ldb, float* C, int64_t ldc,
                  Out out) {
  int64_t i = 0;
  for (; i + 8 <= M; i += 8) micro<8, NV, V, W>(K, alpha, {A.at(i), A.row, A.step}, B, ldb, C + i * ldc, ldc, out);
  for (; i + 4 <= M; i += 4) micro<4, NV, V, W>(K, alpha, {A.at(i), A.row, A.step}, B, ldb, C + i * ldc, ldc, out);
  for (; i < M; ++i) micro<1, NV, V, W>(K, alpha, {A.at(i), A.row, A.step}, B, ldb, C + i * ldc, ldc, out);
}

// Fewer than 8 columns left (N = 300 leaves 4): they are copied, zero-padded, into a K x 8 panel
// (`fill_panel`) and run through the 8-wide block into a scratch tile, so they take vector FMAs
// too instead of a scalar loop over M x K.
template <class FillPanel>
void narrow_tail(int64_t M, int64_t width, int64_t K, float alpha, AView A, FillPanel&& fill_panel, float* C,
                 int64_t ldc, Out out) {
  constexpr int64_t kRows = 64;
  thread_local std::vector<float> panel, tile;
  panel.assign(static_cast<size_t>(K) * 8, 0.0f);
  tile.resize(kRows * 8);
  fill_panel(panel.data());
  for (int64_t i0 = 0; i0 < M; i0 += kRows) {
    const int64_t rows = std::min(kRows, M - i0);
    column_panel<1, f32x8, 8>(rows, K, alpha, {A.at(i0), A.row, A.step}, panel.data(), 8, tile.data(), 8, Out::Set);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) {
        float& dst = C[(i0 + r) * ldc + c];
        dst = tile[r * 8 + c] + (out == Out::Add ? dst : 0.0f);
      }
  }
}

// C = alpha A B, B row-major K x N, in column panels of 32, 16, 8, then a padded narrow tail.
void product(int64_t M, int64_t N, int64_t K, float alpha, AView A, const float* B, int64_t ldb, float* C,
             int64_t ldc, Out out) {
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) column_panel<2, f32x16, 16>(M, K, alpha, A, B + j, ldb, C + j, ldc, out);
  for (; j + 16 <= N; j += 16) column_panel<1, f32x16, 16>(M, K, alpha, A, B + j, ldb, C + j, ldc, out);
  for (; j + 8 <= N; j += 8) column_panel<1, f32x8, 8>(M, K, alpha, A, B + j, ldb, C + j, ldc, out);
  if (j < N) {
    const int64_t width = N - j;
    narrow_tail(M, width, K, alpha, A, [&](float* panel) {
      for (int64_t k = 0; k < K; ++k) std::copy(B + k * ldb + j, B + k * ldb + N, panel + k * 8);
    }, C + j, ldc, out);
  }
}

// C = alpha A B^T for a few rows of A (decode: one query row against every key). Transposing a
// panel of B costs K element moves per key, against M K / 16 vector FMAs of use: with M < 8 it
// dominates. Here each row of A meets 16 rows of B as 16 vector dot products, summed lane-wise
// by sum_each; B is read once, row by row.
void few_rows_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, Out out) {
  const int64_t k_full = K - K % kLanes;
  int64_t j = 0;
  for (; j + 16 <= N; j += 16) {
    const float* b = B + j * ldb;
    for (int64_t i = 0; i < M; ++i) {
      const float* a = A + i * lda;
      f32x16 acc[16];
      for (int t = 0; t < 16; ++t) acc[t] = f32x16{};
      for (int64_t k = 0; k < k_full; k += kLanes) {
        const f32x16 av = load(a + k);
        for (int t = 0; t < 16; ++t) acc[t] += av * load(b + t * ldb + k);
      }
      f32x16 sums = sum_each(acc);
      for (int64_t k = k_full; k < K; ++k)
        for (int t = 0; t < 16; ++t) sums[t] += a[k] * b[t * ldb + k];
      sums *= alpha;
      if (out == Out::Add) sums += load(C + i * ldc + j);
      if (out == Out::Stream) store_streaming(C + i * ldc + j, sums);
      else store(C + i * ldc + j, sums);
    }
  }
  for (; j < N; ++j)
    for (int64_t i = 0; i < M; ++i) {
      float& dst = C[i * ldc + j];
      dst = alpha * dot(A + i * lda, B + j * ldb, K) + (out == Out::Add ? dst : 0.0f);
    }
}

}  // namespace

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, Out out) {
  product(M, N, K, alpha, {A, lda, 1}, B, ldb, C, ldc, out);
}

void gemm_tn(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, Out out) {
  product(M, N, K, alpha, {A, 1, lda}, B, ldb, C, ldc, out);
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst, int64_t dst_ld) {
  // 16 x 16 blocks in registers; the right and bottom edges element by element.
  const int64_t rows16 = rows - rows % 16, cols16 = cols - cols % 16;
  for (int64_t r0 = 0; r0 < rows16; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols16; c0 += 16) {
      f32x16 block[16];
      for (int i = 0; i < 16; ++i) block[i] = load(src + (r0 + i) * ld + c0);
      transpose16(block);
      for (int i = 0; i < 16; ++i) store(dst + (c0 + i) * dst_ld + r0, block[i]);
    }
    for (int64_t r = r0; r < r0 + 16; ++r)
      for (int64_t c = cols16; c < cols; ++c) dst[c * dst_ld + r] = src[r * ld + c];
  }
  for (int64_t r = rows16; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_ld + r] = src[r * ld + c];
}

void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, Out out) {
  if (M < 8) return few_rows_nt(M, N, K, alpha, A, lda, B, ldb, C, ldc, out);
  // B's rows are C's columns. Each panel of up to 32 of them is transposed into a small buffer
  // (K x 32 floats: 8 KB at K = 64, in L1) that every row block of A then streams, so B is read
  // once, row by row, whatever M is.
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(K) * 32);
  const AView a{A, lda, 1};
  auto transpose_panel = [&](int64_t j, int64_t width) { transpose(B + j * ldb, width, K, ldb, panel.data(), width); };
  int64_t j = 0;
  for (; j + 32 <= N; j += 32) {
    transpose_panel(j, 32);
    column_panel<2, f32x16, 16>(M, K, alpha, a, panel.data(), 32, C + j, ldc, out);
  }
  for (; j + 16 <= N; j += 16) {
    transpose_panel(j, 16);
    column_panel<1, f32x16, 16>(M, K, alpha, a, panel.data(), 16, C + j, ldc, out);
  }
  for (; j + 8 <= N; j += 8) {
    transpose_panel(j, 8);
    column_panel<1, f32x8, 8>(M, K, alpha, a, panel.data(), 8, C + j, ldc, out);
  }
  if (j < N) {
    const int64_t width = N - j;
    narrow_tail(M, width, K, alpha, a, [&](float* padded) { transpose(B + j * ldb, width, K, ldb, padded, 8); },
                C + j, ldc, out);
  }
}

SDPA_MATH_CPU_END

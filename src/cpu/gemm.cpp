#include "gemm.h"

#include <algorithm>
#include <type_traits>
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

// The register tile of this level: kTileRows rows of A by kTileVecs vectors of Vec (kWidth floats)
// of B. Its kTileRows * kTileVecs accumulators, kTileVecs vectors of B and one broadcast of A
// must fit the level's vector registers for the whole K loop, or every FMA spills to the stack:
//   AVX-512: 8 x 2 zmm of 16 floats, 19 of 32 registers;
//   AVX2:    6 x 2 ymm of 8 floats, 15 of 16;
//   baseline (SSE2): 6 x 2 xmm of 4 floats, 15 of 16.
// (One 8 x 2 x 16-float tile for every level made the AVX2 forward 10x slower: GCC split each
// 64-byte vector into two ymm, 32 accumulators for 16 registers, and built each broadcast of A
// through the stack.)
// Columns are taken in panels of kTileVecs vectors, then one vector, then (AVX-512) 8 floats,
// and the last fewer than kTailWidth are padded (narrow_tail).
using Vec = vf32;
constexpr int kTileRows = SDPA_MATH_CPU_LEVEL >= 4 ? 8 : 6;
constexpr int kWidth = kLanes;
constexpr int kTileVecs = 2;
constexpr int kPanelWidth = kTileVecs * kWidth;
// The narrowest vector step, and the width the last columns are padded to.
using TailVec = std::conditional_t<(kWidth > 8), f32x8, Vec>;
constexpr int kTailWidth = sizeof(TailVec) / sizeof(float);

// MR rows by NV vectors of W floats, accumulated in registers over the whole K loop.
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

// A column panel of NV vectors of V over all M rows: blocks of kTileRows rows, then 4, then 1.
template <int NV, class V>
void column_panel(int64_t M, int64_t K, float alpha, AView A, const float* B, int64_t ldb, float* C, int64_t ldc,
                  Out out) {
  constexpr int W = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + kTileRows <= M; i += kTileRows)
    micro<kTileRows, NV, V, W>(K, alpha, {A.at(i), A.row, A.step}, B, ldb, C + i * ldc, ldc, out);
  for (; i + 4 <= M; i += 4) micro<4, NV, V, W>(K, alpha, {A.at(i), A.row, A.step}, B, ldb, C + i * ldc, ldc, out);
  for (; i < M; ++i) micro<1, NV, V, W>(K, alpha, {A.at(i), A.row, A.step}, B, ldb, C + i * ldc, ldc, out);
}

// Fewer than kTailWidth columns left (N = 300 leaves 4 on AVX-512): they are copied, zero-padded,
// into a K x kTailWidth panel (`fill_panel`) and run through the one-vector block into a scratch
// tile, so they take vector FMAs too instead of a scalar loop over M x K.
template <class FillPanel>
void narrow_tail(int64_t M, int64_t width, int64_t K, float alpha, AView A, FillPanel&& fill_panel, float* C,
                 int64_t ldc, Out out) {
  constexpr int64_t kRows = 64;
  thread_local std::vector<float> panel, tile;
  panel.assign(static_cast<size_t>(K) * kTailWidth, 0.0f);
  tile.resize(kRows * kTailWidth);
  fill_panel(panel.data());
  for (int64_t i0 = 0; i0 < M; i0 += kRows) {
    const int64_t rows = std::min(kRows, M - i0);
    column_panel<1, TailVec>(rows, K, alpha, {A.at(i0), A.row, A.step}, panel.data(), kTailWidth, tile.data(),
                             kTailWidth, Out::Set);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) {
        float& dst = C[(i0 + r) * ldc + c];
        dst = tile[r * kTailWidth + c] + (out == Out::Add ? dst : 0.0f);
      }
  }
}

// C = alpha A B, B row-major K x N, in column panels (see kPanelWidth), then a padded narrow tail.
void product(int64_t M, int64_t N, int64_t K, float alpha, AView A, const float* B, int64_t ldb, float* C,
             int64_t ldc, Out out) {
  int64_t j = 0;
  for (; j + kPanelWidth <= N; j += kPanelWidth) column_panel<kTileVecs, Vec>(M, K, alpha, A, B + j, ldb, C + j, ldc, out);
  for (; j + kWidth <= N; j += kWidth) column_panel<1, Vec>(M, K, alpha, A, B + j, ldb, C + j, ldc, out);
  if constexpr (kTailWidth < kWidth)
    for (; j + kTailWidth <= N; j += kTailWidth) column_panel<1, TailVec>(M, K, alpha, A, B + j, ldb, C + j, ldc, out);
  if (j < N) {
    const int64_t width = N - j;
    narrow_tail(M, width, K, alpha, A, [&](float* panel) {
      for (int64_t k = 0; k < K; ++k) std::copy(B + k * ldb + j, B + k * ldb + N, panel + k * kTailWidth);
    }, C + j, ldc, out);
  }
}

// C = alpha A B^T for a few rows of A (decode: one query row against every key). Transposing a
// panel of B costs K element moves per key, against M K / kLanes vector FMAs of use: with M < 8
// it dominates. Here each row of A meets kLanes rows of B as kLanes vector dot products, summed
// lane-wise by sum_each; B is read once, row by row.
void few_rows_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                 int64_t ldb, float* C, int64_t ldc, Out out) {
  const int64_t k_full = K - K % kLanes;
  int64_t j = 0;
  for (; j + kLanes <= N; j += kLanes) {
    const float* b = B + j * ldb;
    for (int64_t i = 0; i < M; ++i) {
      const float* a = A + i * lda;
      vf32 acc[kLanes];
      for (int t = 0; t < kLanes; ++t) acc[t] = vf32{};
      for (int64_t k = 0; k < k_full; k += kLanes) {
        const vf32 av = load(a + k);
        for (int t = 0; t < kLanes; ++t) acc[t] += av * load(b + t * ldb + k);
      }
      vf32 sums = sum_each(acc);
      for (int64_t k = k_full; k < K; ++k)
        for (int t = 0; t < kLanes; ++t) sums[t] += a[k] * b[t * ldb + k];
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
  // kLanes x kLanes blocks in registers; the right and bottom edges element by element.
  const int64_t rows_b = rows - rows % kLanes, cols_b = cols - cols % kLanes;
  for (int64_t r0 = 0; r0 < rows_b; r0 += kLanes) {
    for (int64_t c0 = 0; c0 < cols_b; c0 += kLanes) {
      vf32 block[kLanes];
      for (int i = 0; i < kLanes; ++i) block[i] = load(src + (r0 + i) * ld + c0);
      transpose_block(block);
      for (int i = 0; i < kLanes; ++i) store(dst + (c0 + i) * dst_ld + r0, block[i]);
    }
    for (int64_t r = r0; r < r0 + kLanes; ++r)
      for (int64_t c = cols_b; c < cols; ++c) dst[c * dst_ld + r] = src[r * ld + c];
  }
  for (int64_t r = rows_b; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_ld + r] = src[r * ld + c];
}

void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, Out out) {
  if (M < 8) return few_rows_nt(M, N, K, alpha, A, lda, B, ldb, C, ldc, out);
  // B's rows are C's columns. Each panel of up to kPanelWidth of them is transposed into a small
  // buffer (K x 32 floats on AVX-512: 8 KB at K = 64, in L1) that every row block of A then streams, so B is read
  // once, row by row, whatever M is.
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(K) * kPanelWidth);
  const AView a{A, lda, 1};
  auto transpose_panel = [&](int64_t j, int64_t width) { transpose(B + j * ldb, width, K, ldb, panel.data(), width); };
  int64_t j = 0;
  for (; j + kPanelWidth <= N; j += kPanelWidth) {
    transpose_panel(j, kPanelWidth);
    column_panel<kTileVecs, Vec>(M, K, alpha, a, panel.data(), kPanelWidth, C + j, ldc, out);
  }
  for (; j + kWidth <= N; j += kWidth) {
    transpose_panel(j, kWidth);
    column_panel<1, Vec>(M, K, alpha, a, panel.data(), kWidth, C + j, ldc, out);
  }
  if constexpr (kTailWidth < kWidth)
    for (; j + kTailWidth <= N; j += kTailWidth) {
      transpose_panel(j, kTailWidth);
      column_panel<1, TailVec>(M, K, alpha, a, panel.data(), kTailWidth, C + j, ldc, out);
    }
  if (j < N) {
    const int64_t width = N - j;
    narrow_tail(M, width, K, alpha, a,
                [&](float* padded) { transpose(B + j * ldb, width, K, ldb, padded, kTailWidth); }, C + j, ldc, out);
  }
}

SDPA_MATH_CPU_END

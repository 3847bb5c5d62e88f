// Small fp32 matrix products for the attention tiles, all row-major with leading dimensions.
// Tiles here are at most a few hundred on a side and live in cache, so a register-blocked kernel
// without packing A is enough (see bench/NOTES.md).
#pragma once

#include <cstdint>

namespace sdpa_math::cpu {

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool accumulate);

// C = alpha * A^T * B (or C += ...): A is K x M row-major, read by columns (dK = dS^T Q and
// dV = W^T dO without a transposed copy of dS or W).
void gemm_tn(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, bool accumulate);

// C = alpha * A * B^T (or C += ...): B is N x K row-major (rows of K or V), read row by row.
void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, bool accumulate);

// dst (cols x rows, leading dimension dst_ld) = src (rows x cols, leading dimension ld)
// transposed, 16 x 16 blocks at a time in registers.
void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst, int64_t dst_ld);

}  // namespace sdpa_math::cpu

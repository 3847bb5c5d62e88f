// Small fp32 matrix products for the attention tiles, all row-major with leading dimensions.
// Tiles here are at most a few hundred on a side and live in cache, so a register-blocked kernel
// without packing A is enough (see bench/NOTES.md).
#pragma once

#include "isa.h"

#include <cstdint>

SDPA_MATH_CPU_BEGIN

// How a product's result reaches C: overwrite it, add to it, or overwrite it with non-temporal
// stores (a result written once and not read again soon: its cache lines are not read in first;
// the caller ends with streaming_fence() from simd.h before other threads read it).
enum class Out { Set, Add, Stream };

void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
          float* C, int64_t ldc, Out out);

// C = alpha * A^T * B (Out::Add: C += ...): A is K x M row-major, read by columns (dK = dS^T Q and
// dV = W^T dO without a transposed copy of dS or W).
void gemm_tn(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, Out out);

// C = alpha * A * B^T (Out::Add: C += ...): B is N x K row-major (rows of K or V), read row by row.
void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
             float* C, int64_t ldc, Out out);

// dst (cols x rows, leading dimension dst_ld) = src (rows x cols, leading dimension ld)
// transposed, blocks of one vector's lanes square at a time in registers.
void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst, int64_t dst_ld);

SDPA_MATH_CPU_END

// The contract's rules as the CPU kernels apply them, one query row at a time. Forward and
// backward both call these, so each rule (mask, causal, softmax, dropout) is written once here.
#pragma once

#include "isa.h"

#include <cstdint>
#include <vector>

#include "../core/problem.h"

SDPA_MATH_CPU_BEGIN

// Strided elements of any floating (or bool) dtype to fp32, and back.
void load_row(DType dtype, const char* base, int64_t offset, int64_t stride, int64_t n, float* out);
void store_row(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n, const float* in);
void store_zeros(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n);
// The n keys of a row of P past those it can see: zeros, or NaN where the row is NaN (a NaN row
// is NaN throughout, the keys it cannot see too, as the math op's softmax gives). `tmp` holds n
// floats.
void store_hidden_keys(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n, bool nan_row, float* tmp);
// An operand whose rows the kernels read where they are, without a converted copy: fp32 with
// unit column stride.
bool rows_in_place(const core::Operand& op);
// store_row for a row written once and not read again by this call (P): contiguous fp32 goes
// out with non-temporal stores (past its first 64-byte boundary), so its cache lines are not
// read in first: P is larger than the caches on most shapes. A thread that used it calls
// streaming_fence() (simd.h) before its results are read elsewhere.
void store_row_once(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n, const float* in);

// The per-head state of one query row i: what the mask adds, which columns causal allows.
struct RowContext {
  const core::Problem& p;
  int64_t lead;
  int64_t mask_base = 0, dmask_base = 0;
  RowContext(const core::Problem& problem, int64_t lead_index);

  // Number of keys row i may attend to at all (causal: i + 1, top-left aligned).
  int64_t visible(int64_t i) const;
  // scores[0..n) (already scale * q.k) become the masked logits: + float mask, bool False and
  // causal-hidden entries -inf (contract §3-§5). `tmp` holds n floats.
  void mask_scores(int64_t i, float* scores, int64_t n, float* tmp) const;
  // keep[0..n) = the dropout keep mask of row i as 0/1 (contract §8, §9); all ones without dropout.
  void keep_row(int64_t i, float* keep, int64_t n) const;
};

// Softmax of one row of logits in place; returns the log-sum-exp (-inf when every logit is
// -inf, and then the row is all zeros: contract §6; NaN when a logit is NaN, and then the row is
// all NaN, as the math op's softmax gives). exp has |relative error| < 2e-7 on
// [-87, 0] and gives 0 below -87.
float softmax_row(float* x, int64_t n);

// −Σ_j P_j log P_j of a softmax row P (no NaN, not fully masked) of logits x, n entries each, as
// −log P_max + Σ_j P_j (m − x_j) with m = max x and P_max = max P: every term ≥ 0, so the sum has
// no cancellation, and one logarithm a row (not from the lse: next to a float mask's finfo.min,
// m + log Σ rounds back to m in fp32 and every lse − x_j would be 0). Each term in fp32 (two
// roundings, ≤ 1.2e-7 relative), summed in fp64 lanes (half a vector's worth: 8 on AVX-512, 4 on
// AVX2, 2 on the baseline) in a fixed order per level, so levels may differ in the last bits.
// Entries with P_j = 0 add 0 (a hidden key's x_j is −inf).
double entropy_row(const float* p, const float* x, int64_t n);


// Threads to use for `tasks` independent tasks.
int threads_for(int64_t tasks);

// One head's key and value as fp32 rows (S x E and S x Ev), the B operands of every tile
// product: pointers straight into the inputs when they are fp32 with unit column stride, else
// converted copies, kept while consecutive tasks of a thread stay on the same head. With
// `transposed`, K^T and V^T (E x S, Ev x S) are built on first use and kept too: when many row
// blocks share a head, one transposed copy per head is cheaper than gemm_nt's transposing every
// panel for every block (measured: Q K^T at 65-88 GFLOP/s through gemm_nt, 110 through gemm, one
// core). The forward needs only K^T, the backward from a saved P only V^T.
struct HeadPack {
  const float* key = nullptr;
  int64_t key_ld = 0;
  const float* value = nullptr;
  int64_t value_ld = 0;
  void pack(const core::Problem& p, int64_t lead, bool transposed);
  // C = alpha * A K^T and C = alpha * A V^T over the first `cols` keys (C: rows x cols).
  void times_key_t(int64_t rows, int64_t cols, float alpha, const float* A, int64_t lda, float* C, int64_t ldc);
  void times_value_t(int64_t rows, int64_t cols, float alpha, const float* A, int64_t lda, float* C, int64_t ldc);

 private:
  int64_t E = 0, Ev = 0, S = 0;
  int64_t key_at = -1, value_at = -1;
  bool use_t = false, key_t_ready = false, value_t_ready = false;
  std::vector<float> key_copy, value_copy, key_t, value_t;
};

// Tasks (head, row block) a thread takes at a time: a whole head's blocks when there are heads
// enough to share out, so that one thread builds each head's K^T, V^T (and sums its dK, dV)
// once; else one block, for balance.
int64_t task_chunk(int64_t heads, int64_t blocks_per_head, int threads);

// sum_j a[j] * b[j] in fp32, vectorised.
float dot_row(const float* a, const float* b, int64_t n);

// Query rows per task: the block's fp32 scores (rows x S) should stay in a core's L2 (forward.cpp).
int64_t rows_per_block(int64_t S);

SDPA_MATH_CPU_END

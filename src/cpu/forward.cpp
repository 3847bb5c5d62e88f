// CPU forward. Per task (one head, one block of query rows):
//   scores = scale * Q_blk K^T (tile product) -> mask/causal -> softmax -> dropout -> store P once
//   (the block stays in L2; P is written with streaming stores, see store_row_once)
//   O_blk = P_blk V (times 1/(1-p) for an explicit dropout mask)
// Causal blocks compute only the keys their last row can see; the rest of P is stored as zeros.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "rows.h"
#include "simd.h"

SDPA_MATH_CPU_BEGIN

int64_t rows_per_block(int64_t S) {
  // 32K floats = 128 KB of scores per block (S = 1024 -> 32 rows), in multiples of the AVX-512
  // GEMM tile's 8 rows, between 8 and 64. (AVX2 and the baseline have 6-row tiles: a 32-row block
  // there ends in two one-row passes; not yet measured whether other multiples pay, NOTES.)
  int64_t rows = 32768 / std::max<int64_t>(S, 1);
  return std::clamp<int64_t>(rows / 8 * 8, 8, 64);
}

void forward(const core::Problem& p, const ForwardOutputs& out) {
  const core::Operand O = core::output_operand(p, out.output, true);
  const core::Operand P = core::output_operand(p, out.attn_probs, true);
  const core::Operand LSE = core::output_operand(p, out.logsumexp, false);
  const int64_t S = p.S, E = p.E, Ev = p.Ev;
  const int64_t block = rows_per_block(S);
  const int64_t blocks_per_head = (p.L + block - 1) / block;
  const int64_t tasks = p.num_lead * blocks_per_head;
  if (tasks == 0) return;
  const float o_scale = p.dropout == core::DropoutMode::ExplicitMask ? static_cast<float>(p.keep_scale()) : 1.0f;
  const float p_scale = p.dropout == core::DropoutMode::Random ? static_cast<float>(p.keep_scale()) : 1.0f;
  char* o_data = static_cast<char*>(out.output.data);
  char* p_data = static_cast<char*>(out.attn_probs.data);

  const int nthreads = threads_for(tasks);
  const int64_t chunk = task_chunk(p.num_lead, blocks_per_head, nthreads);
  FirstError errors;  // an exception (say, no memory for the scratch rows) reaches the caller
#pragma omp parallel num_threads(nthreads)
  {
    HeadPack pack;
    std::vector<float> q, scores, o, tmp, keep;
    errors.run([&] {
      q.resize(block * E), scores.resize(block * S), o.resize(block * Ev), tmp.resize(S), keep.resize(S);
    });
#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < tasks; ++t) errors.run([&] {
      const int64_t lead = t / blocks_per_head, i0 = (t % blocks_per_head) * block;
      const int64_t rows = std::min(block, p.L - i0);
      pack.pack(p, lead, blocks_per_head > 1);
      const RowContext ctx(p, lead);
      const int64_t q_at = core::lead_offset(p, p.query, lead);
      for (int64_t r = 0; r < rows; ++r)
        load_row(p.dtype, p.query.data, q_at + (i0 + r) * p.query.row_stride, p.query.col_stride, E, q.data() + r * E);
      const int64_t cols = ctx.visible(i0 + rows - 1);  // keys any row of the block can see
      const int64_t o_at = core::lead_offset(p, O, lead), p_at = core::lead_offset(p, P, lead),
                    l_at = core::lead_offset(p, LSE, lead);
      pack.times_key_t(rows, cols, static_cast<float>(p.scale), q.data(), E, scores.data(), S);

      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        float* row = scores.data() + r * S;
        ctx.mask_scores(i, row, cols, tmp.data());
        const float lse = softmax_row(row, cols);
        if (p.dropout != core::DropoutMode::None) {
          ctx.keep_row(i, keep.data(), cols);
          for (int64_t j = 0; j < cols; ++j) row[j] *= keep[j] * p_scale;
        }
        store_row_once(P.dtype, p_data, p_at + i * P.row_stride, P.col_stride, cols, row);
        store_hidden_keys(P.dtype, p_data, p_at + i * P.row_stride + cols * P.col_stride, P.col_stride, S - cols,
                          std::isnan(lse), tmp.data());
        const float lse_value[1] = {lse};
        store_row(LSE.dtype, static_cast<char*>(out.logsumexp.data), l_at + i * LSE.row_stride, 1, 1, lse_value);
      }

      gemm(rows, Ev, cols, o_scale, scores.data(), S, pack.value, pack.value_ld, o.data(), Ev, Out::Set);
      for (int64_t r = 0; r < rows; ++r)
        store_row(O.dtype, o_data, o_at + (i0 + r) * O.row_stride, O.col_stride, Ev, o.data() + r * Ev);
      streaming_fence();
    });
  }
  errors.rethrow();
}

SDPA_MATH_CPU_END

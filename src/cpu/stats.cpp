// CPU statistics of P without writing it (attention.h, StatsOutputs). The forward's tasks, with
// the store of P replaced by the reductions:
//   scores = scale * Q_blk K^T -> mask/causal -> softmax (P's rows, in cache only)
//   row_entropy_i = -log P_i,max + sum_j P_ij (m_i - x_ij)   (x: the masked logits, m_i their
//                   maximum; every term >= 0, so the sum has no cancellation; equal to
//                   -sum P log P, with one logarithm a row: entropy_row, rows.h)
//   col_sum_j    += P_ij over the block's rows, in fp64
//   rows: P's rows of the window asked for, stored as the forward stores P
//   O_blk = P_blk V
// A task is one head's row blocks g, g + G, g + 2G, ... for G groups per head: G = 1 when there
// are heads enough for the threads (a task owns its head's column sums and writes them), else
// each group sums into its own fp64 row and the groups are added in order after the parallel
// region, so the result does not depend on which thread ran what (it does on how many threads
// there are, through G).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/element.h"
#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "rows.h"
#include "simd.h"

SDPA_MATH_CPU_BEGIN

void forward_stats(const core::Problem& p, const StatsOutputs& out) {
  const core::Operand O = core::output_operand(p, out.output, true);
  const core::Operand LSE = core::output_operand(p, out.logsumexp, false);
  const core::Operand CS = out.col_sum ? core::output_operand(p, *out.col_sum, false) : core::Operand{};
  const core::Operand ENT = out.row_entropy ? core::output_operand(p, *out.row_entropy, false) : core::Operand{};
  const core::Operand WIN = out.rows ? core::output_operand(p, *out.rows, true) : core::Operand{};
  const int64_t win_rows = out.rows ? out.rows->shape.dims[out.rows->shape.ndim - 2] : 0;
  const bool want_cols = out.col_sum.has_value(), want_entropy = out.row_entropy.has_value();
  const int64_t S = p.S, E = p.E, Ev = p.Ev;
  const int64_t block = rows_per_block(S);
  const int64_t blocks_per_head = (p.L + block - 1) / block;
  if (p.num_lead == 0) return;
  // Groups of row blocks per head (at least 1, so a head with no rows still writes zero column
  // sums). G depends on the thread count: the sums are reproducible for a given count.
  const int64_t groups = std::clamp<int64_t>((threads_for(p.num_lead * blocks_per_head) + p.num_lead - 1) / p.num_lead, 1,
                                             std::max<int64_t>(blocks_per_head, 1));
  const int64_t tasks = p.num_lead * groups;
  const int nthreads = threads_for(tasks);
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  // The groups' column sums when a head has several groups (G > 1 only when heads are fewer than
  // threads, so this holds at most about 2 x threads rows of S).
  std::vector<double> partial;
  if (want_cols && groups > 1) partial.assign(static_cast<size_t>(tasks * S), 0.0);
  char* o_data = static_cast<char*>(out.output.data);

  FirstError errors;
#pragma omp parallel num_threads(nthreads)
  {
    HeadPack pack;
    std::vector<float> q, scores, o, tmp, logits;
    std::vector<double> cols;
    errors.run([&] {
      q.resize(block * E), scores.resize(block * S), o.resize(block * Ev), tmp.resize(S);
      if (want_entropy) logits.resize(S);
      if (want_cols) cols.resize(S);
    });
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) errors.run([&] {
      const int64_t lead = t / groups, g = t % groups;
      pack.pack(p, lead, blocks_per_head > 1);
      const RowContext ctx(p, lead);
      const int64_t q_at = core::lead_offset(p, p.query, lead), o_at = core::lead_offset(p, O, lead),
                    l_at = core::lead_offset(p, LSE, lead);
      if (want_cols) std::fill(cols.begin(), cols.end(), 0.0);
      for (int64_t b = g; b < blocks_per_head; b += groups) {
        const int64_t i0 = b * block, rows = std::min(block, p.L - i0);
        for (int64_t r = 0; r < rows; ++r)
          load_row(p.dtype, p.query.data, q_at + (i0 + r) * p.query.row_stride, p.query.col_stride, E, q.data() + r * E);
        const int64_t visible = ctx.visible(i0 + rows - 1);  // keys any row of the block can see
        pack.times_key_t(rows, visible, static_cast<float>(p.scale), q.data(), E, scores.data(), S);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* row = scores.data() + r * S;
          ctx.mask_scores(i, row, visible, tmp.data());
          if (want_entropy) std::copy(row, row + visible, logits.begin());
          const float lse = softmax_row(row, visible);
          const bool nan_row = std::isnan(lse);
          if (want_entropy) {
            double h = 0.0;
            if (nan_row) {
              h = kNaN;
            } else if (lse != -std::numeric_limits<float>::infinity()) {
              h = entropy_row(row, logits.data(), visible);
            }
            core::store_from_double(ENT.dtype, out.row_entropy->data, core::lead_offset(p, ENT, lead) + i * ENT.row_stride, h);
          }
          if (want_cols) {
            if (nan_row) {  // a NaN row of P is NaN throughout, the keys it cannot see too
              for (int64_t j = 0; j < S; ++j) cols[j] += kNaN;
            } else {
              for (int64_t j = 0; j < visible; ++j) cols[j] += row[j];
            }
          }
          const int64_t k = i - out.rows_first;  // the window's rows: P itself
          if (win_rows > 0 && k >= 0 && k % out.rows_step == 0 && k / out.rows_step < win_rows) {
            char* w_data = static_cast<char*>(out.rows->data);
            const int64_t w_at = core::lead_offset(p, WIN, lead) + (k / out.rows_step) * WIN.row_stride;
            store_row(WIN.dtype, w_data, w_at, WIN.col_stride, visible, row);
            store_hidden_keys(WIN.dtype, w_data, w_at + visible * WIN.col_stride, WIN.col_stride, S - visible, nan_row,
                              tmp.data());
          }
          const float lse_value[1] = {lse};
          store_row(LSE.dtype, static_cast<char*>(out.logsumexp.data), l_at + i * LSE.row_stride, 1, 1, lse_value);
        }
        gemm(rows, Ev, visible, 1.0f, scores.data(), S, pack.value, pack.value_ld, o.data(), Ev, Out::Set);
        for (int64_t r = 0; r < rows; ++r)
          store_row(O.dtype, o_data, o_at + (i0 + r) * O.row_stride, O.col_stride, Ev, o.data() + r * Ev);
      }
      if (want_cols) {
        if (groups == 1) {
          const int64_t c_at = core::lead_offset(p, CS, lead);
          for (int64_t j = 0; j < S; ++j) core::store_from_double(CS.dtype, out.col_sum->data, c_at + j * CS.row_stride, cols[j]);
        } else {
          std::copy(cols.begin(), cols.end(), partial.begin() + t * S);
        }
      }
    });
  }
  errors.rethrow();
  if (want_cols && groups > 1) {
    for (int64_t lead = 0; lead < p.num_lead; ++lead) {
      const int64_t c_at = core::lead_offset(p, CS, lead);
      for (int64_t j = 0; j < S; ++j) {
        double sum = 0.0;
        for (int64_t g = 0; g < groups; ++g) sum += partial[(lead * groups + g) * S + j];
        core::store_from_double(CS.dtype, out.col_sum->data, c_at + j * CS.row_stride, sum);
      }
    }
  }
}

SDPA_MATH_CPU_END

// CPU backward (contract §11). Per task (one head, one block of query rows) the softmax A is
// recomputed from Q and K, row by row by max and sum as the forward took it (A is needed where
// dropout zeroed P, so the stored P cannot serve), then
//   G = dO V^T,  dA by the dropout rule,  dS = A (dA - rowsum(A dA)),
//   dQ += scale dS K,  dK += scale dS^T Q,  dV += W^T dO,  dMask += dS.
// Gradients accumulate in fp32 per thread (in dense buffers of each input's own shape, where
// broadcast and GQA copies sum by construction), then are summed and written once.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../core/element.h"
#include "gemm.h"
#include "kernels.h"
#include "rows.h"

namespace sdpa_math::cpu {
namespace {

struct Grads {
  std::vector<float> q, k, v, mask;
};

// dst += src over a (rows x cols) block with the given strides of dst.
void add_block(float* dst, int64_t row_stride, int64_t col_stride, const float* src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * row_stride + c * col_stride] += src[r * cols + c];
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t src_ld, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * src_ld + c];
}

}  // namespace

void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out) {
  const int64_t S = p.S, E = p.E, Ev = p.Ev;
  const bool has_dO = args.grad_output.has_value(), has_dP = args.grad_probs.has_value();
  const bool want_mask = out.grad_attn_mask.has_value();
  const core::Operand dO = has_dO ? core::output_operand(p, *args.grad_output, true) : core::Operand{};
  const core::Operand dP = has_dP ? core::output_operand(p, *args.grad_probs, true) : core::Operand{};
  const int64_t block = rows_per_block(S);
  const int64_t blocks_per_head = (p.L + block - 1) / block;
  const int64_t tasks = p.num_lead * blocks_per_head;
  const float c = static_cast<float>(p.keep_scale());
  const float scale = static_cast<float>(p.scale);
  const int nthreads = threads_for(std::max<int64_t>(tasks, 1));
  std::vector<Grads> grads(nthreads);

#pragma omp parallel num_threads(nthreads)
  {
    Grads& g = grads[omp_get_thread_num()];
    g.q.assign(p.query.own_shape.numel(), 0.0f);
    g.k.assign(p.key.own_shape.numel(), 0.0f);
    g.v.assign(p.value.own_shape.numel(), 0.0f);
    g.mask.assign(want_mask ? p.attn_mask.own_shape.numel() : 0, 0.0f);
    HeadPack pack;
    std::vector<float> q(block * E), dout(block * Ev), A(block * S), dA(block * S), W(block * S);
    std::vector<float> transposed(S * block), dk(S * E), dv(S * Ev), tmp(S), keep(S), dp(S);
    int64_t acc_lead = -1;  // the head whose dK, dV sit in dk, dv
    auto flush = [&]() {
      if (acc_lead < 0) return;
      add_block(g.k.data() + core::dense_lead_offset(p, p.key, acc_lead), p.key.dense_row_stride,
                p.key.dense_col_stride, dk.data(), S, E);
      add_block(g.v.data() + core::dense_lead_offset(p, p.value, acc_lead), p.value.dense_row_stride,
                p.value.dense_col_stride, dv.data(), S, Ev);
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
    };

#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t lead = t / blocks_per_head, i0 = (t % blocks_per_head) * block;
      const int64_t rows = std::min(block, p.L - i0);
      if (lead != acc_lead) {
        flush();
        acc_lead = lead;
      }
      pack.pack(p, lead, true);
      const RowContext ctx(p, lead);
      const int64_t q_at = core::lead_offset(p, p.query, lead);
      for (int64_t r = 0; r < rows; ++r)
        load_row(p.dtype, p.query.data, q_at + (i0 + r) * p.query.row_stride, p.query.col_stride, E, q.data() + r * E);
      const int64_t cols = ctx.visible(i0 + rows - 1);

      // A = softmax recomputed; G = dO V^T into dA.
      gemm(rows, cols, E, scale, q.data(), E, pack.key_t.data(), S, A.data(), S, false);
      if (has_dO) {
        const int64_t at = core::lead_offset(p, dO, lead);
        for (int64_t r = 0; r < rows; ++r)
          load_row(dO.dtype, dO.data, at + (i0 + r) * dO.row_stride, dO.col_stride, Ev, dout.data() + r * Ev);
        gemm(rows, cols, Ev, 1.0f, dout.data(), Ev, pack.value_t.data(), S, dA.data(), S, false);
      } else {
        std::fill(dA.begin(), dA.end(), 0.0f);
      }
      const int64_t dp_at = has_dP ? core::lead_offset(p, dP, lead) : 0;
      const int64_t gm_at = want_mask ? core::dense_lead_offset(p, p.attn_mask, lead) : 0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        float* a = A.data() + r * S;
        float* da = dA.data() + r * S;
        float* w = W.data() + r * S;
        ctx.mask_scores(i, a, cols, tmp.data());
        // The softmax again, as the forward took it (max, sum, divide), not exp(s - lse): where
        // every logit is near finfo.min, lse rounds to the max and would lose the 1/sum.
        softmax_row(a, cols);
        if (has_dP) load_row(dP.dtype, dP.data, dp_at + i * dP.row_stride, dP.col_stride, cols, dp.data());
        else std::fill(dp.begin(), dp.begin() + cols, 0.0f);
        ctx.keep_row(i, keep.data(), cols);
        // dA and W per the table of contract §11 (W = A without dropout, c A M with either rule).
        switch (p.dropout) {
          case core::DropoutMode::None:
            for (int64_t j = 0; j < cols; ++j) { da[j] += dp[j]; w[j] = a[j]; }
            break;
          case core::DropoutMode::ExplicitMask:
            for (int64_t j = 0; j < cols; ++j) { da[j] = keep[j] * (c * da[j] + dp[j]); w[j] = c * a[j] * keep[j]; }
            break;
          case core::DropoutMode::Random:
            for (int64_t j = 0; j < cols; ++j) { da[j] = c * keep[j] * (da[j] + dp[j]); w[j] = c * a[j] * keep[j]; }
            break;
        }
        float delta = 0.0f;
        for (int64_t j = 0; j < cols; ++j) delta += a[j] * da[j];
        for (int64_t j = 0; j < cols; ++j) da[j] = a[j] * (da[j] - delta);  // dS
        if (want_mask) {
          float* gm = g.mask.data() + gm_at + i * p.attn_mask.dense_row_stride;
          for (int64_t j = 0; j < cols; ++j) gm[j * p.attn_mask.dense_col_stride] += da[j];
        }
      }
      // dQ += scale dS K, straight into the dense buffer (its rows are E apart).
      gemm(rows, E, cols, scale, dA.data(), S, pack.key.data(), E,
           g.q.data() + core::dense_lead_offset(p, p.query, lead) + i0 * p.query.dense_row_stride,
           p.query.dense_row_stride, true);
      // dK += scale dS^T Q and dV += W^T dO for the keys this block sees.
      transpose(dA.data(), rows, cols, S, transposed.data());
      gemm(cols, E, rows, scale, transposed.data(), rows, q.data(), E, dk.data(), E, true);
      if (has_dO) {
        transpose(W.data(), rows, cols, S, transposed.data());
        gemm(cols, Ev, rows, 1.0f, transposed.data(), rows, dout.data(), Ev, dv.data(), Ev, true);
      }
    }
    flush();
  }

  // Sum the threads' buffers into the first, then write each requested gradient once.
  auto reduce_and_write = [&](std::vector<float> Grads::*member, const std::optional<TensorView>& view) {
    if (!view) return;
    std::vector<float>& total = grads[0].*member;
    const int64_t n = static_cast<int64_t>(total.size());
#pragma omp parallel for num_threads(threads_for(n / 65536 + 1))
    for (int64_t e = 0; e < n; ++e)
      for (size_t t = 1; t < grads.size(); ++t) total[e] += (grads[t].*member)[e];
    core::write_dense(total.data(), *view);
  };
  reduce_and_write(&Grads::q, out.grad_query);
  reduce_and_write(&Grads::k, out.grad_key);
  reduce_and_write(&Grads::v, out.grad_value);
  reduce_and_write(&Grads::mask, out.grad_attn_mask);
}

}  // namespace sdpa_math::cpu

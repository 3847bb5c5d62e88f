// CPU backward (contract §11). Per task (one head, one block of query rows):
//   A = the softmax: the saved P when there is no dropout (P is A then), else recomputed from Q
//       and K row by row by max and sum as the forward took it;
//   G = dO V^T,  dA by the dropout rule,  dS = A (dA - rowsum(A dA)),
//   dQ += scale dS K,  dK += scale dS^T Q,  dV += W^T dO,  dMask += dS.
// dQ, dK and dV accumulate in fp32 in one dense buffer per input, of the input's own shape (where
// broadcast and GQA copies sum by construction), shared by the threads; a float32 contiguous
// gradient is that buffer itself. A thread sums a head's dK and dV privately and adds them in
// when it moves to another head, or writes them outright when it runs the whole head and no other
// head shares its keys; a task writes its dQ rows outright unless Q is broadcast. dK = dS^T Q and
// dV = W^T dO read dS and W by columns (gemm_tn), without transposed copies.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "../core/element.h"
#include "gemm.h"
#include "kernels.h"
#include "parallel.h"
#include "rows.h"
#include "simd.h"

SDPA_MATH_CPU_BEGIN
namespace {

// dst += src over a (rows x cols) block with the given strides of dst.
void add_block(float* dst, int64_t row_stride, int64_t col_stride, const float* src, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = dst + r * row_stride;
    const float* s = src + r * cols;
    if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) d[c] += s[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c * col_stride] += s[c];
    }
  }
}

// Where one requested gradient goes. Tasks that own their rows write them outright: into the
// output when it is float32 and contiguous, else (contiguous, another dtype) converted row by
// row into it. Otherwise tasks add into a dense fp32 buffer (the output itself when float32 and
// contiguous), zeroed by all threads first and written out once at the end.
struct GradBuffer {
  float* data = nullptr;        // fp32 rows at dense offsets (the output, or `own`)
  char* converted = nullptr;    // else: the contiguous output, rows stored converted
  DType dtype = DType::Float32;
  int64_t numel = 0;
  bool zero_first = false;
  std::unique_ptr<float[]> own;  // uninitialised: zeroed or written in the parallel region
  const TensorView* view = nullptr;

  void init(const std::optional<TensorView>& out, bool rows_owned) {
    if (!out) return;
    view = &*out;
    numel = out->shape.numel();
    dtype = out->dtype;
    zero_first = !rows_owned;
    if (out->dtype == DType::Float32 && out->is_contiguous()) {
      data = static_cast<float*>(out->data);
    } else if (rows_owned && out->is_contiguous()) {
      converted = static_cast<char*>(out->data);
    } else {
      own.reset(new float[numel]);
      data = own.get();
      zero_first = true;  // written out whole at the end: every element must be set
    }
  }
  bool wanted() const { return view != nullptr; }
  // Owned rows computed elsewhere (src: rows x width, packed) into place; rows [rows, total)
  // of the block are zeros.
  void write_rows(int64_t offset, int64_t row_stride, const float* src, int64_t rows, int64_t total,
                  int64_t width) const {
    for (int64_t r = 0; r < total; ++r) {
      const int64_t at = offset + r * row_stride;
      if (data) {
        if (r < rows) std::copy(src + r * width, src + (r + 1) * width, data + at);
        else std::fill(data + at, data + at + width, 0.0f);
      } else if (r < rows) {
        store_row(dtype, converted, at, 1, width, src + r * width);
      } else {
        store_zeros(dtype, converted, at, 1, width);
      }
    }
  }
  // Called by every thread of the team.
  void zero_in_parallel() const {
    if (!data || !zero_first) return;
    constexpr int64_t kChunk = 1 << 16;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < numel; c += kChunk) std::fill(data + c, data + std::min(numel, c + kChunk), 0.0f);
  }
  // Writes the dense buffer into a non-contiguous or non-fp32 output, a row at a time.
  void finish() const {
    if (!view || !own) return;
    const TensorView& v = *view;
    const int last = v.shape.ndim - 1;
    const int64_t width = v.shape.dims[last];
    Shape rows_shape = v.shape;
    rows_shape.ndim = last;
    char* base = static_cast<char*>(v.data);
    core::for_each_element(rows_shape, v.strides, [&](int64_t linear, int64_t offset) {
      store_row(v.dtype, base, offset, v.strides[last], width, own.get() + linear * width);
    });
  }
};

}  // namespace

void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out) {
  const int64_t S = p.S, E = p.E, Ev = p.Ev;
  const bool has_dO = args.grad_output.has_value(), has_dP = args.grad_probs.has_value();
  const bool want_mask = out.grad_attn_mask.has_value();
  const core::Operand dO = has_dO ? core::output_operand(p, *args.grad_output, true) : core::Operand{};
  const core::Operand dP = has_dP ? core::output_operand(p, *args.grad_probs, true) : core::Operand{};
  // Without dropout the forward's P is A itself (rounded to P's dtype, as the math op's own
  // backward takes it); with dropout P has zeros where A has none, so A is recomputed.
  const bool saved_A = args.attn_probs.has_value() && p.dropout == core::DropoutMode::None;
  const core::Operand Psaved = saved_A ? core::output_operand(p, *args.attn_probs, true) : core::Operand{};
  const int64_t block = rows_per_block(S);
  const int64_t blocks_per_head = (p.L + block - 1) / block;
  const int64_t tasks = p.num_lead * blocks_per_head;
  const float c = static_cast<float>(p.keep_scale());
  const float scale = static_cast<float>(p.scale);
  const int nthreads = threads_for(std::max<int64_t>(tasks, 1));
  const int64_t chunk = task_chunk(p.num_lead, blocks_per_head, nthreads);

  // Distinct (lead, row) pairs own distinct dQ rows unless Q is broadcast over a lead dim: then
  // each task writes its dQ rows outright.
  const bool q_rows_owned = p.query.own_shape.numel() == p.num_lead * p.L * E;
  // A thread owns a head's dK (dV) rows when it runs all of the head's row blocks (one block per
  // head, or a whole head per chunk) and no other head shares them (no GQA or broadcast on K (V)):
  // it then writes them outright (the keys no row sees: zeros), with no zeroing pass or lock.
  // No query rows (L = 0): no task writes a head, so nothing is owned and the zeroing pass writes
  // dK and dV (without it they would be left uninitialised).
  const bool whole_heads = blocks_per_head > 0 && (blocks_per_head == 1 || chunk == blocks_per_head);
  const bool k_rows_owned = whole_heads && p.key.own_shape.numel() == p.num_lead * S * E;
  const bool v_rows_owned = whole_heads && p.value.own_shape.numel() == p.num_lead * S * Ev && has_dO;
  GradBuffer gq, gk, gv;
  gq.init(out.grad_query, q_rows_owned);
  gk.init(out.grad_key, k_rows_owned);
  gv.init(out.grad_value, v_rows_owned);
  // The mask is usually broadcast over heads: each thread sums its dMask privately.
  std::vector<std::vector<float>> gmask(want_mask ? nthreads : 0);

  FirstError errors;  // an exception (say, no memory for the scratch rows) reaches the caller
#pragma omp parallel num_threads(nthreads)
  {
    float* gm_thread = nullptr;
    HeadPack pack;
    std::vector<float> q, dout, A, dA, W, tmp, keep, dp, dq_block;
    std::vector<float> dk, dv;  // a head's dK, dV: summed here unless the task writes an fp32 output
    errors.run([&] {
      if (want_mask) {
        std::vector<float>& mine = gmask[omp_get_thread_num()];
        mine.assign(p.attn_mask.own_shape.numel(), 0.0f);
        gm_thread = mine.data();
      }
      q.resize(block * E), dout.resize(block * Ev), A.resize(block * S), dA.resize(block * S), W.resize(block * S);
      tmp.resize(S), keep.resize(S), dp.resize(S), dq_block.resize(block * E);
      dk.resize(gk.wanted() && !(k_rows_owned && gk.data) ? S * E : 0);
      dv.resize(gv.wanted() && !(v_rows_owned && gv.data) ? S * Ev : 0);
    });
    gq.zero_in_parallel();  // every thread, failed or not: these share the region's work
    gk.zero_in_parallel();
    gv.zero_in_parallel();
    int64_t acc_lead = -1;  // the head whose dK, dV sit in dk, dv
    auto flush = [&]() {
      if (acc_lead < 0) return;
#pragma omp critical(sdpa_math_cpu_dkv)
      {
        if (!k_rows_owned && !dk.empty())  // owned heads were written by their task
          add_block(gk.data + core::dense_lead_offset(p, p.key, acc_lead), p.key.dense_row_stride,
                    p.key.dense_col_stride, dk.data(), S, E);
        if (!v_rows_owned && !dv.empty())
          add_block(gv.data + core::dense_lead_offset(p, p.value, acc_lead), p.value.dense_row_stride,
                    p.value.dense_col_stride, dv.data(), S, Ev);
      }
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
    };

#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < tasks; ++t) errors.run([&] {
      const int64_t lead = t / blocks_per_head, i0 = (t % blocks_per_head) * block;
      const int64_t rows = std::min(block, p.L - i0);
      if (lead != acc_lead) {
        flush();
        acc_lead = lead;
      }
      pack.pack(p, lead, blocks_per_head > 1);
      const RowContext ctx(p, lead);
      const int64_t q_at = core::lead_offset(p, p.query, lead);
      for (int64_t r = 0; r < rows; ++r)
        load_row(p.dtype, p.query.data, q_at + (i0 + r) * p.query.row_stride, p.query.col_stride, E, q.data() + r * E);
      const int64_t cols = ctx.visible(i0 + rows - 1);

      // The logits when A is recomputed; G = dO V^T into dA.
      if (!saved_A) pack.times_key_t(rows, cols, scale, q.data(), E, A.data(), S);
      if (has_dO) {
        const int64_t at = core::lead_offset(p, dO, lead);
        for (int64_t r = 0; r < rows; ++r)
          load_row(dO.dtype, dO.data, at + (i0 + r) * dO.row_stride, dO.col_stride, Ev, dout.data() + r * Ev);
        pack.times_value_t(rows, cols, 1.0f, dout.data(), Ev, dA.data(), S);
      } else {
        std::fill(dA.begin(), dA.end(), 0.0f);
      }
      const int64_t dp_at = has_dP ? core::lead_offset(p, dP, lead) : 0;
      const int64_t pa_at = saved_A ? core::lead_offset(p, Psaved, lead) : 0;
      const int64_t gm_at = want_mask ? core::dense_lead_offset(p, p.attn_mask, lead) : 0;
      // A's rows: the saved P in place when it is fp32 with unit column stride, else converted or
      // recomputed into A. dP's rows likewise, read in place when they can be.
      const float* a_rows = A.data();
      int64_t a_ld = S;
      if (saved_A && rows_in_place(Psaved)) {
        a_rows = reinterpret_cast<const float*>(Psaved.data) + pa_at + i0 * Psaved.row_stride;
        a_ld = Psaved.row_stride;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const float* a = a_rows + r * a_ld;
        float* da = dA.data() + r * S;
        float* w = W.data() + r * S;
        if (a_rows == A.data()) {
          float* a_own = A.data() + r * S;
          if (saved_A) {
            load_row(Psaved.dtype, Psaved.data, pa_at + i * Psaved.row_stride, Psaved.col_stride, cols, a_own);
          } else {
            ctx.mask_scores(i, a_own, cols, tmp.data());
            // The softmax again, as the forward took it (max, sum, divide), not exp(s - lse): where
            // every logit is near finfo.min, lse rounds to the max and would lose the 1/sum.
            softmax_row(a_own, cols);
          }
        }
        const float* dp_row = dp.data();
        if (has_dP && rows_in_place(dP)) dp_row = reinterpret_cast<const float*>(dP.data) + dp_at + i * dP.row_stride;
        else if (has_dP) load_row(dP.dtype, dP.data, dp_at + i * dP.row_stride, dP.col_stride, cols, dp.data());
        else std::fill(dp.begin(), dp.begin() + cols, 0.0f);
        // dA and W per the table of contract §11 (W = A without dropout, c A M with either rule).
        switch (p.dropout) {
          case core::DropoutMode::None:
            for (int64_t j = 0; j < cols; ++j) da[j] += dp_row[j];
            break;
          case core::DropoutMode::ExplicitMask:
            ctx.keep_row(i, keep.data(), cols);
            for (int64_t j = 0; j < cols; ++j) { da[j] = keep[j] * (c * da[j] + dp_row[j]); w[j] = c * a[j] * keep[j]; }
            break;
          case core::DropoutMode::Random:
            ctx.keep_row(i, keep.data(), cols);
            for (int64_t j = 0; j < cols; ++j) { da[j] = c * keep[j] * (da[j] + dp_row[j]); w[j] = c * a[j] * keep[j]; }
            break;
        }
        const float delta = dot_row(a, da, cols);
        for (int64_t j = 0; j < cols; ++j) da[j] = a[j] * (da[j] - delta);  // dS
        if (want_mask) {
          float* gm = gm_thread + gm_at + i * p.attn_mask.dense_row_stride;
          for (int64_t j = 0; j < cols; ++j) gm[j * p.attn_mask.dense_col_stride] += da[j];
        }
      }
      // W is A itself without dropout (the product below reads A then).
      const bool w_is_a = p.dropout == core::DropoutMode::None;
      const float* weights = w_is_a ? a_rows : W.data();
      const int64_t weights_ld = w_is_a ? a_ld : S;

      // dQ += scale dS K: written outright when this task owns the rows, else added.
      if (gq.wanted()) {
        const int64_t dq_at = core::dense_lead_offset(p, p.query, lead) + i0 * p.query.dense_row_stride;
        if (q_rows_owned && gq.data) {
          gemm(rows, E, cols, scale, dA.data(), S, pack.key, pack.key_ld, gq.data + dq_at, p.query.dense_row_stride,
               Out::Stream);
        } else {
          gemm(rows, E, cols, scale, dA.data(), S, pack.key, pack.key_ld, dq_block.data(), E, Out::Set);
          if (q_rows_owned) {
            gq.write_rows(dq_at, p.query.dense_row_stride, dq_block.data(), rows, rows, E);
          } else {
#pragma omp critical(sdpa_math_cpu_dq)
            add_block(gq.data + dq_at, p.query.dense_row_stride, p.query.dense_col_stride, dq_block.data(), rows, E);
          }
        }
      }
      // dK += scale dS^T Q and dV += W^T dO for the keys this block sees. An owned head is summed
      // over its blocks straight into an fp32 output (the first block zeroes the keys it cannot
      // see); else in dk, dv: written converted after the head's last block when owned, added
      // under the lock by flush() when not.
      const bool first_block = i0 == 0, last_block = i0 + rows == p.L;
      auto key_side = [&](const GradBuffer& g, bool owned, std::vector<float>& acc, const core::Operand& op,
                          int64_t width, float alpha, const float* a, int64_t lda, const float* b) {
        const int64_t at = core::dense_lead_offset(p, op, lead), ld = op.dense_row_stride;
        if (owned && g.data) {
          // Written once (a head of one block) it bypasses the caches; else later blocks add to it.
          const Out how = !first_block ? Out::Add : last_block ? Out::Stream : Out::Set;
          gemm_tn(cols, width, rows, alpha, a, lda, b, width, g.data + at, ld, how);
          if (first_block) g.write_rows(at + cols * ld, ld, nullptr, 0, S - cols, width);
        } else {
          gemm_tn(cols, width, rows, alpha, a, lda, b, width, acc.data(), width, Out::Add);
          if (owned && last_block) g.write_rows(at, ld, acc.data(), S, S, width);
        }
      };
      if (gk.wanted()) key_side(gk, k_rows_owned, dk, p.key, E, scale, dA.data(), S, q.data());
      if (gv.wanted() && has_dO) key_side(gv, v_rows_owned, dv, p.value, Ev, 1.0f, weights, weights_ld, dout.data());
    });
    errors.run(flush);
    streaming_fence();  // the outright dK, dV, dQ stores, before the threads join
  }
  errors.rethrow();

  gq.finish();
  gk.finish();
  gv.finish();
  if (want_mask) {
    std::vector<float>& total = gmask[0];
    const int64_t n = static_cast<int64_t>(total.size());
    for (size_t t = 1; t < gmask.size(); ++t)
      for (int64_t e = 0; e < n; ++e) total[e] += gmask[t][e];
    core::write_dense(total.data(), *out.grad_attn_mask);
  }
}

SDPA_MATH_CPU_END

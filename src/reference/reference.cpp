#include "reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/element.h"
#include "../core/kl_row.h"
#include "sdpa_math/dropout_rng.h"

namespace sdpa_math::reference {
namespace {

using core::DropoutMode;
using core::Operand;
using core::Problem;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double at(const Operand& op, int64_t base, int64_t row, int64_t col) {
  return core::load_as_double(op.dtype, op.data, base + row * op.row_stride + col * op.col_stride);
}

// One query row of one head: the softmax A before dropout, the keep mask M, the returned P and
// the matrix W that multiplies V (contract §8, §9, §11).
struct Row {
  std::vector<double> A, keep, P, W;
  double lse = kNegInf;
};

struct HeadOffsets {
  int64_t q, k, v, mask, dmask;
};

HeadOffsets head_offsets(const Problem& p, int64_t lead) {
  HeadOffsets h{core::lead_offset(p, p.query, lead), core::lead_offset(p, p.key, lead),
                core::lead_offset(p, p.value, lead), 0, 0};
  if (p.attn_mask.present()) h.mask = core::lead_offset(p, p.attn_mask, lead);
  if (p.dropout_mask.present()) h.dmask = core::lead_offset(p, p.dropout_mask, lead);
  return h;
}

// Row i's logits: scale q_i · k_j, then causality and the mask (hidden keys -inf).
void row_logits(const Problem& p, const HeadOffsets& h, int64_t i, std::vector<double>& s) {
  s.assign(p.S, 0.0);
  for (int64_t j = 0; j < p.S; ++j) {
    double dot = 0.0;
    for (int64_t e = 0; e < p.E; ++e) dot += at(p.query, h.q, i, e) * at(p.key, h.k, j, e);
    double score = p.scale * dot;
    if (p.is_causal && j > i) score = kNegInf;  // top-left aligned (§3)
    if (p.attn_mask.present()) {
      double mv = at(p.attn_mask, h.mask, i, j);
      if (p.mask_is_bool)
        score = mv != 0.0 ? score : kNegInf;  // True = attend (§5)
      else
        score += mv;  // (§4)
    }
    s[j] = score;
  }
}

void compute_row(const Problem& p, int64_t lead, const HeadOffsets& h, int64_t i, Row& r) {
  const int64_t S = p.S;
  r.A.assign(S, 0.0);
  r.keep.assign(S, 1.0);
  r.P.assign(S, 0.0);
  r.W.assign(S, 0.0);
  std::vector<double> s;
  row_logits(p, h, i, s);
  double m = kNegInf;
  bool has_nan = false;
  for (int64_t j = 0; j < S; ++j) {
    if (s[j] > m) m = s[j];
    if (std::isnan(s[j])) has_nan = true;
  }
  if (has_nan) {  // a NaN logit makes the whole row NaN, lse too, as the math op's softmax does
    r.A.assign(S, std::numeric_limits<double>::quiet_NaN());
    r.lse = std::numeric_limits<double>::quiet_NaN();
  } else if (m == kNegInf) {  // fully masked (or S = 0): P = O = 0 (§6)
    r.lse = kNegInf;
  } else {
    double sum = 0.0;
    for (int64_t j = 0; j < S; ++j) sum += std::exp(s[j] - m);
    for (int64_t j = 0; j < S; ++j) r.A[j] = std::exp(s[j] - m) / sum;
    r.lse = m + std::log(sum);
  }
  const double c = p.keep_scale();
  const uint32_t threshold = dropout_threshold(p.dropout_p);
  for (int64_t j = 0; j < S; ++j) {
    switch (p.dropout) {
      case DropoutMode::None:
        r.P[j] = r.W[j] = r.A[j];
        break;
      case DropoutMode::ExplicitMask:
        r.keep[j] = at(p.dropout_mask, h.dmask, i, j) != 0.0 ? 1.0 : 0.0;
        r.P[j] = r.A[j] * r.keep[j];
        r.W[j] = c * r.P[j];
        break;
      case DropoutMode::Random: {
        uint64_t n = static_cast<uint64_t>((lead * p.L + i) * S + j);
        r.keep[j] = dropout_keep(p.seed, p.offset, n, threshold) ? 1.0 : 0.0;
        r.P[j] = r.W[j] = r.keep[j] != 0.0 ? c * r.A[j] : 0.0;
        break;
      }
    }
  }
}

// The offset of row n (row-major over the first nd - 1 dims of `shape`, the rows' own dims) in a
// view v with those dims first.
int64_t row_offset(const Shape& shape, const TensorView& v, int64_t n) {
  int64_t off = 0;
  for (int d = shape.ndim - 2; d >= 0; --d) {
    off += (n % shape.dims[d]) * v.strides[d];
    n /= shape.dims[d];
  }
  return off;
}

}  // namespace

void forward(const Problem& p, const ForwardOutputs& out) {
  const Operand O = core::output_operand(p, out.output, true);
  const Operand P = core::output_operand(p, out.attn_probs, true);
  const Operand lse = core::output_operand(p, out.logsumexp, false);
  Row r;
  for (int64_t lead = 0; lead < p.num_lead; ++lead) {
    const HeadOffsets h = head_offsets(p, lead);
    const int64_t o_base = core::lead_offset(p, O, lead), p_base = core::lead_offset(p, P, lead),
                  l_base = core::lead_offset(p, lse, lead);
    for (int64_t i = 0; i < p.L; ++i) {
      compute_row(p, lead, h, i, r);
      for (int64_t j = 0; j < p.S; ++j)
        core::store_from_double(P.dtype, out.attn_probs.data, p_base + i * P.row_stride + j * P.col_stride, r.P[j]);
      for (int64_t e = 0; e < p.Ev; ++e) {
        double acc = 0.0;
        for (int64_t j = 0; j < p.S; ++j) acc += r.W[j] * at(p.value, h.v, j, e);
        core::store_from_double(O.dtype, out.output.data, o_base + i * O.row_stride + e * O.col_stride, acc);
      }
      core::store_from_double(lse.dtype, out.logsumexp.data, l_base + i * lse.row_stride, r.lse);
    }
  }
}

// The statistics straight from their definitions (attention.h, StatsOutputs) on each row's P.
void forward_stats(const Problem& p, const StatsOutputs& out) {
  const Operand O = core::output_operand(p, out.output, true);
  const Operand lse = core::output_operand(p, out.logsumexp, false);
  const Operand cs = out.col_sum ? core::output_operand(p, *out.col_sum, false) : Operand{};
  const Operand ent = out.row_entropy ? core::output_operand(p, *out.row_entropy, false) : Operand{};
  const Operand win = out.rows ? core::output_operand(p, *out.rows, true) : Operand{};
  const int64_t win_rows = out.rows ? out.rows->shape.dims[out.rows->shape.ndim - 2] : 0;
  Row r;
  std::vector<double> cols(p.S);
  for (int64_t lead = 0; lead < p.num_lead; ++lead) {
    const HeadOffsets h = head_offsets(p, lead);
    const int64_t o_base = core::lead_offset(p, O, lead), l_base = core::lead_offset(p, lse, lead);
    std::fill(cols.begin(), cols.end(), 0.0);
    for (int64_t i = 0; i < p.L; ++i) {
      compute_row(p, lead, h, i, r);  // no dropout here: P = W = A
      for (int64_t e = 0; e < p.Ev; ++e) {
        double acc = 0.0;
        for (int64_t j = 0; j < p.S; ++j) acc += r.W[j] * at(p.value, h.v, j, e);
        core::store_from_double(O.dtype, out.output.data, o_base + i * O.row_stride + e * O.col_stride, acc);
      }
      core::store_from_double(lse.dtype, out.logsumexp.data, l_base + i * lse.row_stride, r.lse);
      double entropy = 0.0;
      for (int64_t j = 0; j < p.S; ++j) {
        cols[j] += r.P[j];
        if (r.P[j] > 0.0) entropy -= r.P[j] * std::log(r.P[j]);
      }
      if (std::isnan(r.lse)) entropy = r.lse;  // a NaN row (its P is NaN throughout)
      if (out.row_entropy)
        core::store_from_double(ent.dtype, out.row_entropy->data, core::lead_offset(p, ent, lead) + i * ent.row_stride,
                                entropy);
      const int64_t k = i - out.rows_first;
      if (out.rows && k >= 0 && k % out.rows_step == 0 && k / out.rows_step < win_rows)
        for (int64_t j = 0; j < p.S; ++j)
          core::store_from_double(win.dtype, out.rows->data,
                                  core::lead_offset(p, win, lead) + (k / out.rows_step) * win.row_stride + j * win.col_stride,
                                  r.P[j]);
    }
    if (out.col_sum)
      for (int64_t j = 0; j < p.S; ++j)
        core::store_from_double(cs.dtype, out.col_sum->data, core::lead_offset(p, cs, lead) + j * cs.row_stride, cols[j]);
  }
}

void backward(const Problem& p, const BackwardArgs& args, const BackwardOutputs& out) {
  const bool has_dO = args.grad_output.has_value(), has_dP = args.grad_probs.has_value();
  const Operand dO = has_dO ? core::output_operand(p, *args.grad_output, true) : Operand{};
  const Operand dP = has_dP ? core::output_operand(p, *args.grad_probs, true) : Operand{};
  std::vector<double> gq(p.query.own_shape.numel()), gk(p.key.own_shape.numel()), gv(p.value.own_shape.numel());
  std::vector<double> gm(out.grad_attn_mask ? p.attn_mask.own_shape.numel() : 0);
  const double c = p.keep_scale();
  Row r;
  std::vector<double> dA(p.S), dS(p.S);
  for (int64_t lead = 0; lead < p.num_lead; ++lead) {
    const HeadOffsets h = head_offsets(p, lead);
    const int64_t dq0 = core::dense_lead_offset(p, p.query, lead), dk0 = core::dense_lead_offset(p, p.key, lead),
                  dv0 = core::dense_lead_offset(p, p.value, lead);
    const int64_t dm0 = gm.empty() ? 0 : core::dense_lead_offset(p, p.attn_mask, lead);
    const int64_t dO0 = has_dO ? core::lead_offset(p, dO, lead) : 0, dP0 = has_dP ? core::lead_offset(p, dP, lead) : 0;
    for (int64_t i = 0; i < p.L; ++i) {
      compute_row(p, lead, h, i, r);
      // dA per the table of contract §11, with G = dO V^T.
      double delta = 0.0;
      for (int64_t j = 0; j < p.S; ++j) {
        double G = 0.0;
        if (has_dO)
          for (int64_t e = 0; e < p.Ev; ++e) G += at(dO, dO0, i, e) * at(p.value, h.v, j, e);
        double gP = has_dP ? at(dP, dP0, i, j) : 0.0;
        switch (p.dropout) {
          case DropoutMode::None: dA[j] = G + gP; break;
          case DropoutMode::ExplicitMask: dA[j] = r.keep[j] * (c * G + gP); break;
          case DropoutMode::Random: dA[j] = c * r.keep[j] * (G + gP); break;
        }
        delta += r.A[j] * dA[j];
      }
      for (int64_t j = 0; j < p.S; ++j) dS[j] = r.A[j] * (dA[j] - delta);
      for (int64_t j = 0; j < p.S; ++j) {
        if (!gm.empty()) gm[dm0 + i * p.attn_mask.dense_row_stride + j * p.attn_mask.dense_col_stride] += dS[j];
        for (int64_t e = 0; e < p.E; ++e) {
          gq[dq0 + i * p.query.dense_row_stride + e] += p.scale * dS[j] * at(p.key, h.k, j, e);
          gk[dk0 + j * p.key.dense_row_stride + e] += p.scale * dS[j] * at(p.query, h.q, i, e);
        }
        if (has_dO)
          for (int64_t e = 0; e < p.Ev; ++e)
            gv[dv0 + j * p.value.dense_row_stride + e] += r.W[j] * at(dO, dO0, i, e);
      }
    }
  }
  if (out.grad_query) core::write_dense(gq.data(), *out.grad_query);
  if (out.grad_key) core::write_dense(gk.data(), *out.grad_key);
  if (out.grad_value) core::write_dense(gv.data(), *out.grad_value);
  if (out.grad_attn_mask) core::write_dense(gm.data(), *out.grad_attn_mask);
}

// kl_to's gradient to q and k from its definition (attention.h, KlBackwardArgs): P recomputed in
// float64 from q and k, dS = g (R P − r) with R as given.
void kl_backward(const Problem& p, const KlBackwardArgs& args, const BackwardOutputs& out) {
  const Operand ref = core::output_operand(p, args.reference, true);
  const Operand R = core::output_operand(p, args.ref_row_sum, false), g = core::output_operand(p, args.grad_kl, false);
  std::vector<double> gq(p.query.own_shape.numel()), gk(p.key.own_shape.numel());
  Row r;
  for (int64_t lead = 0; lead < p.num_lead; ++lead) {
    const HeadOffsets h = head_offsets(p, lead);
    const int64_t dq0 = core::dense_lead_offset(p, p.query, lead), dk0 = core::dense_lead_offset(p, p.key, lead);
    const int64_t r0 = core::lead_offset(p, ref, lead), R0 = core::lead_offset(p, R, lead), g0 = core::lead_offset(p, g, lead);
    for (int64_t i = 0; i < p.L; ++i) {
      compute_row(p, lead, h, i, r);
      const double gi = at(g, g0, i, 0), Ri = at(R, R0, i, 0);
      for (int64_t j = 0; j < p.S; ++j) {
        const double ds = gi * (Ri * r.P[j] - at(ref, r0, i, j));
        for (int64_t e = 0; e < p.E; ++e) {
          gq[dq0 + i * p.query.dense_row_stride + e] += p.scale * ds * at(p.key, h.k, j, e);
          gk[dk0 + j * p.key.dense_row_stride + e] += p.scale * ds * at(p.query, h.q, i, e);
        }
      }
    }
  }
  if (out.grad_query) core::write_dense(gq.data(), *out.grad_query);
  if (out.grad_key) core::write_dense(gk.data(), *out.grad_key);
}

// kl_to's forward rows from their definition (attention.h, KlForwardArgs) with the logits x in
// float64: KL_i = Σ_j r log r − Σ_j r_ij x_ij + R_i lse_i over the keys the row sees, 0 for R_i = 0,
// +inf where r has mass on a hidden key (x = -inf).
void kl_forward(const Problem& p, const KlForwardArgs& args, const TensorView& kl, const TensorView& row_sum) {
  const Operand ref = core::output_operand(p, args.reference, true), lse = core::output_operand(p, args.logsumexp, false);
  const Operand K = core::output_operand(p, kl, false), R = core::output_operand(p, row_sum, false);
  std::vector<double> x;
  for (int64_t lead = 0; lead < p.num_lead; ++lead) {
    const HeadOffsets h = head_offsets(p, lead);
    const int64_t r0 = core::lead_offset(p, ref, lead), l0 = core::lead_offset(p, lse, lead),
                  k0 = core::lead_offset(p, K, lead), R0 = core::lead_offset(p, R, lead);
    for (int64_t i = 0; i < p.L; ++i) {
      row_logits(p, h, i, x);
      double sum = 0.0, xlogx = 0.0, rx = 0.0, hidden = 0.0;
      for (int64_t j = 0; j < p.S; ++j) {
        const double v = at(ref, r0, i, j);
        sum += v;
        if (v != 0.0) xlogx += v * std::log(v);  // 0 log 0 = 0; a negative entry gives NaN
        if (x[j] == kNegInf) hidden += v;
        else rx += v * x[j];
      }
      const double value = core::kl_of_row(xlogx, rx, sum, at(lse, l0, i, 0), hidden);
      core::store_from_double(K.dtype, kl.data, k0 + i * K.row_stride, value);
      core::store_from_double(R.dtype, row_sum.data, R0 + i * R.row_stride, sum);
    }
  }
}

void kl_rows(const KlRowsArgs& a, const TensorView& kl, const TensorView& row_sum) {
  const TensorView& ref = a.reference;
  const int nd = ref.ndim();
  const int64_t L = ref.shape.dims[nd - 2], S = ref.shape.dims[nd - 1], E = a.query.shape.dims[nd - 1];
  const int64_t rows = row_sum.numel();
  auto row_offset = [&](const TensorView& v, int64_t n) { return reference::row_offset(ref.shape, v, n); };
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t i = n % std::max<int64_t>(L, 1), base = row_offset(ref, n);
    double sum = 0.0, xlogx = 0.0, hidden = 0.0;
    for (int64_t j = 0; j < S; ++j) {
      const double x = core::load_as_double(ref.dtype, ref.data, base + j * ref.strides[nd - 1]);
      sum += x;
      if (x != 0.0) xlogx += x * std::log(x);  // 0 log 0 = 0; a negative entry gives NaN
      if (a.is_causal && j > i) hidden += x;
    }
    double qu = 0.0;  // q_i · (r K)_i
    const int64_t q0 = row_offset(a.query, n), u0 = row_offset(a.ref_keys, n);
    for (int64_t e = 0; e < E; ++e)
      qu += core::load_as_double(a.query.dtype, a.query.data, q0 + e * a.query.strides[nd - 1]) *
            core::load_as_double(a.ref_keys.dtype, a.ref_keys.data, u0 + e * a.ref_keys.strides[nd - 1]);
    const double lse = core::load_as_double(a.logsumexp.dtype, a.logsumexp.data, row_offset(a.logsumexp, n));
    const double value = core::kl_of_row(xlogx, a.scale * qu, sum, lse, hidden);  // no mass: 0, even for a NaN q
    core::store_from_double(kl.dtype, kl.data, row_offset(kl, n), value);
    core::store_from_double(row_sum.dtype, row_sum.data, row_offset(row_sum, n), sum);
  }
}

void softmax_rows(const SoftmaxRowsArgs& a, const TensorView& out) {
  const TensorView& x = a.logits;
  const int nd = x.ndim();
  const int64_t w = x.shape.dims[nd - 2], S = x.shape.dims[nd - 1], rows = w > 0 ? x.numel() / std::max<int64_t>(S, 1) : 0;
  if (S == 0) return;
  auto row_offset = [&](const TensorView& v, int64_t n) { return reference::row_offset(x.shape, v, n); };
  std::vector<double> v(static_cast<size_t>(S));
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t i = a.first + (n % w) * a.step, x0 = row_offset(x, n), o0 = row_offset(out, n);
    double m = kNegInf;
    for (int64_t j = 0; j < S; ++j) {
      v[j] = a.is_causal && j > i ? kNegInf : core::load_as_double(x.dtype, x.data, x0 + j * x.strides[nd - 1]);
      m = std::isnan(v[j]) || std::isnan(m) ? NAN : std::max(m, v[j]);  // NaN propagates, as torch's max does
    }
    double sum = 0.0;
    for (int64_t j = 0; j < S; ++j) sum += std::exp(v[j] - m);  // all -inf or an inf: NaN, as torch.softmax
    for (int64_t j = 0; j < S; ++j)
      core::store_from_double(out.dtype, out.data, o0 + j * out.strides[nd - 1], std::exp(v[j] - m) / sum);
  }
}

}  // namespace sdpa_math::reference

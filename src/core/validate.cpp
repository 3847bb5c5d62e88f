// Validation of an attention call: every error of docs/contract.md, raised here and
// nowhere else, before any backend touches an output. The wording follows PyTorch's where it has
// one, so users of the binding see familiar messages.
#include <cmath>
#include <sstream>

#include "problem.h"

namespace sdpa_math::core {
namespace {

template <class... Parts>
[[noreturn]] void fail(ErrorCode code, const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw Error(code, s.str());
}

bool is_supported_input(DType d) { return is_floating(d); }

void check_rank(const TensorView& v, const char* name) {
  if (v.ndim() > kMaxDims) fail(ErrorCode::TooManyDims, name, " has ", v.ndim(), " dims; sdpa_math supports at most ", kMaxDims);
  if (v.ndim() < 2)
    fail(ErrorCode::RankTooLow, name, " must have at least 2 dimensions (..., sequence, features), got shape ", v.shape.str());
}

void check_device(const TensorView& v, const char* name, const TensorView& query) {
  if (v.device != query.device)
    fail(ErrorCode::DeviceMismatch, "Expected ", name, " to be on the same device as query, but got query.device: ",
         device_name(query.device), " and ", name, ".device: ", device_name(v.device), " instead.");
}

// Size of dim `d` (counted from the right, d = 1 is the last) of a shape, 1 where it has none.
int64_t dim_from_right(const Shape& s, int d) { return d <= s.ndim ? s.dims[s.ndim - d] : 1; }

bool broadcastable_to(const Shape& from, const Shape& to) {
  if (from.ndim > to.ndim) return false;
  for (int d = 1; d <= from.ndim; ++d) {
    int64_t f = dim_from_right(from, d);
    if (f != 1 && f != dim_from_right(to, d)) return false;
  }
  return true;
}

Shape lead_of(const Shape& s) {
  Shape out;
  out.ndim = s.ndim - 2;
  for (int i = 0; i < out.ndim; ++i) out.dims[i] = s.dims[i];
  return out;
}

// Describes `v` as an operand of the full shape (lead..., rows, cols): memory and dense strides,
// 0 where `v` is broadcast. On `head_dim` (an index into the lead dims, or -1) with group > 1 the
// coordinate is divided by the group (GQA), so the head dim keeps its stride.
Operand map_operand(const TensorView& v, const Shape& full, int head_dim, int64_t head_group) {
  Operand op;
  op.data = static_cast<const char*>(v.data);
  op.dtype = v.dtype;
  op.own_shape = v.shape;
  op.head_group = head_group;
  int64_t dense[kMaxDims];
  int64_t running = 1;
  for (int i = v.ndim() - 1; i >= 0; --i) {
    dense[i] = running;
    running *= v.shape.dims[i];
  }
  const int shift = full.ndim - v.ndim();
  auto strides_for = [&](int full_dim, int64_t& mem, int64_t& den) {
    int own = full_dim - shift;
    bool grouped = full_dim == head_dim && head_group > 1;
    if (own < 0 || (v.shape.dims[own] == 1 && !grouped)) {
      mem = 0;
      den = 0;
    } else {
      mem = v.strides[own];
      den = dense[own];
    }
  };
  const int lead_ndim = full.ndim - 2;
  for (int d = 0; d < lead_ndim; ++d) strides_for(d, op.lead_strides[d], op.dense_lead_strides[d]);
  strides_for(full.ndim - 2, op.row_stride, op.dense_row_stride);
  strides_for(full.ndim - 1, op.col_stride, op.dense_col_stride);
  return op;
}

Shape with_last_two(const Shape& lead, int64_t rows, int64_t cols) {
  Shape s = lead;
  s.dims[s.ndim++] = rows;
  s.dims[s.ndim++] = cols;
  return s;
}

}  // namespace

namespace {
// Unravels a lead index over the output's lead dims and applies one set of strides; on the head
// dim (the last lead dim) the coordinate is divided by the operand's GQA group.
int64_t unravel(const Problem& p, const int64_t* strides, int64_t group, int64_t lead) {
  int64_t off = 0;
  for (int d = p.lead_ndim - 1; d >= 0; --d) {
    int64_t c = lead % p.lead_shape[d];
    lead /= p.lead_shape[d];
    if (d == p.lead_ndim - 1) c /= group;
    off += c * strides[d];
  }
  return off;
}
}  // namespace

int64_t lead_offset(const Problem& p, const Operand& op, int64_t lead) {
  return unravel(p, op.lead_strides, op.head_group, lead);
}

int64_t dense_lead_offset(const Problem& p, const Operand& op, int64_t lead) {
  return unravel(p, op.dense_lead_strides, op.head_group, lead);
}

Operand output_operand(const Problem& p, const TensorView& v, bool has_cols) {
  Operand op;
  op.data = static_cast<const char*>(v.data);
  op.dtype = v.dtype;
  op.own_shape = v.shape;
  for (int d = 0; d < p.lead_ndim; ++d) op.lead_strides[d] = v.strides[d];
  op.row_stride = v.strides[p.lead_ndim];
  op.col_stride = has_cols ? v.strides[p.lead_ndim + 1] : 0;
  return op;
}

Problem make_problem(const ForwardArgs& a) {
  const TensorView &q = a.query, &k = a.key, &v = a.value;
  const AttentionOptions& o = a.options;

  // dtypes: supported, then equal
  const char* names[3] = {"query", "key", "value"};
  const TensorView* qkv[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i)
    if (!is_supported_input(qkv[i]->dtype))
      fail(ErrorCode::UnsupportedDtype, names[i], " has dtype ", dtype_name(qkv[i]->dtype),
           "; sdpa_math supports float16, bfloat16, float32 and float64");
  if (k.dtype != q.dtype || v.dtype != q.dtype)
    fail(ErrorCode::DtypeMismatch, "Expected query, key, and value to have the same dtype, but got query.dtype: ",
         dtype_name(q.dtype), " key.dtype: ", dtype_name(k.dtype), " and value.dtype: ", dtype_name(v.dtype), " instead.");
  check_device(k, "key", q);
  check_device(v, "value", q);
  for (int i = 0; i < 3; ++i) check_rank(*qkv[i], names[i]);

  const int64_t L = q.size(-2), E = q.size(-1), S = k.size(-2), Ev = v.size(-1);
  if (k.size(-1) != E)
    fail(ErrorCode::HeadDimMismatch, "key's last dimension (", k.size(-1), ") must equal query's last dimension (", E,
         "): query ", q.shape.str(), ", key ", k.shape.str());
  if (v.size(-2) != S)
    fail(ErrorCode::SequenceMismatch, "key and value must have the same sequence length, but key has ", S,
         " and value has ", v.size(-2), ": key ", k.shape.str(), ", value ", v.shape.str());

  // Lead dims. GQA (contract §10): with enable_gqa and differing head counts, key/value head
  // h // (Hq/Hkv) serves query head h; the head dim then takes the query's size.
  Shape ql = lead_of(q.shape), kl = lead_of(k.shape), vl = lead_of(v.shape);
  int64_t k_group = 1, v_group = 1;
  const bool heads_known = q.ndim() >= 3 && k.ndim() >= 3 && v.ndim() >= 3;
  if (o.enable_gqa && heads_known) {
    const int64_t hq = q.size(-3), hk = k.size(-3), hv = v.size(-3);
    if (!(hq == hk && hk == hv)) {
      if (hk == 0 || hv == 0 || hq % hk != 0 || hq % hv != 0)
        fail(ErrorCode::GqaHeadsNotDivisible,
             "Number of heads in key and value must divide the number of heads in query (query has ", hq,
             ", key ", hk, ", value ", hv, ")");
      k_group = hq / hk;
      v_group = hq / hv;
      kl.dims[kl.ndim - 1] = hq;
      vl.dims[vl.ndim - 1] = hq;
    }
  }
  Problem p;
  p.lead_ndim = std::max(ql.ndim, std::max(kl.ndim, vl.ndim));
  for (int d = 1; d <= p.lead_ndim; ++d) {
    int64_t sizes[3] = {dim_from_right(ql, d), dim_from_right(kl, d), dim_from_right(vl, d)};
    int64_t out = 1;
    for (int64_t s : sizes) {
      if (s == 1) continue;
      if (out != 1 && s != out) {
        if (d == 1 && heads_known)
          fail(ErrorCode::HeadsMismatch, "query has ", q.size(-3), " heads but key has ", k.size(-3), " and value ",
               v.size(-3), "; heads must match (a single key/value head broadcasts), or pass enable_gqa=True for "
               "grouped-query attention");
        fail(ErrorCode::BatchNotBroadcastable, "batch dimensions of query ", q.shape.str(), ", key ", k.shape.str(),
             " and value ", v.shape.str(), " do not broadcast (dim ", -(d + 2), ": ", sizes[0], ", ", sizes[1], ", ",
             sizes[2], ")");
      }
      out = s;
    }
    p.lead_shape[p.lead_ndim - d] = out;
  }
  p.num_lead = 1;
  Shape lead;
  lead.ndim = p.lead_ndim;
  for (int d = 0; d < p.lead_ndim; ++d) {
    lead.dims[d] = p.lead_shape[d];
    p.num_lead *= p.lead_shape[d];
  }
  p.L = L;
  p.S = S;
  p.E = E;
  p.Ev = Ev;
  p.dtype = q.dtype;
  p.device = q.device;
  const Shape probs_shape = with_last_two(lead, L, S);
  if (probs_shape.ndim > kMaxDims)
    fail(ErrorCode::TooManyDims, "the output would have ", probs_shape.ndim, " dims; sdpa_math supports at most ", kMaxDims);
  p.shapes.output = with_last_two(lead, L, Ev);
  p.shapes.attn_probs = probs_shape;
  p.shapes.logsumexp = lead;
  p.shapes.logsumexp.dims[p.shapes.logsumexp.ndim++] = L;

  const int head_dim = p.lead_ndim - 1;
  p.query = map_operand(q, with_last_two(lead, L, E), head_dim, 1);
  p.key = map_operand(k, with_last_two(lead, S, E), head_dim, k_group);
  p.value = map_operand(v, with_last_two(lead, S, Ev), head_dim, v_group);

  // The float or bool mask (contract §3-§5).
  if (a.attn_mask) {
    const TensorView& m = *a.attn_mask;
    if (o.is_causal)
      fail(ErrorCode::CausalWithMask, "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True");
    if (!(m.dtype == DType::Bool || m.dtype == DType::Float32 || m.dtype == q.dtype))
      fail(ErrorCode::MaskDtype, "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: ",
           dtype_name(m.dtype), " and  query.dtype: ", dtype_name(q.dtype), " instead.");
    check_device(m, "attn_mask", q);
    if (m.ndim() > kMaxDims) fail(ErrorCode::TooManyDims, "attn_mask has ", m.ndim(), " dims");
    if (!broadcastable_to(m.shape, probs_shape))
      fail(ErrorCode::MaskNotBroadcastable, "attn_mask of shape ", m.shape.str(),
           " cannot be broadcast to the attention shape (*batch, Hq, L, S) = ", probs_shape.str());
    p.attn_mask = map_operand(m, probs_shape, -1, 1);
    p.mask_is_bool = m.dtype == DType::Bool;
  }
  p.is_causal = o.is_causal;

  // Dropout (contract §7-§9).
  if (!(o.dropout_p >= 0.0 && o.dropout_p <= 1.0))
    fail(ErrorCode::DropoutProbability, "dropout probability has to be between 0 and 1, but got ", o.dropout_p);
  p.dropout_p = o.dropout_p;
  if (o.dropout_p > 0.0) {
    if (a.dropout_mask) {
      const TensorView& dm = *a.dropout_mask;
      if (!(dm.dtype == DType::Bool || is_floating(dm.dtype)))
        fail(ErrorCode::DropoutMaskDtype, "dropout_mask must be bool or floating (0/1), got ", dtype_name(dm.dtype));
      check_device(dm, "dropout_mask", q);
      if (dm.ndim() > kMaxDims || !broadcastable_to(dm.shape, probs_shape))
        fail(ErrorCode::DropoutMaskShape, "dropout_mask of shape ", dm.shape.str(),
             " does not match the attention shape (*batch, Hq, L, S) = ", probs_shape.str());
      p.dropout_mask = map_operand(dm, probs_shape, -1, 1);
      p.dropout = DropoutMode::ExplicitMask;
    } else {
      p.dropout = DropoutMode::Random;
    }
  }
  p.seed = o.seed;
  p.offset = o.offset;
  p.rng_device = o.rng_device;
  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(E));
  // E = 0: every score is an empty sum, 0 whatever the scale (the math op multiplies empty
  // tensors by it), so P is uniform over the unmasked keys. The default 1/sqrt(0) = inf (or an
  // infinite or NaN scale given) would make 0 * scale a NaN in every backend: use 1.
  if (E == 0) p.scale = 1.0;
  return p;
}

namespace {

void check_view(const TensorView& v, const char* name, const Shape& expected, bool float_only_32_64, Device dev,
                ErrorCode code) {
  if (v.shape != expected)
    fail(code, name, " has shape ", v.shape.str(), ", expected ", expected.str());
  bool ok_dtype = float_only_32_64 ? (v.dtype == DType::Float32 || v.dtype == DType::Float64) : is_floating(v.dtype);
  if (!ok_dtype)
    fail(code, name, " has dtype ", dtype_name(v.dtype), ", expected ",
         float_only_32_64 ? "float32 or float64" : "a floating dtype");
  if (v.device != dev)
    fail(ErrorCode::DeviceMismatch, name, " is on ", device_name(v.device), " but the inputs are on ", device_name(dev));
  if (v.numel() > 0 && v.data == nullptr) fail(code, name, " has no data pointer");
}

}  // namespace

void check_forward_outputs(const Problem& p, const ForwardOutputs& out) {
  const Device dev = p.device;
  check_view(out.output, "output", p.shapes.output, false, dev, ErrorCode::BadOutput);
  check_view(out.attn_probs, "attn_probs", p.shapes.attn_probs, false, dev, ErrorCode::BadOutput);
  check_view(out.logsumexp, "logsumexp", p.shapes.logsumexp, true, dev, ErrorCode::BadOutput);
}

void check_stats_outputs(const Problem& p, const StatsOutputs& out) {
  if (p.dropout != DropoutMode::None)
    fail(ErrorCode::DropoutProbability, "attention statistics are those of the dropout-free map P; dropout_p must be 0, got ",
         p.dropout_p);
  const Device dev = p.device;
  check_view(out.output, "output", p.shapes.output, false, dev, ErrorCode::BadOutput);
  check_view(out.logsumexp, "logsumexp", p.shapes.logsumexp, true, dev, ErrorCode::BadOutput);
  if (out.col_sum) {
    Shape cols = p.shapes.logsumexp;  // (*lead, L) -> (*lead, S)
    cols.dims[cols.ndim - 1] = p.S;
    check_view(*out.col_sum, "col_sum", cols, true, dev, ErrorCode::BadOutput);
  }
  if (out.row_entropy) check_view(*out.row_entropy, "row_entropy", p.shapes.logsumexp, true, dev, ErrorCode::BadOutput);
  if (out.rows) {
    Shape window = p.shapes.attn_probs;  // (*lead, L, S) -> (*lead, n, S)
    const int64_t n = out.rows->shape.ndim >= 2 ? out.rows->shape.dims[out.rows->shape.ndim - 2] : -1;
    window.dims[window.ndim - 2] = n;
    if (out.rows_step < 1 || out.rows_first < 0 || (n > 0 && out.rows_first + (n - 1) * out.rows_step >= p.L))
      fail(ErrorCode::BadOutput, "rows: ", n, " query rows from row ", out.rows_first, " every ", out.rows_step,
           " do not lie within the ", p.L, " rows");
    check_view(*out.rows, "rows", window, false, dev, ErrorCode::BadOutput);
  }
}

void check_backward(const Problem& p, const BackwardArgs& a, const BackwardOutputs& out) {
  const Device dev = p.device;
  check_view(a.logsumexp, "logsumexp", p.shapes.logsumexp, true, dev, ErrorCode::BadGradient);
  if (a.grad_output) check_view(*a.grad_output, "grad_output", p.shapes.output, false, dev, ErrorCode::BadGradient);
  if (a.grad_probs) check_view(*a.grad_probs, "grad_probs", p.shapes.attn_probs, false, dev, ErrorCode::BadGradient);
  if (a.output) check_view(*a.output, "output", p.shapes.output, false, dev, ErrorCode::BadGradient);
  if (a.attn_probs) check_view(*a.attn_probs, "attn_probs", p.shapes.attn_probs, false, dev, ErrorCode::BadGradient);
  if (out.grad_query) check_view(*out.grad_query, "grad_query", a.forward.query.shape, false, dev, ErrorCode::BadOutput);
  if (out.grad_key) check_view(*out.grad_key, "grad_key", a.forward.key.shape, false, dev, ErrorCode::BadOutput);
  if (out.grad_value) check_view(*out.grad_value, "grad_value", a.forward.value.shape, false, dev, ErrorCode::BadOutput);
  if (out.grad_attn_mask) {
    // Given, not present(): an empty mask (L = 0 or S = 0) may have no data pointer and still
    // gets its (empty) gradient.
    if (!a.forward.attn_mask || p.mask_is_bool)
      fail(ErrorCode::BadOutput, "grad_attn_mask was requested but there is no float attn_mask to differentiate");
    check_view(*out.grad_attn_mask, "grad_attn_mask", a.forward.attn_mask->shape, false, dev, ErrorCode::BadOutput);
  }
}

// What kl_forward and kl_backward both take: the dropout-free problem, the student's lse and the
// reference map of P's shape.
void check_kl_inputs(const Problem& p, const char* op, const TensorView& logsumexp, const TensorView& reference) {
  if (p.dropout != DropoutMode::None)
    fail(ErrorCode::DropoutProbability, op, " compares the reference with the dropout-free map P; dropout_p must be 0, got ",
         p.dropout_p);
  check_view(logsumexp, "logsumexp", p.shapes.logsumexp, true, p.device, ErrorCode::BadGradient);
  check_view(reference, "reference", p.shapes.attn_probs, false, p.device, ErrorCode::BadGradient);
}

void check_kl_backward(const Problem& p, const KlBackwardArgs& a, const BackwardOutputs& out) {
  check_kl_inputs(p, "kl_backward", a.logsumexp, a.reference);
  const Device dev = p.device;
  check_view(a.ref_row_sum, "ref_row_sum", p.shapes.logsumexp, true, dev, ErrorCode::BadGradient);
  check_view(a.grad_kl, "grad_kl", p.shapes.logsumexp, true, dev, ErrorCode::BadGradient);
  if (out.grad_value || out.grad_attn_mask)
    fail(ErrorCode::BadOutput, "kl_backward writes grad_query and grad_key only (the KL does not reach V; no mask gradient)");
  if (out.grad_query) check_view(*out.grad_query, "grad_query", a.forward.query.shape, false, dev, ErrorCode::BadOutput);
  if (out.grad_key) check_view(*out.grad_key, "grad_key", a.forward.key.shape, false, dev, ErrorCode::BadOutput);
}

void check_kl_forward(const Problem& p, const KlForwardArgs& a, const TensorView* kl, const TensorView* row_sum) {
  check_kl_inputs(p, "kl_forward", a.logsumexp, a.reference);
  const Device dev = p.device;
  if (kl) check_view(*kl, "kl", p.shapes.logsumexp, true, dev, ErrorCode::BadOutput);
  if (row_sum) check_view(*row_sum, "row_sum", p.shapes.logsumexp, true, dev, ErrorCode::BadOutput);
  if (kl && row_sum && kl->dtype != row_sum->dtype)
    fail(ErrorCode::BadOutput, "kl and row_sum must have one dtype, got ", dtype_name(kl->dtype), " and ", dtype_name(row_sum->dtype));
}

void check_kl_rows(const KlRowsArgs& a, const TensorView& kl, const TensorView& row_sum) {
  const TensorView& r = a.reference;
  if (r.ndim() < 2) fail(ErrorCode::RankTooLow, "reference must have at least 2 dims (rows, keys), got ", r.shape.str());
  if (!is_floating(r.dtype)) fail(ErrorCode::UnsupportedDtype, "reference has dtype ", dtype_name(r.dtype), ", expected a floating dtype");
  const int nd = r.ndim();
  if (a.query.ndim() != nd)
    fail(ErrorCode::BadGradient, "query must have the reference's ", nd, " dims (*lead, L, E), got ", a.query.shape.str());
  Shape rows = r.shape;
  rows.ndim -= 1;
  Shape per_row = rows;
  per_row.ndim += 1;
  per_row.dims[nd - 1] = a.query.shape.dims[nd - 1];  // (*lead, L, E)
  // the row inputs come from the forward, as kl_backward's saved ones do (same error code)
  check_view(a.query, "query", per_row, false, r.device, ErrorCode::BadGradient);
  check_view(a.ref_keys, "ref_keys", per_row, true, r.device, ErrorCode::BadGradient);
  check_view(a.logsumexp, "logsumexp", rows, true, r.device, ErrorCode::BadGradient);
  check_view(kl, "kl", rows, true, r.device, ErrorCode::BadOutput);
  check_view(row_sum, "row_sum", rows, true, r.device, ErrorCode::BadOutput);
  if (kl.dtype != row_sum.dtype)
    fail(ErrorCode::BadOutput, "kl and row_sum must have one dtype, got ", dtype_name(kl.dtype), " and ", dtype_name(row_sum.dtype));
}

void check_softmax_rows(const SoftmaxRowsArgs& a, const TensorView& out) {
  const TensorView& x = a.logits;
  if (x.ndim() < 2) fail(ErrorCode::RankTooLow, "logits must have at least 2 dims (rows, keys), got ", x.shape.str());
  if (x.dtype != DType::Float32) fail(ErrorCode::UnsupportedDtype, "logits have dtype ", dtype_name(x.dtype), ", expected float32");
  if (a.is_causal && (a.first < 0 || a.step < 1))
    fail(ErrorCode::BadWindow, "a causal window needs first >= 0 and step >= 1, got first ", a.first, " and step ", a.step);
  check_view(out, "out", x.shape, false, x.device, ErrorCode::BadOutput);
  if (out.dtype != DType::Float16 && out.dtype != DType::BFloat16 && out.dtype != DType::Float32)
    fail(ErrorCode::BadOutput, "out has dtype ", dtype_name(out.dtype), ", expected float16, bfloat16 or float32");
}

}  // namespace sdpa_math::core

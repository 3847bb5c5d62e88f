// Backward: the float64 reference against central finite differences of its own forward, and the
// CPU backward against the reference, each with and without dP, with masks, GQA and both dropout
// rules.
#include <gtest/gtest.h>

#include <cmath>

#include "test_cases.h"

namespace sdpa_math::testing {
namespace {

struct Grads {
  Tensor dq, dk, dv, dmask;
};

// Runs backward with the forward's lse (and, with `saved`, its O and P, which the CPU backward
// reads A from when there is no dropout); a float mask gets its gradient.
Grads run_backward(Backend backend, const Built& b, const TensorView* dO, const TensorView* dP, DType grad_dtype,
                   bool saved = false) {
  const ForwardShapes s = forward_shapes(b.args);
  Tensor o = empty_tensor(grad_dtype, s.output), p = empty_tensor(grad_dtype, s.attn_probs),
         lse = empty_tensor(DType::Float32, s.logsumexp);
  forward(backend, b.args, {o.view, p.view, lse.view});
  BackwardArgs args;
  args.forward = b.args;
  args.logsumexp = lse.view;
  if (saved) {
    args.output = o.view;
    args.attn_probs = p.view;
  }
  if (dO) args.grad_output = *dO;
  if (dP) args.grad_probs = *dP;
  Grads g{empty_tensor(grad_dtype, b.q.view.shape), empty_tensor(grad_dtype, b.k.view.shape),
          empty_tensor(grad_dtype, b.v.view.shape), Tensor{}};
  BackwardOutputs out{g.dq.view, g.dk.view, g.dv.view, std::nullopt};
  if (b.args.attn_mask && b.args.attn_mask->dtype != DType::Bool) {
    g.dmask = empty_tensor(grad_dtype, b.args.attn_mask->shape);
    out.grad_attn_mask = g.dmask.view;
  }
  backward(backend, args, out);
  return g;
}

// loss = sum(O * gO) + sum(P * gP), in float64 through the reference.
double loss(const ForwardArgs& args, const std::vector<double>* gO, const std::vector<double>* gP) {
  const ForwardShapes s = forward_shapes(args);
  Tensor o = empty_tensor(DType::Float64, s.output), p = empty_tensor(DType::Float64, s.attn_probs),
         lse = empty_tensor(DType::Float64, s.logsumexp);
  forward(Backend::Reference, args, {o.view, p.view, lse.view});
  double total = 0;
  if (gO) {
    std::vector<double> O = read(o.view);
    for (size_t n = 0; n < O.size(); ++n) total += O[n] * (*gO)[n];
  }
  if (gP) {
    std::vector<double> P = read(p.view);
    for (size_t n = 0; n < P.size(); ++n) total += P[n] * (*gP)[n];
  }
  return total;
}

struct FdCase {
  const char* name;
  Case c;
  bool with_dO, with_dP;
};

std::vector<FdCase> fd_cases() {
  Case base;
  base.dtype = DType::Float64;
  base.batch = {1};
  base.hq = base.hkv = 2;
  base.L = 4;
  base.S = 5;
  base.E = 3;
  base.Ev = 2;
  std::vector<FdCase> v;
  v.push_back({"plain_dO_dP", base, true, true});
  v.push_back({"plain_dO_only", base, true, false});
  v.push_back({"plain_dP_only", base, false, true});
  Case c = base;
  c.mask = MaskKind::FloatFull;
  v.push_back({"float_mask_full", c, true, true});
  c.mask = MaskKind::FloatKeyPadding;  // gradient summed over the broadcast rows and heads
  v.push_back({"float_mask_broadcast", c, true, true});
  c = base;
  c.mask = MaskKind::BoolFullyMaskedRows;
  v.push_back({"bool_mask_fully_masked_rows", c, true, true});
  c = base;
  c.causal = true;
  v.push_back({"causal", c, true, true});
  c = base;
  c.hq = 4;
  c.hkv = 2;
  c.gqa = true;
  v.push_back({"gqa", c, true, true});
  c = base;
  c.dropout = DropoutKind::ExplicitBool;
  c.dropout_p = 0.3;
  c.mask = MaskKind::Float2D;
  v.push_back({"explicit_dropout", c, true, true});
  v.push_back({"explicit_dropout_no_dP", c, true, false});
  c = base;
  c.dropout = DropoutKind::Random;
  c.dropout_p = 0.4;
  v.push_back({"random_dropout", c, true, true});
  v.push_back({"random_dropout_dP_only", c, false, true});
  c = base;
  c.batch = {};
  c.hq = c.hkv = 0;
  v.push_back({"two_dim_inputs", c, true, true});
  c = base;
  c.batch = {1};
  c.kv_batch = {2};
  v.push_back({"batch_broadcast", c, true, true});
  return v;
}

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class ReferenceBackward : public ::testing::TestWithParam<FdCase> {};

TEST_P(ReferenceBackward, MatchesFiniteDifferences) {
  const FdCase& fc = GetParam();
  Built b = build(fc.c);
  const ForwardShapes s = forward_shapes(b.args);
  std::mt19937_64 rng(99);
  Tensor gO = random_tensor(rng, DType::Float64, s.output), gP = random_tensor(rng, DType::Float64, s.attn_probs);
  const std::vector<double> gOv = read(gO.view), gPv = read(gP.view);
  const std::vector<double>* pO = fc.with_dO ? &gOv : nullptr;
  const std::vector<double>* pP = fc.with_dP ? &gPv : nullptr;
  Grads g = run_backward(Backend::Reference, b, fc.with_dO ? &gO.view : nullptr, fc.with_dP ? &gP.view : nullptr,
                         DType::Float64);
  struct Wrt {
    const char* name;
    TensorView input;
    const Tensor* grad;
  };
  std::vector<Wrt> wrt = {{"query", b.q.view, &g.dq}, {"key", b.k.view, &g.dk}, {"value", b.v.view, &g.dv}};
  if (g.dmask.view.data) wrt.push_back({"attn_mask", b.mask.view, &g.dmask});
  for (const Wrt& w : wrt)
    expect_matches_finite_differences(w.input, read(w.grad->view), [&] { return loss(b.args, pO, pP); }, w.name);
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceBackward, ::testing::ValuesIn(fd_cases()),
                         [](const ::testing::TestParamInfo<FdCase>& info) { return std::string(info.param.name); });

struct CpuBackwardCase {
  Case c;
  bool with_dO, with_dP;
  std::string name() const {
    return c.name() + (with_dO ? "_dO" : "") + (with_dP ? "_dP" : "");
  }
};

std::vector<CpuBackwardCase> cpu_backward_cases() {
  std::vector<CpuBackwardCase> v;
  int n = 0;
  for (const Case& c : backward_cases()) {
    v.push_back({c, true, true});
    // Alternate the partial forms: dO alone, dP alone.
    v.push_back({c, n % 2 == 0, n % 2 == 1});
    ++n;
  }
  return v;
}

void PrintTo(const CpuBackwardCase& c, std::ostream* os) { *os << c.name(); }

class CpuBackward : public ::testing::TestWithParam<CpuBackwardCase> {};

// Gradients are sums of many products; compare by relative Frobenius error and an elementwise
// bound relative to the largest gradient entry. fp32 accumulation gives ~1e-6; the fp16/bf16
// inputs are identical on both sides, so the rest is one rounding of the output (u) plus the
// fp32 recomputation: bounds 2e-5 (fp32), 2u elementwise of the max entry.
TEST_P(CpuBackward, MatchesReference) {
  const CpuBackwardCase& bc = GetParam();
  Built b = build(bc.c);
  const ForwardShapes s = forward_shapes(b.args);
  std::mt19937_64 rng(bc.c.seed);
  Tensor gO = random_tensor(rng, bc.c.dtype, s.output), gP = random_tensor(rng, bc.c.dtype, s.attn_probs);
  const TensorView* dO = bc.with_dO ? &gO.view : nullptr;
  const TensorView* dP = bc.with_dP ? &gP.view : nullptr;
  Grads ref = run_backward(Backend::Reference, b, dO, dP, DType::Float64);
  const double u = bc.c.dtype == DType::Float32 ? 1e-5 : unit_roundoff(bc.c.dtype);
  for (bool saved : {false, true}) {
    Grads cpu = run_backward(Backend::Cpu, b, dO, dP, bc.c.dtype, saved);
    const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> pairs[] = {
        {"dq", {&cpu.dq, &ref.dq}}, {"dk", {&cpu.dk, &ref.dk}}, {"dv", {&cpu.dv, &ref.dv}}, {"dmask", {&cpu.dmask, &ref.dmask}}};
    for (const auto& [name, t] : pairs) {
      if (!t.second->view.data) continue;
      std::vector<double> x = read(t.first->view), r = read(t.second->view);
      Errors e = compare(x, r, u, 2 * u * std::max(max_abs(r), 1e-30));
      EXPECT_EQ(e.bad, 0) << name << (saved ? " (saved P)" : "") << ": " << describe(e);
      EXPECT_LE(e.rel_frobenius, 2 * u) << name << (saved ? " (saved P)" : "") << ": " << describe(e);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuBackward, ::testing::ValuesIn(cpu_backward_cases()),
                         [](const ::testing::TestParamInfo<CpuBackwardCase>& info) { return info.param.name(); });

}  // namespace
}  // namespace sdpa_math::testing

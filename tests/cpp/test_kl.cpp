// kl_to's core ops on the float64 reference (attention.h): kl_backward against central finite
// differences of the KL computed from the reference forward's P, kl_reference_rows against its
// definition on a strided view, and the validation of both.
#include <gtest/gtest.h>

#include <cmath>

#include "test_cases.h"

namespace sdpa_math::testing {
namespace {

// A reference map of P's shape: positive random rows normalised to sum 1, with the keys the
// top-left causal mask hides set to 0 (else the KL is +inf) and every fifth entry 0.
Tensor reference_map(std::mt19937_64& rng, const Shape& probs, bool causal) {
  Tensor r = empty_tensor(DType::Float64, probs);
  const int64_t S = probs.dims[probs.ndim - 1], L = probs.dims[probs.ndim - 2];
  std::vector<double> v(probs.numel());
  std::uniform_real_distribution<double> u(0.05, 1.0);
  for (int64_t row = 0; row * S < static_cast<int64_t>(v.size()); ++row) {
    double sum = 0;
    for (int64_t j = 0; j < S; ++j) {
      const int64_t n = row * S + j;
      const bool hidden = causal && j > row % L;
      v[n] = hidden || n % 5 == 4 ? 0.0 : u(rng);
      sum += v[n];
    }
    for (int64_t j = 0; j < S; ++j) v[row * S + j] /= sum > 0 ? sum : 1.0;
  }
  write(r.view, v);
  return r;
}

Shape rows_of(const Shape& probs) {
  Shape s = probs;
  s.ndim -= 1;
  return s;
}

// Σ_i g_i Σ_j r_ij log(r_ij / P_ij) with P from the reference forward (terms with r = 0 are 0).
double kl_loss(const ForwardArgs& args, const std::vector<double>& r, const std::vector<double>& g) {
  const ForwardShapes s = forward_shapes(args);
  Tensor o = empty_tensor(DType::Float64, s.output), p = empty_tensor(DType::Float64, s.attn_probs),
         lse = empty_tensor(DType::Float64, s.logsumexp);
  forward(Backend::Reference, args, {o.view, p.view, lse.view});
  const std::vector<double> P = read(p.view);
  const int64_t S = s.attn_probs.dims[s.attn_probs.ndim - 1];
  double total = 0;
  for (size_t n = 0; n < P.size(); ++n)
    if (r[n] > 0) total += g[n / S] * r[n] * std::log(r[n] / P[n]);
  return total;
}

struct KlCase {
  const char* name;
  Case c;
};

std::vector<KlCase> kl_cases() {
  Case base;
  base.dtype = DType::Float64;
  base.batch = {1};
  base.hq = base.hkv = 2;
  base.L = 4;
  base.S = 5;
  base.E = 3;
  base.Ev = 2;
  std::vector<KlCase> v{{"plain", base}};
  Case c = base;
  c.causal = true;
  v.push_back({"causal", c});
  c = base;
  c.hq = 4;
  c.gqa = true;
  v.push_back({"gqa", c});
  c = base;
  c.kv_batch = {2};  // q broadcast over the batch: its gradient sums both batch entries
  v.push_back({"query_broadcast", c});
  c = base;
  c.scale = 0.7;
  c.layout = Layout::Transposed;
  v.push_back({"scale_transposed", c});
  return v;
}

void PrintTo(const KlCase& c, std::ostream* os) { *os << c.name; }

class ReferenceKlBackward : public ::testing::TestWithParam<KlCase> {};

TEST_P(ReferenceKlBackward, MatchesFiniteDifferences) {
  const KlCase& kc = GetParam();
  Built b = build(kc.c);
  const ForwardShapes s = forward_shapes(b.args);
  std::mt19937_64 rng(7);
  Tensor r = reference_map(rng, s.attn_probs, kc.c.causal);
  Tensor g = random_tensor(rng, DType::Float64, s.logsumexp);
  Tensor R = empty_tensor(DType::Float64, s.logsumexp), H = empty_tensor(DType::Float64, s.logsumexp),
         M = empty_tensor(DType::Float64, s.logsumexp);
  kl_reference_rows(Backend::Reference, r.view, kc.c.causal, R.view, H.view, M.view);
  Tensor o = empty_tensor(DType::Float64, s.output), p = empty_tensor(DType::Float64, s.attn_probs),
         lse = empty_tensor(DType::Float64, s.logsumexp);
  forward(Backend::Reference, b.args, {o.view, p.view, lse.view});
  KlBackwardArgs args{b.args, lse.view, r.view, R.view, g.view};
  Tensor dq = empty_tensor(DType::Float64, b.q.view.shape), dk = empty_tensor(DType::Float64, b.k.view.shape);
  kl_backward(Backend::Reference, args, {dq.view, dk.view, std::nullopt, std::nullopt});
  const std::vector<double> rv = read(r.view), gv = read(g.view);
  const auto kl = [&] { return kl_loss(b.args, rv, gv); };
  expect_matches_finite_differences(b.q.view, read(dq.view), kl, "query");
  expect_matches_finite_differences(b.k.view, read(dk.view), kl, "key");
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceKlBackward, ::testing::ValuesIn(kl_cases()),
                         [](const ::testing::TestParamInfo<KlCase>& info) { return std::string(info.param.name); });

TEST(KlReferenceRows, MatchTheirDefinitionOnATransposedView) {
  std::mt19937_64 rng(11);
  const Shape shape = make_shape({2, 3, 6});
  Tensor r = empty_tensor(DType::Float32, shape, Layout::Transposed);
  std::vector<double> v(shape.numel());
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (size_t n = 0; n < v.size(); ++n) v[n] = n % 4 == 0 ? 0.0 : u(rng);
  write(r.view, v);
  v = read(r.view);  // as rounded to float32
  const Shape rows = make_shape({2, 3});
  Tensor R = empty_tensor(DType::Float64, rows), H = empty_tensor(DType::Float64, rows), M = empty_tensor(DType::Float64, rows);
  kl_reference_rows(Backend::Cpu, r.view, true, R.view, H.view, M.view);
  const std::vector<double> Rv = read(R.view), Hv = read(H.view), Mv = read(M.view);
  for (int64_t row = 0; row < 6; ++row) {
    double sum = 0, xlogx = 0, hidden = 0;
    for (int64_t j = 0; j < 6; ++j) {
      const double x = v[row * 6 + j];
      sum += x;
      if (x > 0) xlogx += x * std::log(x);
      if (j > row % 3) hidden += x;  // row i of its head sees keys j <= i
    }
    EXPECT_NEAR(Rv[row], sum, 1e-12) << row;
    EXPECT_NEAR(Hv[row], xlogx, 1e-12) << row;
    EXPECT_NEAR(Mv[row], hidden, 1e-12) << row;
  }
}

TEST(KlValidation, NamesTheBadArgumentBeforeWritingAnything) {
  Case c;
  c.dtype = DType::Float64;
  Built b = build(c);
  const ForwardShapes s = forward_shapes(b.args);
  std::mt19937_64 rng(3);
  Tensor r = reference_map(rng, s.attn_probs, false), lse = empty_tensor(DType::Float64, s.logsumexp);
  Tensor wrong = empty_tensor(DType::Float64, make_shape({2, 7, 6}));
  Tensor dq = empty_tensor(DType::Float64, b.q.view.shape), dk = empty_tensor(DType::Float64, b.k.view.shape),
         dv = empty_tensor(DType::Float64, b.v.view.shape);
  const std::vector<unsigned char> before = dq.storage;
  KlBackwardArgs args{b.args, lse.view, wrong.view, lse.view, lse.view};
  expect_error([&] { kl_backward(Backend::Reference, args, {dq.view, dk.view, std::nullopt, std::nullopt}); },
                  ErrorCode::BadGradient, "reference has shape (2, 7, 6), expected (2, 7, 7)");
  args.reference = r.view;
  expect_error([&] { kl_backward(Backend::Reference, args, {dq.view, dk.view, dv.view, std::nullopt}); },
                  ErrorCode::BadOutput, "grad_query and grad_key only");
  ForwardArgs dropped = b.args;
  dropped.options.dropout_p = 0.5;
  args.forward = dropped;
  expect_error([&] { kl_backward(Backend::Reference, args, {dq.view, dk.view, std::nullopt, std::nullopt}); },
                  ErrorCode::DropoutProbability, "dropout-free map");
  EXPECT_EQ(dq.storage, before);
  Tensor flat = empty_tensor(DType::Float32, make_shape({5}));
  expect_error([&] { kl_reference_rows(Backend::Cpu, flat.view, false, lse.view, lse.view, lse.view); },
                  ErrorCode::RankTooLow, "reference must have at least 2 dims");
  expect_error([&] { kl_reference_rows(Backend::Cpu, r.view, false, r.view, lse.view, lse.view); },
                  ErrorCode::BadOutput, "row_sum has shape");
}

}  // namespace
}  // namespace sdpa_math::testing

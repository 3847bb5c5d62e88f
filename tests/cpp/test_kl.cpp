// kl_to's core ops on the float64 reference (attention.h): kl_backward against central finite
// differences of the KL computed from the reference forward's P, kl_rows against its
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
  Tensor R = empty_tensor(DType::Float64, s.logsumexp);  // R_i = Σ_j r_ij, as kl_rows gives it
  {
    const std::vector<double> rv = read(r.view);
    const int64_t S = s.attn_probs.dims[s.attn_probs.ndim - 1];
    std::vector<double> sums(rv.size() / S, 0.0);
    for (size_t n = 0; n < rv.size(); ++n) sums[n / S] += rv[n];
    write(R.view, sums);
  }
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

// kl_forward against the KL computed from the reference forward's P and lse: with that lse,
// Σ_j r log r − Σ_j r x + R lse is Σ_j r log(r / P), over the kl_cases' shapes (causal, GQA, a
// query broadcast over batches, transposed views) and a bool mask whose hidden keys the reference
// avoids; then mass put on a hidden key makes that row +inf.
class ReferenceKlForward : public ::testing::TestWithParam<KlCase> {};

TEST_P(ReferenceKlForward, IsTheKlFromTheForwardsMap) {
  Case c = GetParam().c;
  Built b = build(c);
  const ForwardShapes s = forward_shapes(b.args);
  Tensor o = empty_tensor(DType::Float64, s.output), p = empty_tensor(DType::Float64, s.attn_probs),
         lse = empty_tensor(DType::Float64, s.logsumexp);
  forward(Backend::Reference, b.args, {o.view, p.view, lse.view});
  const std::vector<double> P = read(p.view);
  std::mt19937_64 rng(13);
  Tensor r = reference_map(rng, s.attn_probs, false);
  std::vector<double> rv = read(r.view);
  for (size_t n = 0; n < rv.size(); ++n)
    if (P[n] == 0.0) rv[n] = 0.0;  // hidden by causality or the mask: no mass there (yet)
  write(r.view, rv);
  const int64_t S = s.attn_probs.dims[s.attn_probs.ndim - 1];
  Tensor kl = empty_tensor(DType::Float64, s.logsumexp), R = empty_tensor(DType::Float64, s.logsumexp);
  KlForwardArgs args{b.args, lse.view, r.view};
  kl_forward(Backend::Cpu, args, kl.view, R.view);
  const std::vector<double> klv = read(kl.view), Rv = read(R.view);
  ASSERT_EQ(klv.size(), rv.size() / S);
  for (size_t row = 0; row < klv.size(); ++row) {
    double want = 0, sum = 0;
    for (int64_t j = 0; j < S; ++j) {
      const double x = rv[row * S + j];
      sum += x;
      if (x > 0) want += x * std::log(x / P[row * S + j]);
    }
    EXPECT_NEAR(Rv[row], sum, 1e-12) << row;
    EXPECT_NEAR(klv[row], want, 1e-10) << row;
  }
  // Mass on a key the first such row does not see: +inf there, the other rows unchanged. (Causal
  // cases always have such keys; the others may not.)
  bool hidden_key = false;
  for (size_t n = 0; n < P.size(); ++n) {
    if (P[n] != 0.0 || std::isnan(P[n])) continue;
    hidden_key = true;
    rv[n] = 0.5;
    write(r.view, rv);
    kl_forward(Backend::Reference, args, kl.view, R.view);
    const std::vector<double> after = read(kl.view);
    for (size_t row = 0; row < after.size(); ++row) {
      if (row == n / S) EXPECT_EQ(after[row], INFINITY) << row;
      else EXPECT_EQ(after[row], klv[row]) << row;
    }
    break;
  }
  EXPECT_TRUE(hidden_key || !c.causal);
}

std::vector<KlCase> kl_forward_cases() {
  std::vector<KlCase> v = kl_cases();
  Case c = v[0].c;
  c.mask = MaskKind::BoolFull;
  v.push_back({"bool_mask", c});  // (with causality the contract refuses a mask)
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceKlForward, ::testing::ValuesIn(kl_forward_cases()),
                         [](const ::testing::TestParamInfo<KlCase>& info) { return std::string(info.param.name); });

TEST(KlRows, MatchTheirDefinitionOnTransposedViews) {
  // r (2 heads, 3 rows, 6 keys) and u with rows and heads swapped in memory, a quarter of r's
  // entries 0 (0 log 0 = 0), one row all 0 (R = 0: no lse term); causal, so rows with mass right
  // of the diagonal are +inf.
  std::mt19937_64 rng(11);
  const Shape shape = make_shape({2, 3, 6}), per_row = make_shape({2, 3, 4}), rows = make_shape({2, 3});
  Tensor r = empty_tensor(DType::Float32, shape, Layout::Transposed);
  std::vector<double> v(shape.numel());
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (size_t n = 0; n < v.size(); ++n) v[n] = n % 4 == 0 || n / 6 == 4 ? 0.0 : uni(rng);
  for (int64_t row : {0, 3})  // row 0 of each head sees key 0 only: no hidden mass, a finite KL
    for (int64_t j = 1; j < 6; ++j) v[row * 6 + j] = 0.0;
  write(r.view, v);
  v = read(r.view);  // as rounded to float32
  Tensor q = empty_tensor(DType::Float32, per_row), u = empty_tensor(DType::Float64, per_row, Layout::Transposed),
         lse = empty_tensor(DType::Float64, rows);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (Tensor* t : {&q, &u, &lse}) {
    std::vector<double> w(t->view.numel());
    for (double& x : w) x = normal(rng);
    write(t->view, w);
  }
  {  // row 4 has no mass: its KL is 0 even with a NaN in q and an infinite lse
    std::vector<double> w = read(q.view), l = read(lse.view);
    w[4 * 4 + 1] = NAN;
    l[4] = INFINITY;
    write(q.view, w);
    write(lse.view, l);
  }
  const std::vector<double> qv = read(q.view), uv = read(u.view), lv = read(lse.view);
  Tensor kl = empty_tensor(DType::Float64, rows), R = empty_tensor(DType::Float64, rows);
  KlRowsArgs args{r.view, q.view, u.view, lse.view, 0.7, true};
  kl_rows(Backend::Cpu, args, kl.view, R.view);
  const std::vector<double> klv = read(kl.view), Rv = read(R.view);
  int finite = 0, infinite = 0;
  for (int64_t row = 0; row < 6; ++row) {
    double sum = 0, xlogx = 0, hidden = 0, qu = 0;
    for (int64_t j = 0; j < 6; ++j) {
      const double x = v[row * 6 + j];
      sum += x;
      if (x > 0) xlogx += x * std::log(x);
      if (j > row % 3) hidden += x;  // row i of its head sees keys j <= i
    }
    for (int64_t e = 0; e < 4; ++e) qu += qv[row * 4 + e] * uv[row * 4 + e];
    const double want = hidden > 0 ? INFINITY : sum != 0 ? xlogx - 0.7 * qu + sum * lv[row] : 0.0;
    EXPECT_NEAR(Rv[row], sum, 1e-12) << row;
    if (hidden > 0) {
      EXPECT_EQ(klv[row], INFINITY) << row;
      ++infinite;
    } else {
      EXPECT_NEAR(klv[row], want, 1e-12) << row;
      ++finite;
    }
  }
  EXPECT_GE(finite, 3);  // rows 0 and 3 and the all-zero row 4
  EXPECT_EQ(klv[4], 0.0);
  EXPECT_GE(infinite, 1);
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
  Tensor fwd_kl = empty_tensor(DType::Float64, s.logsumexp), sums = empty_tensor(DType::Float64, s.logsumexp);
  const std::vector<unsigned char> fwd_before = fwd_kl.storage;
  KlForwardArgs fwd{dropped, lse.view, r.view};
  expect_error([&] { kl_forward(Backend::Reference, fwd, fwd_kl.view, sums.view); }, ErrorCode::DropoutProbability,
               "dropout-free map");
  fwd.forward = b.args;
  fwd.reference = wrong.view;
  expect_error([&] { kl_forward(Backend::Cpu, fwd, fwd_kl.view, sums.view); }, ErrorCode::BadGradient,
               "reference has shape (2, 7, 6), expected (2, 7, 7)");
  fwd.reference = r.view;
  expect_error([&] { kl_forward(Backend::Cpu, fwd, r.view, sums.view); }, ErrorCode::BadOutput, "kl has shape");
  Tensor sums32 = empty_tensor(DType::Float32, s.logsumexp);
  expect_error([&] { kl_forward(Backend::Cpu, fwd, fwd_kl.view, sums32.view); }, ErrorCode::BadOutput,
               "kl and row_sum must have one dtype");
  EXPECT_EQ(fwd_kl.storage, fwd_before);
  Tensor flat = empty_tensor(DType::Float32, make_shape({5}));
  KlRowsArgs rows{flat.view, b.q.view, b.q.view, lse.view, 1.0, false};
  expect_error([&] { kl_rows(Backend::Cpu, rows, lse.view, lse.view); }, ErrorCode::RankTooLow,
               "reference must have at least 2 dims");
  rows.reference = r.view;
  rows.ref_keys = wrong.view;
  expect_error([&] { kl_rows(Backend::Cpu, rows, lse.view, lse.view); }, ErrorCode::BadGradient, "ref_keys has shape");
  rows.ref_keys = b.q.view;
  expect_error([&] { kl_rows(Backend::Cpu, rows, r.view, lse.view); }, ErrorCode::BadOutput, "kl has shape");
  rows.query = flat.view;
  expect_error([&] { kl_rows(Backend::Cpu, rows, lse.view, lse.view); }, ErrorCode::BadGradient,
               "query must have the reference's 3 dims");
  rows.query = b.q.view;
  Tensor kl_out = empty_tensor(DType::Float64, s.logsumexp);
  const std::vector<unsigned char> kl_before = kl_out.storage;
  expect_error([&] { kl_rows(Backend::Cpu, rows, kl_out.view, r.view); }, ErrorCode::BadOutput, "row_sum has shape");
  EXPECT_EQ(kl_out.storage, kl_before);  // kl untouched: the error came before anything was written
}

}  // namespace
}  // namespace sdpa_math::testing

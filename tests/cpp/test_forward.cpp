// Forward: the reference against the contract's rules (small properties that pin each rule), and
// the CPU backend against the reference on the seeded case space of tests/cpp/test_cases.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <iomanip>
#include <sstream>
#include <limits>

#include "sdpa_math/dropout_rng.h"
#include "test_cases.h"

namespace sdpa_math::testing {
namespace {

struct Outputs {
  Tensor o, p, lse;
  ForwardOutputs views() const { return {o.view, p.view, lse.view}; }
};

Outputs run(Backend backend, const ForwardArgs& args, DType out_dtype, DType lse_dtype,
            Layout out_layout = Layout::Contiguous) {
  const ForwardShapes s = forward_shapes(args);
  Outputs out{empty_tensor(out_dtype, s.output, out_layout), empty_tensor(out_dtype, s.attn_probs, out_layout),
              empty_tensor(lse_dtype, s.logsumexp)};
  forward(backend, args, out.views());
  return out;
}

// Tolerances, CPU against the float64 reference on the same (already rounded) inputs.
// The CPU computes in fp32 and rounds O and P once, so each element may differ by one rounding
// of the output dtype (unit roundoff u, relative) plus the fp32 arithmetic before it:
//  - P: logits carry ~1e-6 absolute error (fp32 dot products of length <= 256 of O(1) values,
//    and the exp polynomial's 2e-7), which is ~1e-6 relative in P: rtol = u + 4e-6, atol 1e-7
//    (subnormal fp16 probabilities are rounded on an absolute 6e-8 grid).
//  - O: an fp32 sum of S terms |W v| <= c max|V| errs by at most ~S eps32 in the worst case and
//    ~sqrt(S) eps32 typically: atol = 3e-5 c max|V| covers S = 1024 with room; rtol = u.
//  - lse: fp32 rounding of an O(10) number: 1e-5 (1 + |lse|); -inf exactly.
TEST(ForwardSemantics, UniformWhenQueryIsZero) {
  Case c;
  c.dtype = DType::Float64;
  c.batch = {1};
  c.hq = c.hkv = 1;
  c.L = 3;
  c.S = 5;
  c.E = c.Ev = 4;
  Built b = build(c);
  write(b.q.view, std::vector<double>(b.q.view.numel(), 0.0));
  Outputs r = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  std::vector<double> P = read(r.p.view), O = read(r.o.view), V = read(b.v.view), lse = read(r.lse.view);
  for (double x : P) EXPECT_DOUBLE_EQ(x, 0.2);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(lse[i], std::log(5.0), 1e-15);
    for (int64_t e = 0; e < 4; ++e) {
      double mean = 0;
      for (int64_t j = 0; j < 5; ++j) mean += V[j * 4 + e] / 5;
      EXPECT_NEAR(O[i * 4 + e], mean, 1e-14);
    }
  }
}

TEST(ForwardSemantics, CausalIsTopLeftAligned) {
  Case c;
  c.dtype = DType::Float64;
  c.batch = {};
  c.hq = c.hkv = 1;
  c.L = 4;
  c.S = 6;  // L < S: row i still sees keys 0..i (top-left), not the bottom-right band
  c.causal = true;
  Built b = build(c);
  Outputs r = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  std::vector<double> P = read(r.p.view), O = read(r.o.view), V = read(b.v.view);
  for (int64_t i = 0; i < 4; ++i) {
    double row = 0;
    for (int64_t j = 0; j < 6; ++j) {
      if (j > i) EXPECT_EQ(P[i * 6 + j], 0.0) << i << "," << j;
      else EXPECT_GT(P[i * 6 + j], 0.0);
      row += P[i * 6 + j];
    }
    EXPECT_NEAR(row, 1.0, 1e-15);
  }
  for (int64_t e = 0; e < c.Ev; ++e) EXPECT_NEAR(O[e], V[e], 1e-15);  // row 0 sees key 0 only
}

// One forward with an explicit mask M, one without: P = A M and O = (A M) V / (1 - p).
TEST(ForwardSemantics, ExplicitDropoutIsNotRescaledInP) {
  Case c;
  c.dtype = DType::Float64;
  c.batch = {2};
  c.L = 5;
  c.S = 9;
  c.dropout = DropoutKind::ExplicitBool;
  c.dropout_p = 0.4;
  Built b = build(c);
  Outputs with = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  ForwardArgs plain = b.args;
  plain.options.dropout_p = 0.0;  // the mask is then ignored (contract §7)
  Outputs without = run(Backend::Reference, plain, DType::Float64, DType::Float64);
  std::vector<double> P = read(with.p.view), A = read(without.p.view), M = read(b.dmask.view), O = read(with.o.view);
  std::vector<double> V = read(b.v.view);
  const int64_t L = 5, S = 9, Ev = 8;
  for (size_t n = 0; n < P.size(); ++n) EXPECT_DOUBLE_EQ(P[n], A[n] * M[n]);
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t e = 0; e < Ev; ++e) {
        double acc = 0;
        for (int64_t j = 0; j < S; ++j) acc += P[(h * L + i) * S + j] * V[(h * S + j) * Ev + e];
        EXPECT_NEAR(O[(h * L + i) * Ev + e], acc / 0.6, 1e-13);
      }
}

// Random dropout: P = A M / (1 - p) with M from the Philox stream, O = P V, and about 1 - p kept.
TEST(ForwardSemantics, RandomDropoutRescalesPAndFollowsTheStream) {
  Case c;
  c.dtype = DType::Float64;
  c.batch = {2};
  c.L = 40;
  c.S = 50;
  c.dropout = DropoutKind::Random;
  c.dropout_p = 0.3;
  Built b = build(c);
  Outputs with = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  ForwardArgs plain = b.args;
  plain.options.dropout_p = 0.0;
  Outputs without = run(Backend::Reference, plain, DType::Float64, DType::Float64);
  std::vector<double> P = read(with.p.view), A = read(without.p.view);
  const uint32_t thr = dropout_threshold(0.3);
  int64_t kept = 0;
  for (size_t n = 0; n < P.size(); ++n) {
    const bool keep = dropout_keep(b.args.options.seed, b.args.options.offset, n, thr);
    kept += keep;
    EXPECT_NEAR(P[n], keep ? A[n] / 0.7 : 0.0, 1e-15);
  }
  const double frac = static_cast<double>(kept) / P.size();  // 8000 draws: sd of the fraction 0.005
  EXPECT_NEAR(frac, 0.7, 0.03);
  // A different offset gives a different mask; the same seed and offset the same one.
  ForwardArgs shifted = b.args;
  shifted.options.offset += 4096;
  Outputs other = run(Backend::Reference, shifted, DType::Float64, DType::Float64);
  EXPECT_NE(read(other.p.view), P);
  Outputs again = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  EXPECT_EQ(read(again.p.view), P);
}

// p = 1: random dropout returns zeros (as native's dropout); explicit mask divides by zero.
TEST(ForwardSemantics, RandomDropoutAtOneGivesZeros) {
  Case c;
  c.dtype = DType::Float32;
  c.batch = {1};
  c.dropout = DropoutKind::Random;
  c.dropout_p = 1.0;
  Built b = build(c);
  for (Backend be : {Backend::Reference, Backend::Cpu}) {
    Outputs r = run(be, b.args, DType::Float32, DType::Float32);
    for (double x : read(r.p.view)) EXPECT_EQ(x, 0.0);
    for (double x : read(r.o.view)) EXPECT_EQ(x, 0.0);
  }
}

// GQA: grouped heads equal the result with key/value heads repeated (repeat_interleave).
TEST(ForwardSemantics, GqaEqualsRepeatedHeads) {
  Case c;
  c.dtype = DType::Float64;
  c.batch = {2};
  c.hq = 6;
  c.hkv = 2;
  c.gqa = true;
  c.L = 5;
  c.S = 7;
  Built b = build(c);
  Outputs grouped = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  // Repeat each key/value head 3 times.
  auto repeat = [](const Tensor& t, int64_t rows, int64_t cols) {
    Tensor r = empty_tensor(DType::Float64, make_shape({2, 6, rows, cols}));
    std::vector<double> src = read(t.view), dst(r.view.numel());
    for (int64_t bb = 0; bb < 2; ++bb)
      for (int64_t h = 0; h < 6; ++h)
        for (int64_t n = 0; n < rows * cols; ++n) dst[(bb * 6 + h) * rows * cols + n] = src[(bb * 2 + h / 3) * rows * cols + n];
    write(r.view, dst);
    return r;
  };
  Tensor k = repeat(b.k, 7, 8), v = repeat(b.v, 7, 8);
  ForwardArgs full = b.args;
  full.key = k.view;
  full.value = v.view;
  full.options.enable_gqa = false;
  Outputs repeated = run(Backend::Reference, full, DType::Float64, DType::Float64);
  EXPECT_EQ(read(grouped.p.view), read(repeated.p.view));
  EXPECT_EQ(read(grouped.o.view), read(repeated.o.view));
}

TEST(ForwardSemantics, FullyMaskedRowsAreZeroNotNan) {
  Case c;
  c.dtype = DType::Float32;
  c.batch = {1};
  c.L = 9;
  c.S = 12;
  c.mask = MaskKind::BoolFullyMaskedRows;
  Built b = build(c);
  for (Backend be : {Backend::Reference, Backend::Cpu}) {
    Outputs r = run(be, b.args, DType::Float32, DType::Float32);
    std::vector<double> P = read(r.p.view), O = read(r.o.view), lse = read(r.lse.view);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 1; i < 9; i += 3) {
        for (int64_t j = 0; j < 12; ++j) EXPECT_EQ(P[(h * 9 + i) * 12 + j], 0.0);
        for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(O[(h * 9 + i) * 8 + e], 0.0);
        EXPECT_EQ(lse[h * 9 + i], -std::numeric_limits<double>::infinity());
      }
  }
}

// Empty dims behave as native: nothing to compute, and S = 0 gives O = 0 with lse = -inf.
TEST(ForwardSemantics, EmptyDims) {
  for (int which = 0; which < 3; ++which) {
    Case c;
    c.dtype = DType::Float32;
    c.batch = {which == 0 ? 0 : 2};
    c.L = which == 1 ? 0 : 4;
    c.S = which == 2 ? 0 : 5;
    Built b = build(c);
    for (Backend be : {Backend::Reference, Backend::Cpu}) {
      Outputs r = run(be, b.args, DType::Float32, DType::Float32);
      for (double x : read(r.o.view)) EXPECT_EQ(x, 0.0) << which;
      for (double x : read(r.lse.view)) EXPECT_EQ(x, -std::numeric_limits<double>::infinity()) << which;
    }
  }
}

// E = 0: every score is an empty sum, 0, whatever the scale (the default 1/sqrt(0) is inf), so P
// is uniform over the keys a row sees and O their mean value row, as native's math op gives.
TEST(ForwardSemantics, HeadSizeZeroIsUniform) {
  for (bool causal : {false, true}) {
    Case c;
    c.dtype = DType::Float32;
    c.batch = {1};
    c.L = 5;
    c.S = 6;
    c.E = 0;
    c.causal = causal;
    Built b = build(c);
    const std::vector<double> V = read(b.v.view);
    for (Backend be : {Backend::Reference, Backend::Cpu}) {
      Outputs r = run(be, b.args, DType::Float32, DType::Float32);
      std::vector<double> P = read(r.p.view), O = read(r.o.view), lse = read(r.lse.view);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 5; ++i) {
          const int64_t seen = causal ? i + 1 : 6;
          for (int64_t j = 0; j < 6; ++j)
            EXPECT_NEAR(P[(h * 5 + i) * 6 + j], j < seen ? 1.0 / seen : 0.0, 1e-7) << causal << " " << i << " " << j;
          for (int64_t e = 0; e < 8; ++e) {
            double mean = 0.0;
            for (int64_t j = 0; j < seen; ++j) mean += V[(h * 6 + j) * 8 + e] / seen;
            EXPECT_NEAR(O[(h * 5 + i) * 8 + e], mean, 1e-6) << causal << " " << i << " " << e;
          }
          EXPECT_NEAR(lse[h * 5 + i], std::log(static_cast<double>(seen)), 1e-6);
        }
    }
  }
}

// A NaN score makes its row of P and O NaN, and its lse, as native's softmax does (its row
// maximum propagates NaN); the CPU kernels' maximum skipped NaN and gave zeros instead.
TEST(ForwardSemantics, NanScoreGivesNanRow) {
  for (DType dt : {DType::Float32, DType::Float16, DType::BFloat16}) {
    Case c;
    c.dtype = dt;
    c.batch = {1};
    c.L = 5;
    c.S = 37;  // full vector blocks at every level (16, 8, 4 lanes) and a tail
    Built b = build(c);
    std::vector<double> q = read(b.q.view);
    q[(1 * 5 + 3) * 8 + 2] = std::numeric_limits<double>::quiet_NaN();  // head 1, row 3
    write(b.q.view, q);
    for (Backend be : {Backend::Reference, Backend::Cpu}) {
      Outputs r = run(be, b.args, DType::Float32, DType::Float32);
      std::vector<double> P = read(r.p.view), O = read(r.o.view), lse = read(r.lse.view);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 5; ++i) {
          const bool nan_row = h == 1 && i == 3;
          for (int64_t j = 0; j < 37; ++j) EXPECT_EQ(std::isnan(P[(h * 5 + i) * 37 + j]), nan_row) << h << " " << i;
          for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(std::isnan(O[(h * 5 + i) * 8 + e]), nan_row) << h << " " << i;
          EXPECT_EQ(std::isnan(lse[h * 5 + i]), nan_row) << h << " " << i;
        }
    }
  }
}

class CpuForward : public ::testing::TestWithParam<Case> {};

TEST_P(CpuForward, MatchesReference) {
  const Case& c = GetParam();
  Built b = build(c);
  Outputs ref = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  Outputs cpu = run(Backend::Cpu, b.args, c.dtype, DType::Float32, c.out_layout);
  const double u = unit_roundoff(c.dtype);
  const double keep_scale = c.dropout == DropoutKind::None ? 1.0 : 1.0 / (1.0 - c.dropout_p);
  const std::vector<double> V = read(b.v.view);
  Errors ep = compare(read(cpu.p.view), read(ref.p.view), u + 4e-6, 1e-7);
  EXPECT_EQ(ep.bad, 0) << "P: " << describe(ep);
  Errors eo = compare(read(cpu.o.view), read(ref.o.view), u, 3e-5 * keep_scale * std::max(max_abs(V), 1e-30));
  EXPECT_EQ(eo.bad, 0) << "O: " << describe(eo);
  Errors el = compare(read(cpu.lse.view), read(ref.lse.view), 1e-5, 1e-5);
  EXPECT_EQ(el.bad, 0) << "lse: " << describe(el);
  // Kept in the test report (--gtest_output=xml) for the closing note's worst-error figures.
  auto sci = [](double x) {
    std::ostringstream s;
    s << std::scientific << std::setprecision(3) << x;
    return s.str();
  };
  RecordProperty("p_rel_frobenius", sci(ep.rel_frobenius));
  RecordProperty("o_rel_frobenius", sci(eo.rel_frobenius));
  RecordProperty("p_max_abs", sci(ep.max_abs));
  RecordProperty("o_max_abs", sci(eo.max_abs));
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuForward, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name(); });

// Statistics without P (forward_stats): the reference's equal P's own column sums and entropy;
// the CPU's equal the reference's. The CPU computes P in fp32 (relative error ~1e-6 an element)
// and reduces in fp64, so both statistics stay within 1e-5 relative of the float64 reference
// even for fp16/bf16 inputs (P is never rounded to them).
// The window of rows asked for: rows 1, 3, 5, ... (none when L < 2).
constexpr int64_t kWindowFirst = 1, kWindowStep = 2;

struct Stats {
  Tensor o, lse, col_sum, row_entropy, rows;
  StatsOutputs views() const {
    return {o.view, lse.view, col_sum.view, row_entropy.view, rows.view, kWindowFirst, kWindowStep};
  }
};

Stats run_stats(Backend backend, const ForwardArgs& args, DType out_dtype, DType stat_dtype) {
  const ForwardShapes s = forward_shapes(args);
  Shape cols = s.logsumexp;
  cols.dims[cols.ndim - 1] = s.attn_probs.dims[s.attn_probs.ndim - 1];
  Shape window = s.attn_probs;
  const int64_t L = window.dims[window.ndim - 2];
  window.dims[window.ndim - 2] = L > kWindowFirst ? (L - kWindowFirst + kWindowStep - 1) / kWindowStep : 0;
  Stats out{empty_tensor(out_dtype, s.output), empty_tensor(stat_dtype, s.logsumexp), empty_tensor(stat_dtype, cols),
            empty_tensor(stat_dtype, s.logsumexp), empty_tensor(out_dtype, window)};
  forward_stats(backend, args, out.views());
  return out;
}

class CpuStats : public ::testing::TestWithParam<Case> {};

TEST_P(CpuStats, ReferenceIsPsOwnSumsAndCpuMatchesIt) {
  const Case& c = GetParam();
  if (c.dropout != DropoutKind::None) GTEST_SKIP() << "statistics are of the dropout-free map";
  Built b = build(c);
  Outputs full = run(Backend::Reference, b.args, DType::Float64, DType::Float64);
  Stats ref = run_stats(Backend::Reference, b.args, DType::Float64, DType::Float64);
  const ForwardShapes s = forward_shapes(b.args);
  const int64_t S = s.attn_probs.dims[s.attn_probs.ndim - 1], L = s.attn_probs.dims[s.attn_probs.ndim - 2];
  const int64_t heads = L * S > 0 ? s.attn_probs.numel() / (L * S) : 0;
  const std::vector<double> P = read(full.p.view), cs = read(ref.col_sum.view), ent = read(ref.row_entropy.view);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < S; ++j) {
      double sum = 0;
      for (int64_t i = 0; i < L; ++i) sum += P[(h * L + i) * S + j];
      ASSERT_NEAR(cs[h * S + j], sum, 1e-12 * (1 + std::abs(sum))) << "head " << h << " key " << j;
    }
    for (int64_t i = 0; i < L; ++i) {
      double e = 0;
      for (int64_t j = 0; j < S; ++j) {
        const double x = P[(h * L + i) * S + j];
        if (x > 0) e -= x * std::log(x);
      }
      ASSERT_NEAR(ent[h * L + i], e, 1e-12 * (1 + std::abs(e))) << "head " << h << " row " << i;
    }
  }
  EXPECT_EQ(read(ref.o.view), read(full.o.view));
  const std::vector<double> win = read(ref.rows.view);
  for (int64_t h = 0, n = 0; h < heads; ++h)
    for (int64_t i = kWindowFirst; i < L; i += kWindowStep, ++n)
      for (int64_t j = 0; j < S; ++j) ASSERT_EQ(win[n * S + j], P[(h * L + i) * S + j]) << "head " << h << " row " << i;
  Stats cpu = run_stats(Backend::Cpu, b.args, c.dtype, DType::Float32);
  const std::vector<double> V = read(b.v.view);
  Errors eo = compare(read(cpu.o.view), read(ref.o.view), unit_roundoff(c.dtype), 3e-5 * std::max(max_abs(V), 1e-30));
  EXPECT_EQ(eo.bad, 0) << "O: " << describe(eo);
  Errors el = compare(read(cpu.lse.view), read(ref.lse.view), 1e-5, 1e-5);
  EXPECT_EQ(el.bad, 0) << "lse: " << describe(el);
  Errors ec = compare(read(cpu.col_sum.view), cs, 1e-5, 1e-6);
  EXPECT_EQ(ec.bad, 0) << "col_sum: " << describe(ec);
  EXPECT_LE(ec.rel_frobenius, 1e-5);
  Errors ew = compare(read(cpu.rows.view), win, unit_roundoff(c.dtype) + 4e-6, 1e-7);  // as the forward's P
  EXPECT_EQ(ew.bad, 0) << "rows: " << describe(ew);
  Errors ee = compare(read(cpu.row_entropy.view), ent, 1e-5, 1e-6);
  EXPECT_EQ(ee.bad, 0) << "row_entropy: " << describe(ee);
  EXPECT_LE(ee.rel_frobenius, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Cases, CpuStats, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name(); });

TEST(StatsValidation, DropoutIsRefusedBeforeAnythingIsWritten) {
  Case c;
  c.dtype = DType::Float32;
  c.dropout = DropoutKind::Random;
  Built b = build(c);
  const ForwardShapes s = forward_shapes(b.args);
  Shape cols = s.logsumexp;
  cols.dims[cols.ndim - 1] = s.attn_probs.dims[s.attn_probs.ndim - 1];
  Stats out{empty_tensor(DType::Float32, s.output), empty_tensor(DType::Float32, s.logsumexp),
            empty_tensor(DType::Float32, cols), empty_tensor(DType::Float32, s.logsumexp),
            empty_tensor(DType::Float32, s.attn_probs)};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Tensor* t : {&out.o, &out.lse, &out.col_sum, &out.row_entropy})
    write(t->view, std::vector<double>(t->view.numel(), nan));
  for (Backend be : {Backend::Reference, Backend::Cpu}) {
    try {
      forward_stats(be, b.args, out.views());
      ADD_FAILURE() << "no error from " << backend_name(be);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::DropoutProbability) << e.what();
      EXPECT_NE(std::string(e.what()).find("dropout-free"), std::string::npos) << e.what();
    }
  }
  for (const Tensor* t : {&out.o, &out.lse, &out.col_sum, &out.row_entropy})
    for (double x : read(t->view)) ASSERT_TRUE(std::isnan(x));
}

}  // namespace
}  // namespace sdpa_math::testing

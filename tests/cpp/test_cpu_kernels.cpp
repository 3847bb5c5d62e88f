// The CPU backend's building blocks against plain double-precision loops:
// - the tile products A B, A B^T and A^T B: every register-block and tail path (panels of two
//   vectors, one vector and, on AVX-512, 8 floats; the last columns through the padded panel;
//   row blocks of the level's tile, 4 and 1; fewer than 8 rows of A B^T as dot products with and
//   without a K tail), leading dimensions wider than the tile, overwrite, add and streaming
//   stores;
// - the transpose: register blocks of one vector's lanes square and the scalar edges;
// - the vectorised softmax: lengths that are and are not multiples of the level's vectors, -inf
//   entries, masked rows;
// - the vectorised fp16 row conversions against half.h's scalar ones, bit for bit.
// This file is compiled once per level of the CPU kernels (src/cpu/isa.h, SDPA_MATH_CPU_ISA) and
// tests that level's copy; its tests are named <Suite>_<level> and skip where the CPU lacks it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/rows.h"
#include "sdpa_math/attention.h"
#include "sdpa_math/half.h"

#define SDPA_MATH_PASTE2(a, b) a##_##b
#define SDPA_MATH_PASTE(a, b) SDPA_MATH_PASTE2(a, b)
#define SDPA_MATH_STR2(a) #a
#define SDPA_MATH_STR(a) SDPA_MATH_STR2(a)
// A test suite of this level: TileProduct_avx512, ...
#define LEVEL_SUITE(name) SDPA_MATH_PASTE(name, SDPA_MATH_CPU_ISA)
// gtest pastes INSTANTIATE_TEST_SUITE_P's suite name unexpanded: this expands it first.
#define INSTANTIATE_LEVEL_SUITE_P(prefix, suite, ...) INSTANTIATE_TEST_SUITE_P(prefix, suite, __VA_ARGS__)
// Skips the test where this CPU cannot run the level's instructions.
#define SKIP_UNLESS_LEVEL_RUNS()                                                                        \
  do {                                                                                                 \
    const std::string level = SDPA_MATH_STR(SDPA_MATH_CPU_ISA);                                        \
    if ((", " + sdpa_math::cpu_isas_available() + ",").find(" " + level + ",") == std::string::npos) \
      GTEST_SKIP() << "this CPU cannot run the " << level << " kernels";                              \
  } while (0)

namespace sdpa_math::cpu::SDPA_MATH_CPU_ISA {
namespace {

struct Dims {
  int64_t M, N, K;
};

std::vector<float> random_floats(std::mt19937_64& rng, size_t n) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class LEVEL_SUITE(TileProduct) : public ::testing::TestWithParam<Dims> {};

enum class Form { NN, NT, TN };

TEST_P(LEVEL_SUITE(TileProduct), MatchesDoubleLoops) {
  SKIP_UNLESS_LEVEL_RUNS();
  const auto [M, N, K] = GetParam();
  std::mt19937_64 rng(M * 1000003 + N * 1009 + K);
  // Padded leading dimensions: the kernels must honour them, not assume packed rows. C's rows are
  // a multiple of 16 floats apart and start 64-byte aligned, so Out::Stream takes its
  // non-temporal stores on AVX-512 and AVX2 (plain stores elsewhere give the same values).
  const int64_t lda = K + 3, lda_tn = M + 3, ldb_nn = N + 5, ldb_nt = K + 7, ldc = (N + 2 + 15) / 16 * 16;
  const std::vector<float> A = random_floats(rng, M * lda), Atn = random_floats(rng, K * lda_tn),
                           Bnn = random_floats(rng, K * ldb_nn), Bnt = random_floats(rng, N * ldb_nt),
                           C0 = random_floats(rng, M * ldc);
  std::vector<float> storage(M * ldc + 16);
  float* C = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / sizeof(float) % 16) % 16;
  const float alpha = 0.75f;
  for (Form form : {Form::NN, Form::NT, Form::TN}) {
    const char* name = form == Form::NN ? "gemm" : form == Form::NT ? "gemm_nt" : "gemm_tn";
    for (Out how : {Out::Set, Out::Add, Out::Stream}) {
      const bool accumulate = how == Out::Add;
      const char* mode = how == Out::Set ? " set" : how == Out::Add ? " add" : " stream";
      std::copy(C0.begin(), C0.end(), C);
      switch (form) {
        case Form::NN: gemm(M, N, K, alpha, A.data(), lda, Bnn.data(), ldb_nn, C, ldc, how); break;
        case Form::NT: gemm_nt(M, N, K, alpha, A.data(), lda, Bnt.data(), ldb_nt, C, ldc, how); break;
        case Form::TN: gemm_tn(M, N, K, alpha, Atn.data(), lda_tn, Bnn.data(), ldb_nn, C, ldc, how); break;
      }
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = 0; j < N; ++j) {
          double want = 0.0, scale = 0.0;
          for (int64_t k = 0; k < K; ++k) {
            const double a = form == Form::TN ? Atn[k * lda_tn + i] : A[i * lda + k];
            const double b = form == Form::NT ? Bnt[j * ldb_nt + k] : Bnn[k * ldb_nn + j];
            want += a * b;
            scale += std::fabs(a * b);
          }
          want = alpha * want + (accumulate ? C0[i * ldc + j] : 0.0);
          ASSERT_NEAR(C[i * ldc + j], want, 1e-6 * (scale + 1.0)) << name << mode << " at " << i << "," << j;
        }
        for (int64_t j = N; j < ldc; ++j)  // padding columns untouched
          ASSERT_EQ(C[i * ldc + j], C0[i * ldc + j]) << name << mode << " wrote past column " << N;
      }
    }
  }
}

INSTANTIATE_LEVEL_SUITE_P(Shapes, LEVEL_SUITE(TileProduct),
                         ::testing::Values(Dims{1, 1, 1}, Dims{1, 2048, 64}, Dims{8, 32, 64}, Dims{13, 61, 17},
                                           Dims{64, 256, 64}, Dims{7, 48, 128}, Dims{12, 5, 3}, Dims{64, 64, 256},
                                           Dims{3, 100, 1}, Dims{130, 300, 64}, Dims{5, 37, 70}, Dims{4, 16, 16}),
                         [](const ::testing::TestParamInfo<Dims>& info) {
                           return "M" + std::to_string(info.param.M) + "_N" + std::to_string(info.param.N) + "_K" +
                                  std::to_string(info.param.K);
                         });

TEST(LEVEL_SUITE(Transpose), MovesEveryElement) {
  SKIP_UNLESS_LEVEL_RUNS();
  // Whole 16 x 16 register blocks, right and bottom edges, one-row and one-column sources, and
  // leading dimensions wider than the data on both sides (the padding must stay untouched).
  std::mt19937_64 rng(5);
  for (const auto [rows, cols] : {std::pair<int64_t, int64_t>{16, 16}, {300, 64}, {37, 70}, {1, 33}, {33, 1}, {48, 17}}) {
    const int64_t ld = cols + 3, dst_ld = rows + 5;
    const std::vector<float> src = random_floats(rng, rows * ld);
    std::vector<float> dst(cols * dst_ld, -7.0f);
    transpose(src.data(), rows, cols, ld, dst.data(), dst_ld);
    for (int64_t c = 0; c < cols; ++c) {
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(dst[c * dst_ld + r], src[r * ld + c]) << rows << "x" << cols << " at " << r << "," << c;
      for (int64_t r = rows; r < dst_ld; ++r) ASSERT_EQ(dst[c * dst_ld + r], -7.0f) << "wrote past row " << rows;
    }
  }
}

TEST(LEVEL_SUITE(SoftmaxRow), MatchesDoubleSoftmax) {
  SKIP_UNLESS_LEVEL_RUNS();
  std::mt19937_64 rng(7);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {1, 5, 15, 16, 17, 31, 64, 100, 257}) {
    std::vector<float> x = random_floats(rng, n);
    for (float& v : x) v *= 8.0f;
    if (n > 3) x[2] = -inf;  // a masked key
    if (n > 20) x[n - 1] = -100.0f;  // below exp's underflow cut
    std::vector<float> y = x;
    const float lse = softmax_row(y.data(), n);
    double m = -inf, sum = 0.0;
    for (float v : x) m = std::max<double>(m, v);
    for (float v : x) sum += std::exp(static_cast<double>(v) - m);
    EXPECT_NEAR(lse, m + std::log(sum), 1e-5 * (1.0 + std::fabs(m))) << "n=" << n;
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double shifted = static_cast<double>(x[j]) - m, want = std::exp(shifted) / sum;
      // x - m is rounded to fp32 first: its error, |x - m| * 2^-24, is exp's relative error.
      const double tol = want == 0.0 ? 0.0 : want * (1e-6 + 1.2e-7 * std::fabs(shifted)) + 1e-37;
      EXPECT_NEAR(y[j], want, tol) << "n=" << n << " j=" << j;
      total += y[j];
    }
    EXPECT_NEAR(total, 1.0, 1e-5) << "n=" << n;
    if (n > 3) EXPECT_EQ(y[2], 0.0f);
  }
}

TEST(LEVEL_SUITE(SoftmaxRow), FullyMaskedRowIsZero) {
  SKIP_UNLESS_LEVEL_RUNS();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {1, 16, 19}) {
    std::vector<float> x(n, -inf);
    EXPECT_EQ(softmax_row(x.data(), n), -inf);
    for (float v : x) EXPECT_EQ(v, 0.0f);
  }
}

TEST(LEVEL_SUITE(DotRow), MatchesDoubleLoop) {
  SKIP_UNLESS_LEVEL_RUNS();
  std::mt19937_64 rng(11);
  for (int64_t n : {0, 1, 15, 16, 33, 300}) {
    const std::vector<float> a = random_floats(rng, n), b = random_floats(rng, n);
    double want = 0.0, scale = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      want += static_cast<double>(a[j]) * b[j];
      scale += std::fabs(a[j] * b[j]);
    }
    EXPECT_NEAR(dot_row(a.data(), b.data(), n), want, 1e-6 * (scale + 1.0)) << "n=" << n;
  }
}

TEST(LEVEL_SUITE(HalfRows), VectorConversionMatchesScalar) {
  SKIP_UNLESS_LEVEL_RUNS();
  // Every fp16 bit pattern to fp32 (the row is not a multiple of 8 long: the tail is scalar).
  std::vector<uint16_t> halves(65536 + 5);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i);
  std::vector<float> wide(halves.size());
  load_row(DType::Float16, reinterpret_cast<const char*>(halves.data()), 0, 1, static_cast<int64_t>(halves.size()),
           wide.data());
  for (size_t i = 0; i < halves.size(); ++i) {
    const float want = half_to_float(halves[i]);
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(wide[i])) << i;
    else ASSERT_EQ(float_bits(wide[i]), float_bits(want)) << "half bits " << i;
  }
  // fp32 to fp16: halfway cases (ties to even), overflow, subnormals, signed zeros, random.
  std::vector<float> values;
  for (size_t i = 0; i + 1 < 65536; ++i) {
    const float a = half_to_float(static_cast<uint16_t>(i)), b = half_to_float(static_cast<uint16_t>(i + 1));
    if (std::isfinite(a) && std::isfinite(b) && (i & 0x7fffu) != 0x7fffu) values.push_back(0.5f * (a + b));
  }
  for (float v : {65504.0f, 65519.0f, 65520.0f, 1e6f, -1e6f, 0.0f, -0.0f, 5.96e-8f, 2.98e-8f, 1e-10f,
                  std::numeric_limits<float>::infinity()})
    values.push_back(v);
  std::mt19937_64 rng(3);
  for (float v : random_floats(rng, 10007)) values.push_back(v * 100.0f);
  std::vector<uint16_t> narrow(values.size());
  store_row(DType::Float16, reinterpret_cast<char*>(narrow.data()), 0, 1, static_cast<int64_t>(values.size()),
            values.data());
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(narrow[i], float_to_half(values[i])) << "value " << values[i];
}

}  // namespace
}  // namespace sdpa_math::cpu::SDPA_MATH_CPU_ISA

#include "rows.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "gemm.h"
#include "simd.h"
#include "sdpa_math/dropout_rng.h"
#include "sdpa_math/half.h"

SDPA_MATH_CPU_BEGIN
namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}

namespace {
// Contiguous fp16 <-> fp32 with the F16C instructions, 8 at a time (round to nearest even, as
// half.h's scalar conversion; the scalar loop finishes the tail). Returns how many it did.
int64_t half_to_float_vec(const uint16_t* p, int64_t n, float* out) {
  int64_t j = 0;
#if SDPA_MATH_CPU_LEVEL >= 3
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j))));
#endif
  (void)p, (void)n, (void)out;
  return j;
}
int64_t float_to_half_vec(const float* in, int64_t n, uint16_t* p) {
  int64_t j = 0;
#if SDPA_MATH_CPU_LEVEL >= 3
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  (void)in, (void)n, (void)p;
  return j;
}
}  // namespace

void load_row(DType dtype, const char* base, int64_t offset, int64_t stride, int64_t n, float* out) {
  switch (dtype) {
    case DType::Float32: {
      const float* p = reinterpret_cast<const float*>(base) + offset;
      if (stride == 1) std::memcpy(out, p, n * sizeof(float));
      else for (int64_t j = 0; j < n; ++j) out[j] = p[j * stride];
      break;
    }
    case DType::Float16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(base) + offset;
      const int64_t done = stride == 1 ? half_to_float_vec(p, n, out) : 0;
      for (int64_t j = done; j < n; ++j) out[j] = half_to_float(p[j * stride]);
      break;
    }
    case DType::BFloat16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(base) + offset;
      for (int64_t j = 0; j < n; ++j) out[j] = bfloat16_to_float(p[j * stride]);
      break;
    }
    case DType::Float64: {
      const double* p = reinterpret_cast<const double*>(base) + offset;
      for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(p[j * stride]);
      break;
    }
    case DType::Bool:
    case DType::UInt8: {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(base) + offset;
      for (int64_t j = 0; j < n; ++j) out[j] = p[j * stride] ? 1.0f : 0.0f;
      break;
    }
    default:
      std::fill(out, out + n, 0.0f);  // unreachable: validation admits no other dtype
  }
}

void store_row(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n, const float* in) {
  switch (dtype) {
    case DType::Float32: {
      float* p = reinterpret_cast<float*>(base) + offset;
      if (stride == 1) std::memcpy(p, in, n * sizeof(float));
      else for (int64_t j = 0; j < n; ++j) p[j * stride] = in[j];
      break;
    }
    case DType::Float16: {
      uint16_t* p = reinterpret_cast<uint16_t*>(base) + offset;
      const int64_t done = stride == 1 ? float_to_half_vec(in, n, p) : 0;
      for (int64_t j = done; j < n; ++j) p[j * stride] = float_to_half(in[j]);
      break;
    }
    case DType::BFloat16: {
      uint16_t* p = reinterpret_cast<uint16_t*>(base) + offset;
      for (int64_t j = 0; j < n; ++j) p[j * stride] = float_to_bfloat16(in[j]);
      break;
    }
    case DType::Float64: {
      double* p = reinterpret_cast<double*>(base) + offset;
      for (int64_t j = 0; j < n; ++j) p[j * stride] = in[j];
      break;
    }
    default:
      break;
  }
}

void store_row_once(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n, const float* in) {
  if (dtype != DType::Float32 || stride != 1) return store_row(dtype, base, offset, stride, n, in);
  float* p = reinterpret_cast<float*>(base) + offset;
  int64_t j = 0;
  for (; j < n && reinterpret_cast<uintptr_t>(p + j) % sizeof(vf32) != 0; ++j) p[j] = in[j];
  for (; j + kLanes <= n; j += kLanes) store_streaming(p + j, load(in + j));
  for (; j < n; ++j) p[j] = in[j];
}

bool rows_in_place(const core::Operand& op) { return op.dtype == DType::Float32 && op.col_stride == 1; }

void store_hidden_keys(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n, bool nan_row, float* tmp) {
  if (n <= 0) return;
  if (!nan_row) return store_zeros(dtype, base, offset, stride, n);
  std::fill(tmp, tmp + n, std::numeric_limits<float>::quiet_NaN());
  store_row(dtype, base, offset, stride, n, tmp);
}

void store_zeros(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n) {
  const size_t size = dtype_size(dtype);
  char* p = base + offset * static_cast<int64_t>(size);
  if (stride == 1) {
    std::memset(p, 0, n * size);  // +0.0 is all zero bits in every floating dtype
  } else {
    for (int64_t j = 0; j < n; ++j) std::memset(p + j * stride * static_cast<int64_t>(size), 0, size);
  }
}

namespace {

// exp(v): Cody-Waite range reduction v = k ln2 + r, |r| <= ln2/2, a degree-7 Taylor polynomial
// (truncation error r^8/8! < 6e-9) and 2^k built in the exponent bits. Lanes below -87 (also
// -inf and NaN) give 0; above 88 clamp (logits here are shifted by the row max, so <= 0).
inline vf32 exp_lanes(vf32 v) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723212e-6f;
  const vi32 keep = v >= splat(-87.0f);
  v = v < splat(-87.0f) ? splat(-87.0f) : v;
  v = v > splat(88.0f) ? splat(88.0f) : v;
  const vf32 t = v * kLog2e + 0.5f;
  vi32 k = __builtin_convertvector(t, vi32);  // rounds toward zero: floor needs -1 below
  k += __builtin_convertvector(k, vf32) > t;    // a true comparison is -1
  const vf32 kf = __builtin_convertvector(k, vf32);
  const vf32 r = v - kf * kLn2Hi - kf * kLn2Lo;
  vf32 poly = splat(1.0f / 5040.0f);
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const vi32 two_k = (k + 127) << 23;
  vf32 two_kf;
  std::memcpy(&two_kf, &two_k, sizeof two_kf);
  const vf32 e = poly * two_kf;
  vi32 bits;
  std::memcpy(&bits, &e, sizeof bits);
  bits &= keep;
  vf32 out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// The last n % kLanes elements go through a padded copy, so every lane runs the same code.
template <class F>
inline void for_tail(float* x, int64_t n, F&& f) {
  const int64_t rest = n % kLanes;
  if (rest == 0) return;
  float buf[kLanes] = {};
  float* tail = x + (n - rest);
  std::memcpy(buf, tail, rest * sizeof(float));
  f(buf, rest);
  std::memcpy(tail, buf, rest * sizeof(float));
}

}  // namespace

RowContext::RowContext(const core::Problem& problem, int64_t lead_index) : p(problem), lead(lead_index) {
  if (p.attn_mask.present()) mask_base = core::lead_offset(p, p.attn_mask, lead);
  if (p.dropout_mask.present()) dmask_base = core::lead_offset(p, p.dropout_mask, lead);
}

int64_t RowContext::visible(int64_t i) const { return p.is_causal ? std::min(p.S, i + 1) : p.S; }

void RowContext::mask_scores(int64_t i, float* scores, int64_t n, float* tmp) const {
  const int64_t lim = std::min(n, visible(i));
  for (int64_t j = lim; j < n; ++j) scores[j] = kNegInf;
  if (!p.attn_mask.present()) return;
  const core::Operand& m = p.attn_mask;
  load_row(m.dtype, m.data, mask_base + i * m.row_stride, m.col_stride, lim, tmp);
  if (p.mask_is_bool) {
    for (int64_t j = 0; j < lim; ++j) scores[j] = tmp[j] != 0.0f ? scores[j] : kNegInf;
  } else {
    for (int64_t j = 0; j < lim; ++j) scores[j] += tmp[j];
  }
}

void RowContext::keep_row(int64_t i, float* keep, int64_t n) const {
  switch (p.dropout) {
    case core::DropoutMode::None:
      std::fill(keep, keep + n, 1.0f);
      break;
    case core::DropoutMode::ExplicitMask: {
      const core::Operand& m = p.dropout_mask;
      load_row(m.dtype, m.data, dmask_base + i * m.row_stride, m.col_stride, n, keep);
      for (int64_t j = 0; j < n; ++j) keep[j] = keep[j] != 0.0f ? 1.0f : 0.0f;
      break;
    }
    case core::DropoutMode::Random: {
      const uint32_t threshold = dropout_threshold(p.dropout_p);
      const uint64_t first = static_cast<uint64_t>((lead * p.L + i) * p.S);
      int64_t j = 0;
      while (j < n) {  // one Philox block gives 4 consecutive elements
        const uint64_t e = first + j;
        Philox4 block = philox4x32_10(p.seed, e >> 2, p.offset);
        for (uint64_t lane = e & 3; lane < 4 && j < n; ++lane, ++j)
          keep[j] = dropout_keep_bits(block.v[lane], threshold) ? 1.0f : 0.0f;
      }
      break;
    }
  }
}

float softmax_row(float* x, int64_t n) {
  const int64_t full = n - n % kLanes;
  vf32 mv = splat(kNegInf);
  vi32 nan_lanes = vi32{};  // the max below skips NaN, so NaN is looked for on the side
  for (int64_t j = 0; j < full; j += kLanes) {
    const vf32 v = load(x + j);
    mv = v > mv ? v : mv;
    nan_lanes |= v != v;
  }
  float m = kNegInf;
  bool has_nan = false;
  for (int64_t l = 0; l < kLanes; ++l) {
    m = std::max(m, mv[l]);
    has_nan |= nan_lanes[l] != 0;
  }
  for (int64_t j = full; j < n; ++j) {
    m = std::max(m, x[j]);
    has_nan |= std::isnan(x[j]);
  }
  if (has_nan) {  // a NaN logit: the whole row and lse NaN, as the math op's softmax gives
    std::fill(x, x + n, std::numeric_limits<float>::quiet_NaN());
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (m == kNegInf) {  // fully masked (contract §6)
    std::fill(x, x + n, 0.0f);
    return kNegInf;
  }
  // exp(x - m) and its sum in one pass; padded tail lanes are -inf and add 0.
  vf32 sv = vf32{};
  for (int64_t j = 0; j < full; j += kLanes) {
    const vf32 e = exp_lanes(load(x + j) - m);
    store(x + j, e);
    sv += e;
  }
  for_tail(x, n, [&](float* buf, int64_t rest) {
    for (int64_t l = rest; l < kLanes; ++l) buf[l] = kNegInf;
    const vf32 e = exp_lanes(load(buf) - m);
    store(buf, e);
    sv += e;
  });
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += sv[l];
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < full; j += kLanes) store(x + j, load(x + j) * inv);
  for (int64_t j = full; j < n; ++j) x[j] *= inv;
  return m + std::log(sum);
}

double entropy_row(const float* p, const float* x, int64_t n) {
  const int64_t full = n - n % kLanes;
  vf32 mv = splat(kNegInf), pv = vf32{};
  for (int64_t j = 0; j < full; j += kLanes) {
    const vf32 xj = load(x + j), pj = load(p + j);
    mv = xj > mv ? xj : mv;
    pv = pj > pv ? pj : pv;
  }
  float m = kNegInf, p_max = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) {
    m = std::max(m, mv[l]);
    p_max = std::max(p_max, pv[l]);
  }
  for (int64_t j = full; j < n; ++j) {
    m = std::max(m, x[j]);
    p_max = std::max(p_max, p[j]);
  }
  vf64 lo = vf64{}, hi = vf64{};
  const vf32 zero = vf32{};
  for (int64_t j = 0; j < full; j += kLanes) {
    const vf32 pj = load(p + j);
    const vf32 t = pj > zero ? pj * (m - load(x + j)) : zero;
    vf32_half t_lo, t_hi;
    std::memcpy(&t_lo, &t, sizeof(t_lo));
    std::memcpy(&t_hi, reinterpret_cast<const char*>(&t) + sizeof(t_lo), sizeof(t_hi));
    lo += __builtin_convertvector(t_lo, vf64);
    hi += __builtin_convertvector(t_hi, vf64);
  }
  double h = 0.0;
  for (int64_t l = 0; l < kLanes / 2; ++l) h += lo[l] + hi[l];
  for (int64_t j = full; j < n; ++j)
    if (p[j] > 0.0f) h += static_cast<double>(p[j] * (m - x[j]));
  return h - std::log(static_cast<double>(p_max));
}

int threads_for(int64_t tasks) {
  int t = cpu_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, tasks)));
}

namespace {
// Points `rows` at operand `op`'s (n x width) block at `at` as fp32 rows, converting into `copy`
// unless the block is already fp32 with unit column stride.
void fp32_rows(const core::Operand& op, int64_t at, int64_t n, int64_t width, std::vector<float>& copy,
               const float*& rows, int64_t& ld) {
  if (rows_in_place(op)) {
    rows = reinterpret_cast<const float*>(op.data) + at;
    ld = op.row_stride;
    return;
  }
  copy.resize(n * width);
  for (int64_t j = 0; j < n; ++j)
    load_row(op.dtype, op.data, at + j * op.row_stride, op.col_stride, width, copy.data() + j * width);
  rows = copy.data();
  ld = width;
}

}  // namespace

void HeadPack::pack(const core::Problem& p, int64_t lead, bool transposed) {
  const int64_t k_at = core::lead_offset(p, p.key, lead), v_at = core::lead_offset(p, p.value, lead);
  E = p.E, Ev = p.Ev, S = p.S;
  use_t = transposed;
  if (k_at != key_at) {
    fp32_rows(p.key, k_at, p.S, p.E, key_copy, key, key_ld);
    key_at = k_at;
    key_t_ready = false;
  }
  if (v_at != value_at) {
    fp32_rows(p.value, v_at, p.S, p.Ev, value_copy, value, value_ld);
    value_at = v_at;
    value_t_ready = false;
  }
}

namespace {
// C = alpha A B^T over B's first `cols` rows (B: n x width, rows ldb apart): gemm_nt on B's rows,
// or, with `use_t`, the plain product on B^T (width x n), transposed into `b_t` on first use.
void times_rows_t(int64_t rows, int64_t cols, int64_t width, float alpha, const float* A, int64_t lda,
                  const float* b, int64_t ldb, int64_t n, bool use_t, std::vector<float>& b_t, bool& b_t_ready,
                  float* C, int64_t ldc) {
  if (!use_t) return gemm_nt(rows, cols, width, alpha, A, lda, b, ldb, C, ldc, Out::Set);
  if (!b_t_ready) {
    b_t.resize(n * width);
    transpose(b, n, width, ldb, b_t.data(), n);
    b_t_ready = true;
  }
  gemm(rows, cols, width, alpha, A, lda, b_t.data(), n, C, ldc, Out::Set);
}
}  // namespace

void HeadPack::times_key_t(int64_t rows, int64_t cols, float alpha, const float* A, int64_t lda, float* C,
                           int64_t ldc) {
  times_rows_t(rows, cols, E, alpha, A, lda, key, key_ld, S, use_t, key_t, key_t_ready, C, ldc);
}

void HeadPack::times_value_t(int64_t rows, int64_t cols, float alpha, const float* A, int64_t lda, float* C,
                             int64_t ldc) {
  times_rows_t(rows, cols, Ev, alpha, A, lda, value, value_ld, S, use_t, value_t, value_t_ready, C, ldc);
}

int64_t task_chunk(int64_t heads, int64_t blocks_per_head, int threads) {
  return heads >= 2 * threads ? std::max<int64_t>(blocks_per_head, 1) : 1;  // OpenMP wants a chunk >= 1
}

float dot_row(const float* a, const float* b, int64_t n) { return dot(a, b, n); }

SDPA_MATH_CPU_END

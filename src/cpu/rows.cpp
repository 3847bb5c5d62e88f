#include "rows.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "sdpa_math/dropout_rng.h"
#include "sdpa_math/half.h"

namespace sdpa_math {
namespace {
std::atomic<int> g_cpu_threads{0};
}
void set_cpu_threads(int n) { g_cpu_threads = n < 0 ? 0 : n; }
int cpu_threads() {
  int n = g_cpu_threads.load();
  return n > 0 ? n : omp_get_max_threads();
}
}  // namespace sdpa_math

namespace sdpa_math::cpu {
namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}

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
      for (int64_t j = 0; j < n; ++j) out[j] = half_to_float(p[j * stride]);
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
      for (int64_t j = 0; j < n; ++j) p[j * stride] = float_to_half(in[j]);
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

void store_zeros(DType dtype, char* base, int64_t offset, int64_t stride, int64_t n) {
  const size_t size = dtype_size(dtype);
  char* p = base + offset * static_cast<int64_t>(size);
  if (stride == 1) {
    std::memset(p, 0, n * size);  // +0.0 is all zero bits in every floating dtype
  } else {
    for (int64_t j = 0; j < n; ++j) std::memset(p + j * stride * static_cast<int64_t>(size), 0, size);
  }
}

void exp_rows(float* x, int64_t n) {
  // Cody-Waite range reduction x = k ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial
  // (truncation error r^8/8! < 6e-9) and 2^k built in the exponent bits. Branch-free, vectorises.
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723212e-6f;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    float v = x[j];
    const bool underflow = !(v >= -87.0f);  // also catches -inf and NaN-free masked entries
    v = std::min(std::max(v, -87.0f), 88.0f);
    float k = std::floor(v * kLog2e + 0.5f);
    float r = v - k * kLn2Hi - k * kLn2Lo;
    float poly = 1.0f / 5040.0f;
    poly = poly * r + 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &bits, 4);
    x[j] = underflow ? 0.0f : poly * two_k;
  }
}

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
  float m = kNegInf;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  if (m == kNegInf) {  // fully masked (contract §6)
    std::fill(x, x + n, 0.0f);
    return kNegInf;
  }
  for (int64_t j = 0; j < n; ++j) x[j] -= m;
  exp_rows(x, n);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += x[j];
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
  return m + std::log(sum);
}

int threads_for(int64_t tasks) {
  int t = cpu_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, tasks)));
}

void HeadPack::pack(const core::Problem& p, int64_t lead, bool for_backward) {
  const int64_t k_at = core::lead_offset(p, p.key, lead), v_at = core::lead_offset(p, p.value, lead);
  const int64_t S = p.S, E = p.E, Ev = p.Ev;
  if (k_at != key_at) {
    key_t.resize(E * S);
    for (int64_t e = 0; e < E; ++e)
      load_row(p.key.dtype, p.key.data, k_at + e * p.key.col_stride, p.key.row_stride, S, key_t.data() + e * S);
    if (for_backward) {
      key.resize(S * E);
      for (int64_t j = 0; j < S; ++j)
        load_row(p.key.dtype, p.key.data, k_at + j * p.key.row_stride, p.key.col_stride, E, key.data() + j * E);
    }
    key_at = k_at;
  }
  if (v_at != value_at) {
    if (for_backward) {
      value_t.resize(Ev * S);
      for (int64_t e = 0; e < Ev; ++e)
        load_row(p.value.dtype, p.value.data, v_at + e * p.value.col_stride, p.value.row_stride, S, value_t.data() + e * S);
    } else {
      value.resize(S * Ev);
      for (int64_t j = 0; j < S; ++j)
        load_row(p.value.dtype, p.value.data, v_at + j * p.value.row_stride, p.value.col_stride, Ev, value.data() + j * Ev);
    }
    value_at = v_at;
  }
}

}  // namespace sdpa_math::cpu

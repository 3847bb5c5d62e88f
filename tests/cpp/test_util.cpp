#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "core/element.h"

namespace sdpa_math::testing {

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::Contiguous: return "contig";
    case Layout::Transposed: return "transposed";
    case Layout::Sliced: return "sliced";
    case Layout::HeadsMiddle: return "headsmiddle";
  }
  return "?";
}

Shape make_shape(const std::vector<int64_t>& dims) {
  Shape s;
  for (int64_t d : dims) s.dims[s.ndim++] = d;
  return s;
}

Tensor empty_tensor(DType dtype, const Shape& shape, Layout layout) {
  const int n = shape.ndim;
  if (n < 2 || (layout == Layout::HeadsMiddle && n < 3)) layout = Layout::Contiguous;
  // Memory dims: a permutation of the logical dims (and a wider last dim for Sliced).
  int perm[kMaxDims];  // memory dim m holds logical dim perm[m]
  for (int i = 0; i < n; ++i) perm[i] = i;
  if (layout == Layout::Transposed) std::swap(perm[n - 1], perm[n - 2]);
  if (layout == Layout::HeadsMiddle) std::swap(perm[n - 3], perm[n - 2]);
  int64_t mem_dims[kMaxDims];
  for (int m = 0; m < n; ++m) mem_dims[m] = shape.dims[perm[m]];
  if (layout == Layout::Sliced) mem_dims[n - 1] = 2 * mem_dims[n - 1] + 1;
  int64_t mem_strides[kMaxDims];
  int64_t total = 1;
  for (int m = n - 1; m >= 0; --m) {
    mem_strides[m] = total;
    total *= mem_dims[m];
  }
  Tensor t;
  const size_t es = dtype_size(dtype);
  t.storage.assign(static_cast<size_t>(std::max<int64_t>(total, 1)) * es + 16, 0xFF);
  t.view.dtype = dtype;
  t.view.shape = shape;
  t.view.data = t.storage.data();
  for (int m = 0; m < n; ++m) t.view.strides[perm[m]] = mem_strides[m];
  if (layout == Layout::Sliced) {
    t.view.strides[n - 1] *= 2;
    t.view.data = t.storage.data() + es;
  }
  return t;
}

std::vector<double> read(const TensorView& v) {
  std::vector<double> out(v.numel());
  core::for_each_element(v.shape, v.strides, [&](int64_t i, int64_t off) { out[i] = core::load_as_double(v.dtype, v.data, off); });
  return out;
}

void write(const TensorView& v, const std::vector<double>& values) {
  core::for_each_element(v.shape, v.strides, [&](int64_t i, int64_t off) { core::store_from_double(v.dtype, v.data, off, values[i]); });
}

Tensor random_tensor(std::mt19937_64& rng, DType dtype, const Shape& shape, Layout layout, double scale) {
  Tensor t = empty_tensor(dtype, shape, layout);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> values(shape.numel());
  for (double& x : values) x = scale * normal(rng);
  write(t.view, values);
  return t;
}

Errors compare(const std::vector<double>& x, const std::vector<double>& ref, double rtol, double atol) {
  Errors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - ref[i];
    const bool same_inf = std::isinf(ref[i]) && x[i] == ref[i];
    const double ad = same_inf ? 0.0 : std::fabs(d);
    if (!same_inf) {
      num += d * d;
      den += ref[i] * ref[i];
      e.max_abs = std::max(e.max_abs, std::isnan(ad) ? INFINITY : ad);
    }
    if (!(ad <= atol + rtol * std::fabs(ref[i]))) {
      if (e.bad++ == 0) {
        e.first_bad = static_cast<int64_t>(i);
        e.first_bad_value = x[i];
        e.first_bad_ref = ref[i];
      }
    }
  }
  e.rel_frobenius = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

std::string describe(const Errors& e) {
  std::ostringstream s;
  s << "max_abs=" << e.max_abs << " rel_frobenius=" << e.rel_frobenius << " bad=" << e.bad;
  if (e.bad) s << " (first at " << e.first_bad << ": got " << e.first_bad_value << ", want " << e.first_bad_ref << ")";
  return s.str();
}

double unit_roundoff(DType d) {
  switch (d) {
    case DType::Float16: return std::ldexp(1.0, -11);
    case DType::BFloat16: return std::ldexp(1.0, -8);
    case DType::Float32: return std::ldexp(1.0, -24);
    default: return std::ldexp(1.0, -53);
  }
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

void expect_error(const std::function<void()>& fn, ErrorCode code, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "no error raised; expected " << error_code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "message: " << e.what();
  }
}

void expect_matches_finite_differences(const TensorView& input, const std::vector<double>& analytic,
                                       const std::function<double()>& loss, const std::string& name) {
  const double h = 1e-6;
  const std::vector<double> x = read(input);
  for (size_t n = 0; n < x.size(); ++n) {
    if (!std::isfinite(x[n])) continue;
    std::vector<double> xp = x, xm = x;
    xp[n] += h;
    xm[n] -= h;
    write(input, xp);
    const double up = loss();
    write(input, xm);
    const double down = loss();
    write(input, x);
    const double numeric = (up - down) / (2 * h);
    EXPECT_NEAR(analytic[n], numeric, 1e-7 + 1e-6 * std::fabs(numeric)) << name << "[" << n << "]";
  }
}

}  // namespace sdpa_math::testing

// Helpers for the C++ tests: owned tensors in several memory layouts, NaN sentinels, random
// fills, and error metrics.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sdpa_math/attention.h"

namespace sdpa_math::testing {

// How a tensor's logical shape sits in memory. Every layout but Contiguous gives a
// non-contiguous view; unused memory is filled with NaN so that a wrong read shows.
enum class Layout {
  Contiguous,
  Transposed,    // the last two dims swapped in memory
  Sliced,        // every other element of a wider last dim, starting at element 1
  HeadsMiddle,   // (..., H, L, D) viewed over (..., L, H, D) memory, as Hugging Face lays out O
};
const char* layout_name(Layout l);

struct Tensor {
  std::vector<unsigned char> storage;
  TensorView view;
  Tensor() = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&&) = default;
  Tensor& operator=(Tensor&&) = default;
};

// A tensor with every byte of its storage set to a NaN pattern (0xFF bytes: NaN in every float dtype).
Tensor empty_tensor(DType dtype, const Shape& shape, Layout layout = Layout::Contiguous);

// Logical (row-major) contents as doubles.
std::vector<double> read(const TensorView& v);
// Writes logical contents (row-major order) into the view.
void write(const TensorView& v, const std::vector<double>& values);

// Random normal values (times `scale`), rounded to the dtype on write.
Tensor random_tensor(std::mt19937_64& rng, DType dtype, const Shape& shape, Layout layout = Layout::Contiguous,
                     double scale = 1.0);

struct Errors {
  double max_abs = 0;       // max |x - ref|
  double rel_frobenius = 0; // ||x - ref|| / ||ref||
  int64_t bad = 0;          // elements outside |x - ref| <= atol + rtol |ref| (NaN counts)
  int64_t first_bad = -1;
  double first_bad_value = 0, first_bad_ref = 0;
};
Errors compare(const std::vector<double>& x, const std::vector<double>& ref, double rtol, double atol);
std::string describe(const Errors& e);

// The unit roundoff of a dtype (half an ulp of 1): the relative error of one rounding.
double unit_roundoff(DType d);

double max_abs(const std::vector<double>& v);

Shape make_shape(const std::vector<int64_t>& dims);

// Expects `fn` to throw sdpa_math::Error with `code` and a message containing `text`.
void expect_error(const std::function<void()>& fn, ErrorCode code, const std::string& text);

// Expects `analytic` (the gradient of `loss` to the elements of `input`, row-major) to match
// central differences with step 1e-6 within 1e-7 + 1e-6 |numeric|: each finite element of
// `input` is moved up and down in place (then restored) and `loss` evaluated. Non-finite
// elements (-inf mask entries) have no derivative and are skipped. `name` labels failures.
void expect_matches_finite_differences(const TensorView& input, const std::vector<double>& analytic,
                                       const std::function<double()>& loss, const std::string& name);

}  // namespace sdpa_math::testing

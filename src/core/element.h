// Reading and writing single elements of any dtype, and strided N-d iteration. Used where speed
// does not matter (the reference, gradient write-back); the CPU kernels convert whole rows.
#pragma once

#include <cstdint>
#include <cstring>

#include "sdpa_math/half.h"
#include "sdpa_math/tensor_view.h"

namespace sdpa_math::core {

inline double load_as_double(DType dtype, const void* base, int64_t offset) {
  const char* p = static_cast<const char*>(base);
  switch (dtype) {
    case DType::Float16: { uint16_t h; std::memcpy(&h, p + offset * 2, 2); return half_to_float(h); }
    case DType::BFloat16: { uint16_t h; std::memcpy(&h, p + offset * 2, 2); return bfloat16_to_float(h); }
    case DType::Float32: { float f; std::memcpy(&f, p + offset * 4, 4); return f; }
    case DType::Float64: { double d; std::memcpy(&d, p + offset * 8, 8); return d; }
    case DType::Bool: case DType::UInt8: return static_cast<double>(static_cast<uint8_t>(p[offset]));
    default: return 0.0;  // validation never lets other dtypes through
  }
}

inline void store_from_double(DType dtype, void* base, int64_t offset, double value) {
  char* p = static_cast<char*>(base);
  switch (dtype) {
    case DType::Float16: { uint16_t h = float_to_half(static_cast<float>(value)); std::memcpy(p + offset * 2, &h, 2); break; }
    case DType::BFloat16: { uint16_t h = float_to_bfloat16(static_cast<float>(value)); std::memcpy(p + offset * 2, &h, 2); break; }
    case DType::Float32: { float f = static_cast<float>(value); std::memcpy(p + offset * 4, &f, 4); break; }
    case DType::Float64: std::memcpy(p + offset * 8, &value, 8); break;
    case DType::Bool: p[offset] = value != 0.0 ? 1 : 0; break;
    case DType::UInt8: p[offset] = static_cast<char>(static_cast<uint8_t>(value)); break;
    default: break;
  }
}

// Calls fn(linear_index, strided_offset) for every element of `shape`, in row-major order.
template <class Fn>
void for_each_element(const Shape& shape, const int64_t* strides, Fn&& fn) {
  int64_t n = shape.numel();
  int64_t coord[kMaxDims] = {};
  int64_t offset = 0;
  for (int64_t linear = 0; linear < n; ++linear) {
    fn(linear, offset);
    for (int d = shape.ndim - 1; d >= 0; --d) {
      if (++coord[d] < shape.dims[d]) { offset += strides[d]; break; }
      offset -= strides[d] * (shape.dims[d] - 1);
      coord[d] = 0;
    }
  }
}

// Writes a dense row-major buffer of `view.shape` (given as double or float) into a strided view.
template <class Acc>
void write_dense(const Acc* dense, const TensorView& view) {
  for_each_element(view.shape, view.strides, [&](int64_t linear, int64_t offset) {
    store_from_double(view.dtype, view.data, offset, static_cast<double>(dense[linear]));
  });
}

}  // namespace sdpa_math::core

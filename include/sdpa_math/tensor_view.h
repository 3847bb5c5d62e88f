// Tensor views: how every kernel of sdpa_math sees a tensor. A view is a data pointer, a dtype,
// a shape and strides (in elements, as PyTorch counts them) and the device the memory lives on.
// Views never own memory; the caller (a test, the command line, the PyTorch binding) does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace sdpa_math {

// Every dtype a caller may hand us. Only the floating types are computed with; the others exist
// so that a wrong dtype reaches validation and gets an error that names it.
enum class DType : uint8_t {
  Float16,
  BFloat16,
  Float32,
  Float64,
  Bool,
  UInt8,
  Int8,
  Int16,
  Int32,
  Int64,
  Float8_e4m3fn,
  Float8_e5m2,
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
inline bool is_floating(DType d) {
  return d == DType::Float16 || d == DType::BFloat16 || d == DType::Float32 || d == DType::Float64;
}

enum class DeviceType : uint8_t { CPU, CUDA };
struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string device_name(Device d);

// PyTorch allows at most 25 dims; attention inputs never come close. Eight covers
// (*batch up to 5 dims, heads, rows, cols).
constexpr int kMaxDims = 8;

struct Shape {
  int ndim = 0;
  int64_t dims[kMaxDims] = {};

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t operator[](int i) const { return dims[i]; }
  int64_t& operator[](int i) { return dims[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string str() const;  // "(2, 8, 64, 64)"
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::Float32;
  Shape shape;
  int64_t strides[kMaxDims] = {};  // in elements; 0 is allowed (an expanded dim)
  Device device;

  int ndim() const { return shape.ndim; }
  int64_t size(int dim) const { return shape.dims[dim < 0 ? dim + shape.ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + shape.ndim : dim]; }
  int64_t numel() const { return shape.numel(); }
  // Row-major dense: element n of a contiguous buffer of `shape` sits at offset n (dims of size
  // 1 may have any stride).
  bool is_contiguous() const;
};

// A view of contiguous (row-major) memory.
TensorView contiguous_view(void* data, DType dtype, const Shape& shape, Device device = {});
// A view with explicit strides.
TensorView strided_view(void* data, DType dtype, const Shape& shape,
                        std::initializer_list<int64_t> strides, Device device = {});

}  // namespace sdpa_math

#include "sdpa_math/tensor_view.h"

#include <sstream>

#include "sdpa_math/error.h"

namespace sdpa_math {

size_t dtype_size(DType d) {
  switch (d) {
    case DType::Float16: case DType::BFloat16: case DType::Int16: return 2;
    case DType::Float32: case DType::Int32: return 4;
    case DType::Float64: case DType::Int64: return 8;
    default: return 1;
  }
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Bool: return "bool";
    case DType::UInt8: return "uint8";
    case DType::Int8: return "int8";
    case DType::Int16: return "int16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::Float8_e4m3fn: return "float8_e4m3fn";
    case DType::Float8_e5m2: return "float8_e5m2";
  }
  return "unknown";
}

std::string device_name(Device d) {
  return d.type == DeviceType::CPU ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

Shape::Shape(std::initializer_list<int64_t> d) {
  if (d.size() > static_cast<size_t>(kMaxDims))
    throw Error(ErrorCode::TooManyDims, "sdpa_math supports at most 8 dims, got " + std::to_string(d.size()));
  for (int64_t v : d) dims[ndim++] = v;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < ndim; ++i) s << (i ? ", " : "") << dims[i];
  s << ")";
  return s.str();
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int d = shape.ndim - 1; d >= 0; --d) {
    if (shape.dims[d] != 1 && strides[d] != expect) return false;
    expect *= shape.dims[d];
  }
  return true;
}

TensorView contiguous_view(void* data, DType dtype, const Shape& shape, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = shape;
  v.device = device;
  int64_t stride = 1;
  for (int i = shape.ndim - 1; i >= 0; --i) {
    v.strides[i] = stride;
    stride *= shape.dims[i];
  }
  return v;
}

TensorView strided_view(void* data, DType dtype, const Shape& shape,
                        std::initializer_list<int64_t> strides, Device device) {
  if (static_cast<int>(strides.size()) != shape.ndim)
    throw Error(ErrorCode::BadOutput, "strided_view: " + std::to_string(strides.size()) +
                                          " strides for a shape of " + std::to_string(shape.ndim) + " dims");
  TensorView v = contiguous_view(data, dtype, shape, device);
  int i = 0;
  for (int64_t s : strides) v.strides[i++] = s;
  return v;
}

const char* error_code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::RankTooLow: return "RankTooLow";
    case ErrorCode::BatchNotBroadcastable: return "BatchNotBroadcastable";
    case ErrorCode::HeadDimMismatch: return "HeadDimMismatch";
    case ErrorCode::SequenceMismatch: return "SequenceMismatch";
    case ErrorCode::GqaHeadsNotDivisible: return "GqaHeadsNotDivisible";
    case ErrorCode::HeadsMismatch: return "HeadsMismatch";
    case ErrorCode::MaskNotBroadcastable: return "MaskNotBroadcastable";
    case ErrorCode::MaskDtype: return "MaskDtype";
    case ErrorCode::CausalWithMask: return "CausalWithMask";
    case ErrorCode::DropoutProbability: return "DropoutProbability";
    case ErrorCode::DropoutMaskShape: return "DropoutMaskShape";
    case ErrorCode::DropoutMaskDtype: return "DropoutMaskDtype";
    case ErrorCode::DeviceMismatch: return "DeviceMismatch";
    case ErrorCode::DtypeMismatch: return "DtypeMismatch";
    case ErrorCode::UnsupportedDtype: return "UnsupportedDtype";
    case ErrorCode::TooManyDims: return "TooManyDims";
    case ErrorCode::BadOutput: return "BadOutput";
    case ErrorCode::BadGradient: return "BadGradient";
    case ErrorCode::BackendUnavailable: return "BackendUnavailable";
    case ErrorCode::CudaFailure: return "CudaFailure";
    case ErrorCode::BadWindow: return "BadWindow";
  }
  return "Unknown";
}

}  // namespace sdpa_math

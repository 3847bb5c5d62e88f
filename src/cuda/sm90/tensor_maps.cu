// Host side of the sm90 kernels' tensor maps (tensor_maps.cuh) and the device check.
#include "tensor_maps.cuh"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "sm90.cuh"

namespace sdpa_math::cuda::sm90 {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, found through the runtime (no link against libcuda).
EncodeTiled encoder() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return EncodeTiled{nullptr};
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

}  // namespace

bool make_map(CUtensorMap* map, const DevProblem& p, const DevOperand& op, int64_t rows, int64_t cols, int box_rows,
              MapCoords& mc) {
  EncodeTiled encode = encoder();
  if (encode == nullptr || op.col != 1 || reinterpret_cast<uintptr_t>(op.data) % 16 != 0) return false;
  cuuint64_t dims[5] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), 1, 1, 1};
  // One row (a decode query): its row stride is 0 (size-1 dims broadcast) and never stepped
  // over; the map still needs a valid one.
  const int64_t row_bytes = op.row == 0 && rows == 1 ? (cols * 2 + 15) / 16 * 16 : op.row * 2;
  cuuint64_t strides[4] = {static_cast<cuuint64_t>(row_bytes), 0, 0, 0};
  mc = MapCoords{};
  int64_t inner = 1;  // product of the lead dims inside d
  for (int d = p.lead_ndim - 1; d >= 0; inner *= p.lead_shape[d--]) {
    if (op.lead[d] == 0 || p.lead_shape[d] == 1) continue;
    if (mc.n == 3) return false;
    const int64_t group = d == p.lead_ndim - 1 ? op.head_group : 1;
    dims[2 + mc.n] = static_cast<cuuint64_t>(p.lead_shape[d] / group);
    strides[1 + mc.n] = static_cast<cuuint64_t>(op.lead[d]) * 2;
    mc.div[mc.n] = inner;
    mc.mod[mc.n] = p.lead_shape[d];
    mc.group[mc.n++] = group;
  }
  cuuint64_t widest = 16;
  for (int k = 0; k < 1 + mc.n; ++k) widest = std::max(widest, strides[k]);
  for (int k = 1 + mc.n; k < 4; ++k) strides[k] = widest;  // dims of size 1: any valid stride
  for (int k = 0; k < 4; ++k)
    if (strides[k] == 0 || strides[k] % 16 != 0 || strides[k] >= (cuuint64_t(1) << 40)) return false;
  for (int k = 0; k < 5; ++k)
    if (dims[k] == 0 || dims[k] > (cuuint64_t(1) << 31)) return false;
  const cuuint32_t box[5] = {64, static_cast<cuuint32_t>(box_rows), 1, 1, 1};
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  const auto type = op.dtype == DType::Float16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, type, 5, op.data, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool make_rows_map_f32(CUtensorMap* map, const float* data, int64_t row_len, int64_t rows, int box) {
  EncodeTiled encode = encoder();
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(row_len) * 4;
  if (encode == nullptr || reinterpret_cast<uintptr_t>(data) % 16 != 0 || row_bytes % 16 != 0 ||
      row_bytes >= (cuuint64_t(1) << 40) || row_len > (int64_t(1) << 31) || rows > (int64_t(1) << 31) || rows < 1)
    return false;
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(row_len), static_cast<cuuint64_t>(rows), 1, 1, 1};
  const cuuint64_t strides[4] = {row_bytes, row_bytes, row_bytes, row_bytes};  // dims of size 1: any valid stride
  const cuuint32_t boxes[5] = {static_cast<cuuint32_t>(box), 1, 1, 1, 1};
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 5, const_cast<float*>(data), dims, strides, boxes, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool device_supported() {
  // SDPA_MATH_SM90=0 turns the Hopper kernels off (the mma.sync path runs instead): for
  // side-by-side measurements and for telling a kernel's fault from its neighbours'.
  static const bool disabled = [] {
    const char* env = std::getenv("SDPA_MATH_SM90");
    return env != nullptr && env[0] == '0';
  }();
  if (disabled) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  // 0 unknown, 1 yes, 2 no; atomic, since ops run from several host threads at once.
  static std::atomic<int> cached[64] = {};
  if (device < 0 || device >= 64) return false;
  int known = cached[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    known = major == 9 && minor == 0 ? 1 : 2;
    cached[device].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

}  // namespace sdpa_math::cuda::sm90

// The entry points: validate once (src/core/validate.cpp), then hand the normalized problem to a
// backend. Float64 inputs on the CPU backend go to the reference, which computes in float64.
#include <cstdint>

#include "../cpu/kernels.h"
#include "../reference/reference.h"
#include "problem.h"
#ifdef SDPA_MATH_WITH_CUDA
#include "../cuda/backend.h"
#endif

namespace sdpa_math {
namespace {

// The backend is in this build and runs tensors on `device`.
void check_backend_device(Backend b, const Device& device) {
  if (!backend_available(b))
    throw Error(ErrorCode::BackendUnavailable, std::string("the ") + backend_name(b) + " backend is not in this build");
  if ((device.type == DeviceType::CUDA) != (b == Backend::Cuda))
    throw Error(ErrorCode::DeviceMismatch, std::string("the ") + backend_name(b) + " backend cannot run tensors on " +
                                               device_name(device));
}

void check_backend(Backend b, const core::Problem& p) {
  check_backend_device(b, p.device);
  const bool wants_cuda = b == Backend::Cuda;
  if (p.rng_device != nullptr && !wants_cuda)
    throw Error(ErrorCode::DeviceMismatch, std::string("the ") + backend_name(b) +
                                               " backend reads the dropout seed from options.seed; rng_device is for CUDA");
}

}  // namespace

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Reference: return "reference";
    case Backend::Cpu: return "cpu";
    case Backend::Cuda: return "cuda";
  }
  return "unknown";
}

bool backend_available(Backend b) {
#ifdef SDPA_MATH_WITH_CUDA
  (void)b;
  return true;
#else
  return b != Backend::Cuda;
#endif
}

int64_t cuda_blas_handles_created() {
#ifdef SDPA_MATH_WITH_CUDA
  return cuda::cublas_handles_created();
#else
  return 0;
#endif
}

ForwardShapes forward_shapes(const ForwardArgs& args) { return core::make_problem(args).shapes; }

void forward(Backend backend, const ForwardArgs& args, const ForwardOutputs& out, const CudaExecution& cuda) {
  const core::Problem p = core::make_problem(args);
  core::check_forward_outputs(p, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::forward(p, out, cuda);
#else
  (void)cuda;
#endif
  if (backend == Backend::Reference || p.dtype == DType::Float64)
    reference::forward(p, out);
  else
    cpu::forward(p, out);
}

void backward(Backend backend, const BackwardArgs& args, const BackwardOutputs& out, const CudaExecution& cuda) {
  const core::Problem p = core::make_problem(args.forward);
  core::check_backward(p, args, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::backward(p, args, out, cuda);
#else
  (void)cuda;
#endif
  if (backend == Backend::Reference || p.dtype == DType::Float64)
    reference::backward(p, args, out);
  else
    cpu::backward(p, args, out);
}

void forward_stats(Backend backend, const ForwardArgs& args, const StatsOutputs& out, const CudaExecution& cuda) {
  const core::Problem p = core::make_problem(args);
  core::check_stats_outputs(p, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::forward_stats(p, out, cuda);
#else
  (void)cuda;
#endif
  if (backend == Backend::Reference || p.dtype == DType::Float64)
    reference::forward_stats(p, out);
  else
    cpu::forward_stats(p, out);
}

namespace {
#ifdef SDPA_MATH_WITH_CUDA
// Outputs as a caller allocates them fresh: contiguous, at an address aligned as an allocation
// is. Only their layout is asked about; the placeholder address is never dereferenced.
StatsOutputs fresh_stats_outputs(const core::Problem& p, bool col_sum, bool row_entropy, int64_t rows_count) {
  void* const placeholder = reinterpret_cast<void*>(std::uintptr_t{256});
  const DType stat = p.dtype == DType::Float64 ? DType::Float64 : DType::Float32;
  Shape cols = p.shapes.logsumexp, window = p.shapes.attn_probs;
  cols.dims[cols.ndim - 1] = p.S;
  window.dims[window.ndim - 2] = rows_count;
  StatsOutputs out{contiguous_view(placeholder, p.dtype, p.shapes.output, p.device),
                   contiguous_view(placeholder, stat, p.shapes.logsumexp, p.device)};
  if (col_sum) out.col_sum = contiguous_view(placeholder, stat, cols, p.device);
  if (row_entropy) out.row_entropy = contiguous_view(placeholder, stat, p.shapes.logsumexp, p.device);
  if (rows_count > 0) out.rows = contiguous_view(placeholder, p.dtype, window, p.device);
  return out;
}
#endif

Route cpu_route(Backend backend, DType dtype) {
  if (backend == Backend::Reference) return {"reference", {}};
  if (dtype == DType::Float64) return {"reference", {{"cpu", "float64 inputs: the float64 reference computes them"}}};
  return {"cpu", {}};
}
}  // namespace

bool forward_stats_has_kernel(Backend backend, const ForwardArgs& args, bool col_sum, bool row_entropy, int64_t rows_count) {
  const core::Problem p = core::make_problem(args);
  check_backend(backend, p);
  if (backend != Backend::Cuda) return true;
#ifdef SDPA_MATH_WITH_CUDA
  return cuda::explain_stats(p, fresh_stats_outputs(p, col_sum, row_entropy, rows_count)).kernel != "none";
#else
  (void)col_sum;
  (void)row_entropy;
  (void)rows_count;
  return false;
#endif
}

Route explain_forward(Backend backend, const ForwardArgs& args, const ForwardOutputs& out) {
  const core::Problem p = core::make_problem(args);
  core::check_forward_outputs(p, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::explain_forward(p, out);
#endif
  return cpu_route(backend, p.dtype);
}

Route explain_backward(Backend backend, const BackwardArgs& args, const BackwardOutputs& out) {
  const core::Problem p = core::make_problem(args.forward);
  core::check_backward(p, args, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::explain_backward(p, args, out);
#endif
  return cpu_route(backend, p.dtype);
}

Route explain_stats(Backend backend, const ForwardArgs& args, const StatsOutputs& out) {
  const core::Problem p = core::make_problem(args);
  core::check_stats_outputs(p, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::explain_stats(p, out);
#endif
  return cpu_route(backend, p.dtype);
}

void kl_rows(Backend backend, const KlRowsArgs& args, const TensorView& kl, const TensorView& row_sum,
             const CudaExecution& cuda) {
  core::check_kl_rows(args, kl, row_sum);
  check_backend_device(backend, args.reference.device);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::kl_rows(args, kl, row_sum, cuda);
#else
  (void)cuda;
#endif
  reference::kl_rows(args, kl, row_sum);
}

void softmax_rows(Backend backend, const SoftmaxRowsArgs& args, const TensorView& out, const CudaExecution& cuda) {
  core::check_softmax_rows(args, out);
  check_backend_device(backend, args.logits.device);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::softmax_rows(args, out, cuda);
#else
  (void)cuda;
#endif
  reference::softmax_rows(args, out);
}

void kl_forward(Backend backend, const KlForwardArgs& args, const TensorView& kl, const TensorView& row_sum,
                const CudaExecution& cuda) {
  const core::Problem p = core::make_problem(args.forward);
  core::check_kl_forward(p, args, &kl, &row_sum);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::kl_forward(p, args, kl, row_sum, cuda);
#else
  (void)cuda;
#endif
  reference::kl_forward(p, args, kl, row_sum);  // the CPU backend too: exact and slow, as kl_backward's
}

bool kl_forward_has_kernel(Backend backend, const KlForwardArgs& args) {
  const core::Problem p = core::make_problem(args.forward);
  core::check_kl_forward(p, args, nullptr, nullptr);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::kl_forward_applies(p, args);
#endif
  return true;
}

void kl_backward(Backend backend, const KlBackwardArgs& args, const BackwardOutputs& out, const CudaExecution& cuda) {
  const core::Problem p = core::make_problem(args.forward);
  core::check_kl_backward(p, args, out);
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::kl_backward(p, args, out, cuda);
#else
  (void)cuda;
#endif
  // The CPU backend runs the float64 reference too: exact and slow (attention_stats has its own
  // CPU path for kl_to; this one is for tests and small problems).
  reference::kl_backward(p, args, out);
}

bool kl_backward_has_kernel(Backend backend, const KlBackwardArgs& args) {
  const core::Problem p = core::make_problem(args.forward);
  core::check_kl_backward(p, args, {});
  check_backend(backend, p);
#ifdef SDPA_MATH_WITH_CUDA
  if (backend == Backend::Cuda) return cuda::kl_backward_applies(p, args);
#endif
  return true;
}

}  // namespace sdpa_math

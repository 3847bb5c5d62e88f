// The CUDA backend's host side: the problem as kernels see it, scratch memory from the caller's
// allocator, running the plan of each call (route.h chooses the path), and the gradients' final
// conversion from dense fp32/fp64 accumulators to the caller's (strided,
// any dtype) buffers.
#include "backend.h"

#include <cuda_runtime.h>

#include <type_traits>

#include "decode.cuh"
#include "device_problem.cuh"
#include "gemm_path.cuh"
#include "generic.cuh"
#include "launch.cuh"
#include "route.h"
#include "tensor_core.cuh"
#ifdef SDPA_MATH_WITH_SM90
#include "sm90/sm90.cuh"
#endif

namespace sdpa_math::cuda {
namespace {

DevOperand to_device(const core::Operand& op) {
  DevOperand d;
  d.data = const_cast<char*>(op.data);
  d.dtype = op.dtype;
  d.head_group = op.head_group;
  for (int i = 0; i < kMaxDims; ++i) {
    d.lead[i] = op.lead_strides[i];
    d.dense_lead[i] = op.dense_lead_strides[i];
  }
  d.row = op.row_stride;
  d.col = op.col_stride;
  d.dense_row = op.dense_row_stride;
  d.dense_col = op.dense_col_stride;
  return d;
}

DevProblem to_device(const core::Problem& p) {
  DevProblem d;
  d.lead_ndim = p.lead_ndim;
  for (int i = 0; i < kMaxDims; ++i) d.lead_shape[i] = p.lead_shape[i];
  d.num_lead = p.num_lead;
  d.L = p.L;
  d.S = p.S;
  d.E = p.E;
  d.Ev = p.Ev;
  d.q = to_device(p.query);
  d.k = to_device(p.key);
  d.v = to_device(p.value);
  if (p.attn_mask.present()) d.mask = to_device(p.attn_mask);
  if (p.dropout_mask.present() && p.dropout == core::DropoutMode::ExplicitMask) d.dmask = to_device(p.dropout_mask);
  d.mask_is_bool = p.mask_is_bool;
  d.causal = p.is_causal;
  d.dropout = p.dropout == core::DropoutMode::None ? Dropout::None
              : p.dropout == core::DropoutMode::ExplicitMask ? Dropout::ExplicitMask : Dropout::Random;
  d.drop_threshold = dropout_threshold(p.dropout_p);
  d.keep_scale = p.keep_scale();
  d.scale = p.scale;
  d.seed = p.seed;
  d.offset = p.offset;
  d.rng = p.rng_device;
  return d;
}

DevOperand output_to_device(const core::Problem& p, const TensorView& v, bool has_cols) {
  return to_device(core::output_operand(p, v, has_cols));
}

// Scratch memory of one call, from the caller's allocator (or the stream-ordered one).
class Scratch {
 public:
  Scratch(const CudaExecution& ex, cudaStream_t stream) : ex_(ex), stream_(stream) {}
  ~Scratch() {
    for (void* ptr : blocks_) {
      if (ex_.release) ex_.release(ptr);
      else cudaFreeAsync(ptr, stream_);
    }
  }
  template <typename T>
  T* uninitialized(int64_t n) {
    if (n <= 0) return nullptr;
    void* ptr = nullptr;
    if (ex_.allocate) {
      ptr = ex_.allocate(sizeof(T) * static_cast<size_t>(n));
      if (ptr) blocks_.push_back(ptr);  // released by the destructor, also when refused below
      // Kernels read scratch 16 bytes at a time (decode's workspace, for one).
      if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
        throw Error(ErrorCode::CudaFailure, "CudaExecution::allocate returned " +
                                                std::string(ptr ? "memory not aligned to 16 bytes" : "no memory") +
                                                " for " + std::to_string(sizeof(T) * static_cast<size_t>(n)) + " bytes of scratch");
    } else {
      check_cuda(cudaMallocAsync(&ptr, sizeof(T) * static_cast<size_t>(n), stream_), "allocating CUDA scratch memory");
      blocks_.push_back(ptr);
    }
    return static_cast<T*>(ptr);
  }
  template <typename T>
  T* zeros(int64_t n) {
    T* ptr = uninitialized<T>(n);
    if (ptr) check_cuda(cudaMemsetAsync(ptr, 0, sizeof(T) * static_cast<size_t>(n), stream_), "clearing CUDA scratch memory");
    return ptr;
  }

 private:
  const CudaExecution& ex_;
  cudaStream_t stream_;
  std::vector<void*> blocks_;
};

// A destination view of a gradient: dense accumulator element n goes to the strided element of
// the same (row-major) coordinates.
struct ViewDesc {
  char* data = nullptr;
  DType dtype = DType::Float32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  int64_t numel = 0;
  bool dense = false;  // contiguous: element n is at offset n
};

template <typename Acc>
__global__ void dense_to_view(const Acc* __restrict__ src, ViewDesc dst) {
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < dst.numel;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off = n;
    if (!dst.dense) {  // 64-bit division per dim: only for strided gradients
      int64_t rest = n;
      off = 0;
      for (int d = dst.ndim - 1; d >= 0; --d) {
        off += (rest % dst.shape[d]) * dst.strides[d];
        rest /= dst.shape[d];
      }
    }
    store_elem<Acc>(dst.dtype, dst.data, off, src[n]);
  }
}

template <typename Acc>
void write_gradient(const Acc* dense, const std::optional<TensorView>& view, cudaStream_t stream) {
  if (!view || view->numel() == 0) return;
  ViewDesc d;
  d.data = static_cast<char*>(view->data);
  d.dtype = view->dtype;
  d.ndim = view->ndim();
  for (int i = 0; i < d.ndim; ++i) {
    d.shape[i] = view->shape.dims[i];
    d.strides[i] = view->strides[i];
  }
  d.numel = view->numel();
  d.dense = view->is_contiguous();
  const int64_t blocks = std::min<int64_t>((d.numel + 255) / 256, 65535);
  dense_to_view<Acc><<<grid_x(blocks, "gradient conversion"), 256, 0, stream>>>(dense, d);
  check_launch("gradient conversion");
}

// The paths that accumulate into dense fp32/fp64 buffers (decode, mma.sync, generic, and a problem
// with no query rows), then convert them into the caller's gradients.
template <typename Acc>
void backward_accumulated(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out, BackwardPath path,
                          Scratch& scratch, cudaStream_t stream) {
  BackwardBuffers<Acc> g;
  // Accumulators exist (zeroed) for every requested gradient, even when no element adds to it.
  auto buffer_for = [&](const std::optional<TensorView>& v) -> Acc* {
    return v ? scratch.zeros<Acc>(std::max<int64_t>(v->numel(), 1)) : nullptr;
  };
  // Except dK and dV where the tensor-core kernel can store them itself: the gradient is
  // contiguous in the inputs' dtype and one CTA holds the whole sum of each row — no two heads
  // share a key row (no GQA, no broadcast), or the decode kernel takes each whole GQA group in
  // one CTA.
  const bool tensor_core = path == BackwardPath::Decode || path == BackwardPath::Sm80;
  const int64_t heads_per_cta = path == BackwardPath::Decode ? decode_heads_per_cta(dp) : 1;
  auto stored_directly = [&](const std::optional<TensorView>& v, const core::Operand& op, int64_t width) {
    return tensor_core && v && v->dtype == p.dtype && v->is_contiguous() &&
           op.own_shape.numel() * heads_per_cta == p.num_lead * p.S * width;
  };
  g.dq = buffer_for(out.grad_query);
  if (stored_directly(out.grad_key, p.key, p.E)) g.dk_out = out.grad_key->data;
  else g.dk = buffer_for(out.grad_key);
  if (stored_directly(out.grad_value, p.value, p.Ev)) g.dv_out = out.grad_value->data;
  else g.dv = buffer_for(out.grad_value);
  g.dmask = buffer_for(out.grad_attn_mask);
  g.delta = scratch.zeros<Acc>(std::max<int64_t>(p.num_lead * p.L, 1));
  if constexpr (std::is_same_v<Acc, float>) {
    if (tensor_core) tensor_core_delta(dp, g.delta, stream);
    if (path == BackwardPath::Decode) decode_backward_run(dp, g, stream);
    if (path == BackwardPath::Sm80) tensor_core_backward(dp, g, stream);
  }
  if (path == BackwardPath::Generic) generic_backward<Acc>(dp, g, stream);
  write_gradient<Acc>(g.dq, out.grad_query, stream);
  if (g.dk) write_gradient<Acc>(g.dk, out.grad_key, stream);
  if (g.dv) write_gradient<Acc>(g.dv, out.grad_value, stream);
  write_gradient<Acc>(g.dmask, out.grad_attn_mask, stream);
}

void run_backward(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out, const BackwardPlan& plan,
                  const CudaExecution& ex, cudaStream_t stream) {
  Scratch scratch(ex, stream);
  switch (plan.path) {
    case BackwardPath::CublasFp32:
      gemm_backward(p, dp, out, [&](int64_t n) { return scratch.uninitialized<float>(n); }, stream);
      return;
    case BackwardPath::Sm90: {
#ifdef SDPA_MATH_WITH_SM90
      auto data = [](const std::optional<TensorView>& v) -> void* { return v && v->numel() > 0 ? v->data : nullptr; };
      const sm90::BackwardTargets targets{data(out.grad_query), data(out.grad_key), data(out.grad_value)};
      sm90::backward(dp, *plan.sm90, targets, scratch.zeros<float>(sm90::backward_workspace_floats(dp)), stream);
#endif
      return;
    }
    default:
      if (p.dtype == DType::Float64) backward_accumulated<double>(p, dp, out, plan.path, scratch, stream);
      else backward_accumulated<float>(p, dp, out, plan.path, scratch, stream);
  }
}

DevProblem forward_problem(const core::Problem& p, const ForwardOutputs& out) {
  DevProblem dp = to_device(p);
  dp.out = output_to_device(p, out.output, true);
  dp.probs = output_to_device(p, out.attn_probs, true);
  dp.lse = output_to_device(p, out.logsumexp, false);
  return dp;
}

DevProblem backward_problem(const core::Problem& p, const BackwardArgs& args) {
  DevProblem dp = to_device(p);
  dp.lse = output_to_device(p, args.logsumexp, false);
  if (args.grad_output) dp.grad_out = output_to_device(p, *args.grad_output, true);
  if (args.grad_probs) dp.grad_probs = output_to_device(p, *args.grad_probs, true);
  if (args.output) dp.out = output_to_device(p, *args.output, true);
  if (args.attn_probs) dp.probs = output_to_device(p, *args.attn_probs, true);
  return dp;
}

template <typename Plan>
Route route_of(const Plan& plan) {
  Route r;
  r.kernel = path_name(plan.path);
  for (const Declined& d : plan.declined) r.declined.push_back({d.path, d.why});
  return r;
}

}  // namespace

void forward(const core::Problem& p, const ForwardOutputs& out, const CudaExecution& ex) {
  DeviceGuard guard(p.device.index);
  auto stream = static_cast<cudaStream_t>(ex.stream);
  const DevProblem dp = forward_problem(p, out);
  const ForwardPlan plan = plan_forward(dp);
  Scratch scratch(ex, stream);
  switch (plan.path) {
    case ForwardPath::Empty: return;
    case ForwardPath::Decode:  // up to 4 query rows: split over keys
      decode_forward(dp, scratch.uninitialized<float>(decode_workspace_floats(dp)), stream);
      return;
    case ForwardPath::Sm90:  // Hopper: wgmma + TMA
#ifdef SDPA_MATH_WITH_SM90
      sm90::forward(dp, *plan.sm90, scratch.zeros<uint32_t>(sm90::forward_workspace_words(dp)), stream);
#endif
      return;
    case ForwardPath::Sm80: tensor_core_forward(dp, stream); return;  // fp16/bf16 on mma.sync (sm_80+)
    case ForwardPath::CublasFp32: gemm_forward(dp, stream); return;
    case ForwardPath::Generic:
      if (p.dtype == DType::Float64) generic_forward<double>(dp, stream);
      else generic_forward<float>(dp, stream);
      return;
  }
}

Route explain_forward(const core::Problem& p, const ForwardOutputs& out) {
  DeviceGuard guard(p.device.index);
  return route_of(plan_forward(forward_problem(p, out)));
}

namespace {
StatsTargets stats_targets(const core::Problem& p, const StatsOutputs& out) {
  StatsTargets t;
  if (out.col_sum) t.col_sum = output_to_device(p, *out.col_sum, false);
  if (out.row_entropy) t.entropy = output_to_device(p, *out.row_entropy, false);
  if (out.rows) {
    t.rows = output_to_device(p, *out.rows, true);
    t.rows_first = out.rows_first;
    t.rows_step = out.rows_step;
    t.rows_count = out.rows->shape.dims[out.rows->shape.ndim - 2];
  }
  return t;
}
}  // namespace

namespace {
StatsPlan stats_plan(const core::Problem& p, const StatsOutputs& out, DevProblem& dp, StatsTargets& t) {
  dp = to_device(p);
  dp.out = output_to_device(p, out.output, true);
  dp.lse = output_to_device(p, out.logsumexp, false);
  t = stats_targets(p, out);
  return plan_stats(dp, t);
}
}  // namespace

Route explain_stats(const core::Problem& p, const StatsOutputs& out) {
  DeviceGuard guard(p.device.index);
  DevProblem dp;
  StatsTargets t;
  return route_of(stats_plan(p, out, dp, t));
}

void forward_stats(const core::Problem& p, const StatsOutputs& out, const CudaExecution& ex) {
  DeviceGuard guard(p.device.index);
  auto stream = static_cast<cudaStream_t>(ex.stream);
  DevProblem dp;
  StatsTargets t;
  const StatsPlan plan = stats_plan(p, out, dp, t);
  Scratch scratch(ex, stream);
  switch (plan.path) {
    case StatsPath::Decode:  // up to 4 query rows: the decode kernels, P not written
      decode_forward(dp, scratch.uninitialized<float>(decode_workspace_floats(dp)), stream, &t);
      return;
    case StatsPath::Sm90:
#ifdef SDPA_MATH_WITH_SM90
      sm90::forward_stats(dp, *plan.sm90, t, scratch.uninitialized<float>(sm90::stats_workspace_floats(dp, t)), stream);
#endif
      return;
    case StatsPath::None: break;
  }
  std::string why;
  for (const Declined& d : plan.declined) why += std::string(why.empty() ? "" : "; ") + d.path + ": " + d.why;
  throw Error(ErrorCode::BackendUnavailable, "attention statistics without P: no CUDA kernel takes this problem (" + why +
                                                 ") " + stats_kernel_requirements +
                                                 " (sdpa_math.stats.attention_stats computes them from chunks of P instead)");
}

void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out, const CudaExecution& ex) {
  DeviceGuard guard(p.device.index);
  const DevProblem dp = backward_problem(p, args);
  run_backward(p, dp, out, plan_backward(p, dp, out), ex, static_cast<cudaStream_t>(ex.stream));
}

Route explain_backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out) {
  DeviceGuard guard(p.device.index);
  const DevProblem dp = backward_problem(p, args);
  return route_of(plan_backward(p, dp, out));
}

#ifdef SDPA_MATH_WITH_SM90
namespace {
sm90::KlInputs kl_inputs(const core::Problem& p, const KlBackwardArgs& args) {
  return {output_to_device(p, args.reference, true), output_to_device(p, args.ref_row_sum, false),
          output_to_device(p, args.grad_kl, false)};
}
}  // namespace
#endif

bool kl_backward_applies(const core::Problem& p, const KlBackwardArgs& args) {
#ifdef SDPA_MATH_WITH_SM90
  DeviceGuard guard(p.device.index);
  DevProblem dp = to_device(p);
  dp.lse = output_to_device(p, args.logsumexp, false);
  return sm90::kl_backward_applies(dp, kl_inputs(p, args));
#else
  (void)p;
  (void)args;
  return false;
#endif
}

void kl_backward(const core::Problem& p, const KlBackwardArgs& args, const BackwardOutputs& out, const CudaExecution& ex) {
  const char* why = "this build has no Hopper kernels";
#ifdef SDPA_MATH_WITH_SM90
  DeviceGuard guard(p.device.index);
  auto stream = static_cast<cudaStream_t>(ex.stream);
  DevProblem dp = to_device(p);
  dp.lse = output_to_device(p, args.logsumexp, false);
  const sm90::KlInputs in = kl_inputs(p, args);
  // The kernel stores the gradients itself: contiguous in the inputs' dtype, as the binding
  // allocates them.
  auto direct = [&](const std::optional<TensorView>& v) { return !v || (v->dtype == p.dtype && v->is_contiguous()); };
  if (!direct(out.grad_query) || !direct(out.grad_key)) {
    why = "the gradients are not contiguous in the inputs' dtype";
  } else if (const char* declined = sm90::kl_conditions_decline(dp, in)) {
    why = declined;
  } else {
    auto data = [](const std::optional<TensorView>& v) -> void* { return v && v->numel() > 0 ? v->data : nullptr; };
    const sm90::BackwardTargets targets{data(out.grad_query), data(out.grad_key), nullptr};
    Scratch scratch(ex, stream);
    if (sm90::kl_backward(dp, in, targets, scratch.zeros<float>(sm90::kl_backward_workspace_floats(dp)), stream)) return;
    why = "the TMA unit cannot address an operand or the workspace";
  }
#else
  (void)p;
  (void)args;
  (void)out;
  (void)ex;
#endif
  throw Error(ErrorCode::BackendUnavailable,
              std::string("kl_backward: no CUDA kernel takes this problem, ") + why +
                  " (it needs a Hopper GPU and a build with its kernels; float16 or bfloat16 inputs without dropout or "
                  "a mask; a reference map in the inputs' dtype with 4-byte aligned rows (an even key count); head size "
                  "E a multiple of 8 up to 128; q and k not broadcast over batch dims; contiguous gradients in the "
                  "inputs' dtype; sdpa_math.stats.attention_stats computes kl_to's gradient from chunks of P instead)");
}

bool kl_forward_applies(const core::Problem& p, const KlForwardArgs& args) {
#ifdef SDPA_MATH_WITH_SM90
  DeviceGuard guard(p.device.index);
  DevProblem dp = to_device(p);
  dp.lse = output_to_device(p, args.logsumexp, false);
  sm90::KlRowsOut out;  // as kl_forward's callers allocate them
  out.kl.dtype = out.row_sum.dtype = p.dtype == DType::Float64 ? DType::Float64 : DType::Float32;
  return sm90::kl_forward_declines(dp, output_to_device(p, args.reference, true), out) == nullptr;
#else
  (void)p;
  (void)args;
  return false;
#endif
}

void kl_forward(const core::Problem& p, const KlForwardArgs& args, const TensorView& kl, const TensorView& row_sum,
                const CudaExecution& ex) {
  if (kl.numel() == 0) return;  // no rows (an S = 0 problem has rows, and is declined below)
  const char* why = "this build has no Hopper kernels";
#ifdef SDPA_MATH_WITH_SM90
  DeviceGuard guard(p.device.index);
  DevProblem dp = to_device(p);
  dp.lse = output_to_device(p, args.logsumexp, false);
  const DevOperand ref = output_to_device(p, args.reference, true);
  const sm90::KlRowsOut out{output_to_device(p, kl, false), output_to_device(p, row_sum, false)};
  if (const char* declined = sm90::kl_forward_conditions_decline(dp, ref, out)) {
    why = declined;
  } else {
    if (sm90::kl_forward(dp, ref, out, static_cast<cudaStream_t>(ex.stream))) return;
    why = sm90::kKlForwardTmaDecline;
  }
#else
  (void)p;
  (void)args;
  (void)kl;
  (void)row_sum;
  (void)ex;
#endif
  throw Error(ErrorCode::BackendUnavailable,
              std::string("kl_forward: no CUDA kernel takes this problem, ") + why +
                  " (it needs a Hopper GPU and a build with its kernels; float16 or bfloat16 inputs without dropout or "
                  "a mask; a reference map in the inputs' dtype; head size E a multiple of 8 up to 128; rows of q, k "
                  "and the reference 16-byte aligned (S a multiple of 8); float32 outputs; torch.ops.sdpa_math.kl_rows "
                  "with u = r K covers the rest)");
}

}  // namespace sdpa_math::cuda

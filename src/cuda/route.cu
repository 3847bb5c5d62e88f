// The CUDA plans (route.h): the order of the paths and the questions asked of each. A path's
// question is its *_declines function, next to its kernels; this file only orders them.
#include "route.h"

#include "decode.cuh"
#include "gemm_path.cuh"
#include "tensor_core.cuh"
#ifdef SDPA_MATH_WITH_SM90
#include "sm90/sm90.cuh"
#endif

namespace sdpa_math::cuda {
namespace {
#ifndef SDPA_MATH_WITH_SM90
constexpr const char* kNoSm90 = "this build has no sm_90a kernels (built without nvcc for 90a)";
#endif

// Records a path's answer; true when it takes the problem.
bool takes(std::vector<Declined>& declined, const char* path, const char* why) {
  if (why == nullptr) return true;
  declined.push_back({path, why});
  return false;
}

#ifdef SDPA_MATH_WITH_SM90
// The Hopper backward stores the gradients itself, so they must be contiguous in the inputs'
// dtype (as the binding allocates them) and no mask gradient may be asked for; then its own
// question.
const char* sm90_backward_declines(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out,
                                   std::shared_ptr<const sm90::BackwardPrepared>* prepared) {
  auto direct = [&](const std::optional<TensorView>& v) { return !v || (v->dtype == p.dtype && v->is_contiguous()); };
  if (out.grad_attn_mask) return "a mask gradient is asked for";
  if (!direct(out.grad_query) || !direct(out.grad_key) || !direct(out.grad_value))
    return "a requested gradient not contiguous in the inputs' dtype";
  return sm90::backward_declines(dp, prepared);
}
#endif
}  // namespace

const char* path_name(ForwardPath p) {
  switch (p) {
    case ForwardPath::Empty: return "none";
    case ForwardPath::Decode: return "decode";
    case ForwardPath::Sm90: return "sm90";
    case ForwardPath::Sm80: return "sm80";
    case ForwardPath::CublasFp32: return "cublas-fp32";
    case ForwardPath::Generic: return "generic";
  }
  return "unknown";
}

const char* path_name(BackwardPath p) {
  switch (p) {
    case BackwardPath::Empty: return "none";
    case BackwardPath::CublasFp32: return "cublas-fp32";
    case BackwardPath::Decode: return "decode";
    case BackwardPath::Sm90: return "sm90";
    case BackwardPath::Sm80: return "sm80";
    case BackwardPath::Generic: return "generic";
  }
  return "unknown";
}

const char* path_name(StatsPath p) {
  switch (p) {
    case StatsPath::Decode: return "decode";
    case StatsPath::Sm90: return "sm90";
    case StatsPath::None: return "none";
  }
  return "unknown";
}

ForwardPlan plan_forward(const DevProblem& dp) {
  ForwardPlan plan;
  auto& d = plan.declined;
  if (dp.num_lead * dp.L == 0) plan.path = ForwardPath::Empty;
  else if (takes(d, "decode", decode_declines(dp))) plan.path = ForwardPath::Decode;
#ifdef SDPA_MATH_WITH_SM90
  else if (takes(d, "sm90", sm90::forward_declines(dp, &plan.sm90))) plan.path = ForwardPath::Sm90;
#else
  else if (takes(d, "sm90", kNoSm90)) plan.path = ForwardPath::Sm90;
#endif
  else if (takes(d, "sm80", tensor_core_forward_declines(dp))) plan.path = ForwardPath::Sm80;
  else if (takes(d, "cublas-fp32", gemm_forward_declines(dp))) plan.path = ForwardPath::CublasFp32;
  else plan.path = ForwardPath::Generic;  // takes every problem
  return plan;
}

BackwardPlan plan_backward(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out) {
  BackwardPlan plan;
  auto& d = plan.declined;
  if (dp.num_lead * dp.L == 0) plan.path = BackwardPath::Empty;
  else if (takes(d, "cublas-fp32", gemm_backward_declines(p, dp, out))) plan.path = BackwardPath::CublasFp32;
  // The decode and mma.sync backwards keep dQ and the mask gradient in fp32 accumulators: any
  // gradient layout.
  else if (takes(d, "decode", decode_backward_declines(dp))) plan.path = BackwardPath::Decode;
#ifdef SDPA_MATH_WITH_SM90
  else if (takes(d, "sm90", sm90_backward_declines(p, dp, out, &plan.sm90))) plan.path = BackwardPath::Sm90;
#else
  else if (takes(d, "sm90", kNoSm90)) plan.path = BackwardPath::Sm90;
#endif
  else if (takes(d, "sm80", tensor_core_backward_declines(dp))) plan.path = BackwardPath::Sm80;
  else plan.path = BackwardPath::Generic;
  return plan;
}

StatsPlan plan_stats(const DevProblem& dp, const StatsTargets& t) {
  StatsPlan plan;
  auto& d = plan.declined;
  if (takes(d, "decode", decode_stats_declines(dp, t))) plan.path = StatsPath::Decode;
#ifdef SDPA_MATH_WITH_SM90
  else if (takes(d, "sm90", sm90::stats_declines(dp, t, &plan.sm90))) plan.path = StatsPath::Sm90;
#else
  else if (takes(d, "sm90", kNoSm90)) plan.path = StatsPath::Sm90;
#endif
  else plan.path = StatsPath::None;
  return plan;
}

}  // namespace sdpa_math::cuda

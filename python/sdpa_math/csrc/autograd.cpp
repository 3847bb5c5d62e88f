// Autograd of the sdpa_math ops, in C++: gradients through both outputs O and P of
// sdpa_math::forward, and an error (not silent zeros) for a second derivative through
// sdpa_math::backward.
//
// Why C++: a forward with autograd through torch.library's Python registration spent several
// times a small kernel's own time on the host in Python (argument defaults, the context,
// redispatch), and the backward as much again; at the sizes of a training step the host, not
// the GPU, set the pace (bench/host_overhead.py measures it). The kernels below autograd are reached
// through the dispatcher, so fake tensors (torch.compile) and every backend take the same path.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

constexpr const char* kDoubleBackward =
    "sdpa_math: double backward is not supported: the gradients of sdpa_math.attention (and of the aten op "
    "under sdpa_math.override()) are not differentiable. This is reached by differentiating gradients taken "
    "with create_graph=True (gradient penalties, Hessian-vector products, gradgradcheck). Use PyTorch's own "
    "math op there (sdpa_math.disable(), or outside the override() block).";

using ForwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool,
    const std::optional<at::Tensor>&, std::optional<double>, bool, const std::optional<at::Tensor>&);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, bool, const std::optional<at::Tensor>&, std::optional<double>, bool,
    const std::optional<at::Tensor>&, std::array<bool, 4>);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("sdpa_math::forward", "").typed<ForwardSig>();
  return op;
}
const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("sdpa_math::backward", "").typed<BackwardSig>();
  return op;
}

// An absent optional tensor crosses Function::apply as this one shared empty tensor: autograd
// records the device and dtype of every tensor argument, which an undefined tensor does not have.
// Made once, outside inference mode (so that any call can save it for backward), and straight
// from the CPU allocator rather than through the dispatcher: if the first call is traced by
// torch.compile, a dispatched empty() would be a fake tensor, kept for every later call.
const at::Tensor& absent() {
  static const at::Tensor none = [] {
    c10::InferenceMode normal(false);
    return at::Tensor(at::detail::empty_cpu({0}, at::kFloat));
  }();
  return none;
}
bool is_absent(const at::Tensor& t) { return !t.defined() || t.unsafeGetTensorImpl() == absent().unsafeGetTensorImpl(); }
std::optional<at::Tensor> opt(const at::Tensor& t) { return is_absent(t) ? std::nullopt : std::optional<at::Tensor>(t); }
at::Tensor undef(const std::optional<at::Tensor>& t) { return t && t->defined() ? *t : absent(); }

// sdpa_math::backward as a function whose own derivative is an error. Outside create_graph=True
// (grad mode off in a backward) nothing is recorded; with it, the error comes only when a second
// derivative actually reaches these gradients, so create_graph=True on a graph whose second
// derivative avoids attention still works.
struct Gradients : Function<Gradients> {
  static variable_list forward(AutogradContext*, const at::Tensor& g_out, const at::Tensor& g_probs, const at::Tensor& q,
                               const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, const at::Tensor& lse,
                               const at::Tensor& out, const at::Tensor& probs, const at::Tensor& dropout_mask,
                               const at::Tensor& rng, double dropout_p, bool is_causal, std::optional<double> scale,
                               bool enable_gqa, std::array<bool, 4> wanted) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [gq, gk, gv, gm] = backward_op().call(opt(g_out), opt(g_probs), q, k, v, opt(mask), lse, opt(out), opt(probs),
                                               dropout_p, is_causal, opt(dropout_mask), scale, enable_gqa, opt(rng), wanted);
    return {gq, gk, gv, gm};
  }
  static variable_list backward(AutogradContext*, variable_list) { TORCH_CHECK(false, kDoubleBackward); }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_autograd(
    const std::optional<at::Tensor>& g_out, const std::optional<at::Tensor>& g_probs, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask, const at::Tensor& lse,
    const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& probs, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& dropout_mask, std::optional<double> scale, bool enable_gqa,
    const std::optional<at::Tensor>& rng, std::array<bool, 4> wanted) {
  auto g = Gradients::apply(undef(g_out), undef(g_probs), q, k, v, undef(mask), lse, undef(out), undef(probs),
                            undef(dropout_mask), undef(rng), dropout_p, is_causal, scale, enable_gqa, wanted);
  return {g[0], g[1], g[2], g[3]};
}

// O, P and lse with gradients into query, key, value and a float mask. The backward reads the
// saved O and P (the CUDA backward takes rowsum(dA ∘ A) as rowsum(dO ∘ O) + rowsum(dP ∘ P) from
// them; PyTorch's math op keeps P for its backward too) and the same (seed, offset), so random
// dropout replays its mask. An output that did not reach the loss gets no gradient (not zeros):
// no L x S buffer of zeros for dP when only O was used.
struct Attention : Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& mask, const at::Tensor& dropout_mask, const at::Tensor& rng,
                               double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, probs, lse] = forward_op().call(q, k, v, opt(mask), dropout_p, is_causal, opt(dropout_mask), scale,
                                               enable_gqa, opt(rng));
    ctx->save_for_backward({q, k, v, mask, dropout_mask, rng, lse, out, probs});
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["enable_gqa"] = enable_gqa;
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {out, probs, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list none(10);  // one per argument of forward
    const at::Tensor& g_out = grads[0];
    const at::Tensor& g_probs = grads[1];
    if (!g_out.defined() && !g_probs.defined()) return none;
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &q = s[0], &k = s[1], &v = s[2], &mask = s[3], &dropout_mask = s[4], &rng = s[5], &lse = s[6],
                     &out = s[7], &probs = s[8];
    const bool mask_grad = ctx->needs_input_grad(3) && !is_absent(mask) && mask.is_floating_point();
    const std::array<bool, 4> wanted = {ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2),
                                        mask_grad};
    // Through the dispatcher at the autograd level: sdpa_math::backward's own autograd kernel
    // (backward_autograd) records the double-backward error under create_graph=True.
    auto [gq, gk, gv, gm] =
        backward_op().call(opt(g_out), opt(g_probs), q, k, v, opt(mask), lse, opt(out), opt(probs),
                           ctx->saved_data["dropout_p"].toDouble(), ctx->saved_data["is_causal"].toBool(),
                           opt(dropout_mask), ctx->saved_data["scale"].toOptional<double>(),
                           ctx->saved_data["enable_gqa"].toBool(), opt(rng), wanted);
    none[0] = wanted[0] ? gq : at::Tensor();
    none[1] = wanted[1] ? gk : at::Tensor();
    none[2] = wanted[2] ? gv : at::Tensor();
    none[3] = wanted[3] ? gm : at::Tensor();
    return none;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
    double dropout_p, bool is_causal, const std::optional<at::Tensor>& dropout_mask, std::optional<double> scale,
    bool enable_gqa, const std::optional<at::Tensor>& rng) {
  auto r = Attention::apply(q, k, v, undef(mask), undef(dropout_mask), undef(rng), dropout_p, is_causal, scale,
                            enable_gqa);
  return {r[0], r[1], r[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(sdpa_math, Autograd, m) {
  m.impl("forward", &forward_autograd);
  m.impl("backward", &backward_autograd);
}

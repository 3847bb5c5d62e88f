// The PyTorch binding: every sdpa_math op's schema, and the CPU and CUDA kernels that turn
// at::Tensors into core tensor views. Autograd is in autograd.cpp; fake kernels and the aten
// override live in Python (python/sdpa_math).
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#ifdef SDPA_MATH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <array>
#include <cstdlib>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "sdpa_math/attention.h"

namespace {

using sdpa_math::DType;

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kBool: return DType::Bool;
    case at::kByte: return DType::UInt8;
    case at::kChar: return DType::Int8;
    case at::kShort: return DType::Int16;
    case at::kInt: return DType::Int32;
    case at::kLong: return DType::Int64;
    case at::kFloat8_e4m3fn: return DType::Float8_e4m3fn;
    case at::kFloat8_e5m2: return DType::Float8_e5m2;
    default:
      TORCH_CHECK(false, "sdpa_math: unsupported dtype ", t, "; sdpa_math supports float16, bfloat16, float32 and float64");
  }
}

sdpa_math::TensorView view_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() <= sdpa_math::kMaxDims, "sdpa_math supports at most ", sdpa_math::kMaxDims, " dims, got ", t.dim());
  sdpa_math::TensorView v;
  v.data = t.numel() > 0 ? const_cast<void*>(t.data_ptr()) : nullptr;
  v.dtype = to_dtype(t.scalar_type());
  v.shape.ndim = static_cast<int>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    v.shape.dims[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  v.device = t.is_cuda() ? sdpa_math::Device{sdpa_math::DeviceType::CUDA, t.get_device()} : sdpa_math::Device{};
  return v;
}

std::optional<sdpa_math::TensorView> view_of(const std::optional<at::Tensor>& t) {
  if (!t || !t->defined()) return std::nullopt;
  return view_of(*t);
}

std::vector<int64_t> dims(const sdpa_math::Shape& s) { return std::vector<int64_t>(s.dims, s.dims + s.ndim); }

// rng: random dropout's (seed, offset) as a contiguous int64 tensor of two elements, on the CPU
// (read here) or on the inputs' CUDA device (read by the kernels: nothing waits for the device,
// so the call can sit in a captured CUDA graph or a compiled graph, and the values can come from
// PyTorch's CUDA generator). Absent: no random dropout is asked for.
void set_rng(sdpa_math::AttentionOptions& o, const std::optional<at::Tensor>& rng, const at::Tensor& q) {
  if (!rng || !rng->defined()) return;
  TORCH_CHECK(rng->scalar_type() == at::kLong && rng->numel() == 2 && rng->is_contiguous(),
              "sdpa_math: rng must be a contiguous int64 tensor of two elements (seed, offset), got ",
              rng->scalar_type(), " of shape ", rng->sizes());
  if (rng->is_cpu()) {
    const int64_t* v = rng->data_ptr<int64_t>();
    o.seed = static_cast<uint64_t>(v[0]);
    o.offset = static_cast<uint64_t>(v[1]);
    return;
  }
  TORCH_CHECK(q.is_cuda() && rng->device() == q.device(), "sdpa_math: rng is on ", rng->device(),
              " and the inputs on ", q.device(), "; it must be on the CPU or on the inputs' device");
  o.rng_device = reinterpret_cast<const uint64_t*>(rng->data_ptr<int64_t>());
}

sdpa_math::ForwardArgs forward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                                    const std::optional<at::Tensor>& dropout_mask, std::optional<double> scale,
                                    bool enable_gqa, const std::optional<at::Tensor>& rng) {
  sdpa_math::ForwardArgs a;
  a.query = view_of(q);
  a.key = view_of(k);
  a.value = view_of(v);
  a.attn_mask = view_of(mask);
  a.dropout_mask = view_of(dropout_mask);
  a.options.scale = scale;
  a.options.dropout_p = dropout_p;
  a.options.is_causal = is_causal;
  a.options.enable_gqa = enable_gqa;
  set_rng(a.options, rng, q);
  return a;
}

// The core reports bad input as sdpa_math::Error before writing anything; PyTorch users get it
// as a RuntimeError with the same message. The CPU kernels' own scratch memory running out is a
// RuntimeError too, as PyTorch's CPU allocator reports it (on CUDA, scratch comes from PyTorch's
// caching allocator, whose torch.OutOfMemoryError passes through unchanged).
template <class Fn>
auto checked(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const sdpa_math::Error& e) {
    TORCH_CHECK(false, e.what());
  } catch (const std::bad_alloc&) {
    TORCH_CHECK(false, "sdpa_math: can't allocate memory for the CPU kernels' scratch rows (std::bad_alloc)");
  }
}

sdpa_math::Backend backend_for(const at::Tensor& q) {
  if (q.is_cuda()) return sdpa_math::Backend::Cuda;
  sdpa_math::set_cpu_threads(at::get_num_threads());  // follow torch.set_num_threads
  return sdpa_math::Backend::Cpu;
}

// Test aid: with SDPA_MATH_POISON_OUTPUTS=1 every output buffer starts as NaN, so an element a
// kernel fails to write shows up instead of hiding behind memory that happened to be zero.
void poison(std::initializer_list<at::Tensor*> ts) {
  const char* flag = std::getenv("SDPA_MATH_POISON_OUTPUTS");
  if (flag == nullptr || flag[0] != '1') return;
  for (at::Tensor* t : ts)
    if (t->defined() && t->numel() > 0) t->fill_(std::numeric_limits<double>::quiet_NaN());
}

// CUDA calls run on PyTorch's current stream and borrow scratch memory from its caching
// allocator, so they order and pool like any PyTorch kernel (and run out of memory the same way).
sdpa_math::CudaExecution cuda_execution(const at::Tensor& q) {
  sdpa_math::CudaExecution ex;
#ifdef SDPA_MATH_WITH_CUDA
  if (q.is_cuda()) {
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(q.get_device()).stream();
    ex.stream = stream;
    ex.allocate = [stream](size_t bytes) { return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream); };
    ex.release = [](void* ptr) { c10::cuda::CUDACachingAllocator::raw_delete(ptr); };
  }
#else
  (void)q;
#endif
  return ex;
}

// on_tensors_device: custom ops get no device guard from the dispatcher, so each kernel sets the
// tensors' device with PyTorch's guard. It restores the caller's device the way PyTorch does,
// without a cudaSetDevice that would create a context on a device the caller never used (all work
// on cuda:1 with cuda:0 current); the core's own guard then finds the device already current.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_kernel(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
    double dropout_p, bool is_causal, const std::optional<at::Tensor>& dropout_mask, std::optional<double> scale,
    bool enable_gqa, const std::optional<at::Tensor>& rng) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));  // see on_tensors_device
    const sdpa_math::ForwardArgs a = forward_args(q, k, v, mask, dropout_p, is_causal, dropout_mask, scale, enable_gqa, rng);
    const sdpa_math::ForwardShapes s = sdpa_math::forward_shapes(a);
    at::Tensor out = at::empty(dims(s.output), q.options());
    at::Tensor probs = at::empty(dims(s.attn_probs), q.options());
    // float64 inputs get a float64 log-sum-exp, so their backward keeps float64 accuracy.
    const auto lse_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor lse = at::empty(dims(s.logsumexp), q.options().dtype(lse_dtype));
    poison({&out, &probs, &lse});
    sdpa_math::forward(backend_for(q), a, {view_of(out), view_of(probs), view_of(lse)}, cuda_execution(q));
    return std::make_tuple(out, probs, lse);
  });
}

// Statistics of P without writing it (sdpa_math::forward_stats; the CPU backend takes every
// problem, CUDA those of its Hopper kernel: forward_stats_has_kernel says which). Returns
// (output, logsumexp, col_sum, row_entropy, rows) with the statistics in float32 (float64 for
// float64 inputs) and rows (P at query rows rows_first + k rows_step, k < rows_count) in the
// inputs' dtype; one not asked for comes back as an empty tensor of shape (0,). No dropout and
// no autograd: the package python/sdpa_math/stats/ calls it only when no gradient is wanted.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_stats_kernel(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask, bool is_causal,
    std::optional<double> scale, bool enable_gqa, bool col_sum, bool row_entropy, int64_t rows_first, int64_t rows_count,
    int64_t rows_step) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));  // see on_tensors_device
    const sdpa_math::ForwardArgs a =
        forward_args(q, k, v, mask, 0.0, is_causal, std::nullopt, scale, enable_gqa, std::nullopt);
    const sdpa_math::ForwardShapes s = sdpa_math::forward_shapes(a);
    const auto stat_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor out = at::empty(dims(s.output), q.options());
    at::Tensor lse = at::empty(dims(s.logsumexp), q.options().dtype(stat_dtype));
    sdpa_math::StatsOutputs o{view_of(out), view_of(lse), std::nullopt, std::nullopt, std::nullopt, rows_first, rows_step};
    at::Tensor cs, ent, win;
    if (col_sum) {
      std::vector<int64_t> cs_dims = dims(s.logsumexp);  // (*lead, L) -> (*lead, S)
      cs_dims.back() = s.attn_probs.dims[s.attn_probs.ndim - 1];
      cs = at::empty(cs_dims, q.options().dtype(stat_dtype));
      o.col_sum = view_of(cs);
    }
    if (row_entropy) {
      ent = at::empty(dims(s.logsumexp), q.options().dtype(stat_dtype));
      o.row_entropy = view_of(ent);
    }
    if (rows_count > 0) {
      std::vector<int64_t> win_dims = dims(s.attn_probs);  // (*lead, L, S) -> (*lead, rows_count, S)
      win_dims[win_dims.size() - 2] = rows_count;
      win = at::empty(win_dims, q.options());
      o.rows = view_of(win);
    }
    poison({&out, &lse, &cs, &ent, &win});
    sdpa_math::forward_stats(backend_for(q), a, o, cuda_execution(q));
    auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, q.options().dtype(stat_dtype)); };
    return std::make_tuple(out, lse, or_empty(cs), or_empty(ent), win.defined() ? win : at::empty({0}, q.options()));
  });
}

// Whether forward_stats has a kernel for these inputs (always on the CPU; on CUDA, the Hopper
// statistics kernel's conditions), with outputs as forward_stats allocates them.
bool forward_stats_has_kernel_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::optional<at::Tensor>& mask, bool is_causal, std::optional<double> scale,
                                 bool enable_gqa, bool col_sum, bool row_entropy, int64_t rows_count) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));
    const sdpa_math::ForwardArgs a = forward_args(q, k, v, mask, 0.0, is_causal, std::nullopt, scale, enable_gqa, std::nullopt);
    return sdpa_math::forward_stats_has_kernel(backend_for(q), a, col_sum, row_entropy, rows_count);
  });
}

// The routes a forward, its backward and (asked for) the statistics of P would take
// (sdpa_math::explain_*), with every output, saved tensor and gradient as this binding and its
// autograd allocate them: contiguous, in the inputs' dtype (lse and statistics in float32,
// float64 for float64 inputs). Nothing runs and nothing is allocated: the outputs are views of a
// placeholder address, which only their layout is asked about. Returns one entry per path asked,
// "op\tpath\twhy", each op's chosen kernel last with an empty why; sdpa_math.explain reads it.
std::vector<std::string> explain_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                                    const std::optional<at::Tensor>& dropout_mask, std::optional<double> scale,
                                    bool enable_gqa, bool grad_output, bool grad_probs, std::array<bool, 4> output_mask,
                                    bool col_sum, bool row_entropy, int64_t rows_count) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));
    // Random dropout's seed only decides values, never the route.
    std::optional<at::Tensor> rng;
    if (dropout_p > 0.0 && !(dropout_mask && dropout_mask->defined())) rng = at::zeros({2}, at::kLong);
    const sdpa_math::ForwardArgs a = forward_args(q, k, v, mask, dropout_p, is_causal, dropout_mask, scale, enable_gqa, rng);
    const sdpa_math::ForwardShapes s = sdpa_math::forward_shapes(a);
    void* const placeholder = reinterpret_cast<void*>(std::uintptr_t{256});
    const sdpa_math::Device device = view_of(q).device;
    const DType dt = to_dtype(q.scalar_type()), stat = dt == DType::Float64 ? DType::Float64 : DType::Float32;
    auto fresh = [&](DType d, const sdpa_math::Shape& shape) { return sdpa_math::contiguous_view(placeholder, d, shape, device); };
    auto shape_of = [](const at::Tensor& t) {
      sdpa_math::Shape sh;
      sh.ndim = static_cast<int>(t.dim());
      for (int64_t d = 0; d < t.dim(); ++d) sh.dims[d] = t.size(d);
      return sh;
    };
    const sdpa_math::Backend backend = backend_for(q);
    std::vector<std::string> lines;
    auto add = [&](const char* op, const sdpa_math::Route& r) {
      for (const auto& d : r.declined) lines.push_back(std::string(op) + "\t" + d.path + "\t" + d.why);
      lines.push_back(std::string(op) + "\t" + r.kernel + "\t");
    };
    const sdpa_math::ForwardOutputs fo{fresh(dt, s.output), fresh(dt, s.attn_probs), fresh(stat, s.logsumexp)};
    add("forward", sdpa_math::explain_forward(backend, a, fo));
    if (grad_output || grad_probs) {
      sdpa_math::BackwardArgs b;
      b.forward = a;
      b.logsumexp = fo.logsumexp;
      b.output = fo.output;
      b.attn_probs = fo.attn_probs;
      if (grad_output) b.grad_output = fresh(dt, s.output);
      if (grad_probs) b.grad_probs = fresh(dt, s.attn_probs);
      sdpa_math::BackwardOutputs bo;
      if (output_mask[0]) bo.grad_query = fresh(dt, shape_of(q));
      if (output_mask[1]) bo.grad_key = fresh(dt, shape_of(k));
      if (output_mask[2]) bo.grad_value = fresh(dt, shape_of(v));
      if (output_mask[3]) {
        TORCH_CHECK(mask && mask->defined(), "grad_attn_mask was requested but there is no attn_mask");
        bo.grad_attn_mask = fresh(to_dtype(mask->scalar_type()), shape_of(*mask));
      }
      add("backward", sdpa_math::explain_backward(backend, b, bo));
    }
    if (col_sum || row_entropy || rows_count > 0) {
      TORCH_CHECK(dropout_p == 0.0, "explain: the statistics of P are those of the dropout-free map; dropout_p must be 0");
      sdpa_math::Shape cols = s.logsumexp, window = s.attn_probs;
      cols.dims[cols.ndim - 1] = s.attn_probs.dims[s.attn_probs.ndim - 1];
      window.dims[window.ndim - 2] = rows_count;
      sdpa_math::StatsOutputs so{fo.output, fo.logsumexp, std::nullopt, std::nullopt, std::nullopt, 0, 1};
      if (col_sum) so.col_sum = fresh(stat, cols);
      if (row_entropy) so.row_entropy = fresh(stat, s.logsumexp);
      if (rows_count > 0) so.rows = fresh(dt, window);
      add("stats", sdpa_math::explain_stats(backend, a, so));
    }
    return lines;
  });
}

// torch.use_deterministic_algorithms(True): the CUDA kernels add dQ (and dK and dV where heads
// share key rows) with float atomics whose order changes from run to run, and the CPU threads add
// what several tasks share — dK and dV of K/V rows that GQA or broadcasting gives to several
// heads, dQ of a broadcast Q, the gradient of a broadcast mask — in the order they finish (one
// thread: in a fixed order). Those calls raise (or warn, under warn_only) as PyTorch's own
// nondeterministic ops do; the rest of the CPU backward writes every element from one task and is
// bitwise reproducible.
void alert_if_nondeterministic(const sdpa_math::ForwardArgs& a, const std::optional<at::Tensor>& mask,
                               const std::array<bool, 4>& output_mask) {
  if (!at::globalContext().deterministicAlgorithms()) return;
  const sdpa_math::ForwardShapes s = sdpa_math::forward_shapes(a);  // bad input gets its own error first
  if (a.query.device.type == sdpa_math::DeviceType::CUDA) {
    at::globalContext().alertNotDeterministic("sdpa_math::backward on CUDA");
    return;
  }
  const int64_t rows = s.logsumexp.numel(), cells = s.attn_probs.numel();
  if (rows == 0 || cells == 0) return;
  const int64_t S = cells / rows;
  auto fewer_rows = [&](const sdpa_math::TensorView& t, int64_t per_row, bool wanted, int64_t row_len) {
    return wanted && per_row > 0 && t.numel() / per_row < row_len;
  };
  const int64_t L = s.logsumexp.dims[s.logsumexp.ndim - 1];
  const int64_t heads_rows = rows / std::max<int64_t>(L, 1) * S;  // key rows if no head shared them
  const bool shared = fewer_rows(a.query, a.query.shape.dims[a.query.ndim() - 1], output_mask[0], rows) ||
                      fewer_rows(a.key, a.key.shape.dims[a.key.ndim() - 1], output_mask[1], heads_rows) ||
                      fewer_rows(a.value, a.value.shape.dims[a.value.ndim() - 1], output_mask[2], heads_rows) ||
                      (output_mask[3] && mask && mask->numel() < cells);
  if (shared && at::get_num_threads() > 1)
    at::globalContext().alertNotDeterministic("sdpa_math::backward on the CPU with shared (GQA or broadcast) inputs");
}

// Returns (grad_query, grad_key, grad_value, grad_attn_mask); a gradient not asked for by
// `output_mask` comes back as an empty tensor of
// shape (0,): custom-op schemas cannot return optional tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_kernel(
    const std::optional<at::Tensor>& grad_output, const std::optional<at::Tensor>& grad_probs, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask, const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& output, const std::optional<at::Tensor>& attn_probs, double dropout_p, bool is_causal, const std::optional<at::Tensor>& dropout_mask, std::optional<double> scale,
    bool enable_gqa, const std::optional<at::Tensor>& rng, std::array<bool, 4> output_mask) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));  // see on_tensors_device
    sdpa_math::BackwardArgs a;
    a.forward = forward_args(q, k, v, mask, dropout_p, is_causal, dropout_mask, scale, enable_gqa, rng);
    alert_if_nondeterministic(a.forward, mask, output_mask);
    a.logsumexp = view_of(logsumexp);
    a.grad_output = view_of(grad_output);
    a.grad_probs = view_of(grad_probs);
    a.output = view_of(output);
    a.attn_probs = view_of(attn_probs);
    at::Tensor gq, gk, gv, gm;
    sdpa_math::BackwardOutputs out;
    if (output_mask[0]) { gq = at::empty_like(q, at::MemoryFormat::Contiguous); out.grad_query = view_of(gq); }
    if (output_mask[1]) { gk = at::empty_like(k, at::MemoryFormat::Contiguous); out.grad_key = view_of(gk); }
    if (output_mask[2]) { gv = at::empty_like(v, at::MemoryFormat::Contiguous); out.grad_value = view_of(gv); }
    if (output_mask[3]) {  // without a float mask the core raises "no float attn_mask to differentiate"
      TORCH_CHECK(mask && mask->defined(), "grad_attn_mask was requested but there is no attn_mask");
      gm = at::empty_like(*mask, at::MemoryFormat::Contiguous);
      out.grad_attn_mask = view_of(gm);
    }
    poison({&gq, &gk, &gv, &gm});
    sdpa_math::backward(backend_for(q), a, out, cuda_execution(q));
    auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, q.options()); };
    return std::make_tuple(or_empty(gq), or_empty(gk), or_empty(gv), or_empty(gm));
  });
}

// kl_to's pieces (sdpa_math::kl_rows, kl_backward; the package python/sdpa_math/stats/ uses them on CUDA
// where kl_backward_has_kernel says so). kl_rows returns the KL per row and R = Σ_j r, in float32
// (float64 for a float64 reference), from the reference, q, u = r K and the lse.
std::tuple<at::Tensor, at::Tensor> kl_rows_kernel(const at::Tensor& reference, bool is_causal, const at::Tensor& query,
                                                  const at::Tensor& ref_keys, const at::Tensor& logsumexp, double scale) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(reference));
    TORCH_CHECK(reference.dim() >= 2, "kl_rows: reference must have at least 2 dims, got ", reference.dim());
    const auto stat = reference.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    std::vector<int64_t> rows(reference.sizes().begin(), reference.sizes().end() - 1);
    at::Tensor kl = at::empty(rows, reference.options().dtype(stat)), R = at::empty(rows, reference.options().dtype(stat));
    poison({&kl, &R});
    sdpa_math::KlRowsArgs a;
    a.reference = view_of(reference);
    a.query = view_of(query);
    a.ref_keys = view_of(ref_keys);
    a.logsumexp = view_of(logsumexp);
    a.scale = scale;
    a.is_causal = is_causal;
    sdpa_math::kl_rows(backend_for(reference), a, view_of(kl), view_of(R), cuda_execution(reference));
    return std::make_tuple(kl, R);
  });
}

// The rows of P from their fp32 logits (sdpa_math::softmax_rows; the package sdpa_math.stats's
// `rows` alone on CUDA): a fresh tensor of the logits' shape in `dtype`.
at::Tensor softmax_rows_kernel(const at::Tensor& logits, c10::ScalarType dtype, bool is_causal, int64_t first,
                               int64_t step) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(logits));
    at::Tensor out = at::empty(logits.sizes(), logits.options().dtype(dtype));
    poison({&out});
    sdpa_math::SoftmaxRowsArgs a;
    a.logits = view_of(logits);
    a.is_causal = is_causal;
    a.first = first;
    a.step = step;
    sdpa_math::softmax_rows(backend_for(logits), a, view_of(out), cuda_execution(logits));
    return out;
  });
}

sdpa_math::KlForwardArgs kl_forward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                         std::optional<double> scale, bool enable_gqa, const at::Tensor& logsumexp,
                                         const at::Tensor& reference) {
  sdpa_math::KlForwardArgs a;
  a.forward = forward_args(q, k, v, std::nullopt, 0.0, is_causal, std::nullopt, scale, enable_gqa, std::nullopt);
  a.logsumexp = view_of(logsumexp);
  a.reference = view_of(reference);
  return a;
}

// kl_rows' outputs from q and k (the logits formed tile by tile) instead of u = r K: float32 rows
// shaped like the lse (float64 for float64 inputs).
std::tuple<at::Tensor, at::Tensor> kl_forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool is_causal, std::optional<double> scale, bool enable_gqa,
                                                     const at::Tensor& logsumexp, const at::Tensor& reference) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));
    const sdpa_math::KlForwardArgs a = kl_forward_args(q, k, v, is_causal, scale, enable_gqa, logsumexp, reference);
    const std::vector<int64_t> rows = dims(sdpa_math::forward_shapes(a.forward).logsumexp);  // bad input: its own error first
    const auto stat = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor kl = at::empty(rows, q.options().dtype(stat)), R = at::empty(rows, q.options().dtype(stat));
    poison({&kl, &R});
    sdpa_math::kl_forward(backend_for(q), a, view_of(kl), view_of(R), cuda_execution(q));
    return std::make_tuple(kl, R);
  });
}

bool kl_forward_has_kernel_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                              std::optional<double> scale, bool enable_gqa, const at::Tensor& logsumexp,
                              const at::Tensor& reference) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));
    return sdpa_math::kl_forward_has_kernel(backend_for(q),
                                            kl_forward_args(q, k, v, is_causal, scale, enable_gqa, logsumexp, reference));
  });
}

sdpa_math::KlBackwardArgs kl_backward_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                           std::optional<double> scale, bool enable_gqa, const at::Tensor& logsumexp,
                                           const at::Tensor& reference, const at::Tensor& ref_row_sum,
                                           const at::Tensor& grad_kl) {
  sdpa_math::KlBackwardArgs a;
  a.forward = forward_args(q, k, v, std::nullopt, 0.0, is_causal, std::nullopt, scale, enable_gqa, std::nullopt);
  a.logsumexp = view_of(logsumexp);
  a.reference = view_of(reference);
  a.ref_row_sum = view_of(ref_row_sum);
  a.grad_kl = view_of(grad_kl);
  return a;
}

// dQ and dK of Σ_i g_i KL(r_i ‖ P_i) (either may be skipped by output_mask; an empty (0,) tensor
// then). No mask: kl_to with a mask keeps the Python composition.
std::tuple<at::Tensor, at::Tensor> kl_backward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      bool is_causal, std::optional<double> scale, bool enable_gqa,
                                                      const at::Tensor& logsumexp, const at::Tensor& reference,
                                                      const at::Tensor& ref_row_sum, const at::Tensor& grad_kl,
                                                      std::array<bool, 2> output_mask) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));
    const sdpa_math::KlBackwardArgs a =
        kl_backward_args(q, k, v, is_causal, scale, enable_gqa, logsumexp, reference, ref_row_sum, grad_kl);
    if (q.is_cuda() && at::globalContext().deterministicAlgorithms()) {
      (void)sdpa_math::forward_shapes(a.forward);  // bad input gets its own error first
      at::globalContext().alertNotDeterministic("sdpa_math::kl_backward on CUDA");  // dQ's float reductions
    }
    at::Tensor gq, gk;
    sdpa_math::BackwardOutputs out;
    if (output_mask[0]) { gq = at::empty_like(q, at::MemoryFormat::Contiguous); out.grad_query = view_of(gq); }
    if (output_mask[1]) { gk = at::empty_like(k, at::MemoryFormat::Contiguous); out.grad_key = view_of(gk); }
    poison({&gq, &gk});
    sdpa_math::kl_backward(backend_for(q), a, out, cuda_execution(q));
    auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, q.options()); };
    return std::make_tuple(or_empty(gq), or_empty(gk));
  });
}

bool kl_backward_has_kernel_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                               std::optional<double> scale, bool enable_gqa, const at::Tensor& logsumexp,
                               const at::Tensor& reference, const at::Tensor& ref_row_sum, const at::Tensor& grad_kl) {
  return checked([&] {
    const at::OptionalDeviceGuard guard(at::device_of(q));
    return sdpa_math::kl_backward_has_kernel(
        backend_for(q), kl_backward_args(q, k, v, is_causal, scale, enable_gqa, logsumexp, reference, ref_row_sum, grad_kl));
  });
}

// The level of the CPU kernels (src/cpu/isa.h): which copy runs, which this build and CPU have.
std::string cpu_isa() { return checked([] { return std::string(sdpa_math::cpu_isa()); }); }
std::string cpu_isas_available() { return sdpa_math::cpu_isas_available(); }
void set_cpu_isa(const std::string& level) {
  checked([&] { sdpa_math::set_cpu_isa(level); });
}
int64_t cuda_blas_handles_created() { return sdpa_math::cuda_blas_handles_created(); }

}  // namespace

bool built_with_cuda() {
#ifdef SDPA_MATH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY(sdpa_math, m) {
  m.def("built_with_cuda() -> bool", &built_with_cuda);
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("cpu_isas_available() -> str", &cpu_isas_available);
  m.def("set_cpu_isa(str level) -> ()", &set_cpu_isa);
  m.def("cuda_blas_handles_created() -> int", &cuda_blas_handles_created);
  m.def(
      "explain(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "Tensor? dropout_mask, float? scale, bool enable_gqa, bool grad_output, bool grad_probs, bool[4] output_mask, "
      "bool col_sum, bool row_entropy, int rows_count) -> str[]");
  m.def(
      "forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "Tensor? dropout_mask, float? scale, bool enable_gqa, Tensor? rng) "
      "-> (Tensor output, Tensor attn_probs, Tensor logsumexp)");
  m.def(
      "backward(Tensor? grad_output, Tensor? grad_probs, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor logsumexp, Tensor? output, Tensor? attn_probs, float dropout_p, bool is_causal, Tensor? dropout_mask, float? scale, bool enable_gqa, "
      "Tensor? rng, bool[4] output_mask) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_attn_mask)");
  m.def(
      "forward_stats(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, float? scale, "
      "bool enable_gqa, bool col_sum, bool row_entropy, int rows_first, int rows_count, int rows_step) "
      "-> (Tensor output, Tensor logsumexp, Tensor col_sum, Tensor row_entropy, Tensor rows)");
  m.def(
      "forward_stats_has_kernel(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, bool is_causal, float? scale, "
      "bool enable_gqa, bool col_sum, bool row_entropy, int rows_count) -> bool");
  m.def(
      "kl_rows(Tensor reference, bool is_causal, Tensor query, Tensor ref_keys, Tensor logsumexp, float scale) "
      "-> (Tensor kl, Tensor row_sum)");
  m.def("softmax_rows(Tensor logits, ScalarType dtype, bool is_causal, int first, int step) -> Tensor");
  m.def(
      "kl_forward(Tensor query, Tensor key, Tensor value, bool is_causal, float? scale, bool enable_gqa, Tensor logsumexp, "
      "Tensor reference) -> (Tensor kl, Tensor row_sum)");
  m.def(
      "kl_forward_has_kernel(Tensor query, Tensor key, Tensor value, bool is_causal, float? scale, bool enable_gqa, "
      "Tensor logsumexp, Tensor reference) -> bool");
  m.def(
      "kl_backward(Tensor query, Tensor key, Tensor value, bool is_causal, float? scale, bool enable_gqa, Tensor logsumexp, "
      "Tensor reference, Tensor ref_row_sum, Tensor grad_kl, bool[2] output_mask) -> (Tensor grad_query, Tensor grad_key)");
  m.def(
      "kl_backward_has_kernel(Tensor query, Tensor key, Tensor value, bool is_causal, float? scale, bool enable_gqa, "
      "Tensor logsumexp, Tensor reference, Tensor ref_row_sum, Tensor grad_kl) -> bool");
}

TORCH_LIBRARY_IMPL(sdpa_math, CPU, m) {
  m.impl("explain", &explain_op);
  m.impl("forward", &forward_kernel);
  m.impl("backward", &backward_kernel);
  m.impl("forward_stats", &forward_stats_kernel);
  m.impl("forward_stats_has_kernel", &forward_stats_has_kernel_op);
  m.impl("kl_rows", &kl_rows_kernel);
  m.impl("softmax_rows", &softmax_rows_kernel);
  m.impl("kl_forward", &kl_forward_kernel);
  m.impl("kl_forward_has_kernel", &kl_forward_has_kernel_op);
  m.impl("kl_backward", &kl_backward_kernel);
  m.impl("kl_backward_has_kernel", &kl_backward_has_kernel_op);
}

#ifdef SDPA_MATH_WITH_CUDA
TORCH_LIBRARY_IMPL(sdpa_math, CUDA, m) {
  m.impl("explain", &explain_op);
  m.impl("forward", &forward_kernel);
  m.impl("backward", &backward_kernel);
  m.impl("forward_stats", &forward_stats_kernel);
  m.impl("forward_stats_has_kernel", &forward_stats_has_kernel_op);
  m.impl("kl_rows", &kl_rows_kernel);
  m.impl("softmax_rows", &softmax_rows_kernel);
  m.impl("kl_forward", &kl_forward_kernel);
  m.impl("kl_forward_has_kernel", &kl_forward_has_kernel_op);
  m.impl("kl_backward", &kl_backward_kernel);
  m.impl("kl_backward_has_kernel", &kl_backward_has_kernel_op);
}
#else
// A build without a CUDA compiler: CUDA tensors get this instead of the dispatcher's "could not
// run ... with arguments from the 'CUDA' backend".
void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(), ": this build of sdpa_math has no CUDA kernels (it was built without a CUDA ",
              "compiler). Reinstall it with the CUDA toolkit's nvcc on PATH: pip install --no-build-isolation .");
}
TORCH_LIBRARY_IMPL(sdpa_math, CUDA, m) {
  m.impl("explain", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("forward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("backward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("forward_stats", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("forward_stats_has_kernel", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("kl_rows", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("softmax_rows", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("kl_forward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("kl_forward_has_kernel", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("kl_backward", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  m.impl("kl_backward_has_kernel", torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
}
#endif

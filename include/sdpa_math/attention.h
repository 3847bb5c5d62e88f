// The sdpa_math entry points: attention forward returning the output O, the probability map P
// and the row log-sum-exp, and the backward through both O and P.
// Semantics: docs/contract.md (the contract of aten::_scaled_dot_product_attention_math).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sdpa_math/error.h"
#include "sdpa_math/tensor_view.h"

namespace sdpa_math {

enum class Backend {
  Reference,  // float64 plain loops: the mathematical authority (any float dtype in and out)
  Cpu,        // blocked, multi-threaded, fp32 accumulation (float64 inputs go to Reference)
  Cuda,       // the GPU path, where the build has one
};
const char* backend_name(Backend b);
bool backend_available(Backend b);

struct AttentionOptions {
  std::optional<double> scale;  // default 1/sqrt(E)
  double dropout_p = 0.0;
  bool is_causal = false;
  bool enable_gqa = false;
  // Random dropout (dropout_p > 0 and no dropout_mask) draws element n of P from the
  // counter-based stream (seed, offset): see sdpa_math/dropout_rng.h. Same seed and offset in
  // forward and backward give the same mask, on every backend.
  uint64_t seed = 0;
  uint64_t offset = 0;
  // CUDA only: when set, the kernels read seed and offset from this device memory (two values,
  // seed first) instead of the two fields above. A stream drawn on the device (PyTorch's CUDA
  // generator) then needs no copy to the host, so a captured CUDA graph gets a new mask on each
  // replay and a compiled graph has no host synchronisation.
  const uint64_t* rng_device = nullptr;
};

struct ForwardArgs {
  TensorView query;  // (*batch, Hq, L, E)
  TensorView key;    // (*batch, Hkv, S, E)
  TensorView value;  // (*batch, Hkv, S, Ev)
  std::optional<TensorView> attn_mask;     // bool (True = attend) or float, broadcast to P
  std::optional<TensorView> dropout_mask;  // used only when dropout_p > 0
  AttentionOptions options;
};

// Shapes of what forward returns; computing them validates the inputs.
struct ForwardShapes {
  Shape output;     // (*batch, Hq, L, Ev)
  Shape attn_probs; // (*batch, Hq, L, S)
  Shape logsumexp;  // (*batch, Hq, L)
};

struct ForwardOutputs {
  TensorView output;      // any floating dtype (the binding passes the query's)
  TensorView attn_probs;  // any floating dtype
  TensorView logsumexp;   // float32 or float64; -inf on fully masked rows
};

struct BackwardArgs {
  ForwardArgs forward;  // the same inputs and options as the forward
  TensorView logsumexp; // what the forward returned
  // The forward's O and P, optional. With them the CUDA backend takes rowsum(A . dA) as
  // rowsum(dO . O) + rowsum(P . dP) from memory, and, without dropout, A as P itself instead of
  // recomputing Q K^T. The CPU backend takes A as the saved P likewise (without dropout) and
  // ignores O; the reference recomputes everything.
  std::optional<TensorView> output;
  std::optional<TensorView> attn_probs;
  std::optional<TensorView> grad_output;  // dL/dO, shape of O; absent = zero
  std::optional<TensorView> grad_probs;   // dL/dP, shape of P; absent = zero
};

// Each gradient is written only where a view is given. grad_attn_mask has the mask's own shape
// (the gradient summed over the dims the mask was broadcast along) and needs a float mask.
struct BackwardOutputs {
  std::optional<TensorView> grad_query;
  std::optional<TensorView> grad_key;
  std::optional<TensorView> grad_value;
  std::optional<TensorView> grad_attn_mask;
};

// Statistics of the map P = softmax(scale QKᵀ + mask) without writing P (docs/statistics.md):
// the forward's O and lse, and any of
//   col_sum     (*batch, Hq, S): Σ_i P_ij, per query head;
//   row_entropy (*batch, Hq, L): −Σ_j P_ij log P_ij (0 log 0 = 0; a fully masked row gives 0, a
//                NaN row NaN).
// Both float32 or float64. Dropout is refused: these are statistics of the dropout-free map.
//   rows        (*batch, Hq, n, S): P itself at the query rows rows_first + k · rows_step,
//                k < n (n = its second-to-last dim), in any floating dtype.
struct StatsOutputs {
  TensorView output;     // as ForwardOutputs::output
  TensorView logsumexp;  // as ForwardOutputs::logsumexp
  std::optional<TensorView> col_sum;
  std::optional<TensorView> row_entropy;
  std::optional<TensorView> rows;
  int64_t rows_first = 0, rows_step = 1;
};

// How the CUDA backend runs a call: on which stream, and where it borrows scratch memory
// (the binding passes PyTorch's current stream and caching allocator). Ignored by CPU backends.
struct CudaExecution {
  void* stream = nullptr;                         // a cudaStream_t; nullptr = the default stream
  std::function<void*(std::size_t)> allocate;     // empty = cudaMallocAsync on the stream; else it must
                                                  // return memory aligned to 16 bytes (an Error otherwise)
  std::function<void(void*)> release;
};

// Validates the inputs (throws sdpa_math::Error naming the problem) and returns output shapes.
ForwardShapes forward_shapes(const ForwardArgs& args);

// Validate everything first, then compute. Nothing is written when validation fails.
void forward(Backend backend, const ForwardArgs& args, const ForwardOutputs& out, const CudaExecution& cuda = {});
void backward(Backend backend, const BackwardArgs& args, const BackwardOutputs& out, const CudaExecution& cuda = {});
// Validates like forward (and refuses dropout), then computes O, lse and the statistics asked
// for. The Reference and CPU backends take every problem; CUDA has kernels for up to 4 query
// rows on any GPU (the decode forward's: fp16, bf16 and fp32 inputs, K and V read once) and for
// Hopper GPUs (fp16/bf16 inputs as its forward takes them, fp32 col_sum and row_entropy, rows in
// the inputs' dtype) and raises BackendUnavailable for anything else (the Python package
// computes those statistics from chunks of P instead).
void forward_stats(Backend backend, const ForwardArgs& args, const StatsOutputs& out, const CudaExecution& cuda = {});
// Whether forward_stats has a kernel for these inputs, with the statistics asked for in outputs
// as a caller allocates them fresh (contiguous; float32 statistics, float64 for float64 inputs;
// rows_count rows of P in the inputs' dtype). Validates the inputs as forward does.
bool forward_stats_has_kernel(Backend backend, const ForwardArgs& args, bool col_sum, bool row_entropy, int64_t rows_count);

// The route a call takes: the kernel that runs it and, for each path asked before it, why it
// declined. CUDA's paths, in order: forward decode, sm90, sm80, cublas-fp32, generic; backward
// cublas-fp32, decode, sm90, sm80, generic; statistics decode, sm90 (else "none": forward_stats
// raises). "none" also names a call with no query rows. The CPU backend runs "cpu" (its
// vectorized kernels) or "reference" (float64 inputs, or the Reference backend).
struct RouteDecline {
  std::string path;
  std::string why;
};
struct Route {
  std::string kernel;
  std::vector<RouteDecline> declined;
};
// Validate as forward, backward and forward_stats do (outputs included: the route depends on
// their dtypes and layouts; their memory is not touched), then answer without running anything.
Route explain_forward(Backend backend, const ForwardArgs& args, const ForwardOutputs& out);
Route explain_backward(Backend backend, const BackwardArgs& args, const BackwardOutputs& out);
Route explain_stats(Backend backend, const ForwardArgs& args, const StatsOutputs& out);

// kl_to's pieces without P (docs/statistics.md, "kl_to on CUDA"). For a reference map r of P's
// shape and KL_i = Σ_j r_ij log(r_ij / P_ij), the KL is Σ_j r log r − Σ_j r_ij x_ij + R_i lse_i
// (x the logits, R_i = Σ_j r_ij), and the gradient of Σ_i g_i KL_i to the logits is
// dS_ij = g_i (R_i P_ij − r_ij): no log P and no division by P anywhere.
//
// kl_rows: the KL per row, KL_i = Σ_j r_ij log r_ij − scale · q_i · u_i + R_i lse_i, from one pass
// over r and the caller's u = r K (the sum Σ_j r_ij x_ij of unmasked logits x = scale q kᵀ is
// scale q_i · (r K)_i: one product of r with K, which a GEMM library does best), with 0 log 0 = 0;
// a row with R_i = 0 has KL 0 (whatever q_i and lse_i hold, NaN included). With is_causal, a row
// whose r has mass on a key the top-left causal mask hides has KL +inf. Also writes R_i (the backward's). Sums in the outputs' dtype.
struct KlRowsArgs {
  TensorView reference;  // r, (*lead, L, S), any floating dtype (broadcast by strides)
  TensorView query;      // q, (*lead, L, E), any floating dtype (broadcast by strides)
  TensorView ref_keys;   // u = r K, (*lead, L, E), float32 or float64
  TensorView logsumexp;  // the student's lse, (*lead, L), float32 or float64
  double scale = 1.0;    // the logits' scale (resolved: no default here)
  bool is_causal = false;
};
// kl and row_sum: (*lead, L), float32 or float64, one dtype.
void kl_rows(Backend backend, const KlRowsArgs& args, const TensorView& kl, const TensorView& row_sum,
             const CudaExecution& cuda = {});
// softmax_rows: rows of P from their fp32 logits, for a window of query rows asked for alone
// (python/sdpa_math/stats/, `rows` without the statistics kernel): the logits x of row n
// (x = scale · q kᵀ, already scaled) go to out[n, j] = exp(x_j − max) / Σ exp(x − max), rounded
// to out's dtype, in one kernel that reads x once (rows of up to 4096 keys, held in registers) or
// twice and writes P once (instead of the separate mask, softmax and cast passes of PyTorch ops). With is_causal, row k of the window is query row
// i = first + k · step and key j > i is hidden (weight 0; top-left causal mask). The same values
// as torch.softmax of the masked logits: a row that holds a NaN, or whose visible logits are all
// -inf (never under the causal mask, which leaves key 0 visible), is NaN throughout; +inf likewise
// gives NaN (inf − inf), as torch.softmax does.
struct SoftmaxRowsArgs {
  TensorView logits;     // x, (*lead, w, S), float32, any strides
  bool is_causal = false;
  int64_t first = 0;     // the window's first query row (is_causal only)
  int64_t step = 1;      // query rows between the window's rows, >= 1 (is_causal only)
};
// out: x's shape, float16, bfloat16 or float32, on x's device.
void softmax_rows(Backend backend, const SoftmaxRowsArgs& args, const TensorView& out, const CudaExecution& cuda = {});
// kl_forward: kl_rows' two outputs from q and k instead of the caller's u = r K, with the logits'
// sum Σ_j r_ij x_ij over the keys row i sees (x = scale q kᵀ with causality and the mask; a
// hidden key is one whose logit is -inf): KL_i = Σ_j r_ij log r_ij − Σ_j r_ij x_ij + R_i lse_i,
// 0 for a row with R_i = 0, +inf where r has mass on a hidden key. The reference and CPU
// backends compute it in float64 (slow: for tests and small problems); CUDA has a Hopper kernel
// (fp16/bf16 without a mask, r in the inputs' dtype and every operand addressable by the TMA
// unit: 16-byte aligned rows) and raises BackendUnavailable for anything else.
struct KlForwardArgs {
  ForwardArgs forward;   // as the forward's (value is not read); no dropout
  TensorView logsumexp;  // the student's lse, (*lead, L)
  TensorView reference;  // r, P's shape (*lead, L, S), any floating dtype (broadcast by strides)
};
// kl and row_sum: (*lead, L), float32 or float64, one dtype.
void kl_forward(Backend backend, const KlForwardArgs& args, const TensorView& kl, const TensorView& row_sum,
                const CudaExecution& cuda = {});
// Whether kl_forward runs these inputs on `backend` with kl and row_sum as a caller allocates
// them (float32; float64 for float64 inputs). Validates as kl_forward does.
bool kl_forward_has_kernel(Backend backend, const KlForwardArgs& args);
struct KlBackwardArgs {
  ForwardArgs forward;     // as the forward's (value is not read); no dropout
  TensorView logsumexp;    // the forward's, (*lead, L)
  TensorView reference;    // r, P's shape (*lead, L, S), any floating dtype (broadcast by strides)
  TensorView ref_row_sum;  // R, (*lead, L), float32 or float64
  TensorView grad_kl;      // g, the KL's incoming gradient, (*lead, L), float32 or float64
};
// Writes grad_query = scale dS K and grad_key = scale dSᵀ Q (summed over a GQA group and over
// broadcast dims) where given; grad_value and grad_attn_mask must be absent. The reference and
// CPU backends recompute P from q and k in float64 (a mask allowed; slow: the Python package's
// kl_to has its own CPU path); CUDA has a Hopper kernel (the backward's KL form: fp16/bf16, no
// mask, r in the inputs' dtype) and raises BackendUnavailable for anything else.
void kl_backward(Backend backend, const KlBackwardArgs& args, const BackwardOutputs& out, const CudaExecution& cuda = {});
// Whether kl_backward runs these inputs on `backend` (gradients as a caller allocates them:
// contiguous in the inputs' dtype). Validates as kl_backward does.
bool kl_backward_has_kernel(Backend backend, const KlBackwardArgs& args);

// Threads used by the CPU backend (0 = OpenMP's default).
void set_cpu_threads(int n);
int cpu_threads();

// The instruction-set level of the CPU kernels in use: "avx512" (x86-64-v4), "avx2" (x86-64-v3:
// AVX2, FMA, F16C) or "baseline" (any x86-64, or another architecture). The default is the best
// level that this build has and this CPU supports; the environment variable SDPA_MATH_CPU_ISA,
// read at the first call, or set_cpu_isa choose a lower one (for tests, or to compare levels).
const char* cpu_isa();
// The levels this build has that this CPU can run, best first, comma-separated.
std::string cpu_isas_available();
// Throws Error(BackendUnavailable) naming the available levels when `level` is not one of them.
void set_cpu_isa(const std::string& level);

// How many cuBLAS handles the CUDA backend has created in this process (0 without CUDA). A thread
// keeps one per device while it lives and returns it to a pool when it ends, so the count grows
// with the threads using the fp32 CUDA path at one time, not with all threads ever started.
int64_t cuda_blas_handles_created();

}  // namespace sdpa_math

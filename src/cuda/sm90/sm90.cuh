// The Hopper (sm_90a) kernels: compiled for 90a only (CMake's sdpa_math_sm90 objects) and chosen
// at run time when the tensors' device has compute capability 9.0. Each path answers why it would
// not take a problem (nullptr: it takes it, and what it prepared is kept for the run); the
// backend's plan (route.h) asks them in order.
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "../device_problem.cuh"
#include "../route.h"

namespace sdpa_math::cuda::sm90 {

// Whether the device the problem runs on is a Hopper GPU this build has kernels for.
bool device_supported();

// The forward on warpgroup products fed by TMA (forward_sm90.cu): fp16/bf16, head sizes up to
// 128 (E and Ev padded alike to 64 or 128, multiples of 8), rows unit-stride with 16-byte-aligned
// strides (contiguous and transposed (B, L, H, E) views alike), P and O in the inputs' dtype and
// lse in fp32 (as the binding allocates them), causal, GQA, and masks that are bool, of the
// inputs' dtype or fp32 with pair-aligned rows (any broadcast); no dropout.
// Why it does not take the problem, or nullptr; for a problem it takes, *prepared (if given)
// receives the encoded TMA maps and arguments that forward runs with.
const char* forward_declines(const DevProblem& p, std::shared_ptr<const ForwardPrepared>* prepared);
// Workspace (32-bit words, zeroed by the caller) for the mask plan: which key tiles a float mask
// leaves every logit of 16 rows as it is; 0 without a float mask.
int64_t forward_workspace_words(const DevProblem& p);
void forward(const DevProblem& p, const ForwardPrepared& prepared, uint32_t* workspace, cudaStream_t stream);

// Statistics of P without writing it (the forward kernel's STATS form): O and lse as the
// forward, and the StatsTargets asked for (device_problem.cuh): column sums and row entropy in
// fp32; P's rows in the inputs' dtype with pair-aligned rows; with column sums, one head's
// partial rows within the 64 MiB workspace budget (L x S up to about 2^30). Declines and
// prepares as forward_declines.
const char* stats_declines(const DevProblem& p, const StatsTargets& t, std::shared_ptr<const ForwardPrepared>* prepared);
// fp32 workspace the column sums need (their partial rows, a bounded number of heads at a time).
int64_t stats_workspace_floats(const DevProblem& p, const StatsTargets& t);
void forward_stats(const DevProblem& p, const ForwardPrepared& prepared, const StatsTargets& t, float* workspace,
                   cudaStream_t stream);

// Where the backward writes: contiguous gradients of q, k, v in the inputs' dtype (their own
// shapes), nullptr for one not wanted.
struct BackwardTargets {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
};
// The backward from the saved P (backward_sm90.cu): fp16/bf16 without dropout, P given (dO and
// O, dP: either or both), head sizes as the forward, q/k/v not broadcast over lead dims other than
// GQA's group; every operand TMA-addressable. Why not, or nullptr (and *prepared, if given, gets
// the encoded maps and arguments backward runs with). The caller asks the rest: no mask gradient,
// gradients contiguous in the inputs' dtype.
const char* backward_declines(const DevProblem& p, std::shared_ptr<const BackwardPrepared>* prepared);
// fp32 workspace it needs, zeroed by the caller: delta per query row, then dQ's accumulator.
int64_t backward_workspace_floats(const DevProblem& p);
int64_t backward_delta_floats(const DevProblem& p);
void backward(const DevProblem& p, const BackwardPrepared& prepared, const BackwardTargets& out, float* workspace,
              cudaStream_t stream);

// kl_to's gradient without P (kl_backward_sm90.cu, the KL form of backward_sm90.cuh's kernel):
// dQ and dK of Σ_i g_i KL(r_i ‖ P_i), P recomputed from the lse in p.lse. The reference r has P's
// shape and the inputs' dtype; its row sums R and the incoming gradient g are fp32 rows shaped
// like the lse.
struct KlInputs {
  DevOperand reference, row_sum, grad_kl;
};
// fp16/bf16 without dropout or a mask (causal allowed), head size E up to 128 (a multiple of 8),
// q and k as backward_declines asks and TMA-addressable (it encodes their maps), r either
// TMA-addressable or with 4-byte aligned rows (S even).
bool kl_backward_applies(const DevProblem& p, const KlInputs& in);
// Why it does not apply, for the error message; nullptr when it does.
const char* kl_backward_declines(const DevProblem& p, const KlInputs& in);
// The same without the TMA maps, for a caller about to run: kl_backward encodes them anyway and
// returns false, before any launch, when one cannot be encoded.
const char* kl_conditions_decline(const DevProblem& p, const KlInputs& in);
// fp32 workspace, zeroed by the caller: row vectors, 1 / f per key head, dQ's accumulator.
int64_t kl_backward_workspace_floats(const DevProblem& p);
bool kl_backward(const DevProblem& p, const KlInputs& in, const BackwardTargets& out, float* workspace, cudaStream_t stream);

// kl_to's forward rows without P (kl_forward_sm90.cu): the KL of each row to the reference and
// its row sum R, fp32 rows shaped like the lse (kl_rows' definition, attention.h), from q, k, the
// lse in p.lse and the reference (P's shape, the inputs' dtype), with Q Kᵀ on the tensor cores
// instead of the caller's r K.
struct KlRowsOut {
  DevOperand kl, row_sum;
};
// What both KL kernels ask of the inputs (fp16/bf16, no dropout or mask, the reference in the
// inputs' dtype, head size E a multiple of 8 up to 128, a Hopper device): why not, or nullptr.
const char* kl_inputs_decline(const DevProblem& p, DType reference);
// Why kl_forward declines a layout it cannot describe to the TMA unit.
inline constexpr const char* kKlForwardTmaDecline =
    "the TMA unit cannot address q, k or the reference map (each needs a 16-byte aligned base and rows: E and S "
    "multiples of 8; a unit column stride; rows not broadcast; at most three lead dims of its own)";
// kl_inputs_decline, L and S above 0 and below 2^31, fp32 lse and outputs; without the TMA maps
// (kl_forward encodes them and returns false, before any launch, when one cannot be encoded).
const char* kl_forward_conditions_decline(const DevProblem& p, const DevOperand& reference, const KlRowsOut& out);
// The same and TMA can address q, k and the reference: why not, or nullptr when it applies.
const char* kl_forward_declines(const DevProblem& p, const DevOperand& reference, const KlRowsOut& out);
bool kl_forward(const DevProblem& p, const DevOperand& reference, const KlRowsOut& out, cudaStream_t stream);

}  // namespace sdpa_math::cuda::sm90

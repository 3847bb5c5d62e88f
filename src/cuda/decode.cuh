// The kernels for a few query rows (decode), split over keys: the forward, its statistics and
// the backward (src/cuda/decode/; common.cuh there describes them).
#pragma once

#include <cuda_runtime.h>

#include "device_problem.cuh"
#include "generic.cuh"

namespace sdpa_math::cuda {

constexpr int kDecodeMaxRows = 4;      // query rows per head it takes
constexpr int kDecodeMaxHead = 256;    // E and Ev

// Why decode_forward does not take the problem, or nullptr: it takes 1..kDecodeMaxRows query
// rows, S > 0, head sizes up to kDecodeMaxHead, fp16, bf16 or fp32 inputs, K and V rows read 16
// bytes at a time.
const char* decode_declines(const DevProblem& p);
// Floats of the workspace decode_forward needs (uninitialized): the logits and per-block sums of
// as many heads at a time as fit in 64 MiB, one head at least.
int64_t decode_workspace_floats(const DevProblem& p);
// O, P and lse into p.out, p.probs, p.lse, each key row of K and V read once. With stats
// (forward_stats), P is not written (p.probs.data nullptr) and the statistics asked for in
// *stats are reduced from the kept logits instead.
void decode_forward(const DevProblem& p, float* workspace, cudaStream_t stream, const StatsTargets* stats = nullptr);
// Why decode_forward does not take forward_stats's problem, or nullptr: it takes decode_declines's
// problems without dropout (the statistics are the dropout-free map's); column sums and entropy
// in fp32 (any strides), rows in any floating dtype and layout; at most 65535 chunks of 2048 keys
// (S up to about 134 million).
const char* decode_stats_declines(const DevProblem& p, const StatsTargets& t);

// The backward of the same problems in fp16/bf16 (dO, P and dP in the inputs' dtype), once
// g.delta holds rowsum(A . dA) (tensor_core_delta): dQ (and the mask gradient) added to g's
// accumulators, dK and dV stored into g.dk_out / g.dv_out or added to g.dk / g.dv.
const char* decode_backward_declines(const DevProblem& p);
void decode_backward_run(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream);
// How many query heads sharing one key head a decode CTA takes (1 without GQA). When it is the
// whole group, each key row's dK and dV are complete in one CTA, which may then store them into
// g.dk_out / g.dv_out.
int64_t decode_heads_per_cta(const DevProblem& p);

}  // namespace sdpa_math::cuda

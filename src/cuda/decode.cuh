// The split-key forward for a few query rows (decode), in decode.cu.
#pragma once

#include <cuda_runtime.h>

#include "device_problem.cuh"
#include "generic.cuh"

namespace sdpa_math::cuda {

constexpr int kDecodeMaxRows = 4;      // query rows per head it takes
constexpr int kDecodeMaxHead = 256;    // E and Ev

// Whether decode_forward takes the problem: 1..kDecodeMaxRows query rows, S > 0, head sizes up
// to kDecodeMaxHead, fp16, bf16 or fp32 inputs.
bool decode_applies(const DevProblem& p);
// Floats of the per-block statistics buffer decode_forward needs.
int64_t decode_stats_floats(const DevProblem& p);
// O, P and lse into p.out, p.probs, p.lse. `out_acc`: num_lead * L * Ev floats, zeroed.
void decode_forward(const DevProblem& p, float* stats, float* out_acc, cudaStream_t stream);

// The backward of the same problems in fp16/bf16, once g.delta holds rowsum(A . dA): dQ (and
// the mask gradient) added to g's accumulators, dK and dV stored into g.dk_out / g.dv_out or
// added to g.dk / g.dv.
bool decode_backward_applies(const DevProblem& p);
void decode_backward_run(const DevProblem& p, const BackwardBuffers<float>& g, cudaStream_t stream);

}  // namespace sdpa_math::cuda

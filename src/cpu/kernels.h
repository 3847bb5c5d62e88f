// The CPU backend: fp16, bf16 and fp32 inputs, fp32 accumulation, OpenMP threads over
// (head, query block) tasks. Each task keeps its block's scores in cache and writes P once.
#pragma once

#include "../core/problem.h"

namespace sdpa_math::cpu {

void forward(const core::Problem& p, const ForwardOutputs& out);
void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out);

// Query rows per task: the block's fp32 scores (rows x S) should stay in a core's L2.
int64_t rows_per_block(int64_t S);

}  // namespace sdpa_math::cpu

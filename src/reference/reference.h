// The float64 reference: every rule of contract.md written as plain loops, one element at a time.
// Slow and obviously right; the CPU and CUDA backends are tested against it.
#pragma once

#include "../core/problem.h"

namespace sdpa_math::reference {

void forward(const core::Problem& p, const ForwardOutputs& out);
void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out);
void forward_stats(const core::Problem& p, const StatsOutputs& out);
void kl_backward(const core::Problem& p, const KlBackwardArgs& args, const BackwardOutputs& out);
void kl_forward(const core::Problem& p, const KlForwardArgs& args, const TensorView& kl, const TensorView& row_sum);
void kl_rows(const KlRowsArgs& args, const TensorView& kl, const TensorView& row_sum);
void softmax_rows(const SoftmaxRowsArgs& args, const TensorView& out);

}  // namespace sdpa_math::reference

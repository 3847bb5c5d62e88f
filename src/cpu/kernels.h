// The CPU backend: fp16, bf16 and fp32 inputs, fp32 accumulation, OpenMP threads over
// (head, query block) tasks. Each task keeps its block's scores in cache and writes P once.
//
// The kernels exist once per x86-64 level (isa.h); forward and backward here pick the copy for
// this CPU (dispatch.cpp).
#pragma once

#include <string>

#include "../core/problem.h"

namespace sdpa_math::cpu {

void forward(const core::Problem& p, const ForwardOutputs& out);
void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out);
// Statistics of P without writing it (stats.cpp); no dropout (validated before).
void forward_stats(const core::Problem& p, const StatsOutputs& out);

// Each level's copy of the entry points (defined in forward.cpp, backward.cpp and stats.cpp compiled
// for it).
#define SDPA_MATH_CPU_DECLARE_LEVEL(level)                                                           \
  namespace level {                                                                                  \
  void forward(const core::Problem& p, const ForwardOutputs& out);                                   \
  void backward(const core::Problem& p, const BackwardArgs& args, const BackwardOutputs& out);       \
  void forward_stats(const core::Problem& p, const StatsOutputs& out);                               \
  }
SDPA_MATH_CPU_DECLARE_LEVEL(avx512)
SDPA_MATH_CPU_DECLARE_LEVEL(avx2)
SDPA_MATH_CPU_DECLARE_LEVEL(baseline)
#undef SDPA_MATH_CPU_DECLARE_LEVEL

}  // namespace sdpa_math::cpu

// The route of one CUDA call: which kernel runs it and why each path before it declined.
// backend.cu makes one plan per call (plan_forward, plan_backward, plan_stats) by asking each
// path, in order of preference, one question -- "why would you not take this problem?" --
// whose answer is nullptr for yes. The Hopper paths answer it by encoding their TMA maps, and
// the plan keeps what they prepared, so running the plan asks nothing again. The order of the
// paths is defined here and nowhere else; docs/design.md's route tables are checked against it
// by tests/python/test_explain.py.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../core/problem.h"
#include "device_problem.cuh"

namespace sdpa_math::cuda {

namespace sm90 {
struct ForwardPrepared;   // maps and arguments of the Hopper forward (forward_sm90.cu)
struct BackwardPrepared;  // the same of the Hopper backward (backward_sm90.cu)
}  // namespace sm90

// A path that declined, with its reason (a sentence fragment, lower case).
struct Declined {
  const char* path;
  std::string why;
};

enum class ForwardPath { Empty, Decode, Sm90, Sm80, CublasFp32, Generic };
enum class BackwardPath { Empty, CublasFp32, Decode, Sm90, Sm80, Generic };
enum class StatsPath { Decode, Sm90, None };

const char* path_name(ForwardPath p);
const char* path_name(BackwardPath p);
const char* path_name(StatsPath p);

struct ForwardPlan {
  ForwardPath path = ForwardPath::Generic;
  std::vector<Declined> declined;
  std::shared_ptr<const sm90::ForwardPrepared> sm90;  // path == Sm90 (the statistics form too)
};

struct BackwardPlan {
  BackwardPath path = BackwardPath::Generic;
  std::vector<Declined> declined;
  std::shared_ptr<const sm90::BackwardPrepared> sm90;  // path == Sm90
};

struct StatsPlan {
  StatsPath path = StatsPath::None;
  std::vector<Declined> declined;
  std::shared_ptr<const sm90::ForwardPrepared> sm90;  // path == Sm90
};

// The plans: every path asked in order, the first that takes the problem chosen.
ForwardPlan plan_forward(const DevProblem& dp);
BackwardPlan plan_backward(const core::Problem& p, const DevProblem& dp, const BackwardOutputs& out);
StatsPlan plan_stats(const DevProblem& dp, const StatsTargets& t);

}  // namespace sdpa_math::cuda

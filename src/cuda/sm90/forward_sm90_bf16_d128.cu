// The Hopper forward's kernels of bf16 inputs at head size 128 (E and Ev padded to 128): the
// 12 launch functions of the group (4 mask kinds x {P by TMA stores, P copied, statistics}),
// each compiling its kernel here, in a translation unit of its own so that a parallel build
// compiles the groups side by side. The host launcher is forward_sm90.cu.
#include "forward_sm90_kernel.cuh"

namespace sdpa_math::cuda::sm90::fwd {

SDPA_MATH_SM90_FWD_GROUP(template, __nv_bfloat16, 128)

}  // namespace sdpa_math::cuda::sm90::fwd

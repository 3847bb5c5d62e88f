// The tensor-core forward's kernels of bf16 inputs at head tile 64 (key tiles of 64 keys):
// launch_forward of the tile, compiling forward_tc's two variants (GENERAL true and false) here,
// in a translation unit of its own so that a parallel build compiles the tiles side by side.
// The host side is forward_sm80.cu.
#include "forward_sm80_kernel.cuh"

namespace sdpa_math::cuda::sm80 {

SDPA_MATH_SM80_FWD_TILE(template, __nv_bfloat16, 64, 64)

}  // namespace sdpa_math::cuda::sm80

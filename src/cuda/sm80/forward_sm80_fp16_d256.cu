// The tensor-core forward's kernels of fp16 inputs at head tile 256 (key tiles of 32 and 16 keys):
// launch_forward of both tiles, compiling forward_tc's two variants (GENERAL true and false) here,
// in a translation unit of its own so that a parallel build compiles the tiles side by side.
// The host side is forward_sm80.cu.
#include "forward_sm80_kernel.cuh"

namespace sdpa_math::cuda::sm80 {

SDPA_MATH_SM80_FWD_TILE(template, __half, 256, 32)
SDPA_MATH_SM80_FWD_TILE(template, __half, 256, 16)

}  // namespace sdpa_math::cuda::sm80

// The tensor-core backward's kernels of fp16 inputs at head tile 64 (key blocks of 64 keys):
// launch_backward of the tile, compiling backward_tc's two variants (GENERAL true and false)
// here, in a translation unit of its own so that a parallel build compiles the tiles side by
// side. The host side is backward_sm80.cu.
#include "backward_sm80_kernel.cuh"

namespace sdpa_math::cuda::sm80 {

SDPA_MATH_SM80_BWD_TILE(template, __half, 64, 64)

}  // namespace sdpa_math::cuda::sm80

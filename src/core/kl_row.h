// The KL of one row of kl_to from its sums (attention.h: kl_rows, kl_forward), one definition for
// the float64 reference and the CUDA kernels: Σ_j r log r − Σ_j r x + R lse; 0 for a row with no
// reference mass (R = 0), whatever the logits and the lse hold (NaN included); +inf where the
// reference has mass on a key the row does not see.
#pragma once

#include <cmath>

#include "sdpa_math/host_device.h"

namespace sdpa_math::core {

// xlogx = Σ_j r_ij log r_ij (natural log), rx = Σ_j r_ij x_ij over the keys the row sees, R = Σ_j
// r_ij, hidden = the reference's mass on keys the row does not see.
template <typename Acc>
SDPA_MATH_HD Acc kl_of_row(Acc xlogx, Acc rx, Acc R, Acc lse, Acc hidden) {
  if (hidden > Acc(0)) return static_cast<Acc>(INFINITY);
  return R != Acc(0) ? xlogx - rx + R * lse : Acc(0);
}

}  // namespace sdpa_math::core

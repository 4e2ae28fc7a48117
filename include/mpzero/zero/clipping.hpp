// mpzero: the gradient-clipping coefficient (clip by global L2 norm).
#pragma once

#include "../config.hpp"

namespace mpzero {

// The epsilon DeepSpeed adds to the norm before dividing (runtime/utils.py
// clip_grad_norm_, and ZeRO's unscale_and_clip_grads).
inline constexpr double clip_norm_epsilon = 1e-6;

// The multiplier for the gradients, given the global L2 norm of the *unscaled*
// gradients (over all partitions and ranks) and gradient_clipping = max_norm.
// Matches DeepSpeed: coefficient max_norm / (norm + 1e-6), applied only when it is
// below 1, so a norm equal to max_norm still scales by max_norm / (max_norm + 1e-6), and
// a max_norm below 1e-6 clips even a zero gradient. max_norm <= 0 (or NaN) disables
// clipping. A NaN, infinite or negative norm returns 1: such a step is an overflow and is
// skipped by the loss-scale logic before the coefficient is used (DeepSpeed likewise
// masks a non-finite norm to -1, which yields coefficient 1). Computed in double, where
// DeepSpeed uses fp32 tensors.
// ZeRO folds this into the unscale: grad *= clip_coefficient(norm, max_norm) / scale.
constexpr MPZERO_HOST_DEVICE double clip_coefficient(double global_norm, double max_norm) noexcept {
  if (!(max_norm > 0)) return 1.0;
  // Written without <cmath> so it stays constexpr and device-callable: NaN fails every
  // comparison, and the upper bound rejects +inf.
  if (!(global_norm >= 0 && global_norm <= 1.7976931348623157e308)) return 1.0;
  const double coef = max_norm / (global_norm + clip_norm_epsilon);
  return coef < 1.0 ? coef : 1.0;
}

}  // namespace mpzero

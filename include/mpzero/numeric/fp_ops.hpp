// mpzero: correctly rounded fp32 arithmetic that gives the same bits on host and
// device. Device code uses the _rn intrinsics, which nvcc never contracts into FMA
// and --use_fast_math never approximates; host code uses IEEE operations (build with
// -ffp-contract=off, which the mpzero::mpzero target sets for GCC and Clang). The
// update rules use no fused multiply-add: without hardware FMA the host would call
// a slow libm routine, and in a memory-bound step the extra rounding costs nothing.
#pragma once

#include <cmath>

#include "../config.hpp"

namespace mpzero::fp {

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE float add(float a, float b) noexcept {
#if MPZERO_IS_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE float sub(float a, float b) noexcept {
#if MPZERO_IS_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE float mul(float a, float b) noexcept {
#if MPZERO_IS_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE float div(float a, float b) noexcept {
#if MPZERO_IS_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE float sqrt(float a) noexcept {
#if MPZERO_IS_DEVICE_CODE
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE bool is_finite(float a) noexcept {
  return (__builtin_bit_cast(unsigned, a) & 0x7f800000u) != 0x7f800000u;
}

}  // namespace mpzero::fp

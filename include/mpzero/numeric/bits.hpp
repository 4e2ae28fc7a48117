// mpzero: bit reinterpretation usable in constexpr, host and device code.
#pragma once

#include <cstdint>

#include "../config.hpp"

namespace mpzero::detail {

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t float_as_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr float bits_as_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}

// Round-to-nearest-even decision shared by both 16-bit formats: `kept` is the
// truncated result, `rem` the discarded bits and `half` the value of half an ulp
// in the same units.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t round_nearest_even(std::uint32_t kept, std::uint32_t rem,
                                                                                   std::uint32_t half) noexcept {
  return kept + ((rem > half || (rem == half && (kept & 1u))) ? 1u : 0u);
}

// Stochastic decision: round the magnitude up with probability rem / 2^shift,
// using 32 uniform random bits. Exact for shift <= 32; for larger shifts the
// probability is truncated to 32 bits (bias below 2^-32 ulp).
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t round_stochastic(std::uint32_t kept, std::uint32_t rem,
                                                                                 unsigned shift,
                                                                                 std::uint32_t rand) noexcept {
  std::uint64_t threshold = 0;
  if (shift <= 32u) {
    threshold = static_cast<std::uint64_t>(rem) << (32u - shift);
  } else if (shift - 32u < 64u) {
    threshold = static_cast<std::uint64_t>(rem) >> (shift - 32u);
  }
  return kept + (static_cast<std::uint64_t>(rand) < threshold ? 1u : 0u);
}

}  // namespace mpzero::detail

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
// in the same units. Bitwise rather than || and &&: those compile to branches where
// a loop stays scalar, and the branches mispredict on random-looking remainders.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t round_nearest_even(std::uint32_t kept, std::uint32_t rem,
                                                                                   std::uint32_t half) noexcept {
  return kept + ((static_cast<std::uint32_t>(rem > half) | (static_cast<std::uint32_t>(rem == half) & kept)) & 1u);
}

// Stochastic decision: round the magnitude up with probability rem / 2^shift (rem <
// 2^shift), from 16 uniform random bits r: up iff r < rem * 2^(16 - shift). For
// shift <= 16 that probability is exact (r < rem << (16 - shift) is the same test as
// r >> (16 - shift) < rem: only the top `shift` bits of r decide). For shift > 16 the
// threshold rem >> (shift - 16) truncates the probability by less than 2^-16, so the
// expected result is low by less than 2^-16 ulp (fp16 subnormals; docs/precision.md).
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t round_stochastic(std::uint32_t kept, std::uint32_t rem,
                                                                                 unsigned shift,
                                                                                 std::uint16_t rand16) noexcept {
  std::uint32_t threshold = 0;
  if (shift <= 16u) {
    threshold = rem << (16u - shift);
  } else if (shift - 16u < 32u) {
    threshold = rem >> (shift - 16u);
  }
  return kept + (static_cast<std::uint32_t>(rand16) < threshold ? 1u : 0u);
}

}  // namespace mpzero::detail

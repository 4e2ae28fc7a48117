// mpzero: IEEE binary16 storage type and its conversions.
//
// Written in integer arithmetic and shared by host and device. They reproduce
// CUDA's __float2half_rn and __half2float bit for bit, including NaN
// canonicalisation (float NaN -> 0x7FFF, half NaN -> 0x7FFFFFFF) and subnormals.
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "bits.hpp"

namespace mpzero {

struct fp16 {
  std::uint16_t bits;

  static constexpr fp16 from_bits(std::uint16_t b) noexcept { return fp16{b}; }
  friend constexpr bool operator==(fp16 a, fp16 b) noexcept { return a.bits == b.bits; }
};
static_assert(sizeof(fp16) == 2 && alignof(fp16) == 2);

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr float to_float(fp16 x) noexcept {
  const std::uint32_t h = x.bits;
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {
    return detail::bits_as_float(mantissa != 0u ? 0x7fffffffu : (sign | 0x7f800000u));
  }
  if (exponent == 0u) {
    // Subnormal or zero: mantissa * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return detail::bits_as_float(detail::float_as_bits(magnitude) | sign);
  }
  return detail::bits_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

namespace detail {

// Splits |f| (given as magnitude bits `u`, finite and below 2^16) into the
// truncated half magnitude, the discarded bits and how many bits were discarded.
struct fp16_split {
  std::uint32_t kept;
  std::uint32_t rem;
  unsigned shift;
};

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr fp16_split split_for_fp16(std::uint32_t u) noexcept {
  if (u >= 0x38800000u) {  // result is a normal half: drop 13 mantissa bits, rebias
    return {(u - 0x38000000u) >> 13, u & 0x1fffu, 13u};
  }
  const std::uint32_t exponent = u >> 23;
  if (exponent == 0u) return {0u, u, 150u};  // float subnormal: far below half's range
  const std::uint32_t mantissa = (u & 0x7fffffu) | 0x800000u;
  const unsigned shift = 126u - exponent;  // >= 14
  if (shift >= 32u) return {0u, mantissa, shift};
  return {mantissa >> shift, mantissa & ((1u << shift) - 1u), shift};
}

}  // namespace detail

// Round to nearest, ties to even; |f| >= 65520 becomes infinity.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr fp16 fp16_from_float_rn(float f) noexcept {
  const std::uint32_t x = detail::float_as_bits(f);
  const std::uint32_t u = x & 0x7fffffffu;
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  if (u > 0x7f800000u) return fp16{0x7fffu};
  if (u >= 0x47800000u) return fp16{static_cast<std::uint16_t>(sign | 0x7c00u)};
  const detail::fp16_split s = detail::split_for_fp16(u);
  if (s.shift >= 32u) return fp16{static_cast<std::uint16_t>(sign)};  // below 2^-25: rounds to zero
  const std::uint32_t half = 1u << (s.shift - 1u);
  return fp16{static_cast<std::uint16_t>(sign | detail::round_nearest_even(s.kept, s.rem, half))};
}

// Stochastic rounding with 32 uniform random bits; E[to_float(result)] == f up to
// 2^-32 of an ulp. Values in [65504, 65536) may round to infinity, larger ones do.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr fp16 fp16_from_float_sr(float f, std::uint32_t rand) noexcept {
  const std::uint32_t x = detail::float_as_bits(f);
  const std::uint32_t u = x & 0x7fffffffu;
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  if (u > 0x7f800000u) return fp16{0x7fffu};
  if (u >= 0x47800000u) return fp16{static_cast<std::uint16_t>(sign | 0x7c00u)};
  const detail::fp16_split s = detail::split_for_fp16(u);
  return fp16{static_cast<std::uint16_t>(sign | detail::round_stochastic(s.kept, s.rem, s.shift, rand))};
}

}  // namespace mpzero

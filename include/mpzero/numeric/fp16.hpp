// mpzero: IEEE binary16 storage type and its conversions.
//
// Written in integer arithmetic and shared by host and device. They reproduce
// CUDA's __float2half_rn and __half2float bit for bit, including NaN
// canonicalisation (float NaN -> 0x7FFF, half NaN -> 0x7FFFFFFF) and subnormals.
// Device code runs the hardware's conversions instead (one cvt each, where the integer
// version costs dozens of operations); the integer versions stay as detail::*_soft, which
// the [gpu] tests hold against CUDA's intrinsics for every input, so host and device
// still give the same bits.
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

namespace detail {

// Shifts by a lane-dependent amount s in [0, 31] as five constant shifts blended
// with masks: SSE2 has no per-lane variable shift, and plain integer masks keep the
// code free of the branches that stop vectorization.
template <unsigned K>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t blend_if_bit(std::uint32_t s, std::uint32_t x,
                                                                          std::uint32_t shifted) noexcept {
  const std::uint32_t take = 0u - ((s / K) & 1u);  // all ones when bit K of s is set
  return (x & ~take) | (shifted & take);
}
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t shr_blend(std::uint32_t x, std::uint32_t s) noexcept {
  x = blend_if_bit<16>(s, x, x >> 16);
  x = blend_if_bit<8>(s, x, x >> 8);
  x = blend_if_bit<4>(s, x, x >> 4);
  x = blend_if_bit<2>(s, x, x >> 2);
  return blend_if_bit<1>(s, x, x >> 1);
}
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t shl_blend(std::uint32_t x, std::uint32_t s) noexcept {
  x = blend_if_bit<16>(s, x, x << 16);
  x = blend_if_bit<8>(s, x, x << 8);
  x = blend_if_bit<4>(s, x, x << 4);
  x = blend_if_bit<2>(s, x, x << 2);
  return blend_if_bit<1>(s, x, x << 1);
}

}  // namespace detail

// Branch-free, and in integer arithmetic only: host loops vectorize only code they
// may execute for every lane, and under -ftrapping-math (GCC's default) no FP
// operation may be executed speculatively.
namespace detail {

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr float fp16_to_float_soft(fp16 x) noexcept {
  const std::uint32_t h = x.bits;
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  const std::uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  // Subnormal: mantissa * 2^-24. Normalise the leading one to bit 9 in constant
  // shifts; d = 9 - floor(log2(mantissa)), and the float exponent is 103 + 9 - d.
  // Selects, not branches, so the host loops vectorize.
  std::uint32_t m = mantissa, d = 0;
  const auto normalise = [&](std::uint32_t below, std::uint32_t shift) {
    const bool c = m < below;
    m = c ? m << shift : m;
    d += c ? shift : 0u;
  };
  normalise(1u << 2, 8u);
  normalise(1u << 6, 4u);
  normalise(1u << 8, 2u);
  normalise(1u << 9, 1u);
  const std::uint32_t subnormal = sign | (mantissa == 0u ? 0u : (((112u - d) << 23) | ((m << 14) & 0x7fffffu)));
  const std::uint32_t special = mantissa != 0u ? 0x7fffffffu : (sign | 0x7f800000u);
  const std::uint32_t r = exponent == 0x1fu ? special : (exponent == 0u ? subnormal : normal);
  return detail::bits_as_float(r);
}

}  // namespace detail

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr float to_float(fp16 x) noexcept {
#if MPZERO_IS_DEVICE_CODE
  if (!__builtin_is_constant_evaluated()) {
    // cvt.f32.f16 is exact for every non-NaN input; a NaN becomes the canonical one, as
    // in the integer version (the hardware may keep the payload).
    const unsigned short h = x.bits;
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return (h & 0x7fffu) > 0x7c00u ? detail::bits_as_float(0x7fffffffu) : r;
  }
#endif
  return detail::fp16_to_float_soft(x);
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

// Round to nearest, ties to even; |f| >= 65520 becomes infinity. Branch-free: the
// normal and the subnormal result are both computed, then selected.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr fp16 fp16_from_float_rn_soft(float f) noexcept {
  const std::uint32_t x = detail::float_as_bits(f);
  const std::uint32_t u = x & 0x7fffffffu;
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const bool normal = u >= 0x38800000u;
  // Below half's normal range (float exponent <= 112) the significand shifts right by
  // 126 - exponent >= 14; from 31 on the result is zero (the remainder stays below
  // half an ulp), so clamping the shift to 31 is exact.
  const std::uint32_t exponent = u >> 23;
  const std::uint32_t sh = exponent - 95u <= 31u ? 126u - exponent : 31u;  // exponent in [95, 126]
  const std::uint32_t mantissa = (u & 0x7fffffu) | 0x800000u;
  const std::uint32_t sub_kept = detail::shr_blend(mantissa, sh);
  const std::uint32_t unit = detail::shl_blend(1u, sh);
  const std::uint32_t kept = normal ? (u - 0x38000000u) >> 13 : sub_kept;
  const std::uint32_t rem = normal ? (u & 0x1fffu) : mantissa & (unit - 1u);
  const std::uint32_t half = normal ? 0x1000u : unit >> 1;
  std::uint32_t r = sign | detail::round_nearest_even(kept, rem, half);
  r = u >= 0x47800000u ? (sign | 0x7c00u) : r;
  r = u > 0x7f800000u ? 0x7fffu : r;
  return fp16{static_cast<std::uint16_t>(r)};
}

}  // namespace detail

// Round to nearest, ties to even; |f| >= 65520 becomes infinity; NaN becomes 0x7FFF.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr fp16 fp16_from_float_rn(float f) noexcept {
#if MPZERO_IS_DEVICE_CODE
  if (!__builtin_is_constant_evaluated()) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return fp16{h};
  }
#endif
  return detail::fp16_from_float_rn_soft(f);
}

// Stochastic rounding with 16 uniform random bits. A normal half result discards 13
// bits of the float significand: rounding up iff rand16 < rem << 3 is the same test as
// (rand16 >> 3) < rem, an exact probability rem / 2^13, so E[to_float(result)] == f.
// A subnormal half result discards more than 16 bits where |f| < 2^-17; the
// probability is then truncated to 16 bits and the expected result is low by less than
// 2^-16 ulp (docs/precision.md). Values in [65504, 65536) may round to infinity,
// larger ones do.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr fp16 fp16_from_float_sr(float f, std::uint16_t rand16) noexcept {
  const std::uint32_t x = detail::float_as_bits(f);
  const std::uint32_t u = x & 0x7fffffffu;
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  if (u > 0x7f800000u) return fp16{0x7fffu};
  if (u >= 0x47800000u) return fp16{static_cast<std::uint16_t>(sign | 0x7c00u)};
  const detail::fp16_split s = detail::split_for_fp16(u);
  return fp16{static_cast<std::uint16_t>(sign | detail::round_stochastic(s.kept, s.rem, s.shift, rand16))};
}

}  // namespace mpzero

// mpzero: bfloat16 storage type and its conversions.
//
// Conversions are written once, in integer arithmetic, and used on host and device
// (device code from sm_80 on rounds to nearest with the hardware's cvt, which gives the
// same bits), so both give the same bits. They reproduce CUDA's __float2bfloat16_rn and
// __bfloat162float exactly (NaN becomes the canonical 0x7FFF); tests check every
// 16-bit pattern and every rounding boundary.
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "bits.hpp"

namespace mpzero {

struct bf16 {
  std::uint16_t bits;

  static constexpr bf16 from_bits(std::uint16_t b) noexcept { return bf16{b}; }
  friend constexpr bool operator==(bf16 a, bf16 b) noexcept { return a.bits == b.bits; }
};
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2);

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr float to_float(bf16 x) noexcept {
  return detail::bits_as_float(static_cast<std::uint32_t>(x.bits) << 16);
}

// Round to nearest, ties to even. Overflow goes to infinity, as IEEE requires.
// Adding 0x7fff plus the kept part's lowest bit carries into the kept bits exactly when
// the discarded half exceeds one half, or equals it and the kept part is odd: the same
// decision as detail::round_nearest_even (tests check every rounding boundary), in three
// integer operations instead of seven, which the vectorized host step, rounding three
// values per element under bf16_all, feels. Infinities stay (their low half is zero);
// NaN takes one select, as in bf16_from_float_sr.
//
// Device code from sm_80 on runs the hardware's cvt.rn.bf16.f32 instead; the integer
// version stays as detail::bf16_from_float_rn_soft, which the [gpu] tests hold against
// CUDA's __float2bfloat16_rn for every input.
namespace detail {

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr bf16 bf16_from_float_rn_soft(float f) noexcept {
  const std::uint32_t u = detail::float_as_bits(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return bf16{static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : rounded)};  // NaN: canonical
}

}  // namespace detail

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr bf16 bf16_from_float_rn(float f) noexcept {
#if MPZERO_IS_DEVICE_CODE && __CUDA_ARCH__ >= 800
  if (!__builtin_is_constant_evaluated()) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return bf16{h};
  }
#endif
  return detail::bf16_from_float_rn_soft(f);
}

// Stochastic rounding: the magnitude rounds up with probability equal to the
// discarded fraction, so E[to_float(result)] == f exactly: float -> bf16 discards
// exactly 16 bits, and `rand16` supplies 16 uniform bits, so adding them carries into
// the kept bits with probability (discarded bits) / 2^16. Values beyond the largest
// finite bf16 may round to infinity with the probability that proportion implies; NaN
// and infinities pass through.
//
// Infinities need no case of their own: adding less than 2^16 to 0x7f800000 or
// 0xff800000 leaves the top 16 bits as they are. One select (for NaN) instead of
// three keeps the vectorized host step short: it rounds three values per element.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr bf16 bf16_from_float_sr(float f, std::uint16_t rand16) noexcept {
  const std::uint32_t u = detail::float_as_bits(f);
  const std::uint32_t rounded = (u + rand16) >> 16;
  return bf16{static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : rounded)};
}

}  // namespace mpzero

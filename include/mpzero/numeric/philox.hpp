// mpzero: Philox4x32-10, a counter-based random number generator (Salmon et al.,
// "Parallel random numbers: as easy as 1, 2, 3", SC'11). Pure function of
// (counter, key), so any thread on any backend can draw the bits of any element.
#pragma once

#include <cstdint>

#include "../config.hpp"

namespace mpzero {

struct philox_u32x4 {
  std::uint32_t v[4];
};

namespace detail {

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr void mulhilo32(std::uint32_t a, std::uint32_t b, std::uint32_t& hi,
                                                                std::uint32_t& lo) noexcept {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

}  // namespace detail

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr philox_u32x4 philox4x32_10(philox_u32x4 ctr, std::uint32_t k0,
                                                                            std::uint32_t k1) noexcept {
  constexpr std::uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
  constexpr std::uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0 = 0, lo0 = 0, hi1 = 0, lo1 = 0;
    detail::mulhilo32(m0, ctr.v[0], hi0, lo0);
    detail::mulhilo32(m1, ctr.v[2], hi1, lo1);
    ctr = philox_u32x4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += w0;
    k1 += w1;
  }
  return ctr;
}

// 128 random bits for one (seed, step, counter): counter words (index low, index high,
// step low, step high), key = seed. Pure, so every backend and thread agrees.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr philox_u32x4 philox_draw(std::uint64_t seed, std::uint64_t step,
                                                                          std::uint64_t index) noexcept {
  return philox4x32_10(philox_u32x4{{static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                                     static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32)}},
                       static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

// 128 random bits counted by an element's global index: for generating data (tests,
// examples). Stochastic rounding draws from its own stream (numeric/rounding_bits.hpp).
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr philox_u32x4 element_random_bits(std::uint64_t seed, std::uint64_t step,
                                                                                  std::uint64_t global_index) noexcept {
  return philox_draw(seed, step, global_index);
}

}  // namespace mpzero

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
// examples). Stochastic rounding uses pair_random_bits and element_pair_bits below.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr philox_u32x4 element_random_bits(std::uint64_t seed, std::uint64_t step,
                                                                                  std::uint64_t global_index) noexcept {
  return philox_draw(seed, step, global_index);
}

// ---- Stochastic-rounding bits: one Philox draw per pair of elements -------------------
//
// Rounding to a 16-bit format needs 16 random bits per value (docs/precision.md), and an
// element rounds at most four values (its master and up to three optimizer states). So
// one 128-bit draw serves two elements: elements 2p and 2p + 1 share the draw of pair p,
// keyed by (seed, step, p = global index / 2). Its eight 16-bit halves, half h being bits
// [16 (h % 2), 16 (h % 2) + 16) of word h / 2, go four to each element: halves 0-3 (words
// 0, 1) to the even element, halves 4-7 (words 2, 3) to the odd one. Drawing per pair
// halves the generator's cost, which bounds the host step (docs/perf.md, "Host step
// against copy bandwidth"). The global
// index never changes with chunking, threads, backend or sharding, and neither do the bits.

// The four 16-bit halves of one element, in two words: half j is bits
// [16 (j % 2), 16 (j % 2) + 16) of w[j / 2]. The master rounds with half 0, optimizer
// state k with half 1 + k (see update_element_with_bits).
struct element_bits {
  std::uint32_t w[2];

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint16_t half(int j) const noexcept {
    return static_cast<std::uint16_t>(w[j >> 1] >> ((j & 1) * 16));
  }
};

// The draw of pair p = global_index / 2.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr philox_u32x4 pair_random_bits(std::uint64_t seed, std::uint64_t step,
                                                                               std::uint64_t pair_index) noexcept {
  return philox_draw(seed, step, pair_index);
}

// Which word of its pair's draw is word w (0 or 1) of the element with index parity
// `odd`: the one definition of the split, shared by every backend (the host's vector
// generator selects words with it too).
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr int pair_word(unsigned odd, int w) noexcept {
  return static_cast<int>(2u * odd) + w;
}

// The element's share of its pair's draw. Selects rather than indexes with a run-time
// value, so device code keeps `draw` in registers.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr element_bits element_pair_bits(const philox_u32x4& draw,
                                                                                std::uint64_t global_index) noexcept {
  const bool odd = (global_index & 1u) != 0;
  return element_bits{{odd ? draw.v[pair_word(1, 0)] : draw.v[pair_word(0, 0)],
                       odd ? draw.v[pair_word(1, 1)] : draw.v[pair_word(0, 1)]}};
}

// The rounding bits of one element, drawn on their own (the other half of the pair's
// draw is discarded): for single elements and references; loops share draws per pair.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr element_bits element_rounding_bits(std::uint64_t seed, std::uint64_t step,
                                                                                    std::uint64_t global_index) noexcept {
  return element_pair_bits(pair_random_bits(seed, step, global_index >> 1), global_index);
}

}  // namespace mpzero

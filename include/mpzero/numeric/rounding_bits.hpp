// mpzero: the random bits of stochastic rounding (docs/precision.md, "Where the random
// bits come from"). Pure functions of (seed, step, global element index), so every
// backend, thread count, chunking and ZeRO stage gives the same bits.
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "philox.hpp"

namespace mpzero {

// The stream's identifier, recorded in checkpoints (zero/checkpoint.hpp): stream 1 drew
// one Philox4x32-10 per pair of elements; stream 2 is the one below.
inline constexpr std::uint32_t rounding_stream = 2;

// Stream 2. Rounding to a 16-bit format needs 16 random bits per value, and an element
// rounds at most four values (its master and up to three optimizer states), so each
// element gets two 32-bit words, w0 and w1 (four 16-bit halves; half j is bits
// [16 (j % 2), 16 (j % 2) + 16) of w[j / 2]). The master rounds with half 0, optimizer
// state k with half 1 + k.
//
// Word j of element g is a keyed 32-bit permutation of the counter c = 2 g + j:
//   key  = Philox4x32-10(counter (step low, step high, 0x53520002, 0), key (seed low, seed high))
//   x    = low32(c) ^ key[0]
//   x   ^= x >> 16;  x *= 0x21f0aaad
//   x   ^= x >> 15;  x ^= key[1] ^ high32(c) * 0x9e3779b9;  x *= 0x735a2d97
//   x   ^= x >> 15;  x ^= key[2];  x *= 0x31848bab
//   x   ^= x >> 14
// The first two rounds are lowbias32 as improved in Chris Wellons' hash-prospector (an
// integer hash searched for low avalanche bias), the third takes triple32's last
// multiplier and shift; the key enters before each multiply, so two steps' permutations
// are not shifts of one another. Two rounds alone fail dieharder's 4-D minimum-distance
// test on the element-order stream; three pass the whole battery (docs/perf.md). One
// Philox draw per (seed, step) makes the key, and an element costs six 32-bit multiplies
// (three per word) where stream 1 cost ten (a Philox4x32-10 draw, 20 multiplies, per pair
// of elements) plus the bookkeeping of sharing a draw: the same arithmetic in a plain
// loop takes 0.33 against 0.70 ns per element on one Xeon core (AVX-512).
// Statistical checks: tests/test_numeric.cpp (uniform halves, no correlation across
// neighbours, words or steps) and docs/precision.md (dieharder).
struct rounding_key {
  std::uint32_t k[4];
};

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr rounding_key rounding_key_of(std::uint64_t seed,
                                                                           std::uint64_t step) noexcept {
  const philox_u32x4 d = philox4x32_10(
      philox_u32x4{{static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32), 0x53520002u, 0u}},
      static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  return rounding_key{{d.v[0], d.v[1], d.v[2], d.v[3]}};
}

// The key word injected before the second multiply, for counters whose high 32 bits are
// `counter_high` (all elements below 2^31 share one): loops compute it once per block.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t rounding_inner_key(const rounding_key& key,
                                                                               std::uint32_t counter_high) noexcept {
  return key.k[1] ^ counter_high * 0x9e3779b9u;
}

// Word of the counter whose low 32 bits are `counter_low`; `inner_key` is
// rounding_inner_key of its high half.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t rounding_word(const rounding_key& key, std::uint32_t inner_key,
                                                                          std::uint32_t counter_low) noexcept {
  std::uint32_t x = counter_low ^ key.k[0];
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x ^= inner_key;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  x ^= key.k[2];
  x *= 0x31848babu;
  x ^= x >> 14;
  return x;
}

// The four 16-bit halves of one element, in two words.
struct element_bits {
  std::uint32_t w[2];

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint16_t half(int j) const noexcept {
    return static_cast<std::uint16_t>(w[j >> 1] >> ((j & 1) * 16));
  }
};

// The bits of element g. `Words` (1 or 2) says how many words the caller reads: a
// policy that rounds at most two values per element (a 16-bit master with one 16-bit
// state, or a 16-bit master alone) never reads w1, which is then left zero.
template <int Words = 2>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr element_bits element_rounding_bits(const rounding_key& key,
                                                                                    std::uint64_t global_index) noexcept {
  static_assert(Words == 1 || Words == 2, "an element has two words of rounding bits");
  const std::uint64_t c = 2 * global_index;  // even: c + 1 has the same high word
  const std::uint32_t inner = rounding_inner_key(key, static_cast<std::uint32_t>(c >> 32));
  const std::uint32_t lo = static_cast<std::uint32_t>(c);
  return element_bits{{rounding_word(key, inner, lo), Words > 1 ? rounding_word(key, inner, lo + 1u) : 0u}};
}

// The same, with the key made from (seed, step): for single elements and references
// (loops make the key once).
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr element_bits element_rounding_bits(std::uint64_t seed, std::uint64_t step,
                                                                                    std::uint64_t global_index) noexcept {
  return element_rounding_bits<2>(rounding_key_of(seed, step), global_index);
}

}  // namespace mpzero

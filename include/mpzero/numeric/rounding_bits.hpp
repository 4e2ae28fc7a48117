// mpzero: the random bits of stochastic rounding (docs/precision.md, "Where the random
// bits come from"). Pure functions of (seed, step, global element index), so every
// backend, thread count, chunking and ZeRO stage gives the same bits.
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "philox.hpp"

namespace mpzero {

// The stream's identifier, recorded in checkpoints (zero/checkpoint.hpp): stream 1 drew
// one Philox4x32-10 per pair of elements, stream 2 two three-round hashes per element;
// stream 3 is the one below.
inline constexpr std::uint32_t rounding_stream = 3;

// Stream 3. Rounding to a 16-bit format needs 16 random bits per value, and an element
// rounds at most four values (its master and up to three optimizer states). Elements
// come in pairs, p = g / 2, and a pair hashes its index once into a 32-bit state that
// up to four words, u = 0..3, branch from:
//   key  = Philox4x32-10(counter (step low, step high, 0x53520003, 0), key (seed low, seed high))
//   x    = low32(p) ^ key[0];  x ^= x >> 16;  x *= 0x21f0aaad;  x ^= x >> 15     (the pair's state)
//   y    = x ^ key[1] ^ high32(p) * 0x9e3779b9 ^ salt[u];  y *= 0x735a2d97       (word u)
//   y   ^= y >> 15;  y ^= key[2];  y *= 0x31848bab;  y ^= y >> 14
// with salt = {0, 0x6a09e667, 0xbb67ae85, 0x3c6ef372}. Each word is stream 2's
// three-round hash (lowbias32 as improved in Chris Wellons' hash-prospector, then
// triple32's last multiplier and shift; the key enters before every multiply) of the
// pair index, with the salt before the second multiply. Element g = 2 p + t (t = g % 2)
// takes both halves of word t (w0: master, state 0) and half t of words 2 and 3 (w1:
// states 1 and 2). Under Adam with 16-bit states an element rounds three values, so a
// pair hashes its state and three words: 1 + 3 x 2 = 7 multiplies, 3.5 per element
// (stream 2: 6), and every bit still goes through three multiplies after its counter.
// Two rounds after the counter fail dieharder's 4-D minimum-distance test in element
// order; three pass the whole battery (docs/perf.md).
// Statistical checks: tests/test_numeric.cpp (uniform halves, no dependence across
// neighbours, pairs, words or steps) and docs/precision.md (dieharder).
struct rounding_key {
  std::uint32_t k[4];
};

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr rounding_key rounding_key_of(std::uint64_t seed,
                                                                           std::uint64_t step) noexcept {
  const philox_u32x4 d = philox4x32_10(
      philox_u32x4{{static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32), 0x53520003u, 0u}},
      static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  return rounding_key{{d.v[0], d.v[1], d.v[2], d.v[3]}};
}

// The key word injected before the second multiply, for pairs whose index has the high
// 32 bits `pair_high` (all elements below 2^33 share one): loops compute it once per block.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t rounding_inner_key(const rounding_key& key,
                                                                               std::uint32_t pair_high) noexcept {
  return key.k[1] ^ pair_high * 0x9e3779b9u;
}

// The state the words of the pair whose index has the low 32 bits `pair_low` branch from.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t rounding_pair_state(const rounding_key& key,
                                                                                std::uint32_t pair_low) noexcept {
  std::uint32_t x = pair_low ^ key.k[0];
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  return x ^ (x >> 15);
}

// The salt of word u (0-3): what sets a pair's words apart before their second multiply.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t rounding_salt(unsigned u) noexcept {
  return u == 0 ? 0u : u == 1 ? 0x6a09e667u : u == 2 ? 0xbb67ae85u : 0x3c6ef372u;
}

// A word of a pair: `state` is rounding_pair_state of the pair index's low half, `inner`
// rounding_inner_key of its high half, `salt` rounding_salt of the word's number.
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint32_t rounding_word(const rounding_key& key, std::uint32_t inner,
                                                                          std::uint32_t state, std::uint32_t salt) noexcept {
  std::uint32_t y = state ^ inner ^ salt;
  y *= 0x735a2d97u;
  y ^= y >> 15;
  y ^= key.k[2];
  y *= 0x31848babu;
  return y ^ (y >> 14);
}

// The four 16-bit halves of one element, in two words: half j is bits
// [16 (j % 2), 16 (j % 2) + 16) of w[j / 2]. The master rounds with half 0, optimizer
// state k with half 1 + k.
struct element_bits {
  std::uint32_t w[2];

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr std::uint16_t half(int j) const noexcept {
    return static_cast<std::uint16_t>(w[j >> 1] >> ((j & 1) * 16));
  }
};

// The bits of element g. `Halves` (1-4) says how many halves the caller reads: a policy
// that rounds at most two values per element (a 16-bit master with one 16-bit state, or
// a 16-bit master alone) reads halves 0 and 1 and never hashes words 2 and 3; halves it
// does not read are left zero.
template <int Halves = 4>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr element_bits element_rounding_bits(const rounding_key& key,
                                                                                    std::uint64_t global_index) noexcept {
  static_assert(Halves >= 1 && Halves <= 4, "an element has four halves of rounding bits");
  const std::uint64_t p = global_index >> 1;
  const std::uint32_t t = static_cast<std::uint32_t>(global_index & 1u), shift = 16u * t;
  const std::uint32_t inner = rounding_inner_key(key, static_cast<std::uint32_t>(p >> 32));
  const std::uint32_t x = rounding_pair_state(key, static_cast<std::uint32_t>(p));
  element_bits e{{rounding_word(key, inner, x, rounding_salt(t)), 0u}};
  if constexpr (Halves > 2) e.w[1] = (rounding_word(key, inner, x, rounding_salt(2)) >> shift) & 0xffffu;
  if constexpr (Halves > 3) e.w[1] |= ((rounding_word(key, inner, x, rounding_salt(3)) >> shift) & 0xffffu) << 16;
  return e;
}

// The same, with the key made from (seed, step): for single elements and references
// (loops make the key once).
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr element_bits element_rounding_bits(std::uint64_t seed, std::uint64_t step,
                                                                                    std::uint64_t global_index) noexcept {
  return element_rounding_bits<4>(rounding_key_of(seed, step), global_index);
}

}  // namespace mpzero

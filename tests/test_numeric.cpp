// Conversions, stochastic rounding and the counter-based RNG.
//
// References here are computed from values (ldexp, distances in long double), not
// from bit tricks, so they share nothing with the code under test. Where the CUDA
// toolkit's headers are present, the same inputs are also compared with CUDA's own
// host implementations of the conversion intrinsics and of curand's Philox.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <mpzero/numeric/bf16.hpp>
#include <mpzero/numeric/convert.hpp>
#include <mpzero/numeric/fp16.hpp>
#include <mpzero/numeric/philox.hpp>
#include <mpzero/numeric/rounding_bits.hpp>

#if defined(MPZERO_TEST_CUDA_HEADERS)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <curand_philox4x32_x.h>
#endif

using namespace mpzero;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Value of a 16-bit float with `exp_bits` exponent bits and `man_bits` mantissa
// bits, from its definition; NaN for NaN patterns.
long double decode(std::uint16_t h, int exp_bits, int man_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int sign = h >> 15;
  const int e = (h >> man_bits) & ((1 << exp_bits) - 1);
  const int m = h & ((1 << man_bits) - 1);
  long double v;
  if (e == (1 << exp_bits) - 1) {
    if (m != 0) return std::numeric_limits<long double>::quiet_NaN();
    v = std::numeric_limits<long double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(static_cast<long double>(m), 1 - bias - man_bits);
  } else {
    v = std::ldexp(static_cast<long double>(m + (1 << man_bits)), e - bias - man_bits);
  }
  return sign ? -v : v;
}

long double decode_bf16(std::uint16_t h) { return decode(h, 8, 7); }
long double decode_fp16(std::uint16_t h) { return decode(h, 5, 10); }

// Nearest-even rounding of a finite float by comparing distances to every
// candidate's value: the largest finite value's successor is "infinity" at
// max + ulp, per IEEE 754's overflow rule.
template <class Decode>
std::uint16_t reference_round(float x, Decode decode_fn, std::uint16_t max_finite, std::uint16_t inf_bits) {
  const long double v = std::fabs(static_cast<long double>(x));
  // Binary search for the largest non-negative pattern whose value <= v.
  std::uint16_t lo = 0, hi = max_finite;
  if (decode_fn(max_finite) <= v) {
    lo = max_finite;
  } else {
    while (hi - lo > 1) {
      const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi) / 2);
      if (decode_fn(mid) <= v) lo = mid; else hi = mid;
    }
  }
  const long double below = decode_fn(lo);
  std::uint16_t pick = lo;
  if (below != v) {
    const long double above = lo == max_finite ? below + (below - decode_fn(max_finite - 1)) : decode_fn(lo + 1);
    const long double d_below = v - below, d_above = above - v;
    if (d_above < d_below || (d_above == d_below && (lo & 1u))) pick = static_cast<std::uint16_t>(lo + 1);
  }
  if (pick > max_finite) pick = inf_bits;
  return static_cast<std::uint16_t>(pick | (std::signbit(x) ? 0x8000u : 0u));
}

std::uint16_t reference_bf16(float x) { return reference_round(x, decode_bf16, 0x7f7f, 0x7f80); }
std::uint16_t reference_fp16(float x) { return reference_round(x, decode_fp16, 0x7bff, 0x7c00); }

// Floats around every rounding boundary of a 16-bit format: each finite pattern's
// value, the midpoint to its successor, and the floats either side of both.
template <class Decode>
std::vector<float> boundary_floats(Decode decode_fn, std::uint16_t max_finite) {
  std::vector<float> out;
  for (std::uint32_t h = 0; h <= max_finite; ++h) {
    for (int sign : {1, -1}) {
      const float v = static_cast<float>(sign * decode_fn(static_cast<std::uint16_t>(h)));
      const long double next = h == max_finite ? 2 * decode_fn(max_finite) - decode_fn(max_finite - 1)
                                               : decode_fn(static_cast<std::uint16_t>(h + 1));
      const long double mid_ld = (decode_fn(static_cast<std::uint16_t>(h)) + next) / 2;
      const float mid = static_cast<float>(sign * mid_ld);
      for (float f : {v, mid}) {
        out.push_back(f);
        out.push_back(std::nextafter(f, std::numeric_limits<float>::infinity()));
        out.push_back(std::nextafter(f, -std::numeric_limits<float>::infinity()));
      }
    }
  }
  return out;
}

std::vector<float> special_floats() {
  const float inf = std::numeric_limits<float>::infinity();
  return {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(),
          std::numeric_limits<float>::min(), std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
          65504.0f, 65519.99f, 65520.0f, -65520.0f, 0x1p-24f, 0x1p-25f, std::nextafter(0x1p-25f, 1.0f), 0x1p-14f,
          3.3895314e38f, 3.39e38f};
}

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<float> out;
  out.reserve(n);
  while (out.size() < n) {
    const float f = float_of(static_cast<std::uint32_t>(gen()));
    if (!std::isnan(f)) out.push_back(f);
  }
  return out;
}

}  // namespace

TEST_CASE("bf16 -> float is exact for all 65536 patterns", "[numeric]") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = to_float(bf16::from_bits(static_cast<std::uint16_t>(h)));
    const long double ref = decode_bf16(static_cast<std::uint16_t>(h));
    if (std::isnan(ref)) {
      REQUIRE(std::isnan(f));
      REQUIRE(bits_of(f) == h << 16);  // bf16 -> float keeps the payload, as CUDA does
    } else {
      REQUIRE(static_cast<long double>(f) == ref);
      REQUIRE(std::signbit(f) == ((h & 0x8000u) != 0));
    }
  }
}

TEST_CASE("fp16 -> float is exact for all 65536 patterns, NaN canonical", "[numeric]") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = to_float(fp16::from_bits(static_cast<std::uint16_t>(h)));
    const long double ref = decode_fp16(static_cast<std::uint16_t>(h));
    if (std::isnan(ref)) {
      REQUIRE(bits_of(f) == 0x7fffffffu);
    } else {
      REQUIRE(static_cast<long double>(f) == ref);
      REQUIRE(std::signbit(f) == ((h & 0x8000u) != 0));
      // GCC's _Float16 is an independent IEEE implementation.
      _Float16 x;
      const std::uint16_t hh = static_cast<std::uint16_t>(h);
      std::memcpy(&x, &hh, 2);
      REQUIRE(bits_of(static_cast<float>(x)) == bits_of(f));
    }
  }
}

TEST_CASE("float -> bf16 rounds to nearest even at every boundary", "[numeric]") {
  auto inputs = boundary_floats(decode_bf16, 0x7f7f);
  for (float f : special_floats()) inputs.push_back(f);
  for (float f : random_floats(1 << 20, 1)) inputs.push_back(f);
  for (float f : inputs) {
    INFO("x = " << f << " bits 0x" << std::hex << bits_of(f));
    REQUIRE(bf16_from_float_rn(f).bits == reference_bf16(f));
  }
  // Every bf16 value converts back to itself.
  for (std::uint32_t h = 0; h < 65536; ++h) {
    if (std::isnan(decode_bf16(static_cast<std::uint16_t>(h)))) continue;
    REQUIRE(bf16_from_float_rn(to_float(bf16::from_bits(static_cast<std::uint16_t>(h)))).bits == h);
  }
}

TEST_CASE("float -> bf16: NaN is canonical, overflow goes to infinity", "[numeric]") {
  REQUIRE(bf16_from_float_rn(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  REQUIRE(bf16_from_float_rn(-std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  REQUIRE(bf16_from_float_rn(float_of(0x7f800001u)).bits == 0x7fff);  // signalling NaN stays NaN
  REQUIRE(bf16_from_float_rn(std::numeric_limits<float>::max()).bits == 0x7f80);
  REQUIRE(bf16_from_float_rn(-std::numeric_limits<float>::max()).bits == 0xff80);
  REQUIRE(bf16_from_float_rn(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  REQUIRE(bf16_from_float_rn(float_of(0x00008000u)).bits == 0x0000);  // tie to even (zero)
  REQUIRE(bf16_from_float_rn(float_of(0x00018000u)).bits == 0x0002);  // tie to even (up)
}

TEST_CASE("float -> fp16 rounds to nearest even at every boundary", "[numeric]") {
  auto inputs = boundary_floats(decode_fp16, 0x7bff);
  for (float f : special_floats()) inputs.push_back(f);
  for (float f : random_floats(1 << 20, 2)) inputs.push_back(f);
  for (float f : inputs) {
    INFO("x = " << f << " bits 0x" << std::hex << bits_of(f));
    const std::uint16_t got = fp16_from_float_rn(f).bits;
    REQUIRE(got == reference_fp16(f));
    const _Float16 gcc = static_cast<_Float16>(f);  // independent implementation
    std::uint16_t gcc_bits;
    std::memcpy(&gcc_bits, &gcc, 2);
    REQUIRE(got == gcc_bits);
  }
  for (std::uint32_t h = 0; h < 65536; ++h) {
    if (std::isnan(decode_fp16(static_cast<std::uint16_t>(h)))) continue;
    REQUIRE(fp16_from_float_rn(to_float(fp16::from_bits(static_cast<std::uint16_t>(h)))).bits == h);
  }
}

TEST_CASE("float -> fp16: NaN, infinity, overflow and underflow", "[numeric]") {
  REQUIRE(fp16_from_float_rn(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  REQUIRE(fp16_from_float_rn(-std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  REQUIRE(fp16_from_float_rn(std::numeric_limits<float>::infinity()).bits == 0x7c00);
  REQUIRE(fp16_from_float_rn(-std::numeric_limits<float>::infinity()).bits == 0xfc00);
  REQUIRE(fp16_from_float_rn(65504.0f).bits == 0x7bff);
  REQUIRE(fp16_from_float_rn(std::nextafter(65520.0f, 0.0f)).bits == 0x7bff);
  REQUIRE(fp16_from_float_rn(65520.0f).bits == 0x7c00);
  REQUIRE(fp16_from_float_rn(-1e10f).bits == 0xfc00);
  REQUIRE(fp16_from_float_rn(0x1p-24f).bits == 0x0001);                          // smallest subnormal
  REQUIRE(fp16_from_float_rn(0x1p-25f).bits == 0x0000);                          // tie to even: zero
  REQUIRE(fp16_from_float_rn(std::nextafter(0x1p-25f, 1.0f)).bits == 0x0001);    // just above the tie
  REQUIRE(fp16_from_float_rn(-std::nextafter(0x1p-25f, 1.0f)).bits == 0x8001);
  REQUIRE(fp16_from_float_rn(0x3p-25f).bits == 0x0002);                          // 1.5 ulp: tie to even (up)
  REQUIRE(fp16_from_float_rn(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  REQUIRE(fp16_from_float_rn(-0.0f).bits == 0x8000);
}

#if defined(MPZERO_TEST_CUDA_HEADERS)
TEST_CASE("conversions match CUDA's intrinsics (host implementations in the toolkit headers)", "[numeric]") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto hh = static_cast<unsigned short>(h);
    REQUIRE(bits_of(to_float(fp16::from_bits(hh))) == bits_of(__half2float(__ushort_as_half(hh))));
    REQUIRE(bits_of(to_float(bf16::from_bits(hh))) == bits_of(__bfloat162float(__ushort_as_bfloat16(hh))));
  }
  auto inputs = boundary_floats(decode_fp16, 0x7bff);
  const auto b = boundary_floats(decode_bf16, 0x7f7f);
  inputs.insert(inputs.end(), b.begin(), b.end());
  for (float f : special_floats()) inputs.push_back(f);
  inputs.push_back(std::numeric_limits<float>::quiet_NaN());
  inputs.push_back(-std::numeric_limits<float>::quiet_NaN());
  for (float f : random_floats(1 << 20, 3)) inputs.push_back(f);
  for (float f : inputs) {
    INFO("x = " << f << " bits 0x" << std::hex << bits_of(f));
    REQUIRE(fp16_from_float_rn(f).bits == __half_as_ushort(__float2half_rn(f)));
    REQUIRE(bf16_from_float_rn(f).bits == __bfloat16_as_ushort(__float2bfloat16_rn(f)));
  }
}

TEST_CASE("Philox matches curand's Philox4x32-10", "[numeric]") {
  std::mt19937 gen(7);
  auto u32 = [&] { return static_cast<unsigned>(gen()); };
  for (int i = 0; i < 1000; ++i) {
    const uint4 c{u32(), u32(), u32(), u32()};
    const uint2 k{u32(), u32()};
    const uint4 r = curand_Philox4x32_10(c, k);
    const philox_u32x4 m = philox4x32_10({{c.x, c.y, c.z, c.w}}, k.x, k.y);
    REQUIRE(m.v[0] == r.x);
    REQUIRE(m.v[1] == r.y);
    REQUIRE(m.v[2] == r.z);
    REQUIRE(m.v[3] == r.w);
  }
}
#endif

TEST_CASE("Philox4x32-10 known-answer vectors (Random123)", "[numeric]") {
  const philox_u32x4 zero = philox4x32_10({{0, 0, 0, 0}}, 0, 0);
  CHECK(zero.v[0] == 0x6627e8d5u);
  CHECK(zero.v[1] == 0xe169c58du);
  CHECK(zero.v[2] == 0xbc57ac4cu);
  CHECK(zero.v[3] == 0x9b00dbd8u);
  const philox_u32x4 pi = philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  CHECK(pi.v[0] == 0xd16cfe09u);
  CHECK(pi.v[1] == 0x94fdccebu);
  CHECK(pi.v[2] == 0x5001e420u);
  CHECK(pi.v[3] == 0x24126ea1u);
  static_assert(philox4x32_10({{0, 0, 0, 0}}, 0, 0).v[0] == 0x6627e8d5u, "usable in constant expressions");
}

TEST_CASE("element random bits depend on seed, step and index only", "[numeric]") {
  const auto a = element_random_bits(42, 3, 1000);
  const auto b = element_random_bits(42, 3, 1000);
  CHECK(a.v[0] == b.v[0]);
  CHECK(element_random_bits(42, 3, 1001).v[0] != a.v[0]);
  CHECK(element_random_bits(42, 4, 1000).v[0] != a.v[0]);
  CHECK(element_random_bits(43, 3, 1000).v[0] != a.v[0]);
  CHECK(element_random_bits(42, 3, 1000ull + (1ull << 32)).v[0] != a.v[0]);  // high index bits matter
}

namespace {

// Stream 3 from its definition (numeric/rounding_bits.hpp, docs/precision.md), written
// out here rather than calling the library's pieces: element g = 2 p + t reads word t
// of pair p whole and half t of words 2 and 3; word u of pair p hashes the pair index
// under a key drawn from Philox4x32-10, with u's salt before the second multiply.
std::uint32_t stream3_word(std::uint64_t seed, std::uint64_t step, std::uint64_t p, int u) {
  const philox_u32x4 key =
      philox4x32_10({{static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32), 0x53520003u, 0u}},
                    static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  const std::uint32_t salt[4] = {0u, 0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u};
  std::uint32_t x = static_cast<std::uint32_t>(p) ^ key.v[0];
  x = (x ^ (x >> 16)) * 0x21f0aaadu;
  x = (x ^ (x >> 15) ^ key.v[1] ^ static_cast<std::uint32_t>(p >> 32) * 0x9e3779b9u ^ salt[u]) * 0x735a2d97u;
  x = (x ^ (x >> 15) ^ key.v[2]) * 0x31848babu;
  return x ^ (x >> 14);
}

std::uint16_t stream3_half(std::uint64_t seed, std::uint64_t step, std::uint64_t g, int h) {
  const std::uint64_t p = g / 2;
  const int t = static_cast<int>(g % 2);
  const std::uint32_t word = h < 2 ? stream3_word(seed, step, p, t) : stream3_word(seed, step, p, h);
  return static_cast<std::uint16_t>(word >> (16 * (h < 2 ? h : t)));
}

// Pearson's chi-square of `counts` against a uniform expectation.
double chi_square(const std::vector<std::uint64_t>& counts, std::uint64_t total) {
  const double expected = static_cast<double>(total) / static_cast<double>(counts.size());
  double x2 = 0;
  for (const std::uint64_t c : counts) x2 += (static_cast<double>(c) - expected) * (static_cast<double>(c) - expected) / expected;
  return x2;
}

// Six standard deviations above the mean of a chi-square with `bins - 1` degrees of
// freedom (mean k, variance 2 k): a bound a uniform source exceeds with probability
// about 1e-8 (the data are fixed, so the check cannot flake).
double chi_square_bound(std::size_t bins) {
  const double k = static_cast<double>(bins - 1);
  return k + 6.0 * std::sqrt(2.0 * k);
}

}  // namespace

TEST_CASE("stochastic-rounding bits: stream 3 from its definition", "[numeric]") {
  const std::uint64_t seeds[] = {0, 42, 0x0123456789ABCDEFull};
  const std::uint64_t steps[] = {1, 7, (1ull << 32) + 3};
  // Both elements of pairs around the pair index's high word changing (g = 2^33) and
  // near the top.
  const std::uint64_t indices[] = {0, 1, 2, 3, 1000, 1001, (1ull << 31) - 1, 1ull << 31, (1ull << 32) + 1,
                                   (1ull << 33) - 2, (1ull << 33) - 1, 1ull << 33, (1ull << 33) + 1, (1ull << 62) + 12345};
  int mismatches = 0;
  for (const std::uint64_t seed : seeds) {
    for (const std::uint64_t step : steps) {
      const rounding_key key = rounding_key_of(seed, step);
      for (const std::uint64_t g : indices) {
        std::uint16_t want[4];
        for (int h = 0; h < 4; ++h) want[h] = stream3_half(seed, step, g, h);
        const element_bits e = element_rounding_bits(seed, step, g);
        for (int h = 0; h < 4; ++h) mismatches += e.half(h) != want[h];
        // Fewer halves: the ones read are the same, the others zero.
        const element_bits e1 = element_rounding_bits<1>(key, g), e2 = element_rounding_bits<2>(key, g),
                           e3 = element_rounding_bits<3>(key, g);
        mismatches += e1.w[0] != e.w[0] || e1.w[1] != 0;
        mismatches += e2.w[0] != e.w[0] || e2.w[1] != 0;
        mismatches += e3.w[0] != e.w[0] || e3.half(2) != want[2] || e3.half(3) != 0;
        mismatches += element_rounding_bits<4>(key, g).w[1] != e.w[1];
      }
    }
  }
  CHECK(mismatches == 0);
  CHECK(rounding_stream == 3);
  // Seed, step, the pair's other element and the index's high bits all reach the bits.
  const element_bits e = element_rounding_bits(9, 2, 500);
  CHECK(element_rounding_bits(9, 2, 501).w[0] != e.w[0]);
  CHECK(element_rounding_bits(9, 2, 501).half(2) != e.half(2));
  CHECK(element_rounding_bits(9, 2, 502).w[0] != e.w[0]);
  CHECK(element_rounding_bits(10, 2, 500).w[0] != e.w[0]);
  CHECK(element_rounding_bits(9, 3, 500).w[0] != e.w[0]);
  CHECK(element_rounding_bits(9, 2, 500 + (1ull << 33)).w[0] != e.w[0]);
  static_assert(element_rounding_bits(1, 2, 3).half(3) == element_rounding_bits<4>(rounding_key_of(1, 2), 3).half(3),
                "usable in constant expressions");
}

TEST_CASE("stochastic-rounding bits: halves uniform, no dependence across elements, pairs, words or steps", "[numeric]") {
  constexpr std::uint64_t n = 1 << 20;
  const std::uint64_t first = (1ull << 33) - n / 2;  // across a change of the pair index's high word
  std::vector<element_bits> now(n), next(n);
  const rounding_key k5 = rounding_key_of(3, 5), k6 = rounding_key_of(3, 6);
  for (std::uint64_t i = 0; i < n; ++i) {
    now[i] = element_rounding_bits(k5, first + i);
    next[i] = element_rounding_bits(k6, first + i);
  }
  // Each half's top and bottom byte: 256 bins each.
  for (int h = 0; h < 4; ++h) {
    for (const int shift : {8, 0}) {
      std::vector<std::uint64_t> counts(256);
      for (const element_bits& e : now) ++counts[(e.half(h) >> shift) & 0xffu];
      INFO("half " << h << ", byte at bit " << shift);
      CHECK(chi_square(counts, n) < chi_square_bound(256));
    }
  }
  // Every one of the 64 bits is set half the time (within six standard deviations).
  for (int bit = 0; bit < 64; ++bit) {
    std::uint64_t ones = 0;
    for (const element_bits& e : now) ones += (e.w[bit / 32] >> (bit % 32)) & 1u;
    INFO("bit " << bit);
    CHECK(std::fabs(static_cast<double>(ones) - n / 2.0) < 6.0 * std::sqrt(n / 4.0));
  }
  // Joint distributions of 4 bits of two halves (16 x 16 bins), the top 4 and the
  // bottom 4 (the words of a pair branch from one state, and a multiply's low bits
  // depend on its input's low bits alone): the elements of a pair and of neighbouring
  // pairs, the halves of one element (from one word and from two), the same element at
  // consecutive steps, and an element against the one 2^k away (a simple counter relation).
  const double bound = chi_square_bound(256);
  const auto half_of = [&](const std::vector<element_bits>& v, int h, std::uint64_t offset) {
    return [&v, h, offset](std::uint64_t i) { return v[i + offset].half(h); };
  };
  for (const int shift : {12, 0}) {
    // count pairs (a(i), b(i)), i = 0, stride, 2 stride, ...
    const auto joint = [&](auto&& a, auto&& b, std::uint64_t count, std::uint64_t stride = 1) {
      std::vector<std::uint64_t> counts(256);
      std::uint64_t total = 0;
      for (std::uint64_t i = 0; i < count; i += stride, ++total)
        ++counts[((a(i) >> shift) & 15u) * 16 + ((b(i) >> shift) & 15u)];
      return chi_square(counts, total);
    };
    INFO("4 bits from bit " << shift);
    for (const int h : {0, 1, 2}) {
      INFO("half " << h << " of the two elements of a pair, and of neighbours in different pairs");
      CHECK(joint(half_of(now, h, 0), half_of(now, h, 1), n - 1, 2) < bound);
      CHECK(joint(half_of(now, h, 1), half_of(now, h, 2), n - 2, 2) < bound);
    }
    CHECK(joint(half_of(now, 0, 0), half_of(now, 1, 0), n) < bound);
    CHECK(joint(half_of(now, 0, 0), half_of(now, 2, 0), n) < bound);
    CHECK(joint(half_of(now, 1, 0), half_of(now, 2, 0), n) < bound);
    CHECK(joint(half_of(now, 2, 0), half_of(now, 3, 0), n) < bound);
    CHECK(joint(half_of(now, 0, 0), half_of(now, 2, 1), n - 1, 2) < bound);  // across a pair's words
    CHECK(joint(half_of(now, 0, 0), half_of(next, 0, 0), n) < bound);
    CHECK(joint(half_of(now, 2, 0), half_of(next, 2, 0), n) < bound);
    for (const std::uint64_t d : {2ull, 16ull, 1024ull}) {
      INFO("distance " << d);
      CHECK(joint(half_of(now, 0, 0), half_of(now, 0, d), n - d) < bound);
      CHECK(joint(half_of(now, 2, 0), half_of(now, 2, d), n - d) < bound);
    }
  }
}

TEST_CASE("round_nearest_even matches its definition for every remainder up to 16 bits", "[numeric]") {
  // kept + 1 iff the discarded fraction rem / 2^shift exceeds one half, or equals it
  // and kept is odd.
  const std::uint32_t kepts[] = {0, 1, 2, 3, 0x3ff, 0x7ffe, 0x7fff, 0xfffffffeu};
  long mismatches = 0;
  for (unsigned shift = 1; shift <= 16; ++shift) {
    const std::uint32_t half = 1u << (shift - 1);
    for (std::uint32_t rem = 0; rem < (1u << shift); ++rem) {
      const long double frac = std::ldexp(static_cast<long double>(rem), -static_cast<int>(shift));
      for (const std::uint32_t kept : kepts) {
        const bool up = frac > 0.5L || (frac == 0.5L && kept % 2 == 1);
        mismatches += detail::round_nearest_even(kept, rem, half) != kept + (up ? 1u : 0u);
      }
    }
  }
  CHECK(mismatches == 0);
}

namespace {

// The mean of stochastically rounding x over all 65536 values of the 16 random bits,
// and the range of the results. With uniform bits this mean is the expected value.
struct sr_mean {
  long double mean;
  float lo, hi;
};

template <class Round>
sr_mean mean_over_all_bits(float x, Round round) {
  long double sum = 0;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (std::uint32_t r = 0; r < 65536; ++r) {
    const float v = to_float(round(x, static_cast<std::uint16_t>(r)));
    sum += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  return {sum / 65536, lo, hi};
}

// Values whose stochastic roundings to T are finite: random magnitudes 2^[lo_exp, hi_exp)
// of both signs, each format's subnormal range included.
std::vector<float> sr_inputs(int lo_exp, int hi_exp, int n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(lo_exp, hi_exp - 1);
  std::vector<float> out;
  for (int i = 0; i < n; ++i) out.push_back(std::ldexp(mant(gen), expo(gen)) * (i % 2 ? -1.0f : 1.0f));
  return out;
}

}  // namespace

TEST_CASE("stochastic rounding to bf16 with 16 random bits is exactly unbiased", "[numeric]") {
  // float -> bf16 drops exactly 16 bits, so over all 65536 random values the mean of
  // the results is x itself, and every result is one of x's two bf16 neighbours.
  auto round = [](float v, std::uint16_t r) { return bf16_from_float_sr(v, r); };
  std::vector<float> xs = sr_inputs(-140, 127, 1500, 21);  // bf16 subnormals from 2^-133 down
  for (float x : {1.0f, -1.0f, 0.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-23f, 0x1p-133f, 3.38e38f,
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()})
    xs.push_back(x);
  for (const float x : xs) {
    const sr_mean m = mean_over_all_bits(x, round);
    INFO("x = " << x << " lo " << m.lo << " hi " << m.hi);
    CHECK(m.mean == static_cast<long double>(x));
    CHECK(to_float(from_float<bf16>(m.lo)) == m.lo);  // both results are bf16 values
    CHECK(to_float(from_float<bf16>(m.hi)) == m.hi);
    CHECK(static_cast<long double>(m.hi) - m.lo <= std::fabs(x) * 0x1p-7L + 0x1p-133L);  // at most one ulp apart
  }
  REQUIRE(bf16_from_float_sr(std::numeric_limits<float>::quiet_NaN(), 0xffffu).bits == 0x7fff);
  REQUIRE(bf16_from_float_sr(std::numeric_limits<float>::infinity(), 0xffffu).bits == 0x7f80);
  REQUIRE(bf16_from_float_sr(-std::numeric_limits<float>::infinity(), 0xffffu).bits == 0xff80);
}

TEST_CASE("stochastic rounding to fp16 with 16 random bits: exact for normals, within 2^-16 ulp for subnormals",
          "[numeric]") {
  auto round = [](float v, std::uint16_t r) { return fp16_from_float_sr(v, r); };
  // Normal results drop 13 bits: the mean over all 16-bit random values is x exactly.
  std::vector<float> normals = sr_inputs(-14, 16, 1500, 22);
  normals.push_back(0x1p-14f);
  normals.push_back(65504.0f);
  normals.push_back(std::nextafter(65504.0f, 0.0f));
  for (const float x : normals) {
    if (std::fabs(x) > 65504.0f) continue;  // may round to infinity
    const sr_mean m = mean_over_all_bits(x, round);
    INFO("x = " << x << " lo " << m.lo << " hi " << m.hi);
    CHECK(m.mean == static_cast<long double>(x));
    CHECK(to_float(from_float<fp16>(m.lo)) == m.lo);
    CHECK(to_float(from_float<fp16>(m.hi)) == m.hi);
  }
  // Subnormal results (ulp 2^-24) drop more than 16 bits below 2^-17: the probability
  // of rounding up is truncated to 16 bits, so the mean falls short of x, in
  // magnitude, by less than 2^-16 ulp = 2^-40; from 2^-17 up (and at zero) it is exact.
  std::vector<float> subnormals = sr_inputs(-60, -14, 1500, 23);
  for (float x : {0x1p-24f, 0x1p-25f, 3 * 0x1p-26f, 0x1p-17f, std::nextafter(0x1p-17f, 0.0f), 1e-30f, 0.0f,
                  std::numeric_limits<float>::denorm_min()})
    subnormals.push_back(x);
  long exact_count = 0;
  for (const float x : subnormals) {
    const sr_mean m = mean_over_all_bits(x, round);
    INFO("x = " << x << " mean " << static_cast<double>(m.mean));
    const long double shortfall = std::fabs(static_cast<long double>(x)) - std::fabs(m.mean);
    CHECK(shortfall >= 0);
    CHECK(shortfall < 0x1p-40L);
    if (std::fabs(x) >= 0x1p-17f) CHECK(shortfall == 0);
    exact_count += shortfall == 0;
    CHECK(m.hi - m.lo <= 0x1p-24f);
  }
  CHECK(exact_count < static_cast<long>(subnormals.size()));  // the truncation is real: the bound is not vacuous
  REQUIRE(fp16_from_float_sr(std::numeric_limits<float>::quiet_NaN(), 0).bits == 0x7fff);
  REQUIRE(fp16_from_float_sr(70000.0f, 0xffffu).bits == 0x7c00);
  REQUIRE(fp16_from_float_sr(-std::numeric_limits<float>::infinity(), 0).bits == 0xfc00);
  // Far below the smallest subnormal: rounds up with (truncated) probability 0.
  REQUIRE(fp16_from_float_sr(1e-30f, 0).bits == 0x0000);
}

namespace {

// Draws many stochastic roundings of x, with the random halves of the step's own
// stream (all four halves of each element in turn), and checks: each result is one of
// the two neighbours, and the mean is x within 6 standard errors (an SR result differs
// from x by at most one ulp, so its standard deviation is at most ulp / 2).
template <class T, class Round>
void check_unbiased(float x, Round round, int samples, std::uint64_t seed) {
  long double sum = 0;
  float lo = std::numeric_limits<float>::infinity(), hi = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < samples; ++i) {
    const element_bits e = element_rounding_bits(seed, 1, static_cast<std::uint64_t>(i / 4));
    const float r = to_float(round(x, e.half(i % 4)));
    lo = std::min(lo, r);
    hi = std::max(hi, r);
    sum += r;
  }
  INFO("x = " << x << " lo " << lo << " hi " << hi);
  REQUIRE(lo <= x);
  REQUIRE(hi >= x);
  const long double ulp = static_cast<long double>(hi) - lo;
  if (ulp == 0) {
    REQUIRE(lo == x);  // representable values are kept exactly
    return;
  }
  // Exactly two neighbours, one ulp apart.
  REQUIRE(to_float(from_float<T>(lo)) == lo);
  REQUIRE(to_float(from_float<T>(hi)) == hi);
  const long double mean = sum / samples;
  const long double bound = 6.0L * (ulp / 2) / std::sqrt(static_cast<long double>(samples));
  REQUIRE(std::fabs(mean - static_cast<long double>(x)) <= bound);
}

}  // namespace

TEST_CASE("stochastic rounding with the step's random stream is unbiased: bf16", "[numeric]") {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-140, 120);
  for (int i = 0; i < 64; ++i) {
    const float x = std::ldexp(mant(gen), expo(gen)) * (i % 2 ? -1.0f : 1.0f);
    check_unbiased<bf16>(x, [](float v, std::uint16_t r) { return bf16_from_float_sr(v, r); }, 20000, i);
  }
  check_unbiased<bf16>(1.0f, [](float v, std::uint16_t r) { return bf16_from_float_sr(v, r); }, 1000, 1);
}

TEST_CASE("stochastic rounding with the step's random stream is unbiased: fp16, subnormals included", "[numeric]") {
  std::mt19937 gen(12);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-27, 15);  // subnormal range, normals, up to 65536
  for (int i = 0; i < 64; ++i) {
    const float x = std::ldexp(mant(gen), expo(gen)) * (i % 2 ? -1.0f : 1.0f);
    if (std::fabs(x) >= 65504.0f) continue;
    check_unbiased<fp16>(x, [](float v, std::uint16_t r) { return fp16_from_float_sr(v, r); }, 20000, 100 + i);
  }
}

TEST_CASE("stochastic rounding: aggregate bias over many values is below 1e-3 ulp", "[numeric]") {
  // One rounding for each of many values, each with its own element's master half (as
  // the fused step uses them): the mean signed error, in ulps, must vanish.
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> dist(1.0f, 2.0f);  // bf16 ulp is 2^-7, fp16 ulp 2^-10 here
  const int n = 1 << 20;
  long double err_bf16 = 0, err_fp16 = 0;
  for (int i = 0; i < n; ++i) {
    const float x = dist(gen);
    const element_bits e = element_rounding_bits(5, 1, static_cast<std::uint64_t>(i));
    err_bf16 += (static_cast<long double>(to_float(bf16_from_float_sr(x, e.half(0)))) - x) / 0x1p-7L;
    err_fp16 += (static_cast<long double>(to_float(fp16_from_float_sr(x, e.half(1)))) - x) / 0x1p-10L;
  }
  // Standard error of the mean of n errors each within one ulp: <= 0.5 / sqrt(n) ~ 5e-4.
  REQUIRE(std::fabs(err_bf16 / n) < 3e-3L);
  REQUIRE(std::fabs(err_fp16 / n) < 3e-3L);
}

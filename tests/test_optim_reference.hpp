// Long-double reference optimizers and the driver that holds mpzero's fused step
// against them, for every valid precision policy.
//
// Part 1 (namespace ref) shares nothing with the code under test: storage formats are
// decoded, encoded and rounded with this file's own functions (long double arithmetic
// from the formats' definitions; mpzero's conversions are not used, not even for the
// storage rounding), and Adam, AdamW, SGD and Lion are written from their published
// update rules (PyTorch's documentation of torch.optim.Adam, AdamW and SGD; Chen et al.
// 2023 for Lion). mpzero's bf16 / fp16 structs serve only as 16-bit containers.
//
// How the comparison stays fair without letting errors accumulate: each reference
// value is a pair {exact value, bound on how far an fp32 evaluation of the same formula
// may be from it} (struct E). Before every step the reference reads the library's
// stored master weights and states ("teacher forcing"), so each step is judged on its
// own and a one-ulp rounding difference in a 16-bit state cannot grow into a false
// failure over later steps. When master weights and states are both fp32 nothing is
// lost to storage, so there the reference runs free for all steps instead, carrying its
// own bound from step to step.
//
// Tolerances, per storage dtype (admissible() below):
//  - fp32 master / states: the stored value is the fp32 result itself and must lie
//    within 4x the first-order fp32 error bound of the formula: for a master weight
//    about 4 (|w| + a few |update|) 2^-24, i.e. a couple of ulps per step; for Adam's
//    moments a few ulps of b |m| + (1 - b) |g|, the magnitude of the terms, so that
//    cancellation is allowed for and nothing more.
//  - bf16 / fp16 with nearest rounding: the stored value must be the nearest-even
//    rounding of some value within that fp32 bound. That is the exact rounding of the
//    reference, except within ~2^-22 relative of a rounding boundary, where the fp32
//    intermediate may straddle it and either neighbour (one 16-bit ulp apart) is right.
//  - stochastic rounding: either neighbour of some value within the fp32 bound (one ulp
//    of the storage type per step), and, over all elements, round-ups as often as the
//    discarded fractions predict (sr_bins).
//  - Param copied from an fp32 master: exactly the nearest Param value of the stored
//    master, no tolerance.
// No value here comes near fp32's subnormal range, where the relative model would fail.
//
// Part 2 (the driver) calls mpzero: it builds a fused_step, runs the host backend and
// compares every stored element of every step.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <mpzero/mpzero.hpp>

namespace ref {

using ld = long double;

// ---- storage formats, from their definitions ---------------------------------------

// A binary floating-point format: p significand bits (with the implicit one), the
// exponent of its smallest normal number, its largest finite value.
struct format {
  int p;
  int emin;
  ld max;
};

template <class T>
constexpr format format_of = {};
template <>
inline constexpr format format_of<float> = {24, -126, 0x1.fffffep127L};
template <>
inline constexpr format format_of<mpzero::bf16> = {8, -126, 0x1.fep127L};
template <>
inline constexpr format format_of<mpzero::fp16> = {11, -14, 65504.0L};

template <class T>
inline constexpr bool is_16bit = !std::is_same_v<T, float>;

// floor(log2 |x|) and 2^e for the normal long doubles used here, read and built from
// the x87 80-bit layout where that is the format (libm's ilogbl / ldexpl cost more than
// the reference itself), otherwise through libm.
inline int ilog2(ld x) {
  if constexpr (std::numeric_limits<ld>::digits == 64 && std::numeric_limits<ld>::max_exponent == 16384) {
    std::uint16_t se;
    std::memcpy(&se, reinterpret_cast<const unsigned char*>(&x) + 8, 2);
    return static_cast<int>(se & 0x7fffu) - 16383;
  } else {
    return std::ilogb(x);
  }
}
inline ld pow2(int e) {
  if constexpr (std::numeric_limits<ld>::digits == 64 && std::numeric_limits<ld>::max_exponent == 16384) {
    ld x = 0;
    const std::uint64_t m = 1ull << 63;
    const auto se = static_cast<std::uint16_t>(e + 16383);
    std::memcpy(&x, &m, 8);
    std::memcpy(reinterpret_cast<unsigned char*>(&x) + 8, &se, 2);
    return x;
  } else {
    return std::ldexp(1.0L, e);
  }
}

inline ld decode(float x) { return x; }
inline ld decode(mpzero::bf16 x) {
  const std::uint32_t u = static_cast<std::uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// IEEE binary16 from its definition: 5 exponent bits (bias 15), 10 fraction bits.
inline ld decode(mpzero::fp16 x) {
  const int e = (x.bits >> 10) & 0x1f, m = x.bits & 0x3ff;
  ld v;
  if (e == 0x1f) {
    v = m != 0 ? std::numeric_limits<ld>::quiet_NaN() : std::numeric_limits<ld>::infinity();
  } else {
    v = e == 0 ? m * pow2(-24) : (1024 + m) * pow2(e - 25);
  }
  return (x.bits & 0x8000u) ? -v : v;
}

// The spacing of the format at |x|: the distance from |x| to the next value away from zero.
inline ld quantum(ld x, format f) { return pow2((x == 0 ? f.emin : std::max(ilog2(x), f.emin)) - f.p + 1); }

// The integer nearest to y, ties to even, for |y| < 2^(digits - 2): adding 1.5 * 2^(digits - 1)
// moves y into the binade whose spacing is 1, where the hardware rounds in the default
// mode (round to nearest even). libm's nearbyintl, floorl and ceill cost more than the
// whole reference step.
constexpr ld rint_magic() {
  ld m = 1.5L;
  for (int i = 1; i < std::numeric_limits<ld>::digits; ++i) m *= 2;
  return m;
}
inline ld rint_even(ld y) {
  constexpr ld magic = rint_magic();
  return (y + magic) - magic;
}

// Rounding to the format: nearest-even (overflow to infinity), down, up. Long double
// holds every value of the three formats and every quotient x / quantum exactly, and
// x / quantum stays below 2^24 in magnitude.
inline ld round_nearest(ld x, format f) {
  const ld q = quantum(x, f);
  const ld r = rint_even(x / q) * q;
  return std::fabs(r) > f.max ? std::copysign(std::numeric_limits<ld>::infinity(), x) : r;
}
inline ld round_down(ld x, format f) {
  const ld q = quantum(x, f);
  const ld y = x / q, r = rint_even(y);
  return (r > y ? r - 1 : r) * q;
}
inline ld round_up(ld x, format f) {
  const ld q = quantum(x, f);
  const ld y = x / q, r = rint_even(y);
  return (r < y ? r + 1 : r) * q;
}

// Storage bits of a value that the format represents exactly (checked).
template <class T>
T encode(ld x) {
  const float f = static_cast<float>(x);
  T out{};
  if constexpr (std::is_same_v<T, float>) {
    out = f;
  } else if constexpr (std::is_same_v<T, mpzero::bf16>) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    out.bits = static_cast<std::uint16_t>(u >> 16);
  } else {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    const std::uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    if (mag >= 0x38800000u) {  // normal in binary16 (or beyond it: caught below)
      out.bits = static_cast<std::uint16_t>(sign | (((mag >> 23) - 112u) << 10) | ((mag >> 13) & 0x3ffu));
    } else {  // subnormal: an integer multiple of 2^-24
      out.bits = static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::fabs(x) * pow2(24)));
    }
  }
  if (decode(out) != x) throw std::logic_error("ref::encode: value is not representable in the storage format");
  return out;
}

// Distance from a representable |a| to its neighbour towards zero / away from zero.
inline ld gap_toward_zero(ld a, format f) {
  const ld q = quantum(a, f);
  if (a == 0) return q;
  const int e = ilog2(a);
  return (e > f.emin && a == pow2(e)) ? q / 2 : q;
}
inline ld gap_away_from_zero(ld a, format f) { return quantum(a, f); }

// ---- values with an fp32 error bound ------------------------------------------------

// v: the exact value of the formula (long double, relative error ~2^-64, negligible).
// e: a bound on |fp32 evaluation - v|, in the standard model fl(a op b) = (a op b)(1 + d),
// |d| <= u = 2^-24, propagated to first order plus the product of the operand bounds.
struct E {
  ld v;
  double e;
  double mag;  // |v| in double, for the bound's arithmetic
};

inline constexpr double u32 = 0x1p-24;

inline E make(ld v, double e) { return {v, e, static_cast<double>(std::fabs(v))}; }
// A stored input: exact.
inline E in(ld x) { return make(x, 0); }
// A hyperparameter: an fp32 implementation rounds it to float once.
inline E cst(ld c) { return make(c, static_cast<ld>(static_cast<float>(c)) == c ? 0 : u32 * static_cast<double>(std::fabs(c))); }
inline E add(E a, E b) {
  const E s = make(a.v + b.v, 0);
  const double err = a.e + b.e;
  return {s.v, err + u32 * (s.mag + err), s.mag};
}
inline E sub(E a, E b) { return add(a, E{-b.v, b.e, b.mag}); }
inline E mul(E a, E b) {
  const E p = make(a.v * b.v, 0);
  const double err = a.mag * b.e + b.mag * a.e + a.e * b.e;
  return {p.v, err + u32 * (p.mag + err), p.mag};
}
inline E div(E a, E b) {
  const E q = make(a.v / b.v, 0);
  const double den = b.mag - b.e;
  if (!(den > 0)) return {q.v, std::numeric_limits<double>::infinity(), q.mag};  // reported as unbounded
  const double err = (a.e + q.mag * b.e) / den;
  return {q.v, err + u32 * (q.mag + err), q.mag};
}
inline E sqrt(E a) {
  const E r = make(std::sqrt(std::max<ld>(a.v, 0)), 0);
  // |sqrt(x') - sqrt(x)| <= |x' - x| / sqrt(x), and <= sqrt(|x' - x|) always.
  const double err = r.mag > 0 ? std::min(a.e / r.mag, std::sqrt(a.e)) : std::sqrt(a.e);
  return {r.v, err + u32 * (r.mag + err), r.mag};
}
// sign() is discontinuous: where the fp32 value may lie on either side of zero the
// bound covers every outcome in {-1, 0, 1}.
inline E sign(E c) {
  if (c.v == 0 && c.e == 0) return make(0, 0);
  if (c.mag > c.e) return make(c.v > 0 ? 1.0L : -1.0L, 0);
  return make(0, 1);
}

// ---- the reference optimizers ---------------------------------------------------------

// Results of one element's step. A state that the optimizer does not define (SGD with
// momentum 0 keeps no buffer) is not compared.
struct step_out {
  E w;
  E s[3];
  bool s_defined[3] = {true, true, true};
};

// torch.optim.Adam (L2: g <- g + wd * w) or AdamW (decoupled: w <- w * (1 - lr * wd)):
//   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   m_hat = m / (1 - b1^t);  v_hat = v / (1 - b2^t);  w <- w - lr m_hat / (sqrt(v_hat) + eps)
// bias_correction = false is apex / DeepSpeed FusedAdam's option: m_hat = m, v_hat = v.
struct adam_cfg {
  ld lr, beta1, beta2, eps, weight_decay;
  bool bias_correction;
  bool decoupled;
};

// Each configuration's step t: the scalars once per step, then one call per element.
struct adam_at_step {
  adam_cfg c;
  E decay, wd, b1, one_minus_b1, b2, one_minus_b2, bc1, bc2, lr, eps;

  adam_at_step(const adam_cfg& cfg, std::uint64_t t)
      : c(cfg),
        decay(cst(1 - cfg.lr * cfg.weight_decay)),
        wd(cst(cfg.weight_decay)),
        b1(cst(cfg.beta1)),
        one_minus_b1(cst(1 - cfg.beta1)),
        b2(cst(cfg.beta2)),
        one_minus_b2(cst(1 - cfg.beta2)),
        bc1(cst(1 - std::pow(cfg.beta1, static_cast<ld>(t)))),
        bc2(cst(1 - std::pow(cfg.beta2, static_cast<ld>(t)))),
        lr(cst(cfg.lr)),
        eps(cst(cfg.eps)) {}

  step_out operator()(E w, E g, const E* s) const {
    if (c.decoupled) {
      w = mul(w, decay);
    } else if (c.weight_decay != 0) {
      g = add(g, mul(wd, w));
    }
    const E m = add(mul(b1, s[0]), mul(one_minus_b1, g));
    const E v = add(mul(b2, s[1]), mul(one_minus_b2, mul(g, g)));
    const E m_hat = c.bias_correction ? div(m, bc1) : m;
    const E v_hat = c.bias_correction ? div(v, bc2) : v;
    step_out out{sub(w, mul(lr, div(m_hat, add(sqrt(v_hat), eps)))), {m, v, {}}};
    out.s_defined[2] = false;
    return out;
  }
};
inline adam_at_step at_step(const adam_cfg& c, std::uint64_t t) { return {c, t}; }

// torch.optim.SGD: g <- g + wd * w; with momentum != 0 the buffer is g on the first
// step and momentum * buf + (1 - dampening) * g after, and the step direction is the
// buffer, or g + momentum * buf with Nesterov; with momentum == 0 there is no buffer
// and the direction is g. Then w <- w - lr * direction.
struct sgd_cfg {
  ld lr, momentum, dampening, weight_decay;
  bool nesterov;
};

struct sgd_at_step {
  sgd_cfg c;
  bool first;
  E wd, momentum, one_minus_dampening, lr;

  sgd_at_step(const sgd_cfg& cfg, std::uint64_t t)
      : c(cfg),
        first(t == 1),
        wd(cst(cfg.weight_decay)),
        momentum(cst(cfg.momentum)),
        one_minus_dampening(cst(1 - cfg.dampening)),
        lr(cst(cfg.lr)) {}

  step_out operator()(E w, E g, const E* s) const {
    if (c.weight_decay != 0) g = add(g, mul(wd, w));
    step_out out{};
    out.s[0] = s[0];
    out.s_defined[0] = c.momentum != 0;
    out.s_defined[1] = out.s_defined[2] = false;
    if (c.momentum != 0) {
      const E buf = first ? g : add(mul(momentum, s[0]), mul(one_minus_dampening, g));
      out.s[0] = buf;
      g = c.nesterov ? add(g, mul(momentum, buf)) : buf;
    }
    out.w = sub(w, mul(lr, g));
    return out;
  }
};
inline sgd_at_step at_step(const sgd_cfg& c, std::uint64_t t) { return {c, t}; }

// Lion (Chen et al. 2023, Algorithm 2, decoupled weight decay):
//   c = b1 m + (1 - b1) g;  w <- w (1 - lr wd) - lr sign(c);  m <- b2 m + (1 - b2) g
struct lion_cfg {
  ld lr, beta1, beta2, weight_decay;
};

struct lion_at_step {
  E decay, lr, b1, one_minus_b1, b2, one_minus_b2;

  lion_at_step(const lion_cfg& cfg, std::uint64_t)
      : decay(cst(1 - cfg.lr * cfg.weight_decay)),
        lr(cst(cfg.lr)),
        b1(cst(cfg.beta1)),
        one_minus_b1(cst(1 - cfg.beta1)),
        b2(cst(cfg.beta2)),
        one_minus_b2(cst(1 - cfg.beta2)) {}

  step_out operator()(E w, E g, const E* s) const {
    const E interp = add(mul(b1, s[0]), mul(one_minus_b1, g));
    step_out out{};
    out.w = sub(mul(w, decay), mul(lr, sign(interp)));
    out.s[0] = add(mul(b2, s[0]), mul(one_minus_b2, g));
    out.s_defined[1] = out.s_defined[2] = false;
    return out;
  }
};
inline lion_at_step at_step(const lion_cfg& c, std::uint64_t t) { return {c, t}; }

// ---- judging a stored value -------------------------------------------------------------

// The fp32 bound e is first order in the model above and follows the textbook order of
// operations; an implementation may regroup (fold 1 / sqrt(1 - b2^t) or lr / (1 - b1^t)
// into one precomputed scalar, multiply by 1 - lr * wd instead of subtracting), which
// changes each rounding's weight by a small factor. Four times the bound covers that and
// is still a few fp32 ulps: far below any real mistake (a wrong bias correction or beta
// moves the update by percents).
inline constexpr double slack = 4;

// Can `got` (a value of storage type T) be the rounding, nearest-even or stochastic, of
// some x with |x - r.v| <= slack * r.e?
template <class T>
bool admissible(ld got, const E& r, bool stochastic) {
  constexpr format f = format_of<T>;
  const ld tol = static_cast<ld>(slack * r.e);
  if (std::isnan(got) || !std::isfinite(tol)) return false;
  const ld d = got - r.v;
  if (std::fabs(d) <= tol) return true;
  const ld dist = std::fabs(d) - tol;  // from `got` to the nearest end of the interval
  const ld a = std::fabs(got);
  // The neighbour of `got` on the interval's side.
  const bool toward_zero = (d > 0) == (got > 0) && got != 0;
  const ld gap = toward_zero ? gap_toward_zero(a, f) : gap_away_from_zero(a, f);
  if (stochastic) return dist < gap;  // stochastic rounding yields one of the two neighbours of x
  if (dist != gap / 2) return dist < gap / 2;
  return round_nearest(d > 0 ? r.v + tol : r.v - tol, f) == got;  // a tie at the interval's end
}

// Stochastic rounding must round up with probability equal to the discarded fraction.
// Outcomes are binned by that fraction; in each bin the number of round-ups must match
// the sum of the probabilities within five standard deviations, plus the uncertainty of
// the probabilities themselves: the fp32 value that was rounded lies within e of the
// reference, and add() keeps only samples with e below 1e-3 of the gap.
struct sr_bins {
  static constexpr int n = 8;
  double count[n] = {}, sum_p[n] = {}, sum_up[n] = {}, var[n] = {};

  template <class T>
  void add(ld got, const E& r) {
    constexpr format f = format_of<T>;
    const ld lo = round_down(r.v, f), hi = round_up(r.v, f);
    if (hi == lo || !(r.e < 1e-3 * static_cast<double>(hi - lo))) return;
    const double p = static_cast<double>((r.v - lo) / (hi - lo));
    const int b = std::min(n - 1, static_cast<int>(p * n));
    count[b] += 1;
    sum_p[b] += p;
    sum_up[b] += got == hi ? 1.0 : 0.0;
    var[b] += p * (1 - p);
  }
  double total() const {
    double t = 0;
    for (double c : count) t += c;
    return t;
  }
  // The first bin that fails, or -1.
  int first_bad_bin() const {
    for (int b = 0; b < n; ++b) {
      if (count[b] < 100) continue;
      const double allowed = 5 * std::sqrt(var[b]) + 1e-3 * count[b] + 1;
      if (std::fabs(sum_up[b] - sum_p[b]) > allowed) return b;
    }
    return -1;
  }
};

// ---- random inputs ------------------------------------------------------------------------

// splitmix64: small, fast, and the same on every platform.
struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int uniform_int(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<std::uint64_t>(hi - lo + 1)); }
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1p-53; }
};

// A random value of storage type T: sign, binade 2^k with k in [kmin, kmax], and a
// uniform significand of T's width, so it is exact in T (rounded where T is subnormal).
template <class T>
T random_value(rng& r, int kmin, int kmax) {
  constexpr format f = format_of<T>;
  const std::uint64_t bits = r.next();
  const int k = kmin + static_cast<int>((bits & 0xffff) % static_cast<std::uint64_t>(kmax - kmin + 1));
  const auto significand = static_cast<std::uint32_t>(bits >> (64 - (f.p - 1))) << (24 - f.p);  // float's 23 bits
  const std::uint32_t sign = (bits >> 16) & 1u;
  if (kmin < -126) throw std::logic_error("ref::random_value: binades below fp32's normal range are not drawn");
  const std::uint32_t u = (sign << 31) | (static_cast<std::uint32_t>(k + 127) << 23) | significand;
  float x;
  std::memcpy(&x, &u, 4);
  if (k < f.emin) return encode<T>(round_nearest(x, f));
  return encode<T>(x);
}

// random_value with the sign cleared: for optimizer states that must not be negative
// (Adam's second moment).
template <class T>
T random_magnitude(rng& r, int kmin, int kmax) {
  T x = random_value<T>(r, kmin, kmax);
  if constexpr (std::is_same_v<T, float>) {
    return std::fabs(x);
  } else {
    x.bits = static_cast<std::uint16_t>(x.bits & 0x7fffu);
    return x;
  }
}

}  // namespace ref

// ---- Part 2: the driver (calls mpzero) ----------------------------------------------------

namespace optim_test {

using mpzero::bf16;
using mpzero::fp16;
using mpzero::precision;
using sr = mpzero::round_stochastic;

// Every valid policy. Param fp32 needs Master fp32; Grad fp16 with State bf16 mixes
// formats; stochastic rounding needs a 16-bit master or state.
using policies_a = std::tuple<  // Param fp32 (7) and Param fp16 (6)
    precision<float, float, float, float>, precision<float, float, float, bf16>, precision<float, float, bf16, float>,
    precision<float, float, bf16, bf16>, precision<float, float, fp16, float>,
    precision<float, float, float, bf16, sr>, precision<float, float, bf16, bf16, sr>,
    precision<fp16, fp16, fp16, float>, precision<fp16, fp16, float, float>, precision<fp16, float, fp16, float>,
    precision<fp16, float, float, float>, precision<fp16, fp16, fp16, float, sr>,
    precision<fp16, fp16, float, float, sr>>;
using policies_b = std::tuple<  // Param bf16 (14)
    precision<bf16, bf16, bf16, bf16>, precision<bf16, bf16, bf16, float>, precision<bf16, bf16, float, bf16>,
    precision<bf16, bf16, float, float>, precision<bf16, float, bf16, bf16>, precision<bf16, float, bf16, float>,
    precision<bf16, float, float, bf16>, precision<bf16, float, float, float>,
    precision<bf16, bf16, bf16, bf16, sr>, precision<bf16, bf16, bf16, float, sr>,
    precision<bf16, bf16, float, bf16, sr>, precision<bf16, bf16, float, float, sr>,
    precision<bf16, float, bf16, bf16, sr>, precision<bf16, float, float, bf16, sr>>;

// The number of valid policies, counted from the rules rather than from the lists.
constexpr int count_valid_policies() {
  enum d { f32, b16, f16 };
  int n = 0;
  for (int param : {f32, b16, f16})
    for (int master : {f32, b16, f16})
      for (int grad : {f32, b16, f16})
        for (int state : {f32, b16})  // fp16 states are refused
          for (bool stochastic : {false, true}) {
            if (master != f32 && master != param) continue;
            bool has_b = false, has_f = false;
            for (int x : {param, master, grad, state}) {
              has_b = has_b || x == b16;
              has_f = has_f || x == f16;
            }
            if (has_b && has_f) continue;
            if (stochastic && master == f32 && state == f32) continue;
            ++n;
          }
  return n;
}

template <class Tuple>
struct all_distinct;
template <class... T>
struct all_distinct<std::tuple<T...>> {
  template <class U>
  static constexpr int occurrences = (0 + ... + (std::is_same_v<U, T> ? 1 : 0));
  static constexpr bool value = ((occurrences<T> == 1) && ...);
};

using all_policies = decltype(std::tuple_cat(policies_a{}, policies_b{}));
static_assert(count_valid_policies() == 27);
static_assert(std::tuple_size_v<all_policies> == count_valid_policies(),
              "the policy lists must hold every valid precision policy");
static_assert(all_distinct<all_policies>::value, "a policy is listed twice (so another one is missing)");

// How many entries of two bit vectors differ (a length difference counts in full).
// Compared this way, not with ==, so that a failure prints a number rather than a
// million-element vector.
inline std::size_t count_different(const std::vector<std::uint32_t>& a, const std::vector<std::uint32_t>& b) {
  std::size_t d = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) d += a[i] != b[i] ? 1 : 0;
  return d;
}

template <mpzero::precision_policy P>
std::string policy_name() {
  std::string s = "precision<";
  for (mpzero::dtype d : {P::param_dtype, P::master_dtype, P::grad_dtype, P::state_dtype}) {
    s += mpzero::name_of(d);
    s += ", ";
  }
  s += P::stochastic_rounding ? "stochastic>" : "nearest>";
  return s;
}

// mpzero's options for each reference configuration (the only place the two meet).
inline mpzero::optim::adam_options to_options(const ref::adam_cfg& c) {
  return {static_cast<double>(c.lr),          static_cast<double>(c.beta1), static_cast<double>(c.beta2),
          static_cast<double>(c.eps),         static_cast<double>(c.weight_decay), c.bias_correction};
}
inline mpzero::optim::sgd_options to_options(const ref::sgd_cfg& c) {
  return {static_cast<double>(c.lr), static_cast<double>(c.momentum), static_cast<double>(c.dampening),
          static_cast<double>(c.weight_decay), c.nesterov};
}
inline mpzero::optim::lion_options to_options(const ref::lion_cfg& c) {
  return {static_cast<double>(c.lr), static_cast<double>(c.beta1), static_cast<double>(c.beta2),
          static_cast<double>(c.weight_decay)};
}

struct run_shape {
  std::vector<std::uint64_t> sizes;
  int steps = 3;
  int grad_log2_scale = -10;  // grad_scale = 2^this: grads are stored 2^-this times too large
  std::uint64_t seed = 1;
};


struct mismatch {
  std::size_t tensor;
  std::uint64_t index;
  std::uint64_t step;
  const char* what;
  ref::ld got, want, bound;
};

// What one run of the comparison found.
struct tally {
  std::uint64_t compared = 0, failed = 0, master_changed = 0, master_total = 0;
  std::vector<mismatch> first;
  ref::sr_bins bins;

  void fail(const mismatch& m) {
    ++failed;
    if (first.size() < 8) first.push_back(m);
  }
};

inline const char* state_label(int k) {
  static const char* const labels[] = {"state 0", "state 1", "state 2"};
  return labels[k];
}

// Runs `shape.steps` fused steps of optimizer O under policy P on tensors of
// `shape.sizes` (all in one fused_step) and compares every stored value of every step
// with the reference configured by `cfg`.
template <mpzero::precision_policy P, mpzero::optim::rule O, class Cfg>
void check_against_reference(const Cfg& cfg, const run_shape& shape) {
  using param_t = typename P::param_type;
  using master_t = typename P::master_type;
  using grad_t = typename P::grad_type;
  using state_t = typename P::state_type;
  using ref::ld;
  constexpr int n = O::n_states;
  constexpr bool separate = !P::master_is_param;
  // With fp32 master and states, storage loses nothing: the reference runs free.
  constexpr bool free_running = std::is_same_v<master_t, float> && std::is_same_v<state_t, float>;
  constexpr bool sr_master = P::stochastic_rounding && ref::is_16bit<master_t>;
  constexpr bool sr_state = P::stochastic_rounding && ref::is_16bit<state_t>;
  constexpr bool random_initial_state = std::is_same_v<Cfg, ref::sgd_cfg>;  // step 1 must ignore it

  const std::size_t nt = shape.sizes.size();
  const float grad_scale = std::ldexp(1.0f, shape.grad_log2_scale);

  std::vector<std::vector<param_t>> param(nt);
  std::vector<std::vector<master_t>> master(nt);  // unused when the master is the parameter
  std::vector<std::vector<grad_t>> grad(nt);
  std::vector<std::vector<state_t>> state(nt * n);
  std::vector<std::vector<ref::E>> ref_w(nt), ref_s(nt * n);
  auto weights = [&](std::size_t t) -> std::vector<master_t>& {
    if constexpr (separate) {
      return master[t];
    } else {
      return param[t];
    }
  };

  ref::rng r{shape.seed * 0x9E3779B97F4A7C15ull + 12345};
  for (std::size_t t = 0; t < nt; ++t) {
    const std::uint64_t numel = shape.sizes[t];
    auto& w = weights(t);
    w.resize(numel);
    grad[t].resize(numel);
    if constexpr (separate) param[t].resize(numel);
    for (std::uint64_t i = 0; i < numel; ++i) {
      // Mostly binades 2^-6..2^0; 2% far smaller (fp16 subnormals).
      w[i] = r.uniform01() < 0.02 ? ref::random_value<master_t>(r, -24, -15) : ref::random_value<master_t>(r, -6, 0);
      if constexpr (separate) param[t][i] = ref::encode<param_t>(ref::round_nearest(ref::decode(w[i]), ref::format_of<param_t>));
    }
    for (int k = 0; k < n; ++k) {
      auto& s = state[t * n + k];
      s.assign(numel, ref::encode<state_t>(0));
      if (random_initial_state)
        for (auto& x : s) x = ref::random_value<state_t>(r, -8, 0);
    }
    if constexpr (free_running) {
      ref_w[t].resize(numel);
      for (std::uint64_t i = 0; i < numel; ++i) ref_w[t][i] = ref::in(ref::decode(w[i]));
      for (int k = 0; k < n; ++k) {
        ref_s[t * n + k].resize(numel);
        for (std::uint64_t i = 0; i < numel; ++i) ref_s[t * n + k][i] = ref::in(ref::decode(state[t * n + k][i]));
      }
    }
  }

  std::vector<mpzero::step_tensor<P, O>> tensors(nt);
  for (std::size_t t = 0; t < nt; ++t) {
    tensors[t].param = param[t].data();
    if constexpr (separate) tensors[t].master = master[t].data();
    tensors[t].grad = grad[t].data();
    for (int k = 0; k < n; ++k) tensors[t].states[k] = state[t * n + k].data();
    tensors[t].numel = shape.sizes[t];
  }
  mpzero::assign_global_offsets(std::span(tensors));
  const mpzero::fused_step<P, O> fused(tensors);

  const ref::E gs = ref::cst(grad_scale);
  tally total;
  std::vector<std::vector<master_t>> prev_w(nt);
  std::vector<std::vector<state_t>> prev_s(nt * n);
  for (std::uint64_t step = 1; step <= static_cast<std::uint64_t>(shape.steps); ++step) {
    for (std::size_t t = 0; t < nt; ++t) {
      // |true gradient| in 2^-10..2^1, stored 2^-grad_log2_scale times larger; 1% zeros.
      for (auto& g : grad[t])
        g = r.uniform01() < 0.01 ? ref::encode<grad_t>(0)
                                 : ref::random_value<grad_t>(r, -10 - shape.grad_log2_scale, -shape.grad_log2_scale);
      prev_w[t] = weights(t);
      for (int k = 0; k < n; ++k) prev_s[t * n + k] = state[t * n + k];
    }

    mpzero::host::run(fused, mpzero::make_step_args<O>(to_options(cfg), step, grad_scale, shape.seed));

    const auto stepper = ref::at_step(cfg, step);
    for (std::size_t t = 0; t < nt; ++t) {
      const auto& w_now = weights(t);
      for (std::uint64_t i = 0; i < shape.sizes[t]; ++i) {
        ref::E w_in{}, s_in[3] = {};
        if constexpr (free_running) {
          w_in = ref_w[t][i];
          for (int k = 0; k < n; ++k) s_in[k] = ref_s[t * n + k][i];
        } else {
          w_in = ref::in(ref::decode(prev_w[t][i]));
          for (int k = 0; k < n; ++k) s_in[k] = ref::in(ref::decode(prev_s[t * n + k][i]));
        }
        const ref::E g = ref::mul(ref::in(ref::decode(grad[t][i])), gs);
        const ref::step_out o = stepper(w_in, g, s_in);

        const ld w_got = ref::decode(w_now[i]);
        ++total.compared;
        if (!ref::admissible<master_t>(w_got, o.w, sr_master))
          total.fail({t, i, step, "master weight", w_got, o.w.v, ref::slack * o.w.e});
        else if constexpr (sr_master)
          total.bins.template add<master_t>(w_got, o.w);
        ++total.master_total;
        if (w_got != ref::decode(prev_w[t][i])) ++total.master_changed;

        for (int k = 0; k < n; ++k) {
          if (!o.s_defined[k]) continue;
          const ld s_got = ref::decode(state[t * n + k][i]);
          ++total.compared;
          if (!ref::admissible<state_t>(s_got, o.s[k], sr_state))
            total.fail({t, i, step, state_label(k), s_got, o.s[k].v, ref::slack * o.s[k].e});
          else if constexpr (sr_state)
            total.bins.template add<state_t>(s_got, o.s[k]);
        }
        if constexpr (separate) {
          // The parameter is the nearest Param value to the fp32 master, exactly.
          const ld p_got = ref::decode(param[t][i]);
          const ld p_want = ref::round_nearest(w_got, ref::format_of<param_t>);
          ++total.compared;
          if (p_got != p_want) total.fail({t, i, step, "param (nearest to the fp32 master)", p_got, p_want, 0});
        }
        if constexpr (free_running) {
          ref_w[t][i] = o.w;
          for (int k = 0; k < n; ++k)
            if (o.s_defined[k]) ref_s[t * n + k][i] = o.s[k];
        }
      }
    }
  }

  std::ostringstream where;
  where << policy_name<P>() << " x " << O::name << ", sizes {";
  for (auto s : shape.sizes) where << s << ' ';
  where << "}, " << shape.steps << " steps, grad_scale 2^" << shape.grad_log2_scale << ", "
        << (free_running ? "free-running" : "teacher-forced") << " reference";
  INFO(where.str());
  if (total.failed > 0) {
    std::ostringstream os;
    os.precision(10);
    os << total.failed << " of " << total.compared << " stored values are off; the first:\n";
    for (const mismatch& m : total.first)
      os << "  step " << m.step << " tensor " << m.tensor << " [" << m.index << "] " << m.what << ": got " << m.got
         << ", reference " << m.want << " +- " << m.bound << " (before storage rounding)\n";
    FAIL_CHECK(os.str());
  }
  std::uint64_t elements = 0;
  for (auto s : shape.sizes) elements += s;
  REQUIRE(total.master_total == elements * static_cast<std::uint64_t>(shape.steps));
  // Not vacuous: the steps must move a fair share of the master weights, even in 16 bits.
  if (elements >= 1000) CHECK(total.master_changed * 20 >= total.master_total);
  if constexpr (sr_master || sr_state) {
    if (elements >= 10000) {
      REQUIRE(total.bins.total() >= 10000);
      const int bad = total.bins.first_bad_bin();
      if (bad >= 0) {
        FAIL_CHECK("stochastic rounding is biased: values whose discarded fraction lies in ["
                   << double(bad) / ref::sr_bins::n << ", " << double(bad + 1) / ref::sr_bins::n << ") rounded up "
                   << total.bins.sum_up[bad] << " times in " << total.bins.count[bad] << ", expected "
                   << total.bins.sum_p[bad] << " +- " << 5 * std::sqrt(total.bins.var[bad]));
      }
    }
  }
}

// The configurations every policy runs: a main one on the sizes below (gradients
// loss-scaled by 2^10 and unscaled by grad_scale, weight decay on, bias correction on)
// and a variant on smaller sizes (bias correction off, unit grad_scale, Nesterov, ...).
inline const std::vector<std::uint64_t> main_sizes = {0, 1, 7, 65537, 300000};
inline const std::vector<std::uint64_t> variant_sizes = {1, 0, 7, 4099};

template <mpzero::precision_policy P>
void check_adam_family() {
  using namespace mpzero::optim;
  SECTION("Adam, L2 weight decay, bias correction, grad_scale 2^-10") {
    check_against_reference<P, adam>(ref::adam_cfg{2e-3L, 0.9L, 0.999L, 1e-8L, 0.01L, true, false},
                                     run_shape{main_sizes, 3, -10, 11});
  }
  SECTION("Adam, no bias correction, no weight decay, grad_scale 1") {
    check_against_reference<P, adam>(ref::adam_cfg{1e-3L, 0.8L, 0.99L, 1e-6L, 0.0L, false, false},
                                     run_shape{variant_sizes, 3, 0, 12});
  }
  SECTION("AdamW, decoupled weight decay, bias correction, grad_scale 2^-10") {
    check_against_reference<P, adamw>(ref::adam_cfg{3e-3L, 0.9L, 0.95L, 1e-8L, 0.1L, true, true},
                                      run_shape{main_sizes, 3, -10, 13});
  }
  SECTION("AdamW, no bias correction, grad_scale 2^-3") {
    check_against_reference<P, adamw>(ref::adam_cfg{1e-3L, 0.85L, 0.999L, 1e-7L, 0.05L, false, true},
                                      run_shape{variant_sizes, 3, -3, 14});
  }
}

template <mpzero::precision_policy P>
void check_sgd_and_lion() {
  using namespace mpzero::optim;
  SECTION("SGD, momentum with dampening, weight decay, grad_scale 2^-10") {
    check_against_reference<P, sgd>(ref::sgd_cfg{0.05L, 0.9L, 0.1L, 1e-3L, false}, run_shape{main_sizes, 3, -10, 21});
  }
  SECTION("SGD, Nesterov, grad_scale 1") {
    check_against_reference<P, sgd>(ref::sgd_cfg{0.02L, 0.8L, 0.0L, 0.01L, true}, run_shape{variant_sizes, 3, 0, 22});
  }
  SECTION("Lion, weight decay, grad_scale 2^-10") {
    check_against_reference<P, lion>(ref::lion_cfg{3e-4L, 0.9L, 0.99L, 0.1L}, run_shape{main_sizes, 3, -10, 23});
  }
  SECTION("Lion, no weight decay, grad_scale 1") {
    check_against_reference<P, lion>(ref::lion_cfg{1e-3L, 0.95L, 0.98L, 0.0L}, run_shape{variant_sizes, 3, 0, 24});
  }
}

}  // namespace optim_test

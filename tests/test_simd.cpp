// The host step's loop against its scalar reference, for every SIMD variant this CPU
// runs (portable, baseline x86-64, AVX2, AVX-512).
//
// The reference is update_element() element by element, each making the step's key and
// drawing its own bits (element_rounding_bits). The host loop makes the key once per
// range and hashes a block's pairs of elements in a loop of their own, the key word of
// the pair index's high half once per block; it must give the reference's bits exactly,
// at odd and even first indices (a block that starts mid-pair), in ranges of any length,
// and where the pair index's high half changes (global index 2^33).
#include <catch2/catch.hpp>

#include "support/reference_step.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <string>
#include <vector>

#include <mpzero/backend/host.hpp>

using namespace mpzero;

namespace {

template <class T>
std::vector<T> filled(std::size_t n, std::uint64_t seed, float lo, float hi) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float u = static_cast<float>(element_random_bits(seed, 0, i).v[0] >> 8) * 0x1p-24f;
    v[i] = from_float<T>(lo + (hi - lo) * u);
  }
  return v;
}

template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class Policy, class Opt>
struct state {
  using param_t = typename Policy::param_type;
  using master_t = typename Policy::master_type;
  using state_t = typename Policy::state_type;
  std::vector<param_t> param;
  std::vector<master_t> master;
  std::vector<typename Policy::grad_type> grad;
  std::vector<state_t> s0, s1;
  std::uint64_t global_offset;

  state(std::size_t n, std::uint64_t offset)
      : param(filled<param_t>(n, 1, -1.0f, 1.0f)),
        master(Policy::master_is_param ? 0 : n),
        grad(filled<typename Policy::grad_type>(n, 2, -0.01f, 0.01f)),
        s0(filled<state_t>(n, 3, -1e-3f, 1e-3f)),
        s1(filled<state_t>(n, 4, 0.0f, 1e-5f)),
        global_offset(offset) {
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = from_float<master_t>(to_float(param[i]));
  }
  step_tensor<Policy, Opt> tensor() {
    step_tensor<Policy, Opt> t;
    t.param = param.data();
    if constexpr (!Policy::master_is_param) t.master = master.data();
    t.grad = grad.data();
    t.states[0] = s0.data();
    if constexpr (Opt::n_states > 1) t.states[1] = s1.data();
    t.numel = param.size();
    t.global_offset = global_offset;
    return t;
  }
  // The scalar reference: each element on its own, its bits from its own draw.
  void reference_step(const step_args<Opt>& a) {
    const step_tensor<Policy, Opt> t = tensor();
    test_support::reference_step<Policy, Opt>(std::span(&t, 1), a);
  }
  bool operator==(const state& o) const {
    return same(param, o.param) && same(master, o.master) && same(s0, o.s0) && same(s1, o.s1);
  }
};

template <class Sig>
struct variant {
  std::string name;
  std::function<Sig> run;
};

// Kernel::run in every variant this CPU runs: with the portable kit (scalar draws and
// conversions, what non-x86 and Clang builds use) and in the run-time SIMD variants.
template <class Kernel, class Sig>
std::vector<variant<Sig>> kernel_variants() {
  std::vector<variant<Sig>> v;
  v.push_back({"portable", [](auto&&... a) {
                 return Kernel::template run<host::detail::portable_kit>(std::forward<decltype(a)>(a)...);
               }});
#if defined(MPZERO_RUNTIME_SIMD)
  v.push_back({"baseline", [](auto&&... a) { return host::detail::run_baseline<Kernel>(std::forward<decltype(a)>(a)...); }});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    v.push_back({"avx2", [](auto&&... a) { return host::detail::run_avx2<Kernel>(std::forward<decltype(a)>(a)...); }});
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    v.push_back({"avx512", [](auto&&... a) { return host::detail::run_avx512<Kernel>(std::forward<decltype(a)>(a)...); }});
#endif
  return v;
}

template <class Policy, class Opt>
auto variants() {
  return kernel_variants<host::detail::step_kernel<Policy, Opt>,
                         void(const step_tensor<Policy, Opt>&, std::uint64_t, std::uint32_t, const step_args<Opt>&)>();
}

template <class Policy, class Opt>
void check_against_reference() {
  const std::uint32_t n = 70001;  // vector bodies, scalar tails, many blocks
  typename Opt::options o{};
  o.lr = 1e-2;
  // Odd and even first indices; the last puts global index 2^33 inside the tensor,
  // where the pair index's high word changes.
  for (const std::uint64_t offset : {std::uint64_t{12345}, std::uint64_t{12346}, (std::uint64_t{1} << 33) - 20001}) {
    state<Policy, Opt> ref(n, offset);
    for (std::uint64_t step = 1; step <= 3; ++step) ref.reference_step(make_step_args<Opt>(o, step, 0.5f, 77));
    REQUIRE_FALSE(ref == state<Policy, Opt>(n, offset));  // the steps did something
    for (const auto& v : variants<Policy, Opt>()) {
      INFO(v.name << " loop, first global index " << offset);
      state<Policy, Opt> got(n, offset);
      for (std::uint64_t step = 1; step <= 3; ++step) {
        const auto args = make_step_args<Opt>(o, step, 0.5f, 77);
        // Ranges that start at odd indices and mid-block, as chunks of any size do.
        const auto t = got.tensor();
        v.run(t, 0, 3, args);
        v.run(t, 3, 1030, args);
        v.run(t, 1033, 1, args);
        v.run(t, 1034, n - 1034, args);
      }
      CHECK(got == ref);
    }
  }
}

}  // namespace

TEST_CASE("host step: every loop variant gives the scalar reference's bits", "[multi_tensor]") {
  INFO("this CPU runs the host step as: " << host::simd_name());
  check_against_reference<policies::fp32, optim::adamw>();
  check_against_reference<policies::bf16_fp32_master, optim::adam>();
  check_against_reference<policies::bf16_all, optim::adamw>();
  check_against_reference<policies::bf16_all_sr, optim::adamw>();
  check_against_reference<policies::fp16_fp32_master, optim::sgd>();
  check_against_reference<precision<fp16, fp16, fp16, float, round_stochastic>, optim::lion>();
  // fp16 blocks converted with F16C / AVX-512: gradients in, parameter copy out; and
  // an fp16 master in and out under nearest rounding.
  check_against_reference<policies::fp16_fp32_master, optim::adamw>();
  check_against_reference<precision<fp16, fp16, fp16, float, round_nearest>, optim::adamw>();
  check_against_reference<precision<bf16, float, bf16, bf16, round_stochastic>, optim::adam>();
}

TEST_CASE("host step: every loop variant gives the reference's bits on fp16 NaN, infinities and subnormals",
          "[multi_tensor]") {
  // Every fp16 pattern as a gradient, and masters of every float exponent (NaN and
  // infinities included): the parameter copies overflow, go subnormal and turn NaN.
  using P = policies::fp16_fp32_master;
  using Opt = optim::sgd;
  const std::uint32_t n = 65536 + 37;
  state<P, Opt> ref(n, 0);
  for (std::uint32_t i = 0; i < n; ++i) {
    ref.grad[i] = fp16::from_bits(static_cast<std::uint16_t>(i * 40503u));  // odd multiplier: a permutation
    std::uint32_t bits = element_random_bits(5, 0, i).v[0];
    if (i % 7 == 0) bits = (bits & 0x807fffffu) | ((100u + i % 40u) << 23);  // near fp16's range
    ref.master[i] = std::bit_cast<float>(bits);
  }
  const state<P, Opt> start = ref;
  typename Opt::options o{};
  o.lr = 0.5;
  ref.reference_step(make_step_args<Opt>(o, 1, 1.0f));
  for (const auto& v : variants<P, Opt>()) {
    INFO(v.name << " loop");
    state<P, Opt> got = start;
    const auto t = got.tensor();
    v.run(t, 0, 5, make_step_args<Opt>(o, 1, 1.0f));
    v.run(t, 5, n - 5, make_step_args<Opt>(o, 1, 1.0f));
    // fp16 results bit for bit (NaN is canonical there); float results too, except that
    // which NaN payload an x86 operation keeps depends on its operand order, which the
    // compiler may swap: any NaN matches any NaN in the float master and momentum.
    CHECK(same(got.param, ref.param));
    long float_mismatches = 0;
    for (std::uint32_t i = 0; i < n; ++i) {
      for (const auto& [a, b] : {std::pair{got.master[i], ref.master[i]}, std::pair{got.s0[i], ref.s0[i]}}) {
        float_mismatches += std::isnan(a) ? !std::isnan(b) : std::bit_cast<std::uint32_t>(a) != std::bit_cast<std::uint32_t>(b);
      }
    }
    CHECK(float_mismatches == 0);
  }
}

namespace {

// chunk_stats in every variant this CPU runs: the same sum bit for bit (each of the 16
// accumulators is one lane, whatever the vector width), the same non-finite verdict.
template <class G>
void check_chunk_stats_variants() {
  const auto runs = kernel_variants<host::detail::stats_kernel<G>, grad_stats(const G*, std::uint32_t)>();
  std::vector<G> x = filled<G>(70001, 9, -3.0f, 3.0f);  // blocks, 16-wide bodies and a tail of 1
  for (const std::uint32_t n : {70001u, 1040u, 15u, 1u, 0u}) {
    const grad_stats want = runs[0].run(x.data(), n);
    CHECK_FALSE(want.nonfinite);
    for (const auto& [name, run] : runs) {
      INFO(name << ", n " << n);
      const grad_stats got = run(x.data(), n);
      CHECK(std::bit_cast<std::uint64_t>(got.norm_squared) == std::bit_cast<std::uint64_t>(want.norm_squared));
      CHECK_FALSE(got.nonfinite);
    }
  }
  // NaN and infinity found in a vector body and in the tail, by every variant.
  for (const std::uint32_t at : {5u, 1030u, 70000u}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
      const G keep = x[at];
      x[at] = from_float<G>(bad);
      for (const auto& [name, run] : runs) {
        INFO(name << ", bad value at " << at);
        CHECK(run(x.data(), 70001).nonfinite);
      }
      x[at] = keep;
    }
  }
}

}  // namespace

namespace {

// Values of every kind for D and S: ordinary ones, and every 16-bit pattern's float
// (NaN, infinities, subnormals, the largest finite) so conversions overflow and underflow.
template <class T>
std::vector<T> elementwise_inputs(std::size_t n, std::uint64_t seed) {
  std::vector<T> v = filled<T>(n, seed, -70000.0f, 70000.0f);
  for (std::size_t i = 0; i < n; i += 3) {
    const auto h = static_cast<std::uint16_t>((i * 40503u + seed) & 0xffffu);
    const float f = (seed & 1) ? to_float(fp16::from_bits(h)) : to_float(bf16::from_bits(h));
    v[i] = from_float<T>(f);
  }
  return v;
}

template <class T>
bool same_or_both_nan(const std::vector<T>& a, const std::vector<T>& b) {
  if constexpr (std::same_as<T, float>) {
    // Which NaN payload an x86 float operation keeps depends on its operand order.
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (std::isnan(a[i]) ? !std::isnan(b[i]) : std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]))
        return false;
    }
    return a.size() == b.size();
  } else {
    return same(a, b);
  }
}

// host_backend's accumulate / convert in every variant against the scalar expression.
template <class D, class S>
void check_elementwise() {
  const std::size_t n = 5000 + 11;  // blocks of 1024 and a ragged tail
  const std::vector<D> d0 = elementwise_inputs<D>(n, 3);
  const std::vector<S> src = elementwise_inputs<S>(n, 8);
  std::vector<D> acc_ref = d0, cvt_ref(n);
  for (std::size_t i = 0; i < n; ++i) {
    acc_ref[i] = from_float<D>(fp::add(to_float(d0[i]), fp::mul(to_float(src[i]), 0.75f)));
    cvt_ref[i] = from_float<D>(to_float(src[i]));
  }
  using sig = void(D*, const S*, std::uint64_t, float);
  const auto accs = kernel_variants<host::detail::elementwise_kernel<true, D, S>, sig>();
  const auto cvts = kernel_variants<host::detail::elementwise_kernel<false, D, S>, sig>();
  REQUIRE(accs.size() == cvts.size());
  for (std::size_t k = 0; k < accs.size(); ++k) {
    INFO(accs[k].name);
    std::vector<D> a = d0, c(n);
    accs[k].run(a.data(), src.data(), n, 0.75f);
    cvts[k].run(c.data(), src.data(), n, 1.0f);
    CHECK(same_or_both_nan(a, acc_ref));
    CHECK(same_or_both_nan(c, cvt_ref));
  }
}

}  // namespace

TEST_CASE("host elementwise accumulate and convert: every loop variant gives the scalar bits, specials included",
          "[multi_tensor]") {
  check_elementwise<float, float>();
  check_elementwise<float, bf16>();
  check_elementwise<float, fp16>();
  check_elementwise<bf16, bf16>();
  check_elementwise<bf16, float>();
  check_elementwise<fp16, fp16>();
  check_elementwise<fp16, float>();
  check_elementwise<bf16, fp16>();
}

TEST_CASE("gradient statistics: every loop variant gives the same sum, bit for bit, and finds non-finite values",
          "[multi_tensor]") {
  check_chunk_stats_variants<float>();
  check_chunk_stats_variants<bf16>();
  check_chunk_stats_variants<fp16>();
}

#if defined(MPZERO_RUNTIME_SIMD)
namespace {

template <class Half>
void check_half_blocks(const char* name) {
  INFO(name);
  // Every half, widened in blocks of awkward lengths (vector bodies and tails).
  std::vector<fp16> halves(65536);
  for (std::uint32_t h = 0; h < 65536; ++h) halves[h] = fp16::from_bits(static_cast<std::uint16_t>(h));
  std::vector<float> wide(65536);
  for (std::uint32_t i = 0; i < 65536;) {
    const std::uint32_t len = std::min<std::uint32_t>(1 + i % 29, 65536 - i);
    Half::widen(halves.data() + i, wide.data() + i, len);
    i += len;
  }
  long mismatches = 0;
  for (std::uint32_t h = 0; h < 65536; ++h)
    mismatches += std::bit_cast<std::uint32_t>(wide[h]) != std::bit_cast<std::uint32_t>(to_float(halves[h]));
  CHECK(mismatches == 0);
  // Every float, narrowed with nearest rounding, 2^16 at a time (the last block of
  // each batch 13 short, for the tails). nvcc's copy of this file (test_simd_nvcc.cu)
  // takes every 61st batch: its host pass hands the same code to the same g++, and the
  // stride, below the 128 batches of one exponent and sign, still reaches every exponent
  // of both signs (about 1.6% of the floats: 0.5 s instead of 30).
#ifdef __CUDACC__
  constexpr std::uint64_t batch_stride = 61;
#else
  constexpr std::uint64_t batch_stride = 1;
#endif
  std::vector<float> in(65536);
  std::vector<fp16> out(65536);
  mismatches = 0;
  for (std::uint64_t hi = 0; hi < 65536; hi += batch_stride) {
    for (std::uint32_t lo = 0; lo < 65536; ++lo) in[lo] = std::bit_cast<float>(static_cast<std::uint32_t>(hi << 16 | lo));
    Half::narrow(in.data(), out.data(), 65536 - 13);
    Half::narrow(in.data() + 65536 - 13, out.data() + 65536 - 13, 13);
    for (std::uint32_t lo = 0; lo < 65536; ++lo) mismatches += out[lo].bits != fp16_from_float_rn(in[lo]).bits;
  }
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("host step: the fp16 block conversions give the shared conversions' bits (all halves, all floats)",
          "[multi_tensor]") {
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
    check_half_blocks<host::detail::simd::half_avx2>("avx2 + f16c");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    check_half_blocks<host::detail::simd::half_avx512>("avx512");
}
#endif

#if !defined(MPZERO_RUNTIME_SIMD)
TEST_CASE("host step: this build has no run-time SIMD variants (not x86 GCC)", "[multi_tensor]") {
  REQUIRE(std::string(host::simd_name()) == "baseline");
}
#endif

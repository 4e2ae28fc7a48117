// The host step's run-time SIMD variants (baseline, AVX2, AVX-512) give the same bits.
// Each variant the CPU supports runs the same inputs; the outputs must match the
// baseline variant exactly, for nearest and stochastic rounding and every dtype.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <mpzero/backend/host.hpp>

using namespace mpzero;

#if defined(MPZERO_RUNTIME_SIMD)
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
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class Policy, class Opt>
struct state {
  std::vector<typename Policy::param_type> param;
  std::vector<typename Policy::master_type> master;
  std::vector<typename Policy::grad_type> grad;
  std::vector<typename Policy::state_type> s0, s1;

  explicit state(std::size_t n)
      : param(filled<typename Policy::param_type>(n, 1, -1.0f, 1.0f)),
        master(Policy::master_is_param ? 0 : n),
        grad(filled<typename Policy::grad_type>(n, 2, -0.01f, 0.01f)),
        s0(filled<typename Policy::state_type>(n, 3, -1e-3f, 1e-3f)),
        s1(filled<typename Policy::state_type>(n, 4, 0.0f, 1e-5f)) {
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = from_float<typename Policy::master_type>(to_float(param[i]));
  }
  step_tensor<Policy, Opt> tensor() {
    step_tensor<Policy, Opt> t;
    t.param = param.data();
    if constexpr (!Policy::master_is_param) t.master = master.data();
    t.grad = grad.data();
    t.states[0] = s0.data();
    if constexpr (Opt::n_states > 1) t.states[1] = s1.data();
    t.numel = param.size();
    t.global_offset = 12345;
    return t;
  }
  bool operator==(const state& o) const {
    return same(param, o.param) && same(master, o.master) && same(s0, o.s0) && same(s1, o.s1);
  }
};

template <class Policy, class Opt>
void check_variants() {
  const std::uint32_t n = 70001;  // a vector body and a scalar tail
  typename Opt::options o{};
  o.lr = 1e-2;
  state<Policy, Opt> base(n), avx2(n), avx512(n);
  for (std::uint64_t step = 1; step <= 3; ++step) {
    const auto args = make_step_args<Opt>(o, step, 0.5f, 77);
    host::detail::step_range_body<Policy, Opt>(base.tensor(), 0, n, args);
    if (__builtin_cpu_supports("avx2")) host::detail::step_range_avx2<Policy, Opt>(avx2.tensor(), 0, n, args);
    if (host::detail::simd_level() == 2) host::detail::step_range_avx512<Policy, Opt>(avx512.tensor(), 0, n, args);
  }
  if (__builtin_cpu_supports("avx2")) REQUIRE(avx2 == base);
  if (host::detail::simd_level() == 2) REQUIRE(avx512 == base);
  REQUIRE_FALSE(base == state<Policy, Opt>(n));  // the steps did something
}

}  // namespace

TEST_CASE("host step: AVX2 and AVX-512 variants give the baseline's bits", "[multi_tensor]") {
  INFO("this CPU runs the host step as: " << host::simd_name());
  check_variants<policies::fp32, optim::adamw>();
  check_variants<policies::bf16_fp32_master, optim::adam>();
  check_variants<policies::bf16_all, optim::adamw>();
  check_variants<policies::bf16_all_sr, optim::adamw>();
  check_variants<policies::fp16_fp32_master, optim::sgd>();
  check_variants<precision<fp16, fp16, fp16, float, round_stochastic>, optim::lion>();
}
#else
TEST_CASE("host step: this build has no run-time SIMD variants (not x86 GCC)", "[multi_tensor]") {
  REQUIRE(std::string(host::simd_name()) == "baseline");
}
#endif

// Precision policies, stage/offload tags and the constexpr memory model.
//
// Expected values come from two places that share nothing with memory_model.hpp:
// literal numbers worked out by hand (the ZeRO paper's 2 + 2 + K accounting), and a
// reference that charges each model state separately (replicated, or 1 / W once the
// stage partitions it) from byte sizes written out below, not read from the policies.
#include <catch2/catch.hpp>

#include <concepts>
#include <string>
#include <tuple>
#include <utility>

#include <mpzero/error.hpp>
#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/memory_model.hpp>
#include <mpzero/policy/precision.hpp>
#include <mpzero/policy/stage.hpp>

using namespace mpzero;

namespace {

// ---- what each named policy is, written out by hand -----------------------------

struct hand_policy {
  int param, master, grad, state;  // bytes per element of each storage
  bool master_is_param;            // the optimizer updates the parameter storage itself
  bool needs_loss_scaling;         // fp16 params or grads
  bool stochastic;
};

template <class P>
constexpr hand_policy hand = {};
template <>
constexpr hand_policy hand<policies::fp32> = {4, 4, 4, 4, true, false, false};
template <>
constexpr hand_policy hand<policies::bf16_fp32_master> = {2, 4, 2, 4, false, false, false};
template <>
constexpr hand_policy hand<policies::bf16_master_fp32_states> = {2, 2, 2, 4, true, false, false};
template <>
constexpr hand_policy hand<policies::bf16_all> = {2, 2, 2, 2, true, false, false};
template <>
constexpr hand_policy hand<policies::bf16_all_sr> = {2, 2, 2, 2, true, false, true};
template <>
constexpr hand_policy hand<policies::fp16_fp32_master> = {2, 4, 2, 4, false, true, false};
template <>
constexpr hand_policy hand<policies::bf16_fp32_grads> = {2, 4, 4, 4, false, false, false};
template <>
constexpr hand_policy hand<policies::fp16_master_fp32_states> = {2, 2, 2, 4, true, true, false};

template <class O>
constexpr int hand_states = 0;
template <>
constexpr int hand_states<optim::adam> = 2;  // first and second moment
template <>
constexpr int hand_states<optim::sgd> = 1;  // momentum

using named_policies = std::tuple<policies::fp32, policies::bf16_fp32_master, policies::bf16_master_fp32_states,
                                  policies::bf16_all, policies::bf16_all_sr, policies::fp16_fp32_master,
                                  policies::bf16_fp32_grads, policies::fp16_master_fp32_states>;

template <class F>
void for_each_policy(F&& f) {
  std::apply([&](auto... p) { (f(p), ...); }, named_policies{});
}

// ---- the reference: each state charged on its own ---------------------------------

struct reference_bytes {
  long double device = 0, host = 0;
};

// A state of `bytes` per element, partitioned across W ranks from stage `from` on.
long double charge(long double bytes, int stage_, int from, int world) {
  return stage_ >= from ? bytes / world : bytes;
}

reference_bytes reference(const hand_policy& h, int n_states, int stage_, bool cpu_offload, int world) {
  const long double states = static_cast<long double>(n_states) * h.state;
  reference_bytes r;
  if (cpu_offload) {
    // The host holds the rank's partition of a separate master (even when the policy
    // updates the parameter in place on the device), of the states and of the gradient.
    // The device keeps the parameters and, at stage 1 only, the full gradient: at stages
    // 2 and 3 reduced buckets go straight to the host.
    r.host = static_cast<long double>(h.master) / world + states / world + static_cast<long double>(h.grad) / world;
    r.device = charge(h.param, stage_, 3, world) + (stage_ == 1 ? static_cast<long double>(h.grad) : 0.0L);
    return r;
  }
  r.device = charge(h.param, stage_, 3, world) + charge(h.grad, stage_, 2, world) +
             (h.master_is_param ? 0.0L : charge(h.master, stage_, 1, world)) + charge(states, stage_, 1, world);
  return r;
}

const char* offload_name(bool cpu) { return cpu ? "cpu" : "none"; }

template <class Policy, class Opt, int Stage, class Offload>
void check_model(int world) {
  constexpr bool cpu = Offload::value == offload_kind::cpu;
  const reference_bytes ref = reference(hand<Policy>, hand_states<Opt>, Stage, cpu, world);
  INFO("policy (P,M,G,S bytes) = " << hand<Policy>.param << "," << hand<Policy>.master << "," << hand<Policy>.grad
                                   << "," << hand<Policy>.state << "  optimizer = " << Opt::name << "  stage = " << Stage
                                   << "  offload = " << offload_name(cpu) << "  world = " << world);
  const memory_footprint typed = bytes_per_param<Policy, Opt, stage<Stage>, Offload>(world);
  const memory_footprint untyped = bytes_per_param(layout_of<Policy, Opt>(), Stage, Offload::value, world);
  CHECK(typed.device_bytes == Approx(static_cast<double>(ref.device)).epsilon(1e-12));
  CHECK(typed.host_bytes == Approx(static_cast<double>(ref.host)).epsilon(1e-12));
  CHECK(typed.total() == Approx(static_cast<double>(ref.device + ref.host)).epsilon(1e-12));
  CHECK(untyped.device_bytes == typed.device_bytes);
  CHECK(untyped.host_bytes == typed.host_bytes);
}

template <class Policy, class Opt, int... Stages>
void check_stages(int world, std::integer_sequence<int, Stages...>) {
  (check_model<Policy, Opt, Stages, offload_none>(world), ...);
  // offload_cpu with stage<0> does not compile (tests/compile_fail/offload_cpu_stage0.cpp).
  (
      [&] {
        if constexpr (Stages > 0) check_model<Policy, Opt, Stages, offload_cpu>(world);
      }(),
      ...);
}

// The message names the offending value: `value` appears as a whole token.
bool names_value(const std::string& msg, const std::string& value) {
  for (std::size_t at = msg.find(value); at != std::string::npos; at = msg.find(value, at + 1)) {
    const auto part_of_number = [](char c) { return (c >= '0' && c <= '9') || c == '.' || c == '-'; };
    const bool left_ok = at == 0 || !part_of_number(msg[at - 1]);
    const std::size_t end = at + value.size();
    const bool right_ok = end == msg.size() || !part_of_number(msg[end]);
    if (left_ok && right_ok) return true;
  }
  return false;
}

template <class F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const mpzero::invalid_argument& e) {  // any other exception type fails the test
    return e.what();
  }
  return "<nothing thrown>";
}

}  // namespace

// ---- constexpr: these are evaluated by the compiler -------------------------------

// The reference facts. bf16 params and grads, fp32 master, Adam, stage 3:
// (2 + 2 + 4 + 2 x 4) / W = 16 / W.
static_assert(bytes_per_param<policies::bf16_fp32_master, optim::adam, stage<3>>(1).device_bytes == 16.0);
static_assert(bytes_per_param<policies::bf16_fp32_master, optim::adam, stage<3>>(8).device_bytes == 2.0);
// Everything bf16, Adam, stage 3: (2 + 2 + 0 + 2 x 2) / W = 8 / W, the floor: the
// master is the parameter, so no copy is stored.
static_assert(bytes_per_param<policies::bf16_all, optim::adam, stage<3>>(1).device_bytes == 8.0);
static_assert(bytes_per_param<policies::bf16_all, optim::adam, stage<3>>(4).device_bytes == 2.0);
static_assert(bytes_per_param<policies::bf16_all, optim::adam, stage<3>>(4).host_bytes == 0.0);
// Offload moves master, states and the gradient partition to the host: (4 + 8 + 2) / 2.
static_assert(bytes_per_param<policies::bf16_fp32_master, optim::adam, stage<2>, offload_cpu>(2).host_bytes == 7.0);
static_assert(bytes_per_param(layout_of<policies::fp32, optim::sgd>(), 0, offload_kind::none, 1).total() == 12.0);

// ---- precision<> traits -------------------------------------------------------------

TEST_CASE("named policies: storage types as written in the policy", "[policy]") {
  STATIC_REQUIRE(std::same_as<policies::fp32, precision<float, float, float, float, round_nearest>>);
  STATIC_REQUIRE(std::same_as<policies::bf16_fp32_master, precision<bf16, float, bf16, float, round_nearest>>);
  STATIC_REQUIRE(std::same_as<policies::bf16_master_fp32_states, precision<bf16, bf16, bf16, float, round_nearest>>);
  STATIC_REQUIRE(std::same_as<policies::bf16_all, precision<bf16, bf16, bf16, bf16, round_nearest>>);
  STATIC_REQUIRE(std::same_as<policies::bf16_all_sr, precision<bf16, bf16, bf16, bf16, round_stochastic>>);
  STATIC_REQUIRE(std::same_as<policies::fp16_fp32_master, precision<fp16, float, fp16, float, round_nearest>>);
  STATIC_REQUIRE(std::same_as<policies::bf16_fp32_grads, precision<bf16, float, float, float, round_nearest>>);
  STATIC_REQUIRE(std::same_as<policies::fp16_master_fp32_states, precision<fp16, fp16, fp16, float, round_nearest>>);

  using P = policies::bf16_fp32_master;
  STATIC_REQUIRE(std::same_as<P::param_type, bf16>);
  STATIC_REQUIRE(std::same_as<P::master_type, float>);
  STATIC_REQUIRE(std::same_as<P::grad_type, bf16>);
  STATIC_REQUIRE(std::same_as<P::state_type, float>);
  STATIC_REQUIRE(std::same_as<P::rounding, round_nearest>);
  STATIC_REQUIRE(std::same_as<policies::bf16_all_sr::rounding, round_stochastic>);
}

TEST_CASE("named policies: traits match the hand table", "[policy]") {
  for_each_policy([](auto p) {
    using P = decltype(p);
    constexpr hand_policy h = hand<P>;
    const auto bytes = [](dtype d) { return d == dtype::fp32 ? 4 : 2; };  // sizes from the enum, not size_of
    INFO("policy with P,M,G,S = " << name_of(P::param_dtype) << "," << name_of(P::master_dtype) << ","
                                  << name_of(P::grad_dtype) << "," << name_of(P::state_dtype));
    STATIC_REQUIRE(precision_policy<P>);
    CHECK(bytes(P::param_dtype) == h.param);
    CHECK(bytes(P::master_dtype) == h.master);
    CHECK(bytes(P::grad_dtype) == h.grad);
    CHECK(bytes(P::state_dtype) == h.state);
    CHECK(P::master_is_param == h.master_is_param);
    CHECK(P::needs_loss_scaling == h.needs_loss_scaling);
    CHECK(P::stochastic_rounding == h.stochastic);
    CHECK(size_of(P::param_dtype) == static_cast<std::size_t>(h.param));
    CHECK(size_of(P::master_dtype) == static_cast<std::size_t>(h.master));
  });
}

TEST_CASE("precision<>: dtypes, master_is_param and loss scaling of other valid policies", "[policy]") {
  // fp16 all the way (the master is the parameter): needs loss scaling.
  using F = precision<fp16, fp16, fp16, float>;
  STATIC_REQUIRE(F::param_dtype == dtype::fp16);
  STATIC_REQUIRE(F::master_dtype == dtype::fp16);
  STATIC_REQUIRE(F::state_dtype == dtype::fp32);
  STATIC_REQUIRE(F::master_is_param);
  STATIC_REQUIRE(F::needs_loss_scaling);
  // fp32 weights with fp16 gradients: the gradients alone need loss scaling.
  using G = precision<float, float, fp16, float>;
  STATIC_REQUIRE(G::grad_dtype == dtype::fp16);
  STATIC_REQUIRE(G::needs_loss_scaling);
  STATIC_REQUIRE(G::master_is_param);
  // bf16 with fp32 master and bf16 states, stochastic rounding of the states.
  using S = precision<bf16, float, bf16, bf16, round_stochastic>;
  STATIC_REQUIRE(!S::master_is_param);
  STATIC_REQUIRE(!S::needs_loss_scaling);
  STATIC_REQUIRE(S::stochastic_rounding);
  STATIC_REQUIRE(S::state_dtype == dtype::bf16);
  // Not policies.
  STATIC_REQUIRE(!precision_policy<float>);
  STATIC_REQUIRE(!precision_policy<stage<1>>);
}

TEST_CASE("stage<> and offload tags", "[policy]") {
  STATIC_REQUIRE(stage<0>::value == 0);
  STATIC_REQUIRE(stage<3>::value == 3);
  STATIC_REQUIRE(offload_none::value == offload_kind::none);
  STATIC_REQUIRE(offload_cpu::value == offload_kind::cpu);
  CHECK(name_of(offload_kind::none) == "none");
  CHECK(name_of(offload_kind::cpu) == "cpu");
}

// ---- the memory model ---------------------------------------------------------------

TEST_CASE("memory model: hand-computed numbers", "[policy]") {
  // (policies:: spelled out: mpzero::fp32 is also the float alias.)
  using optim::adam;
  using optim::sgd;
  // The ZeRO paper's mixed-precision Adam: 2 (fp16 param) + 2 (fp16 grad) + K = 12
  // (fp32 master + two fp32 moments), here at W = 8.
  CHECK(bytes_per_param<policies::fp16_fp32_master, adam, stage<0>>(8).device_bytes == Approx(16.0));
  CHECK(bytes_per_param<policies::fp16_fp32_master, adam, stage<1>>(8).device_bytes == Approx(2 + 2 + 12.0 / 8));  // 5.5
  CHECK(bytes_per_param<policies::fp16_fp32_master, adam, stage<2>>(8).device_bytes == Approx(2 + 14.0 / 8));      // 3.75
  CHECK(bytes_per_param<policies::fp16_fp32_master, adam, stage<3>>(8).device_bytes == Approx(2.0));
  // fp32 Adam: the master is the parameter, 4 + 4 + 8.
  CHECK(bytes_per_param<policies::fp32, adam, stage<0>>(1).device_bytes == Approx(16.0));
  // bf16 SGD, master is the parameter: 2 + (2 + 2) / 4 at stage 2.
  CHECK(bytes_per_param<policies::bf16_all, sgd, stage<2>>(4).device_bytes == Approx(3.0));
  // bf16 master, fp32 states, Adam, stage 1, W = 3: 2 + 2 + 8 / 3.
  CHECK(bytes_per_param<policies::bf16_master_fp32_states, adam, stage<1>>(3).device_bytes == Approx(4.0 + 8.0 / 3));
  // Offload at stage 2: the device keeps the bf16 parameters (2), the host (4 + 8 + 2) / 4.
  const auto off = bytes_per_param<policies::bf16_fp32_master, adam, stage<2>, offload_cpu>(4);
  CHECK(off.device_bytes == Approx(2.0));
  CHECK(off.host_bytes == Approx(3.5));
  // Offload with master == param still stores a separate bf16 master on the host: (2 + 4 + 2) / 2.
  const auto off_bf16 = bytes_per_param<policies::bf16_all, adam, stage<1>, offload_cpu>(2);
  CHECK(off_bf16.device_bytes == Approx(4.0));
  CHECK(off_bf16.host_bytes == Approx(4.0));
  // fp32 SGD at stage 3 with offload, W = 8: device 4 / 8 (parameters), host (4 + 4 + 4) / 8.
  const auto off_fp32 = bytes_per_param<policies::fp32, sgd, stage<3>, offload_cpu>(8);
  CHECK(off_fp32.device_bytes == Approx(0.5));
  CHECK(off_fp32.host_bytes == Approx(1.5));
}

TEST_CASE("memory model: reference facts at every world size", "[policy]") {
  for (int w : {1, 2, 3, 4, 8}) {
    INFO("world = " << w);
    const auto mixed = bytes_per_param<policies::bf16_fp32_master, optim::adam, stage<3>>(w);
    CHECK(mixed.device_bytes == Approx(16.0 / w).epsilon(1e-12));
    CHECK(mixed.host_bytes == 0.0);
    const auto floor = bytes_per_param<policies::bf16_all, optim::adam, stage<3>>(w);
    CHECK(floor.device_bytes == Approx(8.0 / w).epsilon(1e-12));
    // The floor: no named policy stores less with Adam at stage 3.
    for_each_policy([&](auto p) {
      using P = decltype(p);
      CHECK(bytes_per_param<P, optim::adam, stage<3>>(w).total() >= floor.total());
    });
  }
}

TEST_CASE("memory model: every stage x named policy x optimizer x world x offload", "[policy]") {
  for (int w : {1, 2, 3, 4, 8}) {
    for_each_policy([&](auto p) {
      using P = decltype(p);
      check_stages<P, optim::adam>(w, std::integer_sequence<int, 0, 1, 2, 3>{});
      check_stages<P, optim::sgd>(w, std::integer_sequence<int, 0, 1, 2, 3>{});
    });
  }
}

TEST_CASE("memory model: invalid runtime arguments throw invalid_argument naming the value", "[policy]") {
  const state_layout l = layout_of<policies::bf16_fp32_master, optim::adam>();

  // Each in its own scope, so a failure shows only its own message.
  {
    const std::string msg = invalid_argument_message([&] { (void)bytes_per_param(l, 5, offload_kind::none, 2); });
    INFO("stage 5: " << msg);
    CHECK(names_value(msg, "5"));
    CHECK_THAT(msg, Catch::Matchers::Contains("stage"));
  }
  {
    const std::string msg = invalid_argument_message([&] { (void)bytes_per_param(l, -1, offload_kind::none, 2); });
    INFO("stage -1: " << msg);
    CHECK(names_value(msg, "-1"));
  }
  {
    const std::string msg = invalid_argument_message([&] { (void)bytes_per_param(l, 2, offload_kind::none, 0); });
    INFO("world 0: " << msg);
    CHECK(names_value(msg, "0"));
    CHECK_THAT(msg, Catch::Matchers::Contains("world"));
  }
  {
    const std::string msg = invalid_argument_message([&] { (void)bytes_per_param(l, 2, offload_kind::none, -4); });
    INFO("world -4: " << msg);
    CHECK(names_value(msg, "-4"));
  }
  {
    const std::string msg = invalid_argument_message([&] { (void)bytes_per_param(l, 0, offload_kind::cpu, 2); });
    INFO("offload cpu, stage 0: " << msg);
    CHECK(names_value(msg, "0"));
    CHECK_THAT(msg, Catch::Matchers::Contains("offload", Catch::CaseSensitive::No));
  }

  for (const int n : {-1, 4}) {
    state_layout bad = l;
    bad.n_states = n;
    const std::string msg = invalid_argument_message([&] { (void)bytes_per_param(bad, 2, offload_kind::none, 2); });
    INFO("n_states " << n << ": " << msg);
    CHECK(names_value(msg, std::to_string(n)));
    CHECK_THAT(msg, Catch::Matchers::Contains("n_states") && Catch::Matchers::Contains("0 to 3"));
  }

  // Valid neighbours of the invalid values do not throw.
  CHECK_NOTHROW(bytes_per_param(l, 3, offload_kind::none, 1));
  CHECK_NOTHROW(bytes_per_param(l, 1, offload_kind::cpu, 1));
  state_layout stateless = l;
  stateless.n_states = 0;  // plain SGD: parameters, master and gradients only
  CHECK(bytes_per_param(stateless, 0, offload_kind::none, 1).device_bytes == 2 + 4 + 2);
  stateless.n_states = 3;
  CHECK(bytes_per_param(stateless, 0, offload_kind::none, 1).device_bytes == 2 + 4 + 2 + 3 * 4);
}

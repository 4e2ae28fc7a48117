// ZeroOptimizer under mpirun (1-4 ranks): every stage against a single-process
// reference, bit for bit.
//
// Gradients are small multiples of a power of two, so their sums over ranks,
// micro-steps and backward passes are exact in every dtype and in any order: all
// stages then see the same reduced gradients, and the issue's promise ("sharding
// never changes the math") can be checked to the bit, stochastic rounding included.
// The reference is the fused step run by hand over the whole model in one process,
// with those exact sums, so it shares no partitioning, bucketing or communication
// code with the code under test.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <mpzero/backend/host.hpp>
#include <mpzero/comm/local.hpp>
#include <mpzero/comm/mpi.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

#include "support/deferred_backend.hpp"
#include "support/mpi_world.hpp"

using namespace mpzero;

namespace {

using mpzero::testing::world;

// The gradient element `e` of parameter `p` that rank `r` reports in backward pass
// `pass` of optimizer step `step`: an integer in [-8, 8] times 2^-6.
float grad_value(int r, std::uint64_t step, int pass, std::size_t p, std::uint64_t e) {
  const auto bits = element_random_bits(1000 + static_cast<std::uint64_t>(r) * 7919 + p,
                                        step * 16 + static_cast<std::uint64_t>(pass), e);
  return static_cast<float>(static_cast<int>(bits.v[0] % 17u) - 8) * 0x1p-6f;
}

float init_value(std::size_t p, std::uint64_t e) {
  const auto bits = element_random_bits(77, p, e);
  return (static_cast<float>(bits.v[0] % 2001u) - 1000.0f) * 1e-3f;
}

struct scenario {
  std::vector<std::uint64_t> numels;
  int steps = 3;
  int passes = 1;                     // backward passes per optimizer step
  bool skip_param_1_on_step_2 = false;  // a parameter that gets no gradient in one step
  bool report_twice = false;          // parameter 0 reported twice per pass (a shared weight)
  zero_options zo;
};

// Everything a run ends with, indexed by flat element.
struct outcome {
  std::vector<float> params, master, state0, state1;
  std::vector<double> norms;
};

template <class Policy>
std::vector<typename Policy::grad_type> to_grad(const std::vector<float>& v) {
  std::vector<typename Policy::grad_type> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = from_float<typename Policy::grad_type>(v[i]);
  return out;
}

// Gathers a shard's values (flat index -> value) from every rank into one vector.
std::vector<float> allgather_flat(const std::vector<std::pair<std::uint64_t, float>>& mine, std::uint64_t total) {
  std::vector<float> local(total, 0.0f), out(total, 0.0f);
  std::vector<int> have(total, 0), have_all(total, 0);
  for (const auto& [i, v] : mine) {
    local[i] = v;
    have[i] = 1;
  }
  MPI_Allreduce(local.data(), out.data(), static_cast<int>(total), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(have.data(), have_all.data(), static_cast<int>(total), MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  // Every element is owned by exactly one rank.
  REQUIRE(std::count(have_all.begin(), have_all.end(), 1) == static_cast<std::ptrdiff_t>(total));
  return out;
}

template <class Policy, class Opt, int Stage, class Wire = typename Policy::grad_type, class Offload = offload_none,
          class Backend = host_backend>
outcome run_zero(const scenario& sc, const typename Opt::options& opt) {
  auto& c = world();
  ZeroOptimizer<Policy, Opt, stage<Stage>, comm::mpi_communicator, Backend, Offload, Wire> z(c, sc.numels, opt, sc.zo);
  const std::size_t n = sc.numels.size();
  for (std::size_t p = 0; p < n; ++p) {
    std::vector<float> v(sc.numels[p]);
    for (std::uint64_t e = 0; e < v.size(); ++e) v[e] = init_value(p, e);
    z.load_param(p, v.data());
  }
  outcome out;
  std::mt19937 order_gen(static_cast<unsigned>(c.rank()) * 31u + 5u);
  for (int step = 1; step <= sc.steps; ++step) {
    for (int pass = 0; pass < sc.passes; ++pass) {
      // Each rank reports in its own random order: the bucket logic must not care.
      std::vector<std::size_t> order(n);
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::shuffle(order.begin(), order.end(), order_gen);
      for (std::size_t p : order) {
        if (sc.skip_param_1_on_step_2 && step == 2 && p == 1) continue;
        std::vector<float> g(sc.numels[p]);
        for (std::uint64_t e = 0; e < g.size(); ++e) g[e] = grad_value(c.rank(), static_cast<std::uint64_t>(step), pass, p, e);
        const auto gt = to_grad<Policy>(g);
        z.accumulate_grad(p, gt.data());
        if (sc.report_twice && p == 0) z.accumulate_grad(p, gt.data());
      }
      z.end_backward();
    }
    const step_report r = z.step();
    REQUIRE_FALSE(r.skipped);
    out.norms.push_back(r.grad_norm);
  }
  // Parameters: stage 3 gathers everything once.
  const std::uint64_t padded = z.layout().padded_numel();
  if constexpr (Stage == 3) z.gather(0, n);
  out.params.assign(padded, 0.0f);
  for (std::size_t p = 0; p < n; ++p) {
    const auto span = z.param(p);
    for (std::uint64_t e = 0; e < span.size(); ++e) out.params[z.flat_offset(p) + e] = to_float(span[e]);
  }
  if constexpr (Stage == 3) z.release(0, n);
  std::vector<std::pair<std::uint64_t, float>> m, s0, s1;
  z.read_master_shard([&](std::uint64_t i, float v) { m.emplace_back(i, v); });
  z.read_state_shard(0, [&](std::uint64_t i, float v) { s0.emplace_back(i, v); });
  if constexpr (Opt::n_states > 1) z.read_state_shard(1, [&](std::uint64_t i, float v) { s1.emplace_back(i, v); });
  if constexpr (Stage == 0) {
    out.master.assign(padded, 0.0f);  // every rank holds everything: no gather
    for (const auto& [i, v] : m) out.master[i] = v;
    out.state0.assign(padded, 0.0f);
    for (const auto& [i, v] : s0) out.state0[i] = v;
    out.state1.assign(padded, 0.0f);
    for (const auto& [i, v] : s1) out.state1[i] = v;
  } else {
    out.master = allgather_flat(m, padded);
    out.state0 = allgather_flat(s0, padded);
    if constexpr (Opt::n_states > 1) out.state1 = allgather_flat(s1, padded);
    else out.state1.assign(padded, 0.0f);
  }
  return out;
}

// The single-process reference: the whole model as one flat tensor (in the same
// flat order as the optimizer: large parameters first), exact gradient sums over
// all ranks, the fused step with grad_scale = 1 / world.
template <class Policy, class Opt>
outcome run_reference(const scenario& sc, const typename Opt::options& opt, const std::vector<std::uint64_t>& flat_offset,
                      std::uint64_t padded) {
  const int W = world().size();
  using P = typename Policy::param_type;
  using M = typename Policy::master_type;
  using S = typename Policy::state_type;
  std::vector<P> param(padded);
  std::vector<M> master(Policy::master_is_param ? 0 : padded);
  std::vector<S> s0(padded), s1(padded);
  std::vector<typename Policy::grad_type> grad(padded);
  for (std::size_t p = 0; p < sc.numels.size(); ++p) {
    for (std::uint64_t e = 0; e < sc.numels[p]; ++e) {
      param[flat_offset[p] + e] = from_float<P>(init_value(p, e));
      if constexpr (!Policy::master_is_param) master[flat_offset[p] + e] = from_float<M>(init_value(p, e));
    }
  }
  // The whole model as one tensor; with parameter groups (zero_options::param_groups),
  // each parameter as its own tensor, stepped with its group's lr (the optimizer's times
  // lr_scale) and weight decay (the group's, else the optimizer's).
  const auto tensor = [&](std::uint64_t at, std::uint64_t numel) {
    step_tensor<Policy, Opt> t;
    t.param = param.data() + at;
    if constexpr (!Policy::master_is_param) t.master = master.data() + at;
    t.grad = grad.data() + at;
    t.states[0] = s0.data() + at;
    if constexpr (Opt::n_states > 1) t.states[1] = s1.data() + at;
    t.numel = numel;
    t.global_offset = at;
    return t;
  };
  std::vector<fused_step<Policy, Opt>> steps;
  std::vector<typename Opt::options> step_opts;
  if (sc.zo.param_groups.empty()) {
    steps.emplace_back(std::vector<step_tensor<Policy, Opt>>{tensor(0, padded)});
    step_opts.push_back(opt);
  } else {
    for (std::size_t p = 0; p < sc.numels.size(); ++p) {
      if (sc.numels[p] == 0) continue;
      const param_group_options& g = sc.zo.param_groups[sc.zo.group_of[p]];
      typename Opt::options o = opt;
      o.lr = opt.lr * g.lr_scale;
      if (g.weight_decay) o.weight_decay = *g.weight_decay;
      steps.emplace_back(std::vector<step_tensor<Policy, Opt>>{tensor(flat_offset[p], sc.numels[p])});
      step_opts.push_back(o);
    }
  }
  outcome out;
  for (int step = 1; step <= sc.steps; ++step) {
    long double norm_sq = 0;
    for (std::size_t p = 0; p < sc.numels.size(); ++p) {
      for (std::uint64_t e = 0; e < sc.numels[p]; ++e) {
        float sum = 0;  // exact: small integers times 2^-6
        const int reports = sc.report_twice && p == 0 ? 2 : 1;
        for (int r = 0; r < W; ++r)
          for (int pass = 0; pass < sc.passes; ++pass)
            if (!(sc.skip_param_1_on_step_2 && step == 2 && p == 1))
              sum += static_cast<float>(reports) * grad_value(r, static_cast<std::uint64_t>(step), pass, p, e);
        grad[flat_offset[p] + e] = from_float<typename Policy::grad_type>(sum);
        if (to_float(grad[flat_offset[p] + e]) != sum) FAIL("the premise broke: a gradient sum is not exact in the grad dtype");
        norm_sq += static_cast<long double>(sum) * sum;
      }
    }
    out.norms.push_back(static_cast<double>(std::sqrt(norm_sq) / W));
    for (std::size_t k = 0; k < steps.size(); ++k) {
      host::run(steps[k], make_step_args<Opt>(step_opts[k], static_cast<std::uint64_t>(step),
                                              static_cast<float>(1.0 / W), sc.zo.seed));
    }
  }
  out.params.resize(padded);
  out.master.resize(padded);
  out.state0.resize(padded);
  out.state1.assign(padded, 0.0f);
  for (std::uint64_t i = 0; i < padded; ++i) {
    out.params[i] = to_float(param[i]);
    if constexpr (Policy::master_is_param) {
      out.master[i] = to_float(param[i]);
    } else {
      out.master[i] = to_float(master[i]);
    }
    out.state0[i] = to_float(s0[i]);
    if constexpr (Opt::n_states > 1) out.state1[i] = to_float(s1[i]);
  }
  return out;
}

template <class Policy, class Opt, int Stage, class Wire = typename Policy::grad_type, class Offload = offload_none,
          class Backend = host_backend>
void check_against_reference(const scenario& sc, const typename Opt::options& opt) {
  const outcome got = run_zero<Policy, Opt, Stage, Wire, Offload, Backend>(sc, opt);
  // The flat order, from an optimizer with the same layout rules.
  comm::mpi_communicator& c = world();
  ZeroOptimizer<Policy, Opt, stage<0>, comm::mpi_communicator> probe(c, sc.numels, opt, sc.zo);
  std::vector<std::uint64_t> offsets(sc.numels.size());
  for (std::size_t p = 0; p < offsets.size(); ++p) offsets[p] = probe.flat_offset(p);
  const outcome ref = run_reference<Policy, Opt>(sc, opt, offsets, probe.layout().padded_numel());
  INFO("stage " << Stage << ", rank " << c.rank() << " of " << c.size());
  REQUIRE(got.params.size() == ref.params.size());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < ref.params.size(); ++i) {
    const auto bits = [](float x) { return std::bit_cast<std::uint32_t>(x); };
    const bool same = bits(got.params[i]) == bits(ref.params[i]) && bits(got.master[i]) == bits(ref.master[i]) &&
                      bits(got.state0[i]) == bits(ref.state0[i]) && bits(got.state1[i]) == bits(ref.state1[i]);
    if (!same && mismatches++ == 0) {
      UNSCOPED_INFO("first mismatch at flat " << i << ": param " << got.params[i] << " vs " << ref.params[i] << ", master "
                                              << got.master[i] << " vs " << ref.master[i] << ", m " << got.state0[i]
                                              << " vs " << ref.state0[i] << ", v " << got.state1[i] << " vs " << ref.state1[i]);
    }
  }
  REQUIRE(mismatches == 0);
  for (std::size_t s = 0; s < ref.norms.size(); ++s) REQUIRE(got.norms[s] == Approx(ref.norms[s]).epsilon(1e-12));
}

scenario uneven() {
  scenario sc;
  // Zero-sized parameters first, middle and last; sizes not divisible by any world
  // size; one large parameter straddling every partition; persistent small ones.
  sc.numels = {0, 5, 1000, 3, 70001, 17, 1, 0, 25000, 0};
  sc.zo.reduce_bucket_numel = 4096;  // many buckets
  sc.zo.param_persistence_threshold = 20;
  sc.zo.seed = 99;
  return sc;
}

template <class Policy, class Opt, class Wire = typename Policy::grad_type>
void all_stages(const scenario& sc, const typename Opt::options& opt) {
  SECTION("stage 0") { check_against_reference<Policy, Opt, 0, Wire>(sc, opt); }
  SECTION("stage 1") { check_against_reference<Policy, Opt, 1, Wire>(sc, opt); }
  SECTION("stage 2") { check_against_reference<Policy, Opt, 2, Wire>(sc, opt); }
  SECTION("stage 3") { check_against_reference<Policy, Opt, 3, Wire>(sc, opt); }
}

optim::adamw::options adamw_opts() {
  optim::adamw::options o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  return o;
}

}  // namespace

TEST_CASE("ZeRO stages match the single-process reference bit for bit: fp32", "[zero]") {
  all_stages<policies::fp32, optim::adamw>(uneven(), adamw_opts());
}

TEST_CASE("ZeRO stages match the reference: bf16 params with fp32 master", "[zero]") {
  all_stages<policies::bf16_fp32_master, optim::adam>(uneven(), optim::adam::options{});
}

TEST_CASE("ZeRO stages match the reference: all bf16 with stochastic rounding", "[zero]") {
  all_stages<policies::bf16_all_sr, optim::adamw>(uneven(), adamw_opts());
}

TEST_CASE("ZeRO stages match the reference: bf16 master (the parameters) with fp32 states", "[zero]") {
  all_stages<policies::bf16_master_fp32_states, optim::adamw>(uneven(), adamw_opts());
}

// Parameter groups: three groups (the optimizer's own hyperparameters; half the lr and
// no weight decay, the usual group of biases and norms; twice the lr and more decay)
// interleaved over the uneven model, so each rank's shard holds pieces of every group.
scenario grouped() {
  scenario sc = uneven();
  sc.zo.param_groups = {{}, {0.5, 0.0}, {2.0, 0.3}};
  sc.zo.group_of = {0, 1, 2, 1, 0, 2, 1, 2, 0, 1};
  return sc;
}

TEST_CASE("ZeRO parameter groups: each group's lr and weight decay, every stage, bit for bit", "[zero]") {
  all_stages<policies::fp32, optim::adamw>(grouped(), adamw_opts());
}

TEST_CASE("ZeRO parameter groups: stochastic rounding keeps each element's key; Lion and SGD", "[zero]") {
  all_stages<policies::bf16_all_sr, optim::adamw>(grouped(), adamw_opts());
  optim::lion::options lion;
  lion.weight_decay = 0.05;
  optim::sgd::options sgd;
  sgd.momentum = 0.9;
  sgd.weight_decay = 0.01;
  SECTION("Lion, stage 2") { check_against_reference<policies::bf16_fp32_master, optim::lion, 2>(grouped(), lion); }
  SECTION("SGD, stage 3") { check_against_reference<policies::fp32, optim::sgd, 3>(grouped(), sgd); }
}

TEST_CASE("ZeRO parameter groups: an lr change moves every group in proportion", "[zero]") {
  auto& c = world();
  const scenario sc = grouped();
  ZeroOptimizer<policies::fp32, optim::adamw, stage<1>, comm::mpi_communicator> z(c, sc.numels, adamw_opts(), sc.zo);
  REQUIRE(z.num_groups() == 3);
  optim::adamw::options o = z.options();
  o.lr = 4e-3;
  z.set_options(o);
  REQUIRE(z.lr(0) == 4e-3);
  REQUIRE(z.lr(1) == 2e-3);
  REQUIRE(z.lr(2) == 8e-3);
  REQUIRE_THROWS_WITH(z.lr(3), Catch::Contains("lr(3): there are 3 parameter groups"));
  // Without groups: one, the optimizer's own.
  ZeroOptimizer<policies::fp32, optim::adamw, stage<1>, comm::mpi_communicator> plain(c, sc.numels, o, uneven().zo);
  REQUIRE(plain.num_groups() == 1);
  REQUIRE(plain.lr(0) == 4e-3);
}

TEST_CASE("ZeRO parameter groups: a wrong group list or hyperparameter is refused with a message", "[zero]") {
  auto& c = world();
  const scenario base = grouped();
  const auto make = [&](const zero_options& zo) {
    ZeroOptimizer<policies::fp32, optim::adamw, stage<2>, comm::mpi_communicator> z(c, base.numels, adamw_opts(), zo);
  };
  zero_options zo = base.zo;
  zo.group_of.pop_back();
  REQUIRE_THROWS_WITH(make(zo), Catch::Contains("group_of has 9 entries for 10 parameters"));
  zo = base.zo;
  zo.group_of[4] = 3;
  REQUIRE_THROWS_WITH(make(zo), Catch::Contains("group_of[4] = 3, but there are 3 groups") &&
                                    Catch::Contains("use an index below 3"));
  zo = base.zo;
  zo.param_groups.clear();
  REQUIRE_THROWS_WITH(make(zo), Catch::Contains("there is 1 group"));
  zo = base.zo;
  zo.param_groups[1].lr_scale = -1.0;
  REQUIRE_THROWS_WITH(make(zo), Catch::Contains("param_groups[1].lr_scale = -1"));
  zo = base.zo;
  zo.param_groups[2].weight_decay = -0.5;
  REQUIRE_THROWS_WITH(make(zo), Catch::Contains("weight_decay") && Catch::Contains("parameter group 2") &&
                                    Catch::Contains("weight_decay -0.5"));
  // Ranks that pass other groups are refused alike on every rank.
  if (c.size() > 1) {
    zo = base.zo;
    if (c.rank() == 1) zo.group_of[0] = 1;
    REQUIRE_THROWS_WITH(make(zo), Catch::Contains("parameter layouts or options"));
  }
}

TEST_CASE("ZeRO-3: gather_dtypes gathers chosen parameters in bf16, a save's gather reads fp32", "[zero]") {
  auto& c = world();
  const scenario base = uneven();
  zero_options zo = base.zo;
  const std::size_t n = base.numels.size();
  for (std::size_t i = 0; i < n; ++i) zo.gather_dtypes.push_back(i % 2 == 0 ? dtype::bf16 : dtype::fp32);
  ZeroOptimizer<policies::fp32, optim::adamw, stage<3>, comm::mpi_communicator> z(c, base.numels, adamw_opts(), zo);
  ZeroOptimizer<policies::fp32, optim::adamw, stage<3>, comm::mpi_communicator> plain(c, base.numels, adamw_opts(),
                                                                                      base.zo);
  for (auto* o : {&z, &plain}) {
    for (std::size_t p = 0; p < n; ++p) {
      std::vector<float> v(base.numels[p]);
      for (std::uint64_t e = 0; e < v.size(); ++e) v[e] = init_value(p, e) * 1.0009765625f;  // not exact in bf16
      o->load_param(p, v.data());
    }
  }
  // bf16 from fp32 by the format's definition: round to nearest, ties to even.
  const auto bf16_bits = [](float x) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
    return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  };
  z.gather(0, n, true);
  std::vector<std::vector<float>> stored(n);
  for (std::size_t p = 0; p < n; ++p) {
    const auto v = z.param(p);
    stored[p].assign(v.begin(), v.end());
  }
  z.release(0, n);
  plain.gather(0, n);
  const std::uint64_t plain_bytes = plain.memory().buckets;
  plain.release(0, n);
  z.gather(0, n);
  if (c.size() > 1) CHECK(z.memory().buckets < plain_bytes);
  std::size_t checked = 0;
  for (std::size_t p = 0; p < n; ++p) {
    INFO("parameter " << p << ", rank " << c.rank() << " of " << c.size());
    const dtype want = z.is_persistent(p) || base.numels[p] == 0 ? dtype::fp32 : zo.gather_dtypes[p];
    REQUIRE(z.core().param_dtype(p) == want);
    if (want == dtype::fp32) {
      const float* got = static_cast<const float*>(z.core().param(p));
      for (std::uint64_t e = 0; e < base.numels[p]; ++e) REQUIRE(got[e] == stored[p][e]);
      continue;
    }
    REQUIRE_THROWS_WITH(z.param(p), Catch::Contains("is gathered in bf16 (zero_options::gather_dtypes)"));
    const auto* got = static_cast<const std::uint16_t*>(z.core().param(p));
    for (std::uint64_t e = 0; e < base.numels[p]; ++e, ++checked) REQUIRE(got[e] == bf16_bits(stored[p][e]));
  }
  CHECK(checked == 1000 + 70001 + 25000);
  // One group, one way at a time.
  REQUIRE_THROWS_WITH(z.gather(0, n, true), Catch::Contains("gathered in zero_options::gather_dtypes; release() it"));
  z.release(0, n);
  // A wrong list is refused.
  zero_options bad = base.zo;
  bad.gather_dtypes.assign(n - 1, dtype::bf16);
  REQUIRE_THROWS_WITH((ZeroOptimizer<policies::fp32, optim::adamw, stage<3>, comm::mpi_communicator>(
                          c, base.numels, adamw_opts(), bad)),
                      Catch::Contains("gather_dtypes has 9 entries for 10 parameters"));
  bad.gather_dtypes.assign(n, dtype::fp16);
  REQUIRE_THROWS_WITH((ZeroOptimizer<policies::bf16_fp32_master, optim::adamw, stage<3>, comm::mpi_communicator>(
                          c, base.numels, adamw_opts(), bad)),
                      Catch::Contains("gather_dtypes[0] = fp16 would round bf16 parameters"));
}

TEST_CASE("ZeRO: accumulation over several backward passes per step, a shared weight, a missing gradient", "[zero]") {
  scenario sc = uneven();
  sc.passes = 3;
  sc.report_twice = true;
  sc.skip_param_1_on_step_2 = true;
  all_stages<policies::bf16_all_sr, optim::adamw>(sc, adamw_opts());
}

TEST_CASE("ZeRO: 3 ranks, two tiny parameters (empty partitions), and an empty model", "[zero]") {
  scenario sc;
  sc.numels = {1, 2};
  sc.zo.param_persistence_threshold = 0;
  all_stages<policies::fp32, optim::adamw>(sc, adamw_opts());
  scenario empty;
  empty.numels = {0, 0};
  all_stages<policies::fp32, optim::adamw>(empty, adamw_opts());
}

namespace {

template <class Policy, class Opt, int Stage>
void check_memory(const std::vector<std::uint64_t>& numels) {
  auto& c = world();
  zero_options zo;
  zo.param_persistence_threshold = 0;  // the model counts partitioned parameters only
  zo.reduce_bucket_numel = 1000;
  zo.loss_scaling = Policy::needs_loss_scaling;
  ZeroOptimizer<Policy, Opt, stage<Stage>, comm::mpi_communicator> z(c, numels, typename Opt::options{}, zo);
  const memory_report m = z.memory();
  const std::uint64_t padded = z.layout().padded_numel();
  const double model = bytes_per_param<Policy, Opt, stage<Stage>>(c.size()).device_bytes;
  INFO("stage " << Stage << " world " << c.size() << " padded " << padded);
  // The model's fractions (14/3 bytes, say) are not exact in double: within half a byte.
  REQUIRE(std::fabs(static_cast<double>(m.model_state_bytes()) - model * static_cast<double>(padded)) < 0.5);
  // Padding: the partitions are multiples of 8 elements.
  REQUIRE(m.padding_numel < 8u * static_cast<std::uint64_t>(c.size()));
  REQUIRE(m.model_numel + m.padding_numel == padded);
  // Nothing transient before the first backward.
  REQUIRE(m.buckets == 0);
}

template <class Policy, class Opt>
void check_memory_all_stages() {
  const std::vector<std::uint64_t> numels{0, 5, 1000, 3, 70001, 17, 1, 0, 25000};
  check_memory<Policy, Opt, 0>(numels);
  check_memory<Policy, Opt, 1>(numels);
  check_memory<Policy, Opt, 2>(numels);
  check_memory<Policy, Opt, 3>(numels);
}

}  // namespace

TEST_CASE("ZeRO: allocated model-state bytes equal the memory model for every stage and policy", "[zero]") {
  check_memory_all_stages<policies::fp32, optim::adam>();
  check_memory_all_stages<policies::bf16_fp32_master, optim::adamw>();
  check_memory_all_stages<policies::bf16_master_fp32_states, optim::adamw>();
  check_memory_all_stages<policies::bf16_all_sr, optim::adamw>();
  check_memory_all_stages<policies::fp16_fp32_master, optim::adam>();
  check_memory_all_stages<policies::bf16_all, optim::sgd>();
  check_memory_all_stages<policies::bf16_fp32_master, optim::lion>();
}

TEST_CASE("ZeRO: an fp16 policy without loss scaling is refused with a message", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{10};
  using Z = ZeroOptimizer<policies::fp16_fp32_master, optim::adam, stage<1>, comm::mpi_communicator>;
  REQUIRE_THROWS_WITH(Z(c, numels, optim::adam::options{}, zero_options{}),
                      Catch::Contains("loss_scaling = true") && Catch::Contains("bf16"));
}

TEST_CASE("ZeRO: the host backend refuses a communicator that reads device memory", "[zero]") {
  // What marks a device communicator (comm::reads_device_memory): wait_for(cudaStream_t),
  // as nccl_communicator has (comm::stream_ordered), its type-erased form
  // wait_for_stream(void*), or a run-time answer (also when declared non-const).
  struct ordered_comm : comm::local_communicator {
    void wait_for(CUstream_st*) {}
  };
  struct erased_wait {
    bool wait_for_stream(void*) { return true; }
  };
  struct answers {
    bool device = false;
    bool reads_device_memory() const { return device; }
  };
  struct answers_non_const {
    bool reads_device_memory() { return true; }
  };
  STATIC_REQUIRE(comm::stream_ordered<ordered_comm>);
  STATIC_REQUIRE_FALSE(comm::stream_ordered<comm::local_communicator>);
  CHECK_FALSE(comm::reads_device_memory(world()));
  CHECK_FALSE(comm::reads_device_memory(comm::local_communicator{}));
  CHECK(comm::reads_device_memory(ordered_comm{}));
  CHECK(comm::reads_device_memory(erased_wait{}));
  CHECK(comm::reads_device_memory(answers{true}));
  CHECK_FALSE(comm::reads_device_memory(answers{false}));
  CHECK(comm::reads_device_memory(answers_non_const{}));

  const std::vector<std::uint64_t> numels{10};
  ordered_comm device_comm;
  using Z = ZeroOptimizer<policies::fp32, optim::adam, stage<1>, ordered_comm>;
  REQUIRE_THROWS_WITH(Z(device_comm, numels, optim::adam::options{}, zero_options{}),
                      Catch::Contains("the backend keeps its buffers in host memory, but the communicator (rank 0 of "
                                      "1) reads device memory") &&
                          Catch::Contains("mpi_communicator") && Catch::Contains("CUDA backend"));
  // The host communicators pass the check.
  using Zw = ZeroOptimizer<policies::fp32, optim::adam, stage<1>, comm::mpi_communicator>;
  CHECK_NOTHROW(Zw(world(), numels, optim::adam::options{}, zero_options{}));
}

TEST_CASE("ZeRO: construction is collective: a lone rank's failure or another layout throws on every rank", "[zero]") {
  auto& c = world();
  using Z = ZeroOptimizer<policies::bf16_fp32_master, optim::adamw, stage<2>, comm::mpi_communicator>;
  const std::vector<std::uint64_t> numels{300, 0, 40};
  zero_options zo;
  zo.reduce_bucket_numel = 100;
  if (c.size() > 1) {
    const std::string other = "ZeroOptimizer: rank 1 of " + std::to_string(c.size()) + " failed (its exception says why)";
    // An option only rank 1 gets wrong: it says what, the others name it.
    zero_options bad = zo;
    if (c.rank() == 1) bad.reduce_bucket_numel = 0;
    CHECK_THROWS_WITH(Z(c, numels, {}, bad), Catch::Contains(c.rank() == 1 ? "reduce_bucket_numel = 0" : other));
    // A parameter too large for rank 1 only (its memory or address space).
    std::vector<std::uint64_t> huge = numels;
    if (c.rank() == 1) huge[0] = std::uint64_t{1} << 62;
    std::string msg;
    try {
      Z z(c, huge, {}, zo);
    } catch (const std::exception& e) {  // rank 1: whatever running out throws
      msg = e.what();
    }
    INFO(msg);
    CHECK_FALSE(msg.empty());
    CHECK((msg.find(other) == std::string::npos) == (c.rank() == 1));  // rank 1 says its own reason
    // Another layout (a parameter's size) or another option (the bucket) on rank 1:
    // every rank throws, naming its own side.
    std::vector<std::uint64_t> other_numels = numels;
    if (c.rank() == 1) other_numels[2] = 41;
    CHECK_THROWS_WITH(Z(c, other_numels, {}, zo),
                      Catch::Contains("ZeroOptimizer: the ranks passed different parameter layouts or options") &&
                          Catch::Contains(c.rank() == 1 ? "3 parameters of 341 elements" : "3 parameters of 340 elements"));
    zero_options other_bucket = zo;
    if (c.rank() == 1) other_bucket.reduce_bucket_numel = 200;
    CHECK_THROWS_WITH(Z(c, numels, {}, other_bucket),
                      Catch::Contains("different parameter layouts or options") &&
                          Catch::Contains(c.rank() == 1 ? "reduce_bucket_numel 200" : "reduce_bucket_numel 100"));
    zero_options other_scaler = zo;
    other_scaler.loss_scaling = true;
    if (c.rank() == 1) other_scaler.loss_scale.initial_scale_power = 12;
    CHECK_THROWS_WITH(Z(c, numels, {}, other_scaler), Catch::Contains("different parameter layouts or options"));
  }
  // The same everywhere constructs, and the ranks' collectives still line up after the
  // refusals: a step trains.
  Z z(c, numels, {}, zo);
  const std::vector<float> init(300, 0.5f), g(300, 0.25f);
  for (std::size_t p = 0; p < numels.size(); ++p) z.load_param(p, init.data());
  for (std::size_t p = 0; p < numels.size(); ++p) z.accumulate_grad(p, g.data());
  z.end_backward();
  CHECK(z.step().step == 1);
}

TEST_CASE("ZeRO: an overflow on one rank skips the step on all ranks and leaves every state untouched", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{300, 7, 5000};
  zero_options zo;
  zo.loss_scaling = true;
  zo.loss_scale.initial_scale_power = 8;
  zo.loss_scale.hysteresis = 1;
  zo.reduce_bucket_numel = 512;
  ZeroOptimizer<policies::fp16_fp32_master, optim::adam, stage<2>, comm::mpi_communicator> z(c, numels, {}, zo);
  auto feed = [&](bool poison) {
    for (std::size_t p = 0; p < numels.size(); ++p) {
      std::vector<fp16> g(numels[p], fp16_from_float_rn(0.25f));
      // The last rank alone sees an infinity (an fp16 overflow of its scaled loss).
      if (poison && p == 2 && c.rank() == c.size() - 1) g[4999] = fp16::from_bits(0x7c00);
      z.accumulate_grad(p, g.data());
    }
    z.end_backward();
  };
  feed(false);
  step_report r = z.step();
  REQUIRE_FALSE(r.skipped);
  REQUIRE(r.loss_scale == 256.0);
  std::vector<std::pair<std::uint64_t, float>> before, after, sb, sa;
  z.read_master_shard([&](std::uint64_t i, float v) { before.emplace_back(i, v); });
  z.read_state_shard(1, [&](std::uint64_t i, float v) { sb.emplace_back(i, v); });
  const float p0 = to_float(z.param(0)[0]);
  feed(true);
  r = z.step();
  REQUIRE(r.overflow);
  REQUIRE(r.skipped);
  REQUIRE(r.step == 1);               // the skipped step does not count
  REQUIRE(z.loss_scale() == 128.0);   // hysteresis 1: halved at once
  z.read_master_shard([&](std::uint64_t i, float v) { after.emplace_back(i, v); });
  z.read_state_shard(1, [&](std::uint64_t i, float v) { sa.emplace_back(i, v); });
  REQUIRE(before == after);
  REQUIRE(sb == sa);
  REQUIRE(to_float(z.param(0)[0]) == p0);
  // The next clean step proceeds from the untouched state, with the gradients of the
  // skipped step gone (they were zeroed).
  feed(false);
  r = z.step();
  REQUIRE_FALSE(r.skipped);
  REQUIRE(r.step == 2);
  REQUIRE(r.loss_scale == 128.0);
}

TEST_CASE("ZeRO: fp16 training that keeps overflowing ends in loss_scale_error on every rank", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{64};
  zero_options zo;
  zo.loss_scaling = true;
  zo.loss_scale.initial_scale_power = 2;  // 4 -> 2 -> 1 (the minimum) -> error
  zo.loss_scale.hysteresis = 1;
  ZeroOptimizer<policies::fp16_fp32_master, optim::adam, stage<1>, comm::mpi_communicator> z(c, numels, {}, zo);
  std::vector<fp16> g(64, fp16::from_bits(0x7e00));  // NaN on every rank
  int steps = 0;
  bool threw = false;
  try {
    for (; steps < 10; ++steps) {
      z.accumulate_grad(0, g.data());
      z.step();
    }
  } catch (const loss_scale_error& e) {
    threw = true;
    REQUIRE_THAT(e.what(), Catch::Contains("bf16"));
  }
  REQUIRE(threw);
  REQUIRE(steps == 2);  // two halvings, then the overflow at the minimum throws
  int all = 0;
  MPI_Allreduce(&steps, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);  // every rank got here, no hang
  REQUIRE(all == 2 * c.size());
  // The failed step's gradients stay reduced: no additions on top of them (stage 1's
  // in-place reduction leaves the blocks a rank does not own unspecified) until
  // zero_grad() drops them.
  REQUIRE_THROWS_WITH(z.accumulate_grad(0, g.data()), Catch::Contains("already reduced"));
  z.zero_grad();
  REQUIRE_NOTHROW(z.accumulate_grad(0, g.data()));
}

TEST_CASE("ZeRO: gradient clipping uses the global norm over all partitions", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{1000, 3, 2000};
  for (int st : {0, 2}) {
    zero_options zo;
    zo.gradient_clipping = 0.5;
    zo.reduce_bucket_numel = 700;
    optim::sgd::options o;
    o.lr = 1.0;
    o.momentum = 0.0;
    // Rank r reports gradient (r + 1) * 2^-4 everywhere; the average is (W + 1) / 2 * 2^-4.
    std::vector<float> g(2000, static_cast<float>(c.rank() + 1) * 0x1p-4f);
    const double avg = (c.size() + 1) / 2.0 * 0x1p-4;
    const double norm = avg * std::sqrt(3003.0);
    auto check = [&](auto& z) {
      for (std::size_t p = 0; p < numels.size(); ++p) z.accumulate_grad(p, g.data());
      const step_report r = z.step();
      REQUIRE(r.grad_norm == Approx(norm).epsilon(1e-12));
      REQUIRE(r.clip_coefficient == Approx(0.5 / (norm + 1e-6)).epsilon(1e-12));
      // SGD with lr 1 from zero: the parameter is minus the clipped gradient.
      const float expect = -static_cast<float>(avg * r.clip_coefficient);
      REQUIRE(z.param(1)[0] == Approx(expect).epsilon(1e-6));
    };
    if (st == 0) {
      ZeroOptimizer<policies::fp32, optim::sgd, stage<0>, comm::mpi_communicator> z(c, numels, o, zo);
      check(z);
    } else {
      ZeroOptimizer<policies::fp32, optim::sgd, stage<2>, comm::mpi_communicator> z(c, numels, o, zo);
      check(z);
    }
  }
}

TEST_CASE("ZeRO-3: prefetch, gather and release; using a partitioned parameter without gathering is an error", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{4000, 10, 3000, 5000};
  zero_options zo;
  zo.param_persistence_threshold = 100;
  ZeroOptimizer<policies::bf16_all, optim::adamw, stage<3>, comm::mpi_communicator> z(c, numels, {}, zo);
  for (std::size_t p = 0; p < numels.size(); ++p) {
    std::vector<float> v(numels[p]);
    for (std::uint64_t e = 0; e < v.size(); ++e) v[e] = init_value(p, e);
    z.load_param(p, v.data());
  }
  REQUIRE_THROWS_WITH(z.param(0), Catch::Contains("gather()"));
  REQUIRE(z.param(1).size() == 10);  // persistent: always whole
  z.prefetch(0, 2);
  z.prefetch(2, 4);
  z.gather(0, 2);
  z.gather(2, 4);
  for (std::size_t p : {0u, 2u, 3u}) {
    const auto s = z.param(p);
    REQUIRE(s.size() == numels[p]);
    for (std::uint64_t e = 0; e < s.size(); e += 97) REQUIRE(to_float(s[e]) == to_float(bf16_from_float_rn(init_value(p, e))));
  }
  // The gathered copies count as buckets; one rank's gathered parameters are its
  // partition, with no copy.
  if (c.size() > 1) {
    REQUIRE(z.memory().buckets > 0);
  } else {
    REQUIRE(z.memory().buckets == 0);
  }
  z.release(0, 2);
  z.release(2, 4);
  REQUIRE_THROWS_WITH(z.param(2), Catch::Contains("gather()"));
  REQUIRE_THROWS_WITH(z.release(0, 2), Catch::Contains("not gathered"));
  REQUIRE(z.memory().buckets == 0);

  // What rewrites the partitions waits for every group to be released: a prefetch in
  // flight or a gathered copy would see old or half-written values.
  z.gather(0, 2);
  z.gather(2, 4);
  std::vector<float> g(numels[0], 1.0f);
  z.accumulate_grad(0, to_grad<policies::bf16_all>(g).data());
  z.end_backward();
  REQUIRE_THROWS_WITH(z.step(), Catch::Contains("step: 2 parameter group(s) are gathered") &&
                                    Catch::Contains("release() them first"));
  const std::vector<float> v0(numels[0], 0.5f);
  REQUIRE_THROWS_WITH(z.load_param(0, v0.data()), Catch::Contains("load_param: 2 parameter group(s)"));
  z.release(0, 2);
  z.release(2, 4);
  z.prefetch(0, 2);  // in flight
  REQUIRE_THROWS_WITH(z.step(), Catch::Contains("1 parameter group(s) are gathered (e.g. [0, 2))"));
  // A partitioned parameter is in one gathered group at a time: an overlapping range is
  // refused, naming it and the group, and the group already gathered is unharmed.
  REQUIRE_THROWS_WITH(z.gather(0, 3), Catch::Contains("gather/prefetch(0, 3): parameter 0 is already in the "
                                                      "gathered group [0, 2)"));
  REQUIRE_THROWS_WITH(z.prefetch(0, 1), Catch::Contains("parameter 0 is already in the gathered group [0, 2)"));
  // Ranges that share only a persistent parameter (1), or nothing (an empty range), may coexist.
  z.gather(1, 4);
  REQUIRE(z.param(3).size() == numels[3]);
  z.release(1, 4);
  z.prefetch(1, 1);
  z.release(1, 1);
  z.gather(0, 2);
  REQUIRE(z.param(0).size() == numels[0]);
  z.gather(2, 4);  // disjoint: fine
  z.release(2, 4);
  z.release(0, 2);
  REQUIRE(z.step().step == 1);  // the refused steps lost nothing: the gradients were still there
}

TEST_CASE("ZeRO: bad calls are refused with the value and the fix, before anything changes", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{300, 0, 40};
  zero_options zo;
  zo.reduce_bucket_numel = 100;
  auto run = [&](auto& z, int st) {
    INFO("stage " << st << ", rank " << c.rank() << " of " << c.size());
    const std::vector<float> g(300, 0x1p-6f), init(300, 0.25f);
    // Null sources; an empty parameter needs none.
    REQUIRE_THROWS_WITH(z.load_param(0, static_cast<const float*>(nullptr)),
                        Catch::Contains("load_param(0): the pointer is null; pass 300 values"));
    REQUIRE_THROWS_WITH(z.accumulate_grad(2, static_cast<const float*>(nullptr)),
                        Catch::Contains("accumulate_grad(2): the pointer is null; pass 40 values"));
    REQUIRE_NOTHROW(z.load_param(1, static_cast<const float*>(nullptr)));
    for (std::size_t p = 0; p < numels.size(); ++p) z.load_param(p, init.data());
    // A non-finite multiplier, named.
    REQUIRE_THROWS_WITH(z.accumulate_grad(0, g.data(), std::numeric_limits<float>::quiet_NaN()),
                        Catch::Contains("scale = nan") && Catch::Contains("finite multiplier"));
    REQUIRE_THROWS_WITH(z.accumulate_grad(0, g.data(), std::numeric_limits<float>::infinity()),
                        Catch::Contains("scale = inf"));
    // A step from no gradient at all, on every rank alike; nothing changes, and the
    // optimizer goes on as new.
    REQUIRE_FALSE(z.grads_pending());
    REQUIRE_THROWS_AS(z.step(), no_gradients_error);
    REQUIRE_THROWS_WITH(z.step(), Catch::Contains("no rank reported a gradient") && Catch::Contains("step 1 ") &&
                                      Catch::Contains("run a backward pass first"));
    REQUIRE(z.steps() == 0);
    z.zero_grad();
    REQUIRE_THROWS_WITH(z.step(), Catch::Contains("no rank reported a gradient"));
    // A bad index reads nothing and reduces nothing: the backward still takes gradients.
    REQUIRE_THROWS_WITH(z.full_grad(7), Catch::Contains("parameter index 7 is out of range"));
    // One rank's gradient is enough for a step: the others add zeros. They call nothing
    // before step(): at stages 2-3 step() ends an empty pass for them, which joins rank
    // 0's bucket reductions (without it they would wait in different collectives).
    if (c.rank() == 0) {
      for (std::size_t p = numels.size(); p-- > 0;) z.accumulate_grad(p, g.data());
      z.end_backward();
    }
    const step_report r = z.step();
    REQUIRE(r.step == 1);
    REQUIRE(r.grad_norm > 0.0);
    REQUIRE_THROWS_WITH(z.step(), Catch::Contains("step 2 would update the weights from zeros"));
    REQUIRE(z.steps() == 1);
  };
  {
    ZeroOptimizer<policies::fp32, optim::adamw, stage<0>, comm::mpi_communicator> z(c, numels, {}, zo);
    run(z, 0);
    // Stages 0 and 1 also take gradients in place: not once they are reduced.
    z.grad(0)[0] = 1.0f;
    z.grad(2)[0] = 1.0f;
    (void)z.full_grad(0);
    REQUIRE_THROWS_WITH(z.grad(2), Catch::Contains("grad(2): this step's gradients were already reduced"));
    REQUIRE(z.step().step == 2);
  }
  {
    ZeroOptimizer<policies::bf16_all_sr, optim::adamw, stage<1>, comm::mpi_communicator> z(c, numels, {}, zo);
    run(z, 1);
  }
  {
    ZeroOptimizer<policies::bf16_fp32_master, optim::adamw, stage<2>, comm::mpi_communicator> z(c, numels, {}, zo);
    run(z, 2);
  }
  {
    zero_options z3 = zo;
    z3.param_persistence_threshold = 10;
    ZeroOptimizer<policies::fp32, optim::adamw, stage<3>, comm::mpi_communicator> z(c, numels, {}, z3);
    run(z, 3);
  }
  {
    ZeroOptimizer<policies::fp32, optim::adamw, stage<2>, comm::mpi_communicator, host_backend, offload_cpu> z(c, numels,
                                                                                                               {}, zo);
    run(z, 2);
  }
}

TEST_CASE("ZeRO: gradients may travel in another dtype (bf16 on the wire for fp32 gradients)", "[zero]") {
  // The gradient sums stay small multiples of 2^-6, exact in bf16: same bits as the reference.
  scenario sc = uneven();
  sc.passes = 2;
  all_stages<policies::fp32, optim::adamw, bf16>(sc, adamw_opts());
}

TEST_CASE("ZeRO: full_grad reads the averaged reduced gradient; accumulate_grad scales its input", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{300, 5, 4000};
  for (int st : {0, 1, 2, 3}) {
    auto run = [&](auto& z) {
      // Rank r reports (r + 1) * 2^-3 scaled by 1/2 (one micro-step of two), twice; in
      // the steps after the first, the step's gradient starts from zero again (stages 0-1
      // clear the buffer lazily: a scaled first report, then the unscaled one of the
      // last step, each on a slot that held the step before's values).
      std::vector<float> g(4000, static_cast<float>(c.rank() + 1) * 0x1p-3f);
      for (int step = 0; step < 3; ++step) {
        INFO("stage " << st << ", step " << step + 1);
        const float scale = step < 2 ? 0.5f : 1.0f;
        for (int pass = 0; pass < 2; ++pass) {
          for (std::size_t p = numels.size(); p-- > 0;) z.accumulate_grad(p, g.data(), scale);
          z.end_backward();
        }
        const float expect = static_cast<float>((c.size() + 1) / 2.0 * 0x1p-3 * (2 * scale));  // mean over ranks
        for (std::size_t p = 0; p < numels.size(); ++p) {
          const std::vector<float> full = z.full_grad(p);
          REQUIRE(full.size() == numels[p]);
          REQUIRE(std::count(full.begin(), full.end(), expect) == static_cast<std::ptrdiff_t>(full.size()));
        }
        REQUIRE_THROWS_WITH(z.accumulate_grad(0, g.data()), Catch::Contains("already reduced"));
        const step_report r = z.step();
        REQUIRE(r.grad_norm == Approx(expect * std::sqrt(4305.0)).epsilon(1e-12));
      }
    };
    zero_options zo;
    zo.reduce_bucket_numel = 1000;
    zo.param_persistence_threshold = 10;
    if (st == 0) { ZeroOptimizer<policies::fp32, optim::adam, stage<0>, comm::mpi_communicator> z(c, numels, {}, zo); run(z); }
    if (st == 1) { ZeroOptimizer<policies::fp32, optim::adam, stage<1>, comm::mpi_communicator> z(c, numels, {}, zo); run(z); }
    if (st == 2) { ZeroOptimizer<policies::fp32, optim::adam, stage<2>, comm::mpi_communicator> z(c, numels, {}, zo); run(z); }
    if (st == 3) { ZeroOptimizer<policies::fp32, optim::adam, stage<3>, comm::mpi_communicator> z(c, numels, {}, zo); run(z); }
  }
}

TEST_CASE("ZeRO: small parameters, placed last, do not hold back the other buckets' reductions", "[zero]") {
  // Eight layers, each a weight of 1000 elements and a bias of 10 (at most the
  // persistence threshold, so placed after every weight in the flat buffer), reported in
  // backward order (last layer first), with buckets of one weight. The biases' bucket
  // fills only when the first layer's bias reports, at the end of backward: were it
  // reduced first (the order of the flat buffer, descending), every weight's staging
  // buffer would be held until then (9 staging buffers of 1000 elements, the whole
  // gradient). Reduced after the weights, at most 4 staging buffers (the biases', two in
  // flight, one filling) and 3 receive buffers exist at any time.
  auto& c = world();
  std::vector<std::uint64_t> numels;
  for (int layer = 0; layer < 8; ++layer) {
    numels.push_back(1000);
    numels.push_back(10);
  }
  zero_options zo;
  zo.reduce_bucket_numel = 1000;
  zo.param_persistence_threshold = 10;
  ZeroOptimizer<policies::bf16_all, optim::adamw, stage<2>, comm::mpi_communicator> z(c, numels, {}, zo);
  const std::vector<float> g(1000, static_cast<float>(c.rank() + 1) * 0x1p-6f);
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t p = numels.size(); p-- > 0;) z.accumulate_grad(p, g.data());
    z.end_backward();
    const std::uint64_t bucket_bytes = 1000 * sizeof(bf16);
    INFO("pass " << pass << ", world " << c.size() << ": " << z.memory().buckets << " bytes of buckets");
    REQUIRE(z.memory().buckets <= 7 * bucket_bytes);
  }
  // And the gradients are right: each element the sum over ranks of two passes, averaged.
  const float expect = static_cast<float>(c.size() + 1) * 0x1p-6f;
  for (std::size_t p = 0; p < numels.size(); ++p) {
    const std::vector<float> full = z.full_grad(p);
    REQUIRE(std::count(full.begin(), full.end(), expect) == static_cast<std::ptrdiff_t>(numels[p]));
  }
}

TEST_CASE("ZeRO: at world size 1, stages 2 and 3 accumulate straight into the gradient (no bucket buffers, stage 0's bits)", "[zero]") {
  // Gradients that are not exact in bf16, three backward passes with a shared weight
  // reported twice, scaled by 1/2: stage 0 rounds each report into the gradient once.
  // At world size 1 stages 2 and 3 must do the same, with no staging or receive buffer
  // (reducing through a zeroed staging bucket rounds twice and holds the buckets). Above
  // world size 1 the buckets are there.
  auto& c = world();
  const std::vector<std::uint64_t> numels{1000, 37, 5000, 3};
  zero_options zo;
  zo.reduce_bucket_numel = 1024;
  zo.param_persistence_threshold = 40;
  using Z0 = ZeroOptimizer<policies::bf16_all, optim::adamw, stage<0>, comm::mpi_communicator>;
  using Z2 = ZeroOptimizer<policies::bf16_all, optim::adamw, stage<2>, comm::mpi_communicator>;
  using Z3 = ZeroOptimizer<policies::bf16_all, optim::adamw, stage<3>, comm::mpi_communicator>;
  Z0 z0(c, numels, {}, zo);
  Z2 z2(c, numels, {}, zo);
  Z3 z3(c, numels, {}, zo);
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<float>> grads(numels.size());
  auto backward = [&](auto& z) {
    for (std::size_t p = numels.size(); p-- > 0;) {
      z.accumulate_grad(p, grads[p].data(), 0.5f);
      if (p == 0) z.accumulate_grad(p, grads[p].data(), 0.5f);
    }
    z.end_backward();
  };
  for (int pass = 0; pass < 3; ++pass) {
    for (std::size_t p = 0; p < numels.size(); ++p) {
      grads[p].resize(numels[p]);
      for (float& v : grads[p]) v = u(gen);
    }
    backward(z0);
    backward(z2);
    backward(z3);
  }
  INFO("world " << c.size() << ": stage 2 holds " << z2.memory().buckets << " bytes of buckets, stage 3 "
                << z3.memory().buckets);
  if (c.size() == 1) {
    CHECK(z2.memory().buckets == 0);
    CHECK(z3.memory().buckets == 0);
    for (std::size_t p = 0; p < numels.size(); ++p) {
      const std::vector<float> g0 = z0.full_grad(p), g2 = z2.full_grad(p), g3 = z3.full_grad(p);
      INFO("parameter " << p);
      REQUIRE(std::memcmp(g0.data(), g2.data(), g0.size() * sizeof(float)) == 0);
      REQUIRE(std::memcmp(g0.data(), g3.data(), g0.size() * sizeof(float)) == 0);
    }
    z0.step();
    z2.step();
    z3.step();
    z3.gather(0, numels.size());
    for (std::size_t p = 0; p < numels.size(); ++p) {
      const auto a = z0.param(p), b = z2.param(p), d = z3.param(p);
      REQUIRE(std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
      REQUIRE(std::memcmp(a.data(), d.data(), a.size_bytes()) == 0);
    }
    z3.release(0, numels.size());
    CHECK(z2.memory().buckets == 0);
  } else {
    CHECK(z2.memory().buckets > 0);
    CHECK(z3.memory().buckets > 0);
  }
}

TEST_CASE("ZeRO: at world size 1, offload adds gradients in place and another wire dtype reduces them", "[zero]") {
  // Offload's partition is in host memory: on the host backend the reports reach it, so at
  // one rank they add straight into it with no staging buffer at all. Above one rank each
  // bucket is staged (at most reduce_bucket_numel elements: the 3000-element parameter is
  // reduced in pieces). A bf16 wire rounds each bucket once: it still reduces through its
  // buffers, so its bits match every world size.
  auto& c = world();
  const std::vector<std::uint64_t> numels{1000, 3000};
  zero_options zo;
  zo.reduce_bucket_numel = 1024;
  zo.param_persistence_threshold = 0;
  ZeroOptimizer<policies::bf16_all, optim::adamw, stage<2>, comm::mpi_communicator, host_backend, offload_cpu> off(c, numels, {}, zo);
  ZeroOptimizer<policies::fp32, optim::adamw, stage<2>, comm::mpi_communicator, host_backend, offload_none, bf16> wire(c, numels, {}, zo);
  const std::vector<float> g(3000, 0x1p-4f);
  for (std::size_t p = numels.size(); p-- > 0;) {
    off.accumulate_grad(p, g.data());
    wire.accumulate_grad(p, g.data());
  }
  off.end_backward();
  wire.end_backward();
  const std::uint64_t largest = zo.reduce_bucket_numel;  // no bucket is larger
  if (c.size() == 1) {
    CHECK(off.memory().buckets == 0);
  } else {
    CHECK(off.memory().buckets >= largest * sizeof(bf16));  // staging buffers, reduced in place
  }
  CHECK(off.memory().peak_buckets <= off.memory().bucket_bound);
  CHECK(wire.memory().peak_buckets <= wire.memory().bucket_bound);
  CHECK(wire.memory().buckets > 0);
  for (std::size_t p = 0; p < numels.size(); ++p) {
    const std::vector<float> a = off.full_grad(p), b = wire.full_grad(p);
    REQUIRE(std::count(a.begin(), a.end(), 0x1p-4f) == static_cast<std::ptrdiff_t>(numels[p]));
    REQUIRE(std::count(b.begin(), b.end(), 0x1p-4f) == static_cast<std::ptrdiff_t>(numels[p]));
  }
}

namespace {

template <class Policy, class Opt>
void offload_stages(const scenario& sc, const typename Opt::options& opt) {
  using G = typename Policy::grad_type;
  SECTION("stage 1, offload") { check_against_reference<Policy, Opt, 1, G, offload_cpu>(sc, opt); }
  SECTION("stage 2, offload") { check_against_reference<Policy, Opt, 2, G, offload_cpu>(sc, opt); }
  SECTION("stage 3, offload") { check_against_reference<Policy, Opt, 3, G, offload_cpu>(sc, opt); }
}

template <class Policy, int Stage>
void check_offload_memory(int passes) {
  auto& c = world();
  const std::vector<std::uint64_t> numels{0, 5, 1000, 3, 70001, 17, 1, 0, 25000};
  zero_options zo;
  zo.param_persistence_threshold = 0;
  zo.reduce_bucket_numel = 4096;
  ZeroOptimizer<Policy, optim::adamw, stage<Stage>, comm::mpi_communicator, host_backend, offload_cpu> z(c, numels, {}, zo);
  const std::uint64_t padded = z.layout().padded_numel();
  const memory_footprint model = bytes_per_param<Policy, optim::adamw, stage<Stage>, offload_cpu>(c.size());
  auto check = [&] {
    const memory_report m = z.memory();
    INFO("stage " << Stage << ", world " << c.size() << ", " << passes << " backward passes per step");
    REQUIRE(std::fabs(static_cast<double>(m.model_state_bytes()) - model.device_bytes * static_cast<double>(padded)) < 0.5);
    REQUIRE(std::fabs(static_cast<double>(m.host_model_state_bytes()) - model.host_bytes * static_cast<double>(padded)) < 0.5);
  };
  check();
  std::vector<float> g(70001, 0x1p-6f);
  for (int pass = 0; pass < passes; ++pass) {
    for (std::size_t p = numels.size(); p-- > 0;) z.accumulate_grad(p, g.data());
    z.end_backward();
  }
  // Several backward passes accumulate in the host partition itself: no extra buffer.
  check();
  const std::vector<float> full = z.full_grad(4);
  REQUIRE(full[123] == static_cast<float>(passes) * 0x1p-6f);  // summed, not overwritten (DeepSpeed #7981)
  z.step();
  check();
}

}  // namespace

TEST_CASE("ZeRO-Offload: parameters and states equal the reference (offload off) bit for bit", "[offload]") {
  offload_stages<policies::bf16_all_sr, optim::adamw>(uneven(), adamw_opts());
}

TEST_CASE("ZeRO-Offload: bf16 or fp16 master with fp32 states, fp32 master with bf16 params", "[offload]") {
  offload_stages<policies::bf16_master_fp32_states, optim::adamw>(uneven(), adamw_opts());
  offload_stages<policies::bf16_fp32_master, optim::adam>(uneven(), optim::adam::options{});
}

TEST_CASE("ZeRO-Offload: parameter groups, in sub-groups that split them", "[offload]") {
  scenario sc = grouped();
  sc.zo.offload_sub_group_numel = 7000;
  offload_stages<policies::bf16_all_sr, optim::adamw>(sc, adamw_opts());
}

TEST_CASE("ZeRO-Offload: several backward passes per step are summed (DeepSpeed #7981)", "[offload]") {
  scenario sc = uneven();
  sc.passes = 4;
  sc.report_twice = true;
  offload_stages<policies::bf16_all_sr, optim::adamw>(sc, adamw_opts());
}

TEST_CASE("ZeRO-Offload: host and device bytes equal the memory model, with 1 and 4 backward passes", "[offload]") {
  for (int passes : {1, 4}) {
    check_offload_memory<policies::bf16_all_sr, 1>(passes);
    check_offload_memory<policies::bf16_all_sr, 2>(passes);
    check_offload_memory<policies::bf16_fp32_master, 2>(passes);
    check_offload_memory<policies::bf16_master_fp32_states, 3>(passes);
  }
}

TEST_CASE("ZeRO-Offload: overlapped transfers (late copies, sub-groups) give the same bits", "[offload]") {
  // deferred_backend finishes a copy only when it is waited on or polled three times:
  // a receive buffer reused, or a download read, before its copy is done would change
  // the numbers. Small sub-groups make the host step and the uploads interleave.
  scenario sc = uneven();
  sc.passes = 2;
  sc.report_twice = true;
  sc.zo.offload_sub_group_numel = 7000;  // 3 to 14 sub-groups per shard at these world sizes
  const std::uint64_t before = testing::deferred_backend::total_queued();
  using B = testing::deferred_backend;
  using G = bf16;
  SECTION("stage 1") { check_against_reference<policies::bf16_all_sr, optim::adamw, 1, G, offload_cpu, B>(sc, adamw_opts()); }
  SECTION("stage 2") { check_against_reference<policies::bf16_all_sr, optim::adamw, 2, G, offload_cpu, B>(sc, adamw_opts()); }
  SECTION("stage 3") {
    check_against_reference<policies::bf16_master_fp32_states, optim::adamw, 3, G, offload_cpu, B>(sc, adamw_opts());
  }
  REQUIRE(testing::deferred_backend::total_queued() > before);  // the overlapped path ran
}

TEST_CASE("ZeRO-Offload: a zero sub-group size is refused with a message", "[offload]") {
  zero_options zo;
  zo.offload_sub_group_numel = 0;
  const std::vector<std::uint64_t> numels{10};
  using Z = ZeroOptimizer<policies::fp32, optim::adamw, stage<1>, comm::mpi_communicator, host_backend, offload_cpu>;
  REQUIRE_THROWS_WITH(Z(world(), numels, {}, zo), Catch::Contains("offload_sub_group_numel = 0"));
}

TEST_CASE("ZeRO-Offload: the offloaded step uses the host backend's thread count", "[offload]") {
  const std::vector<std::uint64_t> numels{10, 3};
  host_backend one_thread;
  one_thread.options.threads = 1;
  using Off = ZeroOptimizer<policies::fp32, optim::adamw, stage<2>, comm::mpi_communicator, host_backend, offload_cpu>;
  using On = ZeroOptimizer<policies::fp32, optim::adamw, stage<2>, comm::mpi_communicator, host_backend>;
  CHECK(Off(world(), numels, {}, {}, one_thread).host_options().threads == 1);
  CHECK(On(world(), numels, {}, {}, one_thread).host_options().threads == 1);
  CHECK(Off(world(), numels, {}, {}).host_options().threads == 0);
}

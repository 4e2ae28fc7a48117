// The LibTorch engine under mpirun (1 and 2 ranks): the dtype each gradient is reduced
// in (torch_autocast's lower_precision_safe_modules, communication_data_type), the
// WarmupDecayLR / WarmupCosineLR / OneCycle schedules end to end, and the world
// initialize joins from the launcher's environment.
//
// Reduction references are plain LibTorch: every rank computes every rank's gradient on
// a copy of the model (same values, same autocast), then reduces them as the engine's
// communicator must: each rank's accumulated gradient converted to the wire dtype, summed
// with an fp32 add rounded once to the wire dtype (comm/mpi.hpp; at two ranks that is
// the only combine, so the order cannot matter), converted back and averaged. They are
// compared bit for bit. Stage 2 reduces each backward's gradient as it comes; stages 0
// and 1 accumulate the micro-batches and reduce once (their roundings differ).
//
// Schedule references: the learning rates (and OneCycle's betas) from DeepSpeed's
// formulas (docs/config.md), written out here, and torch::optim::Adam / AdamW given them
// at each step.
//
// Launch: initialize without a communicator joins the world mpirun launched, trained as
// with MPI_COMM_WORLD passed, and refuses one it cannot join (variables set here).
#include "support/torch_mpi.hpp"  // LibTorch, then Catch and MPI
#include "support/torch_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <utility>
#include <vector>

using namespace mpzero::testing;  // mt, Tensor, json, world(), W(), R(), the reference helpers

namespace {

// Linear -> LayerNorm -> Linear: parameters of a lower-precision-safe module class and
// of one that is not.
struct MixedImpl : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  explicit MixedImpl(std::uint64_t seed) {
    torch::manual_seed(seed);
    l1 = register_module("l1", torch::nn::Linear(4, 6));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    l2 = register_module("l2", torch::nn::Linear(6, 3));
    // LayerNorm starts at weight 1, bias 0; move them off so their gradients are generic.
    torch::NoGradGuard ng;
    norm->weight.uniform_(0.5, 1.5);
    norm->bias.uniform_(-0.5, 0.5);
  }
  Tensor forward(const Tensor& x) { return l2(norm(l1(x))); }
};
TORCH_MODULE(Mixed);

struct NetImpl : two_linear {
  explicit NetImpl(std::uint64_t seed) : two_linear(seed) {}
  Tensor forward(const Tensor& x) { return l2(torch::tanh(l1(x))); }
};
TORCH_MODULE(Net);

batch data(int k, int r, int salt, std::int64_t out_features) {
  return random_batch(static_cast<std::uint64_t>(7919 * salt + 1009 * k + r + 1), out_features);
}

// CPU autocast to bf16 for a scope, as torch.autocast("cpu", torch.bfloat16) would.
class autocast_scope {
 public:
  explicit autocast_scope(bool on) : on_(on) {
    if (!on_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(at::kCPU);
    prev_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~autocast_scope() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, prev_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, prev_dtype_);
  }
  autocast_scope(const autocast_scope&) = delete;
  autocast_scope& operator=(const autocast_scope&) = delete;

 private:
  bool on_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

// Rank r's gradients (fp32, by parameter name) of one micro-batch on the reference model.
template <class M>
std::map<std::string, Tensor> rank_grads(M& m, const batch& b, bool autocast) {
  for (auto& p : m->parameters()) p.mutable_grad().reset();
  Tensor out;
  {
    autocast_scope ac(autocast);
    out = m->forward(b.x);
  }
  torch::mse_loss(out.to(torch::kFloat), b.y).backward();
  std::map<std::string, Tensor> g;
  for (const auto& p : m->named_parameters()) g[p.key()] = p.value().grad().detach().clone();
  return g;
}

// grads[pass][rank]: the reduced, averaged gradient of `name` the engine must hold, with
// gradients scaled by 1/GAS at the parameter (GAS = number of passes).
Tensor reduce_reference(const std::vector<std::vector<std::map<std::string, Tensor>>>& grads, const std::string& name,
                        at::ScalarType wire, int stage) {
  const float scale = 1.0f / static_cast<float>(grads.size());
  // The ranks' values summed as the communicator sums the wire dtype (one combine at two ranks).
  auto reduce = [&](const std::vector<Tensor>& per_rank) {
    Tensor acc = per_rank[0].to(wire);
    for (std::size_t r = 1; r < per_rank.size(); ++r) acc = (acc.to(torch::kFloat) + per_rank[r].to(wire).to(torch::kFloat)).to(wire);
    return acc.to(torch::kFloat);
  };
  const std::size_t ranks = grads[0].size();
  Tensor total;
  if (stage < 2) {
    // Each rank accumulates its micro-batches in fp32, then one reduction.
    std::vector<Tensor> acc(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
      acc[r] = torch::zeros_like(grads[0][r].at(name));
      for (const auto& pass : grads) acc[r] = acc[r] + pass[r].at(name) * scale;
    }
    total = reduce(acc);
  } else {
    // A reduction per backward, accumulated in fp32.
    total = torch::zeros_like(grads[0][0].at(name));
    for (const auto& pass : grads) {
      std::vector<Tensor> staged(ranks);
      for (std::size_t r = 0; r < ranks; ++r) staged[r] = pass[r].at(name) * scale;
      total = total + reduce(staged);
    }
  }
  return total * (1.0f / static_cast<float>(ranks));  // exact at one and two ranks
}

json base_config(int stage, json extra = json::object()) {
  // Small buckets: one holds l1.bias (bf16 under autocast) and norm's (fp32).
  json j = engine_config(stage, 2, 1e-2, {{"zero_optimization", {{"reduce_bucket_size", 20}}}});
  j.merge_patch(extra);
  return j;
}

mpzero::dtype dtype_of(at::ScalarType t) {
  return t == torch::kBFloat16 ? mpzero::dtype::bf16 : t == torch::kHalf ? mpzero::dtype::fp16 : mpzero::dtype::fp32;
}

// Two optimizer steps of two micro-batches each: the engine's reduced gradients equal the
// reference bit for bit, with `wire` giving each parameter's reduction dtype. When
// `expect_rounding`, some parameter's reference differs from an fp32 reduction (so the
// test sees the wire dtype at all).
void check_reduction(const json& cfg, int stage, bool autocast, const std::map<std::string, at::ScalarType>& wire,
                     bool expect_rounding, int salt) {
  auto engine = mt::initialize(Mixed(11), cfg, world());
  Mixed ref(11);  // the engine's initial values (every rank builds them from the same seed)
  const auto& names = engine.parameter_names();
  REQUIRE(names.size() == wire.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    INFO(names[i]);
    CHECK(engine.comm_dtype(engine.parameters()[i]) == dtype_of(wire.at(names[i])));
  }
  for (int it = 0; it < 2; ++it) {
    std::vector<std::vector<std::map<std::string, Tensor>>> grads(2);
    for (int pass = 0; pass < 2; ++pass) {
      const int k = 2 * it + pass;
      const batch b = data(k, R(), salt, 3);
      torch::mse_loss(engine(b.x).to(torch::kFloat), b.y).backward();
      for (int r = 0; r < W(); ++r) grads[pass].push_back(rank_grads(ref, data(k, r, salt, 3), autocast));
      if (pass == 0) engine.step();  // not the boundary: counts the micro-batch
    }
    REQUIRE(engine.is_gradient_accumulation_boundary());
    const auto got = engine.full_grads();
    bool rounded = false;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const at::ScalarType w = wire.at(names[i]);
      const Tensor want = reduce_reference(grads, names[i], w, stage);
      INFO("iteration " << it << ", " << names[i] << " reduced in " << c10::toString(w) << ", rank " << R() << " of "
                        << W() << "\n got  " << got[i].flatten() << "\n want " << want.flatten());
      CHECK(torch::equal(got[i], want));
      if (w != torch::kFloat) rounded = rounded || !torch::equal(want, reduce_reference(grads, names[i], torch::kFloat, stage));
    }
    if (expect_rounding) CHECK(rounded);
    engine.step();
    // The reference model follows the engine's weights (the update is not under test here).
    torch::NoGradGuard ng;
    auto ref_params = ref->named_parameters();
    for (std::size_t i = 0; i < names.size(); ++i) ref_params[names[i]].copy_(engine.parameters()[i]);
  }
}

std::map<std::string, at::ScalarType> wires(at::ScalarType linear, at::ScalarType norm) {
  return {{"l1.weight", linear}, {"l1.bias", linear}, {"norm.weight", norm},
          {"norm.bias", norm},   {"l2.weight", linear}, {"l2.bias", linear}};
}

}  // namespace

TEST_CASE("torch: torch_autocast reduces Linear gradients in bf16 and LayerNorm's in fp32", "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  INFO("stage " << stage << ", world " << W());
  const json cfg = base_config(stage, {{"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}});
  // At one rank stage 2 sends each backward's gradient alone, which autocast already made
  // bf16: converting it changes nothing. Elsewhere sums are rounded.
  check_reduction(cfg, stage, true, wires(torch::kBFloat16, torch::kFloat), W() == 2 || stage < 2, 21);
}

TEST_CASE("torch: communication_data_type bf16 reduces every gradient in bf16", "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  INFO("stage " << stage << ", world " << W());
  const json cfg = base_config(stage, {{"communication_data_type", "bf16"}});
  check_reduction(cfg, stage, false, wires(torch::kBFloat16, torch::kBFloat16), true, 22);
}

TEST_CASE("torch: torch_autocast with its own lower_precision_safe_modules and communication_data_type", "[torch]") {
  const int stage = GENERATE(0, 2);
  INFO("stage " << stage << ", world " << W());
  // Only LayerNorm is "safe": its parameters go in bf16; the others in communication_data_type.
  const json cfg = base_config(stage, {{"torch_autocast", {{"enabled", true}, {"lower_precision_safe_modules", {"LayerNorm"}}}},
                                       {"communication_data_type", "fp16"}});
  check_reduction(cfg, stage, true, wires(torch::kHalf, torch::kBFloat16), W() == 2 || stage < 2, 23);
}

TEST_CASE("torch: lower_precision_safe_modules matches module classes as DeepSpeed does", "[torch]") {
  auto bf16_params = [](const json& modules) {
    json cfg = base_config(1, {{"torch_autocast", {{"enabled", true}}}});
    if (!modules.is_null()) cfg["torch_autocast"]["lower_precision_safe_modules"] = modules;
    auto engine = mt::initialize(Mixed(3), cfg, world());
    std::vector<std::string> out;
    for (std::size_t i = 0; i < engine.parameters().size(); ++i)
      if (engine.comm_dtype(engine.parameters()[i]) == mpzero::dtype::bf16) out.push_back(engine.parameter_names()[i]);
    return out;
  };
  const std::vector<std::string> linears{"l1.weight", "l1.bias", "l2.weight", "l2.bias"};
  CHECK(bf16_params(nullptr) == linears);                                      // the default list
  CHECK(bf16_params({"torch.nn.Linear"}) == linears);                          // DeepSpeed's spelling
  CHECK(bf16_params({"torch::nn::LinearImpl"}) == linears);                    // LibTorch's class
  CHECK(bf16_params({"LayerNorm"}) == std::vector<std::string>{"norm.weight", "norm.bias"});
  CHECK(bf16_params({"torch.nn.modules.linear.Linear"}) == linears);          // DeepSpeed's full name
  // A class the model lacks is a typo or another model's: refused, naming the model's classes.
  CHECK_THROWS_WITH(bf16_params({"Linear", "Conv2d"}),
                    Catch::Contains("entry \"Conv2d\" matches no module of the model") &&
                        Catch::Contains("torch::nn::LinearImpl") && Catch::Contains("or remove the entry"));
  // The model's own class holds no parameters itself (DeepSpeed takes parameters(recurse=False)).
  CHECK(bf16_params({"Mixed"}).empty());
  // Without autocast the list does nothing: everything travels in the gradient dtype.
  auto plain = mt::initialize(Mixed(3), base_config(1), world());
  for (const auto& p : plain.parameters()) CHECK(plain.comm_dtype(p) == mpzero::dtype::fp32);
  CHECK_THROWS_WITH(plain.comm_dtype(torch::zeros({2})), Catch::Contains("comm_dtype") &&
                                                             Catch::Contains("not a parameter this engine manages"));
}

TEST_CASE("torch: an invalid communication_data_type is refused by name", "[torch]") {
  CHECK_THROWS_AS(mt::initialize(Mixed(1), base_config(1, {{"communication_data_type", "int8"}}), world()), mt::config_error);
  CHECK_THROWS_WITH(mt::initialize(Mixed(1), base_config(1, {{"communication_data_type", "int8"}}), world()),
                    Catch::Contains("'communication_data_type' = \"int8\" is invalid") &&
                        Catch::Contains("\"fp32\", \"bf16\", \"fp16\""));
  CHECK_THROWS_WITH(mt::initialize(Mixed(1), base_config(1, {{"communication_data_type", 16}}), world()),
                    Catch::Contains("communication_data_type") && Catch::Contains("a string"));
  // A bf16 model reduced in fp16 would mix the two 16-bit formats.
  CHECK_THROWS_WITH(
      mt::initialize(Mixed(1), base_config(1, {{"bf16", {{"enabled", true}}}, {"communication_data_type", "fp16"}}), world()),
      Catch::Contains("mixes bf16 and fp16"));
}

// =================================================================================
// WarmupDecayLR and WarmupCosineLR end to end.
// =================================================================================
namespace {

// DeepSpeed's learning rate after `k` scheduler steps (the lr of update k + 1), from the
// formulas of docs/config.md, for the two configurations below (W = 3, T = 6).
double decay_lr(int k) {
  const double lo = 1e-4, hi = 2e-3, w = 3, t = 6;
  if (k == 0) return lo;
  const double i = k - 1;
  const double gamma = i < w ? std::log(i + 1) / std::log(w) : std::max(0.0, (t - i) / std::max(1.0, t - w));
  return lo + (hi - lo) * gamma;
}
double cosine_lr(int k) {
  const double base = 2e-3, w = 3, t = 6, min_ratio = 0.1, cos_min = 0.05;
  if (k == 0) return 0.0;
  const double i = k - 1;
  if (i < w) return base * (min_ratio + (1 - min_ratio) * (i / w));
  const double p = std::min(1.0, (i - w + 1) / std::max(1.0, t - w));
  return base * std::max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + std::cos(std::numbers::pi * p)));
}

}  // namespace

TEST_CASE("torch: WarmupDecayLR and WarmupCosineLR through the engine match torch Adam/AdamW at the schedule's lr",
          "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  const bool cosine = GENERATE(false, true);
  INFO("stage " << stage << ", world " << W() << (cosine ? ", WarmupCosineLR with AdamW" : ", WarmupDecayLR with Adam"));
  json cfg = engine_config(stage, 1, 1e-3);  // the optimizer is set below
  std::unique_ptr<torch::optim::Optimizer> opt;
  Net ref(5);
  const std::vector<Tensor> master = fp32_masters(ref->parameters());
  if (cosine) {
    cfg["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.01}}}};
    cfg["scheduler"] = {{"type", "WarmupCosineLR"},
                        {"params",
                         {{"total_num_steps", 6}, {"warmup_num_steps", 3}, {"warmup_min_ratio", 0.1},
                          {"cos_min_ratio", 0.05}, {"warmup_type", "linear"}}}};
    opt = std::make_unique<torch::optim::AdamW>(master, torch::optim::AdamWOptions(2e-3).weight_decay(0.01));
  } else {
    // "Adam" is AdamW in DeepSpeed (adam_w_mode); with weight_decay 0 that is Adam.
    cfg["optimizer"] = {{"type", "Adam"}, {"params", {{"lr", 1e-3}}}};
    cfg["scheduler"] = {{"type", "WarmupDecayLR"},
                        {"params",
                         {{"total_num_steps", 6}, {"warmup_num_steps", 3}, {"warmup_min_lr", 1e-4},
                          {"warmup_max_lr", 2e-3}, {"warmup_type", "log"}}}};
    opt = std::make_unique<torch::optim::Adam>(master, torch::optim::AdamOptions(1e-3).weight_decay(0.0));
  }
  auto lr_of = [&](int k) { return cosine ? cosine_lr(k) : decay_lr(k); };
  auto engine = mt::initialize(Net(5), cfg, world());
  const auto names = engine.parameter_names();
  // 8 updates: warmup, decay, and two past total_num_steps (the rate stays at its floor).
  for (int k = 0; k < 8; ++k) {
    INFO("update " << k + 1);
    CHECK(engine.get_lr() == Approx(lr_of(k)).epsilon(1e-12).margin(1e-18));
    const batch b = data(k, R(), 31, 4);
    torch::mse_loss(engine(b.x), b.y).backward();
    // The reference: the gradient averaged over ranks, the optimizer at this update's lr.
    std::vector<Tensor> avg;
    for (int r = 0; r < W(); ++r) {
      const auto g = rank_grads(ref, data(k, r, 31, 4), false);
      std::size_t i = 0;
      for (const auto& p : ref->named_parameters()) {
        if (r == 0) avg.push_back(g.at(p.key()) / static_cast<float>(W()));
        else avg[i] = avg[i] + g.at(p.key()) / static_cast<float>(W());
        ++i;
      }
    }
    set_learning_rate(*opt, lr_of(k));
    master_step(*opt, master, avg, ref->parameters());
    engine.step();
    CHECK(engine.global_steps() == static_cast<std::uint64_t>(k + 1));
    CHECK(engine.get_lr() == Approx(lr_of(k + 1)).epsilon(1e-12).margin(1e-18));
    const auto got = engine.master_weights();
    std::size_t i = 0;
    for (const auto& p : ref->named_parameters()) {
      const auto at = static_cast<std::size_t>(std::find(names.begin(), names.end(), p.key()) - names.begin());
      REQUIRE(at < names.size());
      check_close(got[at], master[i].detach(), param_tol, param_atol, "master weight " + p.key());
      ++i;
    }
  }
}

namespace {

// DeepSpeed's OneCycle with cycle_first_step_size 2, cycle_second_step_size 2,
// cycle_min_lr 1e-3, cycle_max_lr 3e-3, decay_step_size 2, decay_lr_rate 0.5,
// cycle_min_mom 0.8, cycle_max_mom 0.9, decay_mom_rate 0.05, worked by hand: the
// (lr, beta1) update k (0-based) uses; beta2 is 0.99 throughout. The cycle position of
// k >= 1 is x = k/4 - floor(k/4) with peak at 1/2; past k = 4 the decay has run
// (k - 4) / 2 intervals.
struct lr_mom {
  double lr, beta1;
};
constexpr lr_mom one_cycle_rows[] = {
    {1e-3, 0.8},                        // k 0: min lr, min momentum
    {2e-3, 0.85},                       // k 1: x 1/4, halfway up
    {3e-3, 0.8},                        // k 2: x 1/2, the peak
    {2e-3, 0.85},                       // k 3: x 3/4, halfway down
    {1e-3, 0.9},                        // k 4: x 0, the end of the cycle
    {1e-3 / 1.25, 0.9 * 1.025},         // k 5: decay, 1/2 interval
    {1e-3 / 1.5, 0.9 * 1.05},           // k 6: 1 interval
};

}  // namespace

TEST_CASE("torch: OneCycle cycles the learning rate and Adam's beta1 as DeepSpeed does", "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  INFO("stage " << stage << ", world " << W());
  json cfg = engine_config(stage, 1, 1e-3);
  cfg["optimizer"] = {{"type", "Adam"}, {"params", {{"lr", 5e-2}, {"betas", {0.5, 0.5}}}}};  // both replaced
  cfg["scheduler"] = {{"type", "OneCycle"},
                      {"params",
                       {{"cycle_min_lr", 1e-3}, {"cycle_max_lr", 3e-3}, {"cycle_first_step_size", 2},
                        {"cycle_second_step_size", 2}, {"decay_step_size", 2}, {"decay_lr_rate", 0.5},
                        {"cycle_min_mom", 0.8}, {"cycle_max_mom", 0.9}, {"decay_mom_rate", 0.05}}}};
  Net ref(6);
  const std::vector<Tensor> master = fp32_masters(ref->parameters());
  torch::optim::Adam opt(master, torch::optim::AdamOptions(1e-3).weight_decay(0.0));
  auto engine = mt::initialize(Net(6), cfg, world());
  const auto names = engine.parameter_names();
  for (int k = 0; k < static_cast<int>(std::size(one_cycle_rows)); ++k) {
    INFO("update " << k + 1);
    const lr_mom want = one_cycle_rows[k];
    CHECK(engine.get_lr() == Approx(want.lr).epsilon(1e-12));
    const auto mom = engine.get_mom();
    REQUIRE(mom.has_value());
    CHECK(mom->first == Approx(want.beta1).epsilon(1e-12));
    CHECK(mom->second == 0.99);
    const batch b = data(k, R(), 37, 4);
    torch::mse_loss(engine(b.x), b.y).backward();
    std::vector<Tensor> avg;
    for (int r = 0; r < W(); ++r) {
      const auto g = rank_grads(ref, data(k, r, 37, 4), false);
      std::size_t i = 0;
      for (const auto& p : ref->named_parameters()) {
        if (r == 0) avg.push_back(g.at(p.key()) / static_cast<float>(W()));
        else avg[i] = avg[i] + g.at(p.key()) / static_cast<float>(W());
        ++i;
      }
    }
    for (auto& group : opt.param_groups()) {
      auto& o = static_cast<torch::optim::AdamOptions&>(group.options());
      o.lr(want.lr);
      o.betas({want.beta1, 0.99});
    }
    master_step(opt, master, avg, ref->parameters());
    engine.step();
    const auto got = engine.master_weights();
    std::size_t i = 0;
    for (const auto& p : ref->named_parameters()) {
      const auto at = static_cast<std::size_t>(std::find(names.begin(), names.end(), p.key()) - names.begin());
      REQUIRE(at < names.size());
      check_close(got[at], master[i].detach(), param_tol, param_atol, "master weight " + p.key());
      ++i;
    }
  }
}

TEST_CASE("torch: OneCycle's momentum cannot push beta1 to 1; SGD keeps its momentum", "[torch]") {
  json cfg = engine_config(1, 1, 1e-3);
  cfg["optimizer"] = {{"type", "Adam"}, {"params", {{"lr", 1e-3}}}};
  cfg["scheduler"] = {{"type", "OneCycle"},
                      {"params",
                       {{"cycle_min_lr", 1e-3}, {"cycle_max_lr", 2e-3}, {"cycle_first_step_size", 1},
                        {"decay_step_size", 1}, {"decay_mom_rate", 0.1}, {"cycle_max_mom", 0.95}}}};
  auto engine = mt::initialize(Net(7), cfg, world());
  // Updates 1-3 run the cycle and the first decay step (beta1 0.95 x 1.1 = 1.045 comes at
  // the fourth).
  for (int k = 0; k < 3; ++k) {
    const batch b = data(k, R(), 41, 4);
    torch::mse_loss(engine(b.x), b.y).backward();
    engine.step();
  }
  const batch b = data(3, R(), 41, 4);
  torch::mse_loss(engine(b.x), b.y).backward();
  CHECK_THROWS_WITH(engine.step(), Catch::Contains("OneCycle schedule gives beta1 = 1.04") &&
                                       Catch::Contains("decay_mom_rate"));

  json sgd = engine_config(1, 1, 1e-3);
  sgd["optimizer"] = {{"type", "SGD"}, {"params", {{"lr", 1e-3}, {"momentum", 0.5}}}};
  sgd["scheduler"] = cfg["scheduler"];
  const auto c = mt::parse_config(sgd, W());
  CHECK_FALSE(c.scheduler.cycle_momentum);
  REQUIRE(c.notices.size() == 1);
  CHECK_THAT(c.notices[0], Catch::Contains("SGD has no betas"));
  auto e2 = mt::initialize(Net(7), sgd, world());
  CHECK_FALSE(e2.get_mom().has_value());
}

namespace {

// Sets environment variables for a scope and restores what was there.
class scoped_env {
 public:
  explicit scoped_env(std::map<std::string, std::string> vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      if (v.empty()) {
        ::unsetenv(k.c_str());
      } else {
        ::setenv(k.c_str(), v.c_str(), 1);
      }
    }
  }
  ~scoped_env() {
    for (const auto& [k, v] : saved_) {
      if (v) {
        ::setenv(k.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(k.c_str());
      }
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// Two steps of a small stage-2 engine on `comm`; its master weights after them.
std::vector<Tensor> two_steps(mt::engine<Net>& e) {
  for (int k = 0; k < 2; ++k) {
    const batch b = data(k, e.rank(), 43, 4);
    torch::mse_loss(e(b.x), b.y).backward();
    e.step();
  }
  return e.master_weights();
}

void check_same(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i], b[i]));
}

}  // namespace

TEST_CASE("torch: initialize without a communicator joins the world mpirun launched", "[torch]") {
  const json cfg = engine_config(2, 1, 1e-2);
  auto joined = mt::initialize(Net(8), cfg);
  CHECK(joined.world_size() == W());
  CHECK(joined.rank() == R());
  auto given = mt::initialize(Net(8), cfg, world());
  check_same(two_steps(joined), two_steps(given));
  // any_communicator::local() is one process whatever the launcher says.
  auto alone = mt::initialize(Net(8), cfg, mt::any_communicator::local());
  CHECK(alone.world_size() == 1);
  const auto e = mt::read_launch_environment();
  CHECK(e.launcher == "openmpi");
  CHECK(e.world_size == W());
  CHECK(e.rank == R());
}

TEST_CASE("torch: a launched world initialize cannot join is refused, naming what to set", "[torch]") {
  const json cfg = engine_config(1, 1, 1e-2);
  {
    scoped_env env({{"WORLD_SIZE", "2"}, {"RANK", ""}});
    CHECK_THROWS_WITH(mt::initialize(Net(3), cfg), Catch::Contains("WORLD_SIZE=2 is set but RANK is not"));
  }
  {
    scoped_env env({{"WORLD_SIZE", "2"}, {"RANK", "2"}});
    CHECK_THROWS_WITH(mt::initialize(Net(3), cfg), Catch::Contains("RANK='2' is not an integer in [0, 1]"));
  }
  {
    scoped_env env({{"WORLD_SIZE", "two"}, {"RANK", "0"}});
    CHECK_THROWS_WITH(mt::initialize(Net(3), cfg), Catch::Contains("WORLD_SIZE='two'"));
  }
  {
    // torchrun's variables come first, as DeepSpeed reads them; on CPU parameters that
    // world needs a communicator given in code.
    scoped_env env({{"WORLD_SIZE", "2"}, {"RANK", "0"}});
    const auto e = mt::read_launch_environment();
    CHECK(e.launcher == "torchrun");
    CHECK(e.world_size == 2);
    CHECK_THROWS_WITH(mt::initialize(Net(3), cfg), Catch::Contains("2 processes launched by torchrun (this is rank 0)") &&
                                                       Catch::Contains("launch with mpirun -np 2") &&
                                                       Catch::Contains("any_communicator::local()"));
    // A communicator given in code is used as it is.
    CHECK(mt::initialize(Net(3), cfg, world()).world_size() == W());
  }
  {
    scoped_env env({{"WORLD_SIZE", "1"}, {"RANK", "0"}});
    CHECK(mt::initialize(Net(3), cfg).world_size() == 1);  // a world of one: no store needed
  }
}

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
#include "support/shared_dir.hpp"
#include "support/torch_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
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

// CPU autocast to `dtype` for a scope, as torch.autocast("cpu", dtype) would.
class autocast_scope {
 public:
  explicit autocast_scope(bool on, at::ScalarType dtype = at::kBFloat16) : on_(on) {
    if (!on_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(at::kCPU);
    prev_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
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

namespace {

// The reference gradient of update k: each rank's micro-batch gradient on `ref`, averaged
// over the ranks in fp32.
std::vector<Tensor> averaged_grads(Net& ref, int k, int salt) {
  std::vector<Tensor> avg;
  for (int r = 0; r < W(); ++r) {
    const auto g = rank_grads(ref, data(k, r, salt, 4), false);
    std::size_t i = 0;
    for (const auto& p : ref->named_parameters()) {
      if (r == 0) avg.push_back(g.at(p.key()) / static_cast<float>(W()));
      else avg[i] = avg[i] + g.at(p.key()) / static_cast<float>(W());
      ++i;
    }
  }
  return avg;
}

// The engine's master weights against the reference's, by parameter name.
void check_masters(mt::engine_base& engine, Net& ref, const std::vector<Tensor>& master) {
  const auto names = engine.parameter_names();
  const auto got = engine.master_weights();
  std::size_t i = 0;
  for (const auto& p : ref->named_parameters()) {
    const auto at = static_cast<std::size_t>(std::find(names.begin(), names.end(), p.key()) - names.begin());
    REQUIRE(at < names.size());
    check_close(got[at], master[i].detach(), param_tol, param_atol, "master weight " + p.key());
    ++i;
  }
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
  // 8 updates: warmup, decay, and two past total_num_steps (the rate stays at its floor).
  for (int k = 0; k < 8; ++k) {
    INFO("update " << k + 1);
    CHECK(engine.get_lr() == Approx(lr_of(k)).epsilon(1e-12).margin(1e-18));
    const batch b = data(k, R(), 31, 4);
    torch::mse_loss(engine(b.x), b.y).backward();
    // The reference: the gradient averaged over ranks, the optimizer at this update's lr.
    set_learning_rate(*opt, lr_of(k));
    master_step(*opt, master, averaged_grads(ref, k, 31), ref->parameters());
    engine.step();
    CHECK(engine.global_steps() == static_cast<std::uint64_t>(k + 1));
    CHECK(engine.get_lr() == Approx(lr_of(k + 1)).epsilon(1e-12).margin(1e-18));
    check_masters(engine, ref, master);
  }
}

// =================================================================================
// Parameter groups.
// =================================================================================
namespace {

// Net's parameters in three groups: "no_decay" takes the biases (l1.bias, and l2.bias
// before "head" can), "head" takes l2.weight at twice the lr and its own decay, and
// l1.weight stays in the default group with the optimizer's.
json grouped_config(int stage, bool offload) {
  json cfg = engine_config(stage, 1, 1e-3);
  cfg["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 2e-3}, {"weight_decay", 0.01}}}};
  cfg["scheduler"] = {{"type", "WarmupCosineLR"},
                      {"params",
                       {{"total_num_steps", 6}, {"warmup_num_steps", 3}, {"warmup_min_ratio", 0.1},
                        {"cos_min_ratio", 0.05}, {"warmup_type", "linear"}}}};
  cfg["param_groups"] = json::array({{{"name", "no_decay"}, {"patterns", {"bias$"}}, {"weight_decay", 0.0}},
                                     {{"name", "head"}, {"patterns", {"^l2\\."}}, {"lr", 4e-3}, {"weight_decay", 0.05}}});
  if (offload) cfg["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  return cfg;
}

}  // namespace

TEST_CASE("torch: parameter groups train with their own lr and weight decay, through every stage, offload and a "
          "checkpoint", "[torch]") {
  const auto [stage, offload] = GENERATE(table<int, bool>({{0, false}, {1, false}, {2, false}, {3, false}, {2, true}}));
  INFO("stage " << stage << (offload ? ", offload" : "") << ", world " << W());
  const json cfg = grouped_config(stage, offload);
  // The reference: torch's AdamW with the same three groups, each at the schedule's lr
  // times its ratio to the optimizer's (WarmupCosineLR scales every group's own lr).
  Net ref(5);
  const std::vector<Tensor> master = fp32_masters(ref->parameters());  // l1.weight, l1.bias, l2.weight, l2.bias
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{master[0]}, std::make_unique<torch::optim::AdamWOptions>(
                                                          torch::optim::AdamWOptions(2e-3).weight_decay(0.01)));
  groups.emplace_back(std::vector<Tensor>{master[1], master[3]},
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(2e-3).weight_decay(0.0)));
  groups.emplace_back(std::vector<Tensor>{master[2]}, std::make_unique<torch::optim::AdamWOptions>(
                                                          torch::optim::AdamWOptions(4e-3).weight_decay(0.05)));
  torch::optim::AdamW opt(std::move(groups));
  const double ratio[3] = {1.0, 1.0, 2.0};

  mpzero::testing::shared_dir dir;
  std::optional<mt::engine<Net>> engine;
  engine.emplace(mt::initialize(Net(5), cfg, world()));
  for (int k = 0; k < 6; ++k) {
    INFO("update " << k + 1);
    if (k == 3) {
      // Half way: save, and go on in a new engine from the checkpoint (at another stage:
      // the groups' elements are spread over the shards otherwise).
      engine->save_checkpoint(dir.path.string(), "half");
      const json meta = json::parse(std::ifstream(dir.path / "half" / "mpzero_engine.json"));
      CHECK(meta.at("param_groups").at("parameter_groups") ==
            json::array({"default", "no_decay", "head", "no_decay"}));
      engine.reset();
      engine.emplace(mt::initialize(Net(9), grouped_config(stage == 3 ? 1 : 3, false), world()));
      REQUIRE(engine->load_checkpoint(dir.path.string(), "half"));
    }
    CHECK(engine->get_lr() == Approx(cosine_lr(k)).epsilon(1e-12).margin(1e-18));
    CHECK(engine->get_lr("default") == engine->get_lr());
    CHECK(engine->get_lr("no_decay") == engine->get_lr());
    CHECK(engine->get_lr("head") == Approx(2 * cosine_lr(k)).epsilon(1e-12).margin(1e-18));
    const batch b = data(k, R(), 37, 4);
    torch::mse_loss((*engine)(b.x), b.y).backward();
    for (std::size_t g = 0; g < 3; ++g) opt.param_groups()[g].options().set_lr(cosine_lr(k) * ratio[g]);
    master_step(opt, master, averaged_grads(ref, k, 37), ref->parameters());
    engine->step();
    check_masters(*engine, ref, master);
  }
  CHECK_THROWS_WITH(engine->get_lr("heads"),
                    Catch::Contains("get_lr(\"heads\"): no parameter group of that name; the groups are 'default', "
                                    "'no_decay', 'head'"));
}

TEST_CASE("torch: parameter groups that take no parameter, or an lr against a zero optimizer lr, are refused",
          "[torch]") {
  const auto init = [](const json& groups, double lr = 1e-3) {
    json cfg = engine_config(1, 1, lr);
    cfg["param_groups"] = groups;
    return mt::initialize(Net(5), cfg, world());
  };
  CHECK_THROWS_WITH(init(json::array({{{"name", "norms"}, {"patterns", {"norm"}}, {"weight_decay", 0.0}}})),
                    Catch::Contains("param_groups 'norms' (patterns \"norm\") has no trainable parameter (the "
                                    "trainable parameters: l1.weight, l1.bias, l2.weight, l2.bias)"));
  CHECK_THROWS_WITH(init(json::array({{{"name", "all"}, {"patterns", {"."}}},
                                      {{"name", "bias"}, {"patterns", {"bias"}}, {"weight_decay", 0.0}}})),
                    Catch::Contains("param_groups 'bias' (patterns \"bias\") has no trainable parameter: "
                                    "'l1.bias' matches, but the earlier group 'all' takes it"));
  CHECK_THROWS_WITH(init(json::array({{{"name", "head"}, {"patterns", {"^l2"}}, {"lr", 1e-3}}}), 0.0),
                    Catch::Contains("param_groups 'head' sets lr = 0.001, but optimizer.params.lr is 0"));
  // Groups set in code are checked as the JSON's are.
  mt::config c = mt::parse_config(engine_config(1, 1, 1e-3), W());
  c.param_groups.push_back({"", {"bias"}, std::nullopt, 0.0});
  CHECK_THROWS_WITH(mt::initialize(Net(5), c, world()), Catch::Contains("param_groups[0] has no name"));
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
    for (auto& group : opt.param_groups()) {
      auto& o = static_cast<torch::optim::AdamOptions&>(group.options());
      o.lr(want.lr);
      o.betas({want.beta1, 0.99});
    }
    master_step(opt, master, averaged_grads(ref, k, 37), ref->parameters());
    engine.step();
    check_masters(engine, ref, master);
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
  CHECK(e.local_rank == R());  // one node
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
    scoped_env env({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"LOCAL_RANK", "1"}});
    const auto e = mt::read_launch_environment();
    CHECK(e.launcher == "torchrun");
    CHECK(e.world_size == 2);
    CHECK(e.local_rank == 1);
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

TEST_CASE("torch: torch_autocast in fp16 loss-scales an fp32 model, refuses an unscaled backward, skips overflows",
          "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  INFO("stage " << stage << ", world " << W());
  // Every gradient reduced in fp32 (no lower-precision-safe modules), so that the
  // reference below is the engine's arithmetic: the fp16 forward, the loss times the
  // scale in fp32, the scaled gradients summed over ranks, then divided by scale x ranks
  // (powers of two: exact).
  const json cfg = engine_config(stage, 1, 1e-2,
                                 {{"torch_autocast",
                                   {{"enabled", true}, {"dtype", "float16"}, {"lower_precision_safe_modules", json::array()}}}});
  {
    auto e = mt::initialize(Net(10), cfg, world());
    CHECK(e.loss_scale() == 65536.0);  // 2^initial_scale_power, the fp16 section's default
    const batch b = data(0, R(), 47, 4);
    CHECK_THROWS_WITH(torch::mse_loss(e(b.x).to(torch::kFloat), b.y).backward(),
                      Catch::Contains("Loss scaling is required"));
  }
  auto engine = mt::initialize(Net(10), cfg, world());
  Net ref(10);
  const std::vector<Tensor> master = fp32_masters(ref->parameters());
  torch::optim::Adam opt(master, torch::optim::AdamOptions(1e-2).weight_decay(0.0));
  const double scale = 65536.0;
  for (int k = 0; k < 3; ++k) {
    INFO("update " << k + 1);
    const batch b = data(k, R(), 47, 4);
    engine.backward(torch::mse_loss(engine(b.x).to(torch::kFloat), b.y));
    std::vector<Tensor> avg;
    for (int r = 0; r < W(); ++r) {
      for (auto& p : ref->parameters()) p.mutable_grad().reset();
      const batch br = data(k, r, 47, 4);
      Tensor out;
      {
        autocast_scope ac(true, at::kHalf);
        out = ref->forward(br.x);
      }
      (torch::mse_loss(out.to(torch::kFloat), br.y) * scale).backward();
      std::size_t i = 0;
      for (const auto& p : ref->parameters()) {
        const Tensor g = p.grad().detach().to(torch::kFloat);
        if (r == 0) avg.push_back(g);
        else avg[i] = avg[i] + g;
        ++i;
      }
    }
    for (auto& g : avg) g = g / static_cast<float>(scale * W());
    master_step(opt, master, avg, ref->parameters());
    engine.step();
    CHECK(engine.skipped_steps() == 0);
    check_masters(engine, ref, master);
  }
  // An overflow (here an infinite loss) is skipped: no update, the step counted as skipped.
  const auto before = engine.master_weights();
  const batch b = data(9, R(), 47, 4);
  engine.backward(torch::mse_loss(engine(b.x).to(torch::kFloat), b.y) * std::numeric_limits<float>::infinity());
  engine.step();
  CHECK(engine.skipped_steps() == 1);
  check_same(engine.master_weights(), before);
}

namespace {

// One low-precision configuration the config can select: its keys and the dtypes it
// stores the parameters, master weights, gradients and optimizer states in.
struct states_case {
  const char* name;
  json patch;
  at::ScalarType param, master, grad, state;
  double loss_scale;  // the initial dynamic scale (fp16), 1 without scaling
  std::optional<at::ScalarType> autocast = std::nullopt;  // torch_autocast's dtype, when on
};

std::vector<states_case> states_cases() {
  const auto bf = torch::kBFloat16, h = torch::kHalf, f = torch::kFloat;
  return {
      {"bf16_master_weights_and_grads", {{"bf16", {{"enabled", true}, {"bf16_master_weights_and_grads", true}}}},
       bf, bf, bf, f, 1.0},
      {"bf16_master_weights_and_grads + bf16_optimizer_states",
       {{"bf16", {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}}}},
       bf, bf, bf, bf, 1.0},
      {"bf16 (fp32 master and states)", {{"bf16", {{"enabled", true}}}}, bf, f, bf, f, 1.0},
      {"bf16 with grad_accum_dtype fp32", {{"bf16", {{"enabled", true}}}, {"data_types", {{"grad_accum_dtype", "fp32"}}}},
       bf, f, f, f, 1.0},
      {"fp16_master_weights_and_grads, dynamic loss scaling",
       {{"fp16", {{"enabled", true}, {"fp16_master_weights_and_grads", true}, {"initial_scale_power", 8}}}},
       h, h, h, f, 256.0},
      // DeepSpeed's test_with_autocast configurations: all-bf16 states under bf16 autocast,
      // and fp16 master weights and gradients under fp16 autocast.
      {"bf16 master, gradients and states under bf16 torch_autocast",
       {{"bf16", {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}}},
        {"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}},
       bf, bf, bf, bf, 1.0, bf},
      {"fp16 master and gradients under fp16 torch_autocast",
       {{"fp16", {{"enabled", true}, {"fp16_master_weights_and_grads", true}, {"initial_scale_power", 8}}},
        {"torch_autocast", {{"enabled", true}, {"dtype", "float16"}}}},
       h, h, h, f, 256.0, h},
  };
}

std::int64_t bytes_of(at::ScalarType t) { return static_cast<std::int64_t>(c10::elementSize(t)); }

}  // namespace

TEST_CASE("torch: low-precision model states through initialize, backward and step equal a LibTorch reference "
          "that stores each state in its dtype",
          "[torch][precision]") {
  // The reference, from the definitions: the model in the parameter dtype computes each
  // rank's gradient; the ranks' gradients, in the gradient dtype, are summed in fp32 and
  // rounded to it after each combine (one combine at two ranks; at three, in rank order,
  // which MPI may not follow), then multiplied by 1 / (loss scale x ranks) in fp32; AdamW runs in fp32 on the stored master weights and moments, one
  // rounding per operation, in the fused step's order (optim/adam.hpp), and each result
  // is stored back in its dtype. The engine must give those bits, and hold its states in
  // those dtypes: bytes per element of its master weights and moments, on the device or,
  // offloaded, on the host.
  const auto cases = states_cases();
  const int which = GENERATE(0, 1, 2, 3, 4, 5, 6);
  const int stage = GENERATE(1, 2, 3);
  const bool offload = GENERATE(false, true);
  const states_case& c = cases[static_cast<std::size_t>(which)];
  INFO(c.name << ", stage " << stage << (offload ? ", offload" : "") << ", world " << W());
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  json cfg = engine_config(stage, 1, lr, c.patch);
  cfg["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", lr}, {"betas", {b1, b2}}, {"eps", eps}, {"weight_decay", wd}}}};
  if (offload) cfg["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  auto engine = mt::initialize(Net(11), cfg, world());
  CHECK(engine.loss_scale() == c.loss_scale);

  // The master weights start from the model as built (fp32), rounded to their dtype; the
  // model's parameters are then stored in theirs.
  Net ref(11);
  const auto names = engine.parameter_names();
  std::vector<Tensor> master, m, v;
  for (const auto& p : ref->parameters()) {
    master.push_back(p.detach().to(c.master));
    m.push_back(torch::zeros_like(p, torch::TensorOptions().dtype(c.state)));
    v.push_back(torch::zeros_like(p, torch::TensorOptions().dtype(c.state)));
  }
  ref->to(c.param);
  auto f32 = [](double x) { return static_cast<float>(x); };
  for (int k = 1; k <= 3; ++k) {
    INFO("update " << k);
    const batch b = data(k, R(), 53, 4);
    const Tensor loss = torch::mse_loss(engine(b.x.to(c.param)).to(torch::kFloat), b.y);
    if (c.loss_scale == 1.0) {
      loss.backward();
    } else {
      engine.backward(loss);  // fp16 needs the scaled loss (engine.scale(loss).backward() is the same)
    }
    engine.step();
    // The ranks' gradients in the gradient dtype, reduced as the communicator does.
    std::vector<Tensor> g;
    for (int r = 0; r < W(); ++r) {
      for (auto& p : ref->parameters()) p.mutable_grad().reset();
      const batch br = data(k, r, 53, 4);
      Tensor out;
      {
        autocast_scope ac(c.autocast.has_value(), c.autocast.value_or(at::kBFloat16));
        out = ref->forward(br.x.to(c.param));
      }
      (torch::mse_loss(out.to(torch::kFloat), br.y) * c.loss_scale).backward();
      std::size_t i = 0;
      for (const auto& p : ref->parameters()) {
        const Tensor gi = p.grad().detach().to(c.grad).to(torch::kFloat);
        if (r == 0) g.push_back(gi);
        else g[i] = (g[i] + gi).to(c.grad).to(torch::kFloat);
        ++i;
      }
    }
    const float grad_scale = f32(1.0 / (c.loss_scale * W()));
    const float decay = f32(1.0 - lr * wd), step_size = f32(lr / (1.0 - std::pow(b1, k)));
    const float inv_sqrt_bias2 = f32(1.0 / std::sqrt(1.0 - std::pow(b2, k)));
    for (std::size_t i = 0; i < master.size(); ++i) {
      const Tensor gi = g[i] * grad_scale;
      Tensor w = master[i].to(torch::kFloat) * decay;
      const Tensor mi = m[i].to(torch::kFloat) * f32(b1) + gi * f32(1.0 - b1);
      const Tensor vi = v[i].to(torch::kFloat) * f32(b2) + (gi * f32(1.0 - b2)) * gi;
      const Tensor denom = ieee_sqrt(vi) * inv_sqrt_bias2 + f32(eps);
      w = w - (mi / denom) * step_size;
      master[i] = w.to(c.master);
      m[i] = mi.to(c.state);
      v[i] = vi.to(c.state);
    }
    {
      torch::NoGradGuard ng;
      std::size_t i = 0;
      for (auto& p : ref->parameters()) p.copy_(master[i++].to(c.param));
    }
    const auto got = engine.master_weights();
    std::size_t i = 0;
    for (const auto& p : ref->named_parameters()) {
      const auto at = static_cast<std::size_t>(std::find(names.begin(), names.end(), p.key()) - names.begin());
      REQUIRE(at < names.size());
      const Tensor want = master[i].to(torch::kFloat);
      INFO("master weight " << p.key() << ": max |engine - reference| " << (got[at] - want).abs().max().item<double>());
      if (W() <= 2) {
        CHECK(torch::equal(got[at], want));  // one combine per element: the order cannot matter
      } else {
        // MPI orders three ranks' sums its own way: within twice the master dtype's
        // epsilon relative to each reference value (two roundings' worth).
        const double eps = c.master == torch::kFloat ? 0x1p-23 : c.master == torch::kHalf ? 0x1p-10 : 0x1p-7;
        CHECK(((got[at] - want).abs() <= want.abs().clamp_min(1e-6) * (2 * eps)).all().item<bool>());
      }
      ++i;
    }
  }
  // What the engine holds: the model's parameters in the parameter dtype, and the master
  // weights and two moments of this rank's partition in theirs, where the step runs.
  for (const auto& p : engine.module()->parameters()) CHECK(p.scalar_type() == c.param);
  const mpzero::memory_report mem = engine.memory();
  const auto part = static_cast<std::int64_t>((mem.model_numel + mem.padding_numel) / static_cast<std::uint64_t>(W()));
  const std::int64_t states = 2 * part * bytes_of(c.state);
  CHECK(static_cast<std::int64_t>(offload ? mem.host_states : mem.states) == states);
  CHECK(static_cast<std::int64_t>(offload ? mem.states : mem.host_states) == 0);
  if (c.master != c.param || offload) {
    // A master of its own (fp32, or the offloaded step's host copy).
    CHECK(static_cast<std::int64_t>(offload ? mem.host_master : mem.master) == part * bytes_of(c.master));
  } else {
    CHECK(mem.master == 0);  // the 16-bit master is the parameter itself
  }
}

// The LibTorch engine under mpirun (1, 2 and 3 ranks): REFERENCE.md section 1's scenarios
// at ZeRO stages 0-2, and at stage 3 with every parameter partitioned (scalar and
// non-scalar backward, shared losses, fp16 scaling and its refusal, scale_wrt_gas,
// second backward through a retained graph, reentrant checkpointing, frozen
// parameters), and a regression test for each DeepSpeed bug listed there.
//
// The reference is plain LibTorch, sharing no code with the engine: the same model
// (same seed), run in the same compute dtype, with fp32 master weights updated by
// torch::optim::Adam; every rank computes every rank's micro-batch itself and averages
// the gradients, so the reference needs no communication. Gradients are compared with
// the tolerance of the compute dtype, master weights with fp32's.
#include "support/torch_mpi.hpp"  // LibTorch, then Catch and MPI
#include "support/torch_reference.hpp"

#include <algorithm>
#include <stdexcept>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mpzero/torch/process_group.hpp>
#include <mpzero/torch/zero_core.hpp>

#include "support/mpi_process_group.hpp"
#include "support/unused_communicator.hpp"

using namespace mpzero::testing;  // mt, Tensor, json, world(), W(), R(), the reference helpers

namespace {

// ---- models ------------------------------------------------------------------------

// Two Linear(4, 4) layers. forward(x) gives logits, forward(x, y) the MSE loss (in fp32).
struct NetImpl : two_linear {
  explicit NetImpl(std::uint64_t seed) : two_linear(seed) {}
  Tensor forward(const Tensor& x) {
    Tensor h = l1(x);
    if (probe) probe();  // what a test samples inside the forward
    return l2(h);
  }
  std::function<void()> probe;
  Tensor forward(const Tensor& x, const Tensor& y) { return torch::mse_loss(forward(x).to(torch::kFloat), y); }
};
TORCH_MODULE(Net);

// ---- data ----------------------------------------------------------------------------

// Micro-batch k of rank r (salt separates experiments).
batch data(int k, int r, int salt = 0) {
  return random_batch(static_cast<std::uint64_t>(100003 * salt + 1009 * k + r + 1));
}

// ---- the reference: plain LibTorch ---------------------------------------------------

template <class M>
struct reference {
  M model;  // computes in `dt`
  at::ScalarType dt;
  std::vector<std::string> names;
  std::vector<Tensor> master;            // fp32 leaves, updated by torch::optim::Adam
  std::vector<std::vector<Tensor>> acc;  // [rank][param]: gradients accumulated in `dt`
  // ZeRO-2 reduces every backward pass's gradients as they come (into the owner's
  // accumulator); stages 0 and 1 accumulate locally and reduce once per step. With
  // 16-bit gradients the two orders round differently, so the reference follows the stage.
  bool reduce_each_pass;
  std::vector<Tensor> global;  // reduce_each_pass: the sum over ranks, accumulated in `dt`
  std::unique_ptr<torch::optim::Optimizer> opt;  // torch::optim::Adam, no weight decay, unless replaced

  reference(M m, at::ScalarType dt_, int stage = 0, double lr = 1e-3)
      : model(std::move(m)), dt(dt_), reduce_each_pass(stage >= 2) {
    for (const auto& p : model->named_parameters()) names.push_back(p.key());
    master = fp32_masters(model->parameters());
    model->to(dt);
    acc.resize(static_cast<std::size_t>(W()));
    for (auto& a : acc)
      for (const auto& t : master) a.push_back(torch::zeros_like(t, dt));
    for (const auto& t : master) global.push_back(torch::zeros_like(t, dt));
    opt = std::make_unique<torch::optim::Adam>(master, torch::optim::AdamOptions(lr));
  }
  // Rank r's accumulator += scale * gradient of loss_of(model, r), computed in fp32 and
  // rounded to `dt` (mixed-precision trainers keep 16-bit gradient accumulators).
  template <class F>
  void accumulate(F&& loss_of, double scale) {
    auto ps = model->parameters();
    for (int r = 0; r < W(); ++r) {
      for (auto& p : ps) p.mutable_grad().reset();
      loss_of(model, r).backward();
      auto& a = acc[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < ps.size(); ++i)
        if (ps[i].grad().defined())
          a[i] = (a[i].to(torch::kFloat) + ps[i].grad().to(torch::kFloat) * static_cast<float>(scale)).to(dt);
    }
    if (reduce_each_pass) {
      for (std::size_t i = 0; i < global.size(); ++i) {
        Tensor sum = torch::zeros_like(master[i]);
        for (auto& a : acc) {
          sum = sum + a[i].to(torch::kFloat);
          a[i].zero_();
        }
        global[i] = (global[i].to(torch::kFloat) + sum.to(dt).to(torch::kFloat)).to(dt);
      }
    }
  }
  // The data-parallel gradient: the ranks' accumulators summed (one rounding to `dt`),
  // then averaged in fp32.
  std::vector<Tensor> reduced() const {
    std::vector<Tensor> out;
    for (std::size_t i = 0; i < master.size(); ++i) {
      Tensor sum = global[i].to(torch::kFloat);
      if (!reduce_each_pass) {
        for (const auto& a : acc) sum = sum + a[i].to(torch::kFloat);
        sum = sum.to(dt).to(torch::kFloat);
      }
      out.push_back(sum * static_cast<float>(1.0 / W()));
    }
    return out;
  }
  void set_lr(double lr) { set_learning_rate(*opt, lr); }
  // Another torch optimizer over the masters: make(master) builds it.
  template <class Make>
  void use_optimizer(Make&& make) {
    opt = make(master);
  }
  // Adam on the master weights with `grads` (default: reduced()), then the model
  // parameters are the masters rounded to `dt`.
  void step(std::vector<Tensor> grads = {}) {
    if (grads.empty()) grads = reduced();
    master_step(*opt, master, grads, model->parameters());
    for (auto& a : acc)
      for (auto& t : a) t.zero_();
    for (auto& t : global) t.zero_();
  }
  std::map<std::string, Tensor> grads() const {
    auto g = reduced();
    std::map<std::string, Tensor> m;
    for (std::size_t i = 0; i < names.size(); ++i) m[names[i]] = g[i];
    return m;
  }
  std::map<std::string, Tensor> weights() const {
    std::map<std::string, Tensor> m;
    for (std::size_t i = 0; i < names.size(); ++i) m[names[i]] = master[i].detach().clone();
    return m;
  }
};

// ---- comparisons ------------------------------------------------------------------------

void check_grads(mt::engine_base& e, const std::map<std::string, Tensor>& want, at::ScalarType dt,
                 const std::string& what) {
  auto got = e.full_grads();
  const auto& names = e.parameter_names();
  REQUIRE(got.size() == names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    REQUIRE(want.count(names[i]) == 1);
    check_close(got[i], want.at(names[i]), grad_tol(dt), 0.0, what + ": gradient of " + names[i]);
  }
}

void check_weights(mt::engine_base& e, const std::map<std::string, Tensor>& want, const std::string& what) {
  auto got = e.master_weights();
  const auto& names = e.parameter_names();
  for (std::size_t i = 0; i < names.size(); ++i) {
    check_close(got[i], want.at(names[i]), param_tol, param_atol, what + ": master weight " + names[i]);
    // The model's own parameter is the master rounded to the parameter dtype (at stage 3
    // a partitioned one is empty between forwards: test_torch_zero3.cpp checks its copies).
    if (e.parameters()[i].numel() == 0 && !e.parameter_shape(e.parameters()[i]).empty()) continue;
    check_close(e.parameters()[i].to(torch::kFloat),
                got[i].to(e.parameters()[i].scalar_type()).to(torch::kFloat), {0, 0}, 0.0,
                what + ": model parameter " + names[i] + " vs its master");
  }
}

// ---- configs -------------------------------------------------------------------------------

at::ScalarType dtype_of(const std::string& prec) {
  return prec == "bf16" ? torch::kBFloat16 : prec == "fp16" ? torch::kHalf : torch::kFloat;
}

// At stage 3 every parameter is partitioned (threshold 0; the test models' tensors are
// below DeepSpeed's default), so the scenarios run on gathered copies.
json make_config(int stage, const std::string& prec, int gas = 1, json extra = json::object()) {
  json j = engine_config(stage, gas, 1e-3);
  if (stage == 3) j["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  if (prec == "bf16") j["bf16"] = {{"enabled", true}};
  if (prec == "fp16") j["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}};
  j.merge_patch(extra);
  return j;
}

template <class M>
mt::engine<M> make_engine(M model, const json& cfg) {
  return mt::initialize(std::move(model), cfg, world());
}

std::string label(int stage, const std::string& prec) {
  return "stage " + std::to_string(stage) + ", " + prec + ", world " + std::to_string(W());
}

}  // namespace

// =================================================================================
// Scenarios 1 and 6: loss inside the model, loss outside the model.
// =================================================================================
TEST_CASE("torch: loss.backward() on the model's loss and on a loss computed outside match the reference",
          "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const bool outside = GENERATE(false, true);
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec) << (outside ? ", loss outside the model" : ", loss in the model"));

  auto engine = make_engine(Net(42), make_config(stage, prec));
  reference<Net> ref(Net(42), dt, stage);
  for (int it = 0; it < 3; ++it) {
    const batch b = data(it, R());
    Tensor loss = outside ? torch::mse_loss(engine(b.x.to(dt)).to(torch::kFloat), b.y) : engine(b.x.to(dt), b.y);
    loss.backward();
    ref.accumulate([&](Net& m, int r) { auto d = data(it, r); return m->forward(d.x.to(dt), d.y); }, 1.0);
    check_grads(engine, ref.grads(), dt, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
  CHECK(engine.global_steps() == 3);
  CHECK(engine.epilogues() == 3);
}

// DeepSpeed's "Adam" with adam_w_mode false is torch.optim.Adam (weight decay added to the
// gradient); with adam_w_mode true (its default), and "AdamW", torch.optim.AdamW. The
// other tests run without weight decay, where the two are the same update; here it is
// large enough for them to part, and the check that the two references differ by far
// more than the tolerance shows the comparison can tell which one the engine ran.
TEST_CASE("torch: Adam with L2 weight decay and AdamW match torch.optim.Adam and torch.optim.AdamW", "[torch]") {
  const int stage = GENERATE(0, 2);
  const bool decoupled = GENERATE(false, true);
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"));
  // At 3 ranks the mean of three bf16 gradients rounds in the reduction's order, which
  // this reference does not model; at lr 1e-2 Adam turns that ulp into more than the
  // fp32 tolerance of the master weights (the other scenarios, at lr 1e-3, stay within).
  if (prec == "bf16" && W() > 2) return;
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec) << (decoupled ? ", AdamW" : ", Adam (L2)"));
  const double lr = 1e-2, wd = 0.5;
  const json opt = {
      {"optimizer", {{"type", "Adam"}, {"params", {{"lr", lr}, {"weight_decay", wd}, {"adam_w_mode", decoupled}}}}}};
  auto engine = make_engine(Net(42), make_config(stage, prec, 1, opt));
  REQUIRE_THAT(engine.describe(), Catch::Matchers::Contains(decoupled ? ", AdamW," : ", Adam,"));
  // torch's Adam (L2) or AdamW over the reference's masters.
  const auto torch_adam = [&](bool adamw) {
    return [=](const std::vector<Tensor>& master) -> std::unique_ptr<torch::optim::Optimizer> {
      if (adamw) return std::make_unique<torch::optim::AdamW>(master, torch::optim::AdamWOptions(lr).weight_decay(wd));
      return std::make_unique<torch::optim::Adam>(master, torch::optim::AdamOptions(lr).weight_decay(wd));
    };
  };
  reference<Net> ref(Net(42), dt, stage);
  ref.use_optimizer(torch_adam(decoupled));
  reference<Net> other(Net(42), dt, stage);  // the other kind of decay: the comparison must tell them apart
  other.use_optimizer(torch_adam(!decoupled));
  for (int it = 0; it < 3; ++it) {
    const batch b = data(it, R());
    engine(b.x.to(dt), b.y).backward();
    for (auto* r : {&ref, &other})
      r->accumulate([&](Net& m, int rank) { auto d = data(it, rank); return m->forward(d.x.to(dt), d.y); }, 1.0);
    engine.step();
    ref.step();
    other.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
  // The two references parted by more than the comparison's tolerance.
  double apart = 0;
  const auto theirs = other.weights();
  for (const auto& [name, w] : ref.weights()) apart = std::max(apart, (w - theirs.at(name)).abs().max().item<double>());
  CHECK(apart > 1e-3);
}

namespace {

// Lion from its definition (Chen et al., 2023), over torch tensors: c = b1 m + (1 - b1) g;
// w <- w (1 - lr wd) - lr sign(c); m <- b2 m + (1 - b2) g.
class reference_lion final : public torch::optim::Optimizer {
 public:
  reference_lion(const std::vector<Tensor>& params, double lr, double b1, double b2, double wd)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)},
                                std::make_unique<torch::optim::SGDOptions>(lr)),
        b1_(b1), b2_(b2), wd_(wd) {}
  Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard ng;
    auto& group = param_groups()[0];
    const double lr = group.options().get_lr();
    for (std::size_t i = 0; i < group.params().size(); ++i) {
      Tensor& w = group.params()[i];
      if (m_.size() <= i) m_.push_back(torch::zeros_like(w));
      const Tensor g = w.grad();
      const Tensor c = m_[i] * b1_ + g * (1 - b1_);
      w.mul_(1 - lr * wd_).sub_(c.sign() * lr);
      m_[i] = m_[i] * b2_ + g * (1 - b2_);
    }
    return {};
  }

 private:
  double b1_, b2_, wd_;
  std::vector<Tensor> m_;
};

}  // namespace

TEST_CASE("torch: SGD and Lion match torch.optim.SGD and Lion's definition at every stage, with and without offload",
          "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const bool offload = GENERATE(false, true);
  const std::string type = GENERATE(std::string("SGD"), std::string("Lion"));
  if (offload && stage == 0) return;  // offload keeps a partition: stages 1-3
  INFO(label(stage, "fp32") << ", " << type << (offload ? ", offload" : ""));
  const double lr = 1e-2, wd = 0.1;
  json params = {{"lr", lr}, {"weight_decay", wd}};
  if (type == "SGD") {
    params["momentum"] = 0.9;
    params["nesterov"] = true;
  } else {
    params["betas"] = {0.9, 0.99};
  }
  json extra = {{"optimizer", {{"type", type}, {"params", params}}}};
  if (offload) extra["zero_optimization"] = {{"stage", stage}, {"offload_optimizer", {{"device", "cpu"}}}};
  auto engine = make_engine(Net(7), make_config(stage, "fp32", 1, extra));
  REQUIRE_THAT(engine.describe(), Catch::Contains(", " + type + ", ZeRO stage " + std::to_string(stage)));
  reference<Net> ref(Net(7), torch::kFloat, stage);
  ref.use_optimizer([&](const std::vector<Tensor>& master) -> std::unique_ptr<torch::optim::Optimizer> {
    if (type == "SGD") {
      return std::make_unique<torch::optim::SGD>(
          master, torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(wd).nesterov(true));
    }
    return std::make_unique<reference_lion>(master, lr, 0.9, 0.99, wd);
  });
  for (int it = 0; it < 3; ++it) {
    const batch b = data(it, R(), 5);
    engine(b.x, b.y).backward();
    ref.accumulate([&](Net& m, int rank) { auto d = data(it, rank, 5); return m->forward(d.x, d.y); }, 1.0);
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
}

// =================================================================================
// Scenario 2: non-scalar backward with an explicit gradient.
// =================================================================================
TEST_CASE("torch: out.backward(ones_like(out)) on a non-scalar output matches the reference", "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto engine = make_engine(Net(7), make_config(stage, prec));
  reference<Net> ref(Net(7), dt, stage);
  for (int it = 0; it < 2; ++it) {
    Tensor out = engine(data(it, R(), 1).x.to(dt));
    REQUIRE(out.dim() == 2);
    out.backward(torch::ones_like(out));
    // d(sum(out))/dp is what out.backward(ones) computes.
    ref.accumulate([&](Net& m, int r) { return m->forward(data(it, r, 1).x.to(dt)).to(torch::kFloat).sum(); }, 1.0);
    check_grads(engine, ref.grads(), dt, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
}

TEST_CASE("torch: fp16 non-scalar output: out.backward(grad) is refused naming engine.backward((out * grad).sum()), "
          "which matches the reference", "[torch]") {
  const int stage = GENERATE(0, 2);
  INFO(label(stage, "fp16"));
  auto engine = make_engine(Net(7), make_config(stage, "fp16"));
  reference<Net> ref(Net(7), torch::kHalf, stage);
  for (int it = 0; it < 2; ++it) {
    Tensor out = engine(data(it, R(), 1).x.to(torch::kHalf));
    const Tensor grad = torch::ones_like(out);
    if (it == 0) {  // the advice in the refusal is what works
      CHECK_THROWS_WITH(out.backward(grad, /*retain_graph=*/true),
                        Catch::Contains("Loss scaling is required") && Catch::Contains("engine.backward((out * grad).sum())"));
      CHECK_THROWS_WITH(engine.scale(out), Catch::Contains("engine.scale((out * grad).sum()).backward()"));
      engine.zero_grad();
    }
    engine.backward((out * grad).sum());
    ref.accumulate([&](Net& m, int r) { return m->forward(data(it, r, 1).x.to(torch::kHalf)).to(torch::kFloat).sum(); }, 1.0);
    check_grads(engine, ref.grads(), torch::kHalf, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
}

// =================================================================================
// Scenario 3: gradient accumulation without manual division.
// =================================================================================
TEST_CASE("torch: GAS=4 over 8 micro-batches with plain loss.backward() and step() every micro-batch",
          "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto engine = make_engine(Net(3), make_config(stage, prec, 4));
  reference<Net> ref(Net(3), dt, stage);
  for (int k = 0; k < 8; ++k) {
    const batch b = data(k, R(), 2);
    engine(b.x.to(dt), b.y).backward();
    ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 2); return m->forward(d.x.to(dt), d.y); }, 1.0 / 4);
    const bool boundary = k % 4 == 3;
    CHECK(engine.is_gradient_accumulation_boundary() == boundary);
    if (boundary) check_grads(engine, ref.grads(), dt, "micro-batch " + std::to_string(k));
    engine.step();
    if (boundary) {
      ref.step();
      check_weights(engine, ref.weights(), "micro-batch " + std::to_string(k));
    }
  }
  CHECK(engine.global_steps() == 2);
  CHECK(engine.micro_steps() == 8);
  CHECK(engine.epilogues() == 8);
}

// =================================================================================
// Scenario 4: engine.backward(loss, scale_wrt_gas = false) sums without dividing.
// =================================================================================
TEST_CASE("torch: engine.backward with and without scale_wrt_gas", "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const bool scale_wrt_gas = GENERATE(true, false);
  const std::string prec = "bf16";
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec) << ", scale_wrt_gas " << scale_wrt_gas);
  auto engine = make_engine(Net(5), make_config(stage, prec, 2));
  reference<Net> ref(Net(5), dt, stage);
  for (int k = 0; k < 4; ++k) {
    const batch b = data(k, R(), 3);
    Tensor loss = engine(b.x.to(dt), b.y);
    Tensor ret = engine.backward(loss, false, scale_wrt_gas);
    CHECK(ret.item<double>() == Approx(loss.item<double>() / (scale_wrt_gas ? 2.0 : 1.0)));
    ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 3); return m->forward(d.x.to(dt), d.y); },
                   scale_wrt_gas ? 0.5 : 1.0);
    if (k % 2 == 1) check_grads(engine, ref.grads(), dt, "micro-batch " + std::to_string(k));
    engine.step();
    if (k % 2 == 1) {
      ref.step();
      check_weights(engine, ref.weights(), "micro-batch " + std::to_string(k));
    }
  }
  CHECK(engine.epilogues() == 4);
}

// =================================================================================
// Scenario 5: three engines, one loss, one backward, no manual epilogue.
// =================================================================================
TEST_CASE("torch: three engines sharing one loss need no manual epilogue", "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  std::vector<mt::engine<Net>> engines;
  std::vector<std::unique_ptr<reference<Net>>> refs;
  for (int i = 0; i < 3; ++i) {
    engines.push_back(make_engine(Net(42 + i), make_config(stage, prec)));
    refs.push_back(std::make_unique<reference<Net>>(Net(42 + i), dt, stage));
  }
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 4);
    Tensor loss = torch::zeros({}, torch::kFloat);
    for (int i = 0; i < 3; ++i) loss = loss + engines[i](b.x.to(dt), b.y) / (i + 1.0);
    loss.backward();
    for (int i = 0; i < 3; ++i) {
      refs[i]->accumulate(
          [&](Net& m, int r) { auto d = data(it, r, 4); return m->forward(d.x.to(dt), d.y) / (i + 1.0); }, 1.0);
      check_grads(engines[i], refs[i]->grads(), dt, "engine " + std::to_string(i) + ", iteration " + std::to_string(it));
      CHECK(engines[i].epilogues() == static_cast<std::uint64_t>(it + 1));
    }
    for (int i = 0; i < 3; ++i) {
      engines[i].step();
      refs[i]->step();
      check_weights(engines[i], refs[i]->weights(), "engine " + std::to_string(i));
    }
  }
}

// =================================================================================
// Scenario 8: fp16 without scale() raises on every rank, no hang; dynamic and static.
// =================================================================================
TEST_CASE("torch: fp16 loss.backward() without engine.scale() raises 'Loss scaling is required' on every rank",
          "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const bool dynamic = GENERATE(true, false);
  const bool bypass = GENERATE(false, true);  // a forward that does not go through the engine
  if (stage == 3 && bypass) return;  // stage 3 gathers in engine.forward: a bypassing forward has no weights
  INFO(label(stage, "fp16") << (dynamic ? ", dynamic" : ", static") << " loss scale" << (bypass ? ", bypassed forward" : ""));
  json extra = dynamic ? json{{"fp16", {{"initial_scale_power", 8}}}} : json{{"fp16", {{"loss_scale", 256.0}}}};
  auto engine = make_engine(Net(11), make_config(stage, "fp16", 1, extra));
  CHECK(engine.loss_scale() == 256.0);
  const batch b = data(0, R(), 5);
  Tensor loss = bypass ? engine.module()->forward(b.x.to(torch::kHalf), b.y) : engine(b.x.to(torch::kHalf), b.y);
  CHECK_THROWS_WITH(loss.backward(), Catch::Contains("Loss scaling is required"));
  // Every rank is still in step: a collective completes, and the engine trains on.
  world().barrier();
  reference<Net> ref(Net(11), torch::kHalf, stage);
  Tensor loss2 = engine(b.x.to(torch::kHalf), b.y);
  engine.scale(loss2).backward();
  ref.accumulate([&](Net& m, int r) { auto d = data(0, r, 5); return m->forward(d.x.to(torch::kHalf), d.y); }, 1.0);
  check_grads(engine, ref.grads(), torch::kHalf, "after the error");
  engine.step();
  ref.step();
  check_weights(engine, ref.weights(), "after the error");
  CHECK(engine.epilogues() == 1);
}

// =================================================================================
// Scenario 9: engine.scale(loss).backward() == engine.backward(loss) == reference, GAS 4.
// =================================================================================
TEST_CASE("torch: engine.scale(loss).backward() equals engine.backward(loss) and the reference", "[torch]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string prec = GENERATE(std::string("fp16"), std::string("bf16"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto a = make_engine(Net(21), make_config(stage, prec, 4));
  auto c = make_engine(Net(21), make_config(stage, prec, 4));
  reference<Net> ref(Net(21), dt, stage);
  for (int k = 0; k < 8; ++k) {
    const batch b = data(k, R(), 6);
    a.scale(a(b.x.to(dt), b.y)).backward();
    c.backward(c(b.x.to(dt), b.y));
    ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 6); return m->forward(d.x.to(dt), d.y); }, 0.25);
    if (k % 4 == 3) {
      auto ga = a.full_grads(), gc = c.full_grads();
      for (std::size_t i = 0; i < ga.size(); ++i) check_close(ga[i], gc[i], {0, 0}, 0.0, "scale().backward() vs backward()");
      check_grads(a, ref.grads(), dt, "scale().backward()");
      ref.step();
    }
    a.step();
    c.step();
    if (k % 4 == 3) {
      check_weights(a, ref.weights(), "scale().backward()");
      check_weights(c, ref.weights(), "backward()");
    }
  }
}

// =================================================================================
// Scenario 10: scale() rejects non-scalar tensors.
// =================================================================================
TEST_CASE("torch: engine.scale() of a non-scalar tensor is rejected with a message about scalars", "[torch]") {
  const std::string prec = GENERATE(std::string("fp16"), std::string("bf16"));
  auto engine = make_engine(Net(1), make_config(1, prec));
  Tensor out = engine(data(0, R()).x.to(dtype_of(prec)));
  CHECK_THROWS_WITH(engine.scale(out), Catch::Contains("scalar"));
  CHECK_THROWS_WITH(engine.backward(out), Catch::Contains("scalar"));
}

// =================================================================================
// Scenario 11: several backward calls per optimizer step (GAS = 1, boundary override).
// =================================================================================
TEST_CASE("torch: several backward calls per step with set_gradient_accumulation_boundary", "[torch]") {
  // Without offload every backward's gradient must count (the offload half follows).
  const int stage = GENERATE(0, 1, 2);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto engine = make_engine(Net(9), make_config(stage, prec, 1));
  reference<Net> ref(Net(9), dt, stage);
  constexpr int N = 4;
  for (int it = 0; it < 2; ++it) {
    for (int i = 0; i < N; ++i) {
      engine.set_gradient_accumulation_boundary(i == N - 1);
      CHECK(engine.is_gradient_accumulation_boundary() == (i == N - 1));
      const batch b = data(10 * it + i, R(), 7);
      engine.backward(engine(b.x.to(dt), b.y));
      ref.accumulate([&](Net& m, int r) { auto d = data(10 * it + i, r, 7); return m->forward(d.x.to(dt), d.y); }, 1.0);
    }
    check_grads(engine, ref.grads(), dt, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
  CHECK(engine.global_steps() == 2);
}

TEST_CASE("torch: managed_gradient_accumulation false: every step() applies one update of what backward accumulated",
          "[torch]") {
  // DeepSpeed's unmanaged mode: the caller decides how many backward calls make a step
  // (here 1, 3, then 2, with gradient_accumulation_steps 4 in the config); each averages
  // its own micro-batches and passes scale_wrt_gas = false.
  const int stage = GENERATE(0, 1, 2, 3);
  INFO(label(stage, "fp32"));
  auto engine = make_engine(Net(9), make_config(stage, "fp32", 4, {{"managed_gradient_accumulation", false}}));
  reference<Net> ref(Net(9), torch::kFloat, stage);
  CHECK(engine.is_gradient_accumulation_boundary());
  int k = 0;
  for (const int n : {1, 3, 2}) {
    for (int i = 0; i < n; ++i, ++k) {
      const batch b = data(k, R(), 17);
      engine.backward(engine(b.x, b.y) / static_cast<float>(n), /*retain_graph=*/false, /*scale_wrt_gas=*/false);
      ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 17); return m->forward(d.x, d.y) / static_cast<float>(n); },
                     1.0);
    }
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), std::to_string(n) + " backward calls");
  }
  CHECK(engine.global_steps() == 3);
  CHECK(engine.micro_steps() == 3);
}

TEST_CASE("torch: several backward calls per step with CPU offload equal the run without (DeepSpeed #7981)",
          "[torch]") {
  // DeepSpeed kept only the last backward's gradient here with offload on. With N = 1 no
  // extra host buffer may exist: the host bytes stay the memory model's in both cases.
  const int stage = GENERATE(1, 2);
  const int N = GENERATE(1, 4);
  INFO("stage " << stage << ", " << N << " backward calls per step");
  // With 4 calls, sub-groups of 7 elements: the host step and the uploads interleave.
  json offload = {{"zero_optimization",
                   {{"stage", stage}, {"offload_optimizer", {{"device", "cpu"}}}, {"sub_group_size", N == 4 ? 7 : 1000000000}}}};
  auto off = make_engine(Net(9), make_config(stage, "bf16", 1, offload));
  auto on_device = make_engine(Net(9), make_config(stage, "bf16", 1));
  CHECK_THAT(off.describe(), Catch::Contains("CPU offload"));
  const std::uint64_t host_before = off.memory().host_model_state_bytes();
  CHECK(host_before > 0);
  CHECK(on_device.memory().host_model_state_bytes() == 0);
  for (int it = 0; it < 2; ++it) {
    for (int i = 0; i < N; ++i) {
      const batch b = data(10 * it + i, R(), 7);
      off.set_gradient_accumulation_boundary(i == N - 1);
      off.backward(off(b.x.to(torch::kBFloat16), b.y));
      on_device.set_gradient_accumulation_boundary(i == N - 1);
      on_device.backward(on_device(b.x.to(torch::kBFloat16), b.y));
    }
    off.step();
    on_device.step();
    const auto wa = off.master_weights();
    const auto wb = on_device.master_weights();
    REQUIRE(wa.size() == wb.size());
    for (std::size_t k = 0; k < wa.size(); ++k) CHECK(torch::equal(wa[k], wb[k]));
    for (std::size_t k = 0; k < off.parameters().size(); ++k) CHECK(torch::equal(off.parameters()[k], on_device.parameters()[k]));
  }
  CHECK(off.global_steps() == 2);
  CHECK(off.memory().host_model_state_bytes() == host_before);
}

// =================================================================================
// [hooks]: the DeepSpeed bugs of REFERENCE.md section 1.
// =================================================================================
TEST_CASE("hooks: a second backward without a new forward accumulates and runs its own epilogue", "[hooks]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const bool two_losses = GENERATE(false, true);
  const bool via_scale = GENERATE(false, true);  // DeepSpeed's engine.scale(loss, retain_graph).backward(...)
  INFO(label(stage, "fp32") << (two_losses ? ", two losses of one forward" : ", retain_graph twice")
                            << (via_scale ? ", through engine.scale" : ""));
  auto engine = make_engine(Net(13), make_config(stage, "fp32"));
  reference<Net> ref(Net(13), torch::kFloat, stage);
  const batch b = data(0, R(), 8);
  Tensor out = engine(b.x);
  Tensor l1 = torch::mse_loss(out, b.y);
  Tensor l2 = two_losses ? out.pow(2).mean() : l1;
  if (via_scale) {
    engine.scale(l1, /*retain_graph=*/true).backward({}, /*retain_graph=*/true);
  } else {
    l1.backward({}, /*retain_graph=*/true);
  }
  CHECK(engine.epilogues() == 1);
  if (via_scale) {
    engine.scale(l2).backward();
  } else {
    l2.backward();
  }
  CHECK(engine.epilogues() == 2);
  ref.accumulate([&](Net& m, int r) { auto d = data(0, r, 8); return torch::mse_loss(m->forward(d.x), d.y); }, 1.0);
  ref.accumulate([&](Net& m, int r) {
    auto d = data(0, r, 8);
    auto o = m->forward(d.x);
    return two_losses ? o.pow(2).mean() : torch::mse_loss(o, d.y);
  }, 1.0);
  check_grads(engine, ref.grads(), torch::kFloat, "two backward passes");
  engine.step();
  ref.step();
  check_weights(engine, ref.weights(), "two backward passes");
}

namespace {

// A model whose forward runs a backward of its own (a side loss on l1's weight), as
// DeepSpeed's pipeline engine does internally.
struct InnerImpl : NetImpl {
  explicit InnerImpl(std::uint64_t seed) : NetImpl(seed) {}
  Tensor forward(const Tensor& x, const Tensor& y) {
    (l1->weight.to(torch::kFloat).pow(2).sum() * 0.5).backward();
    return NetImpl::forward(x, y);
  }
};
TORCH_MODULE(Inner);

// Reentrant checkpointing of l2: its forward runs without a graph; its backward
// recomputes l2 with grad and runs a nested backward through it.
thread_local std::function<Tensor(const Tensor&)> checkpointed_fn;
struct checkpoint : torch::autograd::Function<checkpoint> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& h) {
    ctx->save_for_backward({h});
    return checkpointed_fn(h);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    Tensor h = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    {
      torch::AutoGradMode on(true);
      Tensor out = checkpointed_fn(h);
      torch::autograd::backward({out}, {g[0]});
    }
    return {h.grad()};
  }
};
struct CheckpointedImpl : NetImpl {
  explicit CheckpointedImpl(std::uint64_t seed) : NetImpl(seed) {}
  Tensor forward(const Tensor& x, const Tensor& y) {
    checkpointed_fn = [this](const Tensor& h) { return l2(h); };
    return torch::mse_loss(checkpoint::apply(l1(x)), y);
  }
};
TORCH_MODULE(Checkpointed);

}  // namespace

TEST_CASE("hooks: a backward inside forward runs no epilogue; its gradients join the next pass", "[hooks]") {
  const int stage = GENERATE(0, 1, 2);
  INFO(label(stage, "fp32"));
  auto engine = make_engine(Inner(17), make_config(stage, "fp32"));
  reference<Inner> ref(Inner(17), torch::kFloat, stage);
  const batch b = data(0, R(), 9);
  Tensor loss = engine(b.x, b.y);
  CHECK(engine.epilogues() == 0);
  loss.backward();
  CHECK(engine.epilogues() == 1);
  ref.accumulate([&](Inner& m, int r) { auto d = data(0, r, 9); return m->forward(d.x, d.y); }, 1.0);
  check_grads(engine, ref.grads(), torch::kFloat, "inner + outer backward");
  engine.step();
  ref.step();
  check_weights(engine, ref.weights(), "inner + outer backward");
}

TEST_CASE("hooks: a nested (reentrant) backward runs no epilogue of its own", "[hooks]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const bool bypass = GENERATE(false, true);
  if (stage == 3 && bypass) return;  // stage 3 gathers in engine.forward: a bypassing forward has no weights
  INFO(label(stage, "fp32") << (bypass ? ", forward bypasses the engine" : ""));
  auto engine = make_engine(Checkpointed(19), make_config(stage, "fp32"));
  reference<Net> ref(Net(19), torch::kFloat, stage);  // same math without checkpointing
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 10);
    Tensor loss = bypass ? engine.module()->forward(b.x, b.y) : engine(b.x, b.y);
    loss.backward();
    CHECK(engine.epilogues() == static_cast<std::uint64_t>(it + 1));
    ref.accumulate([&](Net& m, int r) { auto d = data(it, r, 10); return m->forward(d.x, d.y); }, 1.0);
    check_grads(engine, ref.grads(), torch::kFloat, "checkpointed");
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "checkpointed");
  }
}

TEST_CASE("hooks: engine.backward(loss, scale_wrt_gas = false) leaves gradients reached first in a nested backward "
          "undivided too", "[hooks]") {
  const int stage = GENERATE(0, 2);
  const bool bypass = GENERATE(false, true);  // bypassed: the checkpoint's nested backward reaches l2 first
  INFO(label(stage, "fp32") << (bypass ? ", forward bypasses the engine" : ""));
  auto engine = make_engine(Checkpointed(19), make_config(stage, "fp32", 2));
  reference<Net> ref(Net(19), torch::kFloat, stage);
  for (int k = 0; k < 2; ++k) {
    const batch b = data(k, R(), 13);
    engine.backward(bypass ? engine.module()->forward(b.x, b.y) : engine(b.x, b.y), false, /*scale_wrt_gas=*/false);
    CHECK(engine.epilogues() == static_cast<std::uint64_t>(k + 1));
    ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 13); return m->forward(d.x, d.y); }, 1.0);
    if (k == 1) check_grads(engine, ref.grads(), torch::kFloat, "undivided sum of two micro-batches");
    engine.step();
  }
  ref.step();
  check_weights(engine, ref.weights(), "undivided sum of two micro-batches");
}

namespace {
// Every parameter inside reentrant checkpointing (the input made to require grad, as
// checkpointing needs): with a forward that bypasses the engine, no hook runs at the
// outer level.
struct AllCheckpointedImpl : NetImpl {
  explicit AllCheckpointedImpl(std::uint64_t seed) : NetImpl(seed) {}
  Tensor forward(const Tensor& x, const Tensor& y) {
    checkpointed_fn = [this](const Tensor& h) { return l2(l1(h)); };
    return torch::mse_loss(checkpoint::apply(x.detach().requires_grad_(true)).to(torch::kFloat), y);
  }
};
TORCH_MODULE(AllCheckpointed);
}  // namespace

TEST_CASE("hooks: every parameter checkpointed and a bypassed forward: the epilogue waits for step(), the result is "
          "the same", "[hooks]") {
  const int stage = GENERATE(0, 1, 2);
  INFO(label(stage, "bf16"));
  auto engine = make_engine(AllCheckpointed(29), make_config(stage, "bf16", 2));
  reference<Net> ref(Net(29), torch::kBFloat16, stage);
  for (int it = 0; it < 2; ++it) {
    for (int k = 0; k < 2; ++k) {
      const batch b = data(2 * it + k, R(), 14);
      engine.module()->forward(b.x.to(torch::kBFloat16), b.y).backward();
      ref.accumulate([&](Net& m, int r) { auto d = data(2 * it + k, r, 14); return m->forward(d.x.to(torch::kBFloat16), d.y); }, 0.5);
      if (k == 1) check_grads(engine, ref.grads(), torch::kBFloat16, "iteration " + std::to_string(it));
      engine.step();
    }
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
}

TEST_CASE("hooks: torch::autograd::grad through the engine's output leaves the engine untouched", "[hooks]") {
  // A gradient penalty or a saliency map on some ranks only: grad() accumulates into no
  // parameter, so no epilogue (a collective) may run, and fp16 must not ask for scaling.
  const int stage = GENERATE(0, 2);
  const std::string prec = GENERATE(std::string("fp16"), std::string("bf16"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto a = make_engine(Net(37), make_config(stage, prec));
  auto c = make_engine(Net(37), make_config(stage, prec));  // the same training without grad() calls
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 15);
    if (R() == 0) {  // one rank only: a collective here would hang
      const Tensor x = b.x.to(dt).requires_grad_(true);
      const Tensor out = a(x);
      const auto g = torch::autograd::grad({out.to(torch::kFloat).sum()}, {x});
      REQUIRE(g[0].defined());
      const Tensor s = a.scale(a(x).to(torch::kFloat).sum());  // a scaled root, then grad()
      const auto g2 = torch::autograd::grad({s}, {x});
      REQUIRE(g2[0].defined());
    }
    CHECK(a.epilogues() == static_cast<std::uint64_t>(it));
    a.backward(a(b.x.to(dt), b.y));
    c.backward(c(b.x.to(dt), b.y));
    a.step();
    c.step();
  }
  const auto wa = a.master_weights(), wc = c.master_weights();
  for (std::size_t i = 0; i < wa.size(); ++i) check_close(wa[i], wc[i], {0, 0}, 0.0, "with grad() calls vs without");
  CHECK(a.epilogues() == 2);
}

TEST_CASE("hooks: a forward that bypasses the engine still gets its epilogue", "[hooks]") {
  const int stage = GENERATE(0, 1, 2);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto engine = make_engine(Net(23), make_config(stage, prec, 2));
  reference<Net> ref(Net(23), dt, stage);
  for (int k = 0; k < 2; ++k) {
    const batch b = data(k, R(), 11);
    engine.module()->forward(b.x.to(dt), b.y).backward();
    CHECK(engine.epilogues() == static_cast<std::uint64_t>(k + 1));
    ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 11); return m->forward(d.x.to(dt), d.y); }, 0.5);
    engine.step();
  }
  ref.step();
  check_weights(engine, ref.weights(), "bypassed forward");
}

namespace {
struct ChainImpl : torch::nn::Module {
  Net enc{nullptr}, dec{nullptr};
  ChainImpl(std::uint64_t a, std::uint64_t b) {
    enc = register_module("enc", Net(a));
    dec = register_module("dec", Net(b));
  }
  Tensor forward(const Tensor& x, const Tensor& y) { return dec->forward(enc->forward(x), y); }
};
TORCH_MODULE(Chain);
}  // namespace

TEST_CASE("hooks: gradients flowing from one engine into another are divided by GAS once", "[hooks]") {
  const int stage = GENERATE(0, 1, 2);
  INFO(label(stage, "fp32"));
  auto enc = make_engine(Net(31), make_config(stage, "fp32", 2));
  auto dec = make_engine(Net(32), make_config(stage, "fp32", 2));
  reference<Chain> ref(Chain(31, 32), torch::kFloat, stage);
  for (int k = 0; k < 4; ++k) {
    const batch b = data(k, R(), 12);
    dec(enc(b.x), b.y).backward();
    ref.accumulate([&](Chain& m, int r) { auto d = data(k, r, 12); return m->forward(d.x, d.y); }, 0.5);
    if (k % 2 == 1) {
      auto want = ref.grads();
      std::map<std::string, Tensor> we, wd;
      for (auto& [n, g] : want) (n.rfind("enc.", 0) == 0 ? we : wd)[n.substr(4)] = g;
      check_grads(enc, we, torch::kFloat, "encoder");
      check_grads(dec, wd, torch::kFloat, "decoder");
      ref.step();
    }
    enc.step();
    dec.step();
  }
  CHECK(enc.epilogues() == 4);
  CHECK(dec.epilogues() == 4);
}

TEST_CASE("hooks: fp16 engines chained into one another are refused with a message that says so", "[hooks]") {
  const int stage = GENERATE(0, 2);
  INFO(label(stage, "fp16"));
  auto enc = make_engine(Net(31), make_config(stage, "fp16"));
  auto dec = make_engine(Net(32), make_config(stage, "fp16"));
  const batch b = data(0, R(), 12);
  CHECK_THROWS_WITH(dec.scale(dec(enc(b.x.to(torch::kHalf)), b.y)).backward(),
                    Catch::Contains("scaled by another engine's loss scale") && Catch::Contains("chained"));
  CHECK_THROWS_WITH(dec.backward(dec(enc(b.x.to(torch::kHalf)), b.y)), Catch::Contains("scaled by another engine"));
  // Unscaled: the plain message.
  CHECK_THROWS_WITH(dec(enc(b.x.to(torch::kHalf)), b.y).backward(),
                    Catch::Contains("this backward was not scaled"));
  world().barrier();  // every rank refused; none waits in a collective
  enc.zero_grad();
  dec.zero_grad();
}

namespace {
// A zero-sized parameter and a layer that never gets a gradient.
struct SparseUseImpl : NetImpl {
  Tensor empty;
  torch::nn::Linear unused{nullptr};
  explicit SparseUseImpl(std::uint64_t seed) : NetImpl(seed) {
    empty = register_parameter("empty", torch::zeros({0}));
    unused = register_module("unused", torch::nn::Linear(4, 3));
  }
};
TORCH_MODULE(SparseUse);
}  // namespace

TEST_CASE("hooks: zero-sized parameters and parameters without gradients", "[hooks]") {
  const int stage = GENERATE(0, 1, 2);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  auto engine = make_engine(SparseUse(29), make_config(stage, prec));
  reference<SparseUse> ref(SparseUse(29), dt, stage);
  REQUIRE(engine.parameters().size() == 7);
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 13);
    engine(b.x.to(dt), b.y).backward();
    ref.accumulate([&](SparseUse& m, int r) { auto d = data(it, r, 13); return m->forward(d.x.to(dt), d.y); }, 1.0);
    check_grads(engine, ref.grads(), dt, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
}

namespace {
// forward(x) returns the logits and a parameter as is (a leaf output).
struct LeafOutImpl : NetImpl {
  explicit LeafOutImpl(std::uint64_t seed) : NetImpl(seed) {}
  std::tuple<Tensor, Tensor> forward(const Tensor& x) { return {l2(l1(x)), l1->weight}; }
};
TORCH_MODULE(LeafOut);
}  // namespace

TEST_CASE("hooks: a forward that returns a leaf tensor adds no hook to it", "[hooks]") {
  auto engine = make_engine(LeafOut(41), make_config(1, "fp32"));
  for (int it = 0; it < 3; ++it) {
    auto [out, w] = engine(data(it, R(), 16).x);
    (out.sum() + w.sum()).backward();
    engine.step();
  }
  // A hook on a leaf lives as long as the tensor: one more per forward otherwise.
  const auto* meta = torch::autograd::impl::get_autograd_meta(engine.module()->l1->weight);
  REQUIRE(meta != nullptr);
  CHECK((meta->cpp_hooks_list_ == nullptr || meta->cpp_hooks_list_->empty()));
  CHECK(engine.epilogues() == 3);
}

namespace {
// One weight under two names, a.w and b.w, used twice in the graph (as a tied embedding
// and output layer).
struct TiedNetImpl : torch::nn::Module {
  struct Holder : torch::nn::Module {
    Tensor w;
    explicit Holder(const Tensor& t) { w = register_parameter("w", t); }
  };
  std::shared_ptr<Holder> a, b;
  Tensor bias;
  explicit TiedNetImpl(std::uint64_t seed) {
    torch::manual_seed(seed);
    const Tensor w = torch::randn({4, 4}) * 0.5;
    a = register_module("a", std::make_shared<Holder>(w));
    b = register_module("b", std::make_shared<Holder>(w));
    bias = register_parameter("bias", torch::randn({4}) * 0.1);
  }
  Tensor forward(const Tensor& x, const Tensor& y) {
    return torch::mse_loss(torch::relu(x.matmul(a->w) + bias).matmul(b->w), y);
  }
};
TORCH_MODULE(TiedNet);
}  // namespace

TEST_CASE("hooks: a weight used twice in the graph (tied) gets the sum of both uses' gradients", "[hooks]") {
  const int stage = GENERATE(0, 2);
  INFO(label(stage, "fp32"));
  auto engine = make_engine(TiedNet(47), make_config(stage, "fp32"));
  REQUIRE(engine.parameters().size() == 2);  // the tied weight once, and the bias
  TiedNet plain(47);                          // the same model without an engine
  REQUIRE(plain->a->w.is_same(plain->b->w));
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 18);
    engine(b.x, b.y).backward();
    // Every rank's gradient of the plain model (autograd sums the two uses), averaged.
    std::map<std::string, Tensor> want;
    for (int r = 0; r < W(); ++r) {
      plain->zero_grad();
      const batch d = data(it, r, 18);
      plain->forward(d.x, d.y).backward();
      for (const auto& p : plain->named_parameters()) {
        const Tensor g = p.value().grad().detach() / static_cast<double>(W());
        want[p.key()] = want.count(p.key()) ? want[p.key()] + g : g.clone();
      }
    }
    check_grads(engine, want, torch::kFloat, "tied weight, iteration " + std::to_string(it));
    engine.step();
    // Keep the plain model on the engine's weights for the next iteration's reference.
    torch::NoGradGuard ng;
    const auto w = engine.master_weights();
    for (std::size_t i = 0; i < w.size(); ++i) plain->named_parameters()[engine.parameter_names()[i]].copy_(w[i]);
  }
}

TEST_CASE("hooks: frozen parameters (requires_grad false) are not managed and keep their values", "[hooks]") {
  const int stage = GENERATE(0, 2, 3);
  const std::string prec = GENERATE(std::string("bf16"), std::string("fp32"));
  const at::ScalarType dt = dtype_of(prec);
  INFO(label(stage, prec));
  Net model(43);
  model->l1->weight.requires_grad_(false);
  model->l1->bias.requires_grad_(false);
  auto engine = make_engine(model, make_config(stage, prec));
  REQUIRE(engine.parameter_names() == std::vector<std::string>{"l2.weight", "l2.bias"});
  // Stage 3 keeps them in slices too (empty between forwards): their values are read
  // from the reference model built alike.
  const Tensor w1 = stage == 3 ? Net(43)->l1->weight.detach().to(dt) : engine.module()->l1->weight.detach().clone();
  if (stage == 3) CHECK(engine.module()->l1->weight.numel() == 0);
  CHECK(w1.scalar_type() == dt);  // frozen parameters take the model's dtype, as after module.bfloat16()
  Net ref_model(43);
  ref_model->l1->weight.requires_grad_(false);
  ref_model->l1->bias.requires_grad_(false);
  reference<Net> ref(ref_model, dt, stage);  // Adam moves nothing that has no gradient
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 19);
    engine(b.x.to(dt), b.y).backward();
    ref.accumulate([&](Net& m, int r) { auto d = data(it, r, 19); return m->forward(d.x.to(dt), d.y); }, 1.0);
    check_grads(engine, ref.grads(), dt, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
  if (stage == 3) {
    // Gathered for a forward under the engine, and unchanged.
    Tensor seen;
    engine.module()->probe = [&] { seen = engine.module()->l1->weight.detach().clone(); };
    engine(data(5, R(), 19).x.to(dt));
    engine.module()->probe = nullptr;
    CHECK(torch::equal(seen, w1));
  } else {
    CHECK(torch::equal(engine.module()->l1->weight, w1));
  }
  CHECK_FALSE(engine.module()->l1->weight.grad().defined());
}

TEST_CASE("hooks: a parameter hook that throws mid-backward leaves the engine usable after zero_grad()", "[hooks]") {
  const int stage = GENERATE(0, 2);
  INFO(label(stage, "fp32"));
  auto engine = make_engine(Net(53), make_config(stage, "fp32"));
  reference<Net> ref(Net(53), torch::kFloat, stage);
  const batch b0 = data(0, R(), 20);
  engine(b0.x, b0.y).backward();
  (void)engine.full_grads();  // reduces this step's gradients: no backward may follow before step()/zero_grad()
  CHECK_THROWS_WITH(engine(b0.x, b0.y).backward(), Catch::Contains("already reduced") && Catch::Contains("zero_grad()"));
  engine.zero_grad();
  for (int it = 1; it < 3; ++it) {  // trains on as if neither backward had happened
    const batch b = data(it, R(), 20);
    engine(b.x, b.y).backward();
    ref.accumulate([&](Net& m, int r) { auto d = data(it, r, 20); return m->forward(d.x, d.y); }, 1.0);
    check_grads(engine, ref.grads(), torch::kFloat, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
  CHECK(engine.epilogues() == 3);
}

TEST_CASE("hooks: backward on another thread, and with create_graph, match the reference", "[hooks]") {
  const int stage = GENERATE(0, 2);
  const bool create_graph = GENERATE(false, true);
  INFO(label(stage, "bf16") << (create_graph ? ", create_graph" : ", another thread"));
  auto engine = make_engine(Net(59), make_config(stage, "bf16"));
  reference<Net> ref(Net(59), torch::kBFloat16, stage);
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 21);
    Tensor loss = engine(b.x.to(torch::kBFloat16), b.y);
    if (create_graph) {
      // The gradients that reach the hooks carry a graph of their own; the engine keeps their values.
      torch::autograd::backward({loss}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    } else {
      std::exception_ptr error;
      std::thread t([&] {
        try {
          loss.backward();
        } catch (...) {
          error = std::current_exception();
        }
      });
      t.join();
      if (error) std::rethrow_exception(error);
    }
    CHECK(engine.epilogues() == static_cast<std::uint64_t>(it + 1));
    ref.accumulate([&](Net& m, int r) { auto d = data(it, r, 21); return m->forward(d.x.to(torch::kBFloat16), d.y); }, 1.0);
    check_grads(engine, ref.grads(), torch::kBFloat16, "iteration " + std::to_string(it));
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "iteration " + std::to_string(it));
  }
}

TEST_CASE("hooks: bookkeeping scales to many parameters (one lookup per backward, one epilogue, every gradient)",
          "[hooks]") {
  // O(1) per hook: a hook finds its backward through a one-entry cache; only the first
  // hook of a graph task looks it up (counted by bookkeeping_lookups()).
  struct ManyImpl : torch::nn::Module {
    std::vector<Tensor> ws;
    ManyImpl() {
      torch::manual_seed(3);
      for (int i = 0; i < 512; ++i) {
        std::string name = "w";
        name += std::to_string(i);
        ws.push_back(register_parameter(name, torch::randn({4})));
      }
    }
    Tensor forward(const Tensor& x) {
      Tensor acc = torch::zeros({x.size(0)});
      for (std::size_t i = 0; i < ws.size(); ++i) acc = acc + (x * ws[i]).sum(1) * (1.0 / (i + 1));
      return acc.pow(2).mean();
    }
  };
  const int stage = GENERATE(1, 2);
  auto model = std::make_shared<ManyImpl>();
  auto engine = make_engine(model, make_config(stage, "fp32", 1, {{"zero_optimization", {{"reduce_bucket_size", 64}}}}));
  const batch b = data(0, R(), 14);
  engine(b.x).backward();
  CHECK(engine.epilogues() == 1);
  // 512 parameter hooks and one output hook found their backward through the cache: one
  // lookup for the graph task, not one per hook.
  CHECK(engine.bookkeeping_lookups() == 1);
  engine.zero_grad();
  engine(b.x).backward();
  CHECK(engine.bookkeeping_lookups() == 2);
  engine.zero_grad();
  engine(b.x).backward();
  auto grads = engine.full_grads();
  // Reference: the same function on a plain copy.
  auto plain = std::make_shared<ManyImpl>();
  for (int r = 0; r < W(); ++r) plain->forward(data(0, r, 14).x).mul(1.0 / W()).backward();
  for (std::size_t i = 0; i < grads.size(); ++i) check_close(grads[i], plain->ws[i].grad(), grad_tol(torch::kFloat), 0.0, "w" + std::to_string(i));
}

// =================================================================================
// Schedules, clipping, config errors, destruction, autocast, c10d.
// =================================================================================
TEST_CASE("torch: WarmupLR sets each step's learning rate; gradient clipping uses the global norm", "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  INFO(label(stage, "fp32"));
  json extra = {{"scheduler",
                 {{"type", "WarmupLR"},
                  {"params", {{"warmup_min_lr", 1e-4}, {"warmup_max_lr", 1e-3}, {"warmup_num_steps", 4}, {"warmup_type", "linear"}}}}},
                {"gradient_clipping", 0.05}};
  auto engine = make_engine(Net(37), make_config(stage, "fp32", 1, extra));
  reference<Net> ref(Net(37), torch::kFloat, stage);
  for (int k = 0; k < 6; ++k) {
    // DeepSpeed's WarmupLR (linear): update k+1 uses min + (max - min) * (k - 1) / 4 once
    // k >= 1 (last_batch_iteration = k - 1), warmup_min_lr before; max_lr after warmup.
    const double i = k - 1;
    const double want_lr = k == 0 ? 1e-4 : i < 4 ? 1e-4 + (1e-3 - 1e-4) * i / 4 : 1e-3;
    CHECK(engine.get_lr() == Approx(want_lr).epsilon(1e-12));
    const batch b = data(k, R(), 15);
    engine(b.x, b.y).backward();
    ref.accumulate([&](Net& m, int r) { auto d = data(k, r, 15); return m->forward(d.x, d.y); }, 1.0);
    auto g = ref.reduced();
    double norm = 0;
    for (auto& t : g) norm += t.to(torch::kDouble).pow(2).sum().item<double>();
    norm = std::sqrt(norm);
    const double coef = 0.05 / (norm + 1e-6);
    if (coef < 1)
      for (auto& t : g) t.mul_(static_cast<float>(coef));
    ref.set_lr(want_lr);
    engine.step();
    ref.step(g);
    CHECK(engine.global_grad_norm() == Approx(norm).epsilon(1e-5));
    check_weights(engine, ref.weights(), "step " + std::to_string(k));
  }
}

TEST_CASE("torch: a configuration the engine cannot run is refused by name, leaving the model alone", "[torch]") {
  Net model(1);
  // What a failed initialize must leave as it was: each parameter's tensor, its storage,
  // its dtype and its bits.
  const std::vector<Tensor> params = model->parameters();
  std::vector<const c10::TensorImpl*> impls;
  std::vector<const void*> storage;
  std::vector<Tensor> bits;  // int32 copies: a bit-for-bit comparison (signed zeros, NaNs included)
  for (const auto& p : params) {
    impls.push_back(p.unsafeGetTensorImpl());
    storage.push_back(p.data_ptr());
    bits.push_back(p.detach().view(torch::kInt32).clone());
  }
  // The core refuses the communicator: initialize fails after it has collected the parameters.
  const mt::any_communicator device_comm(std::make_shared<unused_communicator>("device-reading rank", 1, true));
  CHECK_THROWS_WITH(mt::initialize(model, make_config(1, "bf16", 1), device_comm),
                    Catch::Contains("the parameters are on the CPU, but the communicator 'device-reading rank' reads "
                                    "device memory"));
  // A precision no named policy has (the config cannot select one; the core's factory
  // refuses it by name, listing the policies).
  mt::core_spec odd;
  odd.param = odd.master = odd.grad = mpzero::dtype::bf16;
  odd.state = mpzero::dtype::fp32;
  odd.stochastic_rounding = true;
  const std::uint64_t numels[] = {4};
  CHECK_THROWS_WITH(mt::make_zero_core(odd, {}, numels, {}, {}),
                    Catch::Contains("stochastic rounding") && Catch::Contains("none of the named policies") &&
                        Catch::Contains("bf16_all_sr"));
  // Every optimizer the config accepts runs at every stage, with and without offload.
  const auto cores = mt::compiled_cores();
  for (const auto opt : {mt::optimizer_type::adam, mt::optimizer_type::adamw, mt::optimizer_type::sgd,
                         mt::optimizer_type::lion}) {
    for (int stage = 0; stage <= 3; ++stage) {
      mt::core_spec s;
      s.optimizer = opt;
      s.stage = stage;
      s.offload = stage > 0;
      CHECK(std::find(cores.begin(), cores.end(), s) != cores.end());
    }
  }

  // A failed initialize leaves the model alone: the same tensors, not re-pointed (to the
  // core's flat buffer or to a copy), not cast to bf16, not a bit changed.
  const std::vector<Tensor> after = model->parameters();
  REQUIRE(after.size() == params.size());
  for (std::size_t i = 0; i < after.size(); ++i) {
    INFO("parameter " << i);
    CHECK(after[i].unsafeGetTensorImpl() == impls[i]);
    CHECK(after[i].data_ptr() == storage[i]);
    REQUIRE(after[i].scalar_type() == torch::kFloat);
    CHECK(torch::equal(after[i].detach().view(torch::kInt32), bits[i]));
    CHECK(after[i].requires_grad());
  }
  // No hook of the engine's acts on them: a plain backward fills .grad() exactly as on an
  // untouched copy of the model.
  Net plain(1);
  const batch b = data(0, R(), 19);
  model->forward(b.x, b.y).backward();
  plain->forward(b.x, b.y).backward();
  const std::vector<Tensor> want = plain->parameters();
  for (std::size_t i = 0; i < after.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(after[i].grad().defined());
    CHECK(torch::equal(after[i].grad(), want[i].grad()));
  }
}

TEST_CASE("torch: JSON text, a file path and a parsed config all initialize", "[torch]") {
  const std::string text = make_config(1, "bf16").dump();
  auto a = mt::initialize(Net(2), text, world());
  const std::string path = "mpzero_test_torch_config_" + std::to_string(R()) + ".json";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    REQUIRE(f != nullptr);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  auto b = mt::initialize(Net(2), path, world());
  std::remove(path.c_str());
  auto c = mt::initialize(Net(2), mt::parse_config_text(text, W()), world());
  CHECK(a.describe() == b.describe());
  CHECK(b.describe() == c.describe());
  CHECK(a.describe().find("param bf16") != std::string::npos);
  CHECK(a.parameters()[0].scalar_type() == torch::kBFloat16);
}

TEST_CASE("torch: fp32 inputs to a bf16 engine's forward are explained: what to cast", "[torch]") {
  torch::manual_seed(5);
  auto e = mt::initialize(torch::nn::Linear(4, 2), make_config(2, "bf16"), world());
  CHECK_THROWS_WITH(e.forward(torch::randn({3, 4})),
                    Catch::Contains("the model's forward failed") &&
                        Catch::Contains("parameters are BFloat16 and an input is Float") &&
                        Catch::Contains("cast floating inputs to BFloat16"));
  // Cast, it runs; the failed forward left nothing behind.
  CHECK(e.forward(torch::randn({3, 4}).to(torch::kBFloat16)).sizes().vec() == std::vector<std::int64_t>{3, 2});
  // Another error keeps LibTorch's own message.
  CHECK_THROWS_WITH(e.forward(torch::randn({3, 5}).to(torch::kBFloat16)), !Catch::Contains("cast floating inputs"));
}

TEST_CASE("torch: an optimizer given in code trains as the same section in the config", "[torch]") {
  const int stage = GENERATE(0, 2);
  INFO(label(stage, "fp32"));
  json params = {{"lr", 0.05}, {"momentum", 0.9}};
  const json with = make_config(stage, "fp32", 1, {{"optimizer", {{"type", "SGD"}, {"params", params}}}});
  json without = with;
  without.erase("optimizer");
  mt::optimizer_config sgd;
  sgd.type = mt::optimizer_type::sgd;
  sgd.lr = 0.05;
  sgd.momentum = 0.9;
  auto a = make_engine(Net(3), with);
  auto b = mt::initialize(Net(3), without, sgd, world());
  auto c = mt::initialize(Net(3), without.dump(), sgd, world());  // JSON text
  CHECK(b.config().optimizer_given);
  CHECK(b.config().notices.empty());
  for (int it = 0; it < 3; ++it) {
    for (auto* e : {&a, &b, &c}) {
      const batch d = data(it, R(), 5);
      e->forward(d.x, d.y).backward();
      e->step();
    }
  }
  for (std::size_t i = 0; i < a.master_weights().size(); ++i) {
    REQUIRE(torch::equal(a.master_weights()[i], b.master_weights()[i]));
    REQUIRE(torch::equal(a.master_weights()[i], c.master_weights()[i]));
  }
  // In both places: refused, on every rank, before anything changes.
  CHECK_THROWS_WITH(mt::initialize(Net(3), with, sgd, world()), Catch::Contains("keep one"));
}

// A Net with a frozen integer parameter (an index table), which must keep its dtype.
struct IndexedNetImpl : NetImpl {
  Tensor idx;
  explicit IndexedNetImpl(std::uint64_t seed) : NetImpl(seed) {
    idx = register_parameter("idx", torch::arange(1000, 1004, torch::kLong), /*requires_grad=*/false);
  }
};
TORCH_MODULE(IndexedNet);

// A Net with a frozen floating parameter and a floating buffer, initialised from `seed`.
struct StatefulNetImpl : NetImpl {
  Tensor scale, running;
  explicit StatefulNetImpl(std::uint64_t seed, torch::Device buffer_device = torch::kCPU) : NetImpl(seed) {
    scale = register_parameter("scale", torch::randn({2}), /*requires_grad=*/false);
    running = register_buffer("running", torch::randn({3}).to(buffer_device));
  }
};
TORCH_MODULE(StatefulNet);

TEST_CASE("torch: every rank starts from rank 0's values, through a host window smaller than the model", "[torch]") {
  // Each rank builds its own values (seed 80 + rank); the engine gives every rank rank
  // 0's: trainable parameters, the frozen floating one and the buffer, in the parameter
  // dtype. The window (6 elements) is smaller than a weight (16, loaded whole) and
  // spans several small tensors (biases of 4, the frozen 2, the buffer 3).
  const auto prec = GENERATE(as<std::string>{}, "fp32", "bf16");
  const auto dt = prec == "bf16" ? torch::kBFloat16 : torch::kFloat;
  const std::uint64_t window = GENERATE(std::uint64_t{6}, std::uint64_t{16} << 20);
  CAPTURE(prec, window);
  const std::uint64_t before = mt::detail::set_startup_window_elements(window);
  StatefulNet model(80 + static_cast<std::uint64_t>(R()));
  StatefulNet rank0(80);
  auto e = make_engine(model, make_config(2, prec));
  mt::detail::set_startup_window_elements(before);
  const auto got = model->named_parameters();
  const auto want = rank0->named_parameters();
  for (const auto& item : want) {
    CAPTURE(item.key());
    CHECK(got[item.key()].scalar_type() == dt);
    CHECK(torch::equal(got[item.key()].detach(), item.value().detach().to(dt)));
  }
  CHECK(model->running.scalar_type() == dt);
  CHECK(torch::equal(model->running, rank0->running.to(dt)));
  // And training from there matches a reference that starts from rank 0's values.
  reference<Net> ref(Net(80), dt, 2);
  const batch b = data(0, R(), 81);
  e(b.x.to(dt), b.y).backward();
  ref.accumulate([&](Net& m, int r) {
    const batch d = data(0, r, 81);
    return m->forward(d.x.to(dt), d.y);
  }, 1.0);
  check_grads(e, ref.grads(), dt, "from rank 0's values");
  CHECK_THROWS_WITH(mt::detail::set_startup_window_elements(0), Catch::Contains("at least one element"));
}

TEST_CASE("torch: bad uses are refused by name, changing nothing", "[torch]") {
  const batch b = data(0, R(), 31);
  SECTION("a model another live engine manages; once that engine is gone, a new one trains it") {
    Net model(61);
    {
      auto first = make_engine(model, make_config(1, "fp32"));
      CHECK_THROWS_WITH(make_engine(model, make_config(2, "fp32")),
                        Catch::Contains("parameter 'l1.weight' is already managed by another mpzero engine") &&
                            Catch::Contains("destroy that engine first"));
      const Tensor before = model->l1->weight.detach().clone();
      first(b.x, b.y).backward();  // the refused engine took nothing from the first
      first.step();
      CHECK_FALSE(torch::equal(model->l1->weight.detach(), before));
    }
    auto second = make_engine(model, make_config(2, "fp32"));
    const Tensor before = model->l1->weight.detach().clone();
    second(b.x, b.y).backward();
    second.step();
    CHECK_FALSE(torch::equal(model->l1->weight.detach(), before));
  }
  SECTION("engine.step() at a boundary with no backward since the last step, on every rank") {
    auto e = make_engine(Net(62), make_config(2, "bf16"));
    CHECK_THROWS_WITH(e.step(), Catch::Contains("engine.step(): no backward reached this engine's parameters") &&
                                    Catch::Contains("micro-step 0"));
    CHECK(e.global_steps() == 0);
    e(b.x.to(torch::kBFloat16), b.y).backward();
    e.step();
    CHECK(e.global_steps() == 1);
    CHECK_THROWS_WITH(e.step(), Catch::Contains("micro-step 1"));
  }
  SECTION("a backward on one rank only reaches the engine (ZeRO-2): the others join its reductions at step()") {
    auto e = make_engine(Net(63), make_config(2, "fp32"));
    reference<Net> ref(Net(63), torch::kFloat, 2);
    if (R() == 0) e(b.x, b.y).backward();
    // The reference: rank 0's gradients, averaged over all ranks (the others add zeros).
    ref.accumulate([&](Net& m, int r) {
      const batch d = data(0, 0, 31);  // rank 0's batch
      return r == 0 ? m->forward(d.x, d.y) : m->forward(d.x, d.y) * 0.0;
    }, 1.0);
    check_grads(e, ref.grads(), torch::kFloat, "one rank's backward");
    e.step();
    ref.step();
    check_weights(e, ref.weights(), "one rank's backward");
  }
  SECTION("a model with no trainable parameters") {
    Net frozen(64);
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
    CHECK_THROWS_WITH(make_engine(frozen, make_config(1, "fp32")),
                      Catch::Contains("no trainable parameters (4 parameter(s), none with requires_grad)"));
  }
  SECTION("a frozen integer parameter keeps its dtype and values") {
    IndexedNet m(65);
    auto e = make_engine(m, make_config(1, "bf16"));
    CHECK(m->idx.scalar_type() == torch::kLong);
    CHECK(torch::equal(m->idx, torch::arange(1000, 1004, torch::kLong)));  // 1001 and 1003 are not bf16 values
    CHECK(m->l1->weight.scalar_type() == torch::kBFloat16);
    // Not broadcast, so every rank must hold the same values: another table on one rank is refused.
    if (W() > 1) {
      IndexedNet other(65);
      if (R() == 1) other->idx.add_(1);
      CHECK_THROWS_WITH(make_engine(other, make_config(1, "bf16")),
                        Catch::Contains("the ranks passed different models or configurations"));
    }
  }
  SECTION("fp16: engine.backward of engine.scale()'s result would scale twice") {
    auto e = make_engine(Net(66), make_config(1, "fp16"));
    const Tensor loss = e(b.x.to(torch::kHalf), b.y);
    CHECK_THROWS_WITH(e.backward(e.scale(loss)), Catch::Contains("scaled twice") &&
                                                     Catch::Contains("pass the unscaled loss"));
    e.backward(loss);  // the refused call changed nothing
    e.step();
    CHECK(e.global_steps() == 1);
  }
  SECTION("ranks that pass different models or configurations are refused on every rank") {
    if (W() > 1) {
      // A rank-dependent configuration (another stage on rank 1).
      CHECK_THROWS_WITH(make_engine(Net(68), make_config(R() == 1 ? 2 : 1, "fp32")),
                        Catch::Contains("engine.initialize: the ranks passed different models or configurations") &&
                            Catch::Contains("pass the same on every rank"));
      // A rank-dependent model (one more frozen parameter on rank 1: one fewer trainable).
      Net m(69);
      if (R() == 1) m->l1->bias.requires_grad_(false);
      CHECK_THROWS_WITH(make_engine(m, make_config(1, "fp32")),
                        Catch::Contains("the ranks passed different models or configurations") &&
                            Catch::Contains(R() == 1 ? "3 trainable parameters" : "4 trainable parameters"));
      // A rank-dependent learning rate (the replicas would step apart), then clipping:
      // each is named on its rank's side.
      CHECK_THROWS_WITH(make_engine(Net(68), make_config(1, "fp32", 1, {{"optimizer", {{"params", {{"lr", R() == 1 ? 2e-3 : 1e-3}}}}}})),
                        Catch::Contains("different models or configurations") &&
                            Catch::Contains(R() == 1 ? "lr 0.002" : "lr 0.001"));
      CHECK_THROWS_WITH(make_engine(Net(68), make_config(2, "bf16", 1, {{"gradient_clipping", R() == 1 ? 0.5 : 1.0}})),
                        Catch::Contains("different models or configurations") &&
                            Catch::Contains(R() == 1 ? "gradient_clipping 0.5" : "gradient_clipping 1"));
    }
    // The same everywhere passes.
    CHECK_NOTHROW(make_engine(Net(70), make_config(1, "fp32")));
  }
  SECTION("a rank that fails its own checks at initialize makes every rank throw, none waits") {
    if (W() > 1) {
      const std::string other = "engine.initialize: rank 1 of " + std::to_string(W()) + " failed";
      // Its model: every parameter frozen on rank 1 only.
      Net m(71);
      const Tensor before = m->l1->weight.detach().clone();
      if (R() == 1)
        for (auto& p : m->parameters()) p.requires_grad_(false);
      CHECK_THROWS_WITH(make_engine(m, make_config(1, "fp32")),
                        Catch::Contains(R() == 1 ? "no trainable parameters" : other));
      // Its configuration: one rank's JSON fails to parse, or its config file is missing.
      CHECK_THROWS_WITH(make_engine(Net(72), make_config(1, "fp32", 1, R() == 1 ? json{{"zero_optimization", {{"stage", "two"}}}} : json::object())),
                        Catch::Contains(R() == 1 ? "zero_optimization.stage" : other));
      const std::string cfg = R() == 1 ? std::string("/nonexistent/ds_config.json") : make_config(1, "fp32").dump();
      CHECK_THROWS_WITH(mt::initialize(Net(73), cfg, world()),
                        Catch::Contains(R() == 1 ? "/nonexistent/ds_config.json" : other));
      // Its buffer has no data (on the meta device): nothing to broadcast or receive.
      StatefulNet s(74, R() == 1 ? torch::kMeta : torch::kCPU);
      CHECK_THROWS_WITH(make_engine(s, make_config(1, "bf16")),
                        Catch::Contains(R() == 1 ? "buffer 'running' is on meta" : other));
      CHECK(s->l1->weight.scalar_type() == torch::kFloat);
      // No rank changed the model, and the next initialize works everywhere.
      if (R() == 1)
        for (auto& p : m->parameters()) p.requires_grad_(true);
      CHECK(torch::equal(m->l1->weight.detach(), before));
      CHECK(m->l1->weight.scalar_type() == torch::kFloat);
      auto e = make_engine(m, make_config(1, "fp32"));
      const batch b = data(0, R(), 16);
      e(b.x, b.y).backward();
      e.step();
      CHECK(e.global_steps() == 1);
    }
  }
  SECTION("an undefined tensor where a parameter is expected") {
    auto e = make_engine(Net(67), make_config(1, "fp32"));
    CHECK_THROWS_WITH(e.full_grad(Tensor()), Catch::Contains("full_grad: the tensor is undefined"));
  }
}

TEST_CASE("torch: the model keeps working after its engine is gone", "[torch]") {
  Net model(4);
  Tensor before;
  {
    auto e = make_engine(model, make_config(2, "fp32"));
    const batch b = data(0, R(), 16);
    e(b.x, b.y).backward();
    e.step();
    before = model->l1->weight.detach().clone();
  }
  // The parameters own their storage again (not the freed flat buffer), and plain
  // autograd fills .grad as usual (the hooks find no engine).
  CHECK(torch::equal(model->l1->weight.detach(), before));
  const batch b = data(1, R(), 16);
  model->forward(b.x, b.y).backward();
  CHECK(model->l1->weight.grad().defined());
}

TEST_CASE("torch: torch_autocast runs the engine's forward under LibTorch autocast", "[torch]") {
  json extra = {{"torch_autocast", {{"enabled", true}, {"dtype", "bfloat16"}}}};
  auto engine = make_engine(Net(6), make_config(1, "fp32", 1, extra));
  const batch b = data(0, R(), 17);
  CHECK(engine(b.x).scalar_type() == torch::kBFloat16);           // Linear ran in bf16
  CHECK(engine.module()->forward(b.x).scalar_type() == torch::kFloat);  // outside the engine: no autocast
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  engine(b.x, b.y).backward();
  CHECK(engine.epilogues() == 1);
  engine.step();
}


TEST_CASE("torch: a c10d ProcessGroup as the communicator", "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  INFO(label(stage, "bf16") << ", c10d");
  auto pg = mpi_process_group(MPI_COMM_WORLD);
  // Rank 0's initial values win: give the other ranks a different seed.
  auto engine = mt::initialize(Net(R() == 0 ? 41 : 99), make_config(stage, "bf16"), mt::process_group_communicator(pg));
  CHECK(engine.world_size() == W());
  reference<Net> ref(Net(41), torch::kBFloat16, stage);
  for (int it = 0; it < 2; ++it) {
    const batch b = data(it, R(), 18);
    engine(b.x.to(torch::kBFloat16), b.y).backward();
    ref.accumulate([&](Net& m, int r) { auto d = data(it, r, 18); return m->forward(d.x.to(torch::kBFloat16), d.y); }, 1.0);
    check_grads(engine, ref.grads(), torch::kBFloat16, "c10d");
    engine.step();
    ref.step();
    check_weights(engine, ref.weights(), "c10d");
  }
}

namespace {
// A backend whose allreduce never completes (a peer that never comes), recording what
// the communicator does with it: no abort (only NCCL groups are aborted), no wait that
// would block, and where the data it was handed lives.
struct stuck_work : c10d::Work {
  bool isCompleted() override { return false; }
  bool wait(std::chrono::milliseconds) override {
    waited = true;
    return false;
  }
  static inline bool waited = false;
};
struct stuck_backend : c10d::Backend {
  stuck_backend() : Backend(0, 1) {}
  const std::string getBackendName() const override { return "test-stuck"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions&) override {
    ++posted;
    handed.push_back(ts[0].data_ptr());
    return c10::make_intrusive<stuck_work>();
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions&) override {
    ++posted;
    handed.push_back(ts[0].data_ptr());
    return c10::make_intrusive<stuck_work>();
  }
  void abort() override { aborted = true; }
  int posted = 0;
  bool aborted = false;
  std::vector<const void*> handed;
};
}  // namespace

TEST_CASE("torch: a c10d call that never completes throws comm_error at MPZERO_COMM_TIMEOUT_S, not a hang", "[torch]") {
  auto backend = c10::make_intrusive<stuck_backend>();
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(0, 1);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  ::setenv("MPZERO_COMM_TIMEOUT_S", "2e9", 1);  // read when the communicator is made: a bad value is refused there
  CHECK_THROWS_WITH(mt::process_group_communicator(pg), Catch::Contains("'2e9' is not a positive number of seconds"));
  ::setenv("MPZERO_COMM_TIMEOUT_S", "0.3", 1);
  const auto c = mt::process_group_communicator(pg);
  ::unsetenv("MPZERO_COMM_TIMEOUT_S");
  stuck_work::waited = false;
  std::vector<float> v(8, 1.0f), w(8, 2.0f);
  std::string msg;
  const auto start = std::chrono::steady_clock::now();
  {
    auto r = c.base().iall_reduce(v.data(), v.data(), v.size(), mt::wire_dtype::f32, mpzero::comm::reduce_op::sum);
    auto other = c.base().iall_reduce(w.data(), w.data(), w.size(), mt::wire_dtype::f32, mpzero::comm::reduce_op::sum);
    auto from_to = c.base().iall_reduce(v.data(), w.data(), v.size(), mt::wire_dtype::f32, mpzero::comm::reduce_op::sum);
    auto bcast = c.base().ibroadcast(w.data(), w.size(), mt::wire_dtype::f32, 0);
    CHECK_FALSE(r->test());
    try {
      r->wait();
    } catch (const mpzero::comm::comm_error& e) {
      msg = e.what();
    }
    // The other request of the aborted group says so; neither destructor blocks.
    CHECK_THROWS_WITH(other->test(), Catch::Contains("unusable"));
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(msg);
  CHECK_THAT(msg, Catch::Contains("ProcessGroup allreduce timed out on rank 0 of 1") &&
                      Catch::Contains("raise MPZERO_COMM_TIMEOUT_S") &&
                      Catch::Contains("abandoned (backend 'test-stuck' cannot abort it)"));
  CHECK(waited >= 0.3);
  CHECK(waited < 30);
  CHECK_FALSE(backend->aborted);  // aborting is for NCCL: Gloo cannot, and MPI's would hang
  // The abandoned calls hold buffers of their own, not views of v and w, which a late
  // peer could otherwise write after they are freed: in place, from one to the other,
  // and a broadcast.
  REQUIRE(backend->handed.size() == 4);
  for (const void* p : backend->handed) {
    CHECK(p != static_cast<const void*>(v.data()));
    CHECK(p != static_cast<const void*>(w.data()));
  }
  CHECK_FALSE(stuck_work::waited);
  // Nothing more is posted on the aborted group.
  CHECK_THROWS_WITH(c.base().barrier(), Catch::Contains("barrier") && Catch::Contains("refused"));
  CHECK_THROWS_AS(c.base().iall_reduce(v.data(), v.data(), v.size(), mt::wire_dtype::f32, mpzero::comm::reduce_op::sum),
                  mpzero::comm::comm_error);
  CHECK(backend->posted == 4);
}

namespace {
// A host communicator that says it is bound to CUDA device 1 (as nccl_communicator does
// through device()): enough to check the engine's device rule without a GPU.
struct on_device_1 : mpzero::comm::local_communicator {
  int device() const { return 1; }
};
}  // namespace

TEST_CASE("torch: a communicator bound to another CUDA device than the parameters' is refused by name", "[torch]") {
  const auto bound = mt::any_communicator::own(on_device_1{}, "nccl-on-1");
  CHECK(bound.base().cuda_device() == 1);
  CHECK(mt::any_communicator{}.base().cuda_device() == -1);  // the default local one: tied to no device
  CHECK_NOTHROW(mt::detail::require_communicator_device(bound.base(), 1));
  CHECK_NOTHROW(mt::detail::require_communicator_device(mt::any_communicator{}.base(), 0));
  CHECK_THROWS_WITH(mt::detail::require_communicator_device(bound.base(), 0),
                    Catch::Contains("parameters are on CUDA device 0") &&
                        Catch::Contains("communicator 'nccl-on-1' works on CUDA device 1") &&
                        Catch::Contains("cudaSetDevice(0)"));
  // A c10d group on the CPU is tied to no CUDA device.
  auto pg = mpi_process_group(MPI_COMM_WORLD);
  CHECK(mt::process_group_communicator(pg).base().cuda_device() == -1);
}

// Shared by the LibTorch engine tests (test_torch.cpp, test_torch_wire.cpp): the pieces
// of their plain-LibTorch references (model layers, data, the fp32 master update,
// tolerances) and the configuration they start from. Nothing here calls the engine, so
// the references stay independent of the code under test. Include after torch_mpi.hpp.
#pragma once

#include "torch_mpi.hpp"  // LibTorch, then Catch and MPI

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// Inside mpzero::, `torch` names mpzero::torch: LibTorch is spelled ::torch here.
namespace mpzero::testing {

namespace mt = mpzero::torch;
using ::torch::Tensor;
using json = nlohmann::json;

// ---- models and data ------------------------------------------------------------------

// Two Linear(4, 4) layers, "l1" and "l2", initialised from `seed` (every rank builds the
// same values); each test gives them its own forward.
struct two_linear : ::torch::nn::Module {
  ::torch::nn::Linear l1{nullptr}, l2{nullptr};
  explicit two_linear(std::uint64_t seed) {
    ::torch::manual_seed(seed);
    l1 = register_module("l1", ::torch::nn::Linear(4, 4));
    l2 = register_module("l2", ::torch::nn::Linear(4, 4));
  }
};

struct batch {
  Tensor x, y;
};
// 8 samples of 4 normal features and `out_features` normal targets, from a generator of
// its own seeded with `seed` (the global generator is left alone).
inline batch random_batch(std::uint64_t seed, std::int64_t out_features = 4) {
  auto g = at::detail::createCPUGenerator(seed);
  return {::torch::randn({8, 4}, g), ::torch::randn({8, out_features}, g)};
}

// ---- the reference optimizer: fp32 master weights updated by torch::optim ------------------

// Detached fp32 leaf copies of `params` (taken before a model is cast to its compute dtype).
inline std::vector<Tensor> fp32_masters(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().to(::torch::kFloat).clone().set_requires_grad(true));
  return out;
}

// The square root of each element of an fp32 tensor, correctly rounded as IEEE 754
// requires and as the fused step computes it. LibTorch's CPU sqrt goes through MKL's
// vector math, which is correctly rounded on some CPUs and within one ulp on others (an
// AMD EPYC gives 0x1.1a473ep-7 for the square root of 0x1.374106p-14, where IEEE gives
// 0x1.1a473cp-7), so a bit-exact reference cannot use it.
inline Tensor ieee_sqrt(const Tensor& x) {
  Tensor out = x.to(::torch::kFloat).contiguous().clone();
  float* p = out.data_ptr<float>();
  for (std::int64_t i = 0; i < out.numel(); ++i) p[i] = std::sqrt(p[i]);
  return out;
}

inline void set_learning_rate(::torch::optim::Optimizer& opt, double lr) {
  for (auto& g : opt.param_groups()) g.options().set_lr(lr);
}

// One reference update: `opt` steps the masters with `grads`, then each model parameter
// takes its master's value (rounded to the parameter's dtype).
inline void master_step(::torch::optim::Optimizer& opt, const std::vector<Tensor>& master,
                        const std::vector<Tensor>& grads, const std::vector<Tensor>& params) {
  for (std::size_t i = 0; i < master.size(); ++i) master[i].mutable_grad() = grads[i];
  opt.step();
  ::torch::NoGradGuard ng;
  for (std::size_t i = 0; i < params.size(); ++i) params[i].copy_(master[i]);
}

// ---- comparisons ------------------------------------------------------------------------------

struct tol {
  double rtol, atol_rel;  // |got - want| <= atol_rel * max|want| + rtol * |want|
};
inline tol grad_tol(at::ScalarType dt) {
  if (dt == ::torch::kBFloat16) return {2e-2, 2e-2};
  if (dt == ::torch::kHalf) return {4e-3, 4e-3};
  return {1e-5, 1e-6};
}
// "The parameter tolerance of fp32" (torch.testing's for float32: rtol 1.3e-6, atol 1e-5).
constexpr tol param_tol{1.3e-6, 0.0};
constexpr double param_atol = 1e-5;

// |got - want| <= atol_abs + t.atol_rel * max|want| + t.rtol * |want|, element by element.
inline void check_close(const Tensor& got, const Tensor& want, tol t, double atol_abs, const std::string& what) {
  REQUIRE(got.sizes() == want.sizes());
  if (want.numel() == 0) return;
  const Tensor g = got.to(::torch::kDouble), w = want.to(::torch::kDouble);
  const double scale = w.abs().max().item<double>();
  const double atol = atol_abs + t.atol_rel * scale;
  const Tensor excess = (g - w).abs() - (atol + t.rtol * w.abs());
  INFO(what << " on rank " << R() << ": max |got - want| = " << (g - w).abs().max().item<double>()
            << ", max |want| = " << scale << "\n got  " << g.flatten() << "\n want " << w.flatten());
  CHECK(excess.max().item<double>() <= 0.0);
}

// ---- configs ----------------------------------------------------------------------------------

// What every engine test's configuration starts from: micro-batches of 8, `gas` of them
// per step, Adam at `lr`, no gradient clipping, ZeRO `stage`; `extra` merged on top
// (a JSON merge patch).
inline json engine_config(int stage, int gas, double lr, const json& extra = json::object()) {
  json j = {{"train_micro_batch_size_per_gpu", 8},
            {"gradient_accumulation_steps", gas},
            {"optimizer", {{"type", "Adam"}, {"params", {{"lr", lr}}}}},
            {"gradient_clipping", 0.0},
            {"zero_optimization", {{"stage", stage}}}};
  j.merge_patch(extra);
  return j;
}

}  // namespace mpzero::testing

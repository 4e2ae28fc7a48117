// The LibTorch engine's training step on CPU parameters, per precision configuration:
// engine.forward, engine.backward(loss) (the hooks reduce each gradient into the engine's flat
// buffer) and engine.step() (gradient statistics, the fused step, the parameters'
// refresh), on a model whose own arithmetic is one product and one sum per element, so
// that what is timed is mostly the engine. It runs the code the engine's tables compile
// (adapters/torch/src: the rows, and the host loops of host_kernels.cpp), which
// mpzero_bench_host does not: that one calls the core's fused step directly.
//
//   mpzero_bench_engine [--benchmark_filter=...] [Google Benchmark flags]
//
// Names: <precision>/z<stage>[+off]/<elements>, the precisions as the main job names
// them (examples/gpt/precision_config.hpp); world size 1, AdamW, 4 parameters. And
// zero3_watch/{unit,outside}: what ZeRO-3's watch of parameters used outside every
// gathered_forward unit costs a pass of many small operations.
#include <mpzero/torch/engine.hpp>

#include <ATen/ops/_fused_adamw.h>
#include <torch/cuda.h>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../examples/gpt/precision_config.hpp"
#include "bench_common.hpp"

namespace {

// sum_k (w_k * c_k).sum(): the gradient of w_k is c_k, a fresh tensor every backward, as
// a real model's are.
struct ProductsImpl : torch::nn::Module {
  explicit ProductsImpl(std::int64_t n) {
    torch::manual_seed(7);
    for (int k = 0; k < 4; ++k) {
      std::string name = "w";  // (not "w" + to_string(k): GCC 12 warns of a memcpy overlap there)
      name += std::to_string(k);
      w.push_back(register_parameter(name, torch::randn({n / 4}) * 0.02));
      c.push_back(torch::randn({n / 4}) * 1e-3);
    }
  }
  torch::Tensor forward() {
    torch::Tensor loss = torch::zeros({}, torch::kFloat);
    for (std::size_t k = 0; k < w.size(); ++k) loss = loss + (w[k] * c[k].to(w[k].scalar_type())).sum().to(torch::kFloat);
    return loss;
  }
  std::vector<torch::Tensor> w, c;
};
TORCH_MODULE(Products);

void BM_engine_step(benchmark::State& state, std::string precision, int stage, bool offload, std::int64_t n) {
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 1},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"weight_decay", 0.01}}}}},
                        {"zero_optimization", {{"stage", stage}}}};
  if (offload) cfg["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  mpzero_gpt::set_precision(cfg, precision, {{"enabled", true}, {"initial_scale_power", 8}});
  auto engine = mpzero::torch::initialize(Products(n), cfg);
  auto one = [&] {
    engine.backward(engine());  // fp16 needs the loss scale (engine.backward applies it); the others as loss.backward()
    engine.step();
  };
  one();  // warm-up: the first step allocates the states
  for (auto _ : state) one();
  state.SetItemsProcessed(state.iterations() * n);
  state.counters["skipped"] = static_cast<double>(engine.skipped_steps());
  state.SetLabel(engine.describe());
}

// ZeRO-3's watch of the operations (docs/torch.md, ZeRO-3): one partitioned Linear and
// `ops` small multiplies after it, the Linear run through gathered_forward (nothing is
// outside a unit: no watch) or not (the engine watches every operation of the pass).
// The two gather the same parameter once per forward and once per backward.
struct ChainImpl : torch::nn::Module {
  ChainImpl(bool unit, int ops) : unit(unit), ops(ops) {
    torch::manual_seed(7);
    lin = register_module("lin", torch::nn::Linear(64, 64));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = unit ? mpzero::torch::gathered_forward(lin, x) : lin(x);
    for (int k = 0; k < ops; ++k) h = h * 0.999f;
    return h.sum();
  }
  bool unit;
  int ops;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Chain);

void BM_zero3_watch(benchmark::State& state, bool unit) {
  const int ops = 256;
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 1},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                        {"zero_optimization", {{"stage", 3}, {"stage3_param_persistence_threshold", 0}}}};
  auto engine = mpzero::torch::initialize(Chain(unit, ops), cfg);
  const torch::Tensor x = torch::randn({4, 64});
  auto one = [&] {
    engine(x).backward();
    engine.step();
  };
  one();
  for (auto _ : state) one();
  state.counters["multiplies"] = ops;  // each also runs once in backward
}

// The engine's overhead on a model whose compute matters: an MLP of `layers` square
// Linear layers of width `width` (ReLU between), a batch of 32 rows, mean-squared loss.
// "plain" is LibTorch alone: forward, loss.backward() and LibTorch's fused AdamW
// (at::_fused_adamw_, one call over every parameter), gradients set to None after each
// step; "engine" is the same model and batch through the engine at ZeRO stage 0, fp32,
// world size 1 (the hooks take each gradient, the step runs mpzero's fused AdamW, the
// parameters are views of its buffer). Both use LibTorch's intra-op threads. On a CUDA
// device (the ".../cuda" rows, registered when LibTorch sees one) both synchronize the
// device at the end of each step, so that a step's time is its GPU work and launches.
struct MlpImpl : torch::nn::Module {
  MlpImpl(std::int64_t width, int layers) {
    torch::manual_seed(7);
    for (int k = 0; k < layers; ++k) {
      std::string name = "l";
      name += std::to_string(k);
      lins.push_back(register_module(name, torch::nn::Linear(width, width)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t k = 0; k < lins.size(); ++k) {
      x = lins[k](x);
      if (k + 1 < lins.size()) x = torch::relu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> lins;
};
TORCH_MODULE(Mlp);

constexpr double kLr = 1e-4, kBeta1 = 0.9, kBeta2 = 0.999, kWd = 0.01, kEps = 1e-8;

void BM_overhead(benchmark::State& state, bool engine_side, std::int64_t width, int layers, torch::Device device) {
  const torch::Tensor x = torch::randn({32, width}).to(device), y = torch::randn({32, width}).to(device);
  Mlp model(width, layers);
  model->to(device);
  const auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  std::int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  if (engine_side) {
    nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 32},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", kLr}, {"betas", {kBeta1, kBeta2}},
                                                                        {"eps", kEps}, {"weight_decay", kWd}}}}},
                          {"zero_optimization", {{"stage", 0}}}};
    auto engine = mpzero::torch::initialize(model, cfg);
    auto one = [&] {
      torch::mse_loss(engine(x), y).backward();
      engine.step();
      sync();
    };
    one();
    for (auto _ : state) one();
    state.SetLabel(engine.describe());
  } else {
    std::vector<torch::Tensor> p = model->parameters(), m, v, steps;
    for (const auto& t : p) {
      m.push_back(torch::zeros_like(t));
      v.push_back(torch::zeros_like(t));
      steps.push_back(torch::zeros({}, t.options().dtype(torch::kFloat)));  // the fused kernel's device
    }
    auto one = [&] {
      torch::mse_loss(model->forward(x), y).backward();
      std::vector<torch::Tensor> g;
      for (const auto& t : p) g.push_back(t.grad());
      {
        torch::NoGradGuard ng;
        for (auto& s : steps) s.add_(1);
        at::_fused_adamw_(p, g, m, v, {}, steps, kLr, kBeta1, kBeta2, kWd, kEps, /*amsgrad=*/false, /*maximize=*/false);
      }
      for (auto& t : p) t.mutable_grad().reset();
      sync();
    };
    one();
    for (auto _ : state) one();
    state.SetLabel("LibTorch, at::_fused_adamw_");
  }
  state.counters["params"] = static_cast<double>(params);
}

void register_benchmarks() {
  for (const bool engine_side : {false, true}) {
    const std::string name = std::string("overhead/") + (engine_side ? "engine" : "plain") + "/mlp_2048x8";
    benchmark::RegisterBenchmark(name.c_str(), BM_overhead, engine_side, std::int64_t{2048}, 8, torch::Device(torch::kCPU))
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  // On a GPU, a model where the step matters: 8 x Linear(4096, 4096), 134M parameters.
  if (torch::cuda::is_available()) {
    for (const bool engine_side : {false, true}) {
      const std::string name = std::string("overhead/") + (engine_side ? "engine" : "plain") + "/mlp_4096x8/cuda";
      benchmark::RegisterBenchmark(name.c_str(), BM_overhead, engine_side, std::int64_t{4096}, 8,
                                   torch::Device(torch::kCUDA))
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (const bool unit : {true, false}) {
    benchmark::RegisterBenchmark(unit ? "zero3_watch/unit" : "zero3_watch/outside", BM_zero3_watch, unit)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  struct row {
    const char* precision;
    int stage;
    bool offload;
  };
  const std::vector<row> rows = {{"fp32", 0, false},        {"bf16", 2, false},       {"bf16", 2, true},
                                 {"bf16-all", 2, false},    {"bf16-all-sr", 2, false}, {"fp16", 0, false},
                                 {"fp16-master", 2, false}};
  for (const std::int64_t n : {std::int64_t{1} << 20, std::int64_t{1} << 24}) {
    for (const row& r : rows) {
      const std::string name = std::string(r.precision) + "/z" + std::to_string(r.stage) + (r.offload ? "+off" : "") +
                               "/" + std::to_string(n);
      benchmark::RegisterBenchmark(name.c_str(), BM_engine_step, std::string(r.precision), r.stage, r.offload, n)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_benchmarks();
  mpzero_bench::add_host_context();  // threads, host SIMD, the flags this program was built with
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

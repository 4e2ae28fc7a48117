// A LibTorch consumer of mpzero's engine: a model trained with plain loss.backward() and
// engine.step() from a DeepSpeed-style JSON config. Built and run by the torch_find_package
// consumer test, compiled by the torch_add_subdirectory one; it sets no C++ standard or
// include path of its own, so it also proves that linking mpzero::torch carries C++20,
// the headers and LibTorch.
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <string>

#include <mpzero/torch/engine.hpp>

int main() {
  try {
    torch::manual_seed(0);
    auto model = torch::nn::Linear(4, 1);
    auto engine = mpzero::torch::initialize(model, R"({
      "train_batch_size": 16,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
      "zero_optimization": {"stage": 2}
    })");
    const auto x = torch::randn({16, 4});
    const auto y = x.matmul(torch::tensor({1.0f, -2.0f, 0.5f, 3.0f})).unsqueeze(1) + 0.25f;
    double first = 0, last = 0;
    for (int i = 0; i < 200; ++i) {
      auto loss = torch::mse_loss(engine.forward(x), y);
      loss.backward();  // hooks reduce and partition the gradients; the epilogue runs by itself
      engine.step();
      (i == 0 ? first : last) = loss.item<double>();
    }
    if (!(last < 0.01 * first) || engine.global_steps() != 200) {
      std::printf("mpzero consumer: the loss went from %.6f to %.6f in %llu steps (expected below 1%%)\n", first,
                  last, static_cast<unsigned long long>(engine.global_steps()));
      return 1;
    }
    std::printf("mpzero consumer: ok (%s; loss %.4f -> %.6f)\n", engine.describe().c_str(), first, last);
    return 0;
  } catch (const std::exception& e) {
    std::printf("mpzero consumer: %s\n", e.what());
    return 1;
  }
}

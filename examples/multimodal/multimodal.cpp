// Multimodal training with two engines, as in DeepSpeed's disaggregated hybrid
// parallelism: a vision encoder and a language decoder are separate engines (in the
// real setup, separate process groups); the decoder's plain loss.backward() yields the
// gradient of the encoder's output embeddings, which is handed to the encoder as
// encoder_out.backward(grad) -- a non-scalar backward. Both engines step.
//
// The example checks itself: the same two networks trained as one model in a single
// engine must end with the same weights (ZeRO stage 2, bf16, gradient accumulation 2;
// gradients are divided by the accumulation steps once, at each engine's parameters,
// so the hand-off between engines needs no care), and the loss on a held-out batch
// must fall. Exit status 0 when both hold.
//
//   ./multimodal                  one process
//   mpirun -np 2 ./multimodal     two: initialize joins the world mpirun launched (MPI), and
//                                 each rank trains on its own batches
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include <mpzero/torch/engine.hpp>

namespace mt = mpzero::torch;

// "Vision encoder": patches (B x 16) -> embeddings (B x 8).
struct EncoderImpl : torch::nn::Module {
  torch::nn::Linear proj{nullptr}, mix{nullptr};
  EncoderImpl() {
    proj = register_module("proj", torch::nn::Linear(16, 32));
    mix = register_module("mix", torch::nn::Linear(32, 8));
  }
  torch::Tensor forward(const torch::Tensor& patches) { return mix(torch::gelu(proj(patches))); }
};
TORCH_MODULE(Encoder);

// "Language decoder": embeddings (B x 8) + text features (B x 8) -> regression loss.
struct DecoderImpl : torch::nn::Module {
  torch::nn::Linear fuse{nullptr}, head{nullptr};
  DecoderImpl() {
    fuse = register_module("fuse", torch::nn::Linear(16, 32));
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& vision, const torch::Tensor& text, const torch::Tensor& target) {
    auto h = torch::gelu(fuse(torch::cat({vision, text}, 1)));
    return torch::mse_loss(head(h).to(torch::kFloat), target);
  }
};
TORCH_MODULE(Decoder);

// Both networks as one model: the baseline.
struct WholeImpl : torch::nn::Module {
  Encoder enc;
  Decoder dec;
  WholeImpl(Encoder e, Decoder d) : enc(register_module("enc", e)), dec(register_module("dec", d)) {}
  torch::Tensor forward(const torch::Tensor& patches, const torch::Tensor& text, const torch::Tensor& target) {
    return dec->forward(enc->forward(patches), text, target);
  }
};
TORCH_MODULE(Whole);

struct batch {
  torch::Tensor patches, text, target;
};
batch make_batch(int step, int rank) {
  auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 + step + 100000 * rank));
  return {torch::randn({32, 16}, g), torch::randn({32, 8}, g), torch::randn({32, 4}, g)};
}

int main() {
  const std::string config = R"({
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 256},
    "gradient_clipping": 0
  })";
  constexpr int micro_steps = 40;
  const auto bf16 = torch::kBFloat16;

  // Two engines, encoder and decoder; the baseline starts from the same weights.
  torch::manual_seed(0);
  Encoder enc_model;
  Decoder dec_model;
  torch::manual_seed(0);
  Encoder enc_copy;
  Decoder dec_copy;
  Whole whole_model(enc_copy, dec_copy);
  auto encoder = mt::initialize(enc_model, config);
  auto decoder = mt::initialize(dec_model, config);
  auto whole = mt::initialize(whole_model, config);

  // Learning is judged on one held-out batch, the same before and after training (the
  // training losses are of different random batches, too noisy to compare).
  const batch held_out = make_batch(-1000, 0);
  auto held_out_loss = [&] {
    torch::NoGradGuard no_grad;
    return dec_model->forward(enc_model->forward(held_out.patches.to(bf16)), held_out.text.to(bf16), held_out.target)
        .item<double>();
  };
  const double before = held_out_loss();
  double first = 0, last = 0;
  for (int k = 0; k < micro_steps; ++k) {
    const batch b = make_batch(k, encoder.rank());

    // Encoder side: forward, hand the embeddings over (detached, as across processes).
    torch::Tensor vision_out = encoder(b.patches.to(bf16));
    torch::Tensor vision_in = vision_out.detach().requires_grad_(true);
    // Decoder side: an ordinary loss.backward(); ZeRO runs in the hooks.
    torch::Tensor loss = decoder(vision_in, b.text.to(bf16), b.target);
    loss.backward();
    // The gradient of the embeddings goes back to the encoder: a non-scalar backward.
    vision_out.backward(vision_in.grad());
    encoder.step();
    decoder.step();

    // Baseline: one model, one backward.
    whole(b.patches.to(bf16), b.text.to(bf16), b.target).backward();
    whole.step();

    if (k == 0) first = loss.item<double>();
    last = loss.item<double>();
  }

  // Compare the master weights (fp32) of the split and the whole model, by name.
  auto by_name = [](mt::engine_base& e, const std::string& prefix) {
    std::map<std::string, torch::Tensor> m;
    auto w = e.master_weights();
    for (std::size_t i = 0; i < w.size(); ++i) m[prefix + e.parameter_names()[i]] = w[i];
    return m;
  };
  auto split = by_name(encoder, "enc.");
  split.merge(by_name(decoder, "dec."));
  auto base = by_name(whole, "");
  double worst = 0;
  for (const auto& [name, w] : base) {
    const double d = (split.at(name) - w).abs().max().item<double>();
    worst = std::max(worst, d);
  }
  const double after = held_out_loss();
  std::printf("multimodal: %d micro-steps (%llu optimizer steps per engine), training loss %.4f -> %.4f, "
              "held-out loss %.4f -> %.4f\n",
              micro_steps, static_cast<unsigned long long>(encoder.global_steps()), first, last, before, after);
  std::printf("max |split - whole| over all master weights: %.3g\n", worst);
  const bool ok = worst <= 1e-6 && after < before && encoder.global_steps() == micro_steps / 2;
  std::printf("%s (%d process%s)\n", ok ? "OK: two engines train exactly like one model" : "MISMATCH",
              encoder.world_size(), encoder.world_size() == 1 ? "" : "es");
  return ok ? 0 : 1;
}

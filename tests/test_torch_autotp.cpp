// AutoTP in the LibTorch engine under mpirun (2 ranks: TP 2 x DP 1; 4 ranks: TP 2 x DP 2):
// a transformer block with a GQA fused qkv and a fused gate_up MLP, split by the config's
// layer specs, trains as the unsplit block does on one process with the same global batch.
//
// The reference is plain LibTorch on every rank: the same module class, whole (its
// tp_forward calls are plain Linear forwards outside an AutoTP engine), each data-parallel
// replica's micro-batch gradient averaged, clipped to the global norm, and stepped by
// torch::optim::AdamW. The engine's master weights are slices; each rank's are gathered
// over its tensor-parallel group and put in place with the plan's own index runs, checked
// in test_autotp.cpp against indices worked out by hand. Tensor parallelism sums the
// row-parallel products in another order, so the comparison allows fp32 rounding.
#include "support/torch_mpi.hpp"  // LibTorch, then Catch and MPI
#include "support/shared_dir.hpp"
#include "support/torch_reference.hpp"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <mpzero/torch/autotp.hpp>
#include <mpzero/torch/zero_to_fp32.hpp>

using namespace mpzero::testing;  // mt, Tensor, json, world(), W(), R()

namespace {

// d 8, 4 query heads and 2 key/value heads of 2 dimensions (q 8 rows, k and v 4 each),
// MLP hidden 12 (gate and up stacked: 24 rows).
struct BlockImpl : torch::nn::Module {
  static constexpr std::int64_t d = 8, q_rows = 8, kv_rows = 4, head_dim = 2, hidden = 12;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, o{nullptr}, gate_up{nullptr}, down{nullptr};
  explicit BlockImpl(std::uint64_t seed) {
    torch::manual_seed(seed);
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, q_rows + 2 * kv_rows));
    o = register_module("o", torch::nn::Linear(q_rows, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    gate_up = register_module("gate_up", torch::nn::Linear(d, 2 * hidden));
    down = register_module("down", torch::nn::Linear(hidden, d));
  }
  Tensor forward(const Tensor& x) {  // [batch, tokens, d]
    const auto b = x.size(0), t = x.size(1);
    // This rank's rows of q, k and v: the split follows from the weight's shape.
    const std::int64_t rows = qkv->weight.size(0), share = q_rows + 2 * kv_rows;
    const std::int64_t q = q_rows * rows / share, kv = kv_rows * rows / share;
    const auto parts = mt::tp_forward(qkv, ln1(x)).split_with_sizes({q, kv, kv}, -1);
    const auto heads = [&](const Tensor& y) { return y.reshape({b, t, -1, head_dim}).transpose(1, 2); };
    const Tensor qh = heads(parts[0]);
    const std::int64_t group = qh.size(1) / (kv / head_dim);
    const Tensor kh = heads(parts[1]).repeat_interleave(group, 1), vh = heads(parts[2]).repeat_interleave(group, 1);
    const Tensor att = torch::softmax(qh.matmul(kh.transpose(-2, -1)) / std::sqrt(double(head_dim)), -1).matmul(vh);
    Tensor h = x + mt::tp_forward(o, att.transpose(1, 2).reshape({b, t, q}));
    const auto gu = mt::tp_forward(gate_up, ln2(h)).chunk(2, -1);
    return h + mt::tp_forward(down, torch::silu(gu[0]) * gu[1]);
  }
};
TORCH_MODULE(Block);

const json specs = json::array(
    {{{"patterns", {R"(qkv\.weight$)"}}, {"partition_type", "column"}, {"shape", {{8, 4, 4}, -1}}, {"partition_dim", 0}},
     {{"patterns", {R"(gate_up\.weight$)"}}, {"partition_type", "column"}, {"shape", {2, -1}}, {"partition_dim", 0}},
     {{"patterns", {R"((o|down)\.weight$)"}}, {"partition_type", "row"}}});

json tp_config(int stage, double clip, bool bf16 = false) {
  return engine_config(stage, 1, 1e-2,
                       {{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}, {"eps", 1e-3}}}}},
                        {"gradient_clipping", clip},
                        {"bf16", {{"enabled", bf16}}},
                        {"tensor_parallel", {{"autotp_size", 2}, {"partition_config", {{"layer_specs", specs}}}}}});
}

// Replica r's micro-batch k: 2 sequences of 3 tokens and their targets.
std::pair<Tensor, Tensor> batch_of(int k, int replica) {
  auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 * k + replica + 1));
  return {torch::randn({2, 3, 8}, g), torch::randn({2, 3, 8}, g)};
}

// The engine's master slices, gathered over each tensor-parallel group (collective) and
// put in place by the plan's index runs: the whole master weights.
std::vector<Tensor> whole_masters(mt::engine_base& engine, const std::vector<mt::tp_param_plan>& plan,
                                  const std::vector<std::vector<std::int64_t>>& shapes) {
  const int tp = engine.tensor_parallel_size();
  const auto got = engine.master_weights();
  MPI_Comm group;
  MPI_Comm_split(MPI_COMM_WORLD, R() / tp, R() % tp, &group);
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const Tensor mine = got[i].contiguous().reshape({-1});
    Tensor all = torch::empty({tp * mine.numel()});
    MPI_Allgather(mine.data_ptr<float>(), static_cast<int>(mine.numel()), MPI_FLOAT, all.data_ptr<float>(),
                  static_cast<int>(mine.numel()), MPI_FLOAT, group);
    Tensor whole = mine.clone();
    if (plan[i].type == mt::tp_partition::skip) {
      for (int r = 0; r < tp; ++r) CHECK(torch::equal(all.narrow(0, r * mine.numel(), mine.numel()), mine));
    } else {
      whole = torch::empty({tp * mine.numel()});
      for (int r = 0; r < tp; ++r) {
        std::int64_t at = r * mine.numel();
        for (const auto& [first, n] : mt::tp_shard_runs(plan[i], tp, static_cast<std::uint64_t>(r))) {
          whole.narrow(0, first, n).copy_(all.narrow(0, at, n));
          at += n;
        }
      }
    }
    out.push_back(whole.reshape(shapes[i]));
  }
  MPI_Comm_free(&group);
  return out;
}

}  // namespace

TEST_CASE("autotp: a block split over 2 tensor-parallel ranks trains as the whole block, at ZeRO 0-2", "[torch]") {
  const int stage = GENERATE(0, 1, 2);
  const double clip = GENERATE(0.0, 0.05);
  // bf16: bf16 parameters with fp32 master weights, on both sides; the split sums the
  // row-parallel products in bf16 in another order (measured: within one bf16 ulp of the
  // largest weight).
  const bool bf16 = GENERATE(false, true);
  const auto dt = bf16 ? torch::kBFloat16 : torch::kFloat;
  const tol within = bf16 ? tol{1e-2, 1e-2} : tol{2e-5, 2e-6};  // bf16: about four bf16 ulps
  const int tp = 2, dp = W() / tp, replica = R() / tp;
  INFO("stage " << stage << ", clipping " << clip << (bf16 ? ", bf16" : ", fp32") << ", TP " << tp << " x DP " << dp
                << ", rank " << R());
  REQUIRE(W() % tp == 0);
  auto engine = mt::initialize(Block(7), tp_config(stage, clip, bf16), world());
  CHECK(engine.tensor_parallel_size() == tp);
  CHECK(engine.tensor_parallel_rank() == R() % tp);
  CHECK(engine.world_size() == dp);
  CHECK(engine.module()->qkv->weight.sizes().vec() == std::vector<std::int64_t>{8, 8});
  CHECK(engine.module()->o->weight.sizes().vec() == std::vector<std::int64_t>{8, 4});
  CHECK(engine.module()->down->bias.sizes().vec() == std::vector<std::int64_t>{8});

  Block ref(7);
  ref->to(dt);
  Block start(7);  // the fp32 values the engine's master weights start from
  const std::vector<Tensor> master = fp32_masters(start->parameters());
  // eps 1e-3: the key bias's true gradient is zero (softmax ignores a shift shared by all
  // keys), and Adam would turn its rounding noise into full-size steps of either sign.
  torch::optim::AdamW opt(master, torch::optim::AdamWOptions(1e-2).weight_decay(0.01).eps(1e-3));
  const auto names = engine.parameter_names();
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& p : ref->parameters()) shapes.push_back(p.sizes().vec());
  const auto plan = mt::plan_tensor_parallel(engine.config().tensor_parallel, names, shapes);

  for (int k = 0; k < 4; ++k) {
    INFO("step " << k + 1);
    const auto [x, y] = batch_of(k, replica);
    torch::mse_loss(engine(x.to(dt)).to(torch::kFloat), y).backward();
    engine.step();
    // The reference: each replica's gradient, averaged, clipped, AdamW.
    std::vector<Tensor> avg;
    for (int r = 0; r < dp; ++r) {
      for (auto& p : ref->parameters()) p.mutable_grad().reset();
      const auto [rx, ry] = batch_of(k, r);
      torch::mse_loss(ref->forward(rx.to(dt)).to(torch::kFloat), ry).backward();
      std::size_t i = 0;
      for (auto& p : ref->parameters()) {
        const Tensor g = p.grad().detach().to(torch::kFloat) / static_cast<float>(dp);
        if (r == 0) avg.push_back(g.clone());
        else avg[i] += g;
        ++i;
      }
    }
    double norm_sq = 0;
    for (const auto& g : avg) norm_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
    const double norm = std::sqrt(norm_sq);
    CHECK(engine.global_grad_norm() == Approx(norm).epsilon(bf16 ? 2e-2 : 1e-5));
    if (clip > 0 && norm > clip)
      for (auto& g : avg) g.mul_(static_cast<float>(clip / (norm + 1e-6)));
    master_step(opt, master, avg, ref->parameters());
  }
  const auto whole = whole_masters(engine, plan, shapes);
  for (std::size_t i = 0; i < whole.size(); ++i) {
    INFO(names[i]);
    check_close(whole[i], master[i].detach(), within, bf16 ? 0.0 : 1e-6, "master " + names[i]);
  }
}

TEST_CASE("autotp: checkpoints keep each rank's slices and resume bit for bit; the fp32 export joins them",
          "[torch]") {
  const int stage = GENERATE(1, 2);
  INFO("stage " << stage << ", world " << W());
  const int replica = R() / 2;
  const auto train = [&](mt::engine<Block>& e, int from, int to) {
    for (int k = from; k < to; ++k) {
      const auto [x, y] = batch_of(k, replica);
      torch::mse_loss(e(x), y).backward();
      e.step();
    }
  };
  shared_dir dir;
  auto a = mt::initialize(Block(7), tp_config(stage, 0.05), world());
  train(a, 0, 2);
  a.save_checkpoint(dir.path.string(), "half");
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& p : Block(7)->parameters()) shapes.push_back(p.sizes().vec());
  const auto plan = mt::plan_tensor_parallel(a.config().tensor_parallel, a.parameter_names(), shapes);
  const auto saved = whole_masters(a, plan, shapes);
  train(a, 2, 4);
  // Another engine, at the other stage, from other initial values: the loaded slices,
  // states and counters make it continue as the first one does, to the bit.
  auto b = mt::initialize(Block(3), tp_config(stage == 1 ? 2 : 1, 0.05), world());
  REQUIRE(b.load_checkpoint(dir.path.string(), "half"));
  CHECK(b.global_steps() == 2);
  train(b, 2, 4);
  const auto ma = a.master_weights(), mb = b.master_weights();
  for (std::size_t i = 0; i < ma.size(); ++i) {
    INFO(a.parameter_names()[i]);
    CHECK(torch::equal(ma[i], mb[i]));
  }
  // The fp32 export, in one process: the whole master weights at the save.
  if (R() == 0) {
    const auto sd = mt::fp32_state_dict_from_checkpoint(dir.path.string(), "half");
    const auto names = a.parameter_names();
    for (std::size_t i = 0; i < names.size(); ++i) {
      INFO(names[i]);
      REQUIRE(sd.contains(names[i]));
      CHECK(torch::equal(sd[names[i]], saved[i]));
    }
  }
  // At tensor-parallel size 1 (TP 2 x DP 2 -> TP 1 x DP 4 at four ranks): the slices are
  // joined, master weights exactly as saved; trained on, it follows the split engine
  // within fp32's rounding (the row-parallel sums run in another order).
  json whole_tp = tp_config(stage, 0.05);
  whole_tp.erase("tensor_parallel");
  auto c = mt::initialize(Block(3), whole_tp, world());
  REQUIRE(c.load_checkpoint(dir.path.string(), "half"));
  CHECK(c.global_steps() == 2);
  const auto loaded = c.master_weights();
  for (std::size_t i = 0; i < loaded.size(); ++i) {
    INFO(a.parameter_names()[i]);
    CHECK(torch::equal(loaded[i], saved[i]));
  }
  // Each rank of the whole engine trains its own replica's batch, as the split engine's
  // replicas do: only W / 2 replicas there, so rank r feeds replica r / 2's batch twice.
  for (int k = 2; k < 4; ++k) {
    const auto [x, y] = batch_of(k, replica);
    torch::mse_loss(c(x), y).backward();
    c.step();
  }
  const auto after = whole_masters(a, plan, shapes);
  const auto got = c.master_weights();
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO(a.parameter_names()[i]);
    check_close(got[i], after[i], tol{2e-5, 2e-6}, 1e-6, "resharded master");
  }
  // module-only loads keep the tensor-parallel size.
  CHECK_THROWS_WITH(c.load_checkpoint(dir.path.string(), "half", true),
                    Catch::Contains("load_module_only needs the same size"));
}

TEST_CASE("autotp: what the engine does not split yet is refused with the reason", "[torch]") {
  auto engine = mt::initialize(Block(7), tp_config(1, 0.0), world());
  CHECK_THROWS_WITH(engine.save_16bit_model("unused"), Catch::Contains("engine.save_16bit_model: not available with "
                                                                        "tensor_parallel (autotp_size 2) yet"));
  CHECK_THROWS_WITH(engine.load_checkpoint("unused", "t", true), Catch::Contains("load_module_only = true): not available"));
  json bad = tp_config(1, 0.0);
  bad["tensor_parallel"]["partition_config"]["layer_specs"][0]["patterns"] = {R"(attn\.qkv\.weight$)"};
  CHECK_THROWS_WITH(mt::initialize(Block(7), bad, world()),
                    Catch::Contains("layer spec 0 (patterns \"attn\\.qkv\\.weight$\") matches no parameter"));
}

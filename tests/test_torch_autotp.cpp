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
#include "support/mpi_process_group.hpp"
#include "support/shared_dir.hpp"
#include "support/torch_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/jit/serialization/pickle.h>

#include <mpzero/torch/autotp.hpp>
#include <mpzero/torch/process_group.hpp>
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
// group: the tensor-parallel group's MPI communicator (default: consecutive ranks).
std::vector<Tensor> whole_masters(mt::engine_base& engine, const std::vector<mt::tp_param_plan>& plan,
                                  const std::vector<std::vector<std::int64_t>>& shapes, MPI_Comm given = MPI_COMM_NULL) {
  const int tp = engine.tensor_parallel_size();
  const auto got = engine.master_weights();
  MPI_Comm group;
  if (given == MPI_COMM_NULL) MPI_Comm_split(MPI_COMM_WORLD, R() / tp, R() % tp, &group);
  else MPI_Comm_dup(given, &group);
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

// Block(seed) with the MLP's fused gate_up frozen (weight and bias).
Block frozen_gate_up(std::uint64_t seed) {
  Block b(seed);
  b->gate_up->weight.set_requires_grad(false);
  b->gate_up->bias.set_requires_grad(false);
  return b;
}

// Every parameter of the whole block (trainable and frozen): names, shapes and the
// engine's config's plan of them.
std::tuple<std::vector<std::string>, std::vector<std::vector<std::int64_t>>, std::vector<mt::tp_param_plan>> whole_plan(
    mt::engine_base& e, Block whole) {
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& item : whole->named_parameters()) {
    names.push_back(item.key());
    shapes.push_back(item.value().sizes().vec());
  }
  auto plan = mt::plan_tensor_parallel(e.config().tensor_parallel, names, shapes);
  return {names, shapes, plan};
}

// The plan of the block's trainable parameters (planned with the frozen ones, as the
// engine plans them) and their whole shapes.
std::pair<std::vector<mt::tp_param_plan>, std::vector<std::vector<std::int64_t>>> trainable_plan(mt::engine_base& e,
                                                                                               Block whole) {
  const auto [names, shapes, all] = whole_plan(e, whole);
  std::vector<mt::tp_param_plan> plan;
  std::vector<std::vector<std::int64_t>> kept;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!whole->named_parameters()[names[i]].requires_grad()) continue;
    plan.push_back(all[i]);
    kept.push_back(shapes[i]);
  }
  return {plan, kept};
}

// The whole block (`make(7)`) trained as the engine trains it: `dp` replicas' micro-batch
// gradients averaged, clipped to the global norm, AdamW on fp32 master weights of the
// trainable parameters. Returns those masters after `steps` steps, and each step's norm.
template <class Make>
std::pair<std::vector<Tensor>, std::vector<double>> train_reference(Make make, int steps, int dp, double clip, bool bf16) {
  const auto dt = bf16 ? torch::kBFloat16 : torch::kFloat;
  Block ref = make(7);
  ref->to(dt);
  std::vector<Tensor> trainable, start;
  Block init = make(7);  // the fp32 values the engine's master weights start from
  for (const auto& p : init->parameters())
    if (p.requires_grad()) start.push_back(p);
  for (const auto& p : ref->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  const std::vector<Tensor> master = fp32_masters(start);
  // eps 1e-3: the key bias's true gradient is zero (softmax ignores a shift shared by all
  // keys), and Adam would turn its rounding noise into full-size steps of either sign.
  torch::optim::AdamW opt(master, torch::optim::AdamWOptions(1e-2).weight_decay(0.01).eps(1e-3));
  std::vector<double> norms;
  for (int k = 0; k < steps; ++k) {
    std::vector<Tensor> avg;
    for (int r = 0; r < dp; ++r) {
      for (auto& p : trainable) p.mutable_grad().reset();
      const auto [rx, ry] = batch_of(k, r);
      torch::mse_loss(ref->forward(rx.to(dt)).to(torch::kFloat), ry).backward();
      for (std::size_t i = 0; i < trainable.size(); ++i) {
        const Tensor g = trainable[i].grad().detach().to(torch::kFloat) / static_cast<float>(dp);
        if (r == 0) avg.push_back(g.clone());
        else avg[i] += g;
      }
    }
    double norm_sq = 0;
    for (const auto& g : avg) norm_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
    norms.push_back(std::sqrt(norm_sq));
    if (clip > 0 && norms.back() > clip)
      for (auto& g : avg) g.mul_(static_cast<float>(clip / (norms.back() + 1e-6)));
    master_step(opt, master, avg, trainable);
  }
  std::vector<Tensor> out;
  for (const auto& m : master) out.push_back(m.detach());
  return {out, norms};
}

// A .pt file of tensors by name (torch.save of a dict, as save_16bit_model writes it).
std::map<std::string, Tensor> read_pt(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, Tensor> out;
  for (const auto& item : torch::jit::pickle_load(bytes).toGenericDict())
    out.emplace(item.key().toStringRef(), item.value().toTensor());
  return out;
}

// Tensor-parallel rank `rank`'s slice of whole parameter `name` of the block, by its plan.
Tensor slice_of(mt::engine_base& e, Block whole, const std::string& name, int tp, int rank) {
  const auto [names, shapes, plan] = whole_plan(e, whole);
  const auto i = static_cast<std::size_t>(std::find(names.begin(), names.end(), name) - names.begin());
  const Tensor flat = whole->named_parameters()[name].detach().reshape({-1});
  std::vector<Tensor> pieces;
  for (const auto& [first, n] : mt::tp_shard_runs(plan[i], tp, rank)) pieces.push_back(flat.narrow(0, first, n));
  return torch::cat(pieces).reshape(plan[i].shard_shape);
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

  const auto names = engine.parameter_names();
  std::vector<std::vector<std::int64_t>> shapes;
  for (const auto& p : Block(7)->parameters()) shapes.push_back(p.sizes().vec());
  const auto plan = mt::plan_tensor_parallel(engine.config().tensor_parallel, names, shapes);
  std::vector<double> norms;
  for (int k = 0; k < 4; ++k) {
    const auto [x, y] = batch_of(k, replica);
    torch::mse_loss(engine(x.to(dt)).to(torch::kFloat), y).backward();
    engine.step();
    norms.push_back(engine.global_grad_norm());
  }
  const auto [master, want_norms] = train_reference([](std::uint64_t seed) { return Block(seed); }, 4, dp, clip, bf16);
  for (std::size_t k = 0; k < norms.size(); ++k) {
    INFO("step " << k + 1);
    CHECK(norms[k] == Approx(want_norms[k]).epsilon(bf16 ? 2e-2 : 1e-5));
  }
  const auto whole = whole_masters(engine, plan, shapes);
  for (std::size_t i = 0; i < whole.size(); ++i) {
    INFO(names[i]);
    check_close(whole[i], master[i], within, bf16 ? 0.0 : 1e-6, "master " + names[i]);
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
}

TEST_CASE("autotp: a layer spec that matches no parameter is refused, naming it", "[torch]") {
  json bad = tp_config(1, 0.0);
  bad["tensor_parallel"]["partition_config"]["layer_specs"][0]["patterns"] = {R"(attn\.qkv\.weight$)"};
  CHECK_THROWS_WITH(mt::initialize(Block(7), bad, world()),
                    Catch::Contains("layer spec 0 (patterns \"attn\\.qkv\\.weight$\") matches no parameter"));
}

TEST_CASE("autotp: save_16bit_model joins the slices; module-only loads cut them at any tensor-parallel size",
          "[torch]") {
  const int tp = 2, replica = R() / tp;
  shared_dir dir;
  auto a = mt::initialize(Block(7), tp_config(1, 0.0, /*bf16=*/true), world());
  for (int k = 0; k < 2; ++k) {
    const auto [x, y] = batch_of(k, replica);
    torch::mse_loss(a(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
    a.step();
  }
  // The whole bf16 weights: the whole masters rounded, as the engine rounds each slice.
  const auto [plan, shapes] = trainable_plan(a, Block(7));
  const auto masters = whole_masters(a, plan, shapes);
  std::map<std::string, Tensor> want;
  for (std::size_t i = 0; i < masters.size(); ++i) want[a.parameter_names()[i]] = masters[i].to(torch::kBFloat16);
  CHECK(a.save_16bit_model(dir.path.string(), "model.pt") == want.size());
  a.save_checkpoint(dir.path.string(), "tp2");
  if (R() == 0) {
    const auto got = read_pt((dir.path / "model.pt").string());
    REQUIRE(got.size() == want.size());
    for (const auto& [name, w] : want) {
      INFO(name);
      REQUIRE(got.count(name) == 1);
      CHECK(got.at(name).scalar_type() == torch::kBFloat16);
      CHECK(torch::equal(got.at(name), w));
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const auto own_values = [](mt::engine<Block>& e) {
    std::map<std::string, Tensor> out;
    for (const auto& item : e.module()->named_parameters()) out[item.key()] = item.value().detach().clone();
    return out;
  };
  const auto mine = own_values(a);
  // The same tensor-parallel size: each rank's own slices, no optimizer state or counters.
  auto b = mt::initialize(Block(3), tp_config(2, 0.0, true), world());
  REQUIRE(b.load_checkpoint(dir.path.string(), "tp2", /*load_module_only=*/true));
  CHECK(b.global_steps() == 0);
  for (const auto& [name, v] : own_values(b)) {
    INFO(name);
    CHECK(torch::equal(v, mine.at(name)));
  }
  // Tensor-parallel size 1: the whole weights.
  json whole_cfg = tp_config(1, 0.0, true);
  whole_cfg.erase("tensor_parallel");
  auto c = mt::initialize(Block(3), whole_cfg, world());
  REQUIRE(c.load_checkpoint(dir.path.string(), "tp2", true));
  for (const auto& [name, v] : own_values(c)) {
    INFO(name);
    CHECK(torch::equal(v, want.at(name)));
  }
  // And back: a save of the whole model, loaded module-only at tensor-parallel size 2.
  c.save_checkpoint(dir.path.string(), "whole");
  auto d = mt::initialize(Block(5), tp_config(0, 0.0, true), world());
  REQUIRE(d.load_checkpoint(dir.path.string(), "whole", true));
  for (const auto& [name, v] : own_values(d)) {
    INFO(name);
    CHECK(torch::equal(v, mine.at(name)));
  }
}

TEST_CASE("autotp: a frozen weight that a spec names is split too, and trains as the whole block", "[torch]") {
  const int stage = GENERATE(0, 2);
  const int tp = 2, dp = W() / tp, replica = R() / tp;
  INFO("stage " << stage);
  auto engine = mt::initialize(frozen_gate_up(7), tp_config(stage, 0.05), world());
  // A rank holds its rows of the frozen gate_up (and of its bias), as of a trained one.
  CHECK(engine.module()->gate_up->weight.sizes().vec() == std::vector<std::int64_t>{12, 8});
  CHECK(engine.module()->gate_up->bias.sizes().vec() == std::vector<std::int64_t>{12});
  CHECK(torch::equal(engine.module()->gate_up->weight, slice_of(engine, Block(7), "gate_up.weight", tp, R() % tp)));
  for (int k = 0; k < 3; ++k) {
    const auto [x, y] = batch_of(k, replica);
    torch::mse_loss(engine(x), y).backward();
    engine.step();
  }
  const auto [master, norms] = train_reference(frozen_gate_up, 3, dp, 0.05, false);
  const auto [plan, shapes] = trainable_plan(engine, frozen_gate_up(7));
  const auto whole = whole_masters(engine, plan, shapes);
  REQUIRE(whole.size() == master.size());
  for (std::size_t i = 0; i < whole.size(); ++i)
    check_close(whole[i], master[i], tol{2e-5, 2e-6}, 1e-6, "master " + engine.parameter_names()[i]);
  // A checkpoint loaded at tensor-parallel size 1 gives the frozen weight whole.
  shared_dir dir;
  engine.save_checkpoint(dir.path.string(), "t");
  json whole_cfg = tp_config(stage, 0.05);
  whole_cfg.erase("tensor_parallel");
  auto one = mt::initialize(frozen_gate_up(3), whole_cfg, world());
  REQUIRE(one.load_checkpoint(dir.path.string(), "t"));
  CHECK(torch::equal(one.module()->gate_up->weight, Block(7)->gate_up->weight));
  CHECK(torch::equal(one.module()->gate_up->bias, Block(7)->gate_up->bias));
}

TEST_CASE("autotp: tensor- and data-parallel groups made by the program, as MPI communicators or c10d groups",
          "[torch]") {
  const bool c10d = GENERATE(false, true);
  const int tp = 2, dp = W() / tp;
  // Not consecutive: tensor-parallel groups of the ranks equal modulo dp, data-parallel
  // groups of consecutive ranks (at 4 ranks: TP {0, 2}, {1, 3}; DP {0, 1}, {2, 3}).
  const int tp_rank = R() / dp, replica = R() % dp;
  INFO((c10d ? "c10d" : "MPI") << ", rank " << R());
  MPI_Comm tpc, dpc;
  MPI_Comm_split(MPI_COMM_WORLD, replica, tp_rank, &tpc);
  MPI_Comm_split(MPI_COMM_WORLD, tp_rank, replica, &dpc);
  const auto wrap = [&](MPI_Comm c, const char* name) {
    return c10d ? mt::process_group_communicator(mpi_process_group(c))
                : mt::any_communicator::own(mpzero::comm::mpi_communicator(c), name);
  };
  {
    // The world given (c10d), or left empty (MPI): initialize joins the one mpirun started.
    // With MPI the optimizer is given in code instead of the config (DeepSpeed's
    // initialize(model, config, optimizer, mpu)): the same AdamW.
    const mt::parallel_groups groups{c10d ? mt::any_communicator::wrap(world()) : mt::any_communicator{},
                                     wrap(tpc, "tp"), wrap(dpc, "dp")};
    json no_optimizer = tp_config(1, 0.05);
    no_optimizer.erase("optimizer");
    const mt::optimizer_config adamw{.type = mt::optimizer_type::adamw, .lr = 1e-2, .eps = 1e-3, .weight_decay = 0.01};
    auto engine = c10d ? mt::initialize(Block(R() == 0 ? 7 : 11), tp_config(1, 0.05), groups)
                       : mt::initialize(Block(R() == 0 ? 7 : 11), no_optimizer, adamw, groups);
    CHECK(engine.tensor_parallel_rank() == tp_rank);
    CHECK(engine.world_size() == dp);
    for (int k = 0; k < 3; ++k) {
      const auto [x, y] = batch_of(k, replica);
      torch::mse_loss(engine(x), y).backward();
      engine.step();
    }
    const auto [master, norms] = train_reference([](std::uint64_t seed) { return Block(seed); }, 3, dp, 0.05, false);
    const auto [plan, shapes] = trainable_plan(engine, Block(7));
    const auto whole = whole_masters(engine, plan, shapes, tpc);
    for (std::size_t i = 0; i < whole.size(); ++i)
      check_close(whole[i], master[i], tol{2e-5, 2e-6}, 1e-6, "master " + engine.parameter_names()[i]);
  }
  // Groups that do not form a grid, or of the wrong sizes, are refused on every rank.
  if (W() == 4) {
    // TP {0, 1}, {2, 3} and DP {0, 3}, {1, 2}: every rank has a place of its own, but a
    // data-parallel group would join different slices.
    MPI_Comm a, b;
    MPI_Comm_split(MPI_COMM_WORLD, R() / 2, R() % 2, &a);
    MPI_Comm_split(MPI_COMM_WORLD, R() == 0 || R() == 3 ? 0 : 1, R() / 2, &b);
    CHECK_THROWS_WITH(mt::initialize(Block(7), tp_config(1, 0.0),
                                     mt::parallel_groups{mt::any_communicator::wrap(world()), wrap(a, "tp"), wrap(b, "dp")}),
                      Catch::Contains("must hold the same tensor-parallel rank"));
    // The same group twice: two ranks at one place.
    CHECK_THROWS_WITH(mt::initialize(Block(7), tp_config(1, 0.0),
                                     mt::parallel_groups{mt::any_communicator::wrap(world()), wrap(a, "tp"), wrap(a, "dp")}),
                      Catch::Contains("each rank needs its own place in the grid"));
    MPI_Comm_free(&a);
    MPI_Comm_free(&b);
  }
  CHECK_THROWS_WITH(mt::initialize(Block(7), tp_config(1, 0.0),
                                   mt::parallel_groups{mt::any_communicator::wrap(world()), mt::any_communicator::local(),
                                                       wrap(dpc, "dp")}),
                    Catch::Contains("pass groups of autotp_size and world / autotp_size ranks"));
  json plain = tp_config(1, 0.0);
  plain.erase("tensor_parallel");
  CHECK_THROWS_WITH(mt::initialize(Block(7), plain, mt::parallel_groups{mt::any_communicator::wrap(world()), wrap(tpc, "tp"), wrap(dpc, "dp")}),
                    Catch::Contains("parallel_groups were given, but tensor_parallel.autotp_size is 1"));
  MPI_Comm_free(&tpc);
  MPI_Comm_free(&dpc);
}

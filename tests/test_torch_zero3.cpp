// ZeRO-3 in the LibTorch engine under mpirun (1 and 2 ranks): partitioned parameters,
// engine.forward's gather, gathered_forward's per-submodule gathers around forward and
// backward, checkpoints across stages, and the refusals.
//
// The reference is the stage-2 engine: stage 3 reduces and updates exactly as stage 2
// (the same flat layout, buckets and step); only where the 16-bit parameters live
// differs, so every loss, master weight and parameter must be equal bit for bit.
#include "support/torch_mpi.hpp"  // LibTorch, then Catch and MPI
#include "support/torch_reference.hpp"
#include "support/shared_dir.hpp"

#include <c10/core/CPUAllocator.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

using namespace mpzero::testing;  // mt, Tensor, json, world(), W(), R()

namespace {

// A probe the model calls between blocks (forward) and whose gradient hooks it sets
// (backward): what the test samples there.
std::function<void(const char* where)> probe;

// x (4 features) -> Linear(4, 16) -> 3 residual blocks (LayerNorm, Linear(16, 32), GELU,
// Linear(32, 16)) -> Linear(16, 4). With a persistence threshold of 32 elements, the
// weights (64-512 elements) are partitioned; biases and norms (4-32) stay whole.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int d) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    up = register_module("up", torch::nn::Linear(d, 2 * d));
    down = register_module("down", torch::nn::Linear(2 * d, d));
  }
  Tensor forward(const Tensor& x) { return x + down(torch::gelu(up(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  // Each block passes through mt::partitioned as it is built: under a zero_init scope it
  // keeps this rank's slices only (the model code is the same either way).
  StackImpl(std::uint64_t seed, bool units) : units(units) {
    torch::manual_seed(seed);
    in = register_module("in", torch::nn::Linear(4, 16));
    for (int k = 0; k < 3; ++k) blocks.push_back(register_module("block" + std::to_string(k), mt::partitioned(Block(16))));
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  Tensor forward(const Tensor& x) {
    Tensor h = in(x.to(in->weight.scalar_type()));
    for (int k : order) {
      auto& b = blocks[static_cast<std::size_t>(k)];
      h = units ? mt::gathered_forward(b, h) : b->forward(h);
      if (probe) {
        probe("forward");
        if (h.requires_grad()) h.register_hook([](const Tensor&) { probe("backward"); });
      }
    }
    if (probe) probe("blocks done");
    return out(h);
  }
  Tensor forward(const Tensor& x, const Tensor& y) { return torch::mse_loss(forward(x).to(torch::kFloat), y); }
  bool units;
  std::vector<int> order{0, 1, 2};  // the blocks the forward runs, in this order
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::vector<Block> blocks;
};
TORCH_MODULE(Stack);

batch data(int k, int r) { return random_batch(static_cast<std::uint64_t>(7919 * k + r + 1)); }

json config(int stage, const std::string& prec, std::uint64_t threshold, bool offload = false, int gas = 1) {
  json extra = {{"zero_optimization", {{"stage3_param_persistence_threshold", threshold}}}};
  if (offload) extra["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  if (prec == "bf16") extra["bf16"] = {{"enabled", true}};
  return engine_config(stage, gas, 1e-2, extra);
}

mt::engine<Stack> make(int stage, const std::string& prec, std::uint64_t threshold, bool units, bool offload = false,
                       int gas = 1) {
  return mt::initialize(Stack(1234, units), config(stage, prec, threshold, offload, gas), world());
}

// One micro-step on this rank's batch k; returns the loss.
float micro_step(mt::engine<Stack>& e, int k) {
  const batch b = data(k, R());
  Tensor loss = e.forward(b.x, b.y);
  loss.backward();
  e.step();
  return loss.item<float>();
}

std::vector<Tensor> whole_params(mt::engine_base& e) {
  // master_weights() is whole on every rank at any stage; the parameters are its rounding.
  std::vector<Tensor> out;
  for (auto& m : e.master_weights()) out.push_back(m.to(e.parameters()[0].scalar_type()).to(torch::kFloat));
  return out;
}

void require_equal(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::string& what) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(what << ", tensor " << i);
    REQUIRE(torch::equal(a[i], b[i]));
  }
}

// The partitioned parameters' element count, all of them and engine.forward's part.
std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace

TEST_CASE("zero3: the engine at stage 3 trains bit for bit as at stage 2", "[torch][zero3]") {
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"));
  const bool units = GENERATE(false, true);
  const std::uint64_t threshold = GENERATE(std::uint64_t{0}, std::uint64_t{32});
  const bool offload = GENERATE(false, true);
  const int gas = offload ? 1 : 2;
  INFO(prec << (units ? ", gathered_forward blocks" : ", no gathered_forward") << ", threshold " << threshold
            << (offload ? ", CPU offload" : "") << ", gas " << gas << ", world " << W());
  auto z2 = make(2, prec, threshold, units, offload, gas);
  auto z3 = make(3, prec, threshold, units, offload, gas);
  CHECK_THAT(z3.describe(), Catch::Contains("ZeRO stage 3"));
  std::size_t partitioned = 0;
  for (std::size_t i = 0; i < z3.parameters().size(); ++i) {
    const Tensor& p = z3.parameters()[i];
    const auto shape = z3.parameter_shape(p);
    REQUIRE(shape == z2.parameters()[i].sizes().vec());
    // Between steps a partitioned parameter is empty; a persistent one is whole.
    if (static_cast<std::uint64_t>(numel_of(shape)) > threshold) {
      CHECK(p.numel() == 0);
      ++partitioned;
    } else {
      CHECK(p.sizes().vec() == shape);
    }
  }
  CHECK(partitioned == (threshold == 0 ? z3.parameters().size() : 8));  // the 8 weights
  for (int k = 0; k < 4; ++k) {
    const float l2 = micro_step(z2, k), l3 = micro_step(z3, k);
    INFO("micro-step " << k);
    REQUIRE(l2 == l3);
    CHECK(z3.gathered_numel() == 0);  // step() released everything (and gas-boundary forwards' graphs are gone)
  }
  require_equal(whole_params(z2), whole_params(z3), "master weights after 4 micro-steps");
  // Stage 3 keeps 1/W of the partitioned parameters on each rank.
  const auto m2 = z2.memory(), m3 = z3.memory();
  if (W() > 1 && partitioned > 0) CHECK(m3.params < m2.params);
  if (W() == 1) CHECK(m3.params >= m2.params);
}

TEST_CASE("zero3: with torch_autocast, Linear weights are gathered in the autocast dtype and train bit for bit as "
          "at stage 2", "[torch][zero3]") {
  const bool units = GENERATE(false, true);
  INFO((units ? "gathered_forward blocks" : "no gathered_forward") << ", world " << W());
  const auto make_ac = [&](int stage) {
    json cfg = config(stage, "fp32", 32);
    cfg["torch_autocast"] = {{"enabled", true}, {"dtype", "bfloat16"}};
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
    return mt::initialize(Stack(1234, units), cfg, world());
  };
  auto z2 = make_ac(2);
  auto z3 = make_ac(3);
  auto& m3 = z3.module();
  // While gathered for the forward, the Linear weights are bf16 (as autocast would cast
  // them); between steps the empty parameters keep the model's dtype.
  std::size_t seen = 0;
  bool in_z3 = false;
  probe = [&](const char* where) {
    if (!in_z3 || std::string(where) != "blocks done") return;
    CHECK(m3->out->weight.scalar_type() == torch::kBFloat16);  // gathered, or waiting for its operation
    CHECK(m3->out->bias.scalar_type() == torch::kFloat);         // persistent: whole, in fp32
    ++seen;
  };
  for (int k = 0; k < 4; ++k) {
    const float l2 = micro_step(z2, k);
    in_z3 = true;
    const float l3 = micro_step(z3, k);
    in_z3 = false;
    INFO("micro-step " << k);
    REQUIRE(l2 == l3);
    CHECK(m3->out->weight.numel() == 0);
    CHECK(m3->out->weight.scalar_type() == torch::kFloat);
  }
  probe = nullptr;
  CHECK(seen == 4);
  require_equal(whole_params(z2), whole_params(z3), "master weights after 4 micro-steps");
  // A save gathers in the model's dtype: the fp32 weights, not their bf16 rounding.
  shared_dir dir;
  z3.save_16bit_model(dir.path.string());
  const auto want = whole_params(z2);  // collective
  MPI_Barrier(MPI_COMM_WORLD);
  if (R() == 0) {
    std::ifstream in(dir.path / "pytorch_model.bin", std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto saved = torch::jit::pickle_load(bytes).toGenericDict();
    const auto names = z2.parameter_names();
    for (std::size_t i = 0; i < names.size(); ++i) {
      INFO(names[i]);
      const Tensor t = saved.at(names[i]).toTensor();
      REQUIRE(t.scalar_type() == torch::kFloat);
      REQUIRE(torch::equal(t.reshape(-1), want[i].reshape(-1)));
    }
  }
  for (int k = 4; k < 6; ++k) REQUIRE(micro_step(z2, k) == micro_step(z3, k));
}

TEST_CASE("zero3: gathered_forward holds a block's parameters only around its forward and its backward",
          "[torch][zero3]") {
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"));
  INFO(prec << ", world " << W());
  auto e = make(3, prec, 32, /*units=*/true);
  // Partitioned: in.weight and out.weight (64 each), and each block's up.weight and
  // down.weight (512 each).
  std::uint64_t outside = 0, block = 0, total = 0;
  for (std::size_t i = 0; i < e.parameters().size(); ++i) {
    const auto& name = e.parameter_names()[i];
    const auto n = static_cast<std::uint64_t>(numel_of(e.parameter_shape(e.parameters()[i])));
    if (n <= 32) continue;
    total += n;
    if (name.rfind("block", 0) != 0) outside += n;
    if (name.rfind("block0.", 0) == 0) block += n;
  }
  REQUIRE(outside == 128);
  REQUIRE(block == 1024);
  std::vector<std::pair<std::string, std::uint64_t>> samples;
  probe = [&](const char* where) { samples.emplace_back(where, e.gathered_numel()); };
  for (int k = 0; k < 3; ++k) {
    INFO("iteration " << k);
    samples.clear();
    const std::uint64_t hits = e.prefetched_gathers();
    const batch b = data(k, R());
    Tensor loss = e.forward(b.x, b.y);
    // After the forward: what no call covers, each gathered as an operation read it (the
    // first forward too, while it learns what the calls cover).
    CHECK(e.gathered_numel() == outside);
    loss.backward();
    CHECK(e.gathered_numel() == outside);  // engine.forward's part lives with the graph, until step()
    e.step();
    CHECK(e.gathered_numel() == 0);
    std::size_t fwd = 0, bwd = 0;
    for (const auto& [where, n] : samples) {
      if (where == std::string("blocks done")) continue;
      if (where == std::string("forward")) {
        ++fwd;
        CHECK(n == 64);  // between blocks: in.weight, read already; out.weight is not yet
      } else {
        ++bwd;
        // At each block boundary in backward: the block behind it is gathered again,
        // the one after it (whose backward is done) released.
        CHECK(n == outside + block);
      }
    }
    CHECK(fwd == 3);
    CHECK(bwd == 3);
    // In backward, blocks 1 and 0 find their all-gather started while the block after
    // them computed (the forward just run gave the order); from the second forward on,
    // blocks 1 and 2 too, while the block before them computed. (The prefetched copies
    // are not bound, so the samples above do not count them.)
    CHECK(e.prefetched_gathers() - hits == (k == 0 ? 2u : 4u));
  }
  // A forward under NoGradGuard gathers for the forward only.
  {
    torch::NoGradGuard ng;
    const batch b = data(9, R());
    samples.clear();
    Tensor y = e.forward(b.x);
    CHECK(y.sizes().vec() == std::vector<std::int64_t>{8, 4});
    CHECK(e.gathered_numel() == 0);
    for (const auto& s : samples) CHECK(s.second == 64);
  }
  probe = nullptr;
}

TEST_CASE("zero3: parameters outside every unit are gathered as operations read them, within "
          "stage3_max_live_parameters",
          "[torch][zero3]") {
  // No gathered_forward call and a persistence threshold of 0: every parameter is used
  // outside the units. The largest one operation reads is an up projection's weight and
  // bias (512 + 32 elements, one aten::linear); all of them are 3,460.
  const std::uint64_t limit = GENERATE(std::uint64_t{100}, std::uint64_t{600}, std::uint64_t{1'000'000'000});
  INFO("stage3_max_live_parameters " << limit << ", world " << W());
  json extra = {{"zero_optimization", {{"stage3_param_persistence_threshold", 0}, {"stage3_max_live_parameters", limit}}}};
  auto z3 = mt::initialize(Stack(1234, /*units=*/false), engine_config(3, 1, 1e-2, extra), world());
  auto z2 = make(2, "fp32", 0, /*units=*/false);
  std::uint64_t total = 0;
  for (const auto& p : z3.parameters()) total += static_cast<std::uint64_t>(numel_of(z3.parameter_shape(p)));
  REQUIRE(total == 3460);
  // Measured on the tensors themselves: the elements of the parameters whose storage has data.
  auto resident = [&] {
    std::uint64_t n = 0;
    for (const auto& p : z3.parameters())
      if (p.numel() > 0 && p.storage().data() != nullptr) n += static_cast<std::uint64_t>(p.numel());
    return n;
  };
  std::vector<std::pair<std::string, std::uint64_t>> samples;
  probe = [&](const char* where) { samples.emplace_back(where, resident()); };
  const std::uint64_t bound = std::max<std::uint64_t>(limit, 544);
  for (int k = 0; k < 3; ++k) {
    INFO("step " << k);
    const float l2 = micro_step(z2, k);
    samples.clear();
    const batch b = data(k, R());
    Tensor loss = z3.forward(b.x, b.y);
    CHECK(resident() <= bound);
    CHECK(z3.gathered_numel() == resident());
    loss.backward();
    CHECK(resident() <= bound);
    const float l3 = loss.item<float>();
    z3.step();
    CHECK(z3.gathered_numel() == 0);
    for (const auto& p : z3.parameters()) CHECK(p.numel() == 0);  // empty between passes, as a unit's
    REQUIRE(l2 == l3);
    std::uint64_t most = 0;
    for (const auto& [where, n] : samples) most = std::max(most, n);
    REQUIRE(samples.size() == 7);  // 3 forward, 3 backward, blocks done
    if (limit < total) {
      CHECK(most <= bound);
    } else {
      CHECK(most == total);  // nothing released within the pass: the whole model at the last backward block
    }
  }
  probe = nullptr;
  require_equal(whole_params(z2), whole_params(z3), "master weights after 3 steps");
}

TEST_CASE("zero3: stage3_prefetch_bucket_size bounds the prefetch; 0 turns it off, with the same results",
          "[torch][zero3]") {
  INFO("world " << W());
  // Each block holds 1024 partitioned elements.
  const std::uint64_t bucket = GENERATE(std::uint64_t{0}, std::uint64_t{1000}, std::uint64_t{1024});
  INFO("stage3_prefetch_bucket_size " << bucket);
  json cfg = config(3, "bf16", 32, false, 1);
  cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = bucket;
  auto e = mt::initialize(Stack(1234, true), cfg, world());
  auto ref = make(2, "bf16", 32, true);
  for (int k = 0; k < 3; ++k) REQUIRE(micro_step(e, k) == micro_step(ref, k));
  CHECK(e.prefetched_gathers() == (bucket >= 1024 ? 10u : 0u));  // 2 in the first backward, 4 in each iteration after
  require_equal(whole_params(e), whole_params(ref), "master weights");
}

namespace {
// The MPI world, except that while armed the all-gather whose wait is the `fail_at`-th
// from then fails after completing (on every rank alike: the ranks stay in step).
struct failing_gathers final : mt::communicator_base {
  mt::any_communicator inner = mt::any_communicator::wrap(world(), "mpi");
  int fail_at = 0;  // 0: disarmed
  int failed = 0;
  struct request final : mt::request_base {
    request(std::unique_ptr<mt::request_base> r, failing_gathers& c) : r_(std::move(r)), c_(c) {}
    void wait() override {
      if (done_) return;
      r_->wait();
      done_ = true;
      if (c_.fail_at > 0 && --c_.fail_at == 0) {
        ++c_.failed;
        throw mpzero::comm::comm_error("failing_gathers: an injected all-gather failure");
      }
    }
    bool test() override {
      if (done_) return true;
      if (!r_->test()) return false;
      wait();
      return true;
    }
    std::unique_ptr<mt::request_base> r_;
    failing_gathers& c_;
    bool done_ = false;
  };
  int rank() const override { return inner.rank(); }
  int size() const override { return inner.size(); }
  std::string name() const override { return "failing_gathers"; }
  std::unique_ptr<mt::request_base> iall_reduce(const void* in, void* out, std::uint64_t n, mt::wire_dtype t,
                                                mpzero::comm::reduce_op op) override {
    return inner.base().iall_reduce(in, out, n, t, op);
  }
  std::unique_ptr<mt::request_base> ireduce_scatter_v(const void* in, void* out, std::span<const std::uint64_t> counts,
                                                      mt::wire_dtype t, mpzero::comm::reduce_op op) override {
    return inner.base().ireduce_scatter_v(in, out, counts, t, op);
  }
  std::unique_ptr<mt::request_base> iall_gather_v(const void* in, std::uint64_t n_in, void* out,
                                                  std::span<const std::uint64_t> counts, mt::wire_dtype t) override {
    return std::make_unique<request>(inner.base().iall_gather_v(in, n_in, out, counts, t), *this);
  }
  std::unique_ptr<mt::request_base> ibroadcast(void* data, std::uint64_t n, mt::wire_dtype t, int root) override {
    return inner.base().ibroadcast(data, n, t, root);
  }
  void barrier() override { inner.barrier(); }
};
}  // namespace

TEST_CASE("zero3: a prefetch that fails to release at the end of a forward is reported by the next call, once",
          "[torch][zero3]") {
  INFO("world " << W());
  if (W() < 2) {
    SUCCEED("one rank gathers nothing (its partition is the whole parameter): no all-gather to fail");
    return;
  }
  auto comm = std::make_shared<failing_gathers>();
  Stack model(1234, true);
  auto e = mt::initialize(model, config(3, "bf16", 32), mt::any_communicator(comm));
  Stack ref_model(1234, true);
  auto ref = mt::initialize(ref_model, config(2, "bf16", 32), world());
  REQUIRE(micro_step(e, 0) == micro_step(ref, 0));  // the units' order is known now: block 0, 1, 2
  // Blocks 1 then 0: block 1 prefetches block 2 (its successor last time) and block 0
  // prefetches block 1 (released after its forward). Neither comes, so the end of the
  // forward releases both: block 1's wait passes, block 2's fails.
  model->order = {1, 0};
  probe = [&](const char* where) {
    if (where == std::string("blocks done")) comm->fail_at = 2;
  };
  {
    torch::NoGradGuard ng;
    const Tensor y = e.forward(data(1, R()).x);  // the failure cannot leave a destructor
    CHECK(y.sizes().vec() == std::vector<std::int64_t>{8, 4});
  }
  probe = nullptr;
  REQUIRE(comm->failed == 1);
  CHECK(e.gathered_numel() == 0);
  // The next call reports it, with what failed and where.
  const batch b = data(1, R());
  CHECK_THROWS_MATCHES(e.forward(b.x, b.y), mpzero::comm::comm_error,
                       Catch::Matchers::Predicate<mpzero::comm::comm_error>([](const mpzero::comm::comm_error& x) {
                         const std::string m = x.what();
                         return m.find("could not release a prefetched all-gather") != std::string::npos &&
                                m.find("an injected all-gather failure") != std::string::npos;
                       }));
  // Once: the engine goes on, and no group released before the failure is released again
  // (step() releases whatever is still listed). Block 2 is left out of the next step, which
  // still updates it (Adam's moments): its failed copy must not come back after that, but
  // a new all-gather. Then training goes on exactly as the stage-2 engine's.
  model->order = ref_model->order = {0, 1};
  REQUIRE(micro_step(e, 1) == micro_step(ref, 1));
  model->order = ref_model->order = {0, 1, 2};
  for (int k = 2; k < 4; ++k) REQUIRE(micro_step(e, k) == micro_step(ref, k));
  CHECK(e.gathered_numel() == 0);
  require_equal(whole_params(ref), whole_params(e), "master weights after the failure");
}

TEST_CASE("zero3: a backward after step() is refused with what to do", "[torch][zero3]") {
  auto e = make(3, "fp32", 32, /*units=*/true);
  const batch b0 = data(0, R()), b1 = data(1, R());
  Tensor loss0 = e.forward(b0.x, b0.y);
  Tensor loss1 = e.forward(b1.x, b1.y);
  loss0.backward();
  e.step();  // releases what loss1's graph would need
  CHECK_THROWS_WITH(loss1.backward(), Catch::Contains("ZeRO-3") && Catch::Contains("Run backward before step()"));
  // The engine goes on.
  const float l = micro_step(e, 2);
  CHECK(std::isfinite(l));
}

TEST_CASE("zero3: checkpoints move between stage 3 and stage 2 in both directions", "[torch][zero3][checkpoint]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mpzero_zero3_ckpt_" + std::to_string(W()));
  if (R() == 0) fs::remove_all(dir);
  world().ibarrier().wait();
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"));
  INFO(prec << ", world " << W());
  auto z3 = make(3, prec, 32, true);
  auto z2 = make(2, prec, 32, true);
  for (int k = 0; k < 2; ++k) {
    micro_step(z3, k);
    micro_step(z2, k);
  }
  z3.save_checkpoint(dir.string(), "z3");
  z2.save_checkpoint(dir.string(), "z2");
  CHECK(z3.gathered_numel() == 0);  // the save gathered each parameter for model_states.pt, then released it
  // model_states.pt of stage 3 holds the whole parameters, as stage 2's does.
  if (R() == 0) {
    auto read = [&](const std::string& tag) {
      std::ifstream in(dir / tag / "model_states.pt", std::ios::binary);
      std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      return torch::pickle_load(bytes).toGenericDict().at("module").toGenericDict();
    };
    auto a = read("z3"), b = read("z2");
    REQUIRE(a.size() == b.size());
    for (const auto& item : b) {
      INFO(item.key().toStringRef());
      REQUIRE(torch::equal(a.at(item.key()).toTensor(), item.value().toTensor()));
    }
  }
  // Cross loads continue bit for bit.
  auto from3 = make(2, prec, 32, true);
  auto from2 = make(3, prec, 32, true);
  REQUIRE(from3.load_checkpoint(dir.string(), "z3"));
  REQUIRE(from2.load_checkpoint(dir.string(), "z2"));
  require_equal(whole_params(from3), whole_params(z3), "stage 2 loaded from stage 3");
  require_equal(whole_params(from2), whole_params(z2), "stage 3 loaded from stage 2");
  // Module only, into stage 3: the parameters from model_states.pt become the master
  // weights, so they round back to the saved parameters.
  auto mod = make(3, prec, 32, true);
  REQUIRE(mod.load_checkpoint(dir.string(), "z2", /*load_module_only=*/true));
  require_equal(whole_params(mod), whole_params(z2), "stage 3, module only, from stage 2");
  CHECK(mod.gathered_numel() == 0);
  const float a = micro_step(z2, 5), b = micro_step(from2, 5), c = micro_step(from3, 5);
  CHECK(a == b);
  CHECK(a == c);
  world().ibarrier().wait();
  if (R() == 0) fs::remove_all(dir);
}

namespace {

// gathered_forward's other shapes: a unit whose input needs no gradient, with a
// non-tensor argument and a tuple output; one module called twice; a unit inside a unit.
struct PairImpl : torch::nn::Module {
  PairImpl() { l = register_module("l", torch::nn::Linear(4, 8)); }
  std::tuple<Tensor, Tensor> forward(const Tensor& x, double scale) {
    Tensor h = l(x);
    return {h * scale, torch::tanh(h)};
  }
  torch::nn::Linear l{nullptr};
};
TORCH_MODULE(Pair);

struct OuterImpl : torch::nn::Module {
  OuterImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    inner = register_module("inner", torch::nn::Linear(8, 8));
  }
  Tensor forward(const Tensor& x) { return x + mt::gathered_forward(inner, torch::gelu(a(x))); }
  torch::nn::Linear a{nullptr}, inner{nullptr};
};
TORCH_MODULE(Outer);

struct TrickyImpl : torch::nn::Module {
  TrickyImpl() {
    torch::manual_seed(99);
    pair = register_module("pair", Pair());
    shared = register_module("shared", torch::nn::Linear(8, 8));
    outer = register_module("outer", Outer());
    head = register_module("head", torch::nn::Linear(8, 4));
  }
  Tensor forward(const Tensor& x, const Tensor& y) {
    auto [p, q] = mt::gathered_forward(pair, x.to(head->weight.scalar_type()), 0.5);
    Tensor h = p + q;
    h = torch::tanh(mt::gathered_forward(shared, h));
    h = torch::tanh(mt::gathered_forward(shared, h));  // the same unit twice
    h = mt::gathered_forward(outer, h);
    return torch::mse_loss(head(h).to(torch::kFloat), y);
  }
  Pair pair{nullptr};
  torch::nn::Linear shared{nullptr}, head{nullptr};
  Outer outer{nullptr};
};
TORCH_MODULE(Tricky);

}  // namespace

TEST_CASE("zero3: units with tuple outputs, non-tensor arguments, inputs without gradient, reuse and nesting",
          "[torch][zero3]") {
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"));
  INFO(prec << ", world " << W());
  auto z2 = mt::initialize(Tricky(), config(2, prec, 0), world());
  auto z3 = mt::initialize(Tricky(), config(3, prec, 0), world());
  // Without an engine, gathered_forward is the module's own forward.
  {
    Tricky plain;
    const batch b = data(0, R());
    auto [p0, q0] = plain->pair->forward(b.x, 0.5);
    auto [p1, q1] = mt::gathered_forward(plain->pair, b.x, 0.5);
    CHECK(torch::equal(p0, p1));
    CHECK(torch::equal(q0, q1));
  }
  std::uint64_t head_numel = 0;
  for (std::size_t i = 0; i < z3.parameters().size(); ++i)
    if (z3.parameter_names()[i].rfind("head.", 0) == 0) head_numel += static_cast<std::uint64_t>(numel_of(z3.parameter_shape(z3.parameters()[i])));
  for (int k = 0; k < 4; ++k) {
    INFO("step " << k);
    const batch b = data(k, R());
    Tensor l2 = z2.forward(b.x, b.y), l3 = z3.forward(b.x, b.y);
    l2.backward();
    l3.backward();
    // After the backward only engine.forward's part (the head, which no unit covers) is
    // left: the pair unit's input needs no gradient, so the end of the backward released it.
    if (k > 0) CHECK(z3.gathered_numel() == head_numel);
    z2.step();
    z3.step();
    REQUIRE(l2.item<float>() == l3.item<float>());
  }
  require_equal(whole_params(z2), whole_params(z3), "master weights after 4 steps");
}

// ---- partitioned construction (zero_init) ------------------------------------------------

namespace {

// Counts the bytes LibTorch's CPU allocator hands out: live now, and the peak since
// reset(). LibTorch expects a CPU pointer to be its own deleter's context, so the blocks
// are found again by address.
struct counting_cpu_allocator final : c10::Allocator {
  c10::Allocator* base = c10::GetCPUAllocator();
  std::mutex m;
  std::unordered_map<void*, std::pair<c10::DataPtr, std::int64_t>> blocks;
  std::int64_t live = 0, peak = 0;
  static counting_cpu_allocator& instance();
  static void release(void* data) {
    counting_cpu_allocator& a = instance();
    std::lock_guard<std::mutex> lock(a.m);
    const auto it = a.blocks.find(data);
    if (it == a.blocks.end()) return;  // a null pointer (empty allocation)
    a.live -= it->second.second;
    a.blocks.erase(it);  // frees it through the base allocator
  }
  c10::DataPtr allocate(std::size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};
    std::lock_guard<std::mutex> lock(m);
    live += static_cast<std::int64_t>(n);
    peak = std::max(peak, live);
    blocks.emplace(data, std::make_pair(std::move(inner), static_cast<std::int64_t>(n)));
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  void reset() {
    std::lock_guard<std::mutex> lock(m);
    peak = live;
  }
  std::int64_t live_now() {
    std::lock_guard<std::mutex> lock(m);
    return live;
  }
  std::int64_t peak_now() {
    std::lock_guard<std::mutex> lock(m);
    return peak;
  }
};
counting_cpu_allocator& counting_cpu_allocator::instance() {
  static counting_cpu_allocator a;
  return a;
}
counting_cpu_allocator& cpu_bytes() {
  static const bool installed = [] {
    c10::SetCPUAllocator(&counting_cpu_allocator::instance(), /*priority=*/100);
    return true;
  }();
  (void)installed;
  return counting_cpu_allocator::instance();
}

std::int64_t bytes_of(torch::nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel() * p.element_size();
  return n;
}

// The Stack built under zero_init(world()), and what its construction held at its peak.
struct built {
  Stack model{nullptr};
  std::int64_t peak_bytes = 0, kept = 0, whole = 0;
};
built build_partitioned(std::uint64_t seed) {
  counting_cpu_allocator& a = cpu_bytes();
  built b;
  {
    mt::zero_init scope(world());
    a.reset();
    const std::int64_t before = a.live_now();
    b.model = Stack(seed, true);
    b.peak_bytes = a.peak_now() - before;
    b.kept = static_cast<std::int64_t>(scope.kept_elements());
    b.whole = static_cast<std::int64_t>(scope.partitioned_elements());
  }
  return b;
}

}  // namespace

TEST_CASE("zero_init: a model built partitioned trains bit for bit as the model built whole", "[torch][zero3]") {
  const int stage = GENERATE(3, 2);
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"));
  INFO("stage " << stage << ", " << prec << ", world " << W());
  auto whole = make(stage, prec, 32, /*units=*/true);
  built b = build_partitioned(1234);
  // Every block parameter is empty after construction; this rank kept its slices.
  std::int64_t block_elements = 0;
  for (auto& blk : b.model->blocks) {
    for (const auto& p : blk->parameters()) CHECK(p.numel() == 0);
  }
  Stack reference(1234, true);
  // Each block tensor of n elements is cut in slices of ceil(n / W); rank r keeps the r-th.
  std::int64_t kept = 0;
  for (auto& blk : reference->blocks) {
    for (const auto& p : blk->parameters()) {
      const std::int64_t n = p.numel(), chunk = (n + W() - 1) / W();
      block_elements += n;
      kept += std::max<std::int64_t>(0, std::min(n, chunk * (R() + 1)) - std::min(n, chunk * R()));
    }
  }
  CHECK(b.whole == block_elements);
  CHECK(b.kept == kept);
  auto e = mt::initialize(b.model, config(stage, prec, 32), world());
  for (int k = 0; k < 4; ++k) {
    INFO("micro-step " << k);
    REQUIRE(micro_step(whole, k) == micro_step(e, k));
  }
  require_equal(whole_params(whole), whole_params(e), "master weights after 4 micro-steps");
}

TEST_CASE("zero_init: construction holds the slices and one block, never the whole model", "[torch][zero3]") {
  // Measured at LibTorch's CPU allocator, not taken from the engine's accounting.
  built b = build_partitioned(1234);
  counting_cpu_allocator& a = cpu_bytes();
  a.reset();
  const std::int64_t before = a.live_now();
  Stack reference(1234, true);
  const std::int64_t whole_peak = a.peak_now() - before;
  const std::int64_t all = bytes_of(*reference);
  std::int64_t outside = bytes_of(*reference->in) + bytes_of(*reference->out), largest_block = 0, largest_tensor = 0;
  for (auto& blk : reference->blocks) {
    largest_block = std::max(largest_block, bytes_of(*blk));
    for (const auto& p : blk->parameters()) largest_tensor = std::max(largest_tensor, p.numel() * 4);
  }
  INFO("world " << W() << ": built whole " << whole_peak << " bytes, partitioned " << b.peak_bytes << " bytes");
  CHECK(whole_peak >= all);
  // The kept slices, the block being built, the modules outside the blocks, and one
  // tensor's copy while its slice is cut.
  CHECK(b.peak_bytes <= b.kept * 4 + largest_block + outside + largest_tensor);
  if (W() > 1) CHECK(b.peak_bytes < whole_peak);
}

TEST_CASE("zero_init: the first forward gathers unit by unit", "[torch][zero3]") {
  built b = build_partitioned(1234);
  auto e = mt::initialize(b.model, config(3, "fp32", 0), world());
  // threshold 0: in and out are partitioned too (built whole: engine.forward holds them
  // for the pass); the blocks were built partitioned, so they are units from the start.
  std::int64_t outside = 0, largest_block = 0;
  for (const auto& p : e.parameters()) {
    const bool in_block = std::any_of(b.model->blocks.begin(), b.model->blocks.end(), [&](Block& blk) {
      for (const auto& q : blk->parameters())
        if (q.is_same(p)) return true;
      return false;
    });
    if (!in_block) outside += numel_of(e.parameter_shape(p));
  }
  for (auto& blk : b.model->blocks) {
    std::int64_t n = 0;
    for (const auto& q : blk->parameters()) n += numel_of(e.parameter_shape(q));
    largest_block = std::max(largest_block, n);
  }
  std::int64_t most = 0;
  probe = [&](const char*) { most = std::max(most, static_cast<std::int64_t>(e.gathered_numel())); };
  const batch d = data(0, R());
  Tensor loss = e.forward(d.x, d.y);
  loss.backward();
  probe = nullptr;
  e.step();
  INFO("outside the blocks " << outside << ", largest block " << largest_block << ", most gathered " << most);
  // The prefetch may hold the next block while one computes.
  CHECK(most <= outside + 2 * largest_block);
  CHECK(most < outside + 3 * largest_block);
}

TEST_CASE("zero_init: ranks that built other values, or for another world, are refused", "[torch][zero3]") {
  {
    built b = build_partitioned(W() > 1 && R() == 1 ? 99 : 1234);
    if (W() > 1) {
      try {
        mt::initialize(b.model, config(3, "fp32", 32), world());
        FAIL("no error");
      } catch (const std::exception& ex) {
        CHECK_THAT(ex.what(), Catch::Contains("was built with other values on this rank than on the others") ||
                                  Catch::Contains("failed (its exception says why)"));
      }
    }
  }
  Stack m{nullptr};
  {
    mt::zero_init scope(W() + 1, 0);
    m = Stack(1234, true);
  }
  REQUIRE_THROWS_WITH(mt::initialize(m, config(3, "fp32", 32), world()),
                      Catch::Contains("was built partitioned for rank 0 of " + std::to_string(W() + 1)) &&
                          Catch::Contains("zero_init(comm)"));
  REQUIRE_THROWS_WITH(mt::zero_init(2, 2), Catch::Contains("world_size 2 and rank 2 are not a rank of a world"));
}

// ---- frozen parameters at ZeRO-3 -----------------------------------------------------------

namespace {

// Every block's `up` layer frozen: a frozen base under trainable layers, as with LoRA.
void freeze_up(Stack& m) {
  for (auto& b : m->blocks)
    for (auto& p : b->up->parameters()) p.requires_grad_(false);
}

}  // namespace

TEST_CASE("zero3: frozen parameters are partitioned too, gathered around their unit, never given state",
          "[torch][zero3]") {
  // Built whole, or under zero_init; with the blocks through gathered_forward, or not
  // (then the frozen weights are gathered as operations read them).
  const int variant = GENERATE(0, 1, 2);
  const bool built = variant == 1, units = variant != 2;
  INFO((built ? "built partitioned" : "built whole") << (units ? "" : ", no units") << ", world " << W());
  Stack m2(1234, units);
  freeze_up(m2);
  auto z2 = mt::initialize(m2, config(2, "fp32", 32), world());
  Stack m3 = built ? build_partitioned(1234).model : Stack(1234, units);
  freeze_up(m3);
  json c3 = config(3, "fp32", 32);
  c3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
  auto z3 = mt::initialize(m3, c3, world());
  REQUIRE(z3.parameters().size() == z2.parameters().size());  // frozen: not managed
  // The frozen weights (32 x 16 = 512 elements) are empty between forwards; their biases
  // (32, at the threshold) stay whole.
  for (auto& b : m3->blocks) {
    CHECK(b->up->weight.numel() == 0);
    CHECK(b->up->bias.numel() == 32);
  }
  std::int64_t most = 0;
  probe = [&](const char*) { most = std::max(most, static_cast<std::int64_t>(z3.gathered_numel())); };
  for (int k = 0; k < 4; ++k) {
    INFO("micro-step " << k);
    REQUIRE(micro_step(z2, k) == micro_step(z3, k));
    CHECK(z3.gathered_numel() == 0);
    for (auto& b : m3->blocks) CHECK(b->up->weight.numel() == 0);
  }
  probe = nullptr;
  CHECK(most >= 512);  // a block's frozen weight was gathered for its unit, or for the operations that read it
  require_equal(whole_params(z2), whole_params(z3), "master weights after 4 micro-steps");
  // The frozen weights are whole, unchanged, in what save_16bit_model writes.
  shared_dir dir;
  z3.save_16bit_model(dir.path.string());
  MPI_Barrier(MPI_COMM_WORLD);
  if (R() == 0) {
    std::ifstream in(dir.path / "pytorch_model.bin", std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto saved = torch::jit::pickle_load(bytes).toGenericDict();
    for (int k = 0; k < 3; ++k) {
      const std::string name = "block" + std::to_string(k) + ".up.weight";
      INFO(name);
      REQUIRE(torch::equal(saved.at(name).toTensor(), m2->blocks[static_cast<std::size_t>(k)]->up->weight.detach()));
    }
  }
  // A checkpoint of the stage-3 engine loads into the stage-2 one and back, frozen slices included.
  z3.save_checkpoint(dir.path.string(), "frozen");
  {
    torch::NoGradGuard ng;
    for (auto& b : m2->blocks) b->up->weight.zero_();
  }
  z2.load_checkpoint(dir.path.string(), "frozen");
  for (int k = 4; k < 6; ++k) REQUIRE(micro_step(z2, k) == micro_step(z3, k));
  // And into the stage-3 engine (each rank's frozen slices from the whole saved values).
  z2.load_checkpoint(dir.path.string(), "frozen");
  z3.load_checkpoint(dir.path.string(), "frozen");
  for (int k = 6; k < 8; ++k) REQUIRE(micro_step(z2, k) == micro_step(z3, k));
  require_equal(whole_params(z2), whole_params(z3), "master weights after the loads");
}

TEST_CASE("zero3: load_checkpoint reads only what the shard files do not hold, never the whole model",
          "[torch][zero3][checkpoint]") {
  // Measured at LibTorch's CPU allocator: the managed parameters come from the shards
  // (the core's own memory); model_states.pt's records of them are not read.
  shared_dir dir;
  auto z3 = mt::initialize(Stack(1234, true), config(3, "fp32", 32), world());
  for (int k = 0; k < 2; ++k) micro_step(z3, k);
  z3.save_checkpoint(dir.path.string(), "t");
  std::int64_t whole = 0;
  for (const auto& p : z3.parameters()) whole += numel_of(z3.parameter_shape(p)) * 4;
  counting_cpu_allocator& a = cpu_bytes();
  a.reset();
  const std::int64_t before = a.live_now();
  z3.load_checkpoint(dir.path.string(), "t");
  const std::int64_t peak = a.peak_now() - before;
  INFO("whole model " << whole << " bytes, load peak " << peak << " bytes");
  CHECK(peak < whole / 2);
  // And the run goes on as one that was not reloaded.
  auto ref = mt::initialize(Stack(1234, true), config(3, "fp32", 32), world());
  for (int k = 0; k < 2; ++k) micro_step(ref, k);
  for (int k = 2; k < 4; ++k) REQUIRE(micro_step(ref, k) == micro_step(z3, k));
}

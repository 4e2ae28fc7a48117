// engine.save_checkpoint / load_checkpoint under mpirun (1 and 2 ranks).
//
// A run interrupted by a save, and resumed by a new engine on a model with other values,
// ends bit for bit where an uninterrupted run ends: master weights, parameters, frozen
// parameters, buffers, counters, learning rate and loss scale. A checkpoint also loads at
// another stage and world size, module-only, and every bad input is refused on every
// rank with a message, changing nothing.
#include "support/torch_mpi.hpp"  // LibTorch, then Catch and MPI
#include "support/shared_dir.hpp"
#include "support/torch_reference.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace mpzero::testing;  // mt, Tensor, json, world(), W(), R()
namespace fs = std::filesystem;

namespace {

// Two Linear(4, 4) layers, a frozen bias and a buffer that counts forwards.
struct CkNetImpl : two_linear {
  Tensor shift, seen;
  explicit CkNetImpl(std::uint64_t seed) : two_linear(seed) {
    shift = register_parameter("shift", ::torch::randn({4}), /*requires_grad=*/false);
    seen = register_buffer("seen", ::torch::zeros({1}));
  }
  Tensor forward(const Tensor& x, const Tensor& y) {
    {
      ::torch::NoGradGuard ng;
      seen.add_(1);
    }
    return ::torch::mse_loss(l2(l1(x) + shift).to(::torch::kFloat), y);
  }
};
TORCH_MODULE(CkNet);

using mpzero::testing::shared_dir;

json config(int stage, const std::string& prec) {
  json extra = {{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 10}}}}}};
  if (prec == "bf16") extra["bf16"] = {{"enabled", true}};
  if (prec == "fp16") extra["fp16"] = {{"enabled", true}, {"initial_scale_power", 8}, {"loss_scale_window", 1}};
  return engine_config(stage, 2, 1e-2, extra);
}

at::ScalarType compute_dtype(const std::string& prec) {
  return prec == "bf16" ? ::torch::kBFloat16 : prec == "fp16" ? ::torch::kHalf : ::torch::kFloat;
}

// Micro-steps [first, last) of rank R(): forward, backward (scaled under fp16), step.
void train(mt::engine<CkNet>& e, at::ScalarType dt, int first, int last) {
  for (int k = first; k < last; ++k) {
    const batch b = random_batch(static_cast<std::uint64_t>(1000 * k + R() + 1));
    e.backward(e(b.x.to(dt), b.y));
    e.step();
  }
}

// Everything a run ends with.
struct state {
  std::vector<Tensor> master, params;
  Tensor shift, seen;
  std::uint64_t global_steps = 0, micro_steps = 0, skipped_steps = 0;
  double lr = 0, loss_scale = 0;
};
state take(mt::engine<CkNet>& e) {
  state s;
  s.master = e.master_weights();
  for (const auto& p : e.parameters()) s.params.push_back(p.detach().clone());
  s.shift = e.module()->shift.detach().clone();
  s.seen = e.module()->seen.detach().clone();
  s.global_steps = e.global_steps();
  s.micro_steps = e.micro_steps();
  s.skipped_steps = e.skipped_steps();
  s.lr = e.get_lr();
  s.loss_scale = e.loss_scale();
  return s;
}
bool same(const Tensor& a, const Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && ::torch::equal(a, b);
}
void require_same(const state& got, const state& want, bool counters = true) {
  REQUIRE(got.master.size() == want.master.size());
  for (std::size_t i = 0; i < got.master.size(); ++i) {
    INFO("parameter " << i);
    REQUIRE(same(got.master[i], want.master[i]));
    REQUIRE(same(got.params[i], want.params[i]));
  }
  REQUIRE(same(got.shift, want.shift));
  REQUIRE(same(got.seen, want.seen));
  if (counters) {
    REQUIRE(got.global_steps == want.global_steps);
    REQUIRE(got.micro_steps == want.micro_steps);
    REQUIRE(got.skipped_steps == want.skipped_steps);
    REQUIRE(got.lr == want.lr);
    REQUIRE(got.loss_scale == want.loss_scale);
  }
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("engine checkpoint: a resumed run ends bit for bit where an uninterrupted one ends", "[checkpoint]") {
  const int stage = GENERATE(0, 1, 2);
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"), std::string("fp16"));
  const at::ScalarType dt = compute_dtype(prec);
  INFO("stage " << stage << ", " << prec << ", world " << W());
  state straight;
  {
    auto e = mt::initialize(CkNet(7), config(stage, prec), world());
    train(e, dt, 0, 8);
    straight = take(e);
  }
  shared_dir dir;
  {
    auto e = mt::initialize(CkNet(7), config(stage, prec), world());
    train(e, dt, 0, 4);
    e.save_checkpoint(dir.path.string(), "", {{"epoch", 3}, {"note", "mid-run"}});
  }
  REQUIRE(fs::exists(dir.path / "latest"));
  auto e = mt::initialize(CkNet(99), config(stage, prec), world());  // other values everywhere
  const auto got = e.load_checkpoint(dir.path.string());
  REQUIRE(got.has_value());
  REQUIRE(got->path == (dir.path / "global_step2").string());
  REQUIRE(got->client_state == json{{"epoch", 3}, {"note", "mid-run"}});
  REQUIRE(e.global_steps() == 2);
  train(e, dt, 4, 8);
  require_same(take(e), straight);
  if (prec == "fp16") REQUIRE(straight.loss_scale > 256.0);  // the scaler's growth carried over
}

TEST_CASE("engine checkpoint: loads at another stage and world size, and module-only", "[checkpoint]") {
  shared_dir dir;
  state saved;
  {
    auto e = mt::initialize(CkNet(7), config(2, "bf16"), world());
    train(e, ::torch::kBFloat16, 0, 6);
    saved = take(e);
    e.save_checkpoint(dir.path.string(), "mine");
  }
  SECTION("stage 0 and stage 1, same world") {
    for (int stage : {0, 1}) {
      auto e = mt::initialize(CkNet(99), config(stage, "bf16"), world());
      REQUIRE(e.load_checkpoint(dir.path.string(), "mine").has_value());
      require_same(take(e), saved);
    }
  }
  SECTION("one rank alone") {
    if (R() == 0) {
      mpzero::comm::mpi_communicator self(MPI_COMM_SELF, mpzero::comm::mpi_options{60.0});
      auto e = mt::initialize(CkNet(99), config(1, "bf16"), self);
      REQUIRE(e.load_checkpoint(dir.path.string()).has_value());  // through 'latest'
      require_same(take(e), saved);
    }
  }
  SECTION("module only: the values, with fresh counters and optimizer states") {
    auto e = mt::initialize(CkNet(99), config(1, "fp32"), world());
    REQUIRE(e.load_checkpoint(dir.path.string(), "mine", /*load_module_only=*/true).has_value());
    REQUIRE(e.global_steps() == 0);
    for (std::size_t i = 0; i < saved.params.size(); ++i) {
      REQUIRE(same(e.parameters()[i], saved.params[i].to(::torch::kFloat)));
      REQUIRE(same(e.master_weights()[i], saved.params[i].to(::torch::kFloat)));
    }
    REQUIRE(same(e.module()->shift, saved.shift.to(::torch::kFloat)));
  }
}

TEST_CASE("engine checkpoint: bad input is refused on every rank with a message, changing nothing", "[checkpoint]") {
  shared_dir dir;
  {
    auto e = mt::initialize(CkNet(7), config(2, "bf16"), world());
    train(e, ::torch::kBFloat16, 0, 2);
    e.save_checkpoint(dir.path.string());
  }
  auto e = mt::initialize(CkNet(99), config(1, "bf16"), world());
  train(e, ::torch::kBFloat16, 0, 2);
  const state before = take(e);
  bool counters_kept = true;

  SECTION("nothing saved yet: an empty result, as DeepSpeed's None") {
    shared_dir empty;
    REQUIRE_FALSE(e.load_checkpoint(empty.path.string()).has_value());
  }
  SECTION("a tag that is not there") {
    REQUIRE_THAT(error_of([&] { e.load_checkpoint(dir.path.string(), "global_step7"); }),
                 Catch::Contains("global_step7/mpzero_engine.json") && Catch::Contains("no such file"));
  }
  SECTION("a tag that is not a directory name") {
    REQUIRE_THAT(error_of([&] { e.save_checkpoint(dir.path.string(), "a/b"); }),
                 Catch::Contains("tag 'a/b' is not a directory name"));
  }
  SECTION("another model") {
    struct OtherImpl : ::torch::nn::Module {
      ::torch::nn::Linear l1{nullptr}, l2{nullptr};
      OtherImpl() {
        l1 = register_module("l1", ::torch::nn::Linear(4, 5));
        l2 = register_module("l2", ::torch::nn::Linear(5, 4));
      }
      Tensor forward(const Tensor& x) { return l2(l1(x)); }
    };
    auto other = mt::initialize(std::make_shared<OtherImpl>(), config(1, "bf16"), world());
    REQUIRE_THAT(error_of([&] { other.load_checkpoint(dir.path.string()); }),
                 Catch::Contains("'l1.weight' of shape [4, 4]") && Catch::Contains("'l1.weight' of shape [5, 4] here"));
  }
  SECTION("a model with a buffer the checkpoint lacks") {
    CkNet m(99);
    m->register_buffer("extra", ::torch::zeros({2}));
    auto x = mt::initialize(m, config(1, "bf16"), world());
    REQUIRE_THAT(error_of([&] { x.load_checkpoint(dir.path.string()); }),
                 Catch::Contains("has no 'extra', which this model has"));
  }
  SECTION("mid-accumulation (gradient_accumulation_steps = 2): save and load are refused") {
    const batch b = random_batch(5);
    e.backward(e(b.x.to(::torch::kBFloat16), b.y));
    e.step();  // micro-step 1 of 2: no update
    REQUIRE_THAT(error_of([&] { e.save_checkpoint(dir.path.string(), "mid"); }),
                 Catch::Contains("accumulation boundary"));
    REQUIRE_THAT(error_of([&] { e.load_checkpoint(dir.path.string()); }), Catch::Contains("accumulation boundary"));
    REQUIRE_FALSE(fs::exists(dir.path / "mid"));
    e.zero_grad();
    counters_kept = false;  // the micro-step counted
  }
  SECTION("a different tag on each rank") {
    if (W() > 1) {
      REQUIRE_THAT(error_of([&] { e.save_checkpoint(dir.path.string(), "t" + std::to_string(R())); }),
                   Catch::Contains("the ranks passed different arguments (this rank: tag 't" + std::to_string(R()) +
                                   "', save_latest true)"));
    }
  }
  SECTION("arguments that differ between ranks") {
    if (W() > 1) {
      REQUIRE_THAT(error_of([&] { e.load_checkpoint(dir.path.string(), "", /*load_module_only=*/R() == 0); }),
                   Catch::Contains("the ranks passed different arguments") && Catch::Contains("load_module_only"));
      REQUIRE_THAT(error_of([&] { e.save_checkpoint(dir.path.string(), "x", json::object(), R() == 0); }),
                   Catch::Contains("the ranks passed different arguments") && Catch::Contains("save_latest"));
    }
  }
  SECTION("engine files of another save than the shards beside them") {
    e.save_checkpoint(dir.path.string(), "other");
    MPI_Barrier(MPI_COMM_WORLD);
    if (R() == 0) {
      for (const char* f : {"mpzero_engine.json", "model_states.pt"}) {
        fs::copy_file(dir.path / "other" / f, dir.path / "global_step1" / f, fs::copy_options::overwrite_existing);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    REQUIRE_THAT(error_of([&] { e.load_checkpoint(dir.path.string(), "global_step1"); }),
                 Catch::Contains("come from different saves"));
    if (R() == 0) fs::copy_file(dir.path / "other" / "zero_shard_00000.mpz", dir.path / "global_step1" / "zero_shard_00000.mpz", fs::copy_options::overwrite_existing);
    MPI_Barrier(MPI_COMM_WORLD);
    if (W() == 1) {  // now the engine files and the only shard agree again
      REQUIRE(e.load_checkpoint(dir.path.string(), "global_step1").has_value());
    }
  }
  SECTION("a damaged module file") {
    MPI_Barrier(MPI_COMM_WORLD);
    if (R() == 0) std::ofstream(dir.path / "global_step1" / "model_states.pt", std::ios::trunc) << "not a pickle";
    MPI_Barrier(MPI_COMM_WORLD);
    REQUIRE_THAT(error_of([&] { e.load_checkpoint(dir.path.string()); }),
                 Catch::Contains("is not a module state save_checkpoint wrote"));
  }
  {
    ::torch::NoGradGuard ng;
    e.module()->seen.copy_(before.seen);  // the refused cases' forwards counted too
  }
  require_same(take(e), before, counters_kept);
}

TEST_CASE("engine checkpoint: Python's torch.load reads model_states.pt", "[checkpoint]") {
  if (W() != 1) return;  // one process runs Python (the np1 run)
#ifndef MPZERO_TEST_PYTHON
  WARN("no python3 with torch was found when this build was configured: not checked");
  return;
#else
  const std::string python = MPZERO_TEST_PYTHON;
  shared_dir dir;
  auto e = mt::initialize(CkNet(7), config(1, "bf16"), world());
  train(e, ::torch::kBFloat16, 0, 4);
  e.save_checkpoint(dir.path.string());
  // Python prints each entry's name, dtype and exact sum; they must be this module's.
  const std::string script =
      "import sys, torch, torch.jit._pickle\n"
      "with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):\n"
      "    d = torch.load(sys.argv[1], weights_only=True)\n"
      "print('global_steps', d['global_steps'])\n"
      "for k, v in d['module'].items(): print(k, str(v.dtype), repr(float(v.double().sum())))\n";
  std::ofstream(dir.path / "read.py") << script;
  const std::string cmd = python + " " + (dir.path / "read.py").string() + " " +
                          (dir.path / "global_step2" / "model_states.pt").string();
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");  // Python's errors go to the test's stderr
  REQUIRE(f != nullptr);
  char buf[512];
  while (fgets(buf, sizeof buf, f)) out += buf;
  INFO(out);
  REQUIRE(pclose(f) == 0);
  std::istringstream lines(out);
  std::string key, dt;
  std::int64_t steps = -1;
  lines >> key >> steps;
  REQUIRE(key == "global_steps");
  REQUIRE(steps == 2);
  std::map<std::string, std::pair<std::string, double>> got;
  double sum = 0;
  while (lines >> key >> dt >> sum) got[key] = {dt, sum};
  std::map<std::string, Tensor> want;
  for (const auto& p : e.module()->named_parameters()) want[p.key()] = p.value();
  for (const auto& b : e.module()->named_buffers()) want[b.key()] = b.value();
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    REQUIRE(got[name].first == "torch.bfloat16");  // the module computes in bf16
    REQUIRE(got[name].second == t.to(::torch::kDouble).sum().item<double>());
  }
#endif
}

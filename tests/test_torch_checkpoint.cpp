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

#include <mpzero/numeric/rounding_bits.hpp>
#include <mpzero/torch/zero_to_fp32.hpp>
#include <torch/csrc/jit/serialization/pickle.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
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

// Runs a shell command; its standard output and exit status (stderr goes to the test's).
std::pair<std::string, int> run_command(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return {"popen failed", -1};
  char buf[512];
  while (fgets(buf, sizeof buf, f)) out += buf;
  const int status = pclose(f);
  return {out, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

// name -> (dtype, exact sum) lines, as the Python scripts below print them.
std::map<std::string, std::pair<std::string, double>> parse_sums(std::istream& lines) {
  std::map<std::string, std::pair<std::string, double>> got;
  std::string key, dt;
  double sum = 0;
  while (lines >> key >> dt >> sum) got[key] = {dt, sum};
  return got;
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

TEST_CASE("engine checkpoint: a checkpoint of another stochastic-rounding stream loads, and says so", "[checkpoint]") {
  json cfg = config(1, "bf16");
  cfg["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}};
  cfg["rounding"] = "stochastic";
  cfg["seed"] = 5;
  shared_dir dir;
  state saved;
  {
    auto e = mt::initialize(CkNet(7), cfg, world());
    train(e, ::torch::kBFloat16, 0, 2);
    e.save_checkpoint(dir.path.string(), "t");
    saved = take(e);
  }
  // Stream 1 in every shard file: byte 6 of the dtype row, at offset 46
  // (mpzero/zero/checkpoint.hpp's layout).
  MPI_Barrier(MPI_COMM_WORLD);
  int patched = 0;
  if (R() == 0) {
    for (const auto& f : fs::recursive_directory_iterator(dir.path / "t")) {
      if (f.path().extension() != ".mpz") continue;
      std::fstream io(f.path(), std::ios::binary | std::ios::in | std::ios::out);
      io.seekg(46);
      char was = 0;
      io.read(&was, 1);
      CHECK(static_cast<int>(was) == static_cast<int>(mpzero::rounding_stream));
      io.seekp(46);
      const char one = 1;
      io.write(&one, 1);
      ++patched;
    }
    CHECK(patched >= 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto e = mt::initialize(CkNet(99), cfg, world());
  // What the load prints on stderr, through a file in place of descriptor 2.
  std::fflush(stderr);
  const fs::path log = dir.path / ("stderr_" + std::to_string(R()));
  const int saved_fd = dup(2);
  FILE* f = std::fopen(log.c_str(), "w");
  REQUIRE(f != nullptr);
  dup2(fileno(f), 2);
  const auto got = e.load_checkpoint(dir.path.string(), "t");
  std::fflush(stderr);
  dup2(saved_fd, 2);
  close(saved_fd);
  std::fclose(f);
  REQUIRE(got.has_value());
  require_same(take(e), saved);  // the values load exactly
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (R() == 0) {
    CHECK_THAT(text, Catch::Contains("written with stochastic-rounding stream 1; this build draws stream 3") &&
                         Catch::Contains("The loaded values are exact"));
  } else {
    CHECK(text.find("stochastic-rounding stream") == std::string::npos);  // said once, by rank 0
  }
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
  SECTION("a model_states.pt with TorchScript's type tags (torch::pickle_save; mpzero before 2026-11-22)") {
    const fs::path file = dir.path / "mine" / "model_states.pt";
    if (R() == 0) {
      std::ifstream in(file, std::ios::binary);
      const std::vector<char> now((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      in.close();
      const std::vector<char> tagged = ::torch::jit::pickle_save(::torch::jit::pickle_load(now));
      REQUIRE(std::string_view(tagged.data(), tagged.size()).find("restore_type_tag") != std::string_view::npos);
      REQUIRE(std::string_view(now.data(), now.size()).find("restore_type_tag") == std::string_view::npos);
      std::ofstream(file, std::ios::binary | std::ios::trunc).write(tagged.data(), static_cast<std::streamsize>(tagged.size()));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    auto e = mt::initialize(CkNet(99), config(2, "bf16"), world());
    REQUIRE(e.load_checkpoint(dir.path.string(), "mine").has_value());
    require_same(take(e), saved);
  }
  SECTION("another precision: fp32 and fp16 engines load the bf16 save's fp32 master weights, and train on") {
    for (const std::string prec : {"fp32", "fp16"}) {
      INFO(prec);
      const at::ScalarType dt = compute_dtype(prec);
      auto e = mt::initialize(CkNet(99), config(2, prec), world());
      REQUIRE(e.load_checkpoint(dir.path.string(), "mine").has_value());
      const state got = take(e);
      REQUIRE(got.master.size() == saved.master.size());
      for (std::size_t i = 0; i < saved.master.size(); ++i) {
        INFO("parameter " << i);
        REQUIRE(same(got.master[i], saved.master[i]));           // fp32 in both: as saved
        REQUIRE(same(got.params[i], saved.master[i].to(dt)));    // rounded once from the master
      }
      REQUIRE(same(got.shift, saved.shift.to(dt)));  // frozen: the saved bf16 values, widened exactly
      REQUIRE(same(got.seen, saved.seen.to(dt)));
      REQUIRE(got.global_steps == saved.global_steps);
      REQUIRE(got.lr == saved.lr);
      train(e, dt, 6, 8);
      REQUIRE(e.global_steps() == saved.global_steps + 1);
      REQUIRE(e.skipped_steps() == 0);
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
  SECTION("a tag that a load could not find again") {
    for (const std::string tag : {"run1 ", " run1", "latest", "a\tb"}) {
      INFO("tag '" << tag << "'");
      REQUIRE_THAT(error_of([&] { e.save_checkpoint(dir.path.string(), tag); }),
                   Catch::Contains("the checkpoint tag '" + tag + "' cannot be found again by a load") &&
                       Catch::Contains("global_step100"));
    }
    REQUIRE_FALSE(std::filesystem::exists(dir.path / "latest" / "mpzero_engine.json"));
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
      "import sys, torch\n"
      "d = torch.load(sys.argv[1], weights_only=True)\n"
      "print('global_steps', d['global_steps'])\n"
      "for k, v in d['module'].items(): print(k, str(v.dtype), repr(float(v.double().sum())))\n";
  std::ofstream(dir.path / "read.py") << script;
  const auto [out, rc] = run_command(python + " " + (dir.path / "read.py").string() + " " +
                                     (dir.path / "global_step2" / "model_states.pt").string());
  INFO(out);
  REQUIRE(rc == 0);
  std::istringstream lines(out);
  std::string key;
  std::int64_t steps = -1;
  lines >> key >> steps;
  REQUIRE(key == "global_steps");
  REQUIRE(steps == 2);
  auto got = parse_sums(lines);
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

// ---- the fp32 export (zero_to_fp32.hpp) ------------------------------------------------

namespace {

// The module's names in its order (parameters, then buffers), and what the export must
// hold for each: the master weights for trainable parameters, the values in fp32 else.
std::vector<std::pair<std::string, Tensor>> expected_fp32(mt::engine<CkNet>& e, const std::vector<Tensor>& master) {
  std::map<const void*, std::size_t> managed;
  for (std::size_t i = 0; i < e.parameters().size(); ++i) managed[e.parameters()[i].unsafeGetTensorImpl()] = i;
  std::vector<std::pair<std::string, Tensor>> want;
  for (const auto& p : e.module()->named_parameters()) {
    const auto it = managed.find(p.value().unsafeGetTensorImpl());
    want.emplace_back(p.key(), it != managed.end() ? master[it->second].cpu() : p.value().detach().to(::torch::kFloat));
  }
  for (const auto& b : e.module()->named_buffers()) want.emplace_back(b.key(), b.value().detach().to(::torch::kFloat));
  return want;
}

void require_export(const ::torch::OrderedDict<std::string, Tensor>& got,
                    const std::vector<std::pair<std::string, Tensor>>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO(want[i].first);
    REQUIRE(got.keys()[i] == want[i].first);  // the module's order
    REQUIRE(same(got.values()[i], want[i].second));
  }
}

}  // namespace

TEST_CASE("engine checkpoint: one fp32 state dict from the shards of any world size (zero_to_fp32)", "[checkpoint]") {
  // fp16 and bf16 keep an fp32 master apart from the parameters; bf16 stage 0 and fp32
  // write one shard file, stages 1-2 one per rank.
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"), std::string("fp16"));
  const int stage = GENERATE(0, 2);
  INFO(prec << ", stage " << stage << ", world " << W());
  shared_dir dir;
  auto e = mt::initialize(CkNet(7), config(stage, prec), world());
  train(e, compute_dtype(prec), 0, 6);
  e.save_checkpoint(dir.path.string(), "", {{"epoch", 1}});
  const auto master = e.master_weights();  // collective: every rank
  const auto want = expected_fp32(e, master);
  if (prec != "fp32") {
    // The point of the export: the master weights, not the rounded parameters.
    bool finer = false;
    for (std::size_t i = 0; i < e.parameters().size(); ++i) {
      finer = finer || !::torch::equal(master[i].cpu(), e.parameters()[i].detach().to(::torch::kFloat).cpu());
    }
    REQUIRE(finer);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (R() == 0) {
    require_export(mt::fp32_state_dict_from_checkpoint(dir.path.string()), want);  // through 'latest'
    require_export(mt::fp32_state_dict_from_checkpoint(dir.path.string(), "global_step3"), want);
  }
}

// One weight under two names (a.w and b.w, as a tied embedding and output layer), and a
// bias: the engine manages the weight once.
struct TiedImpl : ::torch::nn::Module {
  struct Holder : ::torch::nn::Module {
    Tensor w;
    explicit Holder(const Tensor& t) { w = register_parameter("w", t); }
  };
  std::shared_ptr<Holder> a, b;
  Tensor bias;
  TiedImpl() {
    ::torch::manual_seed(3);
    const Tensor w = ::torch::randn({4, 4}) * 0.5;
    a = register_module("a", std::make_shared<Holder>(w));
    b = register_module("b", std::make_shared<Holder>(w));
    bias = register_parameter("bias", ::torch::zeros({4}));
  }
  Tensor forward(const Tensor& x, const Tensor& y) {
    return ::torch::mse_loss((::torch::relu(x.matmul(a->w)).matmul(b->w) + bias).to(::torch::kFloat), y);
  }
};

TEST_CASE("engine checkpoint: the fp32 export gives every name of a tied weight its master weights", "[checkpoint]") {
  shared_dir dir;
  auto e = mt::initialize(std::make_shared<TiedImpl>(), config(2, "bf16"), world());
  REQUIRE(e.parameters().size() == 2);  // a.w (= b.w) and bias
  for (int k = 0; k < 6; ++k) {
    const batch b = random_batch(static_cast<std::uint64_t>(1000 * k + R() + 1));
    e.backward(e(b.x.to(::torch::kBFloat16), b.y));
    e.step();
  }
  e.save_checkpoint(dir.path.string());
  const auto master = e.master_weights();
  MPI_Barrier(MPI_COMM_WORLD);
  if (R() == 0) {
    const auto& names = e.parameter_names();
    const std::size_t w = static_cast<std::size_t>(std::find(names.begin(), names.end(), "a.w") - names.begin());
    const std::size_t bias = static_cast<std::size_t>(std::find(names.begin(), names.end(), "bias") - names.begin());
    REQUIRE((w < 2 && bias < 2));
    const auto sd = mt::fp32_state_dict_from_checkpoint(dir.path.string());
    REQUIRE(sd.keys() == std::vector<std::string>{"bias", "a.w", "b.w"});
    REQUIRE_FALSE(::torch::equal(master[w], e.parameters()[w].detach().to(::torch::kFloat)));  // bf16 rounds
    REQUIRE(same(sd["a.w"], master[w]));
    REQUIRE(same(sd["b.w"], master[w]));  // not the saved bf16 copy
    REQUIRE(same(sd["bias"], master[bias]));
  }
}

TEST_CASE("engine checkpoint: the fp32 export refuses what it cannot read, naming it", "[checkpoint]") {
  shared_dir dir;
  {
    auto e = mt::initialize(CkNet(7), config(2, "bf16"), world());
    train(e, ::torch::kBFloat16, 0, 2);
    e.save_checkpoint(dir.path.string());
    e.save_checkpoint(dir.path.string(), "other", json::object(), /*save_latest=*/false);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (R() == 0) {  // one process (the export is not collective), and no SECTIONs: rank 1 does not repeat the case
    const std::string d = dir.path.string();
    const fs::path mine = dir.path / "global_step1", other = dir.path / "other";
    REQUIRE(mt::fp32_state_dict_from_checkpoint(d).size() == 6);  // l1, l2 weights and biases, shift, seen

    REQUIRE_THAT(error_of([&] { mt::fp32_state_dict_from_checkpoint((dir.path / "nothing").string()); }),
                 Catch::Contains("nothing/latest' does not exist") && Catch::Contains("pass the tag"));
    REQUIRE_THAT(error_of([&] { mt::fp32_state_dict_from_checkpoint(d, "global_step9"); }),
                 Catch::Contains("global_step9/mpzero_engine.json") && Catch::Contains("no such file"));
    REQUIRE_THAT(error_of([&] { mt::fp32_state_dict_from_checkpoint(d, "../x"); }),
                 Catch::Contains("tag '../x' is not a directory name"));
    // An output file that cannot be created, or written but not renamed into place (a
    // directory holds its name): an error naming it, and nothing left behind.
    const fs::path out = dir.path / "no" / "such" / "dir" / "model.safetensors";
    REQUIRE_THAT(error_of([&] { mt::convert_checkpoint_to_fp32_state_dict(d, out.string()); }),
                 Catch::Contains("cannot create") && Catch::Contains("model.safetensors.tmp"));
    REQUIRE_FALSE(fs::exists(out.parent_path()));
    for (const char* name : {"taken.safetensors", "taken.pt"}) {
      const fs::path taken = dir.path / name;
      fs::create_directory(taken);
      REQUIRE_THAT(error_of([&] { mt::convert_checkpoint_to_fp32_state_dict(d, taken.string()); }),
                   Catch::Contains("cannot rename") && Catch::Contains(std::string(name) + ".tmp"));
      REQUIRE(fs::is_directory(taken));
      REQUIRE_FALSE(fs::exists(dir.path / (std::string(name) + ".tmp")));
    }

    // Files of another save beside the shards, one at a time (each put back after).
    for (const char* f : {"model_states.pt", "mpzero_engine.json"}) {
      INFO(f);
      fs::copy_file(mine / f, dir.path / "kept", fs::copy_options::overwrite_existing);
      fs::copy_file(other / f, mine / f, fs::copy_options::overwrite_existing);
      REQUIRE_THAT(error_of([&] { mt::fp32_state_dict_from_checkpoint(d); }), Catch::Contains("come from different saves"));
      fs::copy_file(dir.path / "kept", mine / f, fs::copy_options::overwrite_existing);
    }
    REQUIRE(mt::fp32_state_dict_from_checkpoint(d).size() == 6);
    if (W() > 1) {
      fs::remove(mine / "zero_shard_00001.mpz");
      REQUIRE_THAT(error_of([&] { mt::fp32_state_dict_from_checkpoint(d); }),
                   Catch::Contains("zero_shard_00001.mpz") && Catch::Contains("no such file"));
    }
  }
}

TEST_CASE("engine checkpoint: the mpzero_zero_to_fp32 tool writes files torch reads back", "[checkpoint]") {
  if (W() != 1) return;  // one process runs the tool (the np1 run)
  shared_dir dir;
  auto e = mt::initialize(CkNet(7), config(1, "bf16"), world());
  train(e, ::torch::kBFloat16, 0, 4);
  e.save_checkpoint(dir.path.string());
  const auto want = expected_fp32(e, e.master_weights());
  const std::string tool = MPZERO_ZERO_TO_FP32;
  const fs::path pt = dir.path / "model.pt";

  auto [out, rc] = run_command(tool + " " + dir.path.string() + " " + pt.string() + " --tag global_step2");
  INFO(out);
  REQUIRE(rc == 0);
  REQUIRE_THAT(out, Catch::Contains("wrote " + std::to_string(want.size()) + " tensors to " + pt.string()));
  // The .pt file through C++'s pickle_load: the same entries, in order.
  std::ifstream in(pt, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = ::torch::jit::pickle_load(bytes).toGenericDict();
  // A plain dictionary (the zip stores data.pkl uncompressed): Python's weights_only
  // unpickler refuses TorchScript's type tag.
  REQUIRE(std::string_view(bytes.data(), bytes.size()).find("restore_type_tag") == std::string_view::npos);
  ::torch::OrderedDict<std::string, Tensor> back;
  for (const auto& item : dict) back.insert(item.key().toStringRef(), item.value().toTensor());
  require_export(back, want);

  // Bad use: a clear message and exit status 2 (usage) or 1 (the checkpoint).
  std::tie(out, rc) = run_command(tool + " " + dir.path.string() + " 2>&1");
  REQUIRE(rc == 2);
  REQUIRE_THAT(out, Catch::Contains("usage: mpzero_zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE"));
  std::tie(out, rc) = run_command(tool + " " + dir.path.string() + " x.pt --tga 3 2>&1");
  REQUIRE(rc == 2);
  REQUIRE_THAT(out, Catch::Contains("unknown option --tga"));
  std::tie(out, rc) = run_command(tool + " " + dir.path.string() + " x.pt --tag 2>&1");
  REQUIRE(rc == 2);
  REQUIRE_THAT(out, Catch::Contains("--tag needs a value") && Catch::Contains("usage: mpzero_zero_to_fp32"));
  std::tie(out, rc) = run_command(tool + " " + (dir.path / "none").string() + " " + pt.string() + " 2>&1");
  REQUIRE(rc == 1);
  REQUIRE_THAT(out, Catch::Contains("none/latest' does not exist"));
  {
    std::ifstream again(pt, std::ios::binary);  // the earlier output is untouched
    REQUIRE(std::vector<char>((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>()) == bytes);
  }

#ifdef MPZERO_TEST_PYTHON
  // Python reads both formats with its own libraries: safetensors.torch.load_file, and
  // torch.load (weights only) for the pickle. Each prints name, dtype, shape, sum and an
  // order-sensitive sum (element k weighted by k + 1), compared with the C++ side's.
  std::vector<fs::path> files{pt};
#ifdef MPZERO_TEST_SAFETENSORS
  const fs::path st = dir.path / "model.safetensors";
  std::tie(out, rc) = run_command(tool + " " + dir.path.string() + " " + st.string());
  REQUIRE(rc == 0);
  files.push_back(st);
#else
  WARN("the Python that has torch has no safetensors package (scripts/setup.sh installs it): the .safetensors "
       "file is not read back");
#endif
  const std::string script =
      "import sys, torch\n"
      "if sys.argv[1].endswith('.safetensors'):\n"
      "    from safetensors.torch import load_file\n"
      "    d = load_file(sys.argv[1])\n"
      "else:\n"
      "    d = torch.load(sys.argv[1], weights_only=True)\n"
      "for k, v in d.items():\n"
      "    x = v.double().flatten()\n"
      "    w = (x * torch.arange(1, x.numel() + 1, dtype=torch.float64)).sum()\n"
      "    print(k, str(v.dtype), 'x'.join(map(str, v.shape)) or 'scalar', repr(float(x.sum())), repr(float(w)))\n";
  std::ofstream(dir.path / "read_fp32.py") << script;
  for (const fs::path& file : files) {
    INFO(file);
    std::tie(out, rc) = run_command(std::string(MPZERO_TEST_PYTHON) + " " + (dir.path / "read_fp32.py").string() + " " +
                                    file.string());
    INFO(out);
    REQUIRE(rc == 0);
    std::istringstream lines(out);
    std::map<std::string, std::string> got;
    for (std::string line; std::getline(lines, line);) got[line.substr(0, line.find(' '))] = line;
    REQUIRE(got.size() == want.size());
    for (const auto& [name, t] : want) {
      INFO(name);
      const Tensor x = t.to(::torch::kDouble).flatten();
      const Tensor w = (x * ::torch::arange(1, x.numel() + 1, ::torch::kDouble)).sum();
      std::string shape;
      for (auto d : t.sizes()) {
        if (!shape.empty()) shape += 'x';  // piecewise: "x" + to_string trips GCC 12's -Wrestrict false positive
        shape += std::to_string(d);
      }
      REQUIRE(got.count(name) == 1);
      std::istringstream fields(got[name]);
      std::string gname, gdt, gshape;
      double gsum = 0, gw = 0;
      fields >> gname >> gdt >> gshape >> gsum >> gw;
      REQUIRE(gdt == "torch.float32");
      REQUIRE(gshape == (shape.empty() ? "scalar" : shape));
      REQUIRE(gsum == x.sum().item<double>());
      REQUIRE(gw == w.item<double>());
    }
  }
#else
  WARN("no python3 with torch was found when this build was configured: Python's reading not checked");
#endif
}

// ---- engine.save_16bit_model -------------------------------------------------------------

namespace {

// A safetensors file read from its definition: an 8-byte little-endian header size, a
// JSON header {name: {dtype, shape, data_offsets}}, then the bytes.
std::vector<std::pair<std::string, Tensor>> read_safetensors(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), sizeof n);
  std::string head(n, ' ');
  in.read(head.data(), static_cast<std::streamsize>(n));
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto header = nlohmann::ordered_json::parse(head);
  const std::map<std::string, at::ScalarType> types{
      {"F32", ::torch::kFloat}, {"BF16", ::torch::kBFloat16}, {"F16", ::torch::kHalf}};
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const auto begin = v["data_offsets"][0].get<std::size_t>(), end = v["data_offsets"][1].get<std::size_t>();
    REQUIRE(end <= data.size());
    Tensor t = ::torch::empty(v["shape"].get<std::vector<std::int64_t>>(), types.at(v["dtype"].get<std::string>()));
    REQUIRE(static_cast<std::size_t>(t.nbytes()) == end - begin);
    std::memcpy(t.data_ptr(), data.data() + begin, end - begin);
    out.emplace_back(name, t);
  }
  return out;
}

std::vector<std::pair<std::string, Tensor>> read_pt(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& item : ::torch::jit::pickle_load(bytes).toGenericDict()) {
    out.emplace_back(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

// The module's parameters then buffers, whole (ZeRO-3's partitioned parameters from an
// engine at stage 0 trained alike: stages agree bit for bit).
std::vector<std::pair<std::string, Tensor>> module_values(mt::engine<CkNet>& e) {
  std::vector<std::pair<std::string, Tensor>> want;
  for (const auto& p : e.module()->named_parameters()) want.emplace_back(p.key(), p.value().detach().cpu());
  for (const auto& b : e.module()->named_buffers()) want.emplace_back(b.key(), b.value().detach().cpu());
  return want;
}

json config_16bit(int stage, const std::string& prec) {
  json c = config(stage, prec);
  c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;  // every parameter partitioned at stage 3
  c["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = true;
  return c;
}

}  // namespace

TEST_CASE("engine.save_16bit_model: the module's weights in their training dtype, at every stage", "[checkpoint]") {
  const std::string prec = GENERATE(std::string("fp32"), std::string("bf16"), std::string("fp16"));
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string name = GENERATE(std::string("pytorch_model.bin"), std::string("model.safetensors"));
  INFO(prec << ", stage " << stage << ", " << name << ", world " << W());
  shared_dir dir;
  auto reference = mt::initialize(CkNet(7), config_16bit(0, prec), world());
  train(reference, compute_dtype(prec), 0, 4);
  const auto want = module_values(reference);
  auto e = mt::initialize(CkNet(7), config_16bit(stage, prec), world());
  train(e, compute_dtype(prec), 0, 4);
  const std::size_t n = e.save_16bit_model((dir.path / "out").string(), name);
  REQUIRE(n == want.size());
  if (stage == 3) REQUIRE(e.gathered_numel() == 0);  // each gathered for the save alone, then released
  MPI_Barrier(MPI_COMM_WORLD);
  if (R() == 0) {
    const fs::path file = dir.path / "out" / name;
    const auto got = name.ends_with(".safetensors") ? read_safetensors(file) : read_pt(file);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      INFO(want[i].first);
      REQUIRE(got[i].first == want[i].first);  // the module's order
      REQUIRE(same(got[i].second, want[i].second));
    }
    // The trainable weights are in the dtype the model trains in.
    REQUIRE(got[0].second.scalar_type() == compute_dtype(prec));
  }
}

TEST_CASE("engine.save_16bit_model: refusals name the fix and write nothing", "[checkpoint]") {
  shared_dir dir;
  json c = config(3, "bf16");
  c["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  auto e = mt::initialize(CkNet(7), c, world());
  train(e, ::torch::kBFloat16, 0, 2);
  const std::string out = (dir.path / "out").string();
  REQUIRE_THAT(error_of([&] { e.save_16bit_model(out); }),
               Catch::Contains("stage3_gather_16bit_weights_on_model_save is false, so nothing was saved") &&
                   Catch::Contains("set it to true"));
  REQUIRE_THAT(error_of([&] { e.save_16bit_model(out, "sub/model.bin"); }),
               Catch::Contains("save_filename 'sub/model.bin' is not a file name"));
  REQUIRE_THAT(error_of([&] { e.save_16bit_model(out, ""); }), Catch::Contains("save_filename '' is not a file name"));
  MPI_Barrier(MPI_COMM_WORLD);
  REQUIRE(!fs::exists(out));
  // DeepSpeed's older spelling of the key is read too.
  c["zero_optimization"]["stage3_gather_fp16_weights_on_model_save"] = true;
  auto e2 = mt::initialize(CkNet(7), c, world());
  REQUIRE(e2.save_16bit_model(out) == module_values(e2).size());
  if (W() == 1) {
    // A directory where the file would go: every rank learns it, and nothing else changes.
    fs::create_directories(fs::path(out) / "taken.bin");
    REQUIRE_THAT(error_of([&] { e2.save_16bit_model(out, "taken.bin"); }), Catch::Contains("taken.bin"));
  }
}

TEST_CASE("engine.save_16bit_model: Python reads both formats", "[checkpoint]") {
  if (W() != 1) return;  // one process runs Python (the np1 run)
#if !defined(MPZERO_TEST_PYTHON) || !defined(MPZERO_TEST_SAFETENSORS)
  WARN("no python3 with torch and safetensors was found when this build was configured: not checked");
  return;
#else
  shared_dir dir;
  auto e = mt::initialize(CkNet(7), config_16bit(3, "bf16"), world());
  train(e, ::torch::kBFloat16, 0, 3);
  e.save_16bit_model(dir.path.string());
  e.save_16bit_model(dir.path.string(), "model.safetensors");
  const std::string script =
      "import sys, torch\n"
      "from safetensors.torch import load_file\n"
      "a = torch.load(sys.argv[1], weights_only=True)\n"
      "b = load_file(sys.argv[2])\n"
      "assert list(a) == list(b), (list(a), list(b))\n"
      "for k, v in a.items():\n"
      "    assert torch.equal(v, b[k]) and v.dtype == b[k].dtype, k\n"
      "    print(k, str(v.dtype), repr(float(v.double().sum())))\n";
  std::ofstream(dir.path / "read16.py") << script;
  const auto [out, rc] = run_command(std::string(MPZERO_TEST_PYTHON) + " " + (dir.path / "read16.py").string() + " " +
                                     (dir.path / "pytorch_model.bin").string() + " " +
                                     (dir.path / "model.safetensors").string());
  INFO(out);
  REQUIRE(rc == 0);
  std::istringstream lines(out);
  auto got = parse_sums(lines);
  auto reference = mt::initialize(CkNet(7), config_16bit(0, "bf16"), world());
  train(reference, ::torch::kBFloat16, 0, 3);
  const auto want = module_values(reference);
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    INFO(name);
    REQUIRE(got[name].first == std::string("torch.") + (t.scalar_type() == ::torch::kBFloat16 ? "bfloat16" : "float32"));
    REQUIRE(got[name].second == t.to(::torch::kDouble).sum().item<double>());
  }
#endif
}

// ZeroOptimizer::save_checkpoint / load_checkpoint under mpirun (1-4 ranks).
//
// A run that saves, is replaced by a fresh optimizer that loads, and goes on must end
// bit for bit where an uninterrupted run ends: parameters, master weights, both Adam
// moments, gradient norms, the step count (which keys stochastic rounding and bias
// correction) and the fp16 loss scaler. A checkpoint also loads at another world size,
// another stage and into another precision policy, and every bad input is refused on
// every rank with a message, changing nothing.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <mpzero/backend/host.hpp>
#include <mpzero/comm/mpi.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

#include "support/deferred_backend.hpp"
#include "support/mpi_world.hpp"
#include "support/shared_dir.hpp"

using namespace mpzero;
namespace fs = std::filesystem;

namespace {

using mpzero::testing::world;

// Gradient element e of parameter p on rank r at step s: small multiples of 2^-6, so sums
// over ranks are exact and the reduced gradients do not depend on the world size.
float grad_value(int r, int s, std::size_t p, std::uint64_t e) {
  const auto bits = element_random_bits(500 + static_cast<std::uint64_t>(r) * 131 + p, static_cast<std::uint64_t>(s), e);
  return static_cast<float>(static_cast<int>(bits.v[0] % 17u) - 8) * 0x1p-6f;
}
float init_value(std::size_t p, std::uint64_t e) {
  const auto bits = element_random_bits(31, p, e);
  return (static_cast<float>(bits.v[0] % 2001u) - 1000.0f) * 1e-3f;
}

using mpzero::testing::shared_dir;

// Everything an optimizer holds, whole, indexed by parameter then element; and the
// counters. Equal on every rank.
struct snapshot {
  std::vector<std::vector<float>> params, master, s0, s1;
  std::uint64_t steps = 0;
  double loss_scale = 1.0;
  std::vector<double> norms;
};

template <class Z>
snapshot take(Z& z, comm::mpi_communicator& c) {
  constexpr int S = Z::zero_stage;
  const std::size_t n = z.num_params();
  snapshot out;
  if constexpr (S == 3) z.gather(0, n);
  for (std::size_t p = 0; p < n; ++p) {
    const auto span = z.param(p);
    std::vector<float> v(span.size());
    for (std::size_t e = 0; e < v.size(); ++e) v[e] = to_float(span[e]);
    out.params.push_back(v);
  }
  if constexpr (S == 3) z.release(0, n);
  // Shards to whole tensors: each element has one owner above stage 0, so a sum is exact.
  const std::uint64_t padded = z.layout().padded_numel();
  auto whole = [&](auto&& read) {
    std::vector<float> flat(padded, 0.0f);
    read([&](std::uint64_t i, float v) { flat[i] = v; });
    if (S > 0 && c.size() > 1) {
      MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(padded), MPI_FLOAT, MPI_SUM, c.native());
    }
    std::vector<std::vector<float>> per;
    for (std::size_t p = 0; p < n; ++p) {
      const auto off = static_cast<std::ptrdiff_t>(z.flat_offset(p));
      per.emplace_back(flat.begin() + off, flat.begin() + off + static_cast<std::ptrdiff_t>(z.numel(p)));
    }
    return per;
  };
  out.master = whole([&](auto f) { z.read_master_shard(f); });
  out.s0 = whole([&](auto f) { z.read_state_shard(0, f); });
  if constexpr (Z::n_states > 1) out.s1 = whole([&](auto f) { z.read_state_shard(1, f); });
  out.steps = z.steps();
  out.loss_scale = z.loss_scale();
  return out;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t p = 0; p < a.size(); ++p) {
    if (a[p].size() != b[p].size()) return false;
    if (!a[p].empty() && std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)) != 0) return false;
  }
  return true;
}

void require_same(const snapshot& got, const snapshot& want) {
  REQUIRE(same_bits(got.params, want.params));
  REQUIRE(same_bits(got.master, want.master));
  REQUIRE(same_bits(got.s0, want.s0));
  REQUIRE(same_bits(got.s1, want.s1));
  REQUIRE(got.steps == want.steps);
  REQUIRE(got.loss_scale == want.loss_scale);
}

const std::vector<std::uint64_t> model_numels{0, 5, 1000, 3, 7001, 17, 1, 0, 2500};

zero_options options_for(bool fp16) {
  zero_options zo;
  zo.reduce_bucket_numel = 1024;
  zo.param_persistence_threshold = 20;
  zo.seed = 7;
  zo.offload_sub_group_numel = 3000;
  if (fp16) {
    zo.loss_scaling = true;
    zo.loss_scale.initial_scale_power = 8;
    zo.loss_scale.loss_scale_window = 2;  // the scale grows during the run: state worth restoring
  }
  return zo;
}

template <class Policy, class Opt, int Stage, class Offload = offload_none, class Backend = host_backend>
using zopt = ZeroOptimizer<Policy, Opt, stage<Stage>, comm::mpi_communicator, Backend, Offload>;

template <class Z>
void init(Z& z) {
  for (std::size_t p = 0; p < z.num_params(); ++p) {
    std::vector<float> v(z.numel(p));
    for (std::uint64_t e = 0; e < v.size(); ++e) v[e] = init_value(p, e);
    z.load_param(p, v.data());
  }
}

template <class Z>
void train(Z& z, comm::mpi_communicator& c, int first, int last, std::vector<double>& norms) {
  using G = typename Z::grad_type;
  for (int s = first; s <= last; ++s) {
    const float scale = static_cast<float>(z.loss_scale());
    for (std::size_t p = z.num_params(); p-- > 0;) {
      std::vector<G> g(z.numel(p));
      for (std::uint64_t e = 0; e < g.size(); ++e) g[e] = from_float<G>(grad_value(c.rank(), s, p, e) * scale);
      z.accumulate_grad(p, g.data());
    }
    z.end_backward();
    const step_report r = z.step();
    REQUIRE_FALSE(r.skipped);
    norms.push_back(r.grad_norm);
  }
}

// 4 steps straight, against 2 steps, a save, a fresh optimizer (different values) that
// loads, and 2 more steps: the same bits.
template <class Policy, class Opt, int Stage, class Offload = offload_none, class Backend = host_backend>
void check_resume(bool fp16 = false) {
  auto& c = world();
  const zero_options zo = options_for(fp16);
  const typename Opt::options opt{};
  INFO("stage " << Stage << ", rank " << c.rank() << " of " << c.size());
  snapshot straight;
  {
    zopt<Policy, Opt, Stage, Offload, Backend> z(c, model_numels, opt, zo);
    init(z);
    train(z, c, 1, 4, straight.norms);
    const auto norms = straight.norms;
    straight = take(z, c);
    straight.norms = norms;
  }
  shared_dir dir;
  snapshot resumed;
  {
    zopt<Policy, Opt, Stage, Offload, Backend> z(c, model_numels, opt, zo);
    init(z);
    train(z, c, 1, 2, resumed.norms);
    z.save_checkpoint(dir.path);
  }
  {
    // An optimizer with a history of its own (other values, a step taken, uploads in flight
    // with offload): the load replaces all of it.
    zopt<Policy, Opt, Stage, Offload, Backend> z(c, model_numels, opt, zo);
    std::vector<double> other;
    train(z, c, 9, 9, other);
    z.load_checkpoint(dir.path);
    train(z, c, 3, 4, resumed.norms);
    const auto norms = resumed.norms;
    resumed = take(z, c);
    resumed.norms = norms;
  }
  require_same(resumed, straight);
  REQUIRE(resumed.norms == straight.norms);
  if (fp16) REQUIRE(straight.loss_scale > 256.0);  // the scaler's growth was restored, not restarted
}

// A fresh optimizer of type Z, trained over steps [first, last] and saved into `dir`.
template <class Z>
void save_trained(comm::mpi_communicator& c, const zero_options& zo, const fs::path& dir, int first, int last) {
  Z z(c, model_numels, {}, zo);
  init(z);
  std::vector<double> norms;
  train(z, c, first, last, norms);
  z.save_checkpoint(dir);
}

template <class Z>
std::string load_error(Z& z, const fs::path& dir) {
  try {
    z.load_checkpoint(dir);
  } catch (const mpzero::error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("Checkpoint: a resumed run continues bit for bit at every stage", "[checkpoint]") {
  SECTION("fp32") {
    check_resume<policies::fp32, optim::adamw, 0>();
    check_resume<policies::fp32, optim::adamw, 1>();
    check_resume<policies::fp32, optim::adamw, 2>();
    check_resume<policies::fp32, optim::adamw, 3>();
  }
  SECTION("bf16 params, fp32 master (the saved parameters are not re-derived from the master)") {
    check_resume<policies::bf16_fp32_master, optim::adam, 2>();
    check_resume<policies::bf16_fp32_master, optim::adam, 3>();
  }
  SECTION("all bf16 with stochastic rounding (the step count keys the random bits)") {
    check_resume<policies::bf16_all_sr, optim::adamw, 0>();
    check_resume<policies::bf16_all_sr, optim::adamw, 1>();
    check_resume<policies::bf16_all_sr, optim::adamw, 3>();
  }
  SECTION("fp16 with a dynamic loss scale (the scaler's state is restored)") {
    check_resume<policies::fp16_fp32_master, optim::adamw, 1>(true);
    check_resume<policies::fp16_fp32_master, optim::adamw, 2>(true);
  }
}

TEST_CASE("Checkpoint: a resumed run continues bit for bit with CPU offload", "[checkpoint]") {
  using B = mpzero::testing::deferred_backend;  // device-like: transfers finish late
  check_resume<policies::bf16_all_sr, optim::adamw, 1, offload_cpu>();
  check_resume<policies::bf16_master_fp32_states, optim::adamw, 2, offload_cpu, B>();
  check_resume<policies::bf16_fp32_master, optim::adamw, 3, offload_cpu, B>();
  check_resume<policies::bf16_fp32_master, optim::adamw, 2, offload_none, B>();
}

TEST_CASE("Checkpoint: loads at another world size, stage and precision policy", "[checkpoint]") {
  auto& c = world();
  comm::mpi_communicator self(MPI_COMM_SELF, comm::mpi_options{60.0});
  const zero_options zo = options_for(false);
  shared_dir dir;
  snapshot saved;
  {
    zopt<policies::bf16_fp32_master, optim::adamw, 2> z(c, model_numels, {}, zo);
    init(z);
    std::vector<double> norms;
    train(z, c, 1, 3, norms);
    saved = take(z, c);
    z.save_checkpoint(dir.path);
  }
  SECTION("the whole world at stage 3, and stage 0") {
    zopt<policies::bf16_fp32_master, optim::adamw, 3> z3(c, model_numels, {}, zo);
    z3.load_checkpoint(dir.path);
    require_same(take(z3, c), saved);
    zopt<policies::bf16_fp32_master, optim::adamw, 0> z0(c, model_numels, {}, zo);
    z0.load_checkpoint(dir.path);
    require_same(take(z0, c), saved);
  }
  SECTION("one rank alone (world size 1), at stage 1") {
    if (c.rank() == 0) {
      zopt<policies::bf16_fp32_master, optim::adamw, 1> z(self, model_numels, {}, zo);
      z.load_checkpoint(dir.path);
      require_same(take(z, self), saved);
    }
  }
  SECTION("and back: saved by one rank alone, loaded by the whole world") {
    shared_dir one;
    if (c.rank() == 0) {
      zopt<policies::bf16_fp32_master, optim::adamw, 3> z(self, model_numels, {}, zo);
      z.load_checkpoint(dir.path);
      z.save_checkpoint(one.path);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    zopt<policies::bf16_fp32_master, optim::adamw, 1> z(c, model_numels, {}, zo);
    z.load_checkpoint(one.path);
    require_same(take(z, c), saved);
  }
  SECTION("re-saved into the same directory by one rank alone: the larger save's extra shard files go") {
    const auto shard = [&](int k) { return checkpoint::shard_path(dir.path, static_cast<std::uint32_t>(k)); };
    if (c.rank() == 0) {
      // One more, as a save at a world size one larger would have left (so that one rank
      // alone has something to remove too); and a file that only looks like a shard, which
      // stays: only names save_checkpoint writes are removed.
      fs::copy_file(shard(0), shard(c.size()));
      std::ofstream(dir.path / "zero_shard_1.mpz") << "not ours";
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (c.rank() == 0) {  // CHECK, not REQUIRE: the other ranks wait at the barrier below
      zopt<policies::bf16_fp32_master, optim::adamw, 2> z(self, model_numels, {}, zo);
      z.load_checkpoint(dir.path);
      z.save_checkpoint(dir.path);
      CHECK(fs::exists(shard(0)));
      for (int k = 1; k <= c.size(); ++k) CHECK_FALSE(fs::exists(shard(k)));
      CHECK(fs::exists(dir.path / "zero_shard_1.mpz"));
      CHECK(checkpoint::remove_stale_shards(dir.path, 1) == 0);  // nothing left to remove
    }
    MPI_Barrier(MPI_COMM_WORLD);
    zopt<policies::bf16_fp32_master, optim::adamw, 2> z(c, model_numels, {}, zo);
    z.load_checkpoint(dir.path);
    require_same(take(z, c), saved);
    // And a save at the full world size keeps all of its files.
    z.save_checkpoint(dir.path);
    MPI_Barrier(MPI_COMM_WORLD);
    for (int k = 0; k < c.size(); ++k) REQUIRE(fs::exists(shard(k)));
  }
  SECTION("into fp32 (the master becomes the parameter) and all-bf16 (rounded to nearest)") {
    zopt<policies::fp32, optim::adamw, 2> z32(c, model_numels, {}, zo);
    z32.load_checkpoint(dir.path);
    const snapshot a = take(z32, c);
    REQUIRE(same_bits(a.params, saved.master));
    REQUIRE(same_bits(a.s0, saved.s0));
    REQUIRE(same_bits(a.s1, saved.s1));
    REQUIRE(a.steps == saved.steps);
    zopt<policies::bf16_all, optim::adam, 1> z16(c, model_numels, {}, zo);  // Adam loads AdamW's moments
    z16.load_checkpoint(dir.path);
    const snapshot b = take(z16, c);
    for (std::size_t p = 0; p < b.params.size(); ++p) {
      for (std::size_t e = 0; e < b.params[p].size(); ++e) {
        REQUIRE(b.params[p][e] == to_float(from_float<bf16>(saved.master[p][e])));
        REQUIRE(b.s1[p][e] == to_float(from_float<bf16>(saved.s1[p][e])));
      }
    }
  }
}

// The engine's tables run Adam and AdamW through one rule, optim::adam_runtime: the same
// bits as the static rule its options choose (with and without CPU offload), checkpoints
// named after that choice, and loads across the three.
template <class Offload>
void check_adam_runtime(bool decoupled) {
  auto& c = world();
  INFO((decoupled ? "AdamW" : "Adam") << ", offload " << (Offload::value == offload_kind::cpu) << ", " << c.size()
                                      << " rank(s)");
  const zero_options zo = options_for(false);
  optim::adam_runtime_options rt;
  rt.weight_decay = 0.1;  // Adam and AdamW differ
  rt.decoupled_weight_decay = decoupled;
  const optim::adam_options plain = rt;
  std::vector<double> norms, ref_norms, other_norms;
  zopt<policies::bf16_fp32_master, optim::adam_runtime, 2, Offload> z(c, model_numels, rt, zo);
  init(z);
  train(z, c, 1, 3, norms);
  const snapshot got = take(z, c);
  auto reference = [&]<class Opt>(std::vector<double>& n) {
    zopt<policies::bf16_fp32_master, Opt, 2, Offload> r(c, model_numels, plain, zo);
    init(r);
    train(r, c, 1, 3, n);
    return take(r, c);
  };
  const snapshot same = decoupled ? reference.template operator()<optim::adamw>(ref_norms)
                                  : reference.template operator()<optim::adam>(ref_norms);
  const snapshot other = decoupled ? reference.template operator()<optim::adam>(other_norms)
                                   : reference.template operator()<optim::adamw>(other_norms);
  require_same(got, same);
  REQUIRE(norms == ref_norms);
  REQUIRE_FALSE(same_bits(got.master, other.master));

  shared_dir dir;
  z.save_checkpoint(dir.path);
  MPI_Barrier(MPI_COMM_WORLD);
  REQUIRE(checkpoint::read_fp32_weights(dir.path).header.optimizer == (decoupled ? "AdamW" : "Adam"));
  zopt<policies::bf16_fp32_master, optim::adamw, 1> w(c, model_numels, {}, zo);
  w.load_checkpoint(dir.path);
  REQUIRE(same_bits(take(w, c).master, got.master));
  zopt<policies::bf16_fp32_master, optim::sgd, 1> y(c, model_numels, {}, zo);
  REQUIRE_THAT(load_error(y, dir.path), Catch::Contains(std::string("holds ") + (decoupled ? "AdamW" : "Adam") +
                                                        " states (2 per element); this optimizer is SGD"));
  // And adam_runtime loads the others' checkpoints.
  zopt<policies::bf16_fp32_master, optim::adam_runtime, 2, Offload> back(c, model_numels, rt, zo);
  back.load_checkpoint(dir.path);
  require_same(take(back, c), got);
}

TEST_CASE("Checkpoint: adam_runtime is Adam or AdamW as its options say, saved under that name", "[checkpoint]") {
  check_adam_runtime<offload_none>(false);
  check_adam_runtime<offload_none>(true);
  check_adam_runtime<offload_cpu>(false);
}

TEST_CASE("Checkpoint: the shard files record the stochastic-rounding stream", "[checkpoint]") {
  auto& c = world();
  const zero_options zo = options_for(false);
  const auto header_of = [&](const fs::path& dir) {
    const fs::path file = checkpoint::shard_path(dir, static_cast<std::uint32_t>(c.rank()));
    std::ifstream in;  // read_header opens it
    return checkpoint::read_header(in, file);
  };
  shared_dir sr_dir, nearest_dir;
  save_trained<zopt<policies::bf16_all_sr, optim::adamw, 1>>(c, zo, sr_dir.path, 1, 1);
  save_trained<zopt<policies::bf16_all, optim::adamw, 1>>(c, zo, nearest_dir.path, 1, 1);
  CHECK(header_of(sr_dir.path).rounding_stream == rounding_stream);
  CHECK(header_of(nearest_dir.path).rounding_stream == 0);

  zopt<policies::bf16_all_sr, optim::adamw, 1> z(c, model_numels, {}, zo);
  CHECK(z.loaded_rounding_stream() == 0);
  z.load_checkpoint(sr_dir.path);
  CHECK(z.loaded_rounding_stream() == rounding_stream);
  z.load_checkpoint(nearest_dir.path);  // nearest-rounding states load into a stochastic-rounding optimizer
  CHECK(z.loaded_rounding_stream() == 0);
  // A file of another stream (byte 6 of the dtype row, at offset 40: magic 8, version 4,
  // byte order 4, save id 8, rank / world / files / stage 16) loads, and says which.
  MPI_Barrier(MPI_COMM_WORLD);
  if (c.rank() == 0) {
    for (const auto& f : fs::directory_iterator(sr_dir.path)) {
      std::fstream io(f.path(), std::ios::binary | std::ios::in | std::ios::out);
      io.seekp(40 + 6);
      const char one = 1;
      io.write(&one, 1);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  z.load_checkpoint(sr_dir.path);
  CHECK(z.loaded_rounding_stream() == 1);
}

TEST_CASE("Checkpoint: bad input is refused on every rank, with a message, and changes nothing", "[checkpoint]") {
  auto& c = world();
  const zero_options zo = options_for(false);
  shared_dir dir;
  save_trained<zopt<policies::bf16_fp32_master, optim::adamw, 2>>(c, zo, dir.path, 1, 2);
  // The target: trained differently, so that a partial load would show.
  zopt<policies::bf16_fp32_master, optim::adamw, 1> z(c, model_numels, {}, zo);
  init(z);
  std::vector<double> norms;
  train(z, c, 5, 5, norms);
  const snapshot before = take(z, c);

  SECTION("no checkpoint there") {
    REQUIRE_THAT(load_error(z, dir.path / "nope"), Catch::Contains("zero_shard_00000.mpz") && Catch::Contains("no such file"));
  }
  SECTION("another model") {
    std::vector<std::uint64_t> other = model_numels;
    other[2] = 999;
    zopt<policies::bf16_fp32_master, optim::adamw, 1> y(c, other, {}, zo);
    REQUIRE_THAT(load_error(y, dir.path), Catch::Contains("parameter 2 has 1000 elements there and 999 here"));
    other.pop_back();
    zopt<policies::bf16_fp32_master, optim::adamw, 1> x(c, other, {}, zo);
    REQUIRE_THAT(load_error(x, dir.path), Catch::Contains("holds 9 parameters; this optimizer has 8"));
  }
  SECTION("another optimizer") {
    zopt<policies::bf16_fp32_master, optim::sgd, 1> y(c, model_numels, {}, zo);
    REQUIRE_THAT(load_error(y, dir.path), Catch::Contains("holds AdamW states (2 per element); this optimizer is SGD"));
  }
  SECTION("a truncated file on one rank's side: every rank throws") {
    MPI_Barrier(MPI_COMM_WORLD);
    if (c.rank() == 0) {
      const fs::path f = checkpoint::shard_path(dir.path, static_cast<std::uint32_t>(c.size() - 1));
      fs::resize_file(f, fs::file_size(f) - 10);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    // Every rank reads every header, so every rank sees it.
    REQUIRE_THAT(load_error(z, dir.path), Catch::Contains("truncated"));
  }
  SECTION("files of two saves in one directory") {
    if (c.size() > 1) {
      shared_dir other;
      z.save_checkpoint(other.path);
      MPI_Barrier(MPI_COMM_WORLD);
      if (c.rank() == 0) fs::copy_file(checkpoint::shard_path(other.path, 1), checkpoint::shard_path(dir.path, 1), fs::copy_options::overwrite_existing);
      MPI_Barrier(MPI_COMM_WORLD);
      REQUIRE_THAT(load_error(z, dir.path), Catch::Contains("does not belong to the save"));
    }
  }
  SECTION("gradients pending on one rank: the save is refused everywhere") {
    if (c.rank() == 0) {
      std::vector<bf16> g(z.numel(2), from_float<bf16>(1.0f));
      z.accumulate_grad(2, g.data());  // stage 1: local until step()
    }
    shared_dir unused;
    std::string e;
    try {
      z.save_checkpoint(unused.path);
    } catch (const mpzero::error& x) {
      e = x.what();
    }
    REQUIRE_THAT(e, c.rank() == 0 ? Catch::Contains("Call it after step() or zero_grad()")
                                  : Catch::Contains("rank 0 of " + std::to_string(c.size()) + " failed"));
    z.zero_grad();
  }
  SECTION("gradients pending on one rank: the load is refused everywhere, and nothing changes anywhere") {
    if (c.rank() == 0) {
      std::vector<bf16> g(z.numel(2), from_float<bf16>(1.0f));
      z.accumulate_grad(2, g.data());
    }
    REQUIRE_THAT(load_error(z, dir.path), c.rank() == 0 ? Catch::Contains("Call it after step() or zero_grad()")
                                                       : Catch::Contains("rank 0 of " + std::to_string(c.size()) +
                                                                         " failed (its exception says why); nothing was loaded"));
    z.zero_grad();
  }
  SECTION("a directory that does not exist, for a save") {
    std::string e;
    try {
      z.save_checkpoint(dir.path / "missing" / "deeper");
    } catch (const mpzero::error& x) {
      e = x.what();
    }
    REQUIRE_THAT(e, Catch::Contains("cannot create") || Catch::Contains("failed (its exception says why)"));
  }
  require_same(take(z, c), before);
}

namespace {

// Saves after two steps and reads the weights back by every rank at once (reads only).
template <class Policy, int Stage>
void check_fp32_weights(const char* what) {
  auto& c = world();
  INFO(what << ", stage " << Stage << ", " << c.size() << " rank(s)");
  const zero_options zo = options_for(Policy::needs_loss_scaling);
  shared_dir dir;
  zopt<Policy, optim::adamw, Stage> z(c, model_numels, {}, zo);
  init(z);
  std::vector<double> norms;
  train(z, c, 1, 2, norms);
  const snapshot want = take(z, c);
  z.save_checkpoint(dir.path);
  MPI_Barrier(MPI_COMM_WORLD);
  const checkpoint::fp32_weights got = checkpoint::read_fp32_weights(dir.path);
  REQUIRE(got.header.numels == model_numels);
  REQUIRE(got.header.steps == 2);
  REQUIRE(got.header.optimizer == "AdamW");
  REQUIRE(got.header.files == (Stage == 0 ? 1u : static_cast<std::uint32_t>(c.size())));
  REQUIRE(same_bits(got.params, want.master));
  if constexpr (Policy::master_is_param) REQUIRE(same_bits(got.params, want.params));
}

}  // namespace

TEST_CASE("Checkpoint: read_fp32_weights gives the whole master weights, from any stage and world size", "[checkpoint]") {
  auto& c = world();
  // Stage 0 writes one file, stages 1-3 one per rank; with an fp32 master, with none
  // (all-bf16: the parameters are the master), and from fp16 parameters.
  check_fp32_weights<policies::fp32, 0>("fp32");
  check_fp32_weights<policies::bf16_fp32_master, 2>("bf16_fp32_master");
  check_fp32_weights<policies::bf16_all, 3>("bf16_all");
  check_fp32_weights<policies::fp16_fp32_master, 1>("fp16_fp32_master");
  const zero_options zo = options_for(false);

  SECTION("a missing shard file is named") {
    if (c.size() > 1) {
      shared_dir dir;
      zopt<policies::bf16_fp32_master, optim::adamw, 2> z(c, model_numels, {}, zo);
      init(z);
      z.save_checkpoint(dir.path);
      MPI_Barrier(MPI_COMM_WORLD);
      if (c.rank() == 0) fs::remove(checkpoint::shard_path(dir.path, 1));
      MPI_Barrier(MPI_COMM_WORLD);
      REQUIRE_THROWS_WITH(checkpoint::read_fp32_weights(dir.path),
                          Catch::Contains("zero_shard_00001.mpz") && Catch::Contains("no such file"));
    }
  }
  SECTION("no checkpoint there") {
    shared_dir dir;
    REQUIRE_THROWS_WITH(checkpoint::read_fp32_weights(dir.path),
                        Catch::Contains("zero_shard_00000.mpz") && Catch::Contains("pass the directory that save_checkpoint wrote"));
  }
}

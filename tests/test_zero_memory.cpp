// The memory contract of ZeroOptimizer under mpirun (1-4 ranks), on layouts generated from
// a seed: tensors larger and smaller than a bucket, sizes not divisible by the world size,
// an embedding-like tensor several buckets long and many small vectors. Bytes are counted
// by the backend itself (counting_backend), independently of memory():
//  - between steps a rank holds its model states and nothing else: every communication
//    buffer is freed at the end of the step;
//  - during the step, communication buffers never exceed memory().bucket_bound (the bound
//    docs/precision.md states), and no buffer is larger than one bucket;
//  - at world size >= 2, the bytes held at stage k+1 are at most those at stage k;
//  - stages 1-3 give stage 0's bits (the gradients are chosen to sum exactly).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <mpzero/comm/mpi.hpp>
#include <mpzero/optim/adam.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

#include "support/counting_backend.hpp"
#include "support/mpi_world.hpp"

using namespace mpzero;
using mpzero::testing::counting_backend;
using mpzero::testing::world;

namespace {

constexpr std::uint64_t bucket_numel = 1000;

// A layout from `seed`: an embedding of 5-6 buckets, tensors of 1-2 buckets and of a
// fraction of one (odd sizes, not divisible by the world size), and a tail of small
// vectors (biases, norms), in a shuffled order.
std::vector<std::uint64_t> layout(std::uint32_t seed) {
  std::mt19937 rng(seed);
  const auto pick = [&](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng) | 1u;
  };
  std::vector<std::uint64_t> n{pick(5 * bucket_numel, 6 * bucket_numel)};
  for (int k = 0; k < 4; ++k) n.push_back(pick(bucket_numel + 1, 2 * bucket_numel));
  for (int k = 0; k < 6; ++k) n.push_back(pick(bucket_numel / 10, bucket_numel - 1));
  for (int k = 0; k < 40; ++k) n.push_back(pick(3, 64));
  std::shuffle(n.begin() + 1, n.end(), rng);
  return n;
}

struct outcome {
  std::uint64_t held = 0;      // backend bytes after the steps
  std::vector<float> master;   // this rank's master shard, by flat index (others 0)
};

template <class Policy, int Stage>
outcome run(const std::vector<std::uint64_t>& numels, std::uint32_t seed) {
  auto& c = world();
  using Z = ZeroOptimizer<Policy, optim::adamw, stage<Stage>, comm::mpi_communicator, counting_backend>;
  auto& count = counting_backend::count();
  const std::uint64_t before = count.live;
  zero_options zo;
  zo.reduce_bucket_numel = bucket_numel;
  zo.param_persistence_threshold = 64;
  zo.loss_scaling = Policy::needs_loss_scaling;
  zo.loss_scale.dynamic = false;
  zo.loss_scale.static_scale = 1;
  zo.seed = seed;
  outcome out;
  {
    Z z(c, numels, optim::adamw::options{}, zo);
    const std::string where = "stage " + std::to_string(Stage) + ", world " + std::to_string(c.size());
    INFO(where);
    // At construction: the model states, nothing else.
    REQUIRE(count.live - before == z.memory().model_state_bytes());
    REQUIRE(z.memory().buckets == 0);
    count.reset();
    for (int step = 0; step < 2; ++step) {
      // Backward's order: the last parameter's gradient first. Values k/8, k in [-4, 3]:
      // sums over ranks are exact in every dtype, so every stage reduces to the same bits.
      for (std::size_t p = numels.size(); p-- > 0;) {
        std::vector<float> g(numels[p]);
        for (std::uint64_t k = 0; k < g.size(); ++k)
          g[k] = static_cast<float>(static_cast<int>((k * 7 + p * 3 + static_cast<std::uint64_t>(c.rank()) + step) % 8) - 4) / 8.0f;
        z.accumulate_grad(p, g.data());
      }
      z.end_backward();
      z.step();
      const memory_report m = z.memory();
      // Between steps: the model states alone.
      CHECK(m.buckets == 0);
      CHECK(count.live - before == m.model_state_bytes());
    }
    const memory_report m = z.memory();
    // At most: the model states and the bounded communication buffers, as memory() says.
    CHECK(count.peak - before - m.model_state_bytes() == m.peak_buckets);
    CHECK(m.peak_buckets <= m.bucket_bound);
    // No buffer larger than a bucket (in fp32, the widest dtype), beyond the model states.
    CHECK(count.largest <= std::max<std::uint64_t>(bucket_numel * 4, 1));
    if (c.size() == 1) CHECK(m.bucket_bound == 0);  // nothing to reduce: no buffers at all
    out.held = count.live - before;
    out.master.assign(z.layout().padded_numel(), 0.0f);
    z.read_master_shard([&](std::uint64_t k, float v) { out.master[k] = v; });
  }
  REQUIRE(count.live == before);  // everything freed with the optimizer
  return out;
}

template <class Policy>
void check_policy(std::uint32_t seed) {
  auto& c = world();
  const std::vector<std::uint64_t> numels = layout(seed);
  const outcome o[4] = {run<Policy, 0>(numels, seed), run<Policy, 1>(numels, seed), run<Policy, 2>(numels, seed),
                        run<Policy, 3>(numels, seed)};
  for (int s = 1; s < 4; ++s) {
    INFO("stage " << s << " against stage " << s - 1 << ", world " << c.size());
    if (c.size() >= 2) CHECK(o[s].held <= o[s - 1].held);
    // The same bits as stage 0 on this rank's shard (stage 0's master covers everything).
    for (std::size_t k = 0; k < o[s].master.size(); ++k) {
      if (o[s].master[k] != 0.0f && o[s].master[k] != o[0].master[k]) {
        FAIL_CHECK("flat element " << k << ": " << o[s].master[k] << " vs stage 0's " << o[0].master[k]);
        break;
      }
    }
  }
}

}  // namespace

TEST_CASE("ZeRO memory: held bytes are the model states, buffers stay within their bound, stages are monotone",
          "[memory]") {
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    INFO("layout seed " << seed);
    check_policy<policies::fp32>(seed);
    check_policy<policies::bf16_fp32_master>(seed);
    check_policy<policies::bf16_all_sr>(seed);
    check_policy<policies::fp16_fp32_master>(seed);
  }
}

TEST_CASE("ZeRO memory: a tensor larger than a bucket is reduced in pieces of at most one bucket", "[memory]") {
  auto& c = world();
  auto& count = counting_backend::count();
  // An embedding of 19 buckets and a small tail, as a language model's layout.
  const std::vector<std::uint64_t> numels{19 * bucket_numel + 7, 3 * bucket_numel, 50, 50};
  zero_options zo;
  zo.reduce_bucket_numel = bucket_numel;
  ZeroOptimizer<policies::bf16_all, optim::adamw, stage<2>, comm::mpi_communicator, counting_backend> z(c, numels, {}, zo);
  count.reset();
  const std::vector<float> g(numels[0], 0.25f);
  for (std::size_t p = numels.size(); p-- > 0;) z.accumulate_grad(p, g.data());
  z.end_backward();
  const memory_report m = z.memory();
  CHECK(count.largest <= bucket_numel * sizeof(bf16));
  CHECK(m.peak_buckets <= m.bucket_bound);
  if (c.size() > 1) {
    // Three buckets of staging at most (two in flight, one filling) and the small
    // parameters' bucket: far below one staging buffer per bucket.
    CHECK(m.peak_buckets <= (3 * bucket_numel + 100) * sizeof(bf16));
  }
  z.step();
  CHECK(z.memory().buckets == 0);
  const std::vector<float> got = z.full_grad(0);  // after the step: zeros again
  CHECK(got.size() == numels[0]);
}

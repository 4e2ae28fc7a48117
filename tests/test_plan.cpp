// The multi-tensor planner. Every plan is checked against the properties it promises,
// stated from the definition (chunks tile each tensor from its start in whole
// chunk_size pieces, launches cut the chunk list into contiguous, bounded, greedy
// runs), not against a second planner.
#include <catch2/catch.hpp>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <mpzero/error.hpp>
#include <mpzero/multi_tensor/plan.hpp>
#include <mpzero/multi_tensor/tuning.hpp>

using mpzero::multi_tensor_plan;
using mpzero::plan_options;

namespace {

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

std::string describe(const std::vector<std::uint64_t>& numels, const plan_options& o) {
  std::ostringstream os;
  os << "chunk_size " << o.chunk_size << ", max_chunks_per_launch " << o.max_chunks_per_launch
     << ", max_tensors_per_launch " << o.max_tensors_per_launch << ", " << numels.size() << " numels {";
  for (std::size_t i = 0; i < numels.size() && i < 40; ++i) os << numels[i] << (i + 1 < numels.size() ? " " : "");
  if (numels.size() > 40) os << " ...";
  os << "}";
  return os.str();
}

// Returns an empty string when `plan` keeps every promise for `numels`, else the first
// broken one (checked without Catch assertions per chunk, which would be slow).
std::string violation(const multi_tensor_plan& plan, const std::vector<std::uint64_t>& numels) {
  const plan_options& o = plan.options();
  const auto chunks = plan.chunks();
  const auto launches = plan.launches();
  std::ostringstream err;

  std::uint64_t total = 0, expected_chunks = 0;
  for (std::uint64_t n : numels) {
    total += n;
    expected_chunks += ceil_div(n, o.chunk_size);  // zero-size tensors have none
  }
  if (plan.total_elements() != total) return "total_elements() is not the sum of the numels";
  if (chunks.size() != expected_chunks) {
    err << chunks.size() << " chunks, expected sum of ceil(numel / chunk_size) = " << expected_chunks;
    return err.str();
  }

  // Chunks: each inside its tensor, starting on a chunk_size boundary, full unless it is
  // the tensor's last; consecutive chunks continue the same tensor or start the next
  // non-empty one at 0 once the previous tensor is finished. Together with the count
  // above this means every element is covered exactly once, in order.
  std::size_t next_tensor = 0;  // the tensor the walk expects to start next
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const mpzero::chunk& ch = chunks[c];
    err << "chunk " << c << " (tensor " << ch.tensor << ", begin " << ch.begin << ", size " << ch.size << "): ";
    if (ch.tensor >= numels.size()) return err.str() + "tensor index out of range";
    const std::uint64_t n = numels[ch.tensor];
    if (ch.size == 0 || ch.size > o.chunk_size) return err.str() + "size outside 1..chunk_size";
    if (ch.begin % o.chunk_size != 0) return err.str() + "does not start on a chunk_size boundary";
    if (ch.begin + ch.size > n) return err.str() + "runs past the end of its tensor";
    if (ch.begin + ch.size < n && ch.size != o.chunk_size) return err.str() + "is short but not its tensor's last";
    if (ch.begin == 0) {
      if (ch.tensor < next_tensor) return err.str() + "starts a tensor again";
      for (std::size_t t = next_tensor; t < ch.tensor; ++t)
        if (numels[t] != 0) return err.str() + "skips the non-empty tensor " + std::to_string(t);
      if (c > 0) {
        const mpzero::chunk& prev = chunks[c - 1];
        if (prev.begin + prev.size != numels[prev.tensor]) return err.str() + "starts before the previous tensor ends";
      }
      next_tensor = ch.tensor + 1;
    } else {
      if (c == 0) return err.str() + "the first chunk does not start its tensor";
      const mpzero::chunk& prev = chunks[c - 1];
      if (prev.tensor != ch.tensor || prev.begin + prev.size != ch.begin)
        return err.str() + "does not continue the previous chunk";
    }
    err.str("");
  }
  for (std::size_t t = next_tensor; t < numels.size(); ++t)
    if (numels[t] != 0) return "the non-empty tensor " + std::to_string(t) + " has no chunks";

  // Launches: non-empty, contiguous from chunk 0 to the last, within both limits, and
  // greedy (a launch ends only where its next chunk would break a limit).
  if (chunks.empty() != launches.empty()) return "launches exist without chunks, or chunks without launches";
  std::uint64_t next_chunk = 0;
  for (std::size_t l = 0; l < launches.size(); ++l) {
    const mpzero::launch_range& r = launches[l];
    err << "launch " << l << " (first_chunk " << r.first_chunk << ", num_chunks " << r.num_chunks
        << ", first_tensor " << r.first_tensor << ", num_tensors " << r.num_tensors << "): ";
    if (r.num_chunks == 0) return err.str() + "is empty";
    if (r.first_chunk != next_chunk) return err.str() + "does not start where the previous launch ended";
    if (r.first_chunk + std::uint64_t{r.num_chunks} > chunks.size()) return err.str() + "runs past the chunk list";
    if (r.num_chunks > o.max_chunks_per_launch) return err.str() + "has more than max_chunks_per_launch chunks";
    const std::uint32_t first_t = chunks[r.first_chunk].tensor;
    const std::uint32_t last_t = chunks[r.first_chunk + r.num_chunks - 1].tensor;
    if (r.first_tensor != first_t) return err.str() + "first_tensor is not its first chunk's tensor";
    if (r.num_tensors != last_t - first_t + 1) return err.str() + "num_tensors does not span its chunks' tensors";
    if (r.num_tensors > o.max_tensors_per_launch) return err.str() + "spans more than max_tensors_per_launch tensors";
    next_chunk = r.first_chunk + std::uint64_t{r.num_chunks};
    if (next_chunk < chunks.size()) {
      const bool chunks_full = r.num_chunks == o.max_chunks_per_launch;
      const bool tensors_full = chunks[next_chunk].tensor - first_t + 1ull > o.max_tensors_per_launch;
      if (!chunks_full && !tensors_full) return err.str() + "ends although its next chunk would have fit";
    }
    err.str("");
  }
  if (next_chunk != chunks.size()) return "the launches do not reach the last chunk";
  return {};
}

void check_plan(const std::vector<std::uint64_t>& numels, const plan_options& o) {
  const multi_tensor_plan plan(numels, o);
  INFO(describe(numels, o));
  REQUIRE(violation(plan, numels) == "");
}

}  // namespace

TEST_CASE("chunks cover every element of every tensor exactly once, in order", "[multi_tensor]") {
  check_plan({10}, {});
  check_plan({65536, 65537, 1, 131072, 131071}, {});
  check_plan({100, 7, 64, 65, 63}, {.chunk_size = 64});
  check_plan({3, 0, 2, 0, 0, 9}, {.chunk_size = 4, .max_chunks_per_launch = 2, .max_tensors_per_launch = 3});

  // Random lists with many empty tensors under small limits, where every boundary case
  // (a chunk exactly filling a tensor, a launch ending on a tensor's last chunk, a run
  // of empty tensors longer than the tensor limit) turns up many times.
  std::uint64_t state = 42;
  auto next = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::uint32_t>(state >> 33);
  };
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::uint64_t> numels(next() % 24);
    for (auto& n : numels) n = next() % 5 < 2 ? 0 : 1 + next() % (next() % 4 == 0 ? 300 : 40);
    const plan_options o{.chunk_size = 1 + next() % 48,
                         .max_chunks_per_launch = 1 + next() % 9,
                         .max_tensors_per_launch = 1 + next() % 7};
    const multi_tensor_plan plan(numels, o);
    const std::string v = violation(plan, numels);
    if (!v.empty()) {
      INFO(describe(numels, o));
      FAIL(v);
    }
  }
}

TEST_CASE("zero-size tensors produce no chunks", "[multi_tensor]") {
  const multi_tensor_plan empty_list(std::vector<std::uint64_t>{}, {});
  CHECK(empty_list.chunks().empty());
  CHECK(empty_list.launches().empty());
  CHECK(empty_list.total_elements() == 0);

  const multi_tensor_plan all_empty(std::vector<std::uint64_t>{0, 0, 0}, {});
  CHECK(all_empty.chunks().empty());
  CHECK(all_empty.launches().empty());

  const std::vector<std::uint64_t> numels = {0, 5, 0, 0, 3, 0};
  const multi_tensor_plan plan(numels, {.chunk_size = 4});
  REQUIRE(violation(plan, numels) == "");
  for (const mpzero::chunk& c : plan.chunks()) CHECK(numels[c.tensor] > 0);
  REQUIRE(plan.chunks().size() == 3);

  const multi_tensor_plan unset;  // a default-constructed plan is empty, not garbage
  CHECK(unset.chunks().empty());
  CHECK(unset.launches().empty());
  CHECK(unset.total_elements() == 0);
}

TEST_CASE("64-bit sizes: tensors past 2^32 elements are planned, not truncated", "[multi_tensor]") {
  // Planning only: nothing of this size is allocated.
  const std::uint64_t big = 5'000'000'000ull;
  const std::vector<std::uint64_t> numels = {big, 3, big + 1, (1ull << 32) + 1};
  for (std::uint32_t cs : {65536u, 12345679u, 1u << 31}) {
    const plan_options o{.chunk_size = cs};
    check_plan(numels, o);
    const multi_tensor_plan plan(numels, o);
    CHECK(plan.total_elements() == 2 * big + 4 + (1ull << 32) + 1);
    // The last chunk of the first tensor ends exactly at 5e9 (begin past 2^32).
    std::uint64_t end_of_first = 0;
    for (const mpzero::chunk& c : plan.chunks())
      if (c.tensor == 0) end_of_first = c.begin + c.size;
    CHECK(end_of_first == big);
  }
  // chunk_size = 2^31, the largest allowed: a tensor of 2^32 + 1 elements is two full
  // chunks and a chunk of 1 that begins at 2^32.
  const multi_tensor_plan plan(std::vector<std::uint64_t>{(1ull << 32) + 1}, {.chunk_size = 1u << 31});
  REQUIRE(plan.chunks().size() == 3);
  CHECK(plan.chunks()[0].size == 1u << 31);
  CHECK(plan.chunks()[1].begin == 1ull << 31);
  CHECK(plan.chunks()[1].size == 1u << 31);
  CHECK(plan.chunks()[2].begin == 1ull << 32);
  CHECK(plan.chunks()[2].size == 1);
}

TEST_CASE("chunk_size edge cases", "[multi_tensor]") {
  SECTION("chunk_size 1: one chunk per element") {
    const std::vector<std::uint64_t> numels = {3, 0, 2};
    check_plan(numels, {.chunk_size = 1});
    const multi_tensor_plan per_element(numels, {.chunk_size = 1});
    CHECK(per_element.chunks().size() == 5);
  }
  SECTION("numel one below, equal to and one above chunk_size") {
    for (std::uint64_t n : {63u, 64u, 65u}) check_plan({n}, {.chunk_size = 64});
    const multi_tensor_plan equal(std::vector<std::uint64_t>{64}, {.chunk_size = 64});
    CHECK(equal.chunks().size() == 1);
    const multi_tensor_plan over(std::vector<std::uint64_t>{65}, {.chunk_size = 64});
    REQUIRE(over.chunks().size() == 2);
    CHECK(over.chunks()[1].size == 1);
  }
  SECTION("chunk_size larger than every tensor: one chunk per non-empty tensor") {
    const std::vector<std::uint64_t> numels = {1, 7, 0, 65537};
    const multi_tensor_plan plan(numels, {.chunk_size = 1u << 20});
    REQUIRE(violation(plan, numels) == "");
    CHECK(plan.chunks().size() == 3);
  }
  SECTION("the default chunk size") {
    check_plan({65535, 65536, 65537, 300000}, {});
  }
}

namespace {
struct sized {
  std::uint64_t numel;
};
// A launch shape whose chunk is three block iterations of 1024 elements.
struct odd_shape {
  static constexpr int threads = 256;
  static constexpr int ilp = 4;
  static constexpr std::uint32_t chunk = 3 * 1024;
};
// The number of chunks of `numels` at `chunk` elements each, from the definition.
std::uint64_t chunks_of(const std::vector<sized>& ts, std::uint64_t chunk) {
  std::uint64_t n = 0;
  for (const sized& t : ts) n += t.numel / chunk + (t.numel % chunk != 0 ? 1 : 0);
  return n;
}
}  // namespace

TEST_CASE("a small step's chunks shrink until every SM gets one, down to one block iteration", "[multi_tensor]") {
  using nearest = mpzero::cuda_step_tuning<false>;    // 512 threads x 8: 4096 per iteration, chunk 16384
  using stochastic = mpzero::cuda_step_tuning<true>;  // 1024 x 8: 8192 per iteration, chunk 65536
  SECTION("large steps keep the shape's chunk") {
    const std::vector<sized> big = {{64u << 20}};
    CHECK(mpzero::plan_for<nearest>(big, 132).chunk_size == 16384);
    CHECK(mpzero::plan_for<stochastic>(big, 132).chunk_size == 65536);
    // 132 chunks of 16K exactly: one per SM already; one element less is 132 chunks too.
    CHECK(mpzero::plan_for<nearest>(std::vector<sized>{{132u * 16384}}, 132).chunk_size == 16384);
    CHECK(mpzero::plan_for<nearest>(std::vector<sized>{{131u * 16384 + 1}}, 132).chunk_size == 16384);
    CHECK(mpzero::plan_for<nearest>(std::vector<sized>{{131u * 16384}}, 132).chunk_size == 8192);
  }
  SECTION("a million elements on 132 SMs") {
    const std::vector<sized> m = {{1u << 20}};
    // 64 chunks of 16K, 128 of 8K, 256 of 4K.
    CHECK(mpzero::plan_for<nearest>(m, 132).chunk_size == 4096);
    // 16 of 64K, ..., 128 of 8K: one block iteration is the floor, with fewer than 132 chunks.
    CHECK(mpzero::plan_for<stochastic>(m, 132).chunk_size == 8192);
  }
  SECTION("the first halving that reaches one chunk per SM stops it") {
    const std::vector<sized> ts = {{3u << 19}, {5000}, {0}};
    const auto o = mpzero::plan_for<nearest>(ts, 132);
    CHECK(chunks_of(ts, o.chunk_size) >= 132);
    CHECK(chunks_of(ts, o.chunk_size * 2) < 132);
    CHECK(o.chunk_size == 8192);  // 192 + 1 chunks; at 16K, 96 + 1
    REQUIRE(violation(mpzero::multi_tensor_plan(std::vector<std::uint64_t>{3u << 19, 5000, 0}, o),
                      {3u << 19, 5000, 0}) == "");
  }
  SECTION("many small tensors already fill the GPU; no tensors and no SMs are harmless") {
    CHECK(mpzero::plan_for<nearest>(std::vector<sized>(300, sized{100}), 132).chunk_size == 16384);
    CHECK(mpzero::plan_for<nearest>(std::vector<sized>{}, 132).chunk_size == 4096);
    CHECK(mpzero::plan_for<stochastic>(std::vector<sized>{{1u << 30}}, 0).chunk_size == 65536);
  }
  SECTION("a shape whose chunk is an odd number of iterations keeps whole iterations") {
    CHECK(mpzero::plan_for<odd_shape>(std::vector<sized>{{2048}}, 8).chunk_size == 1024);
  }
}

TEST_CASE("launches respect max_chunks_per_launch and max_tensors_per_launch", "[multi_tensor]") {
  SECTION("one chunk per launch") {
    const std::vector<std::uint64_t> numels = {5, 0, 9};
    const multi_tensor_plan plan(numels, {.chunk_size = 2, .max_chunks_per_launch = 1});
    REQUIRE(violation(plan, numels) == "");
    CHECK(plan.launches().size() == plan.chunks().size());
  }
  SECTION("one tensor per launch") {
    const std::vector<std::uint64_t> numels = {5, 0, 9, 1};
    const multi_tensor_plan plan(numels, {.chunk_size = 4, .max_tensors_per_launch = 1});
    REQUIRE(violation(plan, numels) == "");
    CHECK(plan.launches().size() == 3);
  }
  SECTION("empty tensors between non-empty ones count towards num_tensors") {
    std::vector<std::uint64_t> numels = {5};
    numels.insert(numels.end(), 100, 0);
    numels.insert(numels.end(), {5, 0, 0, 5});
    for (std::uint32_t limit : {1u, 2u, 3u, 4u, 101u, 102u, 1000u}) {
      const multi_tensor_plan plan(numels, {.chunk_size = 8, .max_tensors_per_launch = limit});
      INFO("max_tensors_per_launch " << limit);
      REQUIRE(violation(plan, numels) == "");
      for (const auto& l : plan.launches()) CHECK(l.num_tensors <= limit);
    }
    // A run of empty tensors exactly at the limit: {1, 0, 0, 1} spans four tensor slots.
    const std::vector<std::uint64_t> gap = {1, 0, 0, 1};
    const multi_tensor_plan at_limit(gap, {.max_tensors_per_launch = 4}), over_limit(gap, {.max_tensors_per_launch = 3});
    CHECK(at_limit.launches().size() == 1);
    CHECK(over_limit.launches().size() == 2);
  }
  SECTION("the default limits split more than 65536 tensors and more than 2^20 chunks") {
    const std::vector<std::uint64_t> many(70000, 1);
    const multi_tensor_plan plan(many, {});
    REQUIRE(violation(plan, many) == "");
    CHECK(plan.launches().size() == 2);

    const std::vector<std::uint64_t> long_one = {(1u << 20) + 1};
    const multi_tensor_plan chunky(long_one, {.chunk_size = 1});
    REQUIRE(violation(chunky, long_one) == "");
    CHECK(chunky.launches().size() == 2);
  }
}

TEST_CASE("invalid plan options throw with the option's name", "[multi_tensor]") {
  using Catch::Matchers::Contains;
  const std::vector<std::uint64_t> numels = {10};
  REQUIRE_THROWS_AS(multi_tensor_plan(numels, {.chunk_size = 0}), mpzero::invalid_argument);
  REQUIRE_THROWS_WITH(multi_tensor_plan(numels, {.chunk_size = 0}), Contains("chunk_size"));
  // Above 2^31 a chunk's 32-bit loop index could wrap: refused; 2^31 itself is accepted.
  REQUIRE_THROWS_WITH(multi_tensor_plan(numels, {.chunk_size = 0x80000001u}),
                      Contains("chunk_size = 2147483649") && Contains("at most 2147483648"));
  REQUIRE_THROWS_WITH(multi_tensor_plan(numels, {.chunk_size = 0xffffffffu}), Contains("chunk_size = 4294967295"));
  REQUIRE_NOTHROW(multi_tensor_plan(numels, {.chunk_size = 0x80000000u}));
  REQUIRE_THROWS_WITH(multi_tensor_plan(numels, {.max_chunks_per_launch = 0}), Contains("max_chunks_per_launch"));
  REQUIRE_THROWS_WITH(multi_tensor_plan(numels, {.max_chunks_per_launch = 0x80000000u}),
                      Contains("max_chunks_per_launch = 2147483648") && Contains("2147483647"));
  REQUIRE_NOTHROW(multi_tensor_plan(numels, {.max_chunks_per_launch = 0x7fffffffu}));
  REQUIRE_THROWS_WITH(multi_tensor_plan(numels, {.max_tensors_per_launch = 0}), Contains("max_tensors_per_launch"));
  REQUIRE_THROWS_AS(multi_tensor_plan(numels, {.max_tensors_per_launch = 0}), mpzero::invalid_argument);
  // An invalid option is refused even when there is nothing to plan.
  REQUIRE_THROWS_AS(multi_tensor_plan(std::vector<std::uint64_t>{}, {.chunk_size = 0}), mpzero::invalid_argument);
  // The options are kept as given.
  const multi_tensor_plan plan(numels, {.chunk_size = 3, .max_chunks_per_launch = 5, .max_tensors_per_launch = 7});
  CHECK(plan.options().chunk_size == 3);
  CHECK(plan.options().max_chunks_per_launch == 5);
  CHECK(plan.options().max_tensors_per_launch == 7);
}

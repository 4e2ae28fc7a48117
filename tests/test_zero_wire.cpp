// Per-parameter wire dtypes (zero_options::wire_dtypes) under mpirun (1-4 ranks):
// every stage, with and without CPU offload, reduces each parameter's gradient in its
// own wire dtype, with buckets that mix dtypes and runs that straddle buckets.
//
// The reference is written from the definitions, in long double: each rank's gradient
// is rounded to the wire dtype (round to nearest even, by scaling to an integer), the
// ranks' values are combined as the communicators combine 16-bit types (an fp32 add,
// then one rounding to the wire dtype per combine: comm/mpi.hpp, comm/local.hpp), the
// sum is rounded back to the gradient dtype and averaged. MPI leaves the order of the
// combines open, so above two ranks the data either keep every partial sum exact in the
// wire dtype (the rounding that remains is each rank's own, which no order changes) or
// give each element a nonzero value on two ranks only (one combine rounds, adding a zero
// is exact, whatever the order); the test checks that premise. Arbitrary values are
// checked at every rank count that way.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <mpzero/backend/host.hpp>
#include <mpzero/comm/mpi.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

#include "support/mpi_world.hpp"

using namespace mpzero;

namespace {

using mpzero::testing::world;

// ---- the reference arithmetic ---------------------------------------------------------

// x rounded to nearest even in a binary format with `bits` significant bits and minimum
// normal exponent `emin` (subnormals included); the values here stay far from overflow.
long double round_to(long double x, dtype d) {
  int bits = 24, emin = -126;
  if (d == dtype::bf16) bits = 8;
  if (d == dtype::fp16) bits = 11, emin = -14;
  if (x == 0) return x;
  const int e = std::max(std::ilogb(x), emin);
  const long double ulp = std::ldexp(1.0L, e - (bits - 1));
  return std::nearbyint(x / ulp) * ulp;  // the default rounding mode: ties to even
}

// One combine of two wire values: an fp32 add, rounded once to the wire dtype.
long double combine(long double a, long double b, dtype d) {
  const float sum = static_cast<float>(a) + static_cast<float>(b);
  return round_to(sum, d);
}

// ---- the data ---------------------------------------------------------------------------

enum class values {
  perturbed,  // +-(k * 2^-6 + j * 2^-20), k in 1..8, j in 1..3: not exact in 16 bits, exact once rounded
  bf16_wide,  // +-m * 2^(x-7), m in 128..255, x in -7..-5: exact in bf16, their sums need more bits
  grid,       // +-k * 2^-6: exact in every dtype, and so are sums of a few
  arbitrary,  // about [-1, 1] with every fp32 bit used
  // `arbitrary` on two ranks per element, which two turning with the element, the step and
  // the parameter; 0 on the others. At one and two ranks: `arbitrary` on every rank.
  arbitrary_pairs,
};

float make_value(values kind, int rank, int step, std::size_t p, std::uint64_t e) {
  if (kind == values::arbitrary_pairs) {
    const auto n = static_cast<std::uint64_t>(world().size());
    const auto first = (e + p + static_cast<std::uint64_t>(step)) % n;
    const auto r = static_cast<std::uint64_t>(rank);
    return r == first || r == (first + 1) % n ? make_value(values::arbitrary, rank, step, p, e) : 0.0f;
  }
  const auto bits = element_random_bits(4242 + static_cast<std::uint64_t>(rank) * 7919 + p,
                                        static_cast<std::uint64_t>(step), e);
  const std::uint32_t b = bits.v[0];
  const float sign = (b >> 20) & 1u ? -1.0f : 1.0f;
  switch (kind) {
    case values::perturbed:
      return sign * (static_cast<float>(1 + b % 8u) * 0x1p-6f + static_cast<float>(1 + (b >> 4) % 3u) * 0x1p-20f);
    case values::bf16_wide:
      return sign * std::ldexp(static_cast<float>(128 + b % 128u), static_cast<int>((b >> 8) % 3u) - 14);
    case values::grid:
      return sign * static_cast<float>(1 + b % 8u) * 0x1p-6f;
    case values::arbitrary:
    case values::arbitrary_pairs:  // handled above
      return (static_cast<float>(b % 2000001u) - 1000000.0f) * 1.0e-6f + static_cast<float>(bits.v[1] % 1000u) * 1e-10f;
  }
  return 0.0f;
}

float init_value(std::size_t p, std::uint64_t e) {
  const auto bits = element_random_bits(99, p, e);
  return (static_cast<float>(bits.v[0] % 2001u) - 1000.0f) * 1e-3f;
}

struct wire_case {
  std::vector<std::uint64_t> numels;
  std::vector<dtype> wire;        // per parameter
  std::vector<values> kinds;      // per parameter
  zero_options zo;
  int steps = 2;
};

// Every rank's value of an element rounded to its wire dtype and combined in rank order.
struct wire_sum {
  long double combined = 0;  // as the communicators combine (rounded)
  long double exact = 0;     // the exact sum of the rounded values
  int nonzero = 0;           // ranks whose rounded value is not 0
  std::vector<bool> carries;  // [rank]: its rounded value is not 0
};
wire_sum sum_on_wire(const wire_case& wc, int step, std::size_t p, std::uint64_t e) {
  const int W = world().size();
  const dtype d = wc.wire[p];
  wire_sum s;
  s.carries.assign(static_cast<std::size_t>(W), false);
  for (int r = 0; r < W; ++r) {
    const long double v = round_to(make_value(wc.kinds[p], r, step, p, e), d);
    s.combined = r == 0 ? v : combine(s.combined, v, d);
    s.exact += v;
    s.nonzero += v != 0;
    s.carries[static_cast<std::size_t>(r)] = v != 0;
  }
  return s;
}

// The reduced, averaged gradient element the optimizer must hold, from every rank's value.
float reference_grad(const wire_case& wc, dtype grad, int step, std::size_t p, std::uint64_t e) {
  const int W = world().size();
  const wire_sum s = sum_on_wire(wc, step, p, e);
  // Above two ranks the combines may come in any order: the data must keep them exact, or
  // leave one combine that rounds (at most two nonzero values; adding a zero is exact).
  if (W > 2 && s.combined != s.exact && s.nonzero > 2) {
    FAIL("the premise broke: a partial sum of parameter " << p << " is not exact in " << name_of(wc.wire[p])
                                                          << " and " << s.nonzero << " ranks contribute to it");
  }
  return static_cast<float>(round_to(s.combined, grad) / W);
}

// ---- one run --------------------------------------------------------------------------------

template <class Policy, int Stage, class Offload = offload_none>
void check_case(const wire_case& wc) {
  using G = typename Policy::grad_type;
  auto& c = world();
  INFO("stage " << Stage << (Offload::value == offload_kind::cpu ? ", offload" : "") << ", rank " << c.rank() << " of "
                << c.size());
  optim::sgd::options o;
  o.lr = 0.5;
  o.momentum = 0.0;  // plain SGD: the update is -lr x gradient
  zero_options zo = wc.zo;
  zo.wire_dtypes = wc.wire;
  zo.gradient_clipping = 0;
  ZeroOptimizer<Policy, optim::sgd, stage<Stage>, comm::mpi_communicator, host_backend, Offload> z(c, wc.numels, o, zo);
  const std::size_t n = wc.numels.size();
  std::vector<std::vector<long double>> master(n);
  for (std::size_t p = 0; p < n; ++p) {
    std::vector<float> v(wc.numels[p]);
    for (std::uint64_t e = 0; e < v.size(); ++e) v[e] = init_value(p, e);
    z.load_param(p, v.data());
    master[p].assign(v.begin(), v.end());
  }
  std::mt19937 order_gen(static_cast<unsigned>(c.rank()) * 17u + 3u);
  for (int step = 1; step <= wc.steps; ++step) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), order_gen);  // hooks fire in any order
    for (std::size_t p : order) {
      std::vector<G> g(wc.numels[p]);
      for (std::uint64_t e = 0; e < g.size(); ++e) {
        const float v = make_value(wc.kinds[p], c.rank(), step, p, e);
        g[e] = from_float<G>(v);
        if (to_float(g[e]) != v) FAIL("the premise broke: a gradient is not exact in the gradient dtype");
      }
      z.accumulate_grad(p, g.data());
    }
    z.end_backward();
    std::size_t mismatches = 0;
    for (std::size_t p = 0; p < n; ++p) {
      const std::vector<float> got = z.full_grad(p);
      REQUIRE(got.size() == wc.numels[p]);
      for (std::uint64_t e = 0; e < got.size(); ++e) {
        const float want = reference_grad(wc, dtype_of_v<G>, step, p, e);
        if (got[e] != want && mismatches++ == 0) {
          UNSCOPED_INFO("step " << step << ", parameter " << p << " (wire " << name_of(wc.wire[p]) << "), element " << e
                                << ": got " << got[e] << ", want " << want);
        }
        master[p][e] -= static_cast<long double>(o.lr) * want;
      }
    }
    REQUIRE(mismatches == 0);
    REQUIRE_FALSE(z.step().skipped);
  }
  // The step used those gradients: SGD moved each master weight by -lr x gradient.
  std::vector<float> flat_master(z.layout().padded_numel(), 0.0f);
  std::vector<int> owned(flat_master.size(), 0);
  z.read_master_shard([&](std::uint64_t i, float v) {
    flat_master[i] = v;
    owned[i] = 1;
  });
  for (std::size_t p = 0; p < n; ++p) {
    for (std::uint64_t e = 0; e < wc.numels[p]; ++e) {
      const std::uint64_t i = z.flat_offset(p) + e;
      if (owned[i]) REQUIRE(flat_master[i] == Approx(static_cast<double>(master[p][e])).margin(1e-6).epsilon(1e-6));
    }
  }
}

template <class Policy>
void all_stages(const wire_case& wc) {
  SECTION("stage 0") { check_case<Policy, 0>(wc); }
  SECTION("stage 1") { check_case<Policy, 1>(wc); }
  SECTION("stage 2") { check_case<Policy, 2>(wc); }
  SECTION("stage 3") { check_case<Policy, 3>(wc); }
  SECTION("stage 1, offload") { check_case<Policy, 1, offload_cpu>(wc); }
  SECTION("stage 2, offload") { check_case<Policy, 2, offload_cpu>(wc); }
  SECTION("stage 3, offload") { check_case<Policy, 3, offload_cpu>(wc); }
}

// Parameters whose wire dtypes alternate and whose sizes make the bucket planner put
// several dtypes in one bucket and split a run of one dtype over several buckets;
// zero-sized ones between them; small (persistent) ones, which the flat layout moves
// to the end, so that runs form in an order other than the caller's.
wire_case mixed_case() {
  wire_case wc;
  wc.numels = {700, 0, 5, 1300, 2500, 3, 900, 0, 17, 1, 640, 250, 4000};
  wc.wire = {dtype::fp32, dtype::bf16, dtype::bf16, dtype::bf16, dtype::bf16, dtype::fp32, dtype::fp16,
             dtype::fp32, dtype::bf16, dtype::fp16, dtype::fp32, dtype::fp16, dtype::bf16};
  wc.zo.reduce_bucket_numel = 1000;
  wc.zo.param_persistence_threshold = 20;
  return wc;
}

// The premises of mixed_case() for the bucket logic: some bucket holds several wire
// dtypes, and some run of one dtype covers more than one bucket.
void check_bucket_premises(const wire_case& wc) {
  using Z = ZeroOptimizer<policies::fp32, optim::sgd, stage<2>, comm::mpi_communicator>;
  zero_options zo = wc.zo;
  Z z(world(), wc.numels, {}, zo);
  const bucket_plan plan(z.layout(), zo.reduce_bucket_numel);
  std::vector<dtype> flat(z.layout().total_numel());
  for (std::size_t p = 0; p < wc.numels.size(); ++p)
    for (std::uint64_t e = 0; e < wc.numels[p]; ++e) flat[z.flat_offset(p) + e] = wc.wire[p];
  bool mixed_bucket = false, straddling_run = false;
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    const flat_range r = plan.buckets()[b].range;
    for (std::uint64_t i = r.begin + 1; i < r.end; ++i) mixed_bucket = mixed_bucket || flat[i] != flat[i - 1];
    if (b > 0 && !r.empty() && r.begin > 0) straddling_run = straddling_run || flat[r.begin] == flat[r.begin - 1];
  }
  REQUIRE(plan.num_buckets() > 3);
  REQUIRE(mixed_bucket);
  REQUIRE(straddling_run);
}

}  // namespace

TEST_CASE("ZeRO wire dtypes: fp32 gradients, bf16/fp16/fp32 per parameter, every stage and offload", "[zero]") {
  wire_case wc = mixed_case();
  check_bucket_premises(wc);
  // 16-bit wires: values that their rounding changes; fp32 wires: the same values, exact.
  wc.kinds.assign(wc.wire.size(), values::perturbed);
  all_stages<policies::fp32>(wc);
}

TEST_CASE("ZeRO wire dtypes: bf16 gradients with fp32 on the wire for some parameters", "[zero]") {
  // A bf16 model with communication_data_type fp32 for some parameters: their sums are
  // formed in fp32 and rounded to bf16 once (any rank count), the others' in bf16.
  wire_case wc = mixed_case();
  for (dtype& d : wc.wire) d = d == dtype::fp16 ? dtype::bf16 : d;
  for (dtype d : wc.wire) wc.kinds.push_back(d == dtype::fp32 ? values::bf16_wide : values::grid);
  all_stages<policies::bf16_fp32_master>(wc);
  // The premise that makes the fp32 wire visible: a single rounding of the exact sum
  // differs from rounding after every combine for some element (from three ranks on).
  if (world().size() > 2) {
    bool differs = false;
    for (std::uint64_t e = 0; e < 700 && !differs; ++e) {
      long double exact = 0, pairwise = 0;
      for (int r = 0; r < world().size(); ++r) {
        const long double v = make_value(values::bf16_wide, r, 1, 0, e);
        exact += v;
        pairwise = r == 0 ? v : combine(pairwise, v, dtype::bf16);
      }
      differs = round_to(exact, dtype::bf16) != pairwise;
    }
    REQUIRE(differs);
  }
}

TEST_CASE("ZeRO wire dtypes: arbitrary values on two ranks per element, at every rank count", "[zero]") {
  // Sums of arbitrary values round, and MPI leaves the order of the combines open: with
  // two nonzero values per element there is one combine that rounds whatever the order.
  // At one and two ranks that is every rank's value; above, each rank carries some
  // elements and contributes zeros to the others.
  wire_case wc = mixed_case();
  wc.kinds.assign(wc.wire.size(), values::arbitrary_pairs);
  // The premises that keep this from passing on degenerate data: every rank carries
  // values, and from two ranks on, in each wire dtype, some sum rounds (the test sees
  // the combine's rounding and the order question is real).
  const int n = world().size();
  std::vector<bool> carries(static_cast<std::size_t>(n), false);
  bool rounds_in[3] = {false, false, false};  // fp32, bf16, fp16
  for (int step = 1; step <= wc.steps; ++step) {
    for (std::size_t p = 0; p < wc.numels.size(); ++p) {
      for (std::uint64_t e = 0; e < wc.numels[p]; ++e) {
        const wire_sum s = sum_on_wire(wc, step, p, e);
        for (std::size_t r = 0; r < carries.size(); ++r) carries[r] = carries[r] || s.carries[r];
        bool& rounds = rounds_in[wc.wire[p] == dtype::fp32 ? 0 : wc.wire[p] == dtype::bf16 ? 1 : 2];
        rounds = rounds || s.combined != s.exact;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << " of " << n);
    REQUIRE(carries[static_cast<std::size_t>(r)]);
  }
  if (n > 1) {
    REQUIRE(rounds_in[0]);
    REQUIRE(rounds_in[1]);
    REQUIRE(rounds_in[2]);
  }
  all_stages<policies::fp32>(wc);
}

namespace {

// Feeds the same gradients to two optimizers and requires the same reduced gradients.
template <class A, class B>
void require_same_reduction(const wire_case& wc, const zero_options& za, const zero_options& zb) {
  auto& c = world();
  A a(c, wc.numels, {}, za);
  B b(c, wc.numels, {}, zb);
  // Two nonzero values per element at any rank count: no order question.
  const values kind = values::arbitrary_pairs;
  for (std::size_t p = wc.numels.size(); p-- > 0;) {
    std::vector<float> g(wc.numels[p]);
    for (std::uint64_t e = 0; e < g.size(); ++e) g[e] = make_value(kind, c.rank(), 1, p, e);
    a.accumulate_grad(p, g.data());
    b.accumulate_grad(p, g.data());
  }
  a.end_backward();
  b.end_backward();
  for (std::size_t p = 0; p < wc.numels.size(); ++p) {
    INFO("parameter " << p);
    REQUIRE(a.full_grad(p) == b.full_grad(p));
  }
}

template <int Stage>
void default_equivalence(const wire_case& wc) {
  zero_options none = wc.zo, all_fp32 = wc.zo, all_bf16 = wc.zo;
  all_fp32.wire_dtypes.assign(wc.numels.size(), dtype::fp32);
  all_bf16.wire_dtypes.assign(wc.numels.size(), dtype::bf16);
  using F = ZeroOptimizer<policies::fp32, optim::sgd, stage<Stage>, comm::mpi_communicator>;
  using H = ZeroOptimizer<policies::fp32, optim::sgd, stage<Stage>, comm::mpi_communicator, host_backend, offload_none, bf16>;
  // Every parameter in the Wire type: the bits of an empty list.
  require_same_reduction<F, F>(wc, none, all_fp32);
  // bf16 for every parameter at run time: the bits of the compile-time bf16 wire type.
  require_same_reduction<H, F>(wc, none, all_bf16);
}

}  // namespace

TEST_CASE("ZeRO wire dtypes: a list that names one dtype equals the compile-time wire type", "[zero]") {
  const wire_case wc = mixed_case();
  SECTION("stage 0") { default_equivalence<0>(wc); }
  SECTION("stage 1") { default_equivalence<1>(wc); }
  SECTION("stage 2") { default_equivalence<2>(wc); }
  SECTION("stage 3") { default_equivalence<3>(wc); }
}

TEST_CASE("ZeRO wire dtypes: memory().buckets counts the wire buffers", "[zero]") {
  auto& c = world();
  std::vector<float> g(3000, 0x1p-4f);
  auto feed = [&](auto& z, std::size_t n) {
    for (std::size_t p = n; p-- > 0;) z.accumulate_grad(p, g.data());
    z.end_backward();
    z.reduce_gradients();
  };
  {
    // Stages 0 and 1 reduce a bf16 run piece by piece through one bf16 send buffer (and
    // at stage 1 a receive buffer) of min(bucket, longest bf16 run) = 1200 elements.
    const std::vector<std::uint64_t> numels{3000, 500, 2000};
    zero_options zo;
    zo.reduce_bucket_numel = 1200;
    zo.param_persistence_threshold = 0;
    zo.wire_dtypes = {dtype::bf16, dtype::fp32, dtype::bf16};  // runs of 3000, 500 and 2000 (+ padding) elements
    ZeroOptimizer<policies::fp32, optim::sgd, stage<0>, comm::mpi_communicator> z0(c, numels, {}, zo);
    ZeroOptimizer<policies::fp32, optim::sgd, stage<1>, comm::mpi_communicator> z1(c, numels, {}, zo);
    REQUIRE(z0.memory().buckets == 0);
    REQUIRE(z1.memory().buckets == 0);
    feed(z0, numels.size());
    feed(z1, numels.size());
    CHECK(z0.memory().buckets == std::uint64_t{1200} * 2);
    CHECK(z1.memory().buckets == std::uint64_t{2} * 1200 * 2);
    // Freed by the step, taken again by the next reduction.
    z0.step();
    CHECK(z0.memory().buckets == 0);
    feed(z0, numels.size());
    CHECK(z0.memory().buckets == std::uint64_t{1200} * 2);
  }
  {
    // Stage 2, one bucket: its fp32 staging buffer and its bf16 copy, which is
    // reduce-scattered in place (no receive buffer).
    const std::vector<std::uint64_t> numels{1000};
    zero_options zo;
    zo.reduce_bucket_numel = 1200;
    zo.param_persistence_threshold = 0;
    zo.wire_dtypes = {dtype::bf16};
    ZeroOptimizer<policies::fp32, optim::sgd, stage<2>, comm::mpi_communicator> z(c, numels, {}, zo);
    zo.wire_dtypes.clear();
    ZeroOptimizer<policies::fp32, optim::sgd, stage<2>, comm::mpi_communicator> plain(c, numels, {}, zo);
    feed(z, 1);
    feed(plain, 1);
    CHECK(z.memory().buckets == std::uint64_t{1000} * 4 + std::uint64_t{1000} * 2);
    // In the gradient dtype, one rank has nothing to reduce: no buffers at all.
    CHECK(plain.memory().buckets == (c.size() == 1 ? 0 : std::uint64_t{1000} * 4));
    CHECK(z.memory().peak_buckets <= z.memory().bucket_bound);
    CHECK(plain.memory().peak_buckets <= plain.memory().bucket_bound);
    // The step frees them.
    z.step();
    plain.step();
    CHECK(z.memory().buckets == 0);
    CHECK(plain.memory().buckets == 0);
  }
}

TEST_CASE("ZeRO wire dtypes: a wrong list is refused with a message", "[zero]") {
  auto& c = world();
  const std::vector<std::uint64_t> numels{10, 20, 30};
  using Z = ZeroOptimizer<policies::fp32, optim::adamw, stage<2>, comm::mpi_communicator>;
  zero_options zo;
  zo.wire_dtypes = {dtype::bf16, dtype::fp32};
  REQUIRE_THROWS_AS(Z(c, numels, {}, zo), invalid_argument);
  REQUIRE_THROWS_WITH(Z(c, numels, {}, zo), Catch::Contains("wire_dtypes has 2 entries for 3 parameters") &&
                                                Catch::Contains("one mpzero::dtype per parameter"));
  zo.wire_dtypes = {dtype::bf16, static_cast<dtype>(7), dtype::fp32};
  REQUIRE_THROWS_WITH(Z(c, numels, {}, zo), Catch::Contains("wire_dtypes[1] = 7 is not a dtype") &&
                                                Catch::Contains("dtype::fp16"));
  zo.wire_dtypes = {dtype::bf16, dtype::fp16, dtype::fp32};
  REQUIRE_NOTHROW(Z(c, numels, {}, zo));
  // A bf16 policy's gradients may travel in bf16 or fp32, not fp16 (nothing scales them).
  using B = ZeroOptimizer<policies::bf16_all, optim::adamw, stage<2>, comm::mpi_communicator>;
  zo.wire_dtypes = {dtype::bf16, dtype::fp16, dtype::fp32};
  REQUIRE_THROWS_WITH(B(c, numels, {}, zo), Catch::Contains("wire_dtypes[1] = fp16 mixes bf16 and fp16 with this "
                                                            "policy's bf16") &&
                                                Catch::Contains("use bf16 or fp32"));
  zo.wire_dtypes = {dtype::bf16, dtype::fp32, dtype::bf16};
  REQUIRE_NOTHROW(B(c, numels, {}, zo));
}

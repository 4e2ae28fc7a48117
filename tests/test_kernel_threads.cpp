// The CUDA kernels' per-thread work (mpzero/cuda/thread_work.hpp), run on the CPU:
// every (chunk, thread) pair of a launch one after another, which is what the grid
// computes, since no two threads touch one element and none waits for another.
// Held bit for bit against the step's definition, update_element() on each element
// with its global index, for every valid precision policy: the kernel's indexing,
// 16-byte vector path and tail, its fallback for unaligned arrays, and its rounding
// bits (the key made once per thread; odd global offsets; the counter's high word).
// These run in CPU CI; the [gpu] tests (test_gpu.cu) then need only show that nvcc's
// code for the same text gives the host's bits.
#include "support/reference_step.hpp"
#include "test_optim_reference.hpp"

#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include <mpzero/cuda/thread_work.hpp>
#include <mpzero/multi_tensor/tuning.hpp>

namespace {

using mpzero::bf16;
using mpzero::fp16;
using optim_test::count_different;

// An odd thread count and a vector width every dtype accepts (8 x 2 bytes = 16): the
// grid-stride arithmetic at a size unlike the default's.
struct odd_tuning {
  static constexpr int threads = 3;
  static constexpr int ilp = 8;
};

// The arrays a thread reads, each of which must be 16-byte aligned for the vector path.
enum class array_kind { none, param, master, grad, last_state };

// Where a case puts its tensors: `lead` spare elements before every array (1 makes
// every array of a tensor 2 or 4 bytes off 16-byte alignment), and one more before one
// kind of array alone (`one_off`: one unaligned array among the several a thread reads).
struct layout_case {
  const char* what;
  std::uint64_t first_offset = 0;
  mpzero::plan_options plan = {};
  std::uint64_t lead = 0;
  array_kind one_off = array_kind::none;
  bool odd_threads = false;

  // Spare elements before an array of kind k; optimizer state k of n is of kind
  // last_state when it is the last one, else none (which no case names).
  std::uint64_t lead_of(array_kind k) const { return lead + (k != array_kind::none && k == one_off ? 1 : 0); }
  static array_kind state_kind(int k, int n) { return k == n - 1 ? array_kind::last_state : array_kind::none; }
};

// The arrays of several tensors, filled from a seed; two models made alike are alike
// bit for bit.
template <mpzero::precision_policy P, mpzero::optim::rule O>
struct model {
  static constexpr int n = O::n_states;
  std::vector<std::vector<typename P::param_type>> param;
  std::vector<std::vector<typename P::master_type>> master;
  std::vector<std::vector<typename P::grad_type>> grad;
  std::vector<std::vector<typename P::state_type>> state;  // tensor t's state k at t * n + k
  std::vector<mpzero::step_tensor<P, O>> tensors;

  model(const std::vector<std::uint64_t>& sizes, const layout_case& lc)
      : param(sizes.size()), master(sizes.size()), grad(sizes.size()), state(sizes.size() * n) {
    ref::rng r{29};
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::uint64_t i = 0; i < sizes[t] + lc.lead_of(array_kind::param); ++i)
        param[t].push_back(ref::random_value<typename P::param_type>(r, -6, 0));
      if constexpr (!P::master_is_param)
        for (std::uint64_t i = 0; i < sizes[t] + lc.lead_of(array_kind::master); ++i)
          master[t].push_back(ref::random_value<typename P::master_type>(r, -6, 0));
      for (std::uint64_t i = 0; i < sizes[t] + lc.lead_of(array_kind::grad); ++i)
        grad[t].push_back(ref::random_value<typename P::grad_type>(r, -8, 2));
      for (int k = 0; k < n; ++k)
        for (std::uint64_t i = 0; i < sizes[t] + lc.lead_of(layout_case::state_kind(k, n)); ++i)
          state[t * n + k].push_back(ref::random_magnitude<typename P::state_type>(r, -12, -4));
      mpzero::step_tensor<P, O> ts;
      ts.param = param[t].data() + lc.lead_of(array_kind::param);
      if constexpr (!P::master_is_param) ts.master = master[t].data() + lc.lead_of(array_kind::master);
      ts.grad = grad[t].data() + lc.lead_of(array_kind::grad);
      for (int k = 0; k < n; ++k) ts.states[k] = state[t * n + k].data() + lc.lead_of(layout_case::state_kind(k, n));
      ts.numel = sizes[t];
      tensors.push_back(ts);
    }
    mpzero::assign_global_offsets(std::span(tensors), lc.first_offset);
  }

  // Whether the case lays the arrays out as it says: all aligned, or exactly the
  // arrays it names off alignment (allocators give 16-byte aligned memory, but the
  // test should not depend on that unseen).
  bool layout_as_described(const layout_case& lc) const {
    using mpzero::cuda::detail::aligned16;
    for (const auto& ts : tensors) {
      if (ts.numel == 0) continue;
      // With a lead of 0 or 1 element, an array is aligned exactly when it has no lead.
      auto expect = [&](const void* p, array_kind k) { return aligned16(p) == (lc.lead_of(k) == 0); };
      bool ok = expect(ts.param, array_kind::param) && expect(ts.grad, array_kind::grad);
      if constexpr (!P::master_is_param) ok = ok && expect(ts.master, array_kind::master);
      for (int k = 0; k < n; ++k) ok = ok && expect(ts.states[k], layout_case::state_kind(k, n));
      if (!ok) return false;
    }
    return true;
  }

  std::vector<std::uint32_t> bits() const {
    std::vector<std::uint32_t> out;
    auto put = [&out](const auto& arrays) {
      for (const auto& v : arrays)
        for (const auto& x : v) {
          std::uint32_t u = 0;
          std::memcpy(&u, &x, sizeof(x));
          out.push_back(u);
        }
    };
    put(param);
    put(master);
    put(state);
    return out;
  }
};

// The launcher's grids, on the host: one launch per launch range of the plan, whose
// block b runs chunk first_chunk + b, thread by thread, in the optimizer's mode read
// from the step's arguments (the launcher's kernel per mode, optim::visit_mode).
template <class Tuning, mpzero::precision_policy P, mpzero::optim::rule O>
void step_as_grid(const mpzero::fused_step<P, O>& fused, const mpzero::step_args<O>& a) {
  const auto chunks = fused.plan().chunks();
  mpzero::optim::visit_mode<O>(a.opt, [&](auto mode) {
    for (const mpzero::launch_range& l : fused.plan().launches())
      for (std::uint32_t block = 0; block < l.num_chunks; ++block) {
        const mpzero::chunk& c = chunks[l.first_chunk + block];
        for (std::uint32_t thread = 0; thread < Tuning::threads; ++thread)
          mpzero::cuda::detail::fused_step_thread<P, O, Tuning::threads, Tuning::ilp, decltype(mode)::value>(
              fused.tensors()[c.tensor], c, a, thread);
      }
  });
}

template <mpzero::precision_policy P, mpzero::optim::rule O>
void check_grid(const typename O::options& opt) {
  INFO(optim_test::policy_name<P>() << " x " << O::name);
  // Sizes: empty, single, shorter than one vector, a tensor of chunks and a tail,
  // 65536 + 9 (a second chunk of 9: one vector and one tail element).
  const std::vector<std::uint64_t> sizes = {0, 1, 7, 4099, 65545};
  const layout_case cases[] = {
      {.what = "aligned, global offset 0"},
      {.what = "odd global offset", .first_offset = 1},
      {.what = "the rounding counter's high word changes inside the data",
       .first_offset = (std::uint64_t{1} << 33) - 5001},
      {.what = "every array one element off 16-byte alignment", .lead = 1},
      {.what = "the parameters alone unaligned", .one_off = array_kind::param},
      {.what = "the master weights alone unaligned", .one_off = array_kind::master},
      {.what = "the gradients alone unaligned", .one_off = array_kind::grad},
      {.what = "the last optimizer state alone unaligned", .one_off = array_kind::last_state},
      {.what = "chunks of 1001, at most 5 a launch: chunk starts off alignment and odd",
       .first_offset = 1,
       .plan = {.chunk_size = 1001, .max_chunks_per_launch = 5}},
      {.what = "3 threads per block", .first_offset = 3, .plan = {.chunk_size = 1000}, .odd_threads = true},
  };
  for (const layout_case& lc : cases) {
    if (P::master_is_param && lc.one_off == array_kind::master) continue;  // the parameters' case
    INFO(lc.what);
    model<P, O> by_element(sizes, lc), by_grid(sizes, lc);
    REQUIRE(by_grid.layout_as_described(lc));
    const auto initial = by_grid.bits();
    const mpzero::fused_step<P, O> fused(by_grid.tensors, lc.plan);
    for (std::uint64_t step = 1; step <= 3; ++step) {
      const auto args = mpzero::make_step_args<O>(opt, step, 0.5f, 4321);
      test_support::reference_step<P, O>(by_element.tensors, args);
      if (lc.odd_threads) {
        step_as_grid<odd_tuning>(fused, args);
      } else {
        step_as_grid<mpzero::cuda_tuning>(fused, args);
      }
    }
    const auto got = by_grid.bits();
    CHECK(count_different(got, initial) > got.size() / 2);  // the steps changed most values
    CHECK(count_different(got, by_element.bits()) == 0);
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("CUDA kernel threads, run on the host, give the element-wise step's bits: AdamW",
                        "[multi_tensor]", optim_test::all_policies) {
  check_grid<TestType, mpzero::optim::adamw>({.lr = 1e-2, .weight_decay = 0.1});
}

TEST_CASE("CUDA kernel threads, run on the host, give the element-wise step's bits: Adam, SGD, Lion, adam_runtime",
          "[multi_tensor]") {
  using namespace mpzero::optim;
  using mpzero::policies::bf16_all_sr;
  using mpzero::policies::fp32;
  check_grid<fp32, adam>({.lr = 1e-2, .weight_decay = 0.01});
  check_grid<bf16_all_sr, adam>({.lr = 1e-2, .weight_decay = 0.01});
  check_grid<fp32, sgd>({.lr = 0.1, .momentum = 0.9, .nesterov = true});
  check_grid<bf16_all_sr, sgd>({.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01});
  check_grid<mpzero::policies::fp16_fp32_master, lion>({.lr = 1e-3, .weight_decay = 0.1});
  check_grid<bf16_all_sr, lion>({.lr = 1e-3, .weight_decay = 0.1});
  // adam_runtime, the engine's rule: one kernel per mode, the launcher choosing.
  for (const bool decoupled : {false, true}) {
    adam_runtime_options o{{.lr = 1e-2, .weight_decay = 0.1}};
    o.decoupled_weight_decay = decoupled;
    check_grid<bf16_all_sr, adam_runtime>(o);
    check_grid<mpzero::policies::fp16_fp32_master, adam_runtime>(o);
  }
}

namespace {

// The gradient check's launches on the host: block b of a launch writes the partial of
// chunk first_chunk + b, its threads' sums added in thread order (the kernel adds them
// with cub::BlockReduce, in another order); then the partials are added.
template <class G>
mpzero::grad_stats stats_as_grid(const mpzero::multi_tensor_plan& plan, std::span<const mpzero::grad_view<G>> grads) {
  constexpr int threads = mpzero::cuda_tuning::threads;
  const auto chunks = plan.chunks();
  // NaN: a chunk that no block wrote spoils the sum.
  std::vector<double> partials(chunks.size(), std::numeric_limits<double>::quiet_NaN());
  mpzero::grad_stats out;
  for (const mpzero::launch_range& l : plan.launches())
    for (std::uint32_t block = 0; block < l.num_chunks; ++block) {
      const mpzero::chunk& c = chunks[l.first_chunk + block];
      double sum = 0;
      for (std::uint32_t t = 0; t < threads; ++t) {
        const auto mine = mpzero::cuda::detail::grad_stats_thread<G, threads>(grads[c.tensor], c, t);
        sum += mine.sum_squares;
        out.nonfinite = out.nonfinite || mine.nonfinite != 0;
      }
      partials[l.first_chunk + block] = sum;
    }
  for (const double p : partials) out.norm_squared += p;
  return out;
}

template <class G>
void check_stats_grid(G nan, G inf) {
  const std::vector<std::uint64_t> sizes = {0, 1, 7, 65537, 13};
  ref::rng r{5};
  std::vector<std::vector<G>> data(sizes.size());
  long double want = 0;
  std::uint64_t numel = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    for (std::uint64_t i = 0; i < sizes[t]; ++i) {
      data[t].push_back(ref::random_value<G>(r, 0, 3));  // |x| >= 1: every element shows in the sum
      want += ref::decode(data[t].back()) * ref::decode(data[t].back());
    }
    numel += sizes[t];
  }
  std::vector<mpzero::grad_view<G>> views;
  views.reserve(data.size());
  for (const auto& d : data) views.push_back({d.data(), d.size()});
  const mpzero::multi_tensor_plan plan(sizes, {});
  const std::span<const mpzero::grad_view<G>> grads(views);

  // Every element counted once: each square is at least 1, the total below 2^25 and
  // the rounding bound, n * 2^-53 of the total with n < 2^17 (see test_fused_step.cpp's
  // gradient_stats test), below 2^-11, so one element more or less always shows. Also
  // over launches of at most 3 chunks.
  const mpzero::grad_stats got = stats_as_grid<G>(plan, grads);
  CHECK_FALSE(got.nonfinite);
  CHECK(std::fabs(static_cast<long double>(got.norm_squared) - want) <= numel * 0x1p-53L * want);
  const mpzero::grad_stats small_launches =
      stats_as_grid<G>(mpzero::multi_tensor_plan(sizes, {.chunk_size = 4096, .max_chunks_per_launch = 3}), grads);
  CHECK(std::fabs(static_cast<long double>(small_launches.norm_squared) - want) <= numel * 0x1p-53L * want);
  // A non-finite value in a one-element tensor, a chunk's first element, its last, and
  // the last chunk's only element is seen by the thread that owns it.
  const std::pair<std::size_t, std::uint64_t> places[] = {{1, 0}, {3, 0}, {3, 65535}, {3, 65536}, {4, 12}};
  for (const auto& [t, i] : places) {
    for (G bad : {nan, inf}) {
      INFO("tensor " << t << " element " << i);
      const G keep = data[t][i];
      data[t][i] = bad;
      CHECK(stats_as_grid<G>(plan, grads).nonfinite);
      data[t][i] = keep;
    }
  }
}

}  // namespace

TEST_CASE("CUDA gradient-check threads, run on the host, cover every element once and see each non-finite one",
          "[multi_tensor]") {
  const float inf = std::numeric_limits<float>::infinity();
  check_stats_grid<float>(std::numeric_limits<float>::quiet_NaN(), inf);
  check_stats_grid<bf16>(bf16::from_bits(0x7fc0), bf16::from_bits(0x7f80));
  check_stats_grid<fp16>(fp16::from_bits(0x7e00), fp16::from_bits(0x7c00));
}

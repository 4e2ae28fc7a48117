// LibTorch's CPU fused AdamW (at::_fused_adamw_) against mpzero's host step, side by
// side in one run, on the same sizes, threads, hyperparameters and memory.
//
// Pairs (bench/README.md, "mpzero_bench_torch"):
//   fp32              torch fp32 params/grads/states     vs policies::fp32
//   bf16_fp32_master  torch's way to train a bf16 model with fp32 master weights:
//                     grad bf16 -> fp32 copy_, _fused_adamw_ on the fp32 master,
//                     master -> bf16 param copy_          vs policies::bf16_fp32_master
//   fp16_fp32_master  the same with fp16 (DeepSpeed's classic fp16 mode; torch's
//                     fused AdamW takes no loss scale here)  vs policies::fp16_fp32_master
//   bf16_all          torch all-bf16 _fused_adamw_        vs policies::bf16_all
//   bf16_all_sr       the same torch run                  vs policies::bf16_all_sr
// A third run per config, "pattern", is the ceiling of the access pattern: the step's
// loads and stores over the same buffers and chunks, with an XOR in place of the
// update's arithmetic. Neither side streams faster than its access pattern, so pattern /
// torch approximates the ratio the best possible step could reach against torch (each
// run allocates its own buffers: on a shared machine runs differ by several percent).
// Every run of a pair reports the mpzero policy's bytes per element
// (step_bytes_per_element), so their bytes_per_second divide into the speed ratio;
// the summary printed after the run gives that ratio (mpzero / torch) per size.
//
// The torch tensors wrap the benchmark's own buffers (at::from_blob): both sides
// stream the same kind of memory (huge pages, first touched by the same threads), so
// the comparison is of the update kernels, not of the allocators.

// LibTorch first: its headers must see no macros of other libraries.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "bench_common.hpp"

using namespace mpzero;
using namespace mpzero_bench;

namespace {

using adamw = optim::adamw;
constexpr std::uint64_t kStep = 10;  // a step past the first, as in bench_host.cpp
constexpr std::uint64_t kSeed = 0x5eed;

// ---- model state shared by both sides ------------------------------------------------

// The arrays of one tensor under Policy, filled with the same values as bench_host.cpp.
template <precision_policy Policy>
struct model_state {
  explicit model_state(std::uint64_t n)
      : n(n),
        param(n),
        grad(n),
        master(Policy::master_is_param ? 0 : n),
        exp_avg(n),
        exp_avg_sq(n) {
    fill(param, kChunk, kParamFill);
    fill(grad, kChunk, kGradFill);
    if constexpr (!Policy::master_is_param) fill(master, kChunk, kParamFill);
    fill(exp_avg, kChunk, state_fill(0, adamw::n_states));
    fill(exp_avg_sq, kChunk, state_fill(1, adamw::n_states));
  }
  std::uint64_t n;
  buffer<typename Policy::param_type> param;
  buffer<typename Policy::grad_type> grad;
  buffer<typename Policy::master_type> master;  // empty when the param is the master
  buffer<typename Policy::state_type> exp_avg, exp_avg_sq;
};

// ---- mpzero side -----------------------------------------------------------------------

template <precision_policy Policy>
class mpzero_side {
 public:
  explicit mpzero_side(model_state<Policy>& s) : step_(make_tensors(s)) {}
  void run() const { host::run(step_, args_, opt_); }

 private:
  static std::vector<step_tensor<Policy, adamw>> make_tensors(model_state<Policy>& s) {
    step_tensor<Policy, adamw> t;
    t.param = s.param.data();
    t.grad = s.grad.data();
    if constexpr (!Policy::master_is_param) t.master = s.master.data();
    t.states[0] = s.exp_avg.data();
    t.states[1] = s.exp_avg_sq.data();
    t.numel = s.n;
    return {t};
  }
  fused_step<Policy, adamw> step_;
  step_args<adamw> args_ = make_step_args<adamw>(bench_options<adamw>(), kStep, 1.0f, kSeed);
  host::options opt_{bench_threads()};
};

// ---- torch side ------------------------------------------------------------------------

template <class T>
at::Tensor wrap(const buffer<T>& b) {
  const auto type = std::is_same_v<T, float> ? at::kFloat : std::is_same_v<T, fp16> ? at::kHalf : at::kBFloat16;
  return at::from_blob(b.data(), {static_cast<std::int64_t>(b.size())}, at::TensorOptions().dtype(type));
}

// One at::_fused_adamw_ call with bench_options<adamw>() at step kStep. The CPU kernel
// reads the step count from state_steps and does not advance it (torch.optim does that
// before the call), so every iteration runs step kStep, as the mpzero side does.
void fused_adamw(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                 const at::Tensor& exp_avg_sq, const at::Tensor& step) {
  const auto o = bench_options<adamw>();
  at::_fused_adamw_({param}, {grad}, {exp_avg}, {exp_avg_sq}, {}, {step}, o.lr, o.beta1, o.beta2, o.weight_decay,
                    o.eps, /*amsgrad=*/false, /*maximize=*/false);
}

// The torch counterpart of a policy: what a LibTorch program runs for the same model.
// One dtype for parameters, gradients and states (fp32, bf16_all): one fused call.
template <precision_policy Policy>
class torch_side {
  static_assert(Policy::master_is_param && std::is_same_v<typename Policy::param_type, typename Policy::grad_type> &&
                    std::is_same_v<typename Policy::param_type, typename Policy::state_type>,
                "torch's fused AdamW takes one dtype for params, grads and states: specialize torch_side");

 public:
  explicit torch_side(model_state<Policy>& s)
      : p_(wrap(s.param)), g_(wrap(s.grad)), m_(wrap(s.exp_avg)), v_(wrap(s.exp_avg_sq)) {}
  void run() const { fused_adamw(p_, g_, m_, v_, step_); }
  static constexpr std::uint64_t extra_bytes_per_element = 0;

 private:
  at::Tensor p_, g_, m_, v_;
  at::Tensor step_ = at::scalar_tensor(static_cast<double>(kStep), at::kFloat);
};

// A 16-bit model with fp32 master weights: LibTorch's fused AdamW needs one dtype for
// params, grads and states, so the 16-bit gradient is converted into an fp32 buffer,
// the fp32 master is stepped, and the 16-bit parameter is copied from it.
template <precision_policy Policy>
class torch_side_fp32_master {
 public:
  explicit torch_side_fp32_master(model_state<Policy>& s)
      : grad32_(s.n),
        p_(wrap(s.param)),
        g_(wrap(s.grad)),
        w_(wrap(s.master)),
        g32_((fill(grad32_, kChunk, kGradFill), wrap(grad32_))),
        m_(wrap(s.exp_avg)),
        v_(wrap(s.exp_avg_sq)) {}
  void run() const {
    g32_.copy_(g_);
    fused_adamw(w_, g32_, m_, v_, step_);
    p_.copy_(w_);
  }
  static constexpr std::uint64_t extra_bytes_per_element = sizeof(float);  // the fp32 gradient

 private:
  buffer<float> grad32_;
  at::Tensor p_, g_, w_, g32_, m_, v_;
  at::Tensor step_ = at::scalar_tensor(static_cast<double>(kStep), at::kFloat);
};
template <>
class torch_side<policies::bf16_fp32_master> : public torch_side_fp32_master<policies::bf16_fp32_master> {
  using torch_side_fp32_master::torch_side_fp32_master;
};
template <>
class torch_side<policies::fp16_fp32_master> : public torch_side_fp32_master<policies::fp16_fp32_master> {
  using torch_side_fp32_master::torch_side_fp32_master;
};

// ---- the access pattern's ceiling -------------------------------------------------------

// The bits of a storage type, and back; and a change of width (the high half, as a
// conversion between float and bf16 would keep).
template <class T>
using bits_t = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
template <class T>
bits_t<T> to_bits(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return mpzero::detail::float_as_bits(x);
  } else {
    return x.bits;
  }
}
template <class T>
T of_bits(bits_t<T> b) {
  if constexpr (std::is_same_v<T, float>) {
    return mpzero::detail::bits_as_float(b);
  } else {
    return T::from_bits(b);
  }
}
template <class To, class From>
bits_t<To> rewidth(bits_t<From> b) {
  if constexpr (sizeof(To) == sizeof(From)) {
    return b;
  } else if constexpr (sizeof(To) > sizeof(From)) {
    return static_cast<std::uint32_t>(b) << 16;
  } else {
    return static_cast<std::uint16_t>(b >> 16);
  }
}

// Policy's AdamW step with the arithmetic taken out: reads the gradient, reads and
// writes the master (the parameter when it is the master) and both states, writes the
// parameter when it is separate; each value changes by an XOR, so the stores are real.
// The same chunks and threads as host::run.
template <precision_policy Policy>
class pattern_side {
  using P = typename Policy::param_type;
  using G = typename Policy::grad_type;
  using M = typename Policy::master_type;
  using S = typename Policy::state_type;

 public:
  explicit pattern_side(model_state<Policy>& s) : s_(s) {}
  void run() const {
    P* MPZERO_RESTRICT pp = s_.param.data();
    const G* MPZERO_RESTRICT pg = s_.grad.data();
    M* MPZERO_RESTRICT pw = nullptr;
    if constexpr (!Policy::master_is_param) pw = s_.master.data();
    S* MPZERO_RESTRICT pm = s_.exp_avg.data();
    S* MPZERO_RESTRICT pv = s_.exp_avg_sq.data();
    parallel_chunks(s_.n, kChunk, [&](std::uint64_t lo, std::uint64_t hi) {
      for (std::uint64_t i = lo; i < hi; ++i) {
        const bits_t<G> g = to_bits(pg[i]);
        if constexpr (Policy::master_is_param) {
          pp[i] = of_bits<P>(to_bits(pp[i]) ^ rewidth<P, G>(g));
        } else {
          const bits_t<M> w = to_bits(pw[i]) ^ rewidth<M, G>(g);
          pw[i] = of_bits<M>(w);
          pp[i] = of_bits<P>(rewidth<P, M>(w));
        }
        pm[i] = of_bits<S>(to_bits(pm[i]) ^ bits_t<S>{1});
        pv[i] = of_bits<S>(to_bits(pv[i]) ^ bits_t<S>{2});
      }
    });
  }

 private:
  model_state<Policy>& s_;
};

// ---- the benchmarks --------------------------------------------------------------------

// Runs Side's step over a fresh model_state<Policy> of n elements; reports Policy's
// bytes per element whichever side runs, so a pair's bytes_per_second compare directly.
template <precision_policy Policy, class Side>
void bench_side(benchmark::State& state, std::uint64_t n, std::uint64_t extra_bytes_per_element) {
  model_state<Policy> s(n);
  Side side(s);
  side.run();  // warm-up: thread pool, TLB, and torch's dispatcher
  for (auto _ : state) {
    side.run();
    benchmark::ClobberMemory();  // the step's stores happen every iteration
  }
  // Keep the result observable: read back one element written by the last step.
  benchmark::DoNotOptimize(s.param.data()[n / 2]);
  set_common_counters(
      state, n, static_cast<double>(step_bytes_per_element<Policy, adamw>()),
      static_cast<double>((step_footprint_per_element<Policy, adamw>() + extra_bytes_per_element) * n));
  state.counters["threads"] = bench_threads();
}

template <precision_policy Policy>
void BM_mpzero(benchmark::State& state, std::uint64_t n) {
  bench_side<Policy, mpzero_side<Policy>>(state, n, 0);
}

template <precision_policy Policy>
void BM_torch(benchmark::State& state, std::uint64_t n) {
  bench_side<Policy, torch_side<Policy>>(state, n, torch_side<Policy>::extra_bytes_per_element);
}

template <precision_policy Policy>
void BM_pattern(benchmark::State& state, std::uint64_t n) {
  bench_side<Policy, pattern_side<Policy>>(state, n, 0);
}

// 256K elements (4 of mpzero's chunks: threading overhead, in L2/L3), 4M (64 MiB of
// fp32 state), 32M (past this machine's 480 MiB last-level cache for the fp32 configs)
// and 128M (past it for all).
const std::vector<std::uint64_t> kSizes = {1u << 18, 1u << 22, 1u << 25, 1u << 27};

// A pair: the mpzero config and the torch config its ratio is taken against.
struct pair_name {
  const char* mpzero;
  const char* torch;
};
const std::vector<pair_name> kPairs = {
    {"fp32", "fp32"},         {"bf16_fp32_master", "bf16_fp32_master"}, {"fp16_fp32_master", "fp16_fp32_master"},
    {"bf16_all", "bf16_all"}, {"bf16_all_sr", "bf16_all"}};

std::string bench_name(const std::string& config, std::uint64_t n, const char* side) {
  return config + "/" + std::to_string(n) + "/" + side;
}

// Per size, each pair's two sides run back to back, so drift in the machine's load
// hits both alike.
void register_benchmarks() {
  for (const std::uint64_t n : kSizes) {
    auto reg = [&](const char* config, const char* side, void (*fn)(benchmark::State&, std::uint64_t)) {
      benchmark::RegisterBenchmark(bench_name(config, n, side).c_str(), fn, n)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    };
    reg("fp32", "mpzero", BM_mpzero<policies::fp32>);
    reg("fp32", "torch", BM_torch<policies::fp32>);
    reg("fp32", "pattern", BM_pattern<policies::fp32>);
    reg("bf16_fp32_master", "mpzero", BM_mpzero<policies::bf16_fp32_master>);
    reg("bf16_fp32_master", "torch", BM_torch<policies::bf16_fp32_master>);
    reg("bf16_fp32_master", "pattern", BM_pattern<policies::bf16_fp32_master>);
    reg("fp16_fp32_master", "mpzero", BM_mpzero<policies::fp16_fp32_master>);
    reg("fp16_fp32_master", "torch", BM_torch<policies::fp16_fp32_master>);
    reg("bf16_all", "mpzero", BM_mpzero<policies::bf16_all>);
    reg("bf16_all", "torch", BM_torch<policies::bf16_all>);
    reg("bf16_all", "pattern", BM_pattern<policies::bf16_all>);
    reg("bf16_all_sr", "mpzero", BM_mpzero<policies::bf16_all_sr>);
  }
}

// ---- the ratio summary -----------------------------------------------------------------

// The console reporter, plus a record of every run's bytes_per_second, from which the
// table of mpzero / torch ratios is printed after the run. With repetitions it uses
// the median; otherwise the mean of the runs.
class summary_reporter : public benchmark::ConsoleReporter {
 public:
  using benchmark::ConsoleReporter::ConsoleReporter;

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      entry& e = results_[r.run_name.function_name];
      if (r.run_type == Run::RT_Aggregate) {
        if (r.aggregate_name == "median") e.median = it->second.value;
      } else {
        e.sum += it->second.value;
        ++e.count;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  // Printed on the reporter's own stream, so it follows the runs' lines in order.
  void print_summary() const {
    std::ostream& out = GetOutputStream();
    bool header = false;
    char line[160];
    for (const std::uint64_t n : kSizes) {
      for (const pair_name& p : kPairs) {
        const double a = value(bench_name(p.mpzero, n, "mpzero"));
        const double b = value(bench_name(p.torch, n, "torch"));
        if (a <= 0 || b <= 0) continue;  // filtered out, or failed
        if (!header) {
          out << "\nmpzero / torch (GB/s: 1e9 bytes per second, bytes = n x the mpzero policy's B/elem; "
              << (any_median() ? "medians" : "means of the runs") << ")\n";
          std::snprintf(line, sizeof line, "%12s  %-18s %-18s %12s %12s %8s\n", "n", "mpzero policy", "torch",
                        "mpzero GB/s", "torch GB/s", "ratio");
          out << line;
          header = true;
        }
        std::snprintf(line, sizeof line, "%12llu  %-18s %-18s %12.2f %12.2f %8.2f\n",
                      static_cast<unsigned long long>(n), p.mpzero, p.torch, a / 1e9, b / 1e9, a / b);
        out << line;
      }
    }
    header = false;
    for (const std::uint64_t n : kSizes) {
      for (const pair_name& p : kPairs) {
        if (std::string(p.mpzero) != p.torch) continue;  // one line per config
        const double c = value(bench_name(p.mpzero, n, "pattern"));
        const double a = value(bench_name(p.mpzero, n, "mpzero"));
        const double b = value(bench_name(p.torch, n, "torch"));
        if (c <= 0 || a <= 0 || b <= 0) continue;
        if (!header) {
          out << "\nthe access pattern's ceiling (\"pattern\": the step's loads and stores, no arithmetic); "
                 "pattern / torch approximates the best ratio any step can reach against torch here\n";
          std::snprintf(line, sizeof line, "%12s  %-18s %13s %15s %14s %14s\n", "n", "config", "pattern GB/s",
                        "mpzero/pattern", "torch/pattern", "pattern/torch");
          out << line;
          header = true;
        }
        std::snprintf(line, sizeof line, "%12llu  %-18s %13.2f %15.2f %14.2f %14.2f\n",
                      static_cast<unsigned long long>(n), p.mpzero, c / 1e9, a / c, b / c, c / b);
        out << line;
      }
    }
    out.flush();
  }

 private:
  struct entry {
    double median = -1;
    double sum = 0;
    int count = 0;
  };
  double value(const std::string& name) const {
    const auto it = results_.find(name);
    if (it == results_.end()) return -1;
    if (it->second.median > 0) return it->second.median;
    return it->second.count > 0 ? it->second.sum / it->second.count : -1;
  }
  bool any_median() const {
    return std::any_of(results_.begin(), results_.end(), [](const auto& kv) { return kv.second.median > 0; });
  }
  std::map<std::string, entry> results_;
};

// ---- start-up check (not timed) ---------------------------------------------------------

// max over i of |a_i - b_i| / max(|b_i|, floor): the relative error, with an absolute
// floor for values near zero (where a few ulps of the update are all that differ).
double max_rel_diff(const buffer<float>& a, const buffer<float>& b, double floor) {
  double worst = 0;
  for (std::uint64_t i = 0; i < a.size(); ++i) {
    const double x = a.data()[i], y = b.data()[i];
    worst = std::max(worst, std::abs(x - y) / std::max(std::abs(y), floor));
  }
  return worst;
}

// Largest difference in units of the last place between two 16-bit arrays (same signs
// assumed: the values stay away from zero crossings in one step, or differ by more).
template <class T>
std::uint32_t max_ulp_diff(const buffer<T>& a, const buffer<T>& b) {
  std::uint32_t worst = 0;
  for (std::uint64_t i = 0; i < a.size(); ++i) {
    const int d = static_cast<int>(a.data()[i].bits) - static_cast<int>(b.data()[i].bits);
    worst = std::max<std::uint32_t>(worst, static_cast<std::uint32_t>(std::abs(d)));
  }
  return worst;
}

bool changed(const buffer<float>& a, const buffer<float>& b) {
  for (std::uint64_t i = 0; i < a.size(); ++i)
    if (a.data()[i] != b.data()[i]) return true;
  return false;
}

// One step of each side on identical inputs; the results must agree. Catches a
// hyperparameter, step count or composite that differs between the two sides (which
// would make the timings compare different work). Returns false, having printed why.
bool sanity_check() {
  constexpr std::uint64_t n = 3 * std::uint64_t{kChunk} + 123;  // several chunks and a ragged tail
  constexpr double tol = 1e-6, floor = 1e-3;                     // floor: lr, the size of one update
  bool ok = true;
  auto report = [&](const char* what, double err, double limit) {
    const bool pass = err <= limit;
    std::fflush(stdout);
    std::fprintf(pass ? stdout : stderr, "sanity: %-40s %.3g (limit %.3g) %s\n", what, err, limit,
                 pass ? "ok" : "FAILED");
    ok = ok && pass;
  };
  {
    model_state<policies::fp32> a(n), b(n), before(n);
    mpzero_side<policies::fp32>(a).run();
    torch_side<policies::fp32>(b).run();
    if (!changed(a.param, before.param)) {
      std::fprintf(stderr, "sanity: FAILED: the fp32 step left the parameters unchanged\n");
      ok = false;
    }
    report("fp32 param, max rel diff", max_rel_diff(a.param, b.param, floor), tol);
    // The states with floors a tenth of their typical size: torch forms the first
    // moment as lerp(m, g, 1 - beta1), mpzero as beta1 m + (1 - beta1) g; the two
    // round differently where the terms cancel.
    report("fp32 exp_avg, max rel diff", max_rel_diff(a.exp_avg, b.exp_avg, 1e-4), 1e-5);
    report("fp32 exp_avg_sq, max rel diff", max_rel_diff(a.exp_avg_sq, b.exp_avg_sq, 1e-6), 1e-5);
  }
  {
    model_state<policies::bf16_fp32_master> a(n), b(n);
    mpzero_side<policies::bf16_fp32_master>(a).run();
    torch_side<policies::bf16_fp32_master>(b).run();
    report("bf16_fp32_master master, max rel diff", max_rel_diff(a.master, b.master, floor), tol);
    report("bf16_fp32_master param, max ulp diff", max_ulp_diff(a.param, b.param), 1);
  }
  {
    model_state<policies::fp16_fp32_master> a(n), b(n);
    mpzero_side<policies::fp16_fp32_master>(a).run();
    torch_side<policies::fp16_fp32_master>(b).run();
    report("fp16_fp32_master master, max rel diff", max_rel_diff(a.master, b.master, floor), tol);
    report("fp16_fp32_master param, max ulp diff", max_ulp_diff(a.param, b.param), 1);
  }
  {
    model_state<policies::bf16_all> a(n), b(n);
    mpzero_side<policies::bf16_all>(a).run();
    torch_side<policies::bf16_all>(b).run();
    report("bf16_all param, max ulp diff", max_ulp_diff(a.param, b.param), 1);
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  // One thread count for both sides: LibTorch's intra-op pool gets OpenMP's count.
  at::set_num_threads(bench_threads());
  register_benchmarks();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  try {
    if (!sanity_check()) {
      std::fprintf(stderr,
                   "mpzero_bench_torch: mpzero and LibTorch disagree after one AdamW step on identical inputs, so "
                   "their timings would not compare the same work; fix the setup (hyperparameters, step count, "
                   "composite) before benchmarking.\n");
      return 3;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpzero_bench_torch: start-up check failed: %s\n", e.what());
    return 3;
  }

  benchmark::AddCustomContext("torch_version", TORCH_VERSION);
  benchmark::AddCustomContext("torch_threads", std::to_string(at::get_num_threads()));
  benchmark::AddCustomContext("torch_cpu_capability", at::get_cpu_capability());
  add_host_context();

  // The display is always the console format (colour on a terminal only); write JSON
  // with --benchmark_out=FILE --benchmark_out_format=json.
  summary_reporter display(isatty(STDOUT_FILENO) ? benchmark::ConsoleReporter::OO_Color
                                                 : benchmark::ConsoleReporter::OO_None);
  benchmark::RunSpecifiedBenchmarks(&display);
  display.print_summary();
  benchmark::Shutdown();
  return 0;
}

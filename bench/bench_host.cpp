// Host backend of the fused optimizer step against plain memory baselines, in one binary.
//
// Every step benchmark reports the bytes the step must move (see bench/README.md for
// the formula) as bytes_per_second; the copy baseline moves the same byte volume with
// memcpy, split into the same chunks and spread over the same OpenMP threads with the
// same static schedule, so "step GB/s / copy GB/s" compares like with like.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.hpp"

#include <mpzero/backend/host_backend.hpp>

using namespace mpzero;
using namespace mpzero_bench;

namespace {

// The common counters plus the thread count.
void set_host_counters(benchmark::State& state, std::uint64_t n, double bytes_per_element, double footprint) {
  set_common_counters(state, n, bytes_per_element, footprint);
  state.counters["threads"] = bench_threads();
}

// One fused step over one tensor of range(0) elements (the plan splits it into
// 64K-element chunks that host::run spreads over the threads).
template <precision_policy Policy, optim::rule Optimizer>
void BM_step(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  constexpr int ns = Optimizer::n_states;
  using tensor = step_tensor<Policy, Optimizer>;

  buffer<typename Policy::param_type> param(n);
  buffer<typename Policy::grad_type> grad(n);
  std::vector<std::unique_ptr<buffer<typename Policy::master_type>>> master;
  std::vector<std::unique_ptr<buffer<typename Policy::state_type>>> states;
  fill(param, kChunk, kParamFill);
  fill(grad, kChunk, kGradFill);
  tensor t;
  t.param = param.data();
  t.grad = grad.data();
  t.numel = n;
  if constexpr (!Policy::master_is_param) {
    master.push_back(std::make_unique<buffer<typename Policy::master_type>>(n));
    fill(*master[0], kChunk, kParamFill);
    t.master = master[0]->data();
  }
  for (int k = 0; k < ns; ++k) {
    states.push_back(std::make_unique<buffer<typename Policy::state_type>>(n));
    fill(*states[k], kChunk, state_fill(k, ns));
    t.states[k] = states[k]->data();
  }
  const fused_step<Policy, Optimizer> step(std::vector<tensor>{t});
  const auto args = make_step_args<Optimizer>(bench_options<Optimizer>(), 10, 1.0f, 0x5eed);
  const host::options opt{bench_threads()};
  host::run(step, args, opt);  // warm the thread pool and the caches' TLB entries

  for (auto _ : state) {
    host::run(step, args, opt);
    benchmark::ClobberMemory();
  }
  set_host_counters(state, n, static_cast<double>(step_bytes_per_element<Policy, Optimizer>()),
                    static_cast<double>(step_footprint_per_element<Policy, Optimizer>() * n));
}

// The gradient check every ZeRO step runs before the update (global squared L2 norm
// for clipping, non-finite flag for loss scaling): one read of the gradients, credited
// with sizeof(G) bytes per element.
template <storage_type G>
void BM_grad_stats(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  buffer<G> grad(n);
  fill(grad, kChunk, kGradFill);
  const std::uint64_t numel[1] = {n};
  const multi_tensor_plan plan(numel);
  const grad_view<G> view[1] = {{grad.data(), n}};
  const host::options opt{bench_threads()};
  grad_stats s = host::gradient_stats<G>(plan, view, opt);
  for (auto _ : state) {
    s = host::gradient_stats<G>(plan, view, opt);
    benchmark::DoNotOptimize(s);
  }
  if (s.nonfinite) state.SkipWithError("the benchmark's gradients should be finite");
  set_host_counters(state, n, static_cast<double>(sizeof(G)), static_cast<double>(sizeof(G) * n));
}

// host_backend::accumulate: dst = round(dst + src * scale), what the ZeRO core does with
// every gradient of every backward on host memory (and offload's host partition).
// Credited with sizeof(S) + 2 sizeof(D) bytes per element (src read, dst read and written).
template <storage_type D, storage_type S>
void BM_accumulate(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  buffer<D> dst(n);
  buffer<S> src(n);
  fill(dst, kChunk, kGradFill);
  fill(src, kChunk, kGradFill);
  const host_backend be{host::options{bench_threads()}};
  be.accumulate(dst.data(), src.data(), n, 0.5f);
  for (auto _ : state) {
    be.accumulate(dst.data(), src.data(), n, 0.5f);
    benchmark::ClobberMemory();
  }
  set_host_counters(state, n, static_cast<double>(sizeof(S) + 2 * sizeof(D)),
                    static_cast<double>((sizeof(S) + sizeof(D)) * n));
}

// memcpy of range(0) * range(1) / 2 bytes: read and write together move range(1)
// bytes per element, the volume of a step that moves range(1) bytes per element.
// Chunks hold the bytes of one 64K-element step chunk, so both run on the same
// number of chunks with the same schedule.
void BM_copy(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const auto bpe = static_cast<std::uint64_t>(state.range(1));
  const std::uint64_t bytes = n * bpe / 2;
  const std::uint64_t chunk = std::uint64_t{kChunk} * bpe / 2;
  buffer<unsigned char> src(bytes), dst(bytes);
  unsigned char* s = src.data();
  unsigned char* d = dst.data();
  parallel_chunks(bytes, chunk, [&](std::uint64_t b, std::uint64_t e) {
    std::memset(s + b, 0x3c, e - b);
    std::memset(d + b, 0, e - b);
  });
  for (auto _ : state) {
    parallel_chunks(bytes, chunk, [&](std::uint64_t b, std::uint64_t e) { std::memcpy(d + b, s + b, e - b); });
    benchmark::ClobberMemory();
  }
  set_host_counters(state, n, static_cast<double>(bpe), 2.0 * static_cast<double>(bytes));
}

// In-place update of range(0) * range(1) / 2 bytes of fp32, x[i] = x[i] * q: the same
// byte volume as a step of range(1) B/elem, read and written back where it lies, as
// the step does with its master weights and states. A plain copy writes to lines it
// never read, which costs x86 a read for ownership per line: on this kind of machine
// an in-place stream runs well ahead of memcpy, so this is the tighter baseline.
void BM_rmw(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const auto bpe = static_cast<std::uint64_t>(state.range(1));
  const std::uint64_t floats = n * bpe / 2 / sizeof(float);
  const std::uint64_t chunk = std::uint64_t{kChunk} * bpe / 2 / sizeof(float);
  buffer<float> x(floats);
  float* MPZERO_RESTRICT px = x.data();
  fill(x, chunk, {10, 0.5f, 1.0f});
  // Alternating factors keep the values in range however many iterations run.
  float q = 0.5f;
  for (auto _ : state) {
    parallel_chunks(floats, chunk, [&](std::uint64_t lo, std::uint64_t hi) {
      for (std::uint64_t i = lo; i < hi; ++i) px[i] = px[i] * q;
    });
    q = q == 0.5f ? 2.0f : 0.5f;
    benchmark::ClobberMemory();
  }
  set_host_counters(state, n, static_cast<double>(bpe), static_cast<double>(floats * sizeof(float)));
}

// STREAM-style triad over fp32 arrays, a[i] = b[i] + q * c[i] (read 2, write 1:
// 12 B/elem), with the step's chunking. A second reference point with a read:write
// mix nearer the step's.
void BM_triad(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  buffer<float> a(n), b(n), c(n);
  float* MPZERO_RESTRICT pa = a.data();
  const float* MPZERO_RESTRICT pb = b.data();
  const float* MPZERO_RESTRICT pc = c.data();
  fill(a, kChunk, {7, 0.0f, 1.0f});
  fill(b, kChunk, {8, 0.0f, 1.0f});
  fill(c, kChunk, {9, 0.0f, 1.0f});
  const float q = 0.5f;
  for (auto _ : state) {
    parallel_chunks(n, kChunk, [&](std::uint64_t lo, std::uint64_t hi) {
      for (std::uint64_t i = lo; i < hi; ++i) pa[i] = pb[i] + q * pc[i];
    });
    benchmark::ClobberMemory();
  }
  set_host_counters(state, n, 12.0, 12.0 * static_cast<double>(n));
}

// 64K elements (one chunk: one thread) to 128M elements (1.0 to 2.25 GiB of model
// state, several times this machine's 480 MiB last-level cache).
void step_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : {1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 27}) b->Arg(n);
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

void copy_sizes(benchmark::internal::Benchmark* b) {
  // Bytes per element of the steps registered below: 30 (fp32 gradients of a bf16
  // model), 28 (fp32, fp32 masters), 22 (16-bit master, fp32 states), 20 (fp32 SGD,
  // Lion), 14 (all bf16).
  b->ArgsProduct({{1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 27}, {14, 20, 22, 28, 30}});
  b->ArgNames({"n", "B/elem"})->UseRealTime()->Unit(benchmark::kMicrosecond);
}

// Ablation, not an optimizer: AdamW's update with parts of its arithmetic taken out, to
// see which part bounds a step (docs/perf.md, "Host step: AdamW arithmetic ablation").
// Variant 0 is all of AdamW's
// arithmetic (the same operations as optim::adamw); 1 multiplies where AdamW divides;
// 2 skips the square root; 3 does both; 4 keeps no arithmetic but a move of each value
// (the loads, conversions, rounding and stores of the step stay in every variant).
template <int Variant>
struct adamw_ablation : optim::adamw {
  MPZERO_FORCEINLINE static void update(const params& p, float& w, float g, float (&s)[2]) noexcept {
    if constexpr (Variant == 4) {
      s[0] = g;
      s[1] = fp::add(s[1], g);
      w = fp::sub(w, g);
    } else {
      w = fp::mul(w, p.decay_factor);
      const float m = fp::add(fp::mul(p.beta1, s[0]), fp::mul(p.one_minus_beta1, g));
      const float v = fp::add(fp::mul(p.beta2, s[1]), fp::mul(fp::mul(p.one_minus_beta2, g), g));
      const float root = Variant == 2 || Variant == 3 ? v : fp::sqrt(v);
      const float denom = fp::add(fp::mul(root, p.inv_sqrt_bias2), p.eps);
      const float ratio = Variant == 1 || Variant == 3 ? fp::mul(m, denom) : fp::div(m, denom);
      w = fp::sub(w, fp::mul(p.step_size, ratio));
      s[0] = m;
      s[1] = v;
    }
  }
};

// In the cache (64K) and above it (32M, 128M elements).
void ablation_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : {1 << 16, 1 << 25, 1 << 27}) b->Arg(n);
  b->UseRealTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_step, policies::fp32, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_fp32_master, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_master_fp32_states, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all_sr, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::fp16_fp32_master, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::fp16_master_fp32_states, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_fp32_grads, optim::adamw)->Apply(step_sizes);
// The engine's tables run Adam and AdamW through one rule, adam_runtime (in AdamW mode
// here): its step must keep adamw's speed.
BENCHMARK_TEMPLATE(BM_step, policies::fp32, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_fp32_master, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all_sr, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::fp16_fp32_master, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::fp32, optim::sgd)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::fp32, optim::lion)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_grad_stats, float)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_grad_stats, bf16)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_grad_stats, fp16)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_accumulate, float, float)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_accumulate, float, bf16)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_accumulate, bf16, bf16)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_accumulate, fp16, fp16)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_accumulate, float, fp16)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, adamw_ablation<0>)->Apply(ablation_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, adamw_ablation<1>)->Apply(ablation_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, adamw_ablation<2>)->Apply(ablation_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, adamw_ablation<3>)->Apply(ablation_sizes);
BENCHMARK_TEMPLATE(BM_step, policies::bf16_all, adamw_ablation<4>)->Apply(ablation_sizes);
BENCHMARK(BM_copy)->Apply(copy_sizes);
BENCHMARK(BM_rmw)->Apply(copy_sizes);
BENCHMARK(BM_triad)->Apply(step_sizes);

int main(int argc, char** argv) {
  add_host_context();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

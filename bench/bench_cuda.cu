// CUDA backend of the fused optimizer step against device copy baselines, in one binary.
//
// Each iteration is timed with CUDA events around the work on one stream
// (UseManualTime), so host overheads outside the stream do not count and launch
// latency does. The step reports the bytes it must move (bench/README.md); the copy
// baselines move the same byte volume with cudaMemcpyAsync (device to device) and with
// a plain 16-byte-vector copy kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <mpzero/cuda/fused_step.cuh>

#include "bench_common.hpp"

using namespace mpzero;
using namespace mpzero_bench;

namespace {

// Device memory that frees itself; errors surface as mpzero::cuda_error.
class device_buffer {
 public:
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) { MPZERO_CUDA_CHECK(cudaMalloc(&p_, bytes == 0 ? 1 : bytes)); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { cudaFree(p_); }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(p_);
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

class stream_and_events {
 public:
  stream_and_events() {
    MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    MPZERO_CUDA_CHECK(cudaEventCreate(&start));
    MPZERO_CUDA_CHECK(cudaEventCreate(&stop));
  }
  stream_and_events(const stream_and_events&) = delete;
  stream_and_events& operator=(const stream_and_events&) = delete;
  ~stream_and_events() {
    cudaEventDestroy(stop);
    cudaEventDestroy(start);
    cudaStreamDestroy(stream);
  }
  // Times `work` (which enqueues on `stream`) with events; returns seconds.
  template <class Work>
  double time(Work&& work) {
    MPZERO_CUDA_CHECK(cudaEventRecord(start, stream));
    work();
    MPZERO_CUDA_CHECK(cudaEventRecord(stop, stream));
    MPZERO_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    MPZERO_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms) * 1e-3;
  }
  cudaStream_t stream{};
  cudaEvent_t start{}, stop{};
};

template <storage_type T>
__global__ void fill_kernel(T* p, std::uint64_t n, std::uint64_t salt, float lo, float hi) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x)
    p[i] = from_float<T>(hashed_uniform(i, salt, lo, hi));
}

template <storage_type T>
void fill(const device_buffer& b, std::uint64_t n, fill_range r, cudaStream_t s) {
  fill_kernel<T><<<1024, 256, 0, s>>>(b.as<T>(), n, r.salt, r.lo, r.hi);
  MPZERO_CUDA_CHECK(cudaGetLastError());
}

// A plain copy kernel: 16-byte vectors, grid-stride; the bandwidth a simple
// memory-bound kernel reaches on this device.
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x)
    dst[i] = src[i];
}

// Turns a CUDA or mpzero failure into a skipped benchmark with the message.
template <class Body>
void guarded(benchmark::State& state, Body&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// A launch shape other than the library's (cuda_step_tuning), for the sweep below.
template <int Threads, int Ilp, std::uint32_t Chunk = 65536>
struct tuning {
  static constexpr int threads = Threads;
  static constexpr int ilp = Ilp;
  static constexpr std::uint32_t chunk = Chunk;
};

template <precision_policy Policy, optim::rule Optimizer, class Tuning = cuda_step_tuning<Policy::rounding::stochastic>>
void BM_cuda_step(benchmark::State& state) {
  guarded(state, [&] {
    const auto n = static_cast<std::uint64_t>(state.range(0));
    constexpr int ns = Optimizer::n_states;
    using tensor = step_tensor<Policy, Optimizer>;
    stream_and_events se;
    device_buffer param(n * sizeof(typename Policy::param_type));
    device_buffer grad(n * sizeof(typename Policy::grad_type));
    device_buffer master(Policy::master_is_param ? 0 : n * sizeof(typename Policy::master_type));
    std::vector<std::unique_ptr<device_buffer>> states;
    fill<typename Policy::param_type>(param, n, kParamFill, se.stream);
    fill<typename Policy::grad_type>(grad, n, kGradFill, se.stream);
    tensor t;
    t.param = param.as<typename Policy::param_type>();
    t.grad = grad.as<typename Policy::grad_type>();
    t.numel = n;
    if constexpr (!Policy::master_is_param) {
      fill<typename Policy::master_type>(master, n, kParamFill, se.stream);
      t.master = master.as<typename Policy::master_type>();
    }
    for (int k = 0; k < ns; ++k) {
      states.push_back(std::make_unique<device_buffer>(n * sizeof(typename Policy::state_type)));
      fill<typename Policy::state_type>(*states[k], n, state_fill(k, ns), se.stream);
      t.states[k] = states[k]->as<typename Policy::state_type>();
    }
    // The library's shape gets the library's plan (smaller chunks for a small step); a
    // shape of the sweep below keeps its own chunk.
    const std::vector<tensor> ts{t};
    const plan_options plan = std::is_same_v<Tuning, cuda_step_tuning<Policy::rounding::stochastic>>
                                  ? plan_for<Tuning>(ts, mpzero::cuda::multiprocessors())
                                  : plan_for<Tuning>();
    const fused_step<Policy, Optimizer> step(ts, plan);
    mpzero::cuda::fused_step_launcher<Policy, Optimizer, Tuning> launcher(step);
    device_buffer workspace(launcher.workspace_bytes());
    launcher.upload(workspace.as<void>(), workspace.bytes(), se.stream);
    const auto args = make_step_args<Optimizer>(bench_options<Optimizer>(), 10, 1.0f, 0x5eed);
    launcher.run(args, se.stream);  // warm-up: module load, first touch of the tables
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(se.stream));

    for (auto _ : state) state.SetIterationTime(se.time([&] { launcher.run(args, se.stream); }));
    set_common_counters(state, n, static_cast<double>(step_bytes_per_element<Policy, Optimizer>()),
                        static_cast<double>(step_footprint_per_element<Policy, Optimizer>() * n));
  });
}

// cudaMemcpyAsync device to device of range(0) * range(1) / 2 bytes: range(1) bytes
// per element of reads and writes together, the volume of a step of range(1) B/elem.
void BM_cuda_memcpy(benchmark::State& state) {
  guarded(state, [&] {
    const auto n = static_cast<std::uint64_t>(state.range(0));
    const auto bpe = static_cast<std::uint64_t>(state.range(1));
    const std::uint64_t bytes = n * bpe / 2;
    stream_and_events se;
    device_buffer src(bytes), dst(bytes);
    MPZERO_CUDA_CHECK(cudaMemsetAsync(src.as<void>(), 0x3c, bytes, se.stream));
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(dst.as<void>(), src.as<void>(), bytes, cudaMemcpyDeviceToDevice, se.stream));
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(se.stream));
    for (auto _ : state) {
      state.SetIterationTime(se.time([&] {
        MPZERO_CUDA_CHECK(
            cudaMemcpyAsync(dst.as<void>(), src.as<void>(), bytes, cudaMemcpyDeviceToDevice, se.stream));
      }));
    }
    set_common_counters(state, n, static_cast<double>(bpe), 2.0 * static_cast<double>(bytes));
  });
}

// The same volume through copy_kernel, with enough blocks to fill every SM.
void BM_cuda_copy_kernel(benchmark::State& state) {
  guarded(state, [&] {
    const auto n = static_cast<std::uint64_t>(state.range(0));
    const auto bpe = static_cast<std::uint64_t>(state.range(1));
    const std::uint64_t words = n * bpe / 2 / sizeof(uint4);
    stream_and_events se;
    device_buffer src(words * sizeof(uint4)), dst(words * sizeof(uint4));
    MPZERO_CUDA_CHECK(cudaMemsetAsync(src.as<void>(), 0x3c, src.bytes(), se.stream));
    int device = 0, sms = 0;
    MPZERO_CUDA_CHECK(cudaGetDevice(&device));
    MPZERO_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    constexpr int threads = 512;
    const auto blocks = static_cast<unsigned>(
        std::min<std::uint64_t>(std::uint64_t(sms) * 8, (words + threads - 1) / threads + 1));
    auto launch = [&] {
      copy_kernel<<<blocks, threads, 0, se.stream>>>(src.as<const uint4>(), dst.as<uint4>(), words);
      MPZERO_CUDA_CHECK(cudaGetLastError());
    };
    launch();
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(se.stream));
    for (auto _ : state) state.SetIterationTime(se.time(launch));
    set_common_counters(state, n, static_cast<double>(bpe), 2.0 * static_cast<double>(words * sizeof(uint4)));
  });
}

// 64K to 256M elements; from 16M elements up every policy's state is far above the
// H100's 50 MB L2.
const std::vector<std::int64_t> kSizes = {1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28};

void step_sizes(benchmark::internal::Benchmark* b) {
  for (std::int64_t n : kSizes) b->Arg(n);
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void copy_sizes(benchmark::internal::Benchmark* b) {
  // Bytes per element of the steps registered below: 30, 28, 22, 20 and 14.
  b->ArgsProduct({kSizes, {14, 20, 22, 28, 30}});
  b->ArgNames({"n", "B/elem"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_cuda_step, policies::fp32, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_fp32_master, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_master_fp32_states, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_all, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_all_sr, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::fp16_fp32_master, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::fp16_master_fp32_states, optim::adamw)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_fp32_grads, optim::adamw)->Apply(step_sizes);
// adam_runtime (the engine's Adam/AdamW kernel, one kernel per mode; AdamW mode here),
// against adamw's rows above.
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_all, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_all_sr, optim::adam_runtime)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::fp32, optim::sgd)->Apply(step_sizes);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::fp32, optim::lion)->Apply(step_sizes);
// Launch-shape sweep (docs/perf.md, "CUDA launch shapes"): threads per block, elements per
// thread and chunk size, at 64M elements, for the policies furthest from copy bandwidth.
// --benchmark_filter=tuning selects them.
void sweep_size(benchmark::internal::Benchmark* b) {
  b->Arg(std::int64_t{1} << 26)->UseManualTime()->Unit(benchmark::kMicrosecond);
}
#define MPZERO_TUNING_SWEEP(P)                                                                                \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<512, 8>)->Apply(sweep_size);                        \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<256, 8>)->Apply(sweep_size);                        \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<1024, 8>)->Apply(sweep_size);                       \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<128, 8>)->Apply(sweep_size);                        \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<256, 16>)->Apply(sweep_size);                       \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<512, 8, 16384>)->Apply(sweep_size);                 \
  BENCHMARK_TEMPLATE(BM_cuda_step, P, optim::adamw, tuning<512, 8, 262144>)->Apply(sweep_size);
// At a million elements the library's shapes with their own chunks, as the library ran
// them before it shrank the chunks of small steps (16K: 64 blocks; 64K: 16 blocks),
// beside the library's rows above.
void small_size(benchmark::internal::Benchmark* b) {
  b->Arg(std::int64_t{1} << 20)->UseManualTime()->Unit(benchmark::kMicrosecond);
}
BENCHMARK_TEMPLATE(BM_cuda_step, policies::fp32, optim::adamw, tuning<512, 8, 16384>)->Apply(small_size);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_all, optim::adamw, tuning<512, 8, 16384>)->Apply(small_size);
BENCHMARK_TEMPLATE(BM_cuda_step, policies::bf16_all_sr, optim::adamw, tuning<1024, 8, 65536>)->Apply(small_size);
MPZERO_TUNING_SWEEP(policies::fp32)
MPZERO_TUNING_SWEEP(policies::bf16_fp32_master)
MPZERO_TUNING_SWEEP(policies::bf16_all_sr)
MPZERO_TUNING_SWEEP(policies::fp16_master_fp32_states)
#undef MPZERO_TUNING_SWEEP
BENCHMARK(BM_cuda_memcpy)->Apply(copy_sizes);
BENCHMARK(BM_cuda_copy_kernel)->Apply(copy_sizes);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);  // first, so --help works on a machine without a GPU
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    std::fprintf(stderr,
                 "mpzero_bench_cuda: no usable CUDA device (%s). This benchmark needs an NVIDIA GPU and its driver; "
                 "run it on a GPU machine, or run mpzero_bench_host for the host backend.\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found 0 devices");
    return 2;
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "mpzero_bench_cuda: cannot query CUDA device %d\n", device);
    return 2;
  }
  int bus_bits = 0, mem_khz = 0, driver = 0, runtime = 0;
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device);
  cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, device);
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  benchmark::AddCustomContext("cuda_device", prop.name);
  benchmark::AddCustomContext("cuda_sm", std::to_string(prop.major) + "." + std::to_string(prop.minor) + " x " +
                                             std::to_string(prop.multiProcessorCount) + " SMs");
  benchmark::AddCustomContext("cuda_memory_GiB", std::to_string(prop.totalGlobalMem >> 30));
  benchmark::AddCustomContext("cuda_l2_MiB", std::to_string(prop.l2CacheSize >> 20));
  // Double data rate: two transfers per memory clock.
  benchmark::AddCustomContext("cuda_peak_dram_GBps",
                              std::to_string(2.0 * mem_khz * 1e3 * (bus_bits / 8) / 1e9));
  benchmark::AddCustomContext("cuda_driver_runtime", std::to_string(driver) + " / " + std::to_string(runtime));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

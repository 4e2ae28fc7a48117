// Pieces shared by mpzero's benchmark programs (bench_host.cpp, bench_cuda.cu,
// bench_torch.cpp): the bytes a step must move, the optimizer options every benchmark
// uses, the deterministic fill values, the common counters, and host buffers.
//
// Plain C++20: compiles with g++ and with nvcc -std=c++20 (the host parts are host
// code either way; hashed_uniform is also a device function under nvcc).
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

#include <sys/mman.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <mpzero/mpzero.hpp>

namespace mpzero_bench {

// Bytes one step must read and write per element, from the policy's storage types:
// the gradient is read; the parameter is read and written when it is the master,
// and only written when a separate master is read and written; each optimizer state
// is read and written (bench/README.md, "Bytes per element of a step").
template <mpzero::precision_policy Policy, mpzero::optim::rule Optimizer>
constexpr std::uint64_t step_bytes_per_element() {
  std::uint64_t b = sizeof(typename Policy::grad_type);
  if constexpr (Policy::master_is_param) {
    b += 2 * sizeof(typename Policy::param_type);
  } else {
    b += sizeof(typename Policy::param_type) + 2 * sizeof(typename Policy::master_type);
  }
  return b + 2 * static_cast<std::uint64_t>(Optimizer::n_states) * sizeof(typename Policy::state_type);
}

// Bytes of model state the step touches per element (its working set).
template <mpzero::precision_policy Policy, mpzero::optim::rule Optimizer>
constexpr std::uint64_t step_footprint_per_element() {
  std::uint64_t b = sizeof(typename Policy::grad_type) + sizeof(typename Policy::param_type);
  if constexpr (!Policy::master_is_param) b += sizeof(typename Policy::master_type);
  return b + static_cast<std::uint64_t>(Optimizer::n_states) * sizeof(typename Policy::state_type);
}

static_assert(step_bytes_per_element<mpzero::policies::fp32, mpzero::optim::adamw>() == 28);
static_assert(step_bytes_per_element<mpzero::policies::bf16_fp32_master, mpzero::optim::adamw>() == 28);
static_assert(step_bytes_per_element<mpzero::policies::bf16_all, mpzero::optim::adamw>() == 14);

// The hyperparameters of every benchmark (the values do not change the cost of the
// step; they only need to be typical and the same on both sides of a comparison).
template <mpzero::optim::rule Optimizer>
typename Optimizer::options bench_options() {
  typename Optimizer::options o{};
  if constexpr (std::same_as<Optimizer, mpzero::optim::adamw> || std::same_as<Optimizer, mpzero::optim::adam> ||
                std::same_as<Optimizer, mpzero::optim::adam_runtime>) {  // adam_runtime: AdamW by default
    o.lr = 1e-3;
    o.weight_decay = 0.01;
  } else if constexpr (std::same_as<Optimizer, mpzero::optim::sgd>) {
    o.lr = 1e-2;
    o.momentum = 0.9;
    o.weight_decay = 1e-4;
  } else {
    o.lr = 1e-4;
    o.weight_decay = 0.01;
  }
  return o;
}

// Deterministic values in [lo, hi), cheap enough to fill gigabytes (host and device).
MPZERO_HOST_DEVICE inline float hashed_uniform(std::uint64_t i, std::uint64_t salt, float lo, float hi) {
  std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (salt * 0xD1B54A32D192ED03ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  const float u = static_cast<float>(x >> 40) * 0x1p-24f;
  return lo + (hi - lo) * u;
}

// The value ranges the step benchmarks fill their arrays with (salt, lo, hi).
struct fill_range {
  std::uint64_t salt;
  float lo, hi;
};
inline constexpr fill_range kParamFill{1, -1.0f, 1.0f};  // master too: the same values as the param
inline constexpr fill_range kGradFill{2, -1e-2f, 1e-2f};
// Optimizer state k; Adam's second moment (k == 1 of 2) must be non-negative.
constexpr fill_range state_fill(int k, int n_states) {
  const bool second_moment = n_states == 2 && k == 1;
  return fill_range{static_cast<std::uint64_t>(3 + k), second_moment ? 0.0f : -1e-3f, second_moment ? 1e-4f : 1e-3f};
}

// bytes_per_second (SetBytesProcessed), elem/s, B/elem and MiB (the working set).
inline void set_common_counters(benchmark::State& state, std::uint64_t n, double bytes_per_element,
                                double footprint_bytes) {
  const double iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(iters * bytes_per_element * static_cast<double>(n)));
  state.counters["elem/s"] = benchmark::Counter(iters * static_cast<double>(n), benchmark::Counter::kIsRate);
  state.counters["B/elem"] = bytes_per_element;
  state.counters["MiB"] = footprint_bytes / (1024.0 * 1024.0);
}

// ---- host memory -------------------------------------------------------------------

inline constexpr std::uint32_t kChunk = mpzero::plan_options{}.chunk_size;

inline int bench_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Runs body(begin, end) over [0, n) in chunks of `chunk` on every thread with a static
// schedule: the same split of work over threads that host::run uses for one tensor.
template <class Body>
void parallel_chunks(std::uint64_t n, std::uint64_t chunk, Body&& body) {
  const auto chunks = static_cast<std::int64_t>((n + chunk - 1) / chunk);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(bench_threads())
#endif
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::uint64_t b = static_cast<std::uint64_t>(c) * chunk;
    body(b, std::min(n, b + chunk));
  }
}

// A page-aligned array, advised onto transparent huge pages and first touched by the
// threads that will stream it (the same chunks the benchmark loop gives them), so that
// neither page faults nor TLB misses differ between the step and the baselines.
template <class T>
class buffer {
 public:
  explicit buffer(std::uint64_t n) : n_(n) {
    constexpr std::size_t align = 2u << 20;
    const std::size_t bytes = std::max<std::size_t>(align, (n * sizeof(T) + align - 1) / align * align);
    data_ = static_cast<T*>(std::aligned_alloc(align, bytes));
    if (data_ == nullptr) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
    madvise(data_, bytes, MADV_HUGEPAGE);
#endif
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() { std::free(data_); }
  T* data() const noexcept { return data_; }
  std::uint64_t size() const noexcept { return n_; }

 private:
  T* data_ = nullptr;
  std::uint64_t n_ = 0;
};

// Fills (and so first-touches) a host buffer in the step's chunks on the step's threads.
template <mpzero::storage_type T>
void fill(const buffer<T>& b, std::uint64_t chunk, fill_range r) {
  T* p = b.data();
  parallel_chunks(b.size(), chunk, [&](std::uint64_t begin, std::uint64_t end) {
    for (std::uint64_t i = begin; i < end; ++i) p[i] = mpzero::from_float<T>(hashed_uniform(i, r.salt, r.lo, r.hi));
  });
}

// The host step's build and run-time configuration, in the benchmark's context block,
// so that every result file says what it measured.
inline void add_host_context() {
  benchmark::AddCustomContext("mpzero_threads", std::to_string(bench_threads()));
  benchmark::AddCustomContext("mpzero_chunk_elements", std::to_string(kChunk));
  benchmark::AddCustomContext("mpzero_host_simd", mpzero::host::simd_name());
#if defined(MPZERO_BENCH_NATIVE_ON)
  benchmark::AddCustomContext("mpzero_march_native", "yes");
#else
  benchmark::AddCustomContext("mpzero_march_native", "no");
#endif
#if defined(MPZERO_BENCH_CXX_FLAGS)
  benchmark::AddCustomContext("mpzero_cxx_flags", MPZERO_BENCH_CXX_FLAGS);
#endif
}

}  // namespace mpzero_bench

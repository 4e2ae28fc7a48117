// mpzero: the host backend. Runs a plan's chunks on OpenMP threads (serially when
// built without OpenMP); each chunk is a plain loop over restrict pointers that the
// compiler vectorizes, calling the same per-element code as the CUDA kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <vector>

#include "../config.hpp"
#include "../multi_tensor/plan.hpp"
#include "../numeric/dtype.hpp"
#include "../step/fused_step.hpp"
#include "../step/grad_stats.hpp"

namespace mpzero::host {


struct options {
  int threads = 0;  // 0: OpenMP's default (OMP_NUM_THREADS or all cores)
};

namespace detail {

template <class Body>
void for_each_chunk(std::size_t num_chunks, const options& opt, Body&& body) {
  const auto n = static_cast<std::int64_t>(num_chunks);
#if defined(_OPENMP)
  if (opt.threads > 0) {
#pragma omp parallel for schedule(static) num_threads(opt.threads)
    for (std::int64_t c = 0; c < n; ++c) body(static_cast<std::size_t>(c));
  } else {
#pragma omp parallel for schedule(static)
    for (std::int64_t c = 0; c < n; ++c) body(static_cast<std::size_t>(c));
  }
#else
  (void)opt;
  for (std::int64_t c = 0; c < n; ++c) body(static_cast<std::size_t>(c));
#endif
}

template <precision_policy Policy, optim::rule Optimizer>
MPZERO_FORCEINLINE void step_range_body(const step_tensor<Policy, Optimizer>& t, std::uint64_t begin,
                                        std::uint32_t size, const step_args<Optimizer>& a) {
  using param_t = typename Policy::param_type;
  using master_t = typename Policy::master_type;
  using grad_t = typename Policy::grad_type;
  using state_t = typename Policy::state_type;
  constexpr int n = Optimizer::n_states;
  param_t* MPZERO_RESTRICT param = t.param + begin;
  const grad_t* MPZERO_RESTRICT grad = t.grad + begin;
  master_t* MPZERO_RESTRICT master = nullptr;
  if constexpr (Policy::master_is_param) {
    master = param;
  } else {
    master = t.master + begin;
  }
  state_t* MPZERO_RESTRICT s0 = t.states[0] + begin;
  state_t* MPZERO_RESTRICT s1 = n > 1 ? t.states[n > 1 ? 1 : 0] + begin : nullptr;
  state_t* MPZERO_RESTRICT s2 = n > 2 ? t.states[n > 2 ? 2 : 0] + begin : nullptr;
  const std::uint64_t base = t.global_offset + begin;
  for (std::uint32_t i = 0; i < size; ++i) {
    master_t w = master[i];
    state_t s[n];
    s[0] = s0[i];
    if constexpr (n > 1) s[1] = s1[i];
    if constexpr (n > 2) s[2] = s2[i];
    param_t p{};
    update_element<Policy, Optimizer>(a, base + i, w, grad[i], s, p);
    master[i] = w;
    if constexpr (!Policy::master_is_param) param[i] = p;
    s0[i] = s[0];
    if constexpr (n > 1) s1[i] = s[1];
    if constexpr (n > 2) s2[i] = s[2];
  }
}

// The loop compiled for the widest vectors the CPU has, chosen at run time, so a
// binary built for baseline x86-64 still uses AVX2 or AVX-512. No FMA is enabled in
// these targets (and -ffp-contract=off forbids contraction anyway): every variant
// rounds alike, bit for bit.
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && \
    !defined(MPZERO_NO_RUNTIME_SIMD)
#define MPZERO_RUNTIME_SIMD 1

template <precision_policy Policy, optim::rule Optimizer>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"))) void step_range_avx512(
    const step_tensor<Policy, Optimizer>& t, std::uint64_t begin, std::uint32_t size, const step_args<Optimizer>& a) {
  step_range_body<Policy, Optimizer>(t, begin, size, a);
}

template <precision_policy Policy, optim::rule Optimizer>
__attribute__((target("avx2"))) void step_range_avx2(const step_tensor<Policy, Optimizer>& t, std::uint64_t begin,
                                                     std::uint32_t size, const step_args<Optimizer>& a) {
  step_range_body<Policy, Optimizer>(t, begin, size, a);
}

// 2: AVX-512 (F, BW, VL, DQ), 1: AVX2, 0: the build's baseline. MPZERO_HOST_SIMD=0/1/2
// caps it (for comparisons and tests).
inline int simd_level() {
  static const int level = [] {
    __builtin_cpu_init();
    int l = 0;
    if (__builtin_cpu_supports("avx2")) l = 1;
    if (l == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      l = 2;
    if (const char* cap = std::getenv("MPZERO_HOST_SIMD"); cap != nullptr && cap[0] >= '0' && cap[0] <= '2' && cap[1] == '\0')
      l = std::min(l, cap[0] - '0');
    return l;
  }();
  return level;
}
#endif

template <precision_policy Policy, optim::rule Optimizer>
void step_range(const step_tensor<Policy, Optimizer>& t, std::uint64_t begin, std::uint32_t size,
                const step_args<Optimizer>& a) {
#if defined(MPZERO_RUNTIME_SIMD)
  switch (simd_level()) {
    case 2: step_range_avx512<Policy, Optimizer>(t, begin, size, a); return;
    case 1: step_range_avx2<Policy, Optimizer>(t, begin, size, a); return;
    default: break;
  }
#endif
  step_range_body<Policy, Optimizer>(t, begin, size, a);
}

}  // namespace detail

// Which vector instructions the host step uses on this CPU: "avx512", "avx2" or "baseline".
inline const char* simd_name() {
#if defined(MPZERO_RUNTIME_SIMD)
  switch (detail::simd_level()) {
    case 2: return "avx512";
    case 1: return "avx2";
    default: return "baseline";
  }
#else
  return "baseline";
#endif
}

// Runs one optimizer step over every tensor of `step`.
template <precision_policy Policy, optim::rule Optimizer>
void run(const fused_step<Policy, Optimizer>& step, const step_args<Optimizer>& args, const options& opt = {}) {
  const auto chunks = step.plan().chunks();
  const auto tensors = step.tensors();
  detail::for_each_chunk(chunks.size(), opt, [&](std::size_t c) {
    const chunk& ch = chunks[c];
    detail::step_range<Policy, Optimizer>(tensors[ch.tensor], ch.begin, ch.size, args);
  });
}

namespace detail {

// Sum of squares of one chunk in fp64, eight interleaved accumulators combined in a
// fixed order: deterministic, and fast enough to stay memory-bound.
template <storage_type G>
grad_stats chunk_stats(const G* MPZERO_RESTRICT x, std::uint32_t n) {
  double acc[8] = {};
  bool bad = false;
  std::uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const float v = to_float(x[i + k]);
      bad |= !fp::is_finite(v);
      acc[k] += static_cast<double>(v) * static_cast<double>(v);
    }
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    bad |= !fp::is_finite(v);
    acc[i & 7u] += static_cast<double>(v) * static_cast<double>(v);
  }
  const double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  return {sum, bad};
}

}  // namespace detail

// Squared global L2 norm and non-finite check of many gradient tensors, in one pass.
// The result does not depend on the thread count: chunk partials are summed in plan order.
template <storage_type G>
grad_stats gradient_stats(const multi_tensor_plan& plan, std::span<const grad_view<G>> grads,
                          const options& opt = {}) {
  const auto chunks = plan.chunks();
  std::vector<grad_stats> partial(chunks.size());
  detail::for_each_chunk(chunks.size(), opt, [&](std::size_t c) {
    const chunk& ch = chunks[c];
    partial[c] = detail::chunk_stats(grads[ch.tensor].data + ch.begin, ch.size);
  });
  grad_stats total;
  for (const grad_stats& p : partial) {
    total.norm_squared += p.norm_squared;
    total.nonfinite = total.nonfinite || p.nonfinite;
  }
  return total;
}

}  // namespace mpzero::host

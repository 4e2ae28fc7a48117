// mpzero: one CUDA thread's share of the fused step and of the gradient check, as
// functions of (chunk, thread index) that compile for host and device alike.
//
// The kernels in fused_step.cuh are thin: block b takes chunk b of its launch and
// thread t calls these with t. Nothing here synchronises threads, and no two threads
// of a grid touch the same element (thread t owns the chunk's vector groups t, t +
// Threads, ... and then its tail elements t, t + Threads, ...), so running every
// (chunk, thread) pair one after another on the host gives what the grid gives on a
// device. tests/test_kernel_threads.cpp does that in CPU CI, bit for bit against the
// element-wise step (update_element), for every precision policy: the kernel's
// indexing, vector and tail paths, alignment fallback and per-pair random draws are
// tested without a GPU. What only a device shows (nvcc's code for the same text, the
// launches themselves, CUB's reduction) is left to the [gpu] tests.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../config.hpp"
#include "../multi_tensor/plan.hpp"
#include "../numeric/convert.hpp"
#include "../numeric/fp_ops.hpp"
#include "../numeric/rounding_bits.hpp"
#include "../step/fused_step.hpp"
#include "../step/grad_stats.hpp"

#if defined(__CUDACC__)
#include <vector_types.h>
#endif

namespace mpzero::cuda::detail {

// A 16-byte word: CUDA's uint4 in device code (one 128-bit load or store), a plain
// 16-byte struct on the host, where may_alias lets it read and write the elements'
// storage without breaking strict aliasing.
#if defined(__CUDACC__)
using word16 = uint4;
#else
struct __attribute__((may_alias, aligned(16))) word16 {
  std::uint32_t x, y, z, w;
};

// On a device an unaligned 16-byte access faults ("misaligned address"); on the host
// it would quietly work, so the host version refuses it as loudly.
[[noreturn]] inline void misaligned_vector_access(const void* p) {
  throw std::logic_error("mpzero::cuda::detail: a 16-byte vector access at " +
                         std::to_string(reinterpret_cast<std::uintptr_t>(p)) +
                         ", not 16-byte aligned (a 'misaligned address' fault on a GPU)");
}
#endif

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE bool aligned16(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

// Loads N elements of T starting at p (16-byte aligned, N * sizeof(T) a multiple of 16).
template <class T, int N>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void load_vec(const T* p, T (&out)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "vector loads move whole 16-byte words");
  constexpr int words = static_cast<int>(N * sizeof(T) / 16);
#if !defined(__CUDACC__)
  if (!aligned16(p)) misaligned_vector_access(p);
#endif
  word16 tmp[words];
  MPZERO_UNROLL
  for (int k = 0; k < words; ++k) tmp[k] = reinterpret_cast<const word16*>(p)[k];
  __builtin_memcpy(out, tmp, sizeof(tmp));
}

template <class T, int N>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void store_vec(T* p, const T (&in)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "vector stores move whole 16-byte words");
  constexpr int words = static_cast<int>(N * sizeof(T) / 16);
#if !defined(__CUDACC__)
  if (!aligned16(p)) misaligned_vector_access(p);
#endif
  word16 tmp[words];
  __builtin_memcpy(tmp, in, sizeof(tmp));
  MPZERO_UNROLL
  for (int k = 0; k < words; ++k) reinterpret_cast<word16*>(p)[k] = tmp[k];
}

// Thread `thread` (0 .. Threads - 1) of the block that runs chunk `c` of tensor `t`.
// When every array of the chunk is 16-byte aligned, the thread takes groups of Ilp
// elements (vector loads and stores) and the last size % Ilp elements one at a time;
// otherwise it takes all its elements one at a time. Mode: the optimizer's mode
// (optim::moded_rule), chosen by the launcher for the whole grid (optim::visit_mode);
// -1 lets the rule choose per element.
template <precision_policy Policy, optim::rule Optimizer, int Threads, int Ilp, int Mode = -1>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void fused_step_thread(const step_tensor<Policy, Optimizer>& t, const chunk& c,
                                                             const step_args<Optimizer>& args, std::uint32_t thread) {
  using param_t = typename Policy::param_type;
  using master_t = typename Policy::master_type;
  using grad_t = typename Policy::grad_type;
  using state_t = typename Policy::state_type;
  constexpr int n = Optimizer::n_states;

  param_t* param = t.param + c.begin;
  const grad_t* grad = t.grad + c.begin;
  master_t* master = nullptr;
  if constexpr (Policy::master_is_param) {
    master = param;
  } else {
    master = t.master + c.begin;
  }
  state_t* states[n];
  bool vec_ok = aligned16(param) && aligned16(grad) && aligned16(master);
  MPZERO_UNROLL
  for (int k = 0; k < n; ++k) {
    states[k] = t.states[k] + c.begin;
    vec_ok = vec_ok && aligned16(states[k]);
  }
  const std::uint64_t base = t.global_offset + c.begin;
  const std::uint32_t n_vec = vec_ok ? (c.size / Ilp) * Ilp : 0u;
  // Stochastic rounding: the step's key once per thread, then per element its pair's
  // state and the words its halves come from (numeric/rounding_bits.hpp); the bits
  // depend on the global index alone.
  constexpr bool sr = Policy::rounding::stochastic;
  constexpr int halves = rounding_halves<Policy, Optimizer>;
  rounding_key key{};
  if constexpr (sr) key = rounding_key_of(args.seed, args.step);

  for (std::uint32_t i = thread * Ilp; i < n_vec; i += Threads * Ilp) {
    grad_t g[Ilp];
    master_t w[Ilp];
    state_t s[n][Ilp];
    param_t p[Ilp];
    load_vec(grad + i, g);
    load_vec(master + i, w);
    MPZERO_UNROLL
    for (int k = 0; k < n; ++k) load_vec(states[k] + i, s[k]);
    MPZERO_UNROLL
    for (int j = 0; j < Ilp; ++j) {
      element_bits bits{};
      if constexpr (sr) bits = element_rounding_bits<halves>(key, base + i + j);
      state_t sj[n];
      MPZERO_UNROLL
      for (int k = 0; k < n; ++k) sj[k] = s[k][j];
      update_element_with_bits<Policy, Optimizer, Mode>(args, bits, w[j], g[j], sj, p[j]);
      MPZERO_UNROLL
      for (int k = 0; k < n; ++k) s[k][j] = sj[k];
    }
    store_vec(master + i, w);
    if constexpr (!Policy::master_is_param) store_vec(param + i, p);
    MPZERO_UNROLL
    for (int k = 0; k < n; ++k) store_vec(states[k] + i, s[k]);
  }
  // Tail, or a tensor whose pointers are not 16-byte aligned: one element at a time.
  for (std::uint32_t i = n_vec + thread; i < c.size; i += Threads) {
    master_t w = master[i];
    state_t s[n];
    MPZERO_UNROLL
    for (int k = 0; k < n; ++k) s[k] = states[k][i];
    param_t p{};
    element_bits bits{};
    if constexpr (sr) bits = element_rounding_bits<halves>(key, base + i);
    update_element_with_bits<Policy, Optimizer, Mode>(args, bits, w, grad[i], s, p);
    master[i] = w;
    if constexpr (!Policy::master_is_param) param[i] = p;
    MPZERO_UNROLL
    for (int k = 0; k < n; ++k) states[k][i] = s[k];
  }
}

// One thread's part of a chunk's gradient check: the sum of squares (fp64) of elements
// thread, thread + Threads, ... and whether one of them is not finite. The kernel
// adds the threads' sums with cub::BlockReduce.
struct thread_stats {
  double sum_squares = 0;
  int nonfinite = 0;
};

template <storage_type G, int Threads>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE thread_stats grad_stats_thread(const grad_view<G>& g, const chunk& c,
                                                                     std::uint32_t thread) {
  const G* x = g.data + c.begin;
  thread_stats out;
  for (std::uint32_t i = thread; i < c.size; i += Threads) {
    const float v = to_float(x[i]);
    out.nonfinite |= fp::is_finite(v) ? 0 : 1;
    out.sum_squares += static_cast<double>(v) * static_cast<double>(v);
  }
  return out;
}

}  // namespace mpzero::cuda::detail

// mpzero: the CUDA backend of the fused step and of the gradient check. These
// kernels only move data: the arithmetic is update_element_with_bits() with the
// rounding bits of pair_random_bits() / element_pair_bits(), and to_float(), the code
// the host backend runs, so both give the same bits.
//
// Two-phase use (CUB's habit): ask workspace_bytes(), hand in device memory with
// upload() once (the tensor and chunk tables live there and are reused every step),
// then run() on a stream each step.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../multi_tensor/plan.hpp"
#include "../multi_tensor/tuning.hpp"
#include "../step/fused_step.hpp"
#include "../step/grad_stats.hpp"
#include "check.cuh"
#include "vector_io.cuh"

namespace mpzero::cuda {

namespace detail {

template <precision_policy Policy, optim::rule Optimizer, int Threads, int Ilp>
__global__ void __launch_bounds__(Threads)
    fused_step_kernel(const step_tensor<Policy, Optimizer>* tensors, const chunk* chunks, step_args<Optimizer> args) {
  using param_t = typename Policy::param_type;
  using master_t = typename Policy::master_type;
  using grad_t = typename Policy::grad_type;
  using state_t = typename Policy::state_type;
  constexpr int n = Optimizer::n_states;

  const chunk c = chunks[blockIdx.x];
  const step_tensor<Policy, Optimizer>& t = tensors[c.tensor];
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
#pragma unroll
  for (int k = 0; k < n; ++k) {
    states[k] = t.states[k] + c.begin;
    vec_ok = vec_ok && aligned16(states[k]);
  }
  const std::uint64_t base = t.global_offset + c.begin;
  const std::uint32_t n_vec = vec_ok ? (c.size / Ilp) * Ilp : 0u;

  for (std::uint32_t i = threadIdx.x * Ilp; i < n_vec; i += Threads * Ilp) {
    grad_t g[Ilp];
    master_t w[Ilp];
    state_t s[n][Ilp];
    param_t p[Ilp];
    load_vec(grad + i, g);
    load_vec(master + i, w);
#pragma unroll
    for (int k = 0; k < n; ++k) load_vec(states[k] + i, s[k]);
    // One Philox draw per pair of elements (numeric/philox.hpp). i is a multiple of
    // Ilp (even), so every thread of the block sees the same parity of base + i: when
    // base is odd, element 0's pair began in the previous thread's group and is drawn
    // again here; the bits depend on the global index alone.
    philox_u32x4 draw{};
#pragma unroll
    for (int j = 0; j < Ilp; ++j) {
      const std::uint64_t gi = base + i + j;
      element_bits bits{};
      if constexpr (Policy::rounding::stochastic) {
        if (j == 0 || (gi & 1u) == 0) draw = pair_random_bits(args.seed, args.step, gi >> 1);
        bits = element_pair_bits(draw, gi);
      }
      state_t sj[n];
#pragma unroll
      for (int k = 0; k < n; ++k) sj[k] = s[k][j];
      update_element_with_bits<Policy, Optimizer>(args, bits, w[j], g[j], sj, p[j]);
#pragma unroll
      for (int k = 0; k < n; ++k) s[k][j] = sj[k];
    }
    store_vec(master + i, w);
    if constexpr (!Policy::master_is_param) store_vec(param + i, p);
#pragma unroll
    for (int k = 0; k < n; ++k) store_vec(states[k] + i, s[k]);
  }
  // Tail, or a tensor whose pointers are not 16-byte aligned: one element at a time,
  // each drawing its pair's bits for itself.
  for (std::uint32_t i = n_vec + threadIdx.x; i < c.size; i += Threads) {
    master_t w = master[i];
    state_t s[n];
#pragma unroll
    for (int k = 0; k < n; ++k) s[k] = states[k][i];
    param_t p{};
    update_element<Policy, Optimizer>(args, base + i, w, grad[i], s, p);
    master[i] = w;
    if constexpr (!Policy::master_is_param) param[i] = p;
#pragma unroll
    for (int k = 0; k < n; ++k) states[k][i] = s[k];
  }
}

template <storage_type G, int Threads>
__global__ void __launch_bounds__(Threads)
    grad_stats_kernel(const grad_view<G>* grads, const chunk* chunks, double* partials, int* nonfinite) {
  using reduce_t = cub::BlockReduce<double, Threads>;
  __shared__ typename reduce_t::TempStorage temp;
  const chunk c = chunks[blockIdx.x];
  const G* x = grads[c.tensor].data + c.begin;
  double acc = 0.0;
  int bad = 0;
  for (std::uint32_t i = threadIdx.x; i < c.size; i += Threads) {
    const float v = to_float(x[i]);
    bad |= fp::is_finite(v) ? 0 : 1;
    acc += static_cast<double>(v) * static_cast<double>(v);
  }
  const double sum = reduce_t(temp).Sum(acc);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *nonfinite = 1;
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// Adds the chunk partials in a fixed order: the same bits every run.
template <int Threads>
__global__ void __launch_bounds__(Threads) sum_partials_kernel(const double* partials, std::uint32_t n, double* out) {
  using reduce_t = cub::BlockReduce<double, Threads>;
  __shared__ typename reduce_t::TempStorage temp;
  double acc = 0.0;
  for (std::uint32_t i = threadIdx.x; i < n; i += Threads) acc += partials[i];
  const double sum = reduce_t(temp).Sum(acc);
  if (threadIdx.x == 0) *out = sum;
}

inline std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

inline void require_workspace(const void* ws, std::size_t given, std::size_t needed, const char* who) {
  if (needed == 0) return;  // nothing to upload (no tensors): any pointer, null included
  if (ws == nullptr) {
    mpzero::detail::throw_invalid(std::string(who) + ": workspace is null; pass device memory of workspace_bytes() = " +
                                  std::to_string(needed) + " bytes");
  }
  if (given < needed) {
    mpzero::detail::throw_invalid(std::string(who) + ": workspace of " + std::to_string(given) +
                                  " bytes is too small; workspace_bytes() asks for " + std::to_string(needed));
  }
  if ((reinterpret_cast<std::uintptr_t>(ws) & 255u) != 0) {
    mpzero::detail::throw_invalid(std::string(who) + ": workspace must be 256-byte aligned (cudaMalloc memory is)");
  }
}

}  // namespace detail

// Runs a fused_step on a CUDA stream. The tensors' pointers must be device memory.
template <precision_policy Policy, optim::rule Optimizer, class Tuning = cuda_tuning>
class fused_step_launcher {
 public:
  using tensor = step_tensor<Policy, Optimizer>;

  explicit fused_step_launcher(const fused_step<Policy, Optimizer>& step)
      : tensors_(step.tensors().begin(), step.tensors().end()),
        chunks_(step.plan().chunks().begin(), step.plan().chunks().end()),
        launches_(step.plan().launches().begin(), step.plan().launches().end()) {}

  std::size_t workspace_bytes() const noexcept {
    return detail::align_up(tensors_.size() * sizeof(tensor), 256) + chunks_.size() * sizeof(chunk);
  }

  // Copies the tensor and chunk tables into `workspace` (device memory, 256-byte
  // aligned, at least workspace_bytes()); asynchronous on `stream`.
  void upload(void* workspace, std::size_t bytes, cudaStream_t stream) {
    detail::require_workspace(workspace, bytes, workspace_bytes(), "fused_step_launcher::upload");
    auto* base = static_cast<unsigned char*>(workspace);
    d_tensors_ = reinterpret_cast<tensor*>(base);
    d_chunks_ = reinterpret_cast<chunk*>(base + detail::align_up(tensors_.size() * sizeof(tensor), 256));
    if (!tensors_.empty())
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(d_tensors_, tensors_.data(), tensors_.size() * sizeof(tensor),
                                        cudaMemcpyHostToDevice, stream));
    if (!chunks_.empty())
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(d_chunks_, chunks_.data(), chunks_.size() * sizeof(chunk),
                                        cudaMemcpyHostToDevice, stream));
  }

  // One optimizer step: one kernel launch per launch range of the plan.
  void run(const step_args<Optimizer>& args, cudaStream_t stream) const {
    if (d_chunks_ == nullptr && !chunks_.empty())
      mpzero::detail::throw_invalid("fused_step_launcher::run: call upload() first");
    for (const launch_range& l : launches_) {
      detail::fused_step_kernel<Policy, Optimizer, Tuning::threads, Tuning::ilp>
          <<<l.num_chunks, Tuning::threads, 0, stream>>>(d_tensors_, d_chunks_ + l.first_chunk, args);
      MPZERO_CUDA_CHECK(cudaGetLastError());
    }
  }

 private:
  std::vector<tensor> tensors_;
  std::vector<chunk> chunks_;
  std::vector<launch_range> launches_;
  tensor* d_tensors_ = nullptr;
  chunk* d_chunks_ = nullptr;
};

// Squared global L2 norm (fp64, deterministic) and non-finite flag of many
// gradient tensors, without a host synchronisation.
template <storage_type G, class Tuning = cuda_tuning>
class gradient_stats_launcher {
 public:
  gradient_stats_launcher(const multi_tensor_plan& plan, std::span<const grad_view<G>> grads)
      : grads_(grads.begin(), grads.end()), chunks_(plan.chunks().begin(), plan.chunks().end()),
        launches_(plan.launches().begin(), plan.launches().end()) {}

  std::size_t workspace_bytes() const noexcept {
    return detail::align_up(grads_.size() * sizeof(grad_view<G>), 256) +
           detail::align_up(chunks_.size() * sizeof(chunk), 256) + chunks_.size() * sizeof(double);
  }

  void upload(void* workspace, std::size_t bytes, cudaStream_t stream) {
    detail::require_workspace(workspace, bytes, workspace_bytes(), "gradient_stats_launcher::upload");
    auto* base = static_cast<unsigned char*>(workspace);
    const std::size_t grads_bytes = detail::align_up(grads_.size() * sizeof(grad_view<G>), 256);
    d_grads_ = reinterpret_cast<grad_view<G>*>(base);
    d_chunks_ = reinterpret_cast<chunk*>(base + grads_bytes);
    d_partials_ = reinterpret_cast<double*>(base + grads_bytes + detail::align_up(chunks_.size() * sizeof(chunk), 256));
    if (!grads_.empty())
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(d_grads_, grads_.data(), grads_.size() * sizeof(grad_view<G>),
                                        cudaMemcpyHostToDevice, stream));
    if (!chunks_.empty())
      MPZERO_CUDA_CHECK(
          cudaMemcpyAsync(d_chunks_, chunks_.data(), chunks_.size() * sizeof(chunk), cudaMemcpyHostToDevice, stream));
  }

  // Writes the squared norm to *d_norm_squared; sets *d_nonfinite to 1 if any
  // element is NaN or infinite (never clears it: the caller zeroes it per step).
  void run(double* d_norm_squared, int* d_nonfinite, cudaStream_t stream) const {
    // (No gradients: nothing to upload, and the sum of no partials writes 0.)
    if (d_partials_ == nullptr && !chunks_.empty())
      mpzero::detail::throw_invalid("gradient_stats_launcher::run: call upload() first");
    for (const launch_range& l : launches_) {
      detail::grad_stats_kernel<G, Tuning::threads><<<l.num_chunks, Tuning::threads, 0, stream>>>(
          d_grads_, d_chunks_ + l.first_chunk, d_partials_ + l.first_chunk, d_nonfinite);
      MPZERO_CUDA_CHECK(cudaGetLastError());
    }
    detail::sum_partials_kernel<Tuning::reduce_threads><<<1, Tuning::reduce_threads, 0, stream>>>(
        d_partials_, static_cast<std::uint32_t>(chunks_.size()), d_norm_squared);
    MPZERO_CUDA_CHECK(cudaGetLastError());
  }

 private:
  std::vector<grad_view<G>> grads_;
  std::vector<chunk> chunks_;
  std::vector<launch_range> launches_;
  grad_view<G>* d_grads_ = nullptr;
  chunk* d_chunks_ = nullptr;
  double* d_partials_ = nullptr;
};

}  // namespace mpzero::cuda

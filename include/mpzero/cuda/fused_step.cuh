// mpzero: the CUDA backend of the fused step and of the gradient check. These
// kernels only move data: the arithmetic is update_element_with_bits() with the
// rounding bits of element_rounding_bits(), and to_float(), the code
// the host backend runs, so both give the same bits. What each thread does is in
// thread_work.hpp, which the host compiles too (CPU tests run it thread by thread).
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
#include "thread_work.hpp"

namespace mpzero::cuda {

namespace detail {

// Block b runs chunk b of its launch; each thread does its share (thread_work.hpp), in
// the optimizer's mode Mode (optim::moded_rule; 0 for a rule without modes).
template <precision_policy Policy, optim::rule Optimizer, int Threads, int Ilp, int Mode>
__global__ void __launch_bounds__(Threads)
    fused_step_kernel(const step_tensor<Policy, Optimizer>* tensors, const chunk* chunks, step_args<Optimizer> args) {
  const chunk c = chunks[blockIdx.x];
  fused_step_thread<Policy, Optimizer, Threads, Ilp, Mode>(tensors[c.tensor], c, args, threadIdx.x);
}

template <storage_type G, int Threads>
__global__ void __launch_bounds__(Threads)
    grad_stats_kernel(const grad_view<G>* grads, const chunk* chunks, double* partials, int* nonfinite) {
  using reduce_t = cub::BlockReduce<double, Threads>;
  __shared__ typename reduce_t::TempStorage temp;
  const chunk c = chunks[blockIdx.x];
  const thread_stats mine = grad_stats_thread<G, Threads>(grads[c.tensor], c, threadIdx.x);
  const double sum = reduce_t(temp).Sum(mine.sum_squares);
  if (__syncthreads_or(mine.nonfinite) && threadIdx.x == 0) *nonfinite = 1;
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

// The current device's SM count: what plan_for(tensors, multiprocessors) fills.
inline int multiprocessors() {
  int device = 0, n = 0;
  MPZERO_CUDA_CHECK(cudaGetDevice(&device));
  MPZERO_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// Runs a fused_step on a CUDA stream. The tensors' pointers must be device memory.
// Tuning: the launch shape (threads per block, elements per thread); by default the
// policy's cuda_step_tuning, whose plan_for<Tuning>(tensors, multiprocessors()) the
// fused_step is best built with (any plan works: one block runs one chunk of it).
template <precision_policy Policy, optim::rule Optimizer, class Tuning = cuda_step_tuning<Policy::rounding::stochastic>>
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

  // One optimizer step: one kernel launch per launch range of the plan. A rule with
  // modes (optim::adam_runtime) has one kernel per mode, chosen here from args, so that
  // each mode runs the code of a rule without modes: a branch per element on the mode
  // slows the stochastic-rounding kernels (docs/perf.md, "Adam and AdamW in one
  // instantiation").
  void run(const step_args<Optimizer>& args, cudaStream_t stream) const {
    if (d_chunks_ == nullptr && !chunks_.empty())
      mpzero::detail::throw_invalid("fused_step_launcher::run: call upload() first");
    optim::visit_mode<Optimizer>(args.opt, [&](auto mode) {
      for (const launch_range& l : launches_) {
        detail::fused_step_kernel<Policy, Optimizer, Tuning::threads, Tuning::ilp, decltype(mode)::value>
            <<<l.num_chunks, Tuning::threads, 0, stream>>>(d_tensors_, d_chunks_ + l.first_chunk, args);
        MPZERO_CUDA_CHECK(cudaGetLastError());
      }
    });
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

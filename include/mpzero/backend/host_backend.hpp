// mpzero: the host backend as the ZeRO optimizer sees it: owning buffers in main
// memory, element-wise helpers and the fused step, all on OpenMP threads.
// backend/cuda_backend.cuh offers the same members for device memory.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../error.hpp"
#include "../numeric/convert.hpp"
#include "../step/fused_step.hpp"
#include "../step/grad_stats.hpp"
#include "host.hpp"
#include "host_memory.hpp"

namespace mpzero {

// A host<->backend copy that may still be running (see the backends' *_async calls).
// The host backend copies synchronously, so its transfers are always complete.
struct host_transfer {
  bool done() const noexcept { return true; }
  void wait() const noexcept {}
};

struct host_backend {
  host::options options{};

  template <class T>
  using buffer = host_buffer<T>;

  static constexpr bool device_memory = false;

  template <class T>
  buffer<T> allocate(std::uint64_t n) const {
    return buffer<T>(n);
  }

  template <class T>
  void zero(T* p, std::uint64_t n) const {
    if (n > 0) std::memset(static_cast<void*>(p), 0, static_cast<std::size_t>(n) * sizeof(T));
  }

  template <class T>
  void copy(T* dst, const T* src, std::uint64_t n) const {
    if (n > 0 && dst != src) std::memmove(static_cast<void*>(dst), src, static_cast<std::size_t>(n) * sizeof(T));
  }

  // Transfers between the caller's host memory and the backend's memory: plain copies here.
  template <class T>
  void upload(T* dst, const T* host_src, std::uint64_t n) const {
    copy(dst, host_src, n);
  }
  template <class T>
  void download(T* host_dst, const T* src, std::uint64_t n) const {
    copy(host_dst, src, n);
  }

  // ZeRO-Offload's host memory: host memory is the backend's memory here, so pinning
  // has no meaning and the request is ignored.
  host_allocator host_memory(bool /*pinned*/) const noexcept { return pageable_host_allocator; }

  // Asynchronous transfers (the CUDA backend runs them on a copy stream, overlapped
  // with compute): here they are plain copies, complete on return.
  using transfer = host_transfer;
  template <class T>
  transfer download_async(T* host_dst, const T* src, std::uint64_t n) const {
    copy(host_dst, src, n);
    return {};
  }
  template <class T>
  transfer upload_async(T* dst, const T* host_src, std::uint64_t n) const {
    copy(dst, host_src, n);
    return {};
  }
  // Orders the backend's later work after `t` (nothing to order here).
  void order_after(const transfer&) const noexcept {}

  // dst[i] = round_to_nearest(dst[i] + src[i] * scale), computed in fp32.
  template <storage_type D, storage_type S>
  void accumulate(D* MPZERO_RESTRICT dst, const S* MPZERO_RESTRICT src, std::uint64_t n, float scale = 1.0f) const {
    parallel_for(n, [&](std::uint64_t begin, std::uint64_t end) {
      host::detail::elementwise<true>(dst + begin, src + begin, end - begin, scale);
    });
  }

  // dst[i] = round_to_nearest(src[i]).
  template <storage_type D, storage_type S>
  void convert(D* MPZERO_RESTRICT dst, const S* MPZERO_RESTRICT src, std::uint64_t n) const {
    parallel_for(n, [&](std::uint64_t begin, std::uint64_t end) {
      host::detail::elementwise<false>(dst + begin, src + begin, end - begin, 1.0f);
    });
  }

  template <storage_type G>
  grad_stats stats(const G* p, std::uint64_t n) const {
    const std::uint64_t numel[1] = {n};
    const multi_tensor_plan plan(numel);
    const grad_view<G> view[1] = {{p, n}};
    return host::gradient_stats<G>(plan, view, options);
  }

  // A prepared fused step over fixed tensors.
  template <precision_policy Policy, optim::rule Optimizer>
  class stepper {
   public:
    stepper(const host_backend& b, std::vector<step_tensor<Policy, Optimizer>> tensors)
        : options_(b.options), step_(std::move(tensors)) {}
    void run(const step_args<Optimizer>& args) const { host::run(step_, args, options_); }
    // A view into the stepper, deleted on rvalues (it would dangle): keep the stepper in a variable.
    std::span<const step_tensor<Policy, Optimizer>> tensors() const& noexcept { return step_.tensors(); }
    std::span<const step_tensor<Policy, Optimizer>> tensors() const&& = delete;

   private:
    host::options options_;
    fused_step<Policy, Optimizer> step_;
  };

  template <precision_policy Policy, optim::rule Optimizer>
  stepper<Policy, Optimizer> make_stepper(std::vector<step_tensor<Policy, Optimizer>> tensors) const {
    return stepper<Policy, Optimizer>(*this, std::move(tensors));
  }

  // The backend's work is complete when its calls return: nothing to order.
  void synchronize() const noexcept {}
  template <class Comm>
  void before_comm(Comm&) const noexcept {}

  // All-reduce of a few values in host memory.
  template <class Comm, class T>
  void all_reduce_host(Comm& comm, T* values, std::uint64_t n, comm::reduce_op op) const {
    comm.all_reduce(values, values, n, op);
  }
  // Broadcast of host memory from `root` (the LibTorch engine's start-up broadcast).
  template <class Comm, class T>
  void broadcast_host(Comm& comm, T* values, std::uint64_t n, int root) const {
    comm.broadcast(values, n, root);
  }

 private:
  // Splits [0, n) into blocks of whole cache lines across threads.
  template <class Body>
  void parallel_for(std::uint64_t n, Body&& body) const {
    constexpr std::uint64_t block = 1u << 16;
    const std::uint64_t blocks = (n + block - 1) / block;
    host::detail::for_each_chunk(static_cast<std::size_t>(blocks), options, [&](std::size_t b) {
      const std::uint64_t begin = b * block;
      body(begin, begin + block < n ? begin + block : n);
    });
  }
};

}  // namespace mpzero

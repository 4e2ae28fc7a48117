// mpzero: the CUDA backend as the ZeRO optimizer sees it: device buffers, element-wise
// kernels and the fused step, all ordered on one stream. Same members as host_backend.
//
// Ordering with a communicator: before every collective the optimizer calls
// before_comm(comm), which makes the communicator's stream wait for this stream (NCCL,
// cuda_local_communicator) or synchronises it (a communicator that reads device memory
// by other means, e.g. a CUDA-aware MPI that says so: comm::reads_device_memory). Host
// communicators are refused by ZeroOptimizer at construction.
#pragma once

#include <cuda_runtime.h>

#include <concepts>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../comm/communicator.hpp"
#include "../cuda/check.cuh"
#include "host_backend.hpp"
#include "../cuda/fused_step.cuh"
#include "../numeric/convert.hpp"
#include "../step/fused_step.hpp"
#include "../step/grad_stats.hpp"

namespace mpzero {

// An owning, zero-initialised array in device memory.
template <class T>
class cuda_buffer {
 public:
  cuda_buffer() = default;
  cuda_buffer(std::uint64_t n, cudaStream_t stream) : n_(n) {
    if (n == 0) return;
    if (n > SIZE_MAX / sizeof(T)) {
      throw invalid_argument("mpzero: a device buffer of " + std::to_string(n) + " elements of " +
                             std::to_string(sizeof(T)) + " bytes exceeds the address space; check the "
                             "parameter sizes (numels) given to ZeroOptimizer");
    }
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, static_cast<std::size_t>(n) * sizeof(T));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // recoverable: do not leave it for the next launch check to report
      throw cuda_error(e, "mpzero: cudaMalloc of " + std::to_string(n * sizeof(T)) +
                              " bytes failed (" + cudaGetErrorString(e) +
                              "); use a higher ZeRO stage, a lower-precision policy or CPU offload");
    }
    p_.reset(static_cast<T*>(p));
    MPZERO_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<std::size_t>(n) * sizeof(T), stream));
  }
  T* data() noexcept { return p_.get(); }
  const T* data() const noexcept { return p_.get(); }
  std::uint64_t size() const noexcept { return n_; }
  std::uint64_t bytes() const noexcept { return n_ * sizeof(T); }

 private:
  struct deleter {
    void operator()(T* p) const noexcept { cudaFree(p); }
  };
  std::unique_ptr<T, deleter> p_;
  std::uint64_t n_ = 0;
};

namespace cuda::detail {

template <storage_type D, storage_type S>
__global__ void accumulate_kernel(D* dst, const S* src, std::uint64_t n, float scale) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    dst[i] = from_float<D>(fp::add(to_float(dst[i]), fp::mul(to_float(src[i]), scale)));
  }
}

template <storage_type D, storage_type S>
__global__ void convert_kernel(D* dst, const S* src, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    dst[i] = from_float<D>(to_float(src[i]));
  }
}

inline unsigned grid_for(std::uint64_t n) {
  const std::uint64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? blocks : 65536);
}

}  // namespace cuda::detail

namespace cuda::detail {

inline void* pinned_allocate(std::size_t bytes) {
  void* p = nullptr;
  // Portable: pinned for every device of the process, whichever is current.
  if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();  // the caller falls back or reports; the next launch check must not see it
    return nullptr;
  }
  return p;
}
inline void pinned_free(void* p) noexcept { cudaFreeHost(p); }

// The copy stream of a backend and a pool of events for its transfers, and the device
// scratch of all_reduce_host. Created on first use (a default-constructed backend
// touches no device), shared by copies of the backend.
struct transfer_pool {
  std::mutex mutex;
  cudaStream_t copy = nullptr;
  std::vector<cudaEvent_t> free_events;
  // Kept between calls: all_reduce_host runs every step (norm, overflow flag), and a
  // cudaFree each time would synchronize the whole device.
  cuda_buffer<unsigned char> scratch;

  transfer_pool() = default;
  transfer_pool(const transfer_pool&) = delete;
  transfer_pool& operator=(const transfer_pool&) = delete;
  ~transfer_pool() {
    for (cudaEvent_t e : free_events) cudaEventDestroy(e);
    if (copy != nullptr) cudaStreamDestroy(copy);  // released once its queued copies finish
  }
  // At least `bytes` of device memory, valid until the next call (callers use it
  // synchronously, one at a time).
  void* scratch_for(std::size_t bytes, cudaStream_t stream) {
    std::lock_guard lock(mutex);
    if (bytes > scratch.size()) {
      scratch = {};  // the old one first: no two alive at once
      scratch = cuda_buffer<unsigned char>(bytes < 256 ? 256 : bytes, stream);
    }
    return scratch.data();
  }
  std::size_t scratch_bytes() {
    std::lock_guard lock(mutex);
    return scratch.size();
  }
  cudaStream_t stream() {
    std::lock_guard lock(mutex);
    if (copy == nullptr) MPZERO_CUDA_CHECK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
    return copy;
  }
  cudaEvent_t acquire() {
    std::lock_guard lock(mutex);
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    MPZERO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void release(cudaEvent_t e) noexcept {
    std::lock_guard lock(mutex);
    free_events.push_back(e);
  }
};

}  // namespace cuda::detail

inline constexpr host_allocator pinned_host_allocator{&cuda::detail::pinned_allocate, &cuda::detail::pinned_free,
                                                      "pinned (cudaHostAlloc)", true};

// A copy queued on a backend's copy stream: an event recorded after it. Move-only; the
// event goes back to the pool when the transfer is dropped (dropping does not wait).
class cuda_transfer {
 public:
  cuda_transfer() = default;
  cuda_transfer(std::shared_ptr<cuda::detail::transfer_pool> pool, cudaEvent_t e) : pool_(std::move(pool)), event_(e) {}
  cuda_transfer(cuda_transfer&& o) noexcept : pool_(std::move(o.pool_)), event_(std::exchange(o.event_, nullptr)) {}
  cuda_transfer& operator=(cuda_transfer&& o) noexcept {
    if (this != &o) {
      reset();
      pool_ = std::move(o.pool_);
      event_ = std::exchange(o.event_, nullptr);
    }
    return *this;
  }
  cuda_transfer(const cuda_transfer&) = delete;
  cuda_transfer& operator=(const cuda_transfer&) = delete;
  ~cuda_transfer() { reset(); }

  // Whether the copy has finished (does not block).
  bool done() const {
    if (event_ == nullptr) return true;
    const cudaError_t e = detail::query_event(event_);
    if (e == cudaErrorNotReady) return false;
    MPZERO_CUDA_CHECK(e);
    return true;
  }
  // Blocks the host until the copy has finished.
  void wait() const {
    if (event_ != nullptr) MPZERO_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  cudaEvent_t event() const noexcept { return event_; }

 private:
  void reset() noexcept {
    if (event_ != nullptr && pool_) pool_->release(event_);
    event_ = nullptr;
  }
  std::shared_ptr<cuda::detail::transfer_pool> pool_;
  cudaEvent_t event_ = nullptr;
};

struct cuda_backend {
  cudaStream_t stream = nullptr;  // the stream all work is ordered on (0: the legacy default stream)

  cuda_backend() = default;
  explicit cuda_backend(cudaStream_t s) : stream(s) {}

  template <class T>
  using buffer = cuda_buffer<T>;

  static constexpr bool device_memory = true;

  // Refuses memory this device's kernels cannot read: pageable host memory (a
  // std::vector's data, say) on a GPU without pageable-memory access (HMM/ATS), where a
  // kernel reading it would fault and take the CUDA context, with every buffer in it,
  // down; and memory of another device that this one has no peer access to. Device,
  // managed and pinned host memory pass. `who` names the call.
  void check_readable(const void* p, const std::string& who) const {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw cuda_error(e, "mpzero: " + who + ": cudaPointerGetAttributes failed (" + cudaGetErrorString(e) + ")");
    }
    int device = 0, pageable = 0;
    MPZERO_CUDA_CHECK(cudaGetDevice(&device));
    if (a.type == cudaMemoryTypeDevice && a.device != device) {
      int peer = 0;
      MPZERO_CUDA_CHECK(cudaDeviceCanAccessPeer(&peer, device, a.device));
      if (peer == 0) {
        throw invalid_argument("mpzero: " + who + ": the memory is on device " + std::to_string(a.device) + ", which kernels on device " +
                               std::to_string(device) + " cannot reach (no peer access); pass memory of device " +
                               std::to_string(device));
      }
    }
    if (a.type != cudaMemoryTypeUnregistered) return;
    MPZERO_CUDA_CHECK(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, device));
    if (pageable != 0) return;
    char addr[32];
    std::snprintf(addr, sizeof addr, "%p", p);
    throw invalid_argument("mpzero: " + who + ": " + addr + " is pageable host memory, which kernels on device " +
                           std::to_string(device) + " cannot read; pass device memory (the CUDA backend's "
                           "allocate(), cudaMalloc, a CUDA tensor's data_ptr), or pinned host memory "
                           "(cudaHostAlloc, cudaHostRegister)");
  }

  template <class T>
  buffer<T> allocate(std::uint64_t n) const {
    return buffer<T>(n, stream);
  }

  template <class T>
  void zero(T* p, std::uint64_t n) const {
    if (n > 0) MPZERO_CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<std::size_t>(n) * sizeof(T), stream));
  }

  template <class T>
  void copy(T* dst, const T* src, std::uint64_t n) const {
    if (n > 0 && dst != src)
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDefault, stream));
  }

  // Host <-> device transfers of small or inspected data; they synchronise.
  template <class T>
  void upload(T* dst, const T* host_src, std::uint64_t n) const {
    if (n == 0) return;
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyHostToDevice, stream));
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  template <class T>
  void download(T* host_dst, const T* src, std::uint64_t n) const {
    if (n == 0) return;
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToHost, stream));
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  // ZeRO-Offload's host memory: pinned (page-locked) unless the caller opts out.
  host_allocator host_memory(bool pinned) const noexcept { return pinned ? pinned_host_allocator : pageable_host_allocator; }

  // Transfers on the backend's copy stream, ordered after the work queued on `stream`
  // so far, overlapping whatever `stream` does next. The host memory should be pinned
  // (host_memory(true)); pageable memory works but copies synchronously on the host.
  // Keep both buffers alive until the transfer is done.
  using transfer = cuda_transfer;
  template <class T>
  transfer download_async(T* host_dst, const T* src, std::uint64_t n) const {
    return enqueue_copy(host_dst, src, n * sizeof(T), cudaMemcpyDeviceToHost);
  }
  template <class T>
  transfer upload_async(T* dst, const T* host_src, std::uint64_t n) const {
    return enqueue_copy(dst, host_src, n * sizeof(T), cudaMemcpyHostToDevice);
  }
  // Work queued on `stream` after this call starts after `t` has finished; the host does not wait.
  void order_after(const transfer& t) const {
    if (t.event() != nullptr) MPZERO_CUDA_CHECK(cudaStreamWaitEvent(stream, t.event(), 0));
  }

  template <storage_type D, storage_type S>
  void accumulate(D* dst, const S* src, std::uint64_t n, float scale = 1.0f) const {
    if (n == 0) return;
    cuda::detail::accumulate_kernel<D, S><<<cuda::detail::grid_for(n), 256, 0, stream>>>(dst, src, n, scale);
    MPZERO_CUDA_CHECK(cudaGetLastError());
  }

  template <storage_type D, storage_type S>
  void convert(D* dst, const S* src, std::uint64_t n) const {
    if (n == 0) return;
    cuda::detail::convert_kernel<D, S><<<cuda::detail::grid_for(n), 256, 0, stream>>>(dst, src, n);
    MPZERO_CUDA_CHECK(cudaGetLastError());
  }

  // Norm and non-finite check of one contiguous gradient range; returns on the host
  // (the step needs the decision there). The launcher and its workspace are kept for
  // the next call on the same range, which is the optimizer's pattern.
  template <storage_type G>
  grad_stats stats(const G* p, std::uint64_t n) const {
    auto& cache = stats_cache<G>();
    if (!cache || cache->data != p || cache->numel != n || cache->stream != stream) cache = std::make_unique<stats_entry<G>>(p, n, stream);
    return cache->run();
  }

  template <precision_policy Policy, optim::rule Optimizer>
  class stepper {
   public:
    stepper(const cuda_backend& b, std::vector<step_tensor<Policy, Optimizer>> tensors)
        : stream_(b.stream),
          step_(planned(std::move(tensors))),
          launcher_(step_),
          workspace_(launcher_.workspace_bytes(), stream_) {
      launcher_.upload(workspace_.data(), workspace_.size(), stream_);
    }
    void run(const step_args<Optimizer>& args) const { launcher_.run(args, stream_); }

   private:
    // The plan is read off the tensors before they move into the step.
    static fused_step<Policy, Optimizer> planned(std::vector<step_tensor<Policy, Optimizer>> tensors) {
      const plan_options plan = plan_for<cuda_step_tuning<Policy::rounding::stochastic>>(tensors, cuda::multiprocessors());
      return fused_step<Policy, Optimizer>(std::move(tensors), plan);
    }

    cudaStream_t stream_;
    fused_step<Policy, Optimizer> step_;
    cuda::fused_step_launcher<Policy, Optimizer> launcher_;
    cuda_buffer<unsigned char> workspace_;
  };

  template <precision_policy Policy, optim::rule Optimizer>
  stepper<Policy, Optimizer> make_stepper(std::vector<step_tensor<Policy, Optimizer>> tensors) const {
    return stepper<Policy, Optimizer>(*this, std::move(tensors));
  }

  // Orders a collective after the work queued so far: on the device where the
  // communicator can (wait_for(stream), or a type-erased wait_for_stream(void*) that
  // says whether it did), else by synchronizing the stream on the host.
  template <class Comm>
  void before_comm(Comm& c) const {
    if constexpr (comm::stream_ordered<Comm>) {
      c.wait_for(stream);
    } else if constexpr (comm::erased_stream_ordered<Comm>) {
      if (!c.wait_for_stream(static_cast<void*>(stream))) MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
    } else {
      MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  }

  // All-reduce of a few host values through device scratch (NCCL reads device memory).
  template <class Comm, class T>
  void all_reduce_host(Comm& c, T* values, std::uint64_t n, comm::reduce_op op) const {
    through_scratch(values, n, [&](T* d, std::uint64_t k) {
      before_comm(c);
      c.all_reduce(d, d, k, op);
    });
  }
  // Broadcast of host memory from `root`, through the same device scratch (the LibTorch
  // engine's start-up broadcast of the model).
  template <class Comm, class T>
  void broadcast_host(Comm& c, T* values, std::uint64_t n, int root) const {
    through_scratch(values, n, [&](T* d, std::uint64_t k) {
      before_comm(c);
      c.broadcast(d, k, root);
    });
  }
  // The host collectives move values through one device scratch in pieces of at most
  // this many bytes: the scratch is kept for the backend's lifetime, and a whole-model
  // call (the engine's start-up broadcast, master_weights(), a large parameter's
  // full_grad) would otherwise keep a model-sized buffer on the device. Sum, max and
  // broadcast act element by element, so the pieces give each element its result.
  static constexpr std::uint64_t host_collective_piece_bytes = std::uint64_t{4} << 20;
  // Device bytes the host collectives keep between calls (at most one piece).
  std::size_t host_collective_scratch_bytes() const { return transfers_->scratch_bytes(); }

  void synchronize() const { MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream)); }

 private:
  template <class T, class Collective>
  void through_scratch(T* values, std::uint64_t n, Collective&& collective) const {
    constexpr std::uint64_t piece = host_collective_piece_bytes / sizeof(T);
    for (std::uint64_t at = 0; at < n; at += piece) {
      const std::uint64_t k = n - at < piece ? n - at : piece;
      T* scratch = static_cast<T*>(transfers_->scratch_for(static_cast<std::size_t>(k) * sizeof(T), stream));
      upload(scratch, values + at, k);  // synchronous: the previous piece's collective is done
      collective(scratch, k);
      download(values + at, scratch, k);
    }
  }

  transfer enqueue_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) const {
    if (bytes == 0) return {};
    cudaStream_t copy = transfers_->stream();
    cudaEvent_t before = transfers_->acquire();
    // The copy must see what `stream` has queued so far (e.g. the kernel that produced src).
    cudaError_t e = cudaEventRecord(before, stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(copy, before, 0);
    transfers_->release(before);  // re-recording later is safe: the wait captured this record
    MPZERO_CUDA_CHECK(e);
    MPZERO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, copy));
    transfer t(transfers_, transfers_->acquire());
    MPZERO_CUDA_CHECK(cudaEventRecord(t.event(), copy));
    return t;
  }

  std::shared_ptr<cuda::detail::transfer_pool> transfers_ = std::make_shared<cuda::detail::transfer_pool>();

  template <storage_type G>
  struct stats_entry {
    stats_entry(const G* p, std::uint64_t n, cudaStream_t s) : data(p), numel(n), stream(s) {
      const std::uint64_t numels[1] = {n};
      plan = multi_tensor_plan(numels);
      const grad_view<G> views[1] = {{p, n}};
      launcher = std::make_unique<cuda::gradient_stats_launcher<G>>(plan, views);
      workspace = cuda_buffer<unsigned char>(launcher->workspace_bytes(), s);
      result = cuda_buffer<double>(1, s);
      flag = cuda_buffer<int>(1, s);
      launcher->upload(workspace.data(), workspace.size(), s);
    }
    grad_stats run() {
      MPZERO_CUDA_CHECK(cudaMemsetAsync(flag.data(), 0, sizeof(int), stream));
      launcher->run(result.data(), flag.data(), stream);
      double norm_sq = 0;
      int bad = 0;
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(&norm_sq, result.data(), sizeof(double), cudaMemcpyDeviceToHost, stream));
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(&bad, flag.data(), sizeof(int), cudaMemcpyDeviceToHost, stream));
      MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream));
      return {norm_sq, bad != 0};
    }
    const G* data;
    std::uint64_t numel;
    cudaStream_t stream;
    multi_tensor_plan plan;
    std::unique_ptr<cuda::gradient_stats_launcher<G>> launcher;
    cuda_buffer<unsigned char> workspace;
    cuda_buffer<double> result;
    cuda_buffer<int> flag;
  };

  template <storage_type G>
  std::unique_ptr<stats_entry<G>>& stats_cache() const {
    return std::get<std::unique_ptr<stats_entry<G>>>(*caches_);
  }

  std::shared_ptr<std::tuple<std::unique_ptr<stats_entry<float>>, std::unique_ptr<stats_entry<bf16>>,
                             std::unique_ptr<stats_entry<fp16>>>>
      caches_ = std::make_shared<std::tuple<std::unique_ptr<stats_entry<float>>, std::unique_ptr<stats_entry<bf16>>,
                                            std::unique_ptr<stats_entry<fp16>>>>();
};

}  // namespace mpzero

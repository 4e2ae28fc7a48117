// The CUDA table's rows: ZeroOptimizer<..., cuda_backend, ...> for CUDA parameters, on
// the device and stream the engine passes (torch's current stream of the parameters'
// device). Included only by the generated table units (torch.cmake, src/table_part.in),
// which nvcc compiles; the combinations are listed in core_impl.hpp (add_table_part).
// Torch-free: nvcc never sees LibTorch's headers.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mpzero/backend/cuda_backend.cuh>

#include "core_impl.hpp"

namespace mpzero::torch::detail {

// The core's device and stream; an event for ordering against other streams.
struct cuda_context {
  using backend_type = cuda_backend;

  int device = 0;
  cudaStream_t stream = nullptr;
  std::shared_ptr<cudaEvent_t> event;  // created on first use, shared by copies

  // Makes the core's device current for a call and restores the caller's.
  class scope {
   public:
    explicit scope(const cuda_context& c) {
      if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
      if (previous_ != c.device) {
        const cudaError_t e = cudaSetDevice(c.device);
        if (e != cudaSuccess) {
          throw cuda_error(e, "mpzero::torch: cudaSetDevice(" + std::to_string(c.device) +
                                  ") failed: " + cudaGetErrorString(e) +
                                  "; the engine's parameters are on a device this process cannot use");
        }
        switched_ = true;
      }
    }
    ~scope() {
      if (switched_ && previous_ >= 0) cudaSetDevice(previous_);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    int previous_ = -1;
    bool switched_ = false;
  };

  cuda_backend backend() const { return cuda_backend(stream); }

  // `waiter` waits for the work queued on `producer` so far.
  void order(cudaStream_t producer, cudaStream_t waiter) {
    if (producer == waiter) return;
    scope s(*this);
    if (!event) {
      cudaEvent_t e = nullptr;
      MPZERO_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      event = std::shared_ptr<cudaEvent_t>(new cudaEvent_t(e), [](cudaEvent_t* p) {
        cudaEventDestroy(*p);
        delete p;
      });
    }
    // Re-recording is safe: the wait captures this record.
    MPZERO_CUDA_CHECK(cudaEventRecord(*event, producer));
    MPZERO_CUDA_CHECK(cudaStreamWaitEvent(waiter, *event, 0));
  }
  void wait_stream(void* s) { order(static_cast<cudaStream_t>(s), stream); }
  void join_stream(void* s) { order(stream, static_cast<cudaStream_t>(s)); }
};

// The world-size-1 communicator of a CUDA core: every collective over one rank is a
// copy (or nothing, in place), here a device-to-device copy on the core's stream, so the
// results are ordered before the core's later work on that stream with no host wait.
// (local_communicator copies host memory: on device pointers it would crash.)
class cuda_local_communicator final : public communicator_base {
 public:
  explicit cuda_local_communicator(cudaStream_t stream) : stream_(stream) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "local (CUDA)"; }
  bool reads_device_memory() const override { return true; }
  std::unique_ptr<request_base> iall_reduce(const void* in, void* out, std::uint64_t n, wire_dtype t,
                                            comm::reduce_op) override {
    with_wire_type(t, [&]<class T>(T*) {
      comm::detail::check_same_or_disjoint(static_cast<const T*>(in), n, static_cast<const T*>(out), n, true,
                                           "all_reduce", "pass in == out or disjoint buffers");
    });
    return copy(in, out, n * wire_size(t));
  }
  std::unique_ptr<request_base> ireduce_scatter_v(const void* in, void* out, std::span<const std::uint64_t> counts,
                                                  wire_dtype t, comm::reduce_op) override {
    const std::uint64_t total = comm::detail::checked_total(counts, 1, "reduce_scatter_v");
    with_wire_type(t, [&]<class T>(T*) {
      comm::detail::check_same_or_disjoint(static_cast<const T*>(in), total, static_cast<const T*>(out), counts[0],
                                           true, "reduce_scatter_v",
                                           "out may only be in's own block or disjoint from in");
    });
    return copy(in, out, counts[0] * wire_size(t));
  }
  std::unique_ptr<request_base> iall_gather_v(const void* in, std::uint64_t n_in, void* out,
                                              std::span<const std::uint64_t> counts, wire_dtype t) override {
    const std::uint64_t total = comm::detail::checked_total(counts, 1, "all_gather_v");
    comm::detail::check_count_match(n_in, counts, 0, "all_gather_v");
    with_wire_type(t, [&]<class T>(T*) {
      comm::detail::check_same_or_disjoint(static_cast<const T*>(in), n_in, static_cast<const T*>(out), total, true,
                                           "all_gather_v", "in may only be out's own block or disjoint from out");
    });
    return copy(in, out, n_in * wire_size(t));
  }
  std::unique_ptr<request_base> ibroadcast(void*, std::uint64_t, wire_dtype, int root) override {
    comm::detail::check_root(root, 1, "broadcast");
    return wrap_request(comm::ready_request{});
  }
  void barrier() override {}
  // The copies run on stream_: work queued there before them is ordered already.
  bool wait_for_stream(void* stream) override { return static_cast<cudaStream_t>(stream) == stream_; }

 private:
  std::unique_ptr<request_base> copy(const void* in, void* out, std::uint64_t bytes) {
    if (bytes != 0 && in != out) {
      MPZERO_CUDA_CHECK(cudaMemcpyAsync(out, in, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToDevice, stream_));
    }
    return wrap_request(comm::ready_request{});
  }
  cudaStream_t stream_;
};

// The communicator a CUDA core uses: `c` when it takes device memory (NCCL, a c10d group
// on CUDA); at world size 1 otherwise (the default local one, or a host communicator of
// one rank) the device copy above; a host communicator of several ranks is refused.
inline any_communicator device_communicator(any_communicator c, int device, cudaStream_t stream) {
  if (c.base().reads_device_memory()) return c;
  if (c.size() == 1) return any_communicator(std::make_shared<cuda_local_communicator>(stream));
  throw config_error("mpzero::torch: the parameters are on CUDA device " + std::to_string(device) +
                     ", but the communicator '" + c.name() + "' (" + std::to_string(c.size()) +
                     " ranks) moves host memory. Pass mpzero::comm::nccl_communicator "
                     "(any_communicator::wrap(nccl, \"nccl\")) or a c10d ProcessGroup with the NCCL backend "
                     "(mpzero::torch::process_group_communicator), or keep the model on the CPU");
}

template <class Policy, class Opt, int N, class Offload>
struct cuda_row {
  static core_row make() {
    return core_row{spec_of<Policy, Opt, N, Offload>(core_device::cuda),
                    [](const core_place& place, any_communicator c, std::span<const std::uint64_t> numels,
                       const optimizer_config& o, const zero_options& zo) -> std::unique_ptr<zero_core> {
                      cuda_context ctx;
                      ctx.device = place.device;
                      ctx.stream = static_cast<cudaStream_t>(place.stream);
                      any_communicator dc = device_communicator(std::move(c), ctx.device, ctx.stream);
                      return std::make_unique<core_impl<Policy, Opt, N, Offload, cuda_context>>(
                          core_device::cuda, std::move(ctx), std::move(dc), numels, o, zo);
                    }};
  }
};

template <int Part>
void add_cuda_part(std::vector<core_row>& t) {
  add_table_part<Part, cuda_row>(t);
}

}  // namespace mpzero::torch::detail

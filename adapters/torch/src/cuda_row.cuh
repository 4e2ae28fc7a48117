// The CUDA table's rows: ZeroOptimizer<..., cuda_backend, ...> for CUDA parameters, on
// the device and stream the engine passes (torch's current stream of the parameters'
// device). Included only by the generated table units (torch.cmake, src/table_part.in),
// which nvcc compiles; the combinations are listed in core_impl.hpp (add_table_part).
// Torch-free: nvcc never sees LibTorch's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mpzero/backend/cuda_backend.cuh>
#include <mpzero/comm/cuda_local.cuh>

#include "core_impl.hpp"

#include <mpzero/backend/host.hpp>
// The host loops host_kernels.cpp compiles, where nvcc's host pass compiles the same
// variant as g++ there: off x86 both take the portable loops; on x86 only nvcc 13+ takes
// the run-time dispatch g++ takes (backend/host.hpp), older ones keep this unit's own.
#if defined(MPZERO_RUNTIME_SIMD) || !(defined(__x86_64__) || defined(__i386__))
#include "host_kernels.hpp"
#endif

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

// The communicator a CUDA core uses: `c` when it takes device memory (NCCL, a c10d group
// on CUDA); at world size 1 otherwise (the default local one, or a host communicator of
// one rank) comm::cuda_local_communicator, device-to-device copies on the core's stream
// (ordered before the core's later work there with no host wait); a host communicator
// of several ranks is refused.
inline any_communicator device_communicator(any_communicator c, const cuda_context& ctx) {
  if (c.base().reads_device_memory()) {
    require_communicator_device(c.base(), ctx.device);
    return c;
  }
  if (c.size() == 1) return any_communicator::own(comm::cuda_local_communicator(ctx.stream), "local (CUDA)");
  throw config_error("mpzero::torch: the parameters are on CUDA device " + std::to_string(ctx.device) +
                     ", but the communicator '" + c.name() + "' (" + std::to_string(c.size()) +
                     " ranks) moves host memory. Pass mpzero::comm::nccl_communicator "
                     "(any_communicator::wrap(nccl, \"nccl\")) or a c10d ProcessGroup with the NCCL backend "
                     "(mpzero::torch::process_group_communicator), or keep the model on the CPU");
}

// mpzero::torch::max_over_ranks over a communicator that reads device memory: the
// values go through a device buffer on place.device, ordered on place.stream.
inline void cuda_max_over_ranks(const core_place& place, any_communicator& c, std::span<std::int32_t> v) {
  cuda_context ctx;
  ctx.device = place.device;
  ctx.stream = static_cast<cudaStream_t>(place.stream);
  cuda_context::scope s(ctx);
  require_communicator_device(c.base(), ctx.device);
  cuda_backend(ctx.stream).all_reduce_host(c, v.data(), v.size(), comm::reduce_op::max);
}

template <class Policy, class Opt, int N, class Offload>
struct cuda_row {
  static core_row make(optimizer_type type) {
    return core_row{spec_of<Policy, N, Offload>(type, core_device::cuda),
                    [](const core_place& place, any_communicator c, std::span<const std::uint64_t> numels,
                       const optimizer_config& o, const zero_options& zo) -> std::unique_ptr<zero_core> {
                      cuda_context ctx;
                      ctx.device = place.device;
                      ctx.stream = static_cast<cudaStream_t>(place.stream);
                      any_communicator dc = device_communicator(std::move(c), ctx);
                      return std::make_unique<core_impl<Policy, Opt, N, Offload, cuda_context>>(
                          core_device::cuda, std::move(ctx), std::move(dc), numels, o, zo);
                    },
                    &cuda_max_over_ranks};
  }
};

template <int Part>
void add_cuda_part(std::vector<core_row>& t) {
  add_table_part<Part, cuda_row>(t);
}

}  // namespace mpzero::torch::detail

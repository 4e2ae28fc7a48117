// The CUDA side of the engine's cores: the device context (device scope, stream ordering),
// the CUDA backend and the CUDA step kernels of every named policy with Adam/AdamW, SGD
// and Lion. nvcc compiles this unit alone; it never sees LibTorch's headers.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>

#include <mpzero/backend/adapter.hpp>
#include <mpzero/backend/cuda_backend.cuh>
#include <mpzero/comm/cuda_local.cuh>

#include "cuda_cores.hpp"
#include "kernel_table.hpp"

namespace mpzero::torch::detail {

namespace {

// The core's device and stream; an event for ordering against other streams.
class cuda_context final : public core_context {
 public:
  cuda_context(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~cuda_context() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  int enter() const override {
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    if (previous == device_) return -1;
    const cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess) {
      throw cuda_error(e, "mpzero::torch: cudaSetDevice(" + std::to_string(device_) + ") failed: " +
                              cudaGetErrorString(e) + "; the engine's parameters are on a device this process cannot use");
    }
    return previous;
  }
  void leave(int previous) const noexcept override {
    if (previous >= 0) cudaSetDevice(previous);
  }
  void wait_stream(void* s) override { order(static_cast<cudaStream_t>(s), stream_); }
  void join_stream(void* s) override { order(stream_, static_cast<cudaStream_t>(s)); }

 private:
  // `waiter` waits for the work queued on `producer` so far.
  void order(cudaStream_t producer, cudaStream_t waiter) {
    if (producer == waiter) return;
    const int previous = enter();
    try {
      if (event_ == nullptr) MPZERO_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
      // Re-recording is safe: the wait captures this record.
      MPZERO_CUDA_CHECK(cudaEventRecord(event_, producer));
      MPZERO_CUDA_CHECK(cudaStreamWaitEvent(waiter, event_, 0));
    } catch (...) {
      leave(previous);
      throw;
    }
    leave(previous);
  }

  int device_;
  cudaStream_t stream_;
  cudaEvent_t event_ = nullptr;
};

// The communicator a CUDA core uses: `c` when it takes device memory (NCCL, a c10d group
// on CUDA); at world size 1 otherwise (the default local one, or a host communicator of
// one rank) comm::cuda_local_communicator, device-to-device copies on the core's stream
// (ordered before the core's later work there with no host wait); a host communicator
// of several ranks is refused.
any_communicator device_communicator(any_communicator c, int device, cudaStream_t stream) {
  if (c.base().reads_device_memory()) {
    require_communicator_device(c.base(), device);
    return c;
  }
  if (c.size() == 1) return any_communicator::own(comm::cuda_local_communicator(stream), "local (CUDA)");
  throw config_error("mpzero::torch: the parameters are on CUDA device " + std::to_string(device) +
                     ", but the communicator '" + c.name() + "' (" + std::to_string(c.size()) +
                     " ranks) moves host memory. Pass mpzero::comm::nccl_communicator "
                     "(any_communicator::wrap(nccl, \"nccl\")) or a c10d ProcessGroup with the NCCL backend "
                     "(mpzero::torch::process_group_communicator), or keep the model on the CPU");
}

}  // namespace

cuda_parts make_cuda_parts(const core_place& place, const precision_spec& p, const optimizer_config& c,
                           any_communicator comm) {
  const auto stream = static_cast<cudaStream_t>(place.stream);
  cuda_parts out;
  // The communicator first: a refusal needs no device.
  out.comm = device_communicator(std::move(comm), place.device, stream);
  out.context = std::make_unique<cuda_context>(place.device, stream);
  const int previous = out.context->enter();
  try {
    const cuda_backend b(stream);
    out.backend = std::make_unique<backend_adapter<cuda_backend>>(b);
    out.kernel = make_kernel<cuda_backend, false>(p, c, b);
  } catch (...) {
    out.context->leave(previous);
    throw;
  }
  out.context->leave(previous);
  return out;
}

void cuda_max_over_ranks(const core_place& place, any_communicator& c, std::span<std::int32_t> v) {
  const cuda_context ctx(place.device, static_cast<cudaStream_t>(place.stream));
  const int previous = ctx.enter();
  try {
    require_communicator_device(c.base(), place.device);
    cuda_backend(static_cast<cudaStream_t>(place.stream)).all_reduce_host(c, v.data(), v.size(), comm::reduce_op::max);
  } catch (...) {
    ctx.leave(previous);
    throw;
  }
  ctx.leave(previous);
}

}  // namespace mpzero::torch::detail

// The CUDA table of ZeroOptimizer instantiations behind mpzero::torch::zero_core: the
// cuda_backend rows, on the device and stream the engine passes (torch's current stream
// of the parameters' device). Torch-free: nvcc never sees LibTorch's headers.
//
// Compile time is the constraint (each policy is one fused CUDA kernel per optimizer,
// plus, with offload, a host step; Adam doubles the build's time): AdamW (what
// DeepSpeed's "Adam" and "AdamW" mean unless adam_w_mode is false) with the six policies
// DeepSpeed's bf16/fp16 sections select (the configurations examples/gpt compares),
// stages 0-2, CPU offload at 1-2. Not here (host table only): Adam with L2 decay, fp32
// gradient accumulation of a 16-bit model, fp16 master weights. Add rows here for more.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>

#include <mpzero/backend/cuda_backend.cuh>

#include "core_impl.hpp"

namespace mpzero::torch::detail {

namespace {

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

template <class Policy, class Opt, int N, class Offload>
struct cuda_row {
  static core_row make() {
    return core_row{spec_of<Policy, Opt, N, Offload>(core_device::cuda),
                    [](const core_place& place, any_communicator c, std::span<const std::uint64_t> numels,
                       const optimizer_config& o, const zero_options& zo) -> std::unique_ptr<zero_core> {
                      cuda_context ctx;
                      ctx.device = place.device;
                      ctx.stream = static_cast<cudaStream_t>(place.stream);
                      return std::make_unique<core_impl<Policy, Opt, N, Offload, cuda_context>>(
                          core_device::cuda, std::move(ctx), std::move(c), numels, o, zo);
                    }};
  }
};

}  // namespace

const std::vector<core_row>& cuda_table() {
  static const std::vector<core_row> t = [] {
    std::vector<core_row> v;
    add_policy<policies::fp32, cuda_row, false, true>(v);
    add_policy<policies::bf16_fp32_master, cuda_row, false, true>(v);
    add_policy<policies::bf16_master_fp32_states, cuda_row, false, true>(v);
    add_policy<policies::bf16_all, cuda_row, false, true>(v);
    add_policy<policies::bf16_all_sr, cuda_row, false, true>(v);
    add_policy<policies::fp16_fp32_master, cuda_row, false, true>(v);
    return v;
  }();
  return t;
}

}  // namespace mpzero::torch::detail

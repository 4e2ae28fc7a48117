// mpzero's CUDA step behind bench/peers.py's C interface (peers_step_api.hpp):
// libmpzero_peers_step_cuda.so. The same launch as mpzero_bench_cuda's BM_cuda_step
// (cuda::fused_step_launcher with the policy's cuda_step_tuning), over device memory
// that Python owns (CUDA tensors' data_ptr()), so that mpzero and its peers (torch's
// fused AdamW, DeepSpeed's and TransformerEngine's FusedAdam, torchao) step the very same
// tensors in one process, on one stream.
#include <cuda_runtime.h>

#include <mpzero/cuda/fused_step.cuh>

#include "peers_step_api.hpp"

namespace {

// The stream of the steppers created next: torch's current stream, set by the script (0,
// the legacy default stream, is torch's default). A stepper keeps the one it was made on.
cudaStream_t g_stream = nullptr;

void require_device_memory(const void* p, std::uint64_t tensor, const char* role) {
  if (p == nullptr) return;  // a master the policy does not have
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess || a.type != cudaMemoryTypeDevice) {
    (void)cudaGetLastError();  // clear the error cudaPointerGetAttributes may leave
    throw std::invalid_argument(std::string("tensor ") + std::to_string(tensor) + "'s " + role +
                                " is not CUDA device memory: give libmpzero_peers_step_cuda.so CUDA tensors "
                                "(bench/peers.py --device cuda), or use libmpzero_peers_step.so for CPU tensors");
  }
}

template <mpzero::precision_policy Policy>
class cuda_stepper final : public mpzero_peers::stepper {
  using tuning = mpzero::cuda_step_tuning<Policy::rounding::stochastic>;

 public:
  cuda_stepper(std::uint64_t n, void* const* params, void* const* masters, const void* const* grads,
               void* const* exp_avgs, void* const* exp_avg_sqs, const std::uint64_t* numels,
               const mpzero_peers_hparams& h)
      : step_(planned(mpzero_peers::make_tensors<Policy>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels))),
        launcher_(step_),
        hparams_(h),
        stream_(g_stream) {
    (void)mpzero_peers::prepare(h, 1);  // reject bad hyperparameters here, not at the first step
    for (std::uint64_t i = 0; i < n; ++i) {
      require_device_memory(params[i], i, "parameter");
      if constexpr (!Policy::master_is_param) require_device_memory(masters[i], i, "master");
      require_device_memory(grads[i], i, "gradient");
      require_device_memory(exp_avgs[i], i, "exp_avg");
      require_device_memory(exp_avg_sqs[i], i, "exp_avg_sq");
    }
    const std::size_t bytes = launcher_.workspace_bytes();
    if (bytes > 0) MPZERO_CUDA_CHECK(cudaMalloc(&workspace_, bytes));
    launcher_.upload(workspace_, bytes, stream_);
    MPZERO_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  cuda_stepper(const cuda_stepper&) = delete;
  cuda_stepper& operator=(const cuda_stepper&) = delete;
  ~cuda_stepper() override {
    // The tables may still be read by a step in flight.
    (void)cudaStreamSynchronize(stream_);
    if (workspace_ != nullptr) (void)cudaFree(workspace_);
  }

  // The library's plan, as its CUDA backend makes it (small steps get smaller chunks).
  static mpzero::fused_step<Policy, mpzero_peers::adamw> planned(
      std::vector<mpzero::step_tensor<Policy, mpzero_peers::adamw>> tensors) {
    const mpzero::plan_options plan = mpzero::plan_for<tuning>(tensors, mpzero::cuda::multiprocessors());
    return mpzero::fused_step<Policy, mpzero_peers::adamw>(std::move(tensors), plan);
  }

  // Asynchronous on the stream, as the peers' steps are: the script times it with CUDA
  // events on that stream.
  void run(std::uint64_t step, int /*threads*/) const override {
    launcher_.run(mpzero_peers::prepare(hparams_, step), stream_);
  }

 private:
  mpzero::fused_step<Policy, mpzero_peers::adamw> step_;
  mpzero::cuda::fused_step_launcher<Policy, mpzero_peers::adamw, tuning> launcher_;
  mpzero_peers_hparams hparams_;
  cudaStream_t stream_;
  void* workspace_ = nullptr;
};

}  // namespace

MPZERO_PEERS_LIBRARY(cuda_stepper, "cuda")

// The stream of every later create and one-shot step (a cudaStream_t; null: the legacy
// default stream); a handle runs on the stream it was created on.
MPZERO_PEERS_API void mpzero_peers_set_stream(void* stream) { g_stream = static_cast<cudaStream_t>(stream); }

// The GPU architectures the kernels were compiled for (nvcc's __CUDA_ARCH_LIST__, e.g.
// "900"), and the CUDA runtime's version: the results record both.
MPZERO_PEERS_API const char* mpzero_peers_cuda_archs() {
#if defined(__CUDA_ARCH_LIST__)
  return MPZERO_PEERS_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

MPZERO_PEERS_API int mpzero_peers_cuda_runtime() {
  int v = 0;
  return cudaRuntimeGetVersion(&v) == cudaSuccess ? v : 0;
}

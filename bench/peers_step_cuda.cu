// mpzero's CUDA step behind bench/peers.py's C interface (peers_step_api.hpp):
// libmpzero_peers_step_cuda.so. The CUDA backend's step (cuda_backend::stepper: the
// policy's cuda_step_tuning, planned for this GPU's SMs), over device memory
// that Python owns (CUDA tensors' data_ptr()), so that mpzero and its peers (torch's
// fused AdamW, DeepSpeed's and TransformerEngine's FusedAdam, torchao) step the very same
// tensors in one process, on one stream.
#include <cuda_runtime.h>

#include <mpzero/backend/cuda_backend.cuh>

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

// The CUDA backend's own stepper (its plan, launch shape and workspace), on the stream
// that was current when the handle was made.
template <mpzero::precision_policy Policy>
class cuda_stepper final : public mpzero_peers::stepper {
 public:
  cuda_stepper(std::uint64_t n, void* const* params, void* const* masters, const void* const* grads,
               void* const* exp_avgs, void* const* exp_avg_sqs, const std::uint64_t* numels,
               const mpzero_peers_hparams& h)
      : step_(checked(n, params, masters, grads, exp_avgs, exp_avg_sqs),
              mpzero_peers::make_tensors<Policy>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels)),
        hparams_(h) {
    (void)mpzero_peers::prepare(h, 1);  // reject bad hyperparameters here, not at the first step
  }

  // Asynchronous on the stream, as the peers' steps are: the script times it with CUDA
  // events on that stream.
  void run(std::uint64_t step, int /*threads*/) const override { step_.run(mpzero_peers::prepare(hparams_, step)); }

 private:
  // The backend to build the step with, once every pointer is known to be device memory.
  static mpzero::cuda_backend checked(std::uint64_t n, void* const* params, void* const* masters,
                                      const void* const* grads, void* const* exp_avgs, void* const* exp_avg_sqs) {
    for (std::uint64_t i = 0; i < n; ++i) {
      require_device_memory(params[i], i, "parameter");
      if constexpr (!Policy::master_is_param) require_device_memory(masters[i], i, "master");
      require_device_memory(grads[i], i, "gradient");
      require_device_memory(exp_avgs[i], i, "exp_avg");
      require_device_memory(exp_avg_sqs[i], i, "exp_avg_sq");
    }
    return mpzero::cuda_backend(g_stream);
  }

  mpzero::cuda_backend::stepper<Policy, mpzero_peers::adamw> step_;
  mpzero_peers_hparams hparams_;
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

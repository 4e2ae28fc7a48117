// mpzero's host step behind bench/peers.py's C interface (peers_step_api.hpp):
// libmpzero_peers_step.so. The same code as mpzero_bench_host's BM_step (host::run over
// a fused_step of optim::adamw, the torch-free core), run over host memory that Python
// owns, so that mpzero and its peers (DeepSpeedCPUAdam, torch.optim.AdamW, torchao) step
// the very same tensors in one process, on one OpenMP runtime.
#include "peers_step_api.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

template <mpzero::precision_policy Policy>
class host_stepper final : public mpzero_peers::stepper {
 public:
  host_stepper(std::uint64_t n, void* const* params, void* const* masters, const void* const* grads,
               void* const* exp_avgs, void* const* exp_avg_sqs, const std::uint64_t* numels,
               const mpzero_peers_hparams& h)
      : step_(mpzero_peers::make_tensors<Policy>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels)),
        hparams_(h) {
    (void)mpzero_peers::prepare(h, 1);  // reject bad hyperparameters here, not at the first step
  }

  void run(std::uint64_t step, int threads) const override {
    // Prepared every call, as each peer computes its bias corrections every step.
    mpzero::host::run(step_, mpzero_peers::prepare(hparams_, step), mpzero::host::options{threads});
  }

 private:
  mpzero::fused_step<Policy, mpzero_peers::adamw> step_;
  mpzero_peers_hparams hparams_;
};

}  // namespace

MPZERO_PEERS_LIBRARY(host_stepper, "cpu")

// What the results must record: the vector instructions the host step picked on this
// CPU ("avx512", "avx2" or "baseline"; MPZERO_HOST_SIMD caps it), the build flags and
// OpenMP's thread count in this process.
MPZERO_PEERS_API const char* mpzero_peers_simd() { return mpzero::host::simd_name(); }

MPZERO_PEERS_API const char* mpzero_peers_cxx_flags() {
#if defined(MPZERO_BENCH_CXX_FLAGS)
  return MPZERO_BENCH_CXX_FLAGS;
#else
  return "";
#endif
}

MPZERO_PEERS_API int mpzero_peers_march_native() {
#if defined(MPZERO_BENCH_NATIVE_ON)
  return 1;
#else
  return 0;
#endif
}

MPZERO_PEERS_API int mpzero_peers_max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// mpzero's host step behind a C interface, for bench/peers.py (loaded with ctypes): the
// same code as mpzero_bench_host's BM_step (host::run over a fused_step of optim::adamw,
// the torch-free core), run over memory that Python owns (torch tensors' data_ptr()),
// so that mpzero and its peers (DeepSpeedCPUAdam, torch.optim.AdamW) step the very same
// tensors in one process, on one OpenMP runtime.
//
// Two ways in, per precision configuration <cfg> (the policy names of
// mpzero::policies):
//   mpzero_peers_create_<cfg>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels, hp)
//       builds the fused_step of n tensors (its multi-tensor plan) once, as a training
//       loop does, and returns a handle; mpzero_peers_run(handle, step, threads) runs one
//       step; mpzero_peers_destroy(handle) frees it. The timed path.
//   mpzero_peers_step_<cfg>(param, master, grad, exp_avg, exp_avg_sq, numel, hp, step, threads)
//       one step of one tensor, building and dropping the plan in the call.
// `masters` (or `master`) is ignored, and may be null, for policies whose master is the
// parameter. Pointers are to the policy's storage types: float, bf16 or fp16 bits.
// Functions that can fail return null or a non-zero status; mpzero_peers_last_error()
// then says why (no C++ exception crosses the C interface).
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <mpzero/mpzero.hpp>

#define MPZERO_PEERS_API extern "C" __attribute__((visibility("default")))

// The hyperparameters of AdamW (decoupled weight decay, bias correction on) and the
// stochastic-rounding seed. Mirrored by a ctypes.Structure in bench/peers.py.
struct mpzero_peers_hparams {
  double lr, beta1, beta2, eps, weight_decay;
  std::uint64_t seed;
};

namespace {

using adamw = mpzero::optim::adamw;

thread_local std::string last_error;

mpzero::step_args<adamw> prepare(const mpzero_peers_hparams& h, std::uint64_t step) {
  adamw::options o{};
  o.lr = h.lr;
  o.beta1 = h.beta1;
  o.beta2 = h.beta2;
  o.eps = h.eps;
  o.weight_decay = h.weight_decay;
  return mpzero::make_step_args<adamw>(o, step, 1.0f, h.seed);
}

// One configuration's step over a fixed list of tensors, with its plan.
class stepper {
 public:
  virtual ~stepper() = default;
  virtual void run(std::uint64_t step, int threads) const = 0;
};

template <mpzero::precision_policy Policy>
class policy_stepper final : public stepper {
  using tensor = mpzero::step_tensor<Policy, adamw>;
  using P = typename Policy::param_type;
  using M = typename Policy::master_type;
  using G = typename Policy::grad_type;
  using S = typename Policy::state_type;

 public:
  policy_stepper(std::uint64_t n, void* const* params, void* const* masters, const void* const* grads,
                 void* const* exp_avgs, void* const* exp_avg_sqs, const std::uint64_t* numels,
                 const mpzero_peers_hparams& h)
      : step_(make_tensors(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels)), hparams_(h) {
    (void)prepare(h, 1);  // reject bad hyperparameters here, not at the first step
  }

  void run(std::uint64_t step, int threads) const override {
    // Prepared every call, as each peer computes its bias corrections every step.
    mpzero::host::run(step_, prepare(hparams_, step), mpzero::host::options{threads});
  }

 private:
  static std::vector<tensor> make_tensors(std::uint64_t n, void* const* params, void* const* masters,
                                          const void* const* grads, void* const* exp_avgs,
                                          void* const* exp_avg_sqs, const std::uint64_t* numels) {
    if (n > 0 && (params == nullptr || grads == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr ||
                  numels == nullptr || (!Policy::master_is_param && masters == nullptr))) {
      throw std::invalid_argument("a pointer array is null");
    }
    std::vector<tensor> ts(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      tensor& t = ts[i];
      t.param = static_cast<P*>(params[i]);
      if constexpr (!Policy::master_is_param) t.master = static_cast<M*>(masters[i]);
      t.grad = static_cast<const G*>(grads[i]);
      t.states[0] = static_cast<S*>(exp_avgs[i]);
      t.states[1] = static_cast<S*>(exp_avg_sqs[i]);
      t.numel = numels[i];
    }
    // Disjoint global indices: stochastic rounding keys its bits on them.
    mpzero::assign_global_offsets(std::span<tensor>(ts));
    return ts;
  }

  mpzero::fused_step<Policy, adamw> step_;
  mpzero_peers_hparams hparams_;
};

template <class F>
int guarded(F&& f) noexcept {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return 1;
}

template <mpzero::precision_policy Policy>
void* create(std::uint64_t n, void* const* params, void* const* masters, const void* const* grads,
             void* const* exp_avgs, void* const* exp_avg_sqs, const std::uint64_t* numels,
             const mpzero_peers_hparams* h) noexcept {
  stepper* out = nullptr;
  const int rc = guarded([&] {
    if (h == nullptr) throw std::invalid_argument("hyperparameters are null");
    out = new policy_stepper<Policy>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels, *h);
  });
  return rc == 0 ? out : nullptr;
}

template <mpzero::precision_policy Policy>
int step_one(void* param, void* master, const void* grad, void* exp_avg, void* exp_avg_sq, std::uint64_t numel,
             const mpzero_peers_hparams* h, std::uint64_t step, int threads) noexcept {
  return guarded([&] {
    if (h == nullptr) throw std::invalid_argument("hyperparameters are null");
    const policy_stepper<Policy> s(1, &param, &master, &grad, &exp_avg, &exp_avg_sq, &numel, *h);
    s.run(step, threads);
  });
}

}  // namespace

// One creator and one single-tensor step per configuration.
#define MPZERO_PEERS_CONFIG(name)                                                                                 \
  MPZERO_PEERS_API void* mpzero_peers_create_##name(                                                              \
      std::uint64_t n, void* const* params, void* const* masters, const void* const* grads, void* const* exp_avgs, \
      void* const* exp_avg_sqs, const std::uint64_t* numels, const mpzero_peers_hparams* h) {                      \
    return create<mpzero::policies::name>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels, h);           \
  }                                                                                                               \
  MPZERO_PEERS_API int mpzero_peers_step_##name(void* param, void* master, const void* grad, void* exp_avg,       \
                                                void* exp_avg_sq, std::uint64_t numel,                            \
                                                const mpzero_peers_hparams* h, std::uint64_t step, int threads) { \
    return step_one<mpzero::policies::name>(param, master, grad, exp_avg, exp_avg_sq, numel, h, step, threads);   \
  }

MPZERO_PEERS_CONFIG(fp32)
MPZERO_PEERS_CONFIG(bf16_fp32_master)
MPZERO_PEERS_CONFIG(bf16_master_fp32_states)
MPZERO_PEERS_CONFIG(bf16_all)
MPZERO_PEERS_CONFIG(bf16_all_sr)
MPZERO_PEERS_CONFIG(fp16_fp32_master)

// The configurations above, comma-separated, so the script can check it has them all.
MPZERO_PEERS_API const char* mpzero_peers_configs() {
  return "fp32,bf16_fp32_master,bf16_master_fp32_states,bf16_all,bf16_all_sr,fp16_fp32_master";
}

// Runs one step (step >= 1 sets the bias corrections) on `threads` OpenMP threads (0:
// OpenMP's default). Returns 0, or 1 with mpzero_peers_last_error() set.
MPZERO_PEERS_API int mpzero_peers_run(const void* handle, std::uint64_t step, int threads) {
  return guarded([&] {
    if (handle == nullptr) throw std::invalid_argument("null handle");
    static_cast<const stepper*>(handle)->run(step, threads);
  });
}

MPZERO_PEERS_API void mpzero_peers_destroy(void* handle) { delete static_cast<stepper*>(handle); }

MPZERO_PEERS_API const char* mpzero_peers_last_error() { return last_error.c_str(); }

// What the results must record: the vector instructions the host step picked on this
// CPU ("avx512", "avx2" or "baseline"; MPZERO_HOST_SIMD caps it), the build flags,
// OpenMP's thread count in this process, and the library's version.
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

#define MPZERO_PEERS_STR2(x) #x
#define MPZERO_PEERS_STR(x) MPZERO_PEERS_STR2(x)
MPZERO_PEERS_API const char* mpzero_peers_version() {
  return MPZERO_PEERS_STR(MPZERO_VERSION_MAJOR) "." MPZERO_PEERS_STR(MPZERO_VERSION_MINOR) "." MPZERO_PEERS_STR(
      MPZERO_VERSION_PATCH);
}

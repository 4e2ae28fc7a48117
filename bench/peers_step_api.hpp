// The C interface of bench/peers.py's step libraries (loaded with ctypes), shared by the
// host one (peers_step.cpp: libmpzero_peers_step.so) and the CUDA one (peers_step_cuda.cu:
// libmpzero_peers_step_cuda.so). Each runs mpzero's fused step over memory that Python
// owns (torch tensors' data_ptr(): host memory, or device memory for the CUDA library), so
// that mpzero and its peers step the very same tensors in one process.
//
// Per precision configuration <cfg> (the policy names of mpzero::policies):
//   mpzero_peers_create_<cfg>(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels, hp)
//       builds the fused_step of n tensors (its multi-tensor plan) once, as a training
//       loop does, and returns a handle; mpzero_peers_run(handle, step, threads) runs one
//       step; mpzero_peers_destroy(handle) frees it. The timed path.
//   mpzero_peers_step_<cfg>(param, master, grad, exp_avg, exp_avg_sq, numel, hp, step, threads)
//       one step of one tensor, building and dropping the plan in the call.
// `masters` (or `master`) is ignored, and may be null, for policies whose master is the
// parameter. Pointers are to the policy's storage types: float, bf16 or fp16 bits.
// `threads` is the host step's OpenMP thread count (0: OpenMP's default); the CUDA
// library launches on the stream mpzero_peers_set_stream named when the handle was made,
// and ignores it.
// Functions that can fail return null or a non-zero status; mpzero_peers_last_error()
// then says why (no C++ exception crosses the C interface).
#pragma once

#include <cstdint>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <mpzero/mpzero.hpp>

#define MPZERO_PEERS_API extern "C" __attribute__((visibility("default")))

// The hyperparameters of AdamW (decoupled weight decay, bias correction on) and the
// stochastic-rounding seed. Mirrored by a ctypes.Structure in bench/peers.py.
struct mpzero_peers_hparams {
  double lr, beta1, beta2, eps, weight_decay;
  std::uint64_t seed;
};

namespace mpzero_peers {

using adamw = mpzero::optim::adamw;

inline std::string& last_error() {
  static thread_local std::string e;
  return e;
}

inline mpzero::step_args<adamw> prepare(const mpzero_peers_hparams& h, std::uint64_t step) {
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

// The step tensors of n tensors given as pointer arrays, with disjoint global indices
// (stochastic rounding keys its bits on them).
template <mpzero::precision_policy Policy>
std::vector<mpzero::step_tensor<Policy, adamw>> make_tensors(std::uint64_t n, void* const* params,
                                                             void* const* masters, const void* const* grads,
                                                             void* const* exp_avgs, void* const* exp_avg_sqs,
                                                             const std::uint64_t* numels) {
  using P = typename Policy::param_type;
  using M = typename Policy::master_type;
  using G = typename Policy::grad_type;
  using S = typename Policy::state_type;
  if (n > 0 && (params == nullptr || grads == nullptr || exp_avgs == nullptr || exp_avg_sqs == nullptr ||
                numels == nullptr || (!Policy::master_is_param && masters == nullptr))) {
    throw std::invalid_argument("a pointer array is null");
  }
  std::vector<mpzero::step_tensor<Policy, adamw>> ts(n);
  for (std::uint64_t i = 0; i < n; ++i) {
    auto& t = ts[i];
    t.param = static_cast<P*>(params[i]);
    if constexpr (!Policy::master_is_param) t.master = static_cast<M*>(masters[i]);
    t.grad = static_cast<const G*>(grads[i]);
    t.states[0] = static_cast<S*>(exp_avgs[i]);
    t.states[1] = static_cast<S*>(exp_avg_sqs[i]);
    t.numel = numels[i];
  }
  mpzero::assign_global_offsets(std::span<mpzero::step_tensor<Policy, adamw>>(ts));
  return ts;
}

template <class F>
int guarded(F&& f) noexcept {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error() = e.what();
  } catch (...) {
    last_error() = "unknown C++ exception";
  }
  return 1;
}

// Stepper<Policy> is constructed from (n, params, masters, grads, exp_avgs, exp_avg_sqs,
// numels, hparams).
template <class Stepper>
void* create(std::uint64_t n, void* const* params, void* const* masters, const void* const* grads,
             void* const* exp_avgs, void* const* exp_avg_sqs, const std::uint64_t* numels,
             const mpzero_peers_hparams* h) noexcept {
  stepper* out = nullptr;
  const int rc = guarded([&] {
    if (h == nullptr) throw std::invalid_argument("hyperparameters are null");
    out = new Stepper(n, params, masters, grads, exp_avgs, exp_avg_sqs, numels, *h);
  });
  return rc == 0 ? out : nullptr;
}

template <class Stepper>
int step_one(void* param, void* master, const void* grad, void* exp_avg, void* exp_avg_sq, std::uint64_t numel,
             const mpzero_peers_hparams* h, std::uint64_t step, int threads) noexcept {
  return guarded([&] {
    if (h == nullptr) throw std::invalid_argument("hyperparameters are null");
    const Stepper s(1, &param, &master, &grad, &exp_avg, &exp_avg_sq, &numel, *h);
    s.run(step, threads);
  });
}

}  // namespace mpzero_peers

// One creator and one single-tensor step per configuration, stepped by STEPPER<policy>.
#define MPZERO_PEERS_CONFIG(STEPPER, name)                                                                        \
  MPZERO_PEERS_API void* mpzero_peers_create_##name(                                                              \
      std::uint64_t n, void* const* params, void* const* masters, const void* const* grads, void* const* exp_avgs, \
      void* const* exp_avg_sqs, const std::uint64_t* numels, const mpzero_peers_hparams* h) {                      \
    return mpzero_peers::create<STEPPER<mpzero::policies::name>>(n, params, masters, grads, exp_avgs, exp_avg_sqs, \
                                                                 numels, h);                                      \
  }                                                                                                               \
  MPZERO_PEERS_API int mpzero_peers_step_##name(void* param, void* master, const void* grad, void* exp_avg,       \
                                                void* exp_avg_sq, std::uint64_t numel,                            \
                                                const mpzero_peers_hparams* h, std::uint64_t step, int threads) { \
    return mpzero_peers::step_one<STEPPER<mpzero::policies::name>>(param, master, grad, exp_avg, exp_avg_sq,      \
                                                                   numel, h, step, threads);                      \
  }

#define MPZERO_PEERS_STR2(x) #x
#define MPZERO_PEERS_STR(x) MPZERO_PEERS_STR2(x)

// Every configuration, and the functions both libraries share. DEVICE names where the
// pointers live ("cpu" or "cuda"), so that the script can check it loaded the right one.
#define MPZERO_PEERS_LIBRARY(STEPPER, DEVICE)                                                                     \
  MPZERO_PEERS_CONFIG(STEPPER, fp32)                                                                              \
  MPZERO_PEERS_CONFIG(STEPPER, bf16_fp32_master)                                                                  \
  MPZERO_PEERS_CONFIG(STEPPER, bf16_master_fp32_states)                                                           \
  MPZERO_PEERS_CONFIG(STEPPER, bf16_all)                                                                          \
  MPZERO_PEERS_CONFIG(STEPPER, bf16_all_sr)                                                                       \
  MPZERO_PEERS_CONFIG(STEPPER, fp16_fp32_master)                                                                  \
  /* The configurations above, comma-separated, so the script can check it has them all. */                      \
  MPZERO_PEERS_API const char* mpzero_peers_configs() {                                                           \
    return "fp32,bf16_fp32_master,bf16_master_fp32_states,bf16_all,bf16_all_sr,fp16_fp32_master";                \
  }                                                                                                               \
  MPZERO_PEERS_API const char* mpzero_peers_device() { return DEVICE; }                                           \
  /* Runs one step (step >= 1 sets the bias corrections). Returns 0, or 1 with                                 \
     mpzero_peers_last_error() set. */                                                                            \
  MPZERO_PEERS_API int mpzero_peers_run(const void* handle, std::uint64_t step, int threads) {                    \
    return mpzero_peers::guarded([&] {                                                                            \
      if (handle == nullptr) throw std::invalid_argument("null handle");                                         \
      static_cast<const mpzero_peers::stepper*>(handle)->run(step, threads);                                      \
    });                                                                                                           \
  }                                                                                                               \
  MPZERO_PEERS_API void mpzero_peers_destroy(void* handle) { delete static_cast<mpzero_peers::stepper*>(handle); } \
  MPZERO_PEERS_API const char* mpzero_peers_last_error() { return mpzero_peers::last_error().c_str(); }           \
  MPZERO_PEERS_API const char* mpzero_peers_version() {                                                           \
    return MPZERO_PEERS_STR(MPZERO_VERSION_MAJOR) "." MPZERO_PEERS_STR(MPZERO_VERSION_MINOR) "." MPZERO_PEERS_STR( \
        MPZERO_VERSION_PATCH);                                                                                    \
  }

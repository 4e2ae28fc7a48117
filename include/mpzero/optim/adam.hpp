// mpzero: Adam (L2 weight decay) and AdamW (decoupled weight decay), with PyTorch's
// update order and bias correction, as a per-element rule shared by host and device.
// `adam` and `adamw` fix the kind of decay at compile time; `adam_runtime` takes it from
// its options (one instantiation for both, which the LibTorch adapter's tables use), and
// the host step chooses the loop once per chunk through its modes (optimizer.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "../config.hpp"
#include "../numeric/fp_ops.hpp"
#include "validate.hpp"

namespace mpzero::optim {

struct adam_options {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
};

// Per-step scalars, computed once on the host in double and rounded to float.
struct adam_params {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float eps, weight_decay, decay_factor;  // decay_factor = 1 - lr * wd (AdamW)
  float step_size;                        // lr / (1 - beta1^t)
  float inv_sqrt_bias2;                   // 1 / sqrt(1 - beta2^t)
};

namespace detail {

inline adam_params adam_prepare(const char* name, const adam_options& o, std::uint64_t step) {
  require_range(name, "lr", o.lr, 0.0, 1e6, true);
  require_range(name, "beta1", o.beta1, 0.0, 1.0, false);
  require_range(name, "beta2", o.beta2, 0.0, 1.0, false);
  require_range(name, "eps", o.eps, 1e-30, 1.0, true);
  require_range(name, "weight_decay", o.weight_decay, 0.0, 1e6, true);
  require_step(name, step);
  const double t = static_cast<double>(step);
  const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, t) : 1.0;
  const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, t) : 1.0;
  return adam_params{static_cast<float>(o.beta1),
                     static_cast<float>(1.0 - o.beta1),
                     static_cast<float>(o.beta2),
                     static_cast<float>(1.0 - o.beta2),
                     static_cast<float>(o.eps),
                     static_cast<float>(o.weight_decay),
                     static_cast<float>(1.0 - o.lr * o.weight_decay),
                     static_cast<float>(o.lr / bc1),
                     static_cast<float>(1.0 / std::sqrt(bc2))};
}

template <bool Decoupled>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void adam_update(const adam_params& p, float& w, float g, float (&s)[2]) noexcept {
  if constexpr (Decoupled) {
    w = fp::mul(w, p.decay_factor);
  } else {
    g = fp::add(g, fp::mul(p.weight_decay, w));
  }
  float m = fp::add(fp::mul(p.beta1, s[0]), fp::mul(p.one_minus_beta1, g));
  float v = fp::add(fp::mul(p.beta2, s[1]), fp::mul(fp::mul(p.one_minus_beta2, g), g));
  const float denom = fp::add(fp::mul(fp::sqrt(v), p.inv_sqrt_bias2), p.eps);
  w = fp::sub(w, fp::mul(p.step_size, fp::div(m, denom)));
  s[0] = m;
  s[1] = v;
}

}  // namespace detail

template <bool Decoupled>
struct adam_rule {
  using options = adam_options;
  using params = adam_params;
  static constexpr int n_states = 2;  // first and second moment
  static constexpr std::string_view name = Decoupled ? "AdamW" : "Adam";

  static params prepare(const options& o, std::uint64_t step) {
    return detail::adam_prepare(Decoupled ? "AdamW" : "Adam", o, step);
  }

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE static void update(const params& p, float& w, float g, float (&s)[2]) noexcept {
    detail::adam_update<Decoupled>(p, w, g, s);
  }
};

using adam = adam_rule<false>;
using adamw = adam_rule<true>;

// Adam or AdamW, chosen by the options at run time: bit for bit `adam`'s or `adamw`'s
// update. Checkpoints and errors name the one the options choose (name_of).
struct adam_runtime_options : adam_options {
  bool decoupled_weight_decay = true;  // true: AdamW; false: Adam (L2 decay added to the gradient)
};

struct adam_runtime {
  using options = adam_runtime_options;
  struct params : adam_params {
    bool decoupled = true;
  };
  static constexpr int n_states = 2;
  static constexpr std::string_view name = "Adam/AdamW";  // the rule; name_of gives the options' choice
  static constexpr std::string_view name_of(const options& o) noexcept {
    return o.decoupled_weight_decay ? adamw::name : adam::name;
  }

  static params prepare(const options& o, std::uint64_t step) {
    return params{detail::adam_prepare(name_of(o).data(), o, step), o.decoupled_weight_decay};
  }

  // Modes (optim::moded_rule): 0 is Adam, 1 is AdamW. Loops that run many elements with
  // one params choose the mode once, outside the loop (optim::visit_mode: the host step
  // per chunk, the CUDA step per launch), and call update_mode<M>, so that each mode's
  // loop is the loop of a rule without modes: a choice per element keeps GCC from
  // vectorizing the loops that convert 16-bit states, and slows the CUDA kernel under
  // stochastic rounding (docs/perf.md, "Adam and AdamW in one instantiation").
  static constexpr int n_modes = 2;
  MPZERO_HOST_DEVICE static constexpr int mode(const params& p) noexcept { return p.decoupled ? 1 : 0; }
  template <int Mode>
  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE static void update_mode(const params& p, float& w, float g,
                                                                float (&s)[2]) noexcept {
    static_assert(Mode == 0 || Mode == 1, "adam_runtime has modes 0 (Adam) and 1 (AdamW)");
    detail::adam_update<Mode == 1>(p, w, g, s);
  }
  // The mode chosen per call (the scalar reference, and code that updates one element).
  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE static void update(const params& p, float& w, float g, float (&s)[2]) noexcept {
    if (mode(p) == 1) {
      update_mode<1>(p, w, g, s);
    } else {
      update_mode<0>(p, w, g, s);
    }
  }
};

}  // namespace mpzero::optim

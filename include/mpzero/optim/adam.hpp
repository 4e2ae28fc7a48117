// mpzero: Adam (L2 weight decay) and AdamW (decoupled weight decay), with PyTorch's
// update order and bias correction, as a per-element rule shared by host and device.
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

template <bool Decoupled>
struct adam_rule {
  using options = adam_options;
  static constexpr int n_states = 2;  // first and second moment
  static constexpr std::string_view name = Decoupled ? "AdamW" : "Adam";

  // Per-step scalars, computed once on the host in double and rounded to float.
  struct params {
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float eps, weight_decay, decay_factor;  // decay_factor = 1 - lr * wd (AdamW)
    float step_size;                        // lr / (1 - beta1^t)
    float inv_sqrt_bias2;                   // 1 / sqrt(1 - beta2^t)
  };

  static params prepare(const options& o, std::uint64_t step) {
    const char* n = Decoupled ? "AdamW" : "Adam";
    detail::require_range(n, "lr", o.lr, 0.0, 1e6, true);
    detail::require_range(n, "beta1", o.beta1, 0.0, 1.0, false);
    detail::require_range(n, "beta2", o.beta2, 0.0, 1.0, false);
    detail::require_range(n, "eps", o.eps, 1e-30, 1.0, true);
    detail::require_range(n, "weight_decay", o.weight_decay, 0.0, 1e6, true);
    detail::require_step(n, step);
    const double t = static_cast<double>(step);
    const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, t) : 1.0;
    const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, t) : 1.0;
    return params{static_cast<float>(o.beta1),
                  static_cast<float>(1.0 - o.beta1),
                  static_cast<float>(o.beta2),
                  static_cast<float>(1.0 - o.beta2),
                  static_cast<float>(o.eps),
                  static_cast<float>(o.weight_decay),
                  static_cast<float>(1.0 - o.lr * o.weight_decay),
                  static_cast<float>(o.lr / bc1),
                  static_cast<float>(1.0 / std::sqrt(bc2))};
  }

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE static void update(const params& p, float& w, float g, float (&s)[2]) noexcept {
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
};

using adam = adam_rule<false>;
using adamw = adam_rule<true>;

}  // namespace mpzero::optim

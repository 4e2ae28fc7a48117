// mpzero: Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023):
// sign of an interpolated momentum, decoupled weight decay.
#pragma once

#include <cstdint>
#include <string_view>

#include "../config.hpp"
#include "../numeric/fp_ops.hpp"
#include "validate.hpp"

namespace mpzero::optim {

struct lion_options {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;
};

struct lion {
  using options = lion_options;
  static constexpr int n_states = 1;  // momentum
  static constexpr std::string_view name = "Lion";

  struct params {
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay_factor;
  };

  static params prepare(const options& o, std::uint64_t step) {
    detail::require_range("Lion", "lr", o.lr, 0.0, 1e6, true);
    detail::require_range("Lion", "beta1", o.beta1, 0.0, 1.0, true);
    detail::require_range("Lion", "beta2", o.beta2, 0.0, 1.0, true);
    detail::require_range("Lion", "weight_decay", o.weight_decay, 0.0, 1e6, true);
    detail::require_step("Lion", step);
    return params{static_cast<float>(o.lr),          static_cast<float>(o.beta1),
                  static_cast<float>(1.0 - o.beta1), static_cast<float>(o.beta2),
                  static_cast<float>(1.0 - o.beta2), static_cast<float>(1.0 - o.lr * o.weight_decay)};
  }

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE static void update(const params& p, float& w, float g, float (&s)[1]) noexcept {
    const float c = fp::add(fp::mul(p.beta1, s[0]), fp::mul(p.one_minus_beta1, g));
    const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    w = fp::sub(fp::mul(w, p.decay_factor), fp::mul(p.lr, sign));
    s[0] = fp::add(fp::mul(p.beta2, s[0]), fp::mul(p.one_minus_beta2, g));
  }
};

}  // namespace mpzero::optim

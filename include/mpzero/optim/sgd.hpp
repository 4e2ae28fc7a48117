// mpzero: SGD with momentum (PyTorch semantics: L2 weight decay, dampening,
// optional Nesterov; the momentum buffer starts as the first gradient).
#pragma once

#include <cstdint>
#include <string_view>

#include "../config.hpp"
#include "../numeric/fp_ops.hpp"
#include "validate.hpp"

namespace mpzero::optim {

struct sgd_options {
  double lr = 1e-2;
  double momentum = 0.9;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

struct sgd {
  using options = sgd_options;
  static constexpr int n_states = 1;  // momentum buffer
  static constexpr std::string_view name = "SGD";

  struct params {
    float lr, momentum, one_minus_dampening, weight_decay;
    bool nesterov, first_step;
  };

  static params prepare(const options& o, std::uint64_t step) {
    detail::require_range("SGD", "lr", o.lr, 0.0, 1e6, true);
    detail::require_range("SGD", "momentum", o.momentum, 0.0, 1.0, true);
    detail::require_range("SGD", "dampening", o.dampening, 0.0, 1.0, true);
    detail::require_range("SGD", "weight_decay", o.weight_decay, 0.0, 1e6, true);
    detail::require_step("SGD", step);
    if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0)) {
      mpzero::detail::throw_invalid("SGD: nesterov = true needs momentum > 0 and dampening = 0 (got momentum = " +
                                    mpzero::detail::format_double(o.momentum) + ", dampening = " +
                                    mpzero::detail::format_double(o.dampening) + ")");
    }
    return params{static_cast<float>(o.lr), static_cast<float>(o.momentum), static_cast<float>(1.0 - o.dampening),
                  // Without momentum PyTorch uses the gradient itself (dampening ignored):
                  // the "first step" rule, buf = g, on every step.
                  static_cast<float>(o.weight_decay), o.nesterov, step == 1 || o.momentum == 0.0};
  }

  MPZERO_HOST_DEVICE MPZERO_FORCEINLINE static void update(const params& p, float& w, float g, float (&s)[1]) noexcept {
    g = fp::add(g, fp::mul(p.weight_decay, w));
    const float buf = p.first_step ? g : fp::add(fp::mul(p.momentum, s[0]), fp::mul(p.one_minus_dampening, g));
    const float d = p.nesterov ? fp::add(g, fp::mul(p.momentum, buf)) : buf;
    w = fp::sub(w, fp::mul(p.lr, d));
    s[0] = buf;
  }
};

}  // namespace mpzero::optim

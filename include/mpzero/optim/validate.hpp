// mpzero: checks of optimizer hyperparameters, shared by every optimizer.
#pragma once

#include <cmath>
#include <string>

#include "../error.hpp"

namespace mpzero::optim::detail {

inline void require_range(const char* optimizer, const char* name, double value, double lo, double hi,
                          bool hi_inclusive) {
  const bool ok = std::isfinite(value) && value >= lo && (hi_inclusive ? value <= hi : value < hi);
  if (!ok) {
    mpzero::detail::throw_invalid(std::string(optimizer) + ": " + name + " = " + mpzero::detail::format_double(value) +
                                  " is out of range; it must lie in [" + mpzero::detail::format_double(lo) + ", " +
                                  mpzero::detail::format_double(hi) + (hi_inclusive ? "]" : ")"));
  }
}

inline void require_step(const char* optimizer, unsigned long long step) {
  if (step == 0) {
    mpzero::detail::throw_invalid(std::string(optimizer) +
                                  ": step must count from 1 (the first optimizer step is step 1)");
  }
}

}  // namespace mpzero::optim::detail

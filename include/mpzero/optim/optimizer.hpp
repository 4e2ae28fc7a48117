// mpzero: what the fused step needs of an optimizer type.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "adam.hpp"
#include "lion.hpp"
#include "sgd.hpp"

namespace mpzero::optim {

// An optimizer is a per-element rule: prepare() turns user options and the 1-based
// step into per-step scalars on the host; update() applies them to one element.
template <class O>
concept rule = requires(const typename O::options& opts, const typename O::params& p, float& w, float g,
                        float (&s)[O::n_states]) {
  { O::prepare(opts, std::uint64_t{1}) } -> std::same_as<typename O::params>;
  { O::update(p, w, g, s) };
  requires O::n_states >= 1 && O::n_states <= 3;
};

// A rule whose update is one of a few variants chosen by its params at run time
// (adam_runtime: Adam or AdamW). mode(p) says which, in [0, n_modes), and
// update_mode<M>() is that variant with the choice made at compile time. Loops over many
// elements with one params pick the mode once outside the loop (update_in_mode), so that
// each variant's loop is compiled, and vectorized, on its own; update() chooses per call.
template <class O>
concept moded_rule = rule<O> && requires(const typename O::params& p, float& w, float g, float (&s)[O::n_states]) {
  { O::mode(p) } -> std::convertible_to<int>;
  { O::template update_mode<0>(p, w, g, s) };
  requires O::n_modes >= 2;
};

// The number of modes of a rule: 1 for a rule without them.
template <rule O>
MPZERO_HOST_DEVICE constexpr int n_modes() {
  if constexpr (moded_rule<O>) {
    return O::n_modes;
  } else {
    return 1;
  }
}

// The rule's update in mode Mode, chosen at compile time; Mode -1 is update() itself.
template <rule O, int Mode>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE void update_in_mode(const typename O::params& p, float& w, float g,
                                                          float (&s)[O::n_states]) noexcept {
  if constexpr (Mode < 0 || !moded_rule<O>) {
    O::update(p, w, g, s);
  } else {
    static_assert(Mode < n_modes<O>(), "update_in_mode: the rule has no such mode");
    O::template update_mode<Mode>(p, w, g, s);
  }
}

// The mode of p: 0 for a rule without modes.
template <rule O>
MPZERO_HOST_DEVICE constexpr int mode_of(const typename O::params& p) noexcept {
  if constexpr (moded_rule<O>) {
    return static_cast<int>(O::mode(p));
  } else {
    (void)p;
    return 0;
  }
}

// Calls f(std::integral_constant<int, M>{}) for M = mode_of<O>(p), and returns what it
// returns: the mode read once, at run time, for code compiled once per mode (the host
// step's loop over a chunk, the CUDA step's kernel), so that each mode's code is what a
// rule without modes gets. For a rule without modes, f's M is 0.
template <rule O, int M = 0, class F>
MPZERO_FORCEINLINE decltype(auto) visit_mode(const typename O::params& p, F&& f) {
  if constexpr (M + 1 < n_modes<O>()) {
    if (mode_of<O>(p) != M) return visit_mode<O, M + 1>(p, std::forward<F>(f));
  }
  return std::forward<F>(f)(std::integral_constant<int, M>{});
}

// The optimizer's name under these options, as checkpoints and errors give it: the
// rule's name, or, for a rule that is several optimizers (adam_runtime), the one the
// options choose.
template <rule O>
constexpr std::string_view name_of(const typename O::options& o) noexcept {
  if constexpr (requires { { O::name_of(o) } -> std::convertible_to<std::string_view>; }) {
    return O::name_of(o);
  } else {
    (void)o;
    return O::name;
  }
}

static_assert(rule<adam> && rule<adamw> && rule<sgd> && rule<lion> && rule<adam_runtime>);
static_assert(moded_rule<adam_runtime> && !moded_rule<adamw> && n_modes<adam_runtime>() == 2);

}  // namespace mpzero::optim

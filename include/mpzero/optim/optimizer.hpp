// mpzero: what the fused step needs of an optimizer type.
#pragma once

#include <concepts>
#include <cstdint>

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

static_assert(rule<adam> && rule<adamw> && rule<sgd> && rule<lion>);

}  // namespace mpzero::optim

// The fused step's definition, as tests hold backends against it: each element updated
// on its own by update_element(), its stochastic-rounding bits drawn from its own global
// index. No chunks, no vectors, no per-pair draws.
#pragma once

#include <cstdint>
#include <span>

#include <mpzero/step/fused_step.hpp>

namespace test_support {

template <mpzero::precision_policy P, mpzero::optim::rule O>
void reference_step(std::span<const mpzero::step_tensor<P, O>> tensors, const mpzero::step_args<O>& a) {
  constexpr int n = O::n_states;
  for (const auto& t : tensors) {
    for (std::uint64_t i = 0; i < t.numel; ++i) {
      typename P::state_type s[n];
      for (int k = 0; k < n; ++k) s[k] = t.states[k][i];
      typename P::param_type p{};
      if constexpr (P::master_is_param) {
        mpzero::update_element<P, O>(a, t.global_offset + i, t.param[i], t.grad[i], s, p);
      } else {
        mpzero::update_element<P, O>(a, t.global_offset + i, t.master[i], t.grad[i], s, p);
        t.param[i] = p;
      }
      for (int k = 0; k < n; ++k) t.states[k][i] = s[k];
    }
  }
}

}  // namespace test_support

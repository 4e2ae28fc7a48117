// make_kernel: the dispatch from (precision, optimizer) values to a typed_step_kernel,
// expanded from the one list of policies. Included by the units that compile the kernels
// of one backend (host_kernels.cpp, cuda_cores.cu). Private to the adapter; torch-free.
#pragma once

#include <memory>

#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/policy_list.hpp>
#include <mpzero/zero/typed_step_kernel.hpp>

#include "step_kernels.hpp"

namespace mpzero::torch::detail {

template <class Backend, bool HostSteps, class Rule>
std::unique_ptr<step_kernel> make_rule_kernel(const precision_spec& p, const optimizer_config& c, const Backend& b) {
#define MPZERO_TORCH_KERNEL(P)                                                                                  \
  if (p == precision_spec_of<policies::P>())                                                                    \
    return std::make_unique<typed_step_kernel<policies::P, Rule, Backend, HostSteps>>(b, options_of<Rule>(c));
  MPZERO_POLICIES(MPZERO_TORCH_KERNEL)
#undef MPZERO_TORCH_KERNEL
  return nullptr;
}

template <class Backend, bool HostSteps>
std::unique_ptr<step_kernel> make_kernel(const precision_spec& p, const optimizer_config& c, const Backend& b) {
  switch (c.type) {
    case optimizer_type::adam:
    case optimizer_type::adamw: return make_rule_kernel<Backend, HostSteps, optim::adam_runtime>(p, c, b);
    case optimizer_type::sgd: return make_rule_kernel<Backend, HostSteps, optim::sgd>(p, c, b);
    case optimizer_type::lion: return make_rule_kernel<Backend, HostSteps, optim::lion>(p, c, b);
  }
  return nullptr;
}

}  // namespace mpzero::torch::detail

// The engine's step kernels: for a precision and the config's optimizer, the
// typed_step_kernel of the named policy with that precision (policy/policy_list.hpp) and
// the rule that runs the optimizer (Adam and AdamW share optim::adam_runtime, which takes
// the kind of decay from its options). Private to the adapter; torch-free.
//
// make_kernel<Backend, HostSteps> is expanded in one unit per backend: host_kernels.cpp
// (g++) and cuda_cores.cu (nvcc, without host steps: a CUDA core's offloaded step runs
// the host kernel, compiled once by g++).
#pragma once

#include <memory>

#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/policy_list.hpp>
#include <mpzero/torch/config.hpp>
#include <mpzero/zero/step_kernel.hpp>

namespace mpzero::torch::detail {

// The rule's options from the config's optimizer section.
template <class Opt>
typename Opt::options options_of(const optimizer_config& c) {
  typename Opt::options o;
  if constexpr (std::is_same_v<Opt, optim::adam_runtime>) {
    o.lr = c.lr, o.beta1 = c.beta1, o.beta2 = c.beta2, o.eps = c.eps, o.weight_decay = c.weight_decay;
    o.bias_correction = c.bias_correction;
    o.decoupled_weight_decay = c.type == optimizer_type::adamw;
  } else if constexpr (std::is_same_v<Opt, optim::sgd>) {
    o.lr = c.lr, o.momentum = c.momentum, o.dampening = c.dampening, o.weight_decay = c.weight_decay;
    o.nesterov = c.nesterov;
  } else {
    static_assert(std::is_same_v<Opt, optim::lion>, "options_of: the engine's rules are adam_runtime, sgd and lion");
    o.lr = c.lr, o.beta1 = c.beta1, o.beta2 = c.beta2, o.weight_decay = c.weight_decay;
  }
  return o;
}

// The host backend's kernel (host_kernels.cpp); null when no named policy has precision p.
std::unique_ptr<step_kernel> make_host_kernel(const precision_spec& p, const optimizer_config& c);

}  // namespace mpzero::torch::detail

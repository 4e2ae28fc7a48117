// mpzero: step_kernel for a precision policy and an optimizer rule as types: the only
// part of the ZeRO optimizer that is compiled per (Policy, Optimizer, Backend). The
// steppers it makes are the backend's fused step (host.hpp's vectorized loop, or
// cuda/fused_step.cuh's kernel) and, for ZeRO-Offload, the host backend's.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <string_view>
#include <utility>
#include <vector>

#include "../backend/host_backend.hpp"
#include "../optim/optimizer.hpp"
#include "../policy/precision.hpp"
#include "../step/fused_step.hpp"
#include "step_kernel.hpp"

namespace mpzero {

// HostSteps: whether it makes host steppers (ZeRO-Offload) itself. A device kernel
// compiled where the host step should not be (the LibTorch adapter's CUDA units, whose
// offloaded steps run the host kernels of its C++ units) leaves it false.
template <precision_policy Policy, optim::rule Optimizer, class Backend, bool HostSteps = true>
class typed_step_kernel final : public step_kernel {
 public:
  using options_type = typename Optimizer::options;
  static constexpr bool has_betas = requires(options_type o) {
    o.beta1 = 0.0;
    o.beta2 = 0.0;
  };

  // The core validates the hyperparameters at construction (validate()), collectively.
  typed_step_kernel(Backend backend, const options_type& o) : backend_(std::move(backend)), opt_(o) {}

  const options_type& options() const noexcept { return opt_; }
  void set_options(const options_type& o) {
    (void)Optimizer::prepare(o, 1);
    opt_ = o;
  }

  void validate(const param_group_options& group = {}) const override { (void)Optimizer::prepare(adjusted(opt_, group), 1); }
  precision_spec precision() const noexcept override { return precision_spec_of<Policy>(); }
  int n_states() const noexcept override { return Optimizer::n_states; }
  std::string_view optimizer_name() const noexcept override { return optim::name_of<Optimizer>(opt_); }
  double lr() const noexcept override { return opt_.lr; }
  void set_lr(double lr) override {
    options_type o = opt_;
    o.lr = lr;
    set_options(o);
  }
  std::optional<std::pair<double, double>> betas() const noexcept override {
    if constexpr (has_betas) {
      return std::pair<double, double>{opt_.beta1, opt_.beta2};
    } else {
      return std::nullopt;
    }
  }
  void set_betas(double beta1, double beta2) override {
    if constexpr (has_betas) {
      options_type o = opt_;
      o.beta1 = beta1;
      o.beta2 = beta2;
      set_options(o);
    } else {
      detail::throw_invalid("set_betas: " + std::string(optimizer_name()) + " has no betas (beta1, beta2)");
    }
  }

  std::unique_ptr<stepper> make_stepper(std::vector<step_buffers> tensors, bool on_host, int host_threads,
                                        const param_group_options& group) const override {
    std::vector<step_tensor<Policy, Optimizer>> typed;
    typed.reserve(tensors.size());
    for (const step_buffers& b : tensors) typed.push_back(typed_tensor(b));
    if (on_host) {
      if constexpr (HostSteps || std::is_same_v<Backend, host_backend>) {
        host_backend h;
        h.options.threads = host_threads;
        return std::make_unique<bound_stepper<host_backend::stepper<Policy, Optimizer>>>(
            h.template make_stepper<Policy, Optimizer>(std::move(typed)), opt_, group);
      } else {
        detail::throw_invalid("typed_step_kernel: this kernel makes no host steppers (HostSteps = false); pair it "
                              "with a host_backend kernel for ZeRO-Offload");
      }
    }
    return std::make_unique<bound_stepper<typename Backend::template stepper<Policy, Optimizer>>>(
        backend_.template make_stepper<Policy, Optimizer>(std::move(typed)), opt_, group);
  }

 private:
  // The hyperparameters of a parameter group: every rule's options have lr and weight_decay.
  static options_type adjusted(options_type o, const param_group_options& group) {
    if (group == param_group_options{}) return o;
    o.lr *= group.lr_scale;
    if (group.weight_decay) o.weight_decay = *group.weight_decay;
    return o;
  }

  // A backend's stepper with the kernel's hyperparameters as its group adjusts them
  // (read at every run: set_lr applies to the next step).
  template <class S>
  class bound_stepper final : public stepper {
   public:
    bound_stepper(S s, const options_type& opt, const param_group_options& group)
        : s_(std::move(s)), opt_(opt), group_(group) {}
    void run(const step_call& c) override {
      s_.run(make_step_args<Optimizer>(adjusted(opt_, group_), c.step, c.grad_scale, c.seed));
    }

   private:
    S s_;
    const options_type& opt_;
    param_group_options group_;
  };

  static step_tensor<Policy, Optimizer> typed_tensor(const step_buffers& b) {
    step_tensor<Policy, Optimizer> t;
    t.param = static_cast<typename Policy::param_type*>(b.param);
    if constexpr (!Policy::master_is_param) t.master = static_cast<typename Policy::master_type*>(b.master);
    t.grad = static_cast<const typename Policy::grad_type*>(b.grad);
    for (int k = 0; k < Optimizer::n_states; ++k) t.states[k] = static_cast<typename Policy::state_type*>(b.states[k]);
    t.numel = b.numel;
    t.global_offset = b.global_offset;
    return t;
  }

  Backend backend_;
  options_type opt_;
};

}  // namespace mpzero

// mpzero: the interface between the ZeRO core and the optimizer step.
//
// The core (zero/core.hpp) does the bookkeeping of ZeRO at run time; the per-element
// arithmetic, where the precision policy and the optimizer rule are types, sits behind
// step_kernel. The core calls it once per step and per shard piece, never per element.
// typed_step_kernel<Policy, Optimizer, Backend> (zero/typed_step_kernel.hpp) is the
// one implementation: the fused step of backend/host.hpp or cuda/fused_step.cuh.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "options.hpp"
#include "spec.hpp"

namespace mpzero {

// What changes from step to step: the 1-based step, the gradient multiplier (1 / loss
// scale, times the clipping coefficient, over ranks when averaging) and the rounding key.
struct step_call {
  std::uint64_t step = 1;
  float grad_scale = 1.0f;
  std::uint64_t seed = 0;
};

// One contiguous tensor of the step, its arrays in the kernel's dtypes (step_tensor<>
// with the types as values). master is null when the master is the parameter.
struct step_buffers {
  void* param = nullptr;
  void* master = nullptr;
  const void* grad = nullptr;
  std::array<void*, 3> states{};
  std::uint64_t numel = 0;
  std::uint64_t global_offset = 0;  // keys stochastic rounding (step_tensor::global_offset)
};

// A prepared step over fixed tensors.
class stepper {
 public:
  virtual ~stepper() = default;
  virtual void run(const step_call& call) = 0;
};

// One precision policy and optimizer rule (with its hyperparameters) on one backend.
class step_kernel {
 public:
  virtual ~step_kernel() = default;

  virtual precision_spec precision() const noexcept = 0;
  virtual int n_states() const noexcept = 0;
  // The optimizer's name under its current options (checkpoints record it): "AdamW",
  // "SGD", ...; adam_runtime gives "Adam" or "AdamW".
  virtual std::string_view optimizer_name() const noexcept = 0;
  // Throws invalid_argument naming a bad hyperparameter (the rule's prepare()), of the
  // kernel's own or as a parameter group adjusts them.
  virtual void validate(const param_group_options& group = {}) const = 0;
  virtual double lr() const noexcept = 0;
  // Validates first (the rule's prepare()), changing nothing when it throws.
  virtual void set_lr(double lr) = 0;
  // (beta1, beta2) of a rule that has them (Adam, AdamW, Lion), nullopt for one that does
  // not (SGD). A schedule that cycles momentum (OneCycle) sets them between steps.
  virtual std::optional<std::pair<double, double>> betas() const noexcept = 0;
  // Validates first, changing nothing when it throws; throws invalid_argument for a rule
  // without betas.
  virtual void set_betas(double beta1, double beta2) = 0;

  // A stepper over `tensors` in the backend's memory, or with on_host, in host memory
  // (ZeRO-Offload's step, run by the host backend with `host_threads` threads; 0: OpenMP's
  // default), with the kernel's hyperparameters as `group` adjusts them (read at every
  // run: set_lr applies to the next step). The kernel outlives its steppers.
  virtual std::unique_ptr<stepper> make_stepper(std::vector<step_buffers> tensors, bool on_host, int host_threads,
                                                const param_group_options& group) const = 0;
};

}  // namespace mpzero

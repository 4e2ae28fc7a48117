// mpzero: the constexpr memory model: bytes of model states per parameter per rank.
//
// P = bytes of a model parameter, G = gradient, M = master copy (0 when the master
// is the parameter storage), S = optimizer states (count x state bytes), W = ranks.
//
//   stage 0:  P + G + M + S                 everything replicated
//   stage 1:  P + G + (M + S) / W           master and states partitioned
//   stage 2:  P + (G + M + S) / W           gradients partitioned too
//   stage 3:  (P + G + M + S) / W           parameters partitioned too
//
// With CPU offload (stages 1-3) the master copy and the states live in host memory,
// always as a separate master (the device keeps the parameters), together with the
// rank's gradient partition: host = (size(master) + S + G) / W. The device keeps the
// parameters (P, or P / W at stage 3) and, at stage 1 only, the full gradient; at
// stages 2 and 3 reduced gradients go from the buckets straight to the host. Alignment padding of the flat buffers (fewer
// than 8 x W elements per model: partitions align to 8 elements) and transient communication buckets are not
// per-parameter costs and are left out; tests account for them separately.
// Also left out: at stage 3, parameters at or below zero_options::param_persistence_threshold
// stay whole on every rank (P x their count x (1 - 1/W) more); with offload and a separate
// master, the host's parameter-typed copy of the partition (P / W, memory().host_buckets).
#pragma once

#include <string>

#include "../error.hpp"
#include "../numeric/dtype.hpp"
#include "precision.hpp"
#include "stage.hpp"

namespace mpzero {

struct memory_footprint {
  double device_bytes = 0;  // per parameter per rank, in accelerator (or, CPU-only, main) memory
  double host_bytes = 0;    // per parameter per rank, in host memory (offload)
  constexpr double total() const noexcept { return device_bytes + host_bytes; }
};

struct state_layout {
  dtype param, master, grad, state;
  int n_states;  // optimizer state tensors per parameter (Adam: 2, SGD/Lion: 1)
};

constexpr memory_footprint bytes_per_param(const state_layout& s, int zero_stage, offload_kind offload,
                                           int world_size) {
  if (zero_stage < 0 || zero_stage > 3)
    detail::throw_invalid("ZeRO stage " + std::to_string(zero_stage) + " does not exist: use 0, 1, 2 or 3");
  if (world_size < 1)
    detail::throw_invalid("world size " + std::to_string(world_size) + " is invalid: it must be at least 1");
  if (s.n_states < 0 || s.n_states > 3)
    detail::throw_invalid("n_states = " + std::to_string(s.n_states) +
                          " is invalid: an optimizer keeps 0 to 3 state tensors per parameter (Adam/AdamW: 2, "
                          "SGD/Lion: 1)");
  if (offload == offload_kind::cpu && zero_stage == 0)
    detail::throw_invalid("CPU offload with ZeRO stage 0: the host keeps each rank's partition, so offload needs "
                          "stage 1, 2 or 3 (or offload none)");
  const double w = world_size;
  const double p = static_cast<double>(size_of(s.param));
  const double g = static_cast<double>(size_of(s.grad));
  const double states = static_cast<double>(s.n_states) * static_cast<double>(size_of(s.state));
  memory_footprint f;
  if (offload == offload_kind::cpu) {
    f.host_bytes = (static_cast<double>(size_of(s.master)) + states + g) / w;
    f.device_bytes = (zero_stage == 3 ? p / w : p) + (zero_stage == 1 ? g : 0.0);
    return f;
  }
  const double m = s.master == s.param ? 0.0 : static_cast<double>(size_of(s.master));
  switch (zero_stage) {
    case 0: f.device_bytes = p + g + m + states; break;
    case 1: f.device_bytes = p + g + (m + states) / w; break;
    case 2: f.device_bytes = p + (g + m + states) / w; break;
    default: f.device_bytes = (p + g + m + states) / w; break;
  }
  return f;
}

template <precision_policy Policy, class Optimizer>
constexpr state_layout layout_of() noexcept {
  return {Policy::param_dtype, Policy::master_dtype, Policy::grad_dtype, Policy::state_dtype, Optimizer::n_states};
}

// The typed form: bytes_per_param<Policy, optim::adam, stage<2>, offload_none>(world).
template <precision_policy Policy, class Optimizer, class Stage, class Offload = offload_none>
constexpr memory_footprint bytes_per_param(int world_size) {
  static_assert(!(Offload::value == offload_kind::cpu && Stage::value == 0),
                MPZERO_RULE_OFFLOAD_STAGE);
  return bytes_per_param(layout_of<Policy, Optimizer>(), Stage::value, Offload::value, world_size);
}

}  // namespace mpzero

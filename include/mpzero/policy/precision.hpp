// mpzero: precision policies. A policy names the storage type of each model state
// and the rounding of low-precision writes; invalid choices fail to compile with a
// message that says what to use instead.
#pragma once

#include <concepts>

#include "../numeric/convert.hpp"
#include "../numeric/dtype.hpp"
#include "rules.hpp"

namespace mpzero {

namespace detail {
template <class A, class B>
inline constexpr bool is_16bit_pair = (std::same_as<A, bf16> && std::same_as<B, fp16>) ||
                                      (std::same_as<A, fp16> && std::same_as<B, bf16>);
}  // namespace detail

// Param:  the model's weights as the forward pass reads them.
// Master: the weights the optimizer updates. fp32, or the same type as Param, in
//         which case the master partition *is* the parameter partition (no copy).
// Grad:   gradients as they are accumulated, reduced and read by the step.
// State:  optimizer states (Adam's moments, momentum). fp32 or bf16.
// Rounding: how low-precision master weights and states are written.
template <class Param, class Master, class Grad, class State, class Rounding = round_nearest>
struct precision {
  static_assert(storage_type<Param> && storage_type<Master> && storage_type<Grad> && storage_type<State>,
                MPZERO_RULE_STORAGE);
  static_assert(rounding_mode<Rounding>,
                "mpzero: the rounding of a precision policy is mpzero::round_nearest or mpzero::round_stochastic.");
  using param_type = Param;
  using master_type = Master;
  using grad_type = Grad;
  using state_type = State;
  using rounding = Rounding;

  static_assert(!std::same_as<State, fp16>,
                MPZERO_RULE_FP16_STATES);
  static_assert(std::same_as<Master, Param> || std::same_as<Master, float>,
                MPZERO_RULE_MASTER);
  static_assert(!detail::is_16bit_pair<Param, Master> && !detail::is_16bit_pair<Param, Grad> &&
                    !detail::is_16bit_pair<Param, State> && !detail::is_16bit_pair<Master, Grad> &&
                    !detail::is_16bit_pair<Master, State> && !detail::is_16bit_pair<Grad, State>,
                MPZERO_RULE_MIX_16BIT);
  static_assert(!Rounding::stochastic || !std::same_as<Master, float> || !std::same_as<State, float>,
                MPZERO_RULE_STOCHASTIC);

  static constexpr dtype param_dtype = dtype_of_v<Param>;
  static constexpr dtype master_dtype = dtype_of_v<Master>;
  static constexpr dtype grad_dtype = dtype_of_v<Grad>;
  static constexpr dtype state_dtype = dtype_of_v<State>;
  // The optimizer updates the parameter storage in place: no separate master copy.
  static constexpr bool master_is_param = std::same_as<Master, Param>;
  static constexpr bool stochastic_rounding = Rounding::stochastic;
  // fp16 weights or gradients lose small gradients to underflow without loss scaling.
  static constexpr bool needs_loss_scaling = std::same_as<Param, fp16> || std::same_as<Grad, fp16>;
};

template <class T>
inline constexpr bool is_precision_v = false;
template <class P, class M, class G, class S, class R>
inline constexpr bool is_precision_v<precision<P, M, G, S, R>> = true;

template <class T>
concept precision_policy = is_precision_v<T>;

// The configurations most trainers choose between.
namespace policies {
// Everything fp32: the reference.
using fp32 = precision<float, float, float, float>;
// bf16 model and gradients, fp32 master weights and Adam states (DeepSpeed's bf16 default).
using bf16_fp32_master = precision<bf16, float, bf16, float>;
// bf16 master weights (the parameter storage itself), fp32 optimizer states.
using bf16_master_fp32_states = precision<bf16, bf16, bf16, float>;
// Everything bf16, rounded to nearest.
using bf16_all = precision<bf16, bf16, bf16, bf16>;
// Everything bf16 with stochastic rounding of master weights and states.
using bf16_all_sr = precision<bf16, bf16, bf16, bf16, round_stochastic>;
// bf16 model, fp32 gradients (accumulated and reduced in fp32), fp32 master and states:
// DeepSpeed's bf16 with data_types.grad_accum_dtype = "fp32".
using bf16_fp32_grads = precision<bf16, float, float, float>;
// fp16 model and gradients with fp32 master and states: needs loss scaling.
using fp16_fp32_master = precision<fp16, float, fp16, float>;
// fp16 master weights (the parameter storage itself) and gradients, fp32 states: needs
// loss scaling. DeepSpeed's fp16_master_weights_and_grads.
using fp16_master_fp32_states = precision<fp16, fp16, fp16, float>;
}  // namespace policies

}  // namespace mpzero

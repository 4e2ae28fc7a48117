// mpzero: the ZeRO core's configuration as run-time values.
//
// precision_spec is a precision policy as values (its four dtypes and its rounding);
// zero_spec adds the ZeRO stage, CPU offload and the default gradient wire dtype.
// validate() refuses what the typed forms refuse at compile time (precision<>,
// stage<>, ZeroOptimizer<>'s Wire and Offload), with the same messages
// (policy/rules.hpp): the LibTorch engine reaches the core from a JSON config.
#pragma once

#include <cstdint>
#include <string>

#include "../error.hpp"
#include "../numeric/dtype.hpp"
#include "../policy/precision.hpp"
#include "../policy/rules.hpp"

namespace mpzero {

struct precision_spec {
  dtype param = dtype::fp32, master = dtype::fp32, grad = dtype::fp32, state = dtype::fp32;
  bool stochastic_rounding = false;

  // The optimizer updates the parameter storage in place: no separate master copy.
  constexpr bool master_is_param() const noexcept { return master == param; }
  // fp16 weights or gradients lose small gradients to underflow without loss scaling.
  constexpr bool needs_loss_scaling() const noexcept { return param == dtype::fp16 || grad == dtype::fp16; }

  // The rules of precision<> (policy/rules.hpp), as invalid_argument.
  void validate() const {
    for (const dtype d : {param, master, grad, state}) {
      if (d != dtype::fp32 && d != dtype::bf16 && d != dtype::fp16) fail(MPZERO_RULE_STORAGE);
    }
    if (state == dtype::fp16) fail(MPZERO_RULE_FP16_STATES);
    if (master != param && master != dtype::fp32) fail(MPZERO_RULE_MASTER);
    const dtype all[] = {param, master, grad, state};
    for (int a = 0; a < 4; ++a)
      for (int b = a + 1; b < 4; ++b)
        if (detail::mixes_16bit(all[a], all[b])) fail(MPZERO_RULE_MIX_16BIT);
    if (stochastic_rounding && master == dtype::fp32 && state == dtype::fp32) fail(MPZERO_RULE_STOCHASTIC);
  }

  // e.g. "param bf16, master fp32, grad bf16, state fp32, nearest rounding"
  std::string describe() const {
    return "param " + std::string(name_of(param)) + ", master " + std::string(name_of(master)) + ", grad " +
           std::string(name_of(grad)) + ", state " + std::string(name_of(state)) + ", " +
           (stochastic_rounding ? "stochastic" : "nearest") + " rounding";
  }

  friend constexpr bool operator==(const precision_spec&, const precision_spec&) = default;

 private:
  [[noreturn]] static void fail(const char* rule) { throw invalid_argument(rule); }
};

// A precision policy's values.
template <precision_policy Policy>
constexpr precision_spec precision_spec_of() noexcept {
  return {Policy::param_dtype, Policy::master_dtype, Policy::grad_dtype, Policy::state_dtype,
          Policy::stochastic_rounding};
}

struct zero_spec {
  precision_spec precision{};
  int stage = 0;
  bool offload = false;  // ZeRO-Offload: the shard's master weights, states and step on the host
  dtype wire = dtype::fp32;  // what gradients travel in unless zero_options::wire_dtypes says otherwise

  // The rules of precision<>, stage<>, and ZeroOptimizer's Offload and Wire.
  void validate() const {
    precision.validate();
    if (stage < 0 || stage > 3) throw invalid_argument(MPZERO_RULE_STAGE);
    if (offload && stage == 0) throw invalid_argument(MPZERO_RULE_OFFLOAD_STAGE);
    if (wire != dtype::fp32 && wire != dtype::bf16 && wire != dtype::fp16) {
      throw invalid_argument(MPZERO_RULE_WIRE_STORAGE);
    }
    if (detail::mixes_16bit(wire, precision.param) || detail::mixes_16bit(wire, precision.grad)) {
      throw invalid_argument(MPZERO_RULE_WIRE_MIX);
    }
  }

  friend constexpr bool operator==(const zero_spec&, const zero_spec&) = default;
};

}  // namespace mpzero

// mpzero: the rules a precision policy, a ZeRO stage, an offload choice and a gradient
// wire type must follow, written once. The typed forms (precision<>, stage<>,
// ZeroOptimizer<>) refuse a broken rule with static_assert and these messages; the
// run-time form (zero_spec::validate, which the LibTorch engine's JSON config reaches)
// throws mpzero::invalid_argument with the same words.
#pragma once

#include "../numeric/dtype.hpp"

// The messages, as macros: static_assert takes a string literal only.
#define MPZERO_RULE_STORAGE                                                                                 \
  "mpzero: precision<Param, Master, Grad, State> stores model states as mpzero::fp32 (float), mpzero::bf16 " \
  "or mpzero::fp16."
#define MPZERO_RULE_FP16_STATES                                                                               \
  "mpzero: fp16 optimizer states are refused: Adam's second moment under- and overflows fp16's range. Use " \
  "State = mpzero::bf16 (8-bit exponent) or mpzero::fp32."
#define MPZERO_RULE_MASTER                                                                                \
  "mpzero: master weights must represent every parameter value: use Master = mpzero::fp32, or Master = " \
  "Param so that the master partition is the parameter partition."
#define MPZERO_RULE_MIX_16BIT                                                                                   \
  "mpzero: a policy may not mix bf16 and fp16: choose one 16-bit format for param, master, grad and state " \
  "(bf16 is the usual choice; it needs no loss scaling)."
#define MPZERO_RULE_STOCHASTIC                                                                                  \
  "mpzero: stochastic rounding applies to low-precision master weights or optimizer states, and this policy " \
  "keeps both in fp32: use mpzero::round_nearest."
#define MPZERO_RULE_STAGE "mpzero: the ZeRO stage must be 0, 1, 2 or 3 (mpzero::stage<0..3>)."
#define MPZERO_RULE_OFFLOAD_STAGE "mpzero: CPU offload keeps each rank's partition on the host: use ZeRO stage 1, 2 or 3."
#define MPZERO_RULE_WIRE_STORAGE "mpzero: the wire type of gradients is mpzero::fp32, mpzero::bf16 or mpzero::fp16."
#define MPZERO_RULE_WIRE_MIX                                                                                      \
  "mpzero: the gradient wire type mixes bf16 and fp16 with the policy's 16-bit type (fp16 overflows above 65504 " \
  "and nothing scales it); reduce in the policy's own 16-bit type or in mpzero::fp32."

namespace mpzero::detail {

// bf16 with fp16, either way round: the pair a policy may not mix.
constexpr bool mixes_16bit(dtype a, dtype b) noexcept {
  return (a == dtype::bf16 && b == dtype::fp16) || (a == dtype::fp16 && b == dtype::bf16);
}

}  // namespace mpzero::detail

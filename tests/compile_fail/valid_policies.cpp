// Positive control for the compile-fail tests: the same headers, flags and include
// path compile a valid use of every policy feature. If this fails, the compile-fail
// tests' messages prove nothing.
#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/memory_model.hpp>
#include <mpzero/policy/precision.hpp>
#include <mpzero/policy/stage.hpp>

namespace p = mpzero::policies;
static_assert(p::fp32::master_is_param && !p::bf16_fp32_master::master_is_param);
static_assert(p::bf16_master_fp32_states::master_is_param && p::bf16_all_sr::stochastic_rounding);
static_assert(p::fp16_fp32_master::needs_loss_scaling && !p::bf16_all::needs_loss_scaling);
// The valid neighbours of each compile-fail case.
static_assert(mpzero::precision<mpzero::bf16, float, mpzero::bf16, mpzero::bf16>::state_dtype == mpzero::dtype::bf16);
static_assert(mpzero::precision<mpzero::fp16, mpzero::fp16, mpzero::fp16, float>::master_is_param);
static_assert(mpzero::precision<mpzero::bf16, mpzero::bf16, mpzero::bf16, float, mpzero::round_stochastic>::stochastic_rounding);
static_assert(mpzero::stage<3>::value == 3 && mpzero::stage<0>::value == 0);
static_assert(mpzero::bytes_per_param<p::bf16_fp32_master, mpzero::optim::adam, mpzero::stage<1>, mpzero::offload_cpu>(2)
                  .host_bytes == 7.0);

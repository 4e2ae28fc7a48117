// Stochastic rounding with nothing low-precision to round: fp32 master and states.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<mpzero::bf16, float, mpzero::bf16, float, mpzero::round_stochastic>;
constexpr bool force_instantiation = bad::stochastic_rounding;

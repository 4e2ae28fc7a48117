// bf16 parameters with fp16 gradients: every other rule holds (fp32 master and
// states), so only the mixing rule can fire.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<mpzero::bf16, float, mpzero::fp16, float>;
constexpr bool force_instantiation = bad::master_is_param;

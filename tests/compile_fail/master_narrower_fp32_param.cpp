// A bf16 master cannot hold every value of an fp32 parameter.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<float, mpzero::bf16, float, float>;
constexpr bool force_instantiation = bad::master_is_param;

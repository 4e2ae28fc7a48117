// fp16 optimizer states must not compile: Adam's second moment leaves fp16's range.
// An fp16 model with an fp32 master breaks no other rule, so only this one fires.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<mpzero::fp16, float, mpzero::fp16, mpzero::fp16>;
constexpr bool force_instantiation = bad::master_is_param;

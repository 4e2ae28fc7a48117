// double is not a storage type (fp32, bf16, fp16 are). The precision<> parameters
// are constrained by mpzero::storage_type, so the compiler reports the unsatisfied
// concept rather than an mpzero-worded static_assert.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<double, float, float, float>;
bad::param_type force_instantiation{};

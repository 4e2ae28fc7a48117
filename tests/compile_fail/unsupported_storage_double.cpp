// double is not a storage type (fp32, bf16, fp16 are). precision<> takes plain class
// parameters and checks mpzero::storage_type in a static_assert, so the error is
// mpzero's own message (tests/policy.cmake expects its text), not a concept failure.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<double, float, float, float>;
bad::param_type force_instantiation{};

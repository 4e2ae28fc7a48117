// An fp16 master cannot hold every bf16 value (bf16 has the wider exponent). The
// policy also mixes bf16 and fp16; the test checks the master message.
#include <mpzero/policy/precision.hpp>

using bad = mpzero::precision<mpzero::bf16, mpzero::fp16, mpzero::bf16, float>;
constexpr bool force_instantiation = bad::master_is_param;

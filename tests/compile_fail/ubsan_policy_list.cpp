// Compile-ok case (tests/policy.cmake): the list of named policies and the lookup the
// LibTorch engine makes from a config's dtypes, compiled with -fsanitize=undefined, as a
// trainer built with UBSan compiles them: they must stay constant expressions there.
#include <mpzero/policy/policy_list.hpp>

static_assert(mpzero::find_policy(mpzero::precision_spec_of<mpzero::policies::fp32>())->name == "fp32");
static_assert(mpzero::find_policy(mpzero::precision_spec_of<mpzero::policies::bf16_all_sr>())->name == "bf16_all_sr");
static_assert(mpzero::find_policy(mpzero::precision_spec{mpzero::dtype::fp16, mpzero::dtype::fp16,
                                                         mpzero::dtype::fp16, mpzero::dtype::fp16}) == nullptr);

int main() { return 0; }

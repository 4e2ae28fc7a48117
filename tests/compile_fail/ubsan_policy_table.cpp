// Compile-ok case (tests/torch.cmake): the engine's table of policies, compiled with
// -fsanitize=undefined, as a trainer built with UBSan compiles it. g++ does not fold a
// comparison of two functions' addresses in a constant expression under that flag, so
// policy_selected<>() must find a policy's entry without one.
// What torch.cmake defines for the engine's units: every policy, and some number of table parts.
#define MPZERO_TORCH_POLICY_MASK 255
#define MPZERO_TORCH_TABLE_PARTS 4
#include "core_impl.hpp"

namespace d = mpzero::torch::detail;
static_assert(d::policy_selected<mpzero::policies::fp32>());
static_assert(d::policy_selected<mpzero::policies::bf16_all_sr>());
static_assert(d::policy_selected<mpzero::policies::fp16_master_fp32_states>());

int main() { return 0; }

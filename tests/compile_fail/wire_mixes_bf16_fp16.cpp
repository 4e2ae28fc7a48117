// Gradients of a bf16 policy sent as fp16 on the wire: fp16 overflows above 65504 and
// flushes below 2^-24, and nothing scales them (the policy needs no loss scaling), so
// ZeroOptimizer refuses the mix as precision<> refuses it within a policy.
#include <mpzero/comm/local.hpp>
#include <mpzero/optim/adam.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

using Z = mpzero::ZeroOptimizer<mpzero::policies::bf16_all, mpzero::optim::adamw, mpzero::stage<2>,
                                mpzero::comm::local_communicator, mpzero::host_backend, mpzero::offload_none,
                                mpzero::fp16>;
static_assert(sizeof(Z) > 0);

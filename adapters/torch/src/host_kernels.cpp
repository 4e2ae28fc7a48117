// The host backend's vectorized loops for the engine's tables, compiled once here at the
// build's own optimization; the table units, compiled at -O1, declare them `extern`
// (host_kernels.hpp). The list: host_kernels.inc.
#include <cstdint>
#include <span>

#include <mpzero/backend/host.hpp>
#include <mpzero/optim/adam.hpp>
#include <mpzero/policy/precision.hpp>

#define MPZERO_TORCH_HOST_KW
#include "host_kernels.inc"

// The host backend's step kernels: every named policy with Adam/AdamW (one rule),
// SGD and Lion, the fused host step vectorized for this CPU (backend/host.hpp).
#include <mpzero/backend/host_backend.hpp>

#include "kernel_table.hpp"

namespace mpzero::torch::detail {

std::unique_ptr<step_kernel> make_host_kernel(const precision_spec& p, const optimizer_config& c) {
  return make_kernel<host_backend, true>(p, c, host_backend{});
}

}  // namespace mpzero::torch::detail

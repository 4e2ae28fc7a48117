// The host table's rows: ZeroOptimizer<..., host_backend, ...> for CPU parameters.
// Included only by the generated table units (torch.cmake, src/table_part.in); the
// combinations are listed in core_impl.hpp (add_table_part). Torch-free.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mpzero/backend/host_backend.hpp>

#include "core_impl.hpp"
#include "host_kernels.hpp"

namespace mpzero::torch::detail {

struct host_context {
  using backend_type = host_backend;
  struct scope {
    explicit scope(const host_context&) noexcept {}
  };
  host_backend backend() const { return {}; }
  void wait_stream(void*) const noexcept {}
  void join_stream(void*) const noexcept {}
};

// The communicator a host core uses: `c`, unless it reads device memory (NCCL, a c10d
// group on a CUDA device), which the core would hand host pointers: refused by name
// before the core's own, more general check.
inline any_communicator host_communicator(any_communicator c) {
  if (!c.base().reads_device_memory()) return c;
  throw config_error("mpzero::torch: the parameters are on the CPU, but the communicator '" + c.name() +
                     "' reads device memory. Move the model to its GPU first (model->to(torch::kCUDA)), or pass a "
                     "host communicator: mpzero::comm::mpi_communicator, or "
                     "mpzero::torch::process_group_communicator(group, torch::kCPU) over a Gloo group");
}

// mpzero::torch::max_over_ranks over a host communicator.
inline void host_max_over_ranks(const core_place&, any_communicator& c, std::span<std::int32_t> v) {
  host_backend{}.all_reduce_host(c, v.data(), v.size(), comm::reduce_op::max);
}

template <class Policy, class Opt, int N, class Offload>
struct host_row {
  static core_row make(optimizer_type type) {
    return core_row{spec_of<Policy, N, Offload>(type, core_device::cpu),
                    [](const core_place&, any_communicator c, std::span<const std::uint64_t> numels,
                       const optimizer_config& o, const zero_options& zo) -> std::unique_ptr<zero_core> {
                      return std::make_unique<core_impl<Policy, Opt, N, Offload, host_context>>(
                          core_device::cpu, host_context{}, host_communicator(std::move(c)), numels, o, zo);
                    },
                    &host_max_over_ranks};
  }
};

template <int Part>
void add_host_part(std::vector<core_row>& t) {
  add_table_part<Part, host_row>(t);
}

}  // namespace mpzero::torch::detail

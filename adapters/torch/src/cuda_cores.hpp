// What a CUDA core needs that only nvcc compiles (cuda_cores.cu): its device context,
// the CUDA backend, its step kernel and its communicator. Private to the adapter;
// torch-free and CUDA-free.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include <mpzero/backend/erased.hpp>
#include <mpzero/torch/zero_core.hpp>
#include <mpzero/zero/spec.hpp>
#include <mpzero/zero/step_kernel.hpp>

namespace mpzero::torch::detail {

struct cuda_parts {
  std::unique_ptr<core_context> context;
  std::unique_ptr<backend_base> backend;
  std::unique_ptr<step_kernel> kernel;  // its steps on the device; none on the host
  any_communicator comm;
};

// The parts of a core on place.device, ordered on place.stream. `comm` must read device
// memory, or have one rank (it is then replaced by device-to-device copies).
cuda_parts make_cuda_parts(const core_place& place, const precision_spec& p, const optimizer_config& c,
                           any_communicator comm);

// mpzero::torch::max_over_ranks over a communicator that reads device memory.
void cuda_max_over_ranks(const core_place& place, any_communicator& c, std::span<std::int32_t> v);

}  // namespace mpzero::torch::detail

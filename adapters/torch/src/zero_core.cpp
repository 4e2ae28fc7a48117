// The dispatch over the tables of ZeroOptimizer instantiations behind
// mpzero::torch::zero_core: the host table (CPU parameters) and, when built with CUDA, the
// CUDA table. Their rows are compiled in the generated units (core_impl.hpp lists the
// combinations); this file only concatenates the parts. Torch-free (plain g++).
#include <mpzero/torch/zero_core.hpp>

#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "core_impl.hpp"

namespace mpzero::torch {

namespace detail {

namespace {

// The parts of a table in order: add(std::integral_constant<int, Part>, rows) for each.
template <class Add, int... Parts>
std::vector<core_row> concatenate(Add add, std::integer_sequence<int, Parts...>) {
  std::vector<core_row> v;
  (add(std::integral_constant<int, Parts>{}, v), ...);
  return v;
}

const std::vector<core_row>& table_for(core_device d) {
  if (d == core_device::cuda) {
#ifdef MPZERO_TORCH_CUDA
    static const std::vector<core_row> t = concatenate(
        []<int P>(std::integral_constant<int, P>, std::vector<core_row>& v) { add_cuda_part<P>(v); },
        std::make_integer_sequence<int, table_parts>{});
    return t;
#else
    static const std::vector<core_row> none;
    return none;
#endif
  }
  static const std::vector<core_row> t = concatenate(
      []<int P>(std::integral_constant<int, P>, std::vector<core_row>& v) { add_host_part<P>(v); },
      std::make_integer_sequence<int, table_parts>{});
  return t;
}

}  // namespace

}  // namespace detail

std::string core_spec::describe() const {
  return "param " + std::string(name_of(param)) + ", master " + std::string(name_of(master)) + ", grad " +
         std::string(name_of(grad)) + ", state " + std::string(name_of(state)) + ", " +
         (stochastic_rounding ? "stochastic" : "nearest") + " rounding, " + std::string(optimizer_name(optimizer)) +
         ", ZeRO stage " + std::to_string(stage) + (offload ? ", CPU offload" : "") +
         (device == core_device::cuda ? ", CUDA" : "");
}

bool cuda_cores_compiled() noexcept {
#ifdef MPZERO_TORCH_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<core_spec> compiled_cores() {
  std::vector<core_spec> out;
  for (core_device d : {core_device::cpu, core_device::cuda})
    for (const detail::core_row& r : detail::table_for(d)) out.push_back(r.spec);
  return out;
}

void max_over_ranks(any_communicator comm, std::span<std::int32_t> v, const core_place& place) {
  if (comm.size() == 1 || v.empty()) return;
  const bool device = comm.base().reads_device_memory();
  const auto& table = detail::table_for(device ? core_device::cuda : core_device::cpu);
  if (table.empty()) {
    throw config_error("mpzero::torch: the communicator '" + comm.name() +
                       "' reads device memory, but this build of the LibTorch adapter has no CUDA cores. Rebuild "
                       "with nvcc found and MPZERO_TORCH_CUDA=ON, or pass a host communicator (MPI, Gloo)");
  }
  table.front().max_over_ranks(place, comm, v);
}

std::unique_ptr<zero_core> make_zero_core(const core_spec& spec, any_communicator comm,
                                          std::span<const std::uint64_t> numels, const optimizer_config& opt,
                                          const zero_options& zo, const core_place& place) {
  const auto& table = detail::table_for(spec.device);
  for (const detail::core_row& r : table)
    if (r.spec == spec) return r.make(place, std::move(comm), numels, opt, zo);
  if (table.empty()) {
    throw config_error("mpzero::torch: the model's parameters are on a CUDA device, but this build of the LibTorch "
                       "adapter has no CUDA cores. Rebuild with nvcc found and MPZERO_TORCH_CUDA=ON (a CUDA build of "
                       "LibTorch, e.g. PyPI's default torch wheel), or move the model to the CPU");
  }
  std::string msg = "mpzero::torch: the configuration selects (" + spec.describe() +
                    "), which is not compiled into this build of the LibTorch adapter. Compiled:";
  for (const detail::core_row& r : table) msg += "\n  " + r.spec.describe();
  // A policy this build left out (CMake's MPZERO_TORCH_POLICIES): say which, and how to add it.
  std::string selected;
  const char* wanted = nullptr;
  for (std::size_t i = 0; i < std::size(detail::table_policies); ++i) {
    const auto& p = detail::table_policies[i];
    const core_spec& ps = p.spec;
    const bool on = ((detail::table_policy_mask >> i) & 1u) != 0;
    if (on) selected += std::string(selected.empty() ? "" : ",") + p.name;
    if (!on && ps.param == spec.param && ps.master == spec.master && ps.grad == spec.grad && ps.state == spec.state &&
        ps.stochastic_rounding == spec.stochastic_rounding)
      wanted = p.name;
  }
  // Every row of a policy is Adam or AdamW (add_policy); another optimizer is missing from
  // the full build too.
  const bool adam = spec.optimizer == optimizer_type::adam || spec.optimizer == optimizer_type::adamw;
  if (wanted && adam) {
    msg += "\nIts precision policy, " + std::string(wanted) + ", was left out of this build: it was configured with " +
           "MPZERO_TORCH_POLICIES=\"" + selected + "\". Reconfigure with " + wanted + " added to that list (or " +
           "MPZERO_TORCH_POLICIES=all, the default; add_table_part in adapters/torch/src/core_impl.hpp lists what " +
           "the full build compiles), or change the config to one of the compiled combinations";
  } else {
    msg += "\nChange the config to one of these, or add the combination to add_table_part in "
           "adapters/torch/src/core_impl.hpp (both tables compile its list)";
  }
  throw config_error(msg);
}

}  // namespace mpzero::torch

// The host table of ZeroOptimizer instantiations behind mpzero::torch::zero_core, and the
// dispatch over the host and CUDA tables. Torch-free (plain g++): every row costs
// compile time (one fused step per policy and optimizer), so keep the table small.
#include <mpzero/torch/zero_core.hpp>

#include <string>
#include <utility>

#include <mpzero/backend/host_backend.hpp>

#include "core_impl.hpp"

namespace mpzero::torch {

namespace detail {

namespace {

struct host_context {
  using backend_type = host_backend;
  struct scope {
    explicit scope(const host_context&) noexcept {}
  };
  host_backend backend() const { return {}; }
  void wait_stream(void*) const noexcept {}
  void join_stream(void*) const noexcept {}
};

template <class Policy, class Opt, int N, class Offload>
struct host_row {
  static core_row make() {
    return core_row{spec_of<Policy, Opt, N, Offload>(core_device::cpu),
                    [](const core_place&, any_communicator c, std::span<const std::uint64_t> numels,
                       const optimizer_config& o, const zero_options& zo) -> std::unique_ptr<zero_core> {
                      return std::make_unique<core_impl<Policy, Opt, N, Offload, host_context>>(
                          core_device::cpu, host_context{}, std::move(c), numels, o, zo);
                    }};
  }
};

// The compiled set: what DeepSpeed's bf16/fp16 sections and data_types.grad_accum_dtype
// can select, with Adam and AdamW, ZeRO stages 0-2, CPU offload at 1-2 where it applies.
const std::vector<core_row>& host_table() {
  static const std::vector<core_row> t = [] {
    std::vector<core_row> v;
    add_policy<policies::fp32, host_row, true, true>(v);
    add_policy<policies::bf16_fp32_master, host_row, true, true>(v);
    add_policy<precision<bf16, float, float, float>, host_row, true, false>(v);  // bf16 model, fp32 gradient accumulation
    add_policy<policies::bf16_master_fp32_states, host_row, true, true>(v);      // DeepSpeed: only with offload
    add_policy<policies::bf16_all, host_row, true, true>(v);
    add_policy<policies::bf16_all_sr, host_row, true, true>(v);
    add_policy<policies::fp16_fp32_master, host_row, true, true>(v);
    // fp16 master weights and gradients; DeepSpeed allows it with CPU offload (issue 5), so
    // with offload here too.
    add_policy<precision<fp16, fp16, fp16, float>, host_row, true, true>(v);
    return v;
  }();
  return t;
}

const std::vector<core_row>& table_for(core_device d) {
  if (d == core_device::cuda) {
#ifdef MPZERO_TORCH_CUDA
    return cuda_table();
#else
    static const std::vector<core_row> none;
    return none;
#endif
  }
  return host_table();
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
  msg += "\nChange the config to one of these, or add the combination to the table in adapters/torch/src/zero_core";
  msg += spec.device == core_device::cuda ? "_cuda.cu" : ".cpp";
  throw config_error(msg);
}

}  // namespace mpzero::torch

// The table of compiled ZeroOptimizer instantiations behind mpzero::torch::zero_core.
// Torch-free (plain g++): this is where the optimizer's templates are instantiated, so
// keep the table small; every row costs compile time (one fused step per row).
#include <mpzero/torch/zero_core.hpp>

#include <string>
#include <utility>

#include <mpzero/backend/host_backend.hpp>
#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/precision.hpp>

namespace mpzero::torch {

namespace {

template <class Opt>
constexpr optimizer_type optimizer_of() {
  if constexpr (std::is_same_v<Opt, optim::adam>) return optimizer_type::adam;
  else if constexpr (std::is_same_v<Opt, optim::adamw>) return optimizer_type::adamw;
  else if constexpr (std::is_same_v<Opt, optim::sgd>) return optimizer_type::sgd;
  else return optimizer_type::lion;
}

template <class Opt>
typename Opt::options options_of(const optimizer_config& c) {
  typename Opt::options o;
  if constexpr (std::is_same_v<Opt, optim::adam> || std::is_same_v<Opt, optim::adamw>) {
    o.lr = c.lr, o.beta1 = c.beta1, o.beta2 = c.beta2, o.eps = c.eps, o.weight_decay = c.weight_decay;
    o.bias_correction = c.bias_correction;
  } else if constexpr (std::is_same_v<Opt, optim::sgd>) {
    o.lr = c.lr, o.momentum = c.momentum, o.dampening = c.dampening, o.weight_decay = c.weight_decay;
    o.nesterov = c.nesterov;
  } else {
    o.lr = c.lr, o.beta1 = c.beta1, o.beta2 = c.beta2, o.weight_decay = c.weight_decay;
  }
  return o;
}

template <class Policy, class Opt, int N, class Offload>
core_spec spec_of() {
  return core_spec{Policy::param_dtype,         Policy::master_dtype, Policy::grad_dtype, Policy::state_dtype,
                   Policy::stochastic_rounding, optimizer_of<Opt>(),  N,
                   Offload::value == offload_kind::cpu};
}

// Calls f(static_cast<const T*>(p)) with T the storage type named by t.
template <class F>
void with_storage(dtype t, const void* p, F&& f) {
  switch (t) {
    case dtype::fp32: f(static_cast<const float*>(p)); return;
    case dtype::bf16: f(static_cast<const bf16*>(p)); return;
    case dtype::fp16: f(static_cast<const fp16*>(p)); return;
  }
  throw config_error("mpzero::torch: unknown dtype " + std::to_string(static_cast<int>(t)));
}

template <class Policy, class Opt, int N, class Offload>
class core_impl final : public zero_core {
 public:
  core_impl(any_communicator comm, std::span<const std::uint64_t> numels, const optimizer_config& opt,
            const zero_options& zo)
      : comm_(std::move(comm)), spec_(spec_of<Policy, Opt, N, Offload>()), z_(comm_, numels, options_of<Opt>(opt), zo) {}

  const core_spec& spec() const noexcept override { return spec_; }

  void* param_data(std::size_t i) override {
    if constexpr (N < 3) {
      return z_.param(i).data();
    } else {
      throw config_error("mpzero::torch: ZeRO stage 3 parameters are partitioned; the engine does not support "
                         "stage 3 yet (use zero_optimization.stage 0, 1 or 2)");
    }
  }
  void load_param(std::size_t i, const void* values, dtype t) override {
    with_storage(t, values, [&](auto* p) { z_.load_param(i, p); });
  }
  void accumulate_grad(std::size_t i, const void* src, dtype t, float scale) override {
    with_storage(t, src, [&](auto* p) { z_.accumulate_grad(i, p, scale); });
  }
  void end_backward() override { z_.end_backward(); }
  void zero_grad() override { z_.zero_grad(); }
  std::vector<float> full_grad(std::size_t i) override { return z_.full_grad(i); }

  std::vector<std::vector<float>> full_master() override {
    std::vector<float> flat(static_cast<std::size_t>(z_.layout().padded_numel()), 0.0f);
    z_.read_master_shard([&](std::uint64_t k, float v) { flat[static_cast<std::size_t>(k)] = v; });
    // Each element has one owner above stage 0 (the others hold +0): the sum is exact.
    if (N > 0 && comm_.size() > 1) comm_.all_reduce(flat.data(), flat.data(), flat.size(), comm::reduce_op::sum);
    std::vector<std::vector<float>> out(z_.num_params());
    for (std::size_t i = 0; i < out.size(); ++i) {
      const auto off = static_cast<std::ptrdiff_t>(z_.flat_offset(i));
      out[i].assign(flat.begin() + off, flat.begin() + off + static_cast<std::ptrdiff_t>(z_.numel(i)));
    }
    return out;
  }

  step_report step() override { return z_.step(); }
  void set_lr(double lr) override {
    auto o = z_.options();
    o.lr = lr;
    z_.set_options(o);
  }
  double loss_scale() const override { return z_.loss_scale(); }
  memory_report memory() const override { return z_.memory(); }

 private:
  any_communicator comm_;  // before z_, which keeps a reference to it
  core_spec spec_;
  ZeroOptimizer<Policy, Opt, stage<N>, any_communicator, host_backend, Offload> z_;
};

using factory = std::unique_ptr<zero_core> (*)(any_communicator, std::span<const std::uint64_t>,
                                               const optimizer_config&, const zero_options&);
struct row {
  core_spec spec;
  factory make;
};

template <class Policy, class Opt, int N, class Offload = offload_none>
row make_row() {
  return row{spec_of<Policy, Opt, N, Offload>(),
             [](any_communicator c, std::span<const std::uint64_t> numels, const optimizer_config& o,
                const zero_options& zo) -> std::unique_ptr<zero_core> {
               return std::make_unique<core_impl<Policy, Opt, N, Offload>>(std::move(c), numels, o, zo);
             }};
}

template <class Policy, class Opt>
void add_stages(std::vector<row>& t) {
  t.push_back(make_row<Policy, Opt, 0>());
  t.push_back(make_row<Policy, Opt, 1>());
  t.push_back(make_row<Policy, Opt, 2>());
}

template <class Policy>
void add_optimizers(std::vector<row>& t) {
  add_stages<Policy, optim::adam>(t);
  add_stages<Policy, optim::adamw>(t);
}

// CPU offload (ZeRO-Offload) needs a partition: stages 1 and 2.
template <class Policy>
void add_offload(std::vector<row>& t) {
  t.push_back(make_row<Policy, optim::adam, 1, offload_cpu>());
  t.push_back(make_row<Policy, optim::adam, 2, offload_cpu>());
  t.push_back(make_row<Policy, optim::adamw, 1, offload_cpu>());
  t.push_back(make_row<Policy, optim::adamw, 2, offload_cpu>());
}

// The compiled set: what DeepSpeed's bf16/fp16 sections and data_types.grad_accum_dtype
// can select, with Adam and AdamW, ZeRO stages 0-2.
const std::vector<row>& table() {
  static const std::vector<row> t = [] {
    std::vector<row> v;
    add_optimizers<policies::fp32>(v);
    add_optimizers<policies::bf16_fp32_master>(v);
    add_optimizers<precision<bf16, float, float, float>>(v);  // bf16 model, fp32 gradient accumulation
    add_optimizers<policies::bf16_master_fp32_states>(v);
    add_optimizers<policies::bf16_all>(v);
    add_optimizers<policies::bf16_all_sr>(v);
    add_optimizers<policies::fp16_fp32_master>(v);
    add_optimizers<precision<fp16, fp16, fp16, float>>(v);  // fp16 master weights and gradients
    add_offload<policies::fp32>(v);
    add_offload<policies::bf16_fp32_master>(v);
    add_offload<policies::bf16_master_fp32_states>(v);  // DeepSpeed allows this one only with offload
    add_offload<policies::bf16_all>(v);
    add_offload<policies::bf16_all_sr>(v);
    add_offload<policies::fp16_fp32_master>(v);
    return v;
  }();
  return t;
}

}  // namespace

std::string core_spec::describe() const {
  return "param " + std::string(name_of(param)) + ", master " + std::string(name_of(master)) + ", grad " +
         std::string(name_of(grad)) + ", state " + std::string(name_of(state)) + ", " +
         (stochastic_rounding ? "stochastic" : "nearest") + " rounding, " + std::string(optimizer_name(optimizer)) +
         ", ZeRO stage " + std::to_string(stage) + (offload ? ", CPU offload" : "");
}

std::vector<core_spec> compiled_cores() {
  std::vector<core_spec> out;
  for (const row& r : table()) out.push_back(r.spec);
  return out;
}

std::unique_ptr<zero_core> make_zero_core(const core_spec& spec, any_communicator comm,
                                          std::span<const std::uint64_t> numels, const optimizer_config& opt,
                                          const zero_options& zo) {
  for (const row& r : table())
    if (r.spec == spec) return r.make(std::move(comm), numels, opt, zo);
  std::string msg = "mpzero::torch: the configuration selects (" + spec.describe() +
                    "), which is not compiled into this build of the LibTorch adapter. Compiled:";
  for (const row& r : table()) msg += "\n  " + r.spec.describe();
  msg += "\nChange the config to one of these, or add the combination to the table in adapters/torch/src/zero_core.cpp";
  throw config_error(msg);
}

}  // namespace mpzero::torch

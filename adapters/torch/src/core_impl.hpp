// The ZeroOptimizer behind mpzero::torch::zero_core, for any backend, and the list of
// compiled combinations (add_table_part): shared by the host table (host_row.hpp, g++) and
// the CUDA table (cuda_row.cuh, nvcc). Private to the adapter. Torch-free.
//
// Context: what the backend needs beyond the optimizer. It provides
//   Context::backend_type backend() const     the backend the optimizer runs on
//   Context::scope (constructible from const Context&)  held by every call (e.g. selects
//                                             the core's CUDA device)
//   void wait_stream(void*), join_stream(void*)  zero_core's stream ordering
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpzero/optim/optimizer.hpp>
#include <mpzero/policy/precision.hpp>
#include <mpzero/torch/zero_core.hpp>

namespace mpzero::torch::detail {

// The optimizer a core of rule Opt runs under config c: its type, which for
// optim::adam_runtime (the Adam and AdamW rows share it; the tables have no static Adam
// or AdamW rows) is the config's.
template <class Opt>
optimizer_type optimizer_of(const optimizer_config& c) {
  if constexpr (std::is_same_v<Opt, optim::adam_runtime>) {
    if (c.type != optimizer_type::adam && c.type != optimizer_type::adamw) {
      throw config_error("mpzero::torch: internal error: an Adam/AdamW core was made for another optimizer type");
    }
    return c.type;
  } else if constexpr (std::is_same_v<Opt, optim::sgd>) {
    return optimizer_type::sgd;
  } else {
    static_assert(std::is_same_v<Opt, optim::lion>, "optimizer_of: a table row's rule is adam_runtime, sgd or lion");
    return optimizer_type::lion;
  }
}

template <class Opt>
typename Opt::options options_of(const optimizer_config& c) {
  typename Opt::options o;
  if constexpr (std::is_same_v<Opt, optim::adam_runtime>) {
    o.lr = c.lr, o.beta1 = c.beta1, o.beta2 = c.beta2, o.eps = c.eps, o.weight_decay = c.weight_decay;
    o.bias_correction = c.bias_correction;
    o.decoupled_weight_decay = c.type == optimizer_type::adamw;
  } else if constexpr (std::is_same_v<Opt, optim::sgd>) {
    o.lr = c.lr, o.momentum = c.momentum, o.dampening = c.dampening, o.weight_decay = c.weight_decay;
    o.nesterov = c.nesterov;
  } else {
    o.lr = c.lr, o.beta1 = c.beta1, o.beta2 = c.beta2, o.weight_decay = c.weight_decay;
  }
  return o;
}

template <class Policy, int N, class Offload>
constexpr core_spec spec_of(optimizer_type optimizer, core_device device) {
  return core_spec{Policy::param_dtype,         Policy::master_dtype, Policy::grad_dtype, Policy::state_dtype,
                   Policy::stochastic_rounding, optimizer,            N,
                   Offload::value == offload_kind::cpu, device};
}

// Calls f(static_cast<const T*>(p)) with T the storage type named by t (the engine
// passes only the three dtypes it maps from torch's).
template <class F>
void with_storage(dtype t, const void* p, F&& f) {
  visit_dtype(t, [&]<class T>(T*) { f(static_cast<const T*>(p)); });
}

template <class Policy, class Opt, int N, class Offload, class Context>
class core_impl final : public zero_core {
  using backend_type = typename Context::backend_type;
  static constexpr bool device_memory = backend_type::device_memory;

 public:
  core_impl(core_device device, Context ctx, any_communicator comm, std::span<const std::uint64_t> numels,
            const optimizer_config& opt, const zero_options& zo)
      : ctx_(std::move(ctx)), comm_(std::move(comm)), spec_(spec_of<Policy, N, Offload>(optimizer_of<Opt>(opt), device)) {
    typename Context::scope s(ctx_);
    backend_ = ctx_.backend();
    z_.emplace(comm_, numels, options_of<Opt>(opt), zo, backend_);
  }
  ~core_impl() override {
    typename Context::scope s(ctx_);
    z_.reset();  // frees device memory with the core's device current
  }

  const core_spec& spec() const noexcept override { return spec_; }

  void* param_data(std::size_t i) override { return z_->param(i).data(); }
  bool partitioned(std::size_t i) const override {
    if constexpr (N < 3) {
      return false;
    } else {
      return z_->numel(i) > 0 && !z_->is_persistent(i);
    }
  }
  void gather(std::size_t first, std::size_t end) override {
    stage3("gather", [&](auto& z) { z.gather(first, end); });
  }
  void prefetch(std::size_t first, std::size_t end) override {
    stage3("prefetch", [&](auto& z) { z.prefetch(first, end); });
  }
  void release(std::size_t first, std::size_t end) override {
    stage3("release", [&](auto& z) { z.release(first, end); });
  }
  void load_param(std::size_t i, const void* values, dtype t) override {
    typename Context::scope s(ctx_);
    with_storage(t, values, [&]<class T>(const T* p) {
      if constexpr (device_memory) {
        auto staged = backend_.template allocate<T>(z_->numel(i));
        backend_.upload(staged.data(), p, z_->numel(i));
        z_->load_param(i, staged.data());
        backend_.synchronize();  // `staged` is freed next
      } else {
        z_->load_param(i, p);
      }
    });
  }
  void broadcast(float* values, std::uint64_t n, int root) override {
    if (comm_.size() == 1 || n == 0) return;
    typename Context::scope s(ctx_);
    // Device communicators (NCCL) read device memory: the CUDA backend stages the values
    // through a small device buffer, a piece at a time (not the whole model at once).
    backend_.broadcast_host(comm_, values, n, root);
  }
  void accumulate_grad(std::size_t i, const void* src, dtype t, float scale) override {
    typename Context::scope s(ctx_);
    with_storage(t, src, [&](auto* p) { z_->accumulate_grad(i, p, scale); });
  }
  void end_backward() override {
    typename Context::scope s(ctx_);
    z_->end_backward();
  }
  void zero_grad() override {
    typename Context::scope s(ctx_);
    z_->zero_grad();
  }
  std::vector<float> full_grad(std::size_t i) override {
    typename Context::scope s(ctx_);
    return z_->full_grad(i);
  }

  std::vector<std::vector<float>> full_master() override {
    typename Context::scope s(ctx_);
    std::vector<float> flat(static_cast<std::size_t>(z_->layout().padded_numel()), 0.0f);
    z_->read_master_shard([&](std::uint64_t k, float v) { flat[static_cast<std::size_t>(k)] = v; });
    // Each element has one owner above stage 0 (the others hold +0): the sum is exact.
    if (N > 0 && comm_.size() > 1) backend_.all_reduce_host(comm_, flat.data(), flat.size(), comm::reduce_op::sum);
    std::vector<std::vector<float>> out(z_->num_params());
    for (std::size_t i = 0; i < out.size(); ++i) {
      const auto off = static_cast<std::ptrdiff_t>(z_->flat_offset(i));
      out[i].assign(flat.begin() + off, flat.begin() + off + static_cast<std::ptrdiff_t>(z_->numel(i)));
    }
    return out;
  }

  std::uint64_t save_checkpoint(const std::string& dir) override {
    typename Context::scope s(ctx_);
    return z_->save_checkpoint(dir);
  }
  void load_checkpoint(const std::string& dir) override {
    typename Context::scope s(ctx_);
    z_->load_checkpoint(dir);
  }
  bool grads_pending() const override { return z_->grads_pending(); }

  step_report step() override {
    typename Context::scope s(ctx_);
    return z_->step();
  }
  void set_lr(double lr) override {
    auto o = z_->options();
    o.lr = lr;
    z_->set_options(o);
  }
  double loss_scale() const override { return z_->loss_scale(); }
  memory_report memory() const override { return z_->memory(); }
  void wait_stream(void* stream) override { ctx_.wait_stream(stream); }
  void join_stream(void* stream) override { ctx_.join_stream(stream); }

 private:
  // f(optimizer) under the core's scope at stage 3; below it, an error naming `what`
  // (the optimizer has no gathers: its parameters are whole on every rank).
  template <class F>
  void stage3(const char* what, F&& f) {
    if constexpr (N < 3) {
      throw mpzero::error(std::string("mpzero::torch: zero_core::") + what + " gathers ZeRO-3 parameters; this core is " +
                          "stage " + std::to_string(N) + ", whose parameters are whole on every rank");
    } else {
      typename Context::scope s(ctx_);
      f(*z_);
    }
  }

  Context ctx_;
  any_communicator comm_;  // before z_, which keeps a reference to it
  core_spec spec_;
  backend_type backend_{};
  std::optional<ZeroOptimizer<Policy, Opt, stage<N>, any_communicator, backend_type, Offload>> z_;
};

using core_factory = std::unique_ptr<zero_core> (*)(const core_place&, any_communicator, std::span<const std::uint64_t>,
                                                    const optimizer_config&, const zero_options&);
// The largest of each value over the ranks, in place, with no core (mpzero::torch::
// max_over_ranks): the same function in every row of a table.
using core_agreement = void (*)(const core_place&, any_communicator&, std::span<std::int32_t>);
struct core_row {
  core_spec spec;
  core_factory make;
  core_agreement max_over_ranks;
};

// ---- the policies a build compiles (CMake's MPZERO_TORCH_POLICIES) ----------------------
// Bit i of MPZERO_TORCH_POLICY_MASK selects table_policies[i]; torch.cmake derives it from
// MPZERO_TORCH_POLICIES ("all", the default, or a list of these names), so that a project
// that uses one or two policies need not compile the others.
#ifndef MPZERO_TORCH_POLICY_MASK
#error "MPZERO_TORCH_POLICY_MASK (the policies the tables compile) is defined by adapters/torch/torch.cmake"
#endif
inline constexpr unsigned table_policy_mask = MPZERO_TORCH_POLICY_MASK;

struct table_policy {
  const char* name;  // as MPZERO_TORCH_POLICIES names it: the policies:: type's name
  core_spec spec;  // its dtypes and rounding (the other fields are left at their defaults)
};
template <class Policy>
constexpr core_spec policy_spec() {
  return spec_of<Policy, 0, offload_none>(optimizer_type::adamw, core_device::cpu);
}
inline constexpr table_policy table_policies[] = {
    {"fp32", policy_spec<policies::fp32>()},
    {"bf16_fp32_grads", policy_spec<policies::bf16_fp32_grads>()},
    {"bf16_fp32_master", policy_spec<policies::bf16_fp32_master>()},
    {"bf16_master_fp32_states", policy_spec<policies::bf16_master_fp32_states>()},
    {"bf16_all", policy_spec<policies::bf16_all>()},
    {"bf16_all_sr", policy_spec<policies::bf16_all_sr>()},
    {"fp16_fp32_master", policy_spec<policies::fp16_fp32_master>()},
    {"fp16_master_fp32_states", policy_spec<policies::fp16_master_fp32_states>()},
};
static_assert(
    [] {
      for (std::size_t a = 0; a < std::size(table_policies); ++a) {
        for (std::size_t b = a + 1; b < std::size(table_policies); ++b) {
          if (table_policies[a].spec == table_policies[b].spec) return false;
        }
      }
      return true;
    }(),
    "two entries of table_policies have the same dtypes and rounding: list each policy once");
static_assert(table_policy_mask != 0 && table_policy_mask < (1u << std::size(table_policies)),
              "MPZERO_TORCH_POLICY_MASK selects no policy, or one past table_policies: see torch.cmake");

// Whether the build compiles Policy: its bit, found by its entry in table_policies (one
// list of the policies and their order, which torch.cmake's names follow). The entry is
// found by its spec (the policy's dtypes and rounding, which tell policies apart), not by
// comparing addresses: g++ does not fold an address comparison in a constant expression
// under -fsanitize=undefined, and a trainer built so would not compile.
template <class Policy>
constexpr bool policy_selected() {
  constexpr std::size_t i = [] {
    std::size_t k = 0;
    while (k < std::size(table_policies) && table_policies[k].spec != policy_spec<Policy>()) ++k;
    return k;
  }();
  static_assert(i < std::size(table_policies), "add_table_part names a policy that table_policies does not list: add "
                                               "it there and to torch.cmake's MPZERO_TORCH_POLICIES names");
  return ((table_policy_mask >> i) & 1u) != 0;
}

// A table's rows for one precision policy: Adam (L2 decay) and AdamW at stages 0-3, and,
// when WithOffload, CPU offload at stages 1-3 (offload needs a partition); none when the
// build leaves the policy out (MPZERO_TORCH_POLICIES). The Adam and AdamW rows of a
// (stage, offload) share one core, optim::adam_runtime, which takes the kind of decay
// from the config: one ZeroOptimizer instantiation for both, which is most of a table
// unit's compile time (docs/perf.md, session 25).
// Row<Policy, Opt, Stage, Offload>::make(type) makes the row that serves optimizer `type`.
template <class Policy, template <class, class, int, class> class Row, bool WithOffload>
void add_policy(std::vector<core_row>& t) {
  if constexpr (policy_selected<Policy>()) {  // not `return` when left out: nothing of it is instantiated
    using Opt = optim::adam_runtime;
    for (const optimizer_type type : {optimizer_type::adam, optimizer_type::adamw}) {
      t.push_back(Row<Policy, Opt, 0, offload_none>::make(type));
      t.push_back(Row<Policy, Opt, 1, offload_none>::make(type));
      t.push_back(Row<Policy, Opt, 2, offload_none>::make(type));
      t.push_back(Row<Policy, Opt, 3, offload_none>::make(type));
      if constexpr (WithOffload) {
        t.push_back(Row<Policy, Opt, 1, offload_cpu>::make(type));
        t.push_back(Row<Policy, Opt, 2, offload_cpu>::make(type));
        t.push_back(Row<Policy, Opt, 3, offload_cpu>::make(type));
      }
    }
  }
}

// ---- the compiled set -------------------------------------------------------------------
// Both tables compile the same combinations (CPU and CUDA parameters get the same
// choices): what DeepSpeed's bf16/fp16 sections, data_types.grad_accum_dtype and
// adam_w_mode can select, with Adam (L2) and AdamW, ZeRO stages 0-3, and CPU offload at
// stages 1-3 where it applies. Build time is the constraint: every policy costs a
// ZeroOptimizer per (stage, offload), one fused step (a CUDA kernel on the CUDA side) and,
// with offload, a vectorized host step. So each table is split into parts, one generated
// translation unit per part and table (torch.cmake writes them from src/table_part.in),
// which a parallel build compiles side by side. To add a combination, add it to a part
// here.
#ifndef MPZERO_TORCH_TABLE_PARTS
#error "MPZERO_TORCH_TABLE_PARTS (the number of generated table units) is defined by adapters/torch/torch.cmake"
#endif
inline constexpr int table_parts = MPZERO_TORCH_TABLE_PARTS;
static_assert(table_parts == 4,
              "add_table_part lists 4 parts and torch.cmake generates MPZERO_TORCH_TABLE_PARTS units: change both");

template <int Part, template <class, class, int, class> class Row>
void add_table_part(std::vector<core_row>& t) {
  if constexpr (Part == 0) {
    add_policy<policies::fp32, Row, true>(t);
    add_policy<policies::bf16_fp32_grads, Row, false>(t);  // DeepSpeed: grad_accum_dtype fp32 (no offload)
  } else if constexpr (Part == 1) {
    add_policy<policies::bf16_fp32_master, Row, true>(t);
    add_policy<policies::bf16_master_fp32_states, Row, true>(t);  // DeepSpeed: only with offload
  } else if constexpr (Part == 2) {
    add_policy<policies::bf16_all, Row, true>(t);
    add_policy<policies::bf16_all_sr, Row, true>(t);
  } else {
    static_assert(Part == 3, "add_table_part: no such part");
    add_policy<policies::fp16_fp32_master, Row, true>(t);
    add_policy<policies::fp16_master_fp32_states, Row, true>(t);  // DeepSpeed allows it with offload
  }
}

// Part `Part` of the host / CUDA table. Defined in host_row.hpp / cuda_row.cuh and
// instantiated once each by the generated units; zero_core.cpp concatenates the parts.
template <int Part>
void add_host_part(std::vector<core_row>& t);
template <int Part>
void add_cuda_part(std::vector<core_row>& t);

}  // namespace mpzero::torch::detail

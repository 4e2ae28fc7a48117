// mpzero::torch::zero_core: the engine's run-time ZeRO core, its device context and step
// kernel chosen from a core_spec. Torch-free (plain g++); the CUDA parts come from
// cuda_cores.cu.
#include <mpzero/torch/zero_core.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include <mpzero/backend/adapter.hpp>
#include <mpzero/backend/host_backend.hpp>
#include <mpzero/policy/policy_list.hpp>
#include <mpzero/zero/core.hpp>

#include "step_kernels.hpp"
#ifdef MPZERO_TORCH_CUDA
#include "cuda_cores.hpp"
#endif

namespace mpzero::torch {

namespace {

// ZeRO-Offload on CUDA parameters: the device kernel's steps on the device, the host
// kernel's on the host, one set of hyperparameters.
class offload_kernel final : public step_kernel {
 public:
  offload_kernel(std::unique_ptr<step_kernel> device, std::unique_ptr<step_kernel> host)
      : device_(std::move(device)), host_(std::move(host)) {}
  void validate(const param_group_options& group) const override { device_->validate(group); }
  precision_spec precision() const noexcept override { return device_->precision(); }
  int n_states() const noexcept override { return device_->n_states(); }
  std::string_view optimizer_name() const noexcept override { return device_->optimizer_name(); }
  double lr() const noexcept override { return device_->lr(); }
  void set_lr(double lr) override {
    device_->set_lr(lr);
    host_->set_lr(lr);
  }
  std::optional<std::pair<double, double>> betas() const noexcept override { return device_->betas(); }
  void set_betas(double beta1, double beta2) override {
    device_->set_betas(beta1, beta2);
    host_->set_betas(beta1, beta2);
  }
  std::unique_ptr<stepper> make_stepper(std::vector<step_buffers> tensors, bool on_host, int host_threads,
                                        const param_group_options& group) const override {
    return (on_host ? host_ : device_)->make_stepper(std::move(tensors), on_host, host_threads, group);
  }

 private:
  std::unique_ptr<step_kernel> device_, host_;
};

// The communicator a host core uses: `c`, unless it reads device memory (NCCL, a c10d
// group on a CUDA device), which the core would hand host pointers: refused by name
// before the core's own, more general check.
any_communicator host_communicator(any_communicator c) {
  if (!c.base().reads_device_memory()) return c;
  throw config_error("mpzero::torch: the parameters are on the CPU, but the communicator '" + c.name() +
                     "' reads device memory. Move the model to its GPU first (model->to(torch::kCUDA)), or pass a "
                     "host communicator: mpzero::comm::mpi_communicator, or "
                     "mpzero::torch::process_group_communicator(group, torch::kCPU) over a Gloo group");
}

#ifndef MPZERO_TORCH_CUDA
[[noreturn]] void no_cuda_cores() {
  throw config_error("mpzero::torch: the model's parameters are on a CUDA device, but this build of the LibTorch "
                     "adapter has no CUDA cores. Rebuild with nvcc found and MPZERO_TORCH_CUDA=ON (a CUDA build of "
                     "LibTorch, e.g. PyPI's default torch wheel), or move the model to the CPU");
}
#endif

precision_spec precision_of(const core_spec& s) {
  return {s.param, s.master, s.grad, s.state, s.stochastic_rounding};
}

}  // namespace

struct zero_core::scope {
  explicit scope(const core_context& c) : c_(c), previous_(c.enter()) {}
  ~scope() { c_.leave(previous_); }
  scope(const scope&) = delete;
  scope& operator=(const scope&) = delete;
  const core_context& c_;
  int previous_;
};

zero_core::zero_core(const core_spec& spec, std::unique_ptr<core_context> ctx, std::unique_ptr<mpzero::zero_core> core)
    : spec_(spec), ctx_(std::move(ctx)), z_(std::move(core)) {}

zero_core::~zero_core() {
  scope s(*ctx_);
  z_.reset();  // frees device memory with the core's device current
}

void* zero_core::param_data(std::size_t i) { return z_->param(i); }
dtype zero_core::param_data_dtype(std::size_t i) const { return z_->param_dtype(i); }
bool zero_core::partitioned(std::size_t i) const { return z_->partitioned(i); }
void zero_core::gather(std::size_t first, std::size_t end, bool in_param_dtype) {
  scope s(*ctx_);
  z_->gather(first, end, in_param_dtype);
}
void zero_core::prefetch(std::size_t first, std::size_t end, bool in_param_dtype) {
  scope s(*ctx_);
  z_->prefetch(first, end, in_param_dtype);
}
void zero_core::release(std::size_t first, std::size_t end) {
  scope s(*ctx_);
  z_->release(first, end);
}

void zero_core::load_param(std::size_t i, const void* values, dtype t) {
  scope s(*ctx_);
  backend_base& be = z_->backend();
  if (!be.device_memory()) return z_->load_param(i, values, t);
  raw_buffer staged = be.allocate(t, z_->numel(i));
  be.upload(staged.data(), values, staged.bytes());
  z_->load_param(i, staged.data(), t);
  be.synchronize();  // `staged` is freed next
}

void zero_core::broadcast(float* values, std::uint64_t n, int root) {
  if (z_->communicator().size() == 1 || n == 0) return;
  scope s(*ctx_);
  // Device communicators (NCCL) read device memory: the CUDA backend stages the values
  // through a small device buffer, a piece at a time (not the whole model at once).
  z_->backend().broadcast_host(z_->communicator(), values, n, root);
}

void zero_core::accumulate_grad(std::size_t i, const void* src, dtype t, float scale) {
  scope s(*ctx_);
  z_->accumulate_grad(i, src, t, scale);
}
void zero_core::end_backward() {
  scope s(*ctx_);
  z_->end_backward();
}
void zero_core::zero_grad() {
  scope s(*ctx_);
  z_->zero_grad();
}
std::vector<float> zero_core::full_grad(std::size_t i) {
  scope s(*ctx_);
  return z_->full_grad(i);
}

std::vector<std::vector<float>> zero_core::full_master() {
  scope s(*ctx_);
  std::vector<float> flat(static_cast<std::size_t>(z_->layout().padded_numel()), 0.0f);
  z_->read_master_shard([&](std::uint64_t k, float v) { flat[static_cast<std::size_t>(k)] = v; });
  // Each element has one owner above stage 0 (the others hold +0): the sum is exact.
  if (spec_.stage > 0 && z_->communicator().size() > 1)
    z_->backend().all_reduce_host(z_->communicator(), flat.data(), flat.size(), comm::reduce_op::sum);
  std::vector<std::vector<float>> out(z_->num_params());
  for (std::size_t i = 0; i < out.size(); ++i) {
    const auto off = static_cast<std::ptrdiff_t>(z_->flat_offset(i));
    out[i].assign(flat.begin() + off, flat.begin() + off + static_cast<std::ptrdiff_t>(z_->numel(i)));
  }
  return out;
}

std::uint64_t zero_core::save_checkpoint(const std::string& dir) {
  scope s(*ctx_);
  return z_->save_checkpoint(dir);
}
std::uint32_t zero_core::load_checkpoint(const std::string& dir) {
  scope s(*ctx_);
  z_->load_checkpoint(dir);
  return z_->loaded_rounding_stream();
}
bool zero_core::grads_pending() const { return z_->grads_pending(); }

step_report zero_core::step() {
  scope s(*ctx_);
  return z_->step();
}
void zero_core::set_tensor_parallel(any_communicator tp, const std::vector<bool>& split) {
  z_->set_tensor_parallel(std::move(tp), split);
}
void zero_core::set_lr(double lr) { z_->kernel().set_lr(lr); }
std::optional<std::pair<double, double>> zero_core::betas() const { return z_->kernel().betas(); }
void zero_core::set_betas(double beta1, double beta2) { z_->kernel().set_betas(beta1, beta2); }
double zero_core::loss_scale() const { return z_->loss_scale(); }
memory_report zero_core::memory() const { return z_->memory(); }

core_plan plan_core(const config& cfg, core_device device, std::span<const dtype> wire) {
  core_plan p;
  core_spec& spec = p.spec;
  spec.param = cfg.param_dtype();
  spec.master = cfg.master_dtype();
  spec.grad = cfg.grad_dtype();
  spec.state = cfg.state_dtype();
  spec.stochastic_rounding = cfg.stochastic_rounding();
  spec.optimizer = cfg.optimizer.type;
  spec.stage = cfg.zero.stage;
  spec.offload = cfg.zero.offload_optimizer == offload_device::cpu;
  spec.device = device;
  zero_options& zo = p.zo;
  zo.reduce_bucket_numel = std::max<std::uint64_t>(1, cfg.zero.reduce_bucket_size);
  zo.param_persistence_threshold = cfg.zero.stage3_param_persistence_threshold;
  zo.gradient_clipping = cfg.gradient_clipping;
  zo.loss_scaling = cfg.loss_scaling();
  zo.loss_scale = cfg.loss_scaler;
  zo.check_overflow = cfg.fp16 || !cfg.bf16 || cfg.check_grad_overflow;
  zo.average_gradients = true;
  zo.seed = cfg.seed;
  zo.pin_memory = cfg.zero.offload_pin_memory;
  if (cfg.zero.sub_group_size) zo.offload_sub_group_numel = *cfg.zero.sub_group_size;
  // All in the gradient dtype is the core's default path (no list).
  if (std::any_of(wire.begin(), wire.end(), [&](dtype d) { return d != spec.grad; })) {
    zo.wire_dtypes.assign(wire.begin(), wire.end());
  }
  return p;
}

std::string core_spec::describe() const {
  return precision_of(*this).describe() + ", " + std::string(optimizer_name(optimizer)) + ", ZeRO stage " +
         std::to_string(stage) + (offload ? ", CPU offload" : "") + (device == core_device::cuda ? ", CUDA" : "");
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
  for (const core_device d : {core_device::cpu, core_device::cuda}) {
    if (d == core_device::cuda && !cuda_cores_compiled()) continue;
    for (const named_policy& p : named_policies) {
      for (const optimizer_type o : {optimizer_type::adam, optimizer_type::adamw, optimizer_type::sgd, optimizer_type::lion}) {
        for (int stage = 0; stage <= 3; ++stage) {
          for (const bool offload : {false, true}) {
            if (offload && stage == 0) continue;
            const precision_spec& q = p.spec;
            out.push_back(core_spec{q.param, q.master, q.grad, q.state, q.stochastic_rounding, o, stage, offload, d});
          }
        }
      }
    }
  }
  return out;
}

void max_over_ranks(any_communicator comm, std::span<std::int32_t> v, const core_place& place) {
  if (comm.size() == 1 || v.empty()) return;
  if (!comm.base().reads_device_memory()) {
    backend_adapter<host_backend>{}.all_reduce_host(comm, v.data(), v.size(), comm::reduce_op::max);
    return;
  }
#ifdef MPZERO_TORCH_CUDA
  detail::cuda_max_over_ranks(place, comm, v);
#else
  (void)place;
  throw config_error("mpzero::torch: the communicator '" + comm.name() +
                     "' reads device memory, but this build of the LibTorch adapter has no CUDA cores. Rebuild "
                     "with nvcc found and MPZERO_TORCH_CUDA=ON, or pass a host communicator (MPI, Gloo)");
#endif
}

std::unique_ptr<zero_core> make_zero_core(const core_spec& spec, any_communicator comm,
                                          std::span<const std::uint64_t> numels, const optimizer_config& opt,
                                          const zero_options& zo, const core_place& place) {
  const precision_spec p = precision_of(spec);
  if (find_policy(p) == nullptr) {
    std::string names;
    for (const named_policy& n : named_policies) names += std::string(names.empty() ? "" : ", ") + std::string(n.name);
    throw config_error("mpzero::torch: the configuration selects (" + spec.describe() +
                       "), whose precision is none of the named policies: " + names +
                       " (docs/precision.md describes each). Change the config's bf16/fp16 sections or "
                       "data_types to select one of them");
  }
  const zero_spec zs{p, spec.stage, spec.offload, p.grad};
  zs.validate();
  std::unique_ptr<core_context> ctx;
  std::unique_ptr<backend_base> backend;
  std::unique_ptr<step_kernel> kernel;
  if (spec.device == core_device::cuda) {
#ifdef MPZERO_TORCH_CUDA
    detail::cuda_parts parts = detail::make_cuda_parts(place, p, opt, std::move(comm));
    ctx = std::move(parts.context);
    backend = std::move(parts.backend);
    kernel = spec.offload ? std::make_unique<offload_kernel>(std::move(parts.kernel), detail::make_host_kernel(p, opt))
                          : std::move(parts.kernel);
    comm = std::move(parts.comm);
#else
    (void)place;  // where a CUDA core would run; this build has none
    no_cuda_cores();
#endif
  } else {
    comm = host_communicator(std::move(comm));
    ctx = std::make_unique<core_context>();
    backend = std::make_unique<backend_adapter<host_backend>>();
    kernel = detail::make_host_kernel(p, opt);
  }
  const int previous = ctx->enter();
  std::unique_ptr<mpzero::zero_core> z;
  try {
    z = std::make_unique<mpzero::zero_core>(std::move(comm), std::move(backend),
                                            std::make_unique<backend_adapter<host_backend>>(), std::move(kernel), zs,
                                            numels, zo);
  } catch (...) {
    ctx->leave(previous);
    throw;
  }
  ctx->leave(previous);
  return std::make_unique<zero_core>(spec, std::move(ctx), std::move(z));
}

}  // namespace mpzero::torch

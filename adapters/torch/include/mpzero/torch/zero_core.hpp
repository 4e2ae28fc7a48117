// mpzero::torch: the ZeRO core the engine runs, chosen at run time.
//
// The engine reads precision, optimizer and ZeRO stage from the JSON config. It runs one
// mpzero::zero_core (the run-time ZeRO core, compiled once per backend) with the one step
// kernel that its precision policy and optimizer select: every named policy
// (policy/policy_list.hpp) with Adam, AdamW, SGD and Lion, at stages 0-3, with CPU
// offload at stages 1-3, on CPU parameters and (built with MPZERO_TORCH_CUDA) on CUDA
// ones. zero_core here adds what the engine needs around it: the CUDA device and stream
// of its parameters, parameters loaded from host memory, and whole-model reads.
//
// Pointers are in the core's memory (host memory for a CPU core, device memory of its
// CUDA device otherwise) unless a member says "host". Element types are passed as
// mpzero::dtype values.
//
// Torch-free, and light: the core itself is behind a pointer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mpzero/numeric/dtype.hpp>
#include <mpzero/torch/communicator.hpp>
#include <mpzero/torch/config.hpp>
#include <mpzero/zero/options.hpp>

namespace mpzero {
class zero_core;
}

namespace mpzero::torch {

// Where a core's parameters, gradients and (without offload) optimizer states live.
enum class core_device : std::uint8_t { cpu, cuda };

// What the config selects.
struct core_spec {
  dtype param = dtype::fp32, master = dtype::fp32, grad = dtype::fp32, state = dtype::fp32;
  bool stochastic_rounding = false;
  optimizer_type optimizer = optimizer_type::adamw;
  int stage = 0;
  bool offload = false;  // zero_optimization.offload_optimizer.device = "cpu"
  core_device device = core_device::cpu;

  // e.g. "param bf16, master fp32, grad bf16, state fp32, nearest rounding, AdamW, ZeRO stage 2, CPU offload, CUDA"
  std::string describe() const;
  friend bool operator==(const core_spec&, const core_spec&) = default;
};

// Where a CUDA core runs: its device and the stream its work is ordered on (a
// cudaStream_t; nullptr is the legacy default stream). Ignored for a CPU core.
struct core_place {
  int device = 0;
  void* stream = nullptr;
};

// The device scope and stream ordering of a core (a CUDA core's; nothing for a CPU core).
class core_context {
 public:
  virtual ~core_context() = default;
  // Makes the core's device current; returns what leave() restores.
  virtual int enter() const { return -1; }
  virtual void leave(int previous) const noexcept { (void)previous; }
  // wait_stream(s): the core's later work starts after what stream `s` (a cudaStream_t)
  // has queued so far. join_stream(s): what `s` queues later starts after the core's work
  // so far. Neither blocks the host.
  virtual void wait_stream(void* stream) { (void)stream; }
  virtual void join_stream(void* stream) { (void)stream; }
};

class zero_core {
 public:
  zero_core(const core_spec& spec, std::unique_ptr<core_context> ctx, std::unique_ptr<mpzero::zero_core> core);
  ~zero_core();
  zero_core(const zero_core&) = delete;
  zero_core& operator=(const zero_core&) = delete;

  const core_spec& spec() const noexcept { return spec_; }
  // The run-time core (zero/core.hpp).
  mpzero::zero_core& core() noexcept { return *z_; }

  // Parameter i's storage (spec().param elements), which forward reads and step()
  // updates in place. Stage 3: a partitioned parameter's only while its group is
  // gathered (the pointer changes with every gather); mpzero::error otherwise.
  void* param_data(std::size_t i);
  // The dtype of param_data(i)'s elements: a gathered ZeRO-3 parameter's gather dtype
  // (zero_options::gather_dtypes; torch_autocast's), else spec().param.
  dtype param_data_dtype(std::size_t i) const;
  // ZeRO-3: whether parameter i exists only as shards (stage 3, above the persistence
  // threshold, not empty). False for every parameter at stages 0-2.
  bool partitioned(std::size_t i) const;
  // ZeRO-3: gather (collective), prefetch (collective, without waiting) and release
  // (local) of parameters [first, end); mpzero::error below stage 3. in_param_dtype:
  // in spec().param whatever zero_options::gather_dtypes says.
  void gather(std::size_t first, std::size_t end, bool in_param_dtype = false);
  void prefetch(std::size_t first, std::size_t end, bool in_param_dtype = false);
  void release(std::size_t first, std::size_t end);
  // Sets parameter i (and its master copy) from numel(i) elements of type `t` in host
  // memory. Every rank passes the same values.
  void load_param(std::size_t i, const void* values, dtype t);
  // Broadcasts n floats in host memory from rank `root` through the core's communicator
  // (staged through device memory for a CUDA core: NCCL reads device memory). Collective.
  void broadcast(float* host_values, std::uint64_t n, int root);

  void accumulate_grad(std::size_t i, const void* src, dtype t, float scale);
  void end_backward();
  void zero_grad();
  // Parameter i's reduced, averaged, unscaled gradient (collective).
  std::vector<float> full_grad(std::size_t i);
  // Every parameter's master weights, whole, on every rank (collective).
  std::vector<std::vector<float>> full_master();

  // Checkpoints into / from directory `dir` (collective; a failure throws on every rank,
  // and a failed load changes nothing). save_checkpoint returns the save id its shard
  // files carry; load_checkpoint the stochastic-rounding stream the files record
  // (mpzero::zero_core::loaded_rounding_stream).
  std::uint64_t save_checkpoint(const std::string& dir);
  std::uint32_t load_checkpoint(const std::string& dir);
  // Gradients reported since the last step or zero_grad.
  bool grads_pending() const;

  // AutoTP: the gradient norm sums the split parameters' squares over `tp` (see
  // mpzero::zero_core::set_tensor_parallel).
  void set_tensor_parallel(any_communicator tp, const std::vector<bool>& split);

  step_report step();
  void set_lr(double lr);
  // The optimizer's (beta1, beta2); nullopt for SGD. set_betas validates first.
  std::optional<std::pair<double, double>> betas() const;
  void set_betas(double beta1, double beta2);
  double loss_scale() const;
  memory_report memory() const;

  // See core_context.
  void wait_stream(void* stream) { ctx_->wait_stream(stream); }
  void join_stream(void* stream) { ctx_->join_stream(stream); }

 private:
  struct scope;
  core_spec spec_;
  std::unique_ptr<core_context> ctx_;
  std::unique_ptr<mpzero::zero_core> z_;
};

// What the engine runs for a config: the core's spec and options. A pure function of the
// config, the parameters' device and the dtype each parameter's gradient travels in
// (`wire`, DeepSpeed's get_comm_dtype: the autocast dtype for lower_precision_safe_modules,
// communication_data_type for the others; empty: every gradient in its own dtype).
struct core_plan {
  core_spec spec;
  zero_options zo;
};
core_plan plan_core(const config& cfg, core_device device, std::span<const dtype> wire = {});

// The core for `spec`, or config_error naming what is not available (CUDA parameters in a
// build without the CUDA cores, a precision no named policy has). A CUDA core allocates
// on place.device.
std::unique_ptr<zero_core> make_zero_core(const core_spec& spec, any_communicator comm,
                                          std::span<const std::uint64_t> numels, const optimizer_config& opt,
                                          const zero_options& zo, const core_place& place = {});

// The largest of each of v's values over the ranks of `comm`, in place (collective),
// with no core: how the engine's ranks agree (at initialize, before a core exists, and
// around checkpoints). A host communicator moves host memory; one that reads device memory
// (NCCL, a c10d group on CUDA) gets the values through a small device buffer on
// place.device, ordered on place.stream, and needs the CUDA cores (config_error
// without them). World size 1 returns at once.
void max_over_ranks(any_communicator comm, std::span<std::int32_t> v, const core_place& place = {});

// Whether this build has the CUDA cores (the adapter was built with MPZERO_TORCH_CUDA).
bool cuda_cores_compiled() noexcept;

// Every combination this build runs: each named policy with Adam, AdamW, SGD and Lion,
// at stages 0-3, and CPU offload at stages 1-3; on CPU parameters, and on CUDA ones with
// the CUDA cores.
std::vector<core_spec> compiled_cores();

}  // namespace mpzero::torch

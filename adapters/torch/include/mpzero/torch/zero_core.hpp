// mpzero::torch: a ZeroOptimizer chosen at run time.
//
// The engine reads precision, optimizer and ZeRO stage from the JSON config, so it
// cannot name the ZeroOptimizer type at compile time. zero_core is the virtual face of
// one ZeroOptimizer<Policy, Optimizer, stage<N>, any_communicator, Backend>;
// make_zero_core() picks the instantiation from a finite table: host_backend rows for
// CPU parameters and cuda_backend rows for CUDA ones (built when the adapter is built
// with CUDA: MPZERO_TORCH_CUDA), the same combinations in both (add_table_part in
// src/core_impl.hpp). compiled_cores() lists them. A combination that is not in the
// table is a clear error that names it and lists what is compiled.
//
// Pointers are in the core's memory (host memory for a CPU core, device memory of its
// CUDA device otherwise) unless a member says "host". Element types are passed as
// mpzero::dtype values.
//
// Torch-free: this header and the tables need only the core and the config struct.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <mpzero/numeric/dtype.hpp>
#include <mpzero/torch/communicator.hpp>
#include <mpzero/torch/config.hpp>
#include <mpzero/zero/zero_optimizer.hpp>

namespace mpzero::torch {

// Where a core's parameters, gradients and (without offload) optimizer states live.
enum class core_device : std::uint8_t { cpu, cuda };

// What selects an instantiation.
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

class zero_core {
 public:
  virtual ~zero_core() = default;

  virtual const core_spec& spec() const noexcept = 0;

  // Parameter i's storage (spec().param elements), which forward reads and step()
  // updates in place. Stage 3: a partitioned parameter's only while its group is
  // gathered (the pointer changes with every gather); mpzero::error otherwise.
  virtual void* param_data(std::size_t i) = 0;
  // ZeRO-3: whether parameter i exists only as shards (stage 3, above the persistence
  // threshold, not empty). False for every parameter at stages 0-2.
  virtual bool partitioned(std::size_t i) const = 0;
  // ZeRO-3: ZeroOptimizer::gather (collective) and release (local) of parameters
  // [first, end); a range holds partitioned parameters only where it is gathered.
  // mpzero::error below stage 3.
  virtual void gather(std::size_t first, std::size_t end) = 0;
  virtual void release(std::size_t first, std::size_t end) = 0;
  // ZeRO-3: ZeroOptimizer::prefetch, the all-gather of [first, end) started without
  // waiting (collective); gather of exactly that range waits for it, release drops it.
  virtual void prefetch(std::size_t first, std::size_t end) = 0;
  // Sets parameter i (and its master copy) from numel(i) elements of type `t` in host
  // memory. Every rank passes the same values.
  virtual void load_param(std::size_t i, const void* values, dtype t) = 0;
  // Broadcasts n floats in host memory from rank `root` through the core's communicator
  // (staged through device memory for a CUDA core: NCCL reads device memory). Collective.
  virtual void broadcast(float* host_values, std::uint64_t n, int root) = 0;

  // ZeroOptimizer::accumulate_grad / end_backward / zero_grad.
  virtual void accumulate_grad(std::size_t i, const void* src, dtype t, float scale) = 0;
  virtual void end_backward() = 0;
  virtual void zero_grad() = 0;
  // Parameter i's reduced, averaged, unscaled gradient (collective).
  virtual std::vector<float> full_grad(std::size_t i) = 0;
  // Every parameter's master weights, whole, on every rank (collective).
  virtual std::vector<std::vector<float>> full_master() = 0;

  // ZeroOptimizer::save_checkpoint / load_checkpoint into / from directory `dir`
  // (collective; a failure throws on every rank, and a failed load changes nothing).
  // save_checkpoint returns the save id its shard files carry.
  virtual std::uint64_t save_checkpoint(const std::string& dir) = 0;
  virtual void load_checkpoint(const std::string& dir) = 0;
  // ZeroOptimizer::grads_pending: gradients reported since the last step or zero_grad.
  virtual bool grads_pending() const = 0;

  virtual step_report step() = 0;
  virtual void set_lr(double lr) = 0;
  virtual double loss_scale() const = 0;
  virtual memory_report memory() const = 0;

  // Stream ordering of a CUDA core (no-ops for a CPU core). The core queues its work on
  // the stream it was made with (core_place::stream). wait_stream(s): the core's later
  // work starts after what stream `s` (a cudaStream_t) has queued so far. join_stream(s):
  // what `s` queues later starts after the core's work so far. Neither blocks the host.
  virtual void wait_stream(void* /*stream*/) {}
  virtual void join_stream(void* /*stream*/) {}
};

// Where a CUDA core runs: its device and the stream its work is ordered on (a
// cudaStream_t; nullptr is the legacy default stream). Ignored for a CPU core.
struct core_place {
  int device = 0;
  void* stream = nullptr;
};

// The instantiation for `spec`, or config_error naming it and listing compiled_cores().
// spec.device picks the table; a CUDA core allocates on place.device.
std::unique_ptr<zero_core> make_zero_core(const core_spec& spec, any_communicator comm,
                                          std::span<const std::uint64_t> numels, const optimizer_config& opt,
                                          const zero_options& zo, const core_place& place = {});

// The largest of each of v's values over the ranks of `comm`, in place (collective),
// with no core: how the engine's ranks agree (at initialize, before a core exists, and
// around checkpoints). A host communicator moves host memory; one that reads device memory
// (NCCL, a c10d group on CUDA) gets the values through a small device buffer on
// place.device, ordered on place.stream, and needs the CUDA table (config_error
// without it). World size 1 returns at once.
void max_over_ranks(any_communicator comm, std::span<std::int32_t> v, const core_place& place = {});

// Whether this build has the CUDA table (the adapter was built with MPZERO_TORCH_CUDA).
bool cuda_cores_compiled() noexcept;

// The specs compiled into this build.
std::vector<core_spec> compiled_cores();

}  // namespace mpzero::torch

// mpzero: ZeroOptimizer, ZeRO stages 0-3 over one communicator and one backend, with the
// precision policy, the optimizer rule and the stage as types.
//
// A thin typed facade: the static_asserts refuse a choice that cannot work at compile
// time, and every call goes to the run-time ZeRO core (zero/core.hpp, compiled once
// whatever the types) and one typed step kernel, the fused per-element step of exactly
// this Policy and Optimizer (zero/typed_step_kernel.hpp). The core's comment describes
// the stages and the layout.
//
// During backward, report each gradient with accumulate_grad(); end a backward pass
// with end_backward(); call step() at the accumulation boundary. Gradients of every
// pass and micro-step are summed until step() (or zero_grad()).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/adapter.hpp"
#include "../backend/host_backend.hpp"
#include "../comm/any.hpp"
#include "../comm/communicator.hpp"
#include "../numeric/dtype.hpp"
#include "../optim/optimizer.hpp"
#include "../policy/memory_model.hpp"
#include "../policy/precision.hpp"
#include "../policy/rules.hpp"
#include "../policy/stage.hpp"
#include "core.hpp"
#include "options.hpp"
#include "typed_step_kernel.hpp"

namespace mpzero {

// Offload: offload_none, or offload_cpu (ZeRO-Offload): master weights, optimizer
// states and the rank's gradient partition live in host memory and the step runs on
// the host (OpenMP, the same per-element code); the backend keeps the parameters.
// Wire: the element type gradients travel in (DeepSpeed's communication_data_type);
// by default the gradient type. With another type, buckets are converted before the
// reduction and the results converted back (sums of 16-bit wire types are formed in
// fp32 by the communicators, one rounding per combine). zero_options::wire_dtypes
// chooses the wire dtype per parameter at run time instead (Wire is then only the
// default of an empty list).
template <precision_policy Policy, optim::rule Optimizer, class Stage, comm::communicator Comm,
          class Backend = host_backend, class Offload = offload_none, class Wire = typename Policy::grad_type>
class ZeroOptimizer {
  static_assert(storage_type<Wire>, MPZERO_RULE_WIRE_STORAGE);
  static_assert(!detail::is_16bit_pair<Wire, typename Policy::param_type> &&
                    !detail::is_16bit_pair<Wire, typename Policy::grad_type>,
                MPZERO_RULE_WIRE_MIX);
  static_assert(Offload::value == offload_kind::none || Stage::value >= 1, MPZERO_RULE_OFFLOAD_STAGE);

 public:
  using policy = Policy;
  using optimizer = Optimizer;
  using backend_type = Backend;
  using param_type = typename Policy::param_type;
  using master_type = typename Policy::master_type;
  using grad_type = typename Policy::grad_type;
  using state_type = typename Policy::state_type;
  using wire_type = Wire;
  static constexpr int zero_stage = Stage::value;
  static constexpr int n_states = Optimizer::n_states;
  static constexpr bool offloaded = Offload::value == offload_kind::cpu;
  // The communicator must read device memory when the backend's buffers are device
  // memory, unless the backend says host code can address them (host_addressable: a
  // test double that stages "device" buffers in host memory). The core checks it at
  // construction.
  static constexpr bool needs_device_communicator = Backend::device_memory && !requires {
    requires Backend::host_addressable;
  };

  // The spec of this instantiation: what the core runs.
  static constexpr zero_spec spec{precision_spec_of<Policy>(), zero_stage, offloaded, dtype_of_v<Wire>};

  // Collective over `comm` (one all-reduce of three integers above world size 1): every
  // rank constructs its optimizer at the same point. A rank that fails (a bad option,
  // memory running out) throws why, and the others throw mpzero::error naming it; ranks
  // that pass different numels or layout-, collective- or step-relevant zero_options
  // all throw invalid_argument. (The optimizer's hyperparameters are not compared:
  // set_options may change them later, rank by rank.)
  ZeroOptimizer(Comm& comm, std::span<const std::uint64_t> numels, const typename Optimizer::options& opt,
                const zero_options& zo = {}, Backend backend = {})
      : core_(wrap(comm), std::make_unique<backend_adapter<Backend>>(backend),
              std::make_unique<backend_adapter<host_backend>>(), make_kernel(backend, opt), spec, numels, zo),
        kernel_(static_cast<kernel_type&>(core_.kernel())) {}

  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // ---- parameters -------------------------------------------------------------
  std::size_t num_params() const noexcept { return core_.num_params(); }
  std::uint64_t numel(std::size_t i) const { return core_.numel(i); }
  bool is_persistent(std::size_t i) const { return core_.is_persistent(i); }

  // The parameter's storage, in the backend's memory. Stage 3: only while gathered
  // (or persistent); a gathered parameter is read-only (a copy whose writes are lost,
  // or at world size 1 the partition itself).
  std::span<param_type> param(std::size_t i) {
    void* p = core_.param(i);
    if (core_.param_dtype(i) != dtype_of_v<param_type>) {
      detail::throw_invalid("ZeroOptimizer::param(" + std::to_string(i) + "): the parameter is gathered in " +
                            std::string(name_of(core_.param_dtype(i))) +
                            " (zero_options::gather_dtypes); read it through core().param(i) and "
                            "core().param_dtype(i), or gather its group with in_param_dtype = true");
    }
    return {static_cast<param_type*>(p), static_cast<std::size_t>(core_.numel(i))};
  }

  // Sets a parameter's value (and its master copy) from `values` (host memory for
  // the host backend, device memory otherwise), `numel(i)` elements in any storage
  // type. Every rank calls it with the same values.
  template <storage_type T>
  void load_param(std::size_t i, const T* values) {
    core_.load_param(i, values, dtype_of_v<T>);
  }

  // ---- gradients --------------------------------------------------------------
  // Adds `src` * scale (numel(i) elements, any storage type, backend memory) to
  // parameter i's gradient; scale is e.g. 1 / gradient_accumulation_steps. Stages 2
  // and 3 reduce a bucket once all its parameters have reported in this backward pass
  // and every later bucket has gone.
  template <storage_type S>
  void accumulate_grad(std::size_t i, const S* src, float scale = 1.0f) {
    core_.accumulate_grad(i, src, dtype_of_v<S>, scale);
  }

  // Stages 0 and 1 keep the whole gradient, so it can also be written in place
  // (no copy); the reduction happens at step(). Stages 2 and 3 throw.
  std::span<grad_type> grad(std::size_t i) {
    return {static_cast<grad_type*>(core_.grad(i)), static_cast<std::size_t>(core_.numel(i))};
  }

  // Ends one backward pass: stages 2 and 3 reduce every bucket still pending
  // (parameters that got no gradient count as zero). Collective.
  void end_backward() { core_.end_backward(); }

  // Drops all accumulated gradients. Collective when called during a backward pass at
  // stages 2 and 3: it ends the pass first (end_backward()), whose bucket reductions
  // every rank must join.
  void zero_grad() { core_.zero_grad(); }

  // Finishes the reduction of this step's gradients now (step() does it otherwise):
  // afterwards every rank holds the rank-sum of its shard's gradients, and
  // full_grad() can read them. Collective.
  void reduce_gradients() { core_.reduce_gradients(); }

  // Parameter i's reduced gradient as the optimizer will use it (averaged over ranks
  // if so configured, unscaled by the loss scale, before clipping), in host memory.
  // Reduces first if needed. Collective (pieces live on their owners).
  std::vector<float> full_grad(std::size_t i) { return core_.full_grad(i); }

  // ---- the step -----------------------------------------------------------------
  // Reduces what is left, checks for overflow on all ranks, clips, updates this
  // rank's shard, gathers the parameters (stages 1 and 2) and zeroes the gradients.
  // Collective. Throws loss_scale_error (on every rank) when fp16 training diverges.
  step_report step() { return core_.step(); }

  // ---- ZeRO-3 parameter gathering -----------------------------------------------
  // Makes parameters [first, end) available through param(). prefetch() starts the
  // gather without waiting; gather() waits for it (or does it). Collective.
  // in_param_dtype: in param_type whatever zero_options::gather_dtypes says.
  void prefetch(std::size_t first, std::size_t end, bool in_param_dtype = false) requires(zero_stage == 3) {
    core_.prefetch(first, end, in_param_dtype);
  }
  void gather(std::size_t first, std::size_t end, bool in_param_dtype = false) requires(zero_stage == 3) {
    core_.gather(first, end, in_param_dtype);
  }

  // Frees the gathered copy of [first, end) (after its all-gather, if prefetched).
  //
  // A group whose all-gather fails (its wait throws, in gather() or here) is forgotten all
  // the same before the error leaves: a later gather() of the range posts a new all-gather
  // instead of handing out a copy that may be garbage, or stale after a step(). Its memory
  // is kept until the optimizer goes, since an abandoned collective may still write into it.
  void release(std::size_t first, std::size_t end) requires(zero_stage == 3) { core_.release(first, end); }

  // ---- inspection -----------------------------------------------------------------
  const flat_layout& layout() const noexcept { return core_.layout(); }
  // The flat range of elements whose master weights and states this rank updates.
  flat_range shard() const noexcept { return core_.shard(); }
  std::uint64_t steps() const noexcept { return core_.steps(); }
  // The stochastic-rounding stream recorded by the last loaded checkpoint (0: nearest
  // rounding, a file older than the record, or nothing loaded); see
  // zero_core::loaded_rounding_stream.
  std::uint32_t loaded_rounding_stream() const noexcept { return core_.loaded_rounding_stream(); }
  // Whether gradients were reported since the last step() or zero_grad() (checkpoints
  // refuse to run then: they hold no gradients).
  bool grads_pending() const noexcept { return core_.grads_pending(); }
  double loss_scale() const noexcept { return core_.loss_scale(); }
  const std::optional<loss_scaler>& scaler() const noexcept { return core_.scaler(); }
  const typename Optimizer::options& options() const noexcept { return kernel_.options(); }
  // The threading of the host step (offload: the offloaded step's, which copies the host
  // backend's; otherwise the host backend's).
  host::options host_options() const noexcept { return host::options{core_.host_threads()}; }
  // The optimizer's hyperparameters; parameter groups (zero_options::param_groups) adjust
  // them, so a new lr moves every group's in proportion.
  void set_options(const typename Optimizer::options& o) { kernel_.set_options(o); }
  // Parameter groups (one when zero_options::param_groups is empty) and the lr of group g.
  std::size_t num_groups() const noexcept { return core_.num_groups(); }
  double lr(std::size_t group) const { return core_.lr(group); }
  // Flat element index of parameter i's first element.
  std::uint64_t flat_offset(std::size_t i) const { return core_.flat_offset(i); }

  // Calls out(flat index, value) for the master weights (or state `which`) of this
  // rank's shard, copied to the host. For checkpoints and tests.
  template <class Out>
  void read_master_shard(Out&& out) const {
    core_.read_master_shard(out);
  }
  template <class Out>
  void read_state_shard(int which, Out&& out) const {
    core_.read_state_shard(which, out);
  }

  // ---- checkpoints ------------------------------------------------------------------
  // save_checkpoint(dir) writes what this rank's shard holds: the parameters (so that a
  // resumed run continues bit for bit, stochastic rounding included), the master weights,
  // the optimizer states, the step count and the loss scaler's state; one file per rank
  // that holds a partition, one in all at stage 0 (checkpoint.hpp has the format). The
  // directory must exist. Gradients are not saved: call it between steps (after step()
  // or zero_grad()). load_checkpoint(dir) restores a checkpoint of the same parameters
  // (same sizes, same order) and optimizer family (Adam and AdamW share their states) at
  // any world size, ZeRO stage or precision policy: values are converted, rounding to
  // nearest where a dtype is narrower. Hyperparameters and options are not saved; they
  // are the caller's configuration. Both are collective: a failure on any rank throws on
  // every rank; a failed load changes nothing, and a failed save leaves every file that
  // was there whole (each is written beside its name and renamed into place), though
  // the set of files may then mix two saves, which load_checkpoint detects. A save that
  // succeeds removes the shard files an earlier save at a larger world size left there.
  // save_checkpoint returns the save id every file of this save carries
  // (checkpoint::shard_header::save_id), for callers that write files of their own beside
  // the shards and want a load to tell whether they belong together.
  std::uint64_t save_checkpoint(const std::filesystem::path& dir) { return core_.save_checkpoint(dir); }
  void load_checkpoint(const std::filesystem::path& dir) { core_.load_checkpoint(dir); }

  // Bytes this rank holds (model states, and communication buffers now, at most, and
  // their bound).
  memory_report memory() const { return core_.memory(); }

  // The run-time core this optimizer forwards to.
  zero_core& core() noexcept { return core_; }
  const zero_core& core() const noexcept { return core_; }

 private:
  using kernel_type = typed_step_kernel<Policy, Optimizer, Backend>;

  static comm::any_communicator wrap(Comm& c) {
    if constexpr (std::is_same_v<Comm, comm::any_communicator>) {
      return c;  // copies share the target
    } else {
      return comm::any_communicator::wrap(c);
    }
  }
  static std::unique_ptr<step_kernel> make_kernel(const Backend& b, const typename Optimizer::options& o) {
    return std::make_unique<kernel_type>(b, o);
  }

  zero_core core_;
  kernel_type& kernel_;  // owned by core_
};

}  // namespace mpzero

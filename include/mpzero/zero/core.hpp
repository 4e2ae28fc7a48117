// mpzero: the ZeRO core, compiled once: stages 0-3, CPU offload and every precision
// policy as run-time values of a zero_spec, over a type-erased communicator
// (comm::any_communicator) and backend (backend_base), with the optimizer step behind a
// step_kernel. ZeroOptimizer<Policy, Optimizer, stage<N>, ...> is a typed facade over it;
// the LibTorch engine drives it directly from its JSON config.
//
//   stage 0  every rank keeps everything; gradients are all-reduced at the step.
//   stage 1  master weights and optimizer states are partitioned; gradients are
//            reduce-scattered at the step; updated parameters are all-gathered.
//   stage 2  gradients are partitioned too: they are reduce-scattered in buckets
//            while backward runs, into the owner's partition (at world size 1,
//            accumulated straight into it: no bucket buffers).
//   stage 3  parameters are partitioned too: gather() a group of parameters before
//            use (prefetch() the next one), release() it after; parameters of at
//            most param_persistence_threshold elements stay whole on every rank.
//
// The flat buffers place large parameters first, in the caller's order, then the
// small (persistent) ones; the layout is the same for every stage and world size, so
// an element's global index, which keys stochastic rounding, never changes: stages
// 1-3 give the bits stage 0 gives from the same reduced gradients.
//
// Pointers are in the backend's memory unless a member says "host"; element types are
// dtype values. Members are documented on ZeroOptimizer (zero_optimizer.hpp), which
// forwards to them.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../backend/erased.hpp"
#include "../comm/any.hpp"
#include "../error.hpp"
#include "../numeric/rounding_bits.hpp"
#include "checkpoint.hpp"
#include "clipping.hpp"
#include "core_checkpoint.hpp"
#include "core_gather.hpp"
#include "core_layout.hpp"
#include "core_reducer.hpp"
#include "core_state.hpp"
#include "loss_scaler.hpp"
#include "options.hpp"
#include "spec.hpp"
#include "step_kernel.hpp"

namespace mpzero {

class zero_core {
 public:
  // Collective over `comm` (one all-reduce of three integers above world size 1): every
  // rank constructs its core at the same point. A rank that fails (a bad option, memory
  // running out) throws why, and the others throw mpzero::error naming it; ranks that
  // pass different numels or layout-, collective- or step-relevant options all throw
  // invalid_argument. `host` runs ZeRO-Offload's host side (a host backend adapter).
  zero_core(comm::any_communicator comm, std::unique_ptr<backend_base> backend, std::unique_ptr<backend_base> host,
            std::unique_ptr<step_kernel> kernel, const zero_spec& spec, std::span<const std::uint64_t> numels,
            const zero_options& zo)
      : backend_(std::move(backend)),
        host_backend_(std::move(host)),
        kernel_(std::move(kernel)),
        s_(std::move(comm), *backend_, *host_backend_, spec, zo, kernel_->n_states()),
        reducer_(s_),
        groups_(s_),
        io_(s_) {
    spec.validate();
    if (kernel_->precision() != spec.precision) {
      detail::throw_invalid("ZeroOptimizer: the step kernel's precision (" + kernel_->precision().describe() +
                    ") is not the spec's (" + spec.precision.describe() + ")");
    }
    check_communicator();
    // A communicator that must follow the backend's stream and cannot (a
    // cuda_local_communicator on another stream) says so now, not mid-backward.
    s_.be.before_comm(s_.comm);
    // The rest may fail on some ranks only (a bad option, memory running out): every rank
    // learns of it in one collective, together with whether all ranks passed the same
    // layout and options, so no rank waits in a later collective for one that threw or
    // partitions the model otherwise.
    detail::agree_on_failure_and_identity(
        s_.rank, s_.world, [&](std::int32_t* v, int n) { all_reduce_max(v, n); }, "ZeroOptimizer",
        "no rank made the optimizer", "parameter layouts or options", [&] { return construct(numels); });
  }

  ~zero_core() {
    try {
      wait_uploads();
    } catch (...) {  // a failed device: nothing left to protect
    }
  }

  zero_core(const zero_core&) = delete;
  zero_core& operator=(const zero_core&) = delete;

  // ---- parameters -------------------------------------------------------------
  std::size_t num_params() const noexcept { return s_.num_params(); }
  std::uint64_t numel(std::size_t i) const { return s_.numel(i); }
  bool is_persistent(std::size_t i) const { return s_.layout.offset(s_.slot(i)) >= s_.persistent_begin; }
  // Stage 3, above the persistence threshold and not empty: exists only as shards.
  bool partitioned(std::size_t i) const { return s_.stage() == 3 && numel(i) > 0 && !is_persistent(i); }

  void* param(std::size_t i) {
    const std::size_t sl = s_.slot(i);
    const std::uint64_t off = s_.layout.offset(sl);
    if (s_.stage() < 3 || off >= s_.persistent_begin) return s_.param_ptr(off);
    void* g = groups_.gathered(sl);
    if (g == nullptr) {
      detail::throw_invalid("ZeroOptimizer::param(" + std::to_string(i) +
                    "): the parameter is partitioned (ZeRO stage 3); gather() its group first");
    }
    return g;
  }

  // The dtype of param(i)'s elements: a gathered ZeRO-3 parameter's gather dtype
  // (zero_options::gather_dtypes), else the parameter dtype.
  dtype param_dtype(std::size_t i) const {
    const std::size_t sl = s_.slot(i);
    if (!partitioned(i) || groups_.gathered(sl) == nullptr) return s_.param_t();
    return groups_.gathered_type(sl);
  }

  void load_param(std::size_t i, const void* values, dtype t) {
    groups_.require_none("load_param");
    const std::size_t sl = s_.slot(i);
    check_source(values, i, "load_param");
    if (s_.offloaded()) wait_uploads();  // they read the host master this rewrites
    const flat_range r = s_.layout.param_range(sl);
    const auto src = [&](std::uint64_t flat) { return static_cast<const unsigned char*>(values) + (flat - r.begin) * size_of(t); };
    // The parameter storage this rank keeps.
    if (s_.stage() < 3 || r.begin >= s_.persistent_begin) {
      s_.be.convert(s_.param_ptr(r.begin), s_.param_t(), values, t, r.size());
    } else {
      const flat_range own = intersect(r, intersect(s_.shard, flat_range{0, s_.persistent_begin}));
      if (!own.empty()) s_.be.convert(s_.param_ptr(own.begin), s_.param_t(), src(own.begin), t, own.size());
    }
    const flat_range own = intersect(r, s_.shard);
    if (own.empty()) return;
    if (s_.offloaded()) {
      // The host master is always separate: bring this rank's slice over and convert it.
      raw_buffer slice = allocate_host(t, own.size(), pageable_host_allocator);
      s_.be.download(slice.data(), src(own.begin), own.size() * size_of(t));
      s_.host.convert(s_.h_master.at(own.begin - s_.shard.begin), s_.master_t(), slice.data(), t, own.size());
    } else if (!s_.master_is_param()) {
      s_.be.convert(s_.master.at(own.begin - s_.shard.begin), s_.master_t(), src(own.begin), t, own.size());
    }
  }

  // ---- gradients --------------------------------------------------------------
  void accumulate_grad(std::size_t i, const void* src, dtype t, float scale = 1.0f) {
    const std::size_t sl = s_.slot(i);
    require_not_reduced("accumulate_grad", i);
    if (!std::isfinite(scale)) {
      detail::throw_invalid("ZeroOptimizer::accumulate_grad(" + std::to_string(i) + "): scale = " + std::to_string(scale) +
                    " would make every gradient non-finite; pass a finite multiplier, e.g. 1 / "
                    "gradient_accumulation_steps (the default is 1)");
    }
    check_source(src, i, "accumulate_grad");
    in_backward_ = true;
    grads_pending_ = true;
    if (s_.stage() < 2) {
      const flat_range r = s_.layout.param_range(sl);
      if (!take_stale_slot(sl)) {
        // The slot's first gradient since it was cleared: written, not added to zeros
        // (the same values: 0 + g is g, but for the sign of a zero).
        if (scale == 1.0f) {
          s_.be.convert(s_.grads.at(r.begin), s_.grad_t(), src, t, r.size());
          return;
        }
        s_.be.zero(s_.grads.at(r.begin), r.size() * size_of(s_.grad_t()));
      }
      s_.be.accumulate(s_.grads.at(r.begin), s_.grad_t(), src, t, r.size(), scale);
    } else {
      reducer_.report(sl, src, t, scale);
    }
  }

  void* grad(std::size_t i) {
    if (s_.stage() >= 2) {
      detail::throw_invalid("ZeroOptimizer::grad(" + std::to_string(i) +
                    "): gradients are partitioned at ZeRO stage 2 and 3; report them with accumulate_grad()");
    }
    const std::size_t sl = s_.slot(i);
    const flat_range r = s_.layout.param_range(sl);
    require_not_reduced("grad", i);
    in_backward_ = true;
    grads_pending_ = true;
    if (!take_stale_slot(sl)) s_.be.zero(s_.grads.at(r.begin), r.size() * size_of(s_.grad_t()));
    return s_.grads.at(r.begin);
  }

  void end_backward() {
    if (s_.stage() >= 2) {
      reducer_.end_pass();
      pass_ended_ = true;
    }
    in_backward_ = false;
  }

  void zero_grad() {
    if (in_backward_) end_backward();
    zero_all_grads();
    reduced_ = false;
    reducer_.release_buffers();
  }

  void reduce_gradients() {
    if (in_backward_) end_backward();
    if (reduced_) return;
    // Stages 2-3: a rank whose backward reached none of its parameters (its loss did not
    // use them this time) ends one empty pass here, reducing zeros, so that it joins the
    // bucket reductions of the ranks whose pass did. (Every rank must still run the same
    // number of non-empty passes per step.)
    if (s_.stage() >= 2 && !pass_ended_) end_backward();
    clear_stale_slots();
    if (s_.stage() < 2) reducer_.reduce_whole();
    if (s_.offloaded() && s_.stage() == 1) {
      // The reduced shard goes to the host partition (stages 2-3 did this bucket by bucket).
      s_.be.download(s_.h_grads.data(), s_.grads.at(s_.shard.begin), s_.shard.size() * size_of(s_.grad_t()));
    }
    reduced_ = true;
  }

  std::vector<float> full_grad(std::size_t i) {
    const flat_range r = s_.layout.param_range(s_.slot(i));  // a bad index throws before the collective
    reduce_gradients();
    const flat_range own = intersect(r, s_.shard);
    std::vector<float> out(r.size(), 0.0f);
    if (!own.empty()) {
      const std::uint64_t at = own.begin - s_.shard.begin;
      raw_buffer host = allocate_host(s_.grad_t(), own.size(), pageable_host_allocator);
      if (s_.offloaded()) {
        s_.host.copy(host.data(), s_.h_grads.at(at), host.bytes());
      } else {
        s_.be.download(host.data(), s_.shard_grads(at), host.bytes());
      }
      s_.host.convert(out.data() + (own.begin - r.begin), dtype::fp32, host.data(), s_.grad_t(), own.size());
    }
    // Stage 0 holds everything everywhere; otherwise each element has one owner.
    if (s_.stage() > 0 && s_.world > 1) s_.be.all_reduce_host(s_.comm, out.data(), out.size(), comm::reduce_op::sum);
    const double unscale = (s_.zo.average_gradients ? 1.0 / s_.world : 1.0) / (scaler_ ? scaler_->scale() : 1.0);
    for (float& v : out) v = static_cast<float>(v * unscale);
    return out;
  }

  // ---- the step -----------------------------------------------------------------
  step_report step() {
    groups_.require_none("step");
    reduce_gradients();
    const double W = static_cast<double>(s_.world);
    // The squared norm of this rank's shard: of the parameters split across a
    // tensor-parallel group apart (split_sq), of the others in norm_sq.
    double norm_sq = 0, split_sq = 0;
    const auto shard_stats = [&](flat_range r) {
      if (r.empty()) return 0.0;
      const std::uint64_t at = r.begin - s_.shard.begin;
      const grad_stats st = s_.offloaded() ? s_.host.stats(s_.h_grads.at(at), s_.grad_t(), r.size())
                                           : s_.be.stats(s_.shard_grads(at), s_.grad_t(), r.size());
      return st.nonfinite ? std::numeric_limits<double>::infinity() : st.norm_squared;
    };
    if (tp_runs_.empty()) {
      norm_sq = shard_stats(s_.shard);
    } else {
      for (const auto& [range, split] : tp_runs_) {
        const flat_range r = intersect(range, s_.shard);
        if (!r.empty()) (split ? split_sq : norm_sq) += shard_stats(r);
      }
    }
    // One all-reduce agrees on the squared norm (stage 0 computed the whole norm on
    // every rank; the others sum their partitions) and on how many ranks reported
    // gradients since the last step.
    double sums[3] = {s_.stage() > 0 ? norm_sq : 0.0, grads_pending_ ? 1.0 : 0.0, s_.stage() > 0 ? split_sq : 0.0};
    if (s_.world > 1) s_.be.all_reduce_host(s_.comm, sums, tp_runs_.empty() ? 2 : 3, comm::reduce_op::sum);
    if (s_.stage() > 0) {
      norm_sq = sums[0];
      split_sq = sums[2];
    }
    if (!tp_runs_.empty()) {
      // Each tensor-parallel rank holds its own slice of the split parameters; the
      // replicated ones are equal on all of them and count once.
      if (tp_->size() > 1) s_.be.all_reduce_host(*tp_, &split_sq, 1, comm::reduce_op::sum);
      norm_sq += split_sq;
    }
    if (sums[1] == 0.0) {
      // An update from all-zero gradients is not a no-op (weight decay, momentum, the
      // bias correction's step count): refuse it, on every rank alike.
      zero_all_grads();  // the reduction may leave unowned blocks unspecified
      reduced_ = false;
      throw no_gradients_error("mpzero: ZeroOptimizer::step(): no rank reported a gradient since the last step() or "
                               "zero_grad(), so step " + std::to_string(steps_ + 1) +
                               " would update the weights from zeros; run a backward pass first (accumulate_grad() "
                               "or grad(i)), or leave step() out of this iteration");
    }
    step_report rep;
    rep.overflow = !std::isfinite(norm_sq);
    rep.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    const double unscale = (s_.zo.average_gradients ? 1.0 / W : 1.0) / rep.loss_scale;
    rep.grad_norm = std::sqrt(norm_sq) * unscale;
    if (scaler_) {
      rep.skipped = scaler_->update(rep.overflow);  // may throw loss_scale_error, alike on every rank
    } else {
      rep.skipped = rep.overflow && s_.zo.check_overflow;
    }
    if (!rep.skipped) {
      validate_groups();  // before any group updates: a set_lr that no group takes changes nothing
      rep.clip_coefficient = clip_coefficient(rep.grad_norm, s_.zo.gradient_clipping);
      ++steps_;
      const step_call call{steps_, static_cast<float>(unscale * rep.clip_coefficient), s_.zo.seed};
      if (s_.offloaded()) {
        run_offloaded_step(call);
      } else {
        for (auto& st : steppers_) st->run(call);
      }
      gather_updated_params();
    }
    rep.step = steps_;
    zero_all_grads();
    reduced_ = false;  // only now: a throw above (loss_scale_error) leaves the reduced gradients marked so
    reducer_.release_buffers();
    return rep;
  }

  // Tensor parallelism (AutoTP): the parameters for which split[i] is true are slices of
  // weights split across the ranks of `tp` (each rank of this core's communicator in one
  // such group); the gradient norm, for clipping and the overflow check, sums their
  // squares over `tp` and counts the others, replicated across it, once. Collective over
  // neither; every rank of a tp group calls it alike.
  void set_tensor_parallel(comm::any_communicator tp, const std::vector<bool>& split) {
    if (split.size() != s_.num_params()) {
      detail::throw_invalid("ZeroOptimizer::set_tensor_parallel: " + std::to_string(split.size()) + " flags for " +
                            std::to_string(s_.num_params()) + " parameters; give one per parameter");
    }
    std::vector<bool> split_at_slot(split.size());
    for (std::size_t i = 0; i < split.size(); ++i) split_at_slot[s_.slot_of[i]] = split[i];
    std::vector<std::pair<flat_range, bool>> runs;
    for (std::size_t sl = 0; sl < s_.num_params(); ++sl) {
      const flat_range r = s_.layout.param_range(sl);
      if (r.empty()) continue;
      const bool sp = split_at_slot[sl];
      if (!runs.empty() && runs.back().second == sp) {
        runs.back().first.end = r.end;
      } else {
        if (!runs.empty()) runs.back().first.end = r.begin;
        runs.emplace_back(r, sp);
      }
    }
    if (runs.empty()) runs.emplace_back(flat_range{0, s_.layout.padded_numel()}, false);
    runs.front().first.begin = 0;
    runs.back().first.end = s_.layout.padded_numel();
    tp_.emplace(std::move(tp));
    tp_runs_ = std::move(runs);
  }

  // ---- ZeRO-3 parameter gathering -----------------------------------------------
  void prefetch(std::size_t first, std::size_t end, bool in_param_dtype = false) {
    groups_.prefetch(first, end, in_param_dtype);
  }
  void gather(std::size_t first, std::size_t end, bool in_param_dtype = false) {
    groups_.gather(first, end, in_param_dtype);
  }
  void release(std::size_t first, std::size_t end) { groups_.release(first, end); }

  // ---- inspection -----------------------------------------------------------------
  const zero_spec& spec() const noexcept { return s_.spec; }
  const zero_options& options() const noexcept { return s_.zo; }
  step_kernel& kernel() noexcept { return *kernel_; }
  const step_kernel& kernel() const noexcept { return *kernel_; }
  backend_base& backend() noexcept { return s_.be; }
  comm::any_communicator& communicator() noexcept { return s_.comm; }
  const flat_layout& layout() const noexcept { return s_.layout; }
  flat_range shard() const noexcept { return s_.shard; }
  std::uint64_t steps() const noexcept { return steps_; }
  // The stochastic-rounding stream the last loaded checkpoint was written with
  // (checkpoint::shard_header::rounding_stream: 0 for nearest rounding or files that
  // predate the record); 0 before any load. Where it is not 0 and differs from
  // mpzero::rounding_stream, the loaded values are exact, but the steps after the load
  // draw other bits than the saving build would have.
  std::uint32_t loaded_rounding_stream() const noexcept { return loaded_rounding_stream_; }
  // Parameter groups (zero_options::param_groups; one when none is given) and the
  // learning rate group g's next step uses.
  std::size_t num_groups() const noexcept { return s_.num_groups(); }
  double lr(std::size_t group) const {
    if (group >= s_.num_groups()) {
      detail::throw_invalid("ZeroOptimizer::lr(" + std::to_string(group) + "): there are " +
                            std::to_string(s_.num_groups()) + " parameter groups");
    }
    return kernel_->lr() * s_.group(group).lr_scale;
  }
  bool grads_pending() const noexcept { return grads_pending_; }
  double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  const std::optional<loss_scaler>& scaler() const noexcept { return scaler_; }
  // The host step's threads (0: OpenMP's default).
  int host_threads() const noexcept { return threads_; }
  std::uint64_t flat_offset(std::size_t i) const { return s_.layout.offset(s_.slot(i)); }

  // Calls out(flat index, value) for the master weights (or optimizer state `which`) of
  // this rank's shard, copied to the host.
  template <class Out>
  void read_master_shard(Out&& out) const {
    // One array, piece by piece: the master is the parameter storage where they are one
    // (not offloaded), else its own buffer (always separate on the host with offload).
    for (const flat_range& r : s_.shard_pieces()) {
      const std::uint64_t at = r.begin - s_.shard.begin;
      if (s_.offloaded()) {
        emit(s_.host, s_.h_master.at(at), s_.master_t(), r, out);
      } else if (s_.master_is_param()) {
        emit(s_.be, s_.param_ptr(r.begin), s_.param_t(), r, out);
      } else {
        emit(s_.be, s_.master.at(at), s_.master_t(), r, out);
      }
    }
  }
  template <class Out>
  void read_state_shard(int which, Out&& out) const {
    if (which < 0 || which >= s_.n_states) {
      detail::throw_invalid("ZeroOptimizer::read_state_shard: state " + std::to_string(which) + " does not exist; " +
                    std::string(kernel_->optimizer_name()) + " has " + std::to_string(s_.n_states));
    }
    const auto k = static_cast<std::size_t>(which);
    for (const flat_range& r : s_.shard_pieces()) {
      const std::uint64_t at = r.begin - s_.shard.begin;
      emit(s_.offloaded() ? s_.host : s_.be, (s_.offloaded() ? s_.h_states : s_.states)[k].at(at), s_.state_t(), r, out);
    }
  }

  // ---- checkpoints ------------------------------------------------------------------
  std::uint64_t save_checkpoint(const std::filesystem::path& dir) {
    const std::uint64_t id = agreed_save_id();
    agree("save_checkpoint", "the checkpoint in " + checkpoint::detail::quoted(dir) + " is incomplete", [&] {
      require_no_pending_grads("save_checkpoint");
      if (s_.stage() == 0 && s_.rank != 0) return;  // every rank holds the same state
      if (s_.offloaded()) wait_uploads();           // the device parameters are read next
      io_.write(dir, checkpoint_header(id));
    });
    // Every file of this save is in place: what an earlier, larger save left goes. Each rank
    // removes what it sees (a directory per node, or one shared: removing twice is harmless).
    checkpoint::remove_stale_shards(dir, shard_files());
    return id;
  }

  void load_checkpoint(const std::filesystem::path& dir) {
    std::vector<detail::host_piece> pieces;
    std::uint64_t steps = 0;
    std::uint32_t stream = 0;
    std::optional<loss_scaler> scaler;
    // Everything is read and checked first; the core changes only once every rank has its part.
    agree("load_checkpoint", "nothing was loaded on this rank", [&] {
      require_no_pending_grads("load_checkpoint");
      groups_.require_none("load_checkpoint");
      io_.read(dir, kernel_->optimizer_name(), scaler_, pieces, steps, stream, scaler);
    });
    if (s_.offloaded()) wait_uploads();  // they read the host buffers rewritten here
    io_.install(pieces);
    steps_ = steps;
    loaded_rounding_stream_ = stream;
    if (scaler) scaler_ = std::move(scaler);
    gather_updated_params();
  }

  memory_report memory() const {
    memory_report m;
    m.params = s_.params.bytes() + s_.persistent.bytes();
    m.grads = s_.grads.bytes();
    m.master = s_.master.bytes();
    for (const auto& st : s_.states) m.states += st.bytes();
    m.buckets = reducer_.device_bytes();
    m.buckets += groups_.bytes();
    m.host_master = s_.h_master.bytes();
    m.host_grads = s_.h_grads.bytes();
    for (const auto& st : s_.h_states) m.host_states += st.bytes();
    m.host_buckets = s_.h_params.bytes() + reducer_.host_bytes();
    m.peak_buckets = s_.dev_meter.peak;
    m.peak_host_buckets = s_.host_meter.peak;
    m.bucket_bound = reducer_.device_bound();
    m.model_numel = s_.layout.total_numel();
    m.padding_numel = s_.layout.padded_numel() - s_.layout.total_numel();
    return m;
  }

 private:
  void check_communicator() {
    const bool needs_device = s_.be.device_memory() && !s_.be.host_addressable();
    if (needs_device == s_.comm.reads_device_memory()) return;
    // Checked before anything is allocated: a host communicator handed device pointers
    // would fault inside a collective (memmove, or MPI's host-side reductions), and NCCL
    // rejects host pointers only once the first bucket is reduced.
    const std::string who = "ZeroOptimizer: the backend keeps its buffers in ";
    const std::string rank = "(rank " + std::to_string(s_.rank) + " of " + std::to_string(s_.world) + ")";
    detail::throw_invalid(needs_device
                      ? who + "device memory, but the communicator " + rank +
                            " moves host memory. Use comm::nccl_communicator (one rank works too), or "
                            "comm::cuda_local_communicator for a single process; or the host backend. (A communicator "
                            "that does read device memory, e.g. over a CUDA-aware MPI, says so with "
                            "`bool reads_device_memory() const { return true; }`; a backend whose device buffers host "
                            "code can address, e.g. managed memory, with `static constexpr bool host_addressable = true`)"
                      : who + "host memory, but the communicator " + rank +
                            " reads device memory. Use comm::mpi_communicator or comm::local_communicator with a host "
                            "backend, or the CUDA backend with this communicator");
  }

  // The constructor's part that may fail on one rank only; returns what every rank must
  // have alike, and how a message names it.
  std::pair<std::string, std::string> construct(std::span<const std::uint64_t> numels) {
    const zero_options& zo = s_.zo;
    if (s_.spec.precision.needs_loss_scaling() && !zo.loss_scaling) {
      detail::throw_invalid("ZeroOptimizer: this policy keeps fp16 weights or gradients, which underflow without loss scaling: "
                    "set zero_options::loss_scaling = true (dynamic by default), or use a bf16 policy");
    }
    if (zo.reduce_bucket_numel == 0) {
      detail::throw_invalid("ZeroOptimizer: reduce_bucket_numel = 0; use a positive bucket size (DeepSpeed's default is 5e8)");
    }
    if (zo.offload_sub_group_numel == 0) {
      detail::throw_invalid("ZeroOptimizer: offload_sub_group_numel = 0; use a positive number of elements (default 2^24)");
    }
    if (!(zo.gradient_clipping >= 0) || !std::isfinite(zo.gradient_clipping)) {
      detail::throw_invalid("ZeroOptimizer: gradient_clipping = " + std::to_string(zo.gradient_clipping) +
                    "; use a finite max norm >= 0 (0 disables clipping)");
    }
    if (zo.loss_scaling) scaler_.emplace(zo.loss_scale);
    threads_ = s_.be.host_threads().value_or(0);
    const std::size_t n_large = detail::build_layout(s_, numels);  // checks the group lists
    validate_groups();  // the hyperparameters now, not at the first step
    detail::allocate(s_);  // first: a model that cannot be held fails here, before its buckets are planned
    if (s_.stage() >= 2) reducer_.plan(n_large);
    groups_.init();
    if (s_.offloaded()) {
      // Steppers per sub-group: a sub-group's upload overlaps the next one's update.
      for (const step_buffers& t : detail::sub_groups(s_, detail::shard_tensors(s_))) {
        host_steppers_.push_back(make_steppers({t}, true));
      }
    } else {
      steppers_ = make_steppers(detail::shard_tensors(s_), false);
    }
    if (s_.world == 1) return {};
    return detail::core_identity(s_, kernel_->optimizer_name(), numels);
  }

  // One stepper per parameter group that has elements in `tensors`.
  std::vector<std::unique_ptr<stepper>> make_steppers(const std::vector<step_buffers>& tensors, bool on_host) {
    std::vector<std::unique_ptr<stepper>> out;
    std::vector<std::vector<step_buffers>> parts = detail::by_group(s_, tensors);
    for (std::size_t g = 0; g < parts.size(); ++g) {
      if (!parts[g].empty()) out.push_back(kernel_->make_stepper(std::move(parts[g]), on_host, threads_, s_.group(g)));
    }
    return out;
  }

  // Every parameter group's hyperparameters, as the kernel's current ones and the group's
  // adjustments give them.
  void validate_groups() const {
    for (std::size_t g = 0; g < s_.num_groups(); ++g) {
      try {
        kernel_->validate(s_.group(g));
      } catch (const invalid_argument& e) {
        if (s_.zo.param_groups.empty()) throw;
        const param_group_options& o = s_.group(g);
        throw invalid_argument(std::string(e.what()) + " (parameter group " + std::to_string(g) + ": lr " +
                               detail::format_double(kernel_->lr()) + " x lr_scale " +
                               detail::format_double(o.lr_scale) +
                               (o.weight_decay ? ", weight_decay " + detail::format_double(*o.weight_decay) : "") + ")");
      }
    }
  }

  // Stages 0-1 clear the whole gradient buffer lazily: zero_all_grads marks every slot
  // stale (nothing written), a slot's first gradient overwrites it (one pass over the
  // gradient where clearing, then adding, takes three), and the slots no gradient
  // reached are cleared before the buffer is read (clear_stale_slots, at the reduction).
  // Returns whether slot sl held this step's values already, marking it so.
  bool take_stale_slot(std::size_t sl) {
    if (!grads_stale_ || slot_fresh_[sl]) return true;
    slot_fresh_[sl] = 1;
    return false;
  }
  void clear_stale_slots() {
    if (!grads_stale_) return;
    grads_stale_ = false;
    const std::size_t n = slot_fresh_.size(), bytes = size_of(s_.grad_t());
    // Runs of stale slots, one clear each (with the padding between them, which is zero).
    for (std::size_t a = 0; a < n;) {
      if (slot_fresh_[a]) {
        ++a;
        continue;
      }
      std::size_t b = a;
      while (b + 1 < n && !slot_fresh_[b + 1]) ++b;
      const std::uint64_t begin = s_.layout.param_range(a).begin, end = s_.layout.param_range(b).end;
      if (end > begin) s_.be.zero(s_.grads.at(begin), (end - begin) * bytes);
      a = b + 1;
    }
  }

  void zero_all_grads() {
    grads_pending_ = false;
    pass_ended_ = false;
    if (s_.stage() < 2) {
      slot_fresh_.assign(s_.layout.num_params(), 0);
      grads_stale_ = true;
      return;
    }
    s_.be.zero(s_.grads.data(), s_.grads.bytes());
    // Stage 1 overwrites the host partition with each step's reduced shard instead.
    if (s_.offloaded() && s_.stage() >= 2) s_.host.zero(s_.h_grads.data(), s_.h_grads.bytes());
  }

  // Offload: the host step in sub-groups. Each sub-group's parameters (written by the
  // host step in the parameter dtype) are uploaded on the backend's copy stream while
  // the host updates the next sub-group; the backend's later work (the gather, the next
  // forward) is ordered after the uploads, and the host waits for them only at the next
  // step, before it overwrites their source.
  void run_offloaded_step(const step_call& call) {
    wait_uploads();
    const std::uint64_t g = s_.zo.offload_sub_group_numel;
    std::uint64_t begin = s_.shard.begin;
    for (auto& sub : host_steppers_) {
      for (auto& st : sub) st->run(call);
      const std::uint64_t end = std::min(begin + g, s_.shard.end);
      upload_params(flat_range{begin, end});
      begin = end;
    }
    for (const auto& t : uploads_) s_.be.order_after(t);
  }

  // Queues the upload of the updated parameters of r (a part of this rank's shard).
  void upload_params(flat_range r) {
    const raw_buffer& src = s_.master_is_param() ? s_.h_master : s_.h_params;
    const std::uint64_t bytes = size_of(s_.param_t());
    const auto up = [&](flat_range piece) {
      if (!piece.empty())
        uploads_.push_back(
            s_.be.upload_async(s_.param_ptr(piece.begin), src.at(piece.begin - s_.shard.begin), piece.size() * bytes));
    };
    if (s_.stage() < 3) {
      up(r);
    } else {
      up(intersect(r, flat_range{0, s_.persistent_begin}));
      up(intersect(r, flat_range{s_.persistent_begin, s_.layout.padded_numel()}));
    }
  }

  void wait_uploads() {
    for (auto& t : uploads_) t.wait();
    uploads_.clear();
  }

  void gather_updated_params() {
    if (s_.world == 1) return;
    const comm::wire_dtype t = detail::wire_of(s_.param_t());
    if (s_.stage() == 1 || s_.stage() == 2) {
      s_.be.before_comm(s_.comm);
      const std::vector<std::uint64_t> counts(static_cast<std::size_t>(s_.world), s_.layout.partition_numel());
      s_.comm.base().iall_gather_v(s_.params.at(s_.shard.begin), s_.layout.partition_numel(), s_.params.data(), counts, t)->wait();
    } else if (s_.stage() == 3) {
      const flat_range r{s_.persistent_begin, s_.layout.padded_numel()};
      if (r.empty()) return;
      s_.be.before_comm(s_.comm);
      const std::vector<std::uint64_t> counts = s_.layout.rank_counts(r);
      // In place on every rank, as MPI requires of MPI_IN_PLACE: a rank whose block is
      // empty passes its (empty) block's place too.
      void* in = s_.persistent.at(comm::detail::offset_of(counts, s_.rank));
      s_.comm.base().iall_gather_v(in, counts[static_cast<std::size_t>(s_.rank)], s_.persistent.data(), counts, t)->wait();
    }
  }

  // Gradients already reduced for this step take no more additions.
  void require_not_reduced(const char* who, std::size_t i) const {
    if (reduced_) {
      detail::throw_invalid("ZeroOptimizer::" + std::string(who) + "(" + std::to_string(i) +
                    "): this step's gradients were already reduced (reduce_gradients() or full_grad()); "
                    "call step() or zero_grad() before the next backward");
    }
  }

  // A parameter's source values: not null (unless the parameter is empty), and memory
  // the backend's kernels can read.
  void check_source(const void* p, std::size_t i, const char* who) const {
    if (numel(i) == 0) return;
    if (p == nullptr) {
      detail::throw_invalid("ZeroOptimizer::" + std::string(who) + "(" + std::to_string(i) + "): the pointer is null; pass " +
                    std::to_string(numel(i)) + " values");
    }
    s_.be.check_readable(p, "ZeroOptimizer::" + std::string(who) + "(" + std::to_string(i) + ")");
  }

  void require_no_pending_grads(const char* who) const {
    if (grads_pending_ || reduced_) {  // (in_backward_ implies grads_pending_)
      detail::throw_invalid("ZeroOptimizer::" + std::string(who) +
                    ": gradients were reported since the last step(); a checkpoint holds weights and optimizer "
                    "states, not gradients. Call it after step() or zero_grad()");
    }
  }

  // The n values at v become their largest over the ranks (the agreements' collective).
  void all_reduce_max(std::int32_t* v, int n) { s_.be.all_reduce_host(s_.comm, v, static_cast<std::uint64_t>(n), comm::reduce_op::max); }

  // Runs f, then every rank learns whether any rank failed (detail::agree_on_failure).
  template <class F>
  void agree(const char* who, const std::string& consequence, F&& f) {
    detail::agree_on_failure(
        s_.rank, s_.world, [&](std::int32_t* v, int n) { all_reduce_max(v, n); }, "ZeroOptimizer::" + std::string(who),
        consequence, std::forward<F>(f));
  }

  // One id for every file of a save, so that a load can tell files of two saves apart.
  std::uint64_t agreed_save_id() {
    std::uint64_t bits = 0;
    try {
      std::random_device rd;
      bits = (std::uint64_t{rd()} << 32) ^ rd();
    } catch (...) {  // no entropy source: the clock and the rank (a throw here would skip the all-reduce)
      bits = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) *
                 0x9E3779B97F4A7C15ull ^
             static_cast<std::uint64_t>(s_.rank);
    }
    // 52 bits: exact in a double, which every communicator reduces.
    double id = static_cast<double>(bits & ((std::uint64_t{1} << 52) - 1));
    if (s_.world > 1) s_.be.all_reduce_host(s_.comm, &id, 1, comm::reduce_op::max);
    return static_cast<std::uint64_t>(id);
  }

  // How many shard files a save writes: one in all at stage 0, one per rank otherwise.
  std::uint32_t shard_files() const noexcept { return s_.stage() == 0 ? 1u : static_cast<std::uint32_t>(s_.world); }

  checkpoint::shard_header checkpoint_header(std::uint64_t id) const {
    checkpoint::shard_header h;
    h.save_id = id;
    h.rank = static_cast<std::uint32_t>(s_.rank);
    h.world = static_cast<std::uint32_t>(s_.world);
    h.files = shard_files();
    h.stage = static_cast<std::uint32_t>(s_.stage());
    h.param = s_.param_t();
    h.master = s_.master_t();
    h.state = s_.state_t();
    h.has_master = !s_.master_is_param();
    h.n_states = static_cast<std::uint32_t>(s_.n_states);
    h.rounding_stream = s_.spec.precision.stochastic_rounding ? rounding_stream : 0;
    h.optimizer = std::string(kernel_->optimizer_name());
    h.steps = steps_;
    if (scaler_) {
      const loss_scaler::state st = scaler_->save();
      h.scaler = checkpoint::scaler_record{st.scale, st.hysteresis_left, st.clean_steps, st.last_overflow_iter, st.iter};
    }
    for (std::size_t i = 0; i < num_params(); ++i) h.numels.push_back(numel(i));
    return h;
  }

  template <class Out>
  // Calls out(flat index, value) for the r.size() values of dtype t at p (memory of `from`).
  void emit(backend_base& from, const void* p, dtype t, flat_range r, Out& out) const {
    raw_buffer host = allocate_host(t, r.size(), pageable_host_allocator);
    from.download(host.data(), p, host.bytes());
    std::vector<float> v(r.size());
    s_.host.convert(v.data(), dtype::fp32, host.data(), t, r.size());
    for (std::uint64_t k = 0; k < r.size(); ++k) out(r.begin + k, v[k]);
  }

  // Owned before the state that refers to them.
  std::unique_ptr<backend_base> backend_, host_backend_;
  std::unique_ptr<step_kernel> kernel_;  // outlives its steppers (declared before them)
  detail::core_state s_;
  detail::grad_reducer reducer_;
  detail::gather_groups groups_;  // stage 3's gathers
  detail::core_checkpoint io_;
  std::optional<loss_scaler> scaler_;
  std::uint64_t steps_ = 0;
  std::uint32_t loaded_rounding_stream_ = 0;
  int threads_ = 0;
  bool in_backward_ = false;
  bool reduced_ = false;        // reduce_gradients() ran for this step
  bool grads_pending_ = false;  // gradients reported since the last step() or zero_grad()
  bool pass_ended_ = false;     // stages 2-3: end_backward() ran since the last step() or zero_grad()
  // Stages 0-1 (zero_all_grads): whether slots may hold stale values, and which do not.
  bool grads_stale_ = false;
  std::vector<std::uint8_t> slot_fresh_;
  std::optional<comm::any_communicator> tp_;                // set_tensor_parallel's group
  std::vector<std::pair<flat_range, bool>> tp_runs_;        // [0, padded) in runs of split / replicated parameters
  std::vector<std::unique_ptr<stepper>> steppers_;  // one per parameter group present in the shard
  std::vector<std::vector<std::unique_ptr<stepper>>> host_steppers_;  // offload: per sub-group of the shard, per group
  std::vector<async_transfer> uploads_;                  // offload: the last step's parameter uploads
};

}  // namespace mpzero

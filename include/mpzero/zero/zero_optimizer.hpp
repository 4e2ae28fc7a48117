// mpzero: ZeroOptimizer, ZeRO stages 0-3 over one communicator and one backend.
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
// During backward, report each gradient with accumulate_grad(); end a backward pass
// with end_backward(); call step() at the accumulation boundary. Gradients of every
// pass and micro-step are summed until step() (or zero_grad()).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../backend/host_backend.hpp"
#include "../comm/communicator.hpp"
#include "../error.hpp"
#include "../numeric/dtype.hpp"
#include "../optim/optimizer.hpp"
#include "../partition/bucket_plan.hpp"
#include "../partition/flat_layout.hpp"
#include "../policy/memory_model.hpp"
#include "../policy/precision.hpp"
#include "../policy/stage.hpp"
#include "../step/fused_step.hpp"
#include "checkpoint.hpp"
#include "clipping.hpp"
#include "loss_scaler.hpp"

namespace mpzero {

struct zero_options {
  // Gradient elements reduced together in stages 2 and 3 (DeepSpeed's reduce_bucket_size).
  std::uint64_t reduce_bucket_numel = 500'000'000;
  // Parameters of at most this many elements are never partitioned in stage 3
  // (stage3_param_persistence_threshold). Every stage places them last in the flat buffers.
  std::uint64_t param_persistence_threshold = 100'000;
  // Clip gradients to this global L2 norm; 0 disables (DeepSpeed's gradient_clipping).
  double gradient_clipping = 0.0;
  // Loss scaling: required by policies with fp16 weights or gradients.
  bool loss_scaling = false;
  loss_scale_options loss_scale{};
  // Skip a step whose gradients are not finite (always on with loss scaling; bf16's check_grad_overflow).
  bool check_overflow = true;
  // Average gradients over ranks (data parallelism) rather than summing them.
  bool average_gradients = true;
  // ZeRO-Offload: page-lock the host partition (DeepSpeed's offload_optimizer.pin_memory)
  // so that copies run on the copy engines, asynchronously. Only the CUDA backend pins.
  bool pin_memory = true;
  // ZeRO-Offload: the host step runs over the shard in sub-groups of this many elements;
  // each sub-group's parameters are uploaded while the next one is updated.
  std::uint64_t offload_sub_group_numel = std::uint64_t{1} << 24;
  // Key of stochastic rounding.
  std::uint64_t seed = 0;
  flat_layout_options layout{};
  // The dtype each parameter's gradient travels in, one entry per parameter in the
  // caller's order (DeepSpeed's torch_autocast: lower_precision_safe_modules in the
  // autocast dtype, the others in communication_data_type). Empty: every gradient
  // travels in the optimizer's Wire type. Contiguous parameters of one wire dtype are
  // reduced together; a bucket that mixes dtypes costs one collective per run.
  std::vector<dtype> wire_dtypes{};
};

struct step_report {
  std::uint64_t step = 0;      // optimizer steps taken so far; a skipped step does not count
  bool skipped = false;        // the update was not applied (overflow)
  bool overflow = false;       // some gradient element was not finite, on some rank
  double grad_norm = 0;        // global L2 norm of the averaged, unscaled gradient, before clipping
  double clip_coefficient = 1; // multiplier applied for clipping
  double loss_scale = 1;       // the scale the step's gradients carried
};

// Bytes this rank holds, by kind. The first four are model states, what the
// memory model predicts; buckets are transient communication buffers.
struct memory_report {
  std::uint64_t params = 0, grads = 0, master = 0, states = 0;  // in the backend's memory
  std::uint64_t host_master = 0, host_grads = 0, host_states = 0;  // CPU offload: in host memory
  std::uint64_t buckets = 0;  // in the backend's memory: staging, wire-typed and receive buffers of the
                              // reductions; stage 3's gathers
  std::uint64_t host_buckets = 0;  // CPU offload, in host memory: the step's parameter output, download staging
  std::uint64_t model_numel = 0;    // trainable elements, unpadded
  std::uint64_t padding_numel = 0;  // elements added to align the partitions
  std::uint64_t model_state_bytes() const noexcept { return params + grads + master + states; }
  std::uint64_t host_model_state_bytes() const noexcept { return host_master + host_grads + host_states; }
};

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
  static_assert(storage_type<Wire>, "mpzero: the wire type of gradients is mpzero::fp32, mpzero::bf16 or mpzero::fp16.");
  static_assert(!detail::is_16bit_pair<Wire, typename Policy::param_type> &&
                    !detail::is_16bit_pair<Wire, typename Policy::grad_type>,
                "mpzero: the gradient wire type mixes bf16 and fp16 with the policy's 16-bit type (fp16 overflows "
                "above 65504 and nothing scales it); reduce in the policy's own 16-bit type or in mpzero::fp32.");
  static_assert(Offload::value == offload_kind::none || Stage::value >= 1,
                "mpzero: CPU offload keeps each rank's partition on the host: use ZeRO stage 1, 2 or 3.");

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
  // test double that stages "device" buffers in host memory).
  static constexpr bool needs_device_communicator = Backend::device_memory && !requires {
    requires Backend::host_addressable;
  };

  // Collective over `comm` (one all-reduce of three integers above world size 1): every
  // rank constructs its optimizer at the same point. A rank that fails (a bad option,
  // memory running out) throws why, and the others throw mpzero::error naming it; ranks
  // that pass different numels or layout-, collective- or step-relevant zero_options
  // all throw invalid_argument. (The optimizer's hyperparameters are not compared:
  // set_options may change them later, rank by rank.)
  ZeroOptimizer(Comm& comm, std::span<const std::uint64_t> numels, const typename Optimizer::options& opt,
                const zero_options& zo = {}, Backend backend = {})
      : comm_(comm), backend_(std::move(backend)), opt_(opt), zo_(zo), world_(comm.size()), rank_(comm.rank()) {
    if (needs_device_communicator != comm::reads_device_memory(comm)) {
      // Checked before anything is allocated: a host communicator handed device pointers
      // would fault inside a collective (memmove, or MPI's host-side reductions), and NCCL
      // rejects host pointers only once the first bucket is reduced.
      detail::throw_invalid(
          needs_device_communicator
              ? "ZeroOptimizer: the backend keeps its buffers in device memory, but the communicator (rank " +
                    std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
                    ") moves host memory. Use comm::nccl_communicator (one rank works too), or "
                    "comm::cuda_local_communicator for a single process; or the host backend. (A communicator "
                    "that does read device memory, e.g. over a CUDA-aware MPI, says so with "
                    "`bool reads_device_memory() const { return true; }`; a backend whose device buffers host "
                    "code can address, e.g. managed memory, with `static constexpr bool host_addressable = true`)"
              : "ZeroOptimizer: the backend keeps its buffers in host memory, but the communicator (rank " +
                    std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) +
                    ") reads device memory. Use comm::mpi_communicator or comm::local_communicator with a host "
                    "backend, or the CUDA backend with this communicator");
    }
    // A communicator that must follow the backend's stream and cannot (a
    // cuda_local_communicator on another stream) says so now, not mid-backward.
    backend_.before_comm(comm_);
    // The rest may fail on some ranks only (a bad option, memory running out): every
    // rank learns of it in one collective, together with whether all ranks passed the
    // same layout and options, so no rank waits in a later collective for one that threw
    // or partitions the model otherwise. (The two checks above fail alike on every rank:
    // they depend on types, and a collective could not run past them.)
    detail::agree_on_failure_and_identity(
        rank_, world_, [&](std::int32_t* v, int n) { all_reduce_max(v, n); }, "ZeroOptimizer",
        "no rank made the optimizer", "parameter layouts or options", [&] { return construct(numels); });
  }

 private:
  // The constructor's part that may fail on one rank only; returns what every rank must
  // have alike, and how a message names it.
  std::pair<std::string, std::string> construct(std::span<const std::uint64_t> numels) {
    const zero_options& zo = zo_;
    const typename Optimizer::options& opt = opt_;
    if constexpr (Policy::needs_loss_scaling) {
      if (!zo.loss_scaling) {
        detail::throw_invalid(
            "ZeroOptimizer: this policy keeps fp16 weights or gradients, which underflow without loss scaling: set "
            "zero_options::loss_scaling = true (dynamic by default), or use a bf16 policy");
      }
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
    (void)Optimizer::prepare(opt, 1);  // validates the hyperparameters now, not at the first step
    if (zo.loss_scaling) scaler_.emplace(zo.loss_scale);
    build_layout(numels);
    allocate();
    if constexpr (offloaded) {
      // The host backend's threading applies to the offloaded step too (with a device
      // backend it runs on OpenMP's default: OMP_NUM_THREADS or all cores).
      if constexpr (std::is_same_v<Backend, host_backend>) host_.options = backend_.options;
      // One stepper per sub-group: a sub-group's upload overlaps the next one's update.
      for (const step_tensor<Policy, Optimizer>& t : sub_groups(shard_tensors())) {
        host_steppers_.push_back(host_.template make_stepper<Policy, Optimizer>({t}));
      }
    } else {
      stepper_.emplace(backend_.template make_stepper<Policy, Optimizer>(shard_tensors()));
    }
    if (world_ == 1) return {};
    std::uint64_t elements = 0;
    std::string id = std::string(optim::name_of<Optimizer>(opt_)) + " " + std::to_string(zero_stage) + " " +
                     std::to_string(static_cast<int>(Policy::param_dtype)) +
                     std::to_string(static_cast<int>(Policy::master_dtype)) +
                     std::to_string(static_cast<int>(Policy::grad_dtype)) +
                     std::to_string(static_cast<int>(Policy::state_dtype)) + std::to_string(Policy::stochastic_rounding) +
                     std::to_string(offloaded) + "\n";
    for (const std::uint64_t n : numels) {
      id += std::to_string(n) + " ";
      elements += n;
    }
    id += "\nbucket " + std::to_string(zo.reduce_bucket_numel) + ", persistence " +
          std::to_string(zo.param_persistence_threshold) + ", sub-group " + std::to_string(zo.offload_sub_group_numel) +
          ", align " + std::to_string(zo.layout.align_elements) + ", clipping " +
          detail::format_double(zo.gradient_clipping) + ", flags " + std::to_string(zo.loss_scaling) +
          std::to_string(zo.check_overflow) + std::to_string(zo.average_gradients) + ", wire";
    for (const dtype d : zo.wire_dtypes) id += " " + std::to_string(static_cast<int>(d));
    if (zo.loss_scaling) {
      const loss_scale_options& l = zo.loss_scale;
      id += "\nscaler " + std::to_string(l.dynamic) + " " + detail::format_double(l.static_scale) + " " +
            std::to_string(l.initial_scale_power) + " " + std::to_string(l.loss_scale_window) + " " +
            std::to_string(l.hysteresis) + " " + std::to_string(l.consecutive_hysteresis) + " " +
            detail::format_double(l.min_loss_scale);
    }
    return {std::move(id), std::to_string(numels.size()) + " parameters of " + std::to_string(elements) +
                               " elements, stage " + std::to_string(zero_stage) + ", reduce_bucket_numel " +
                               std::to_string(zo.reduce_bucket_numel) + ", gradient_clipping " +
                               detail::format_double(zo.gradient_clipping)};
  }

 public:
  // Transfers still in flight read or write buffers freed here: wait for them.
  ~ZeroOptimizer() {
    // Reductions still in flight (an exception left backward midway) finish, or reach
    // the communicator's deadline, before their buffers go: an NCCL request does not
    // wait when dropped, and cudaFree would then wait for a missing peer without one.
    auto quietly = [](auto& request) {
      try {
        request.wait();
      } catch (...) {  // timed out or failed: the communicator is aborted, nothing runs on
      }
    };
    for (auto& f : pending_) {
      for (auto& part : f.parts) quietly(part.request);
    }
    // Stage 3: gathers prefetched and never gathered write into buffers freed here.
    for (auto& [key, g] : groups_) {
      if (g.request) quietly(*g.request);
    }
    if constexpr (offloaded) {
      try {
        for (auto& t : uploads_) t.wait();
        for (auto& d : downloads_) d.transfer.wait();
      } catch (...) {  // a failed device: nothing left to protect
      }
    }
  }

  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  // ---- parameters -------------------------------------------------------------
  std::size_t num_params() const noexcept { return slot_of_.size(); }
  std::uint64_t numel(std::size_t i) const { return layout_.numel(slot(i)); }
  bool is_persistent(std::size_t i) const { return layout_.offset(slot(i)) >= persistent_begin_; }

  // The parameter's storage, in the backend's memory. Stage 3: only while gathered
  // (or persistent); a gathered parameter is read-only (a copy whose writes are lost,
  // or at world size 1 the partition itself).
  std::span<param_type> param(std::size_t i) {
    const std::size_t s = slot(i);
    const std::uint64_t off = layout_.offset(s), n = layout_.numel(s);
    if constexpr (zero_stage < 3) {
      return {params_.data() + off, static_cast<std::size_t>(n)};
    } else {
      if (off >= persistent_begin_) return {persistent_.data() + (off - persistent_begin_), static_cast<std::size_t>(n)};
      if (gathered_[s] == nullptr) {
        detail::throw_invalid("ZeroOptimizer::param(" + std::to_string(i) +
                              "): the parameter is partitioned (ZeRO stage 3); gather() its group first");
      }
      return {gathered_[s], static_cast<std::size_t>(n)};
    }
  }

  // Sets a parameter's value (and its master copy) from `values` (host memory for
  // the host backend, device memory otherwise), `numel(i)` elements in any storage
  // type. Every rank calls it with the same values.
  template <storage_type T>
  void load_param(std::size_t i, const T* values) {
    require_no_gathered_groups("load_param");
    const std::size_t s = slot(i);
    check_source(values, i, "load_param");
    if constexpr (offloaded) wait_uploads();  // they read the host master this rewrites
    const flat_range r = layout_.param_range(s);
    // The parameter storage this rank keeps.
    if constexpr (zero_stage < 3) {
      backend_.convert(params_.data() + r.begin, values, r.size());
    } else if (r.begin >= persistent_begin_) {
      backend_.convert(persistent_.data() + (r.begin - persistent_begin_), values, r.size());
    } else {
      const flat_range own = intersect(r, intersect(shard_, flat_range{0, persistent_begin_}));
      if (!own.empty()) backend_.convert(params_.data() + (own.begin - shard_.begin), values + (own.begin - r.begin), own.size());
    }
    if constexpr (offloaded) {
      // The host master is always separate: bring this rank's slice over and convert it.
      const flat_range own = intersect(r, shard_);
      if (!own.empty()) {
        std::vector<T> slice(own.size());
        backend_.download(slice.data(), values + (own.begin - r.begin), own.size());
        host_.convert(h_master_.data() + (own.begin - shard_.begin), slice.data(), own.size());
      }
    } else if constexpr (!Policy::master_is_param) {
      const flat_range own = intersect(r, shard_);
      if (!own.empty()) backend_.convert(master_.data() + (own.begin - shard_.begin), values + (own.begin - r.begin), own.size());
    }
  }

  // ---- gradients --------------------------------------------------------------
  // Adds `src` * scale (numel(i) elements, any storage type, backend memory) to
  // parameter i's gradient; scale is e.g. 1 / gradient_accumulation_steps. Stages 2
  // and 3 reduce a bucket once all its parameters have reported in this backward pass
  // and every later bucket has gone.
  template <storage_type S>
  void accumulate_grad(std::size_t i, const S* src, float scale = 1.0f) {
    const std::size_t s = slot(i);
    const flat_range r = layout_.param_range(s);
    require_not_reduced("accumulate_grad", i);
    if (!std::isfinite(scale)) {
      detail::throw_invalid("ZeroOptimizer::accumulate_grad(" + std::to_string(i) + "): scale = " +
                            std::to_string(scale) +
                            " would make every gradient non-finite; pass a finite multiplier, e.g. 1 / "
                            "gradient_accumulation_steps (the default is 1)");
    }
    check_source(src, i, "accumulate_grad");
    in_backward_ = true;
    grads_pending_ = true;
    if constexpr (zero_stage < 2) {
      backend_.accumulate(grads_.data() + r.begin, src, r.size(), scale);
    } else {
      const std::size_t b = buckets_.bucket_of(s);
      const bucket& bk = buckets_.buckets()[b];
      if (!offloaded && direct_[b]) {
        // Nothing to reduce (one rank, the gradient dtype on the wire): straight into the
        // gradient partition, as stage 0 does, with no staging or receive buffer.
        backend_.accumulate(grads_.data() + (r.begin - shard_.begin), src, r.size(), scale);
      } else {
        if (staging_of_[b] < 0) staging_of_[b] = acquire_staging();
        backend_.accumulate(staging_.data(staging_of_[b]) + (r.begin - bk.range.begin), src,
                            r.size(), scale);
      }
      if (!reported_[s]) {
        reported_[s] = 1;
        if (--remaining_[b] == 0) launch_ready_buckets();
      } else if (launched_[b] && (offloaded || !direct_[b])) {
        dirty_[b] = 1;  // reported again after its bucket went: reduce (or send) it once more at end_backward()
      }
    }
  }

  // Stages 0 and 1 keep the whole gradient, so it can also be written in place
  // (no copy); the reduction happens at step().
  std::span<grad_type> grad(std::size_t i) {
    if constexpr (zero_stage >= 2) {
      detail::throw_invalid("ZeroOptimizer::grad(" + std::to_string(i) +
                            "): gradients are partitioned at ZeRO stage 2 and 3; report them with accumulate_grad()");
    } else {
      const flat_range r = layout_.param_range(slot(i));
      require_not_reduced("grad", i);
      in_backward_ = true;
      grads_pending_ = true;
      return {grads_.data() + r.begin, static_cast<std::size_t>(r.size())};
    }
  }

  // Ends one backward pass: stages 2 and 3 reduce every bucket still pending
  // (parameters that got no gradient count as zero). Collective.
  void end_backward() {
    if constexpr (zero_stage >= 2) {
      launch_all_remaining();
      // A parameter reported again after its bucket was reduced (a second backward
      // through it, or a shared weight) makes its bucket dirty; all ranks agree on the
      // dirty set so that they issue the same reductions in the same order.
      if (!dirty_.empty()) {
        // (One rank agrees with itself: no round trip through the device.)
        if (world_ > 1) backend_.all_reduce_host(comm_, dirty_.data(), dirty_.size(), comm::reduce_op::max);
        for (std::size_t b = dirty_.size(); b-- > 0;) {
          if (dirty_[b]) launch(b);
        }
      }
      drain();
      std::fill(reported_.begin(), reported_.end(), std::uint8_t{0});
      std::fill(launched_.begin(), launched_.end(), std::uint8_t{0});
      std::fill(dirty_.begin(), dirty_.end(), std::int32_t{0});
      for (std::size_t b = 0; b < remaining_.size(); ++b) remaining_[b] = params_in_bucket_[b];
      launch_pos_ = 0;
      pass_ended_ = true;
    }
    in_backward_ = false;
  }

  // Drops all accumulated gradients. Collective when called during a backward pass at
  // stages 2 and 3: it ends the pass first (end_backward()), whose bucket reductions
  // every rank must join.
  void zero_grad() {
    if (in_backward_) end_backward();
    zero_all_grads();
    reduced_ = false;
  }

  // Finishes the reduction of this step's gradients now (step() does it otherwise):
  // afterwards every rank holds the rank-sum of its shard's gradients, and
  // full_grad() can read them. Collective.
  void reduce_gradients() {
    if (in_backward_) end_backward();
    if (reduced_) return;
    // Stages 2-3: a rank whose backward reached none of its parameters (its loss did not
    // use them this time) ends one empty pass here, reducing zeros, so that it joins the
    // bucket reductions of the ranks whose pass did. (Every rank must still run the same
    // number of non-empty passes per step.)
    if constexpr (zero_stage >= 2) {
      if (!pass_ended_) end_backward();
    }
    if constexpr (zero_stage < 2) {
      // One run of the Wire type by default; with per-parameter wire dtypes, one run per
      // stretch of equal dtype, in flat order on every rank. A run in another dtype goes
      // through it at one rank too, so the bits do not depend on the world size or the
      // stage (stages 2 and 3 always send their buckets).
      for (const wire_run& run : runs_) {
        visit_dtype(run.wire, [&]<class T>(T*) {
          if constexpr (std::same_as<T, grad_type>) {
            if (world_ > 1) reduce_in_place(run.range);
          } else {
            reduce_on_wire<T>(run.range);
          }
        });
      }
    }
    if constexpr (offloaded && zero_stage == 1) {
      // The reduced shard goes to the host partition (stages 2-3 did this bucket by bucket).
      backend_.download(h_grads_.data(), grads_.data() + shard_.begin, shard_.size());
    }
    reduced_ = true;
  }

  // Parameter i's reduced gradient as the optimizer will use it (averaged over ranks
  // if so configured, unscaled by the loss scale, before clipping), in host memory.
  // Reduces first if needed. Collective (pieces live on their owners).
  std::vector<float> full_grad(std::size_t i) {
    const flat_range r = layout_.param_range(slot(i));  // a bad index throws before the collective
    reduce_gradients();
    const flat_range own = intersect(r, shard_);
    std::vector<float> out(r.size(), 0.0f);
    if (!own.empty()) {
      std::vector<grad_type> host(own.size());
      if constexpr (offloaded) {
        host_.copy(host.data(), h_grads_.data() + (own.begin - shard_.begin), own.size());
      } else {
        backend_.download(host.data(), shard_grads() + (own.begin - shard_.begin), own.size());
      }
      for (std::uint64_t k = 0; k < own.size(); ++k) out[own.begin - r.begin + k] = to_float(host[k]);
    }
    // Stage 0 holds everything everywhere; otherwise each element has one owner.
    if (zero_stage > 0 && world_ > 1) backend_.all_reduce_host(comm_, out.data(), out.size(), comm::reduce_op::sum);
    const double unscale = (zo_.average_gradients ? 1.0 / world_ : 1.0) / (scaler_ ? scaler_->scale() : 1.0);
    for (float& v : out) v = static_cast<float>(v * unscale);
    return out;
  }

  // ---- the step -----------------------------------------------------------------
  // Reduces what is left, checks for overflow on all ranks, clips, updates this
  // rank's shard, gathers the parameters (stages 1 and 2) and zeroes the gradients.
  // Collective. Throws loss_scale_error (on every rank) when fp16 training diverges.
  step_report step() {
    require_no_gathered_groups("step");
    reduce_gradients();
    const double W = static_cast<double>(world_);
    const grad_stats local = offloaded ? host_.stats(h_grads_.data(), shard_.size()) : backend_.stats(shard_grads(), shard_.size());
    double norm_sq = local.nonfinite ? std::numeric_limits<double>::infinity() : local.norm_squared;
    // One all-reduce agrees on the squared norm (stage 0 computed the whole norm on
    // every rank; the others sum their partitions) and on how many ranks reported
    // gradients since the last step.
    double sums[2] = {zero_stage > 0 ? norm_sq : 0.0, grads_pending_ ? 1.0 : 0.0};
    if (world_ > 1) backend_.all_reduce_host(comm_, sums, 2, comm::reduce_op::sum);
    if (zero_stage > 0) norm_sq = sums[0];
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
    const double unscale = (zo_.average_gradients ? 1.0 / W : 1.0) / rep.loss_scale;
    rep.grad_norm = std::sqrt(norm_sq) * unscale;
    if (scaler_) {
      rep.skipped = scaler_->update(rep.overflow);  // may throw loss_scale_error, alike on every rank
    } else {
      rep.skipped = rep.overflow && zo_.check_overflow;
    }
    if (!rep.skipped) {
      rep.clip_coefficient = clip_coefficient(rep.grad_norm, zo_.gradient_clipping);
      ++steps_;
      const auto args = make_step_args<Optimizer>(opt_, steps_, static_cast<float>(unscale * rep.clip_coefficient), zo_.seed);
      if constexpr (offloaded) {
        run_offloaded_step(args);
      } else {
        stepper_->run(args);
      }
      gather_updated_params();
    }
    rep.step = steps_;
    zero_all_grads();
    reduced_ = false;  // only now: a throw above (loss_scale_error) leaves the reduced gradients marked so
    return rep;
  }

  // ---- ZeRO-3 parameter gathering -----------------------------------------------
  // Makes parameters [first, end) available through param(). prefetch() starts the
  // gather without waiting; gather() waits for it (or does it). Collective.
  void prefetch(std::size_t first, std::size_t end) requires(zero_stage == 3) {
    const auto key = std::make_pair(first, end);
    if (groups_.count(key)) return;
    const flat_range r = gather_range(first, end);
    // A partitioned parameter belongs to one gathered group at a time: its param() points
    // into that group's copy, and releasing either of two groups would drop the other's
    // pointer. (Persistent and empty parameters are never gathered: ranges may share them.)
    for (const auto& [other, g] : groups_) {
      for (std::size_t i = std::max(first, other.first); i < std::min(end, other.second); ++i) {
        const flat_range p = layout_.param_range(slot(i));
        if (p.empty() || p.begin >= persistent_begin_) continue;
        detail::throw_invalid("ZeroOptimizer::gather/prefetch(" + std::to_string(first) + ", " + std::to_string(end) +
                              "): parameter " + std::to_string(i) + " is already in the gathered group [" +
                              std::to_string(other.first) + ", " + std::to_string(other.second) +
                              "); release() that group first, or gather exactly that range");
      }
    }
    gathered_group g;
    g.range = r;
    // One rank holds every element: its partition is the gathered parameters (no copy).
    if (!r.empty() && world_ > 1) {
      g.data = backend_.template allocate<param_type>(r.size());
      const std::vector<std::uint64_t> counts = layout_.rank_counts(r);
      const flat_range own = intersect(r, shard_);
      const param_type* in = params_.data() + (own.empty() ? 0 : own.begin - shard_.begin);
      backend_.before_comm(comm_);
      g.request.emplace(comm_.iall_gather_v(in, counts[static_cast<std::size_t>(rank_)], g.data.data(), counts));
    }
    groups_.emplace(key, std::move(g));
  }

  void gather(std::size_t first, std::size_t end) requires(zero_stage == 3) {
    prefetch(first, end);
    const auto it = groups_.find(std::make_pair(first, end));
    gathered_group& g = it->second;
    if (g.request) {
      wait_or_abandon(it);
      g.request.reset();
    }
    for (std::size_t i = first; i < end; ++i) {
      const std::size_t s = slot(i);
      const std::uint64_t off = layout_.offset(s);
      if (off < persistent_begin_) {
        gathered_[s] = world_ > 1 ? g.data.data() + (off - g.range.begin) : params_.data() + (off - shard_.begin);
      }
    }
  }

  // Frees the gathered copy of [first, end) (after its all-gather, if prefetched).
  //
  // A group whose all-gather fails (its wait throws, in gather() or here) is forgotten all
  // the same before the error leaves: a later gather() of the range posts a new all-gather
  // instead of handing out a copy that may be garbage, or stale after a step(). Its memory
  // is kept until the optimizer goes, since an abandoned collective may still write into it.
  void release(std::size_t first, std::size_t end) requires(zero_stage == 3) {
    auto it = groups_.find(std::make_pair(first, end));
    if (it == groups_.end()) {
      detail::throw_invalid("ZeroOptimizer::release(" + std::to_string(first) + ", " + std::to_string(end) +
                            "): that group is not gathered; release exactly the ranges you gathered");
    }
    if (it->second.request) wait_or_abandon(it);
    unbind_group(first, end);
    groups_.erase(it);
  }

  // ---- inspection -----------------------------------------------------------------
  const flat_layout& layout() const noexcept { return layout_; }
  // The flat range of elements whose master weights and states this rank updates.
  flat_range shard() const noexcept { return shard_; }
  std::uint64_t steps() const noexcept { return steps_; }
  // Whether gradients were reported since the last step() or zero_grad() (checkpoints
  // refuse to run then: they hold no gradients).
  bool grads_pending() const noexcept { return grads_pending_; }
  double loss_scale() const noexcept { return scaler_ ? scaler_->scale() : 1.0; }
  const std::optional<loss_scaler>& scaler() const noexcept { return scaler_; }
  const typename Optimizer::options& options() const noexcept { return opt_; }
  // The threading of the host step (offload: the offloaded step's, which copies the host
  // backend's; otherwise the host backend's).
  const host::options& host_options() const noexcept {
    if constexpr (offloaded || !std::is_same_v<Backend, host_backend>) {
      return host_.options;
    } else {
      return backend_.options;
    }
  }
  void set_options(const typename Optimizer::options& o) {
    (void)Optimizer::prepare(o, 1);
    opt_ = o;
  }
  // Flat element index of parameter i's first element.
  std::uint64_t flat_offset(std::size_t i) const { return layout_.offset(slot(i)); }

  // Calls out(flat index, value) for the master weights (or state `which`) of this
  // rank's shard, copied to the host. For checkpoints and tests.
  template <class Out>
  void read_master_shard(Out&& out) const {
    for (const auto& t : shard_tensors_) {
      if constexpr (Policy::master_is_param) {
        read_values(t.param, t.numel, t.global_offset, out);
      } else {
        read_values(t.master, t.numel, t.global_offset, out);
      }
    }
  }
  template <class Out>
  void read_state_shard(int which, Out&& out) const {
    if (which < 0 || which >= n_states) {
      detail::throw_invalid("ZeroOptimizer::read_state_shard: state " + std::to_string(which) + " does not exist; " +
                            std::string(optim::name_of<Optimizer>(opt_)) + " has " + std::to_string(n_states));
    }
    for (const auto& t : shard_tensors_) read_values(t.states[which], t.numel, t.global_offset, out);
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
  std::uint64_t save_checkpoint(const std::filesystem::path& dir) {
    const std::uint64_t id = agreed_save_id();
    agree("save_checkpoint", "the checkpoint in " + checkpoint::detail::quoted(dir) + " is incomplete", [&] {
      require_no_pending_grads("save_checkpoint");
      if (zero_stage == 0 && rank_ != 0) return;  // every rank holds the same state
      std::vector<host_piece> pieces = download_shard();
      checkpoint::shard_header h = checkpoint_header(id);
      const std::vector<std::size_t> user = user_of_slot();
      struct source {
        std::size_t piece;
        std::uint64_t at;  // in the piece
      };
      std::vector<source> from;
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        for (const segment& sg : layout_.segments(pieces[k].range)) {
          h.records.push_back({user[sg.param], sg.param_offset, sg.count, 0});
          from.push_back({k, sg.flat_offset - pieces[k].range.begin});
        }
      }
      const std::vector<checkpoint::record> records = h.records;
      checkpoint::write_shard(checkpoint::shard_path(dir, static_cast<std::uint32_t>(rank_)), std::move(h),
                              [&](std::size_t r, auto&& write) {
                                const host_piece& p = pieces[from[r].piece];
                                const std::uint64_t at = from[r].at, n = records[r].count;
                                const auto put = [&](const auto* v) { write(v + at, n * sizeof(*v)); };
                                put(p.params.data());
                                if constexpr (!Policy::master_is_param) put(p.master.data());
                                for (const auto& st : p.states) put(st.data());
                              });
    });
    // Every file of this save is in place: what an earlier, larger save left goes. Each rank
    // removes what it sees (a directory per node, or one shared: removing twice is harmless).
    checkpoint::remove_stale_shards(dir, shard_files());
    return id;
  }

  void load_checkpoint(const std::filesystem::path& dir) {
    std::vector<host_piece> pieces;
    std::uint64_t steps = 0;
    std::optional<loss_scaler> scaler;
    // Everything is read and checked first; the optimizer changes only once every rank has its part.
    agree("load_checkpoint", "nothing was loaded on this rank", [&] {
      require_no_pending_grads("load_checkpoint");
      require_no_gathered_groups("load_checkpoint");
      read_checkpoint(dir, pieces, steps, scaler);
    });
    if constexpr (offloaded) wait_uploads();  // they read the host buffers rewritten here
    for (const host_piece& p : pieces) {
      const std::uint64_t n = p.range.size(), at = p.range.begin - shard_.begin;
      backend_.upload(shard_params(p.range), p.params.data(), n);
      if constexpr (offloaded) {
        if constexpr (Policy::master_is_param) {
          host_.copy(h_master_.data() + at, p.params.data(), n);
        } else {
          host_.copy(h_master_.data() + at, p.master.data(), n);
        }
        for (int k = 0; k < n_states; ++k) host_.copy(h_states_[k].data() + at, p.states[k].data(), n);
      } else {
        if constexpr (!Policy::master_is_param) backend_.upload(master_.data() + at, p.master.data(), n);
        for (int k = 0; k < n_states; ++k) backend_.upload(states_[k].data() + at, p.states[k].data(), n);
      }
    }
    steps_ = steps;
    if (scaler) scaler_ = std::move(scaler);
    gather_updated_params();
  }

  memory_report memory() const {
    memory_report m;
    m.params = params_.bytes() + persistent_.bytes();
    m.grads = grads_.bytes();
    m.master = master_.bytes();
    for (const auto& s : states_) m.states += s.bytes();
    m.buckets += staging_.bytes() + recv_pools_.bytes() + wire_pools_.bytes();
    for (const auto& [k, g] : groups_) m.buckets += g.data.bytes();
    m.host_master = h_master_.bytes();
    m.host_grads = h_grads_.bytes();
    for (const auto& s : h_states_) m.host_states += s.bytes();
    m.host_buckets = h_params_.bytes() + host_pools_.bytes();
    m.model_numel = layout_.total_numel();
    m.padding_numel = layout_.padded_numel() - layout_.total_numel();
    return m;
  }

 private:
  template <class T>
  using buffer = typename Backend::template buffer<T>;
  using request_t = typename Comm::request_type;

  // A flat range whose gradients travel in one dtype.
  struct wire_run {
    flat_range range;
    dtype wire;
  };
  // Reusable buffers of the three wire dtypes: a buffer is taken for one reduction and
  // given back when it completes. Buffers are the backend's, or host memory from a
  // host_allocator (the offload's staging of downloads).
  template <class T, class Buf = buffer<T>>
  struct pool {
    std::vector<Buf> bufs;
    std::vector<std::uint8_t> busy;
    int acquire(const Backend& be, std::uint64_t n) {
      return acquire_with(n, [&](std::uint64_t m) { return be.template allocate<T>(m); });
    }
    int acquire(const host_allocator& mem, std::uint64_t n) {
      return acquire_with(n, [&](std::uint64_t m) { return host_buffer<T>(m, mem); });
    }
    template <class Make>
    int acquire_with(std::uint64_t n, Make&& make) {
      for (std::size_t i = 0; i < bufs.size(); ++i) {
        if (!busy[i] && bufs[i].size() >= n) {
          busy[i] = 1;
          return static_cast<int>(i);
        }
      }
      bufs.push_back(make(std::max<std::uint64_t>(n, 1)));
      busy.push_back(1);
      return static_cast<int>(bufs.size() - 1);
    }
    T* data(int i) { return bufs[static_cast<std::size_t>(i)].data(); }
    void release(int i) { busy[static_cast<std::size_t>(i)] = 0; }
    std::uint64_t bytes() const {
      std::uint64_t b = 0;
      for (const auto& x : bufs) b += x.bytes();
      return b;
    }
  };
  template <template <class> class Buf = buffer>
  struct pools {
    pool<float, Buf<float>> f32;
    pool<bf16, Buf<bf16>> b16;
    pool<fp16, Buf<fp16>> f16;
    template <class T>
    pool<T, Buf<T>>& get() {
      if constexpr (std::same_as<T, float>) return f32;
      else if constexpr (std::same_as<T, bf16>) return b16;
      else return f16;
    }
    std::uint64_t bytes() const { return f32.bytes() + b16.bytes() + f16.bytes(); }
  };
  // One bucket's reduction: one collective per wire run.
  struct in_flight {
    struct part {
      wire_run run;
      int recv;  // in recv_pools_, of the run's dtype
      request_t request;
    };
    std::size_t bucket;
    int staging = -1;             // the gradient-typed bucket while a run sends from it, else -1
    int wire[3] = {-1, -1, -1};   // per dtype: the wire-typed copy of the bucket (in wire_pools_), or -1
    std::vector<part> parts;
  };
  struct gathered_group {
    flat_range range;
    buffer<param_type> data;
    std::optional<request_t> request;
  };

  template <class T, class Out>
  void read_values(const T* p, std::uint64_t n, std::uint64_t first, Out& out) const {
    std::vector<T> host(n);
    if constexpr (offloaded) {
      host_.copy(host.data(), p, n);  // the shard tensors point at host memory
    } else {
      backend_.download(host.data(), p, n);
    }
    for (std::uint64_t k = 0; k < n; ++k) out(first + k, to_float(host[k]));
  }

  // ---- checkpoints ------------------------------------------------------------------
  // A part of this rank's shard in host memory: flat elements `range`.
  struct host_piece {
    flat_range range;
    std::vector<param_type> params;
    std::vector<master_type> master;  // empty when the master is the parameter
    std::array<std::vector<state_type>, n_states> states;

    explicit host_piece(flat_range r) : range(r), params(r.size()) {
      if constexpr (!Policy::master_is_param) master.resize(r.size());
      for (auto& s : states) s.resize(r.size());
    }
  };

  // The shard in pieces of contiguous storage: stage 3 keeps partitioned and persistent
  // parameters in separate buffers.
  std::vector<flat_range> shard_pieces() const {
    std::vector<flat_range> out;
    if constexpr (zero_stage == 3) {
      out.push_back(intersect(shard_, flat_range{0, persistent_begin_}));
      out.push_back(intersect(shard_, flat_range{persistent_begin_, layout_.padded_numel()}));
    } else {
      out.push_back(shard_);
    }
    std::erase_if(out, [](const flat_range& r) { return r.empty(); });
    return out;
  }
  // Where the parameters of a shard piece live (backend memory).
  param_type* shard_params(flat_range p) {
    if constexpr (zero_stage < 3) {
      return params_.data() + p.begin;
    } else {
      return p.begin < persistent_begin_ ? params_.data() + (p.begin - shard_.begin)
                                         : persistent_.data() + (p.begin - persistent_begin_);
    }
  }
  std::vector<std::size_t> user_of_slot() const {
    std::vector<std::size_t> user(slot_of_.size());
    for (std::size_t i = 0; i < slot_of_.size(); ++i) user[slot_of_[i]] = i;
    return user;
  }

  // The n values at v become their largest over the ranks (the agreements' collective).
  void all_reduce_max(std::int32_t* v, int n) { backend_.all_reduce_host(comm_, v, n, comm::reduce_op::max); }

  // Runs f, then every rank learns whether any rank failed (detail::agree_on_failure).
  template <class F>
  void agree(const char* who, const std::string& consequence, F&& f) {
    detail::agree_on_failure(
        rank_, world_, [&](std::int32_t* v, int n) { all_reduce_max(v, n); }, "ZeroOptimizer::" + std::string(who),
        consequence, std::forward<F>(f));
  }

  // Gradients already reduced for this step take no more additions: step() or
  // zero_grad() comes first.
  void require_not_reduced(const char* who, std::size_t i) const {
    if (reduced_) {
      detail::throw_invalid("ZeroOptimizer::" + std::string(who) + "(" + std::to_string(i) +
                            "): this step's gradients were already reduced (reduce_gradients() or full_grad()); "
                            "call step() or zero_grad() before the next backward");
    }
  }

  // A parameter's source values: not null (unless the parameter is empty), and memory
  // the backend's kernels can read (a device backend checks its pointers).
  template <class T>
  void check_source(const T* p, std::size_t i, const char* who) const {
    if (numel(i) == 0) return;
    if (p == nullptr) {
      detail::throw_invalid("ZeroOptimizer::" + std::string(who) + "(" + std::to_string(i) + "): the pointer is null; pass " +
                            std::to_string(numel(i)) + " values");
    }
    if constexpr (requires { backend_.check_readable(static_cast<const void*>(p), std::string()); }) {
      backend_.check_readable(static_cast<const void*>(p), "ZeroOptimizer::" + std::string(who) + "(" + std::to_string(i) + ")");
    }
  }

  // Stage 3: what rewrites the partitions (step, load_param, load_checkpoint) needs
  // every group released: a gathered copy would keep the old values, and a prefetch
  // still in flight reads the partitions while they are written. Groups are gathered
  // collectively, so every rank refuses alike.
  void require_no_gathered_groups(const char* who) const {
    if constexpr (zero_stage == 3) {
      if (!groups_.empty()) {
        const auto& [first, end] = groups_.begin()->first;
        detail::throw_invalid("ZeroOptimizer::" + std::string(who) + ": " + std::to_string(groups_.size()) +
                              " parameter group(s) are gathered (e.g. [" + std::to_string(first) + ", " +
                              std::to_string(end) + ")); release() them first: this rewrites the partitions they "
                              "were gathered from, and a gathered copy would keep the old values");
      }
    }
  }

  void require_no_pending_grads(const char* who) const {
    if (grads_pending_ || reduced_) {  // (in_backward_ implies grads_pending_)
      detail::throw_invalid("ZeroOptimizer::" + std::string(who) +
                            ": gradients were reported since the last step(); a checkpoint holds weights and optimizer "
                            "states, not gradients. Call it after step() or zero_grad()");
    }
  }

  // One id for every file of a save, so that a load can tell files of two saves apart.
  std::uint64_t agreed_save_id() {
    std::uint64_t bits = 0;
    try {
      std::random_device rd;
      bits = (std::uint64_t{rd()} << 32) ^ rd();
    } catch (...) {  // no entropy source: the clock and the rank (a throw here would skip the all-reduce)
      bits = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9E3779B97F4A7C15ull ^
             static_cast<std::uint64_t>(rank_);
    }
    // 52 bits: exact in a double, which every communicator reduces.
    double id = static_cast<double>(bits & ((std::uint64_t{1} << 52) - 1));
    if (world_ > 1) backend_.all_reduce_host(comm_, &id, 1, comm::reduce_op::max);
    return static_cast<std::uint64_t>(id);
  }

  // How many shard files a save writes: one in all at stage 0, one per rank otherwise.
  std::uint32_t shard_files() const noexcept { return zero_stage == 0 ? 1u : static_cast<std::uint32_t>(world_); }

  checkpoint::shard_header checkpoint_header(std::uint64_t id) const {
    checkpoint::shard_header h;
    h.save_id = id;
    h.rank = static_cast<std::uint32_t>(rank_);
    h.world = static_cast<std::uint32_t>(world_);
    h.files = shard_files();
    h.stage = static_cast<std::uint32_t>(zero_stage);
    h.param = dtype_of_v<param_type>;
    h.master = dtype_of_v<master_type>;
    h.state = dtype_of_v<state_type>;
    h.has_master = !Policy::master_is_param;
    h.n_states = static_cast<std::uint32_t>(n_states);
    h.optimizer = std::string(optim::name_of<Optimizer>(opt_));
    h.steps = steps_;
    if (scaler_) {
      const loss_scaler::state st = scaler_->save();
      h.scaler = checkpoint::scaler_record{st.scale, st.hysteresis_left, st.clean_steps, st.last_overflow_iter, st.iter};
    }
    for (std::size_t i = 0; i < num_params(); ++i) h.numels.push_back(numel(i));
    return h;
  }

  std::vector<host_piece> download_shard() {
    if constexpr (offloaded) wait_uploads();  // the device parameters are read next
    std::vector<host_piece> out;
    for (const flat_range& r : shard_pieces()) {
      host_piece& p = out.emplace_back(r);
      const std::uint64_t n = r.size(), at = r.begin - shard_.begin;
      backend_.download(p.params.data(), shard_params(r), n);
      if constexpr (offloaded) {
        if constexpr (!Policy::master_is_param) host_.copy(p.master.data(), h_master_.data() + at, n);
        for (int k = 0; k < n_states; ++k) host_.copy(p.states[k].data(), h_states_[k].data() + at, n);
      } else {
        if constexpr (!Policy::master_is_param) backend_.download(p.master.data(), master_.data() + at, n);
        for (int k = 0; k < n_states; ++k) backend_.download(p.states[k].data(), states_[k].data() + at, n);
      }
    }
    return out;
  }

  // The checks a checkpoint's first file must pass to load here.
  void check_loadable(const checkpoint::shard_header& h, const std::filesystem::path& path) const {
    const std::string where = "ZeroOptimizer::load_checkpoint: " + checkpoint::detail::quoted(path);
    if (h.numels.size() != num_params()) {
      detail::throw_invalid(where + " holds " + std::to_string(h.numels.size()) + " parameters; this optimizer has " +
                            std::to_string(num_params()) +
                            ". Load it into a model with the same parameters, in the same order");
    }
    for (std::size_t i = 0; i < num_params(); ++i) {
      if (h.numels[i] != numel(i)) {
        detail::throw_invalid(where + ": parameter " + std::to_string(i) + " has " + std::to_string(h.numels[i]) +
                              " elements there and " + std::to_string(numel(i)) +
                              " here. Load it into a model with the same parameters, in the same order");
      }
    }
    const auto adam_family = [](std::string_view n) { return n == "Adam" || n == "AdamW"; };
    const std::string_view mine = optim::name_of<Optimizer>(opt_);
    const bool same = h.optimizer == mine || (adam_family(h.optimizer) && adam_family(mine));
    if (!same || h.n_states != static_cast<std::uint32_t>(n_states)) {
      detail::throw_invalid(where + " holds " + h.optimizer + " states (" + std::to_string(h.n_states) +
                            " per element); this optimizer is " + std::string(mine) +
                            ". Load it with the optimizer it was saved with (Adam and AdamW share their states)");
    }
  }

  // Reads this rank's pieces of the checkpoint in `dir` into host memory; changes nothing.
  void read_checkpoint(const std::filesystem::path& dir, std::vector<host_piece>& pieces, std::uint64_t& steps,
                       std::optional<loss_scaler>& scaler) const {
    checkpoint::shard_set files(dir, "ZeroOptimizer::load_checkpoint",
                                [&](const checkpoint::shard_header& h, const std::filesystem::path& p) {
                                  check_loadable(h, p);
                                });
    const checkpoint::shard_header& h0 = files.first();
    if (scaler_ && h0.scaler) {
      loss_scaler s = *scaler_;
      const checkpoint::scaler_record& r = *h0.scaler;
      s.load(loss_scaler::state{r.scale, r.hysteresis_left, r.clean_steps, r.last_overflow_iter, r.iter});
      scaler = std::move(s);
    }
    steps = h0.steps;
    const std::vector<std::size_t> user = user_of_slot();
    for (const flat_range& range : shard_pieces()) {
      host_piece& p = pieces.emplace_back(range);
      for (const segment& sg : layout_.segments(range)) {
        const std::uint64_t base = sg.flat_offset - range.begin;
        files.for_each_run(user[sg.param], sg.param_offset, sg.count, [&](const checkpoint::shard_set::run& r) {
          const checkpoint::shard_header& h = files.header(r.file);
          const auto read = [&]<class T>(int which, T* dst) {
            files.read(r, which, [&](const auto* src, std::uint64_t n) { host_.convert(dst + base + r.at, src, n); });
          };
          if constexpr (Policy::master_is_param) {
            read(h.has_master ? 1 : 0, p.params.data());  // the saved master is the finer source
          } else {
            // The saved parameters when the dtype is the same (bit for bit, stochastic rounding
            // included); otherwise rounded once from the saved master.
            const bool same_param = h.param == dtype_of_v<param_type>;
            read(h.has_master && !same_param ? 1 : 0, p.params.data());
            read(h.has_master ? 1 : 0, p.master.data());
          }
          for (int k = 0; k < n_states; ++k) read((h.has_master ? 2 : 1) + k, p.states[k].data());
        }, "that this rank needs");
      }
    }
  }

  std::size_t slot(std::size_t i) const {
    if (i >= slot_of_.size()) {
      detail::throw_invalid("ZeroOptimizer: parameter index " + std::to_string(i) + " is out of range; the optimizer has " +
                            std::to_string(slot_of_.size()) + " parameters");
    }
    return slot_of_[i];
  }

  void build_layout(std::span<const std::uint64_t> numels) {
    const std::size_t n = numels.size();
    std::vector<std::size_t> order;
    order.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
      if (numels[i] > zo_.param_persistence_threshold) order.push_back(i);
    const std::size_t n_large = order.size();
    for (std::size_t i = 0; i < n; ++i)
      if (numels[i] <= zo_.param_persistence_threshold) order.push_back(i);
    slot_of_.assign(n, 0);
    std::vector<std::uint64_t> slot_numels(n);
    for (std::size_t s = 0; s < n; ++s) {
      slot_of_[order[s]] = s;
      slot_numels[s] = numels[order[s]];
    }
    layout_ = flat_layout(slot_numels, world_, zo_.layout);
    persistent_begin_ = n_large < n ? layout_.offset(n_large) : layout_.total_numel();
    // Nothing is persistent below stage 3, nor when only empty parameters are small:
    // the padding then stays partitioned with the rest.
    if (zero_stage < 3 || persistent_begin_ == layout_.total_numel()) persistent_begin_ = layout_.padded_numel();
    shard_ = zero_stage == 0 ? flat_range{0, layout_.padded_numel()} : layout_.partition(rank_);
    plan_wire_runs(order);
    if constexpr (zero_stage >= 2) {
      // The small parameters (placed last) get buckets of their own, reduced after the
      // others (bucket_plan::launch_order): they fill only as backward ends.
      buckets_ = bucket_plan(layout_, zo_.reduce_bucket_numel, n_large);
      const std::size_t nb = buckets_.buckets().size();
      // Each bucket's runs of equal wire dtype (one run, the whole bucket, by default).
      bucket_runs_.assign(nb, {});
      for (std::size_t b = 0; b < nb; ++b) {
        const flat_range br = buckets_.buckets()[b].range;
        for (const wire_run& run : runs_) {
          const flat_range r = intersect(run.range, br);
          if (!r.empty()) bucket_runs_[b].push_back(wire_run{r, run.wire});
        }
        // A bucket of empty parameters still takes part (a reduction of nothing).
        if (bucket_runs_[b].empty()) bucket_runs_[b].push_back(wire_run{br, dtype_of_v<Wire>});
      }
      // One rank reduces nothing: a bucket whose gradients travel in the gradient dtype
      // (no wire rounding to keep) accumulates straight into the partition, which at
      // world size 1 is the whole gradient. With offload the partition is in host memory
      // and the reports are not: the staged bucket goes there as it is (send_to_host).
      direct_.assign(nb, 0);
      for (std::size_t b = 0; b < nb; ++b) {
        direct_[b] = world_ == 1 &&
                     std::all_of(bucket_runs_[b].begin(), bucket_runs_[b].end(),
                                 [](const wire_run& w) { return w.wire == dtype_of_v<grad_type>; });
      }
      params_in_bucket_.assign(nb, 0);
      for (std::size_t s = 0; s < n; ++s) ++params_in_bucket_[buckets_.bucket_of(s)];
      remaining_ = params_in_bucket_;
      staging_of_.assign(nb, -1);
      launched_.assign(nb, 0);
      dirty_.assign(nb, 0);
      reported_.assign(n, 0);
      launch_pos_ = 0;
    }
  }

  // Validates zero_options::wire_dtypes and splits [0, padded) into runs of equal wire
  // dtype, in flat order. The padding tail travels with the last run (it is zero).
  void plan_wire_runs(const std::vector<std::size_t>& order) {
    const std::vector<dtype>& wd = zo_.wire_dtypes;
    if (!wd.empty() && wd.size() != order.size()) {
      detail::throw_invalid("ZeroOptimizer: zero_options::wire_dtypes has " + std::to_string(wd.size()) +
                            " entries for " + std::to_string(order.size()) +
                            " parameters; give one mpzero::dtype per parameter, in the order of numels, or leave it "
                            "empty (every gradient then travels in " + std::string(name_of(dtype_of_v<Wire>)) + ")");
    }
    for (std::size_t i = 0; i < wd.size(); ++i) {
      if (wd[i] != dtype::fp32 && wd[i] != dtype::bf16 && wd[i] != dtype::fp16) {
        detail::throw_invalid("ZeroOptimizer: zero_options::wire_dtypes[" + std::to_string(i) + "] = " +
                              std::to_string(static_cast<int>(wd[i])) +
                              " is not a dtype; use mpzero::dtype::fp32, dtype::bf16 or dtype::fp16");
      }
      // The Wire static_assert's rule, for the run-time list.
      for (const dtype own : {dtype_of_v<param_type>, dtype_of_v<grad_type>}) {
        if (detail::mixes_16bit(wd[i], own)) {
          detail::throw_invalid("ZeroOptimizer: zero_options::wire_dtypes[" + std::to_string(i) + "] = " +
                                std::string(name_of(wd[i])) + " mixes bf16 and fp16 with this policy's " +
                                std::string(name_of(own)) + " (fp16 overflows above 65504 and nothing scales it); use " +
                                std::string(name_of(own)) + " or fp32");
        }
      }
    }
    runs_.clear();
    const std::uint64_t padded = layout_.padded_numel();
    for (std::size_t s = 0; s < order.size(); ++s) {
      const flat_range r = layout_.param_range(s);
      if (r.empty()) continue;
      const dtype d = wd.empty() ? dtype_of_v<Wire> : wd[order[s]];
      if (!runs_.empty() && runs_.back().wire == d) {
        runs_.back().range.end = r.end;  // parameters are contiguous in the flat buffer
      } else {
        runs_.push_back(wire_run{r, d});
      }
    }
    if (runs_.empty()) {
      runs_.push_back(wire_run{flat_range{0, padded}, dtype_of_v<Wire>});
    } else {
      runs_.front().range.begin = 0;
      runs_.back().range.end = padded;
    }
    for (const wire_run& x : runs_) {
      std::uint64_t& l = longest_run_[dtype_index(x.wire)];
      l = std::max(l, x.range.size());
    }
  }

  void allocate() {
    const std::uint64_t padded = layout_.padded_numel();
    if constexpr (zero_stage < 3) {
      params_ = backend_.template allocate<param_type>(padded);
    } else {
      params_ = backend_.template allocate<param_type>(intersect(shard_, flat_range{0, persistent_begin_}).size());
      persistent_ = backend_.template allocate<param_type>(padded - persistent_begin_);
      gathered_.assign(layout_.num_params(), nullptr);
    }
    if constexpr (offloaded) {
      // Pinned when the backend can pin (and zo_.pin_memory): transfers then run on the copy engines.
      const host_allocator mem = backend_.host_memory(zo_.pin_memory);
      h_master_ = host_buffer<master_type>(shard_.size(), mem);
      for (auto& s : h_states_) s = host_buffer<state_type>(shard_.size(), mem);
      h_grads_ = host_buffer<grad_type>(shard_.size(), mem);
      if constexpr (!Policy::master_is_param) h_params_ = host_buffer<param_type>(shard_.size(), mem);
      if constexpr (zero_stage == 1) grads_ = backend_.template allocate<grad_type>(padded);
    } else {
      if constexpr (!Policy::master_is_param) master_ = backend_.template allocate<master_type>(shard_.size());
      grads_ = backend_.template allocate<grad_type>(zero_stage >= 2 ? shard_.size() : padded);
      for (auto& s : states_) s = backend_.template allocate<state_type>(shard_.size());
    }
  }

  void zero_all_grads() {
    grads_pending_ = false;
    pass_ended_ = false;
    backend_.zero(grads_.data(), grads_.size());
    // Stage 1 overwrites the host partition with each step's reduced shard instead.
    if constexpr (offloaded && zero_stage >= 2) host_.zero(h_grads_.data(), h_grads_.size());
  }

  // Offload: the host step in sub-groups. Each sub-group's parameters (written by the
  // host step in the parameter dtype) are uploaded on the backend's copy stream while
  // the host updates the next sub-group; the backend's later work (the gather, the next
  // forward) is ordered after the uploads, and the host waits for them only at the next
  // step, before it overwrites their source.
  void run_offloaded_step(const step_args<Optimizer>& args) {
    wait_uploads();
    for (auto& st : host_steppers_) {
      st.run(args);
      const auto& t = st.tensors().front();
      upload_params(flat_range{t.global_offset, t.global_offset + t.numel});
    }
    for (const auto& t : uploads_) backend_.order_after(t);
  }

  // Queues the upload of the updated parameters of r (a part of this rank's shard).
  void upload_params(flat_range r) {
    const param_type* src = nullptr;
    if constexpr (Policy::master_is_param) {
      src = h_master_.data();
    } else {
      src = h_params_.data();
    }
    const auto up = [&](param_type* dst, flat_range piece) {
      if (!piece.empty()) uploads_.push_back(backend_.upload_async(dst, src + (piece.begin - shard_.begin), piece.size()));
    };
    if constexpr (zero_stage < 3) {
      up(params_.data() + r.begin, r);
    } else {
      const flat_range a = intersect(r, flat_range{0, persistent_begin_});
      const flat_range b = intersect(r, flat_range{persistent_begin_, layout_.padded_numel()});
      up(params_.data() + (a.begin - shard_.begin), a);
      up(persistent_.data() + (b.begin - persistent_begin_), b);
    }
  }

  // Splits tensors into pieces of at most zo_.offload_sub_group_numel elements.
  std::vector<step_tensor<Policy, Optimizer>> sub_groups(const std::vector<step_tensor<Policy, Optimizer>>& tensors) const {
    std::vector<step_tensor<Policy, Optimizer>> out;
    const std::uint64_t g = zo_.offload_sub_group_numel;
    for (const auto& t : tensors) {
      for (std::uint64_t off = 0; off < t.numel; off += g) {
        step_tensor<Policy, Optimizer> piece = t;
        piece.param += off;
        if constexpr (!Policy::master_is_param) piece.master += off;
        piece.grad += off;
        for (int k = 0; k < n_states; ++k) piece.states[k] += off;
        piece.numel = std::min(g, t.numel - off);
        piece.global_offset = t.global_offset + off;
        out.push_back(piece);
      }
    }
    return out;
  }

  // The shard as step tensors: one per shard_pieces() entry. Global offsets are flat offsets.
  std::vector<step_tensor<Policy, Optimizer>> shard_tensors() {
    if constexpr (offloaded) {
      // On the host every buffer is the shard, contiguous: one tensor.
      std::vector<step_tensor<Policy, Optimizer>> out;
      if (!shard_.empty()) {
        step_tensor<Policy, Optimizer> t;
        if constexpr (Policy::master_is_param) {
          t.param = h_master_.data();
        } else {
          t.param = h_params_.data();
          t.master = h_master_.data();
        }
        t.grad = h_grads_.data();
        for (int k = 0; k < n_states; ++k) t.states[k] = h_states_[static_cast<std::size_t>(k)].data();
        t.numel = shard_.size();
        t.global_offset = shard_.begin;
        out.push_back(t);
      }
      shard_tensors_ = out;
      return out;
    }
    std::vector<step_tensor<Policy, Optimizer>> out;
    for (const flat_range& p : shard_pieces()) {
      step_tensor<Policy, Optimizer> t;
      const std::uint64_t in_shard = p.begin - shard_.begin;
      t.param = shard_params(p);
      if constexpr (!Policy::master_is_param) t.master = master_.data() + in_shard;
      t.grad = shard_grads() + in_shard;
      for (int k = 0; k < n_states; ++k) t.states[k] = states_[static_cast<std::size_t>(k)].data() + in_shard;
      t.numel = p.size();
      t.global_offset = p.begin;
      out.push_back(t);
    }
    shard_tensors_ = out;
    return out;
  }

  const grad_type* shard_grads() const {
    return zero_stage >= 2 ? grads_.data() : grads_.data() + shard_.begin;
  }

  void gather_updated_params() {
    if (world_ == 1) return;
    backend_.before_comm(comm_);
    if constexpr (zero_stage == 1 || zero_stage == 2) {
      const std::vector<std::uint64_t> counts(static_cast<std::size_t>(world_), layout_.partition_numel());
      comm_.all_gather_v(params_.data() + shard_.begin, layout_.partition_numel(), params_.data(), counts);
    } else if constexpr (zero_stage == 3) {
      const flat_range r{persistent_begin_, layout_.padded_numel()};
      if (r.empty()) return;
      const std::vector<std::uint64_t> counts = layout_.rank_counts(r);
      // In place on every rank, as MPI requires of MPI_IN_PLACE: a rank whose block is
      // empty passes its (empty) block's place too.
      param_type* in = persistent_.data() + comm::detail::offset_of(counts, rank_);
      comm_.all_gather_v(in, counts[static_cast<std::size_t>(rank_)], persistent_.data(), counts);
    }
  }

  using group_iterator = typename std::map<std::pair<std::size_t, std::size_t>, gathered_group>::iterator;
  // Waits for a group's all-gather; if that throws, forgets the group (see release()).
  void wait_or_abandon(group_iterator it) {
    try {
      it->second.request->wait();
    } catch (...) {
      unbind_group(it->first.first, it->first.second);
      abandoned_groups_.push_back(std::move(it->second));
      groups_.erase(it);
      throw;
    }
  }
  void unbind_group(std::size_t first, std::size_t end) {
    for (std::size_t i = first; i < end; ++i) {
      const std::size_t s = slot(i);
      if (layout_.offset(s) < persistent_begin_) gathered_[s] = nullptr;
    }
  }

  flat_range gather_range(std::size_t first, std::size_t end) const {
    if (first > end || end > num_params()) {
      detail::throw_invalid("ZeroOptimizer::gather(" + std::to_string(first) + ", " + std::to_string(end) +
                            "): not a range of parameters [first, end) within [0, " + std::to_string(num_params()) + ")");
    }
    flat_range r{0, 0};
    bool any = false;
    for (std::size_t i = first; i < end; ++i) {
      const flat_range p = layout_.param_range(slot(i));
      if (p.begin >= persistent_begin_ || p.empty()) continue;
      r = any ? flat_range{std::min(r.begin, p.begin), std::max(r.end, p.end)} : p;
      any = true;
    }
    return r;
  }

  // ---- stage 2/3 buckets ----------------------------------------------------------
  int acquire_staging() {
    const std::size_t allocated = staging_.bufs.size();
    const int idx = staging_.acquire(backend_, max_bucket_numel());
    // Fresh buffers are zero; a reused one is cleared.
    if (static_cast<std::size_t>(idx) < allocated) backend_.zero(staging_.data(idx), max_bucket_numel());
    return idx;
  }

  std::uint64_t max_bucket_numel() const {
    std::uint64_t m = 0;
    for (const bucket& b : buckets_.buckets()) m = std::max(m, b.range.size());
    return m;
  }

  // Buckets go in the plan's launch order (descending, the order backward usually
  // completes them, with the small parameters' buckets last), so every rank issues the
  // same reductions in the same order whatever its timing.
  void launch_ready_buckets() {
    const auto order = buckets_.launch_order();
    while (launch_pos_ < order.size() && remaining_[order[launch_pos_]] == 0) {
      launch(order[launch_pos_]);
      ++launch_pos_;
    }
  }

  void launch_all_remaining() {
    const auto order = buckets_.launch_order();
    while (launch_pos_ < order.size()) {
      launch(order[launch_pos_]);  // a bucket with no gradient this pass reduces zeros
      ++launch_pos_;
    }
  }

  static constexpr std::size_t dtype_index(dtype d) noexcept { return static_cast<std::size_t>(d); }

  // Reduce-scatters bucket b, one non-blocking collective per wire run, in flat order.
  // A run in the gradient dtype is sent straight from the staging buffer; the others
  // from a wire-typed copy of the bucket (one per dtype), so the staging buffer is
  // given back at once when no run needs it.
  // A direct bucket (see direct_) has nothing to reduce.
  void launch(std::size_t b) {
    launched_[b] = 1;
    if (direct_[b]) {
      if constexpr (offloaded) send_to_host(b);
      return;
    }
    constexpr std::size_t max_in_flight = 2;
    while (pending_.size() >= max_in_flight) complete_oldest();
    const bucket& bk = buckets_.buckets()[b];
    if (staging_of_[b] < 0) staging_of_[b] = acquire_staging();  // no gradient this pass: zeros
    in_flight f;
    f.bucket = b;
    f.staging = staging_of_[b];
    staging_of_[b] = -1;
    const grad_type* staged = staging_.data(f.staging);
    bool sends_staging = false;
    for (const wire_run& run : bucket_runs_[b]) {
      visit_dtype(run.wire, [&]<class T>(T*) {
        if constexpr (std::same_as<T, grad_type>) {
          sends_staging = true;
        } else {
          int& w = f.wire[dtype_index(run.wire)];
          if (w < 0) w = wire_pools_.template get<T>().acquire(backend_, max_bucket_numel());
          const std::uint64_t at = run.range.begin - bk.range.begin;
          backend_.convert(wire_pools_.template get<T>().data(w) + at, staged + at, run.range.size());
        }
      });
    }
    if (!sends_staging) {
      staging_.release(f.staging);
      f.staging = -1;
    }
    for (const wire_run& run : bucket_runs_[b]) {
      visit_dtype(run.wire, [&]<class T>(T*) {
        const std::vector<std::uint64_t> counts = layout_.rank_counts(run.range);
        const std::uint64_t at = run.range.begin - bk.range.begin;
        const int recv = recv_pools_.template get<T>().acquire(backend_, counts[static_cast<std::size_t>(rank_)]);
        // After the acquire: a new receive buffer is zero-filled on the backend's stream,
        // and the collective must follow that fill.
        backend_.before_comm(comm_);
        const T* send = nullptr;
        if constexpr (std::same_as<T, grad_type>) {
          send = staged + at;
        } else {
          send = wire_pools_.template get<T>().data(f.wire[dtype_index(run.wire)]) + at;
        }
        f.parts.push_back(typename in_flight::part{
            run, recv,
            comm_.ireduce_scatter_v(send, recv_pools_.template get<T>().data(recv), counts, comm::reduce_op::sum)});
      });
    }
    pending_.push_back(std::move(f));
  }

  // Offload at world size 1, a direct bucket: its staged gradients are added to the host
  // partition as they are, with no reduction and no receive buffer; on a device backend
  // through a download that holds the staging buffer until retire_downloads. A bucket
  // that got no gradient this pass adds nothing (stage 0 adds nothing either).
  void send_to_host(std::size_t b) {
    const int st = staging_of_[b];
    if (st < 0) return;
    staging_of_[b] = -1;
    const flat_range r = buckets_.buckets()[b].range;  // within the shard: one rank holds it all
    if constexpr (Backend::device_memory) {
      auto& hp = host_pools_.template get<grad_type>();
      const int h = hp.acquire(backend_.host_memory(zo_.pin_memory), r.size());
      downloads_.push_back(download{backend_.download_async(hp.data(h), staging_.data(st), r.size()),
                                    dtype_of_v<grad_type>, -1, h, r.begin - shard_.begin, r.size(), st});
      retire_downloads(2);  // at most two in flight, as with reductions
    } else {
      host_.accumulate(h_grads_.data() + (r.begin - shard_.begin), staging_.data(st), r.size());
      staging_.release(st);
    }
  }

  void complete_oldest() {
    in_flight f = std::move(pending_.front());
    pending_.pop_front();
    for (auto& part : f.parts) {
      part.request.wait();
      visit_dtype(part.run.wire, [&]<class T>(T*) {
        const flat_range own = intersect(part.run.range, shard_);
        if (!own.empty()) {
          const T* got = recv_pools_.template get<T>().data(part.recv);
          if constexpr (offloaded) {
            // Into the host partition, in the gradient dtype.
            if constexpr (Backend::device_memory) {
              // Overlapped with backward: the block goes to (pinned) host staging on the
              // backend's copy stream and is added when the copy is done (retire_downloads).
              const int h = host_pools_.template get<T>().acquire(backend_.host_memory(zo_.pin_memory), own.size());
              downloads_.push_back(download{backend_.download_async(host_pools_.template get<T>().data(h), got, own.size()),
                                            part.run.wire, part.recv, h, own.begin - shard_.begin, own.size(), -1});
              return;  // the receive buffer stays busy until then
            } else {
              host_.accumulate(h_grads_.data() + (own.begin - shard_.begin), got, own.size());
            }
          } else {
            backend_.accumulate(grads_.data() + (own.begin - shard_.begin), got, own.size());
          }
        }
        recv_pools_.template get<T>().release(part.recv);
      });
    }
    if (f.staging >= 0) staging_.release(f.staging);
    for (const dtype d : {dtype::fp32, dtype::bf16, dtype::fp16}) {
      const int w = f.wire[dtype_index(d)];
      if (w >= 0) visit_dtype(d, [&]<class T>(T*) { wire_pools_.template get<T>().release(w); });
    }
    // At most two blocks on their way to the host, like the reductions: each holds a
    // receive buffer and a staging buffer.
    if constexpr (offloaded && Backend::device_memory) retire_downloads(2);
  }

  // Stages 0 and 1, a run in the gradient dtype: reduced in place.
  void reduce_in_place(flat_range r) {
    backend_.before_comm(comm_);
    if constexpr (zero_stage == 0) {
      comm_.all_reduce(grads_.data() + r.begin, grads_.data() + r.begin, r.size(), comm::reduce_op::sum);
    } else {
      // Rank k receives r's part of partition k, which is in's own block k: in place.
      const std::vector<std::uint64_t> counts = layout_.rank_counts(r);
      grad_type* in = grads_.data() + r.begin;
      comm_.reduce_scatter_v(in, in + comm::detail::offset_of(counts, rank_), counts, comm::reduce_op::sum);
    }
  }

  // Stages 0 and 1, a run in another wire dtype T: through T-typed buffers one
  // bucket-sized piece at a time (kept for the next step: memory().buckets counts them).
  template <class T>
  void reduce_on_wire(flat_range run) {
    const std::uint64_t piece = std::min<std::uint64_t>(zo_.reduce_bucket_numel, std::max<std::uint64_t>(run.size(), 1));
    // Sized for the longest run of this dtype, so that one pair serves every run.
    const std::uint64_t n = std::min<std::uint64_t>(zo_.reduce_bucket_numel, longest_run_[dtype_index(dtype_of_v<T>)]);
    auto& wp = wire_pools_.template get<T>();
    const int send = wp.acquire(backend_, n);
    const int recv = zero_stage == 1 ? wp.acquire(backend_, n) : -1;
    for (std::uint64_t begin = run.begin; begin < run.end; begin += piece) {
      const flat_range r{begin, std::min(begin + piece, run.end)};
      backend_.convert(wp.data(send), grads_.data() + r.begin, r.size());
      backend_.before_comm(comm_);
      if constexpr (zero_stage == 0) {
        comm_.all_reduce(wp.data(send), wp.data(send), r.size(), comm::reduce_op::sum);
        backend_.convert(grads_.data() + r.begin, wp.data(send), r.size());
      } else {
        const std::vector<std::uint64_t> counts = layout_.rank_counts(r);
        comm_.reduce_scatter_v(wp.data(send), wp.data(recv), counts, comm::reduce_op::sum);
        const flat_range own = intersect(r, shard_);
        if (!own.empty()) backend_.convert(grads_.data() + own.begin, wp.data(recv), own.size());
      }
    }
    wp.release(send);
    if (recv >= 0) wp.release(recv);
  }

  void drain() {
    while (!pending_.empty()) complete_oldest();
    retire_downloads(0);
  }

  void wait_uploads() {
    for (auto& t : uploads_) t.wait();
    uploads_.clear();
  }

  // Adds the downloaded blocks to the host partition, oldest first (the order they were
  // reduced in, so sums are formed in the same order as without overlap): those whose
  // copies are done, and, waiting, as many more as leave at most `keep` in flight.
  void retire_downloads(std::size_t keep) {
    while (!downloads_.empty()) {
      download& d = downloads_.front();
      if (downloads_.size() <= keep && !d.transfer.done()) return;
      d.transfer.wait();
      visit_dtype(d.wire, [&]<class T>(T*) {
        host_.accumulate(h_grads_.data() + d.offset, host_pools_.template get<T>().data(d.host), d.n);
        host_pools_.template get<T>().release(d.host);
        if (d.recv >= 0) recv_pools_.template get<T>().release(d.recv);
        if (d.staging >= 0) staging_.release(d.staging);
      });
      downloads_.pop_front();
    }
  }

  Comm& comm_;
  Backend backend_;
  typename Optimizer::options opt_;
  zero_options zo_;
  int world_, rank_;
  std::optional<loss_scaler> scaler_;
  std::uint64_t steps_ = 0;
  bool in_backward_ = false;
  bool reduced_ = false;  // reduce_gradients() ran for this step
  bool grads_pending_ = false;  // gradients reported since the last step() or zero_grad()
  bool pass_ended_ = false;     // stages 2-3: end_backward() ran since the last step() or zero_grad()

  flat_layout layout_;
  std::vector<std::size_t> slot_of_;  // parameter index -> position in the flat buffers
  std::uint64_t persistent_begin_ = 0;
  flat_range shard_{};
  std::vector<wire_run> runs_;  // [0, padded) in runs of equal wire dtype (one run by default)
  std::uint64_t longest_run_[3] = {1, 1, 1};  // per wire dtype: its longest run (sizes reduce_on_wire's buffers)
  pools<> wire_pools_;            // wire-typed copies of gradients being reduced (when not in the gradient dtype)

  buffer<param_type> params_;      // stages 0-2: all parameters; stage 3: this rank's partitioned ones
  buffer<param_type> persistent_;  // stage 3: the persistent parameters, whole
  buffer<master_type> master_;     // the shard's master weights (absent when the master is the parameter)
  buffer<grad_type> grads_;        // stages 0-1: all gradients; stages 2-3: the shard's
  buffer<state_type> states_[n_states];
  std::optional<typename Backend::template stepper<Policy, Optimizer>> stepper_;

  // offload
  host_backend host_{};
  host_buffer<master_type> h_master_;  // always separate from the parameters
  host_buffer<state_type> h_states_[n_states];
  host_buffer<grad_type> h_grads_;     // the shard's reduced gradients, accumulated over backward passes
  host_buffer<param_type> h_params_;   // the step's parameter output, when the master is wider
  std::vector<host_backend::stepper<Policy, Optimizer>> host_steppers_;  // one per sub-group of the shard
  std::vector<typename Backend::transfer> uploads_;  // the last step's parameter uploads
  std::vector<step_tensor<Policy, Optimizer>> shard_tensors_;

  // stages 2-3
  bucket_plan buckets_;
  std::vector<std::uint32_t> params_in_bucket_, remaining_;
  std::vector<int> staging_of_;
  std::vector<std::uint8_t> launched_, reported_;
  // Buckets with nothing to reduce (world size 1, every run in the gradient dtype):
  // reports accumulate into grads_ directly and launch() only marks them; with offload
  // they are staged and launch() sends them to the host partition (send_to_host).
  std::vector<std::uint8_t> direct_;
  std::vector<std::int32_t> dirty_;
  std::size_t launch_pos_ = 0;  // buckets_.launch_order()[launch_pos_] is the next to launch
  pool<grad_type> staging_;  // gradient-typed buckets being filled or sent
  std::vector<std::vector<wire_run>> bucket_runs_;  // each bucket's runs of equal wire dtype
  pools<> recv_pools_;  // this rank's block of a reduction in flight
  std::deque<in_flight> pending_;
  // Offload on a device backend: reduced blocks on their way to host memory.
  struct download {
    typename Backend::transfer transfer;
    dtype wire;
    int recv;             // in recv_pools_: busy until the copy is done (-1: sent from staging)
    int host;             // in host_pools_: the copy's destination
    std::uint64_t offset; // in the host partition
    std::uint64_t n;
    int staging;          // in staging_: busy until the copy is done (send_to_host), else -1
  };
  pools<host_buffer> host_pools_;  // before downloads_, which point into it
  std::deque<download> downloads_;

  // stage 3
  std::vector<param_type*> gathered_;
  std::map<std::pair<std::size_t, std::size_t>, gathered_group> groups_;
  std::vector<gathered_group> abandoned_groups_;  // whose all-gather failed (see release())
};

}  // namespace mpzero

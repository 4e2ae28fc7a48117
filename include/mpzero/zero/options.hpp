// mpzero: the ZeRO optimizer's options and reports: what callers and adapters include
// without the optimizer itself.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "../numeric/dtype.hpp"
#include "../partition/flat_layout.hpp"
#include "loss_scaler.hpp"

namespace mpzero {

// One parameter group's hyperparameters (torch's and DeepSpeed's param_groups), relative
// to the step kernel's: set_lr and a schedule change every group's lr in proportion.
struct param_group_options {
  double lr_scale = 1.0;                 // the group's lr: the kernel's lr times this (finite, >= 0)
  std::optional<double> weight_decay{};  // the group's weight decay; nullopt: the kernel's
  friend bool operator==(const param_group_options&, const param_group_options&) = default;
};

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
  // Parameter groups: each group's hyperparameters (empty: one group, the kernel's own),
  // and the group of each parameter, one entry per parameter in the caller's order
  // (empty: every parameter in group 0). Gradient clipping and the overflow check see
  // every group at once; the update applies each group's hyperparameters.
  // ZeRO-3: the dtype each partitioned parameter is all-gathered in, one entry per
  // parameter in the caller's order (DeepSpeed's torch_autocast gathers the
  // lower_precision_safe_modules' parameters in the autocast dtype, halving the bytes of
  // an fp32 model's gathers). Empty: the parameter dtype. gather(..., in_param_dtype)
  // overrides it (a save reads the parameters as they are stored).
  std::vector<dtype> gather_dtypes{};
  std::vector<param_group_options> param_groups{};
  std::vector<std::uint32_t> group_of{};
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
// memory model predicts; buckets are communication buffers held now.
struct memory_report {
  std::uint64_t params = 0, grads = 0, master = 0, states = 0;  // in the backend's memory
  std::uint64_t host_master = 0, host_grads = 0, host_states = 0;  // CPU offload: in host memory
  std::uint64_t buckets = 0;  // in the backend's memory: staging, wire-typed and receive buffers of the
                              // reductions; stage 3's gathers
  std::uint64_t host_buckets = 0;  // CPU offload, in host memory: the step's parameter output, download staging
  // The reductions' communication buffers (staging, wire-typed copies; offload's download
  // staging in host memory): the most bytes held at once since construction. They are
  // freed at the end of every step.
  std::uint64_t peak_buckets = 0, peak_host_buckets = 0;
  // What the reductions may hold at once in the backend's memory when gradients arrive in
  // reverse parameter order, as backward produces them (docs/precision.md, "Communication
  // buffers"): a function of reduce_bucket_numel and the layout.
  std::uint64_t bucket_bound = 0;
  std::uint64_t model_numel = 0;    // trainable elements, unpadded
  std::uint64_t padding_numel = 0;  // elements added to align the partitions
  std::uint64_t model_state_bytes() const noexcept { return params + grads + master + states; }
  std::uint64_t host_model_state_bytes() const noexcept { return host_master + host_grads + host_states; }
};

}  // namespace mpzero

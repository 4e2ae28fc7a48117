// mpzero::torch: the DeepSpeed-style JSON configuration, parsed and validated.
// Torch-free: this header and config.cpp use only nlohmann-json and the core.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <mpzero/error.hpp>
#include <mpzero/torch/autotp.hpp>
#include <mpzero/numeric/dtype.hpp>
#include <mpzero/zero/loss_scaler.hpp>

namespace mpzero::torch {

// A configuration error: names the key (as a JSON path, e.g. "zero_optimization.stage"),
// the bad value and the valid choices.
class config_error : public mpzero::invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

enum class optimizer_type { adam, adamw, sgd, lion };
enum class scheduler_type { none, warmup_lr, warmup_decay_lr, warmup_cosine_lr, lr_range_test, one_cycle };
enum class offload_device { none, cpu };

struct optimizer_config {
  optimizer_type type = optimizer_type::adamw;
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;  // Adam/AdamW/Lion "betas"
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  // SGD
  double dampening = 0.0;
  bool nesterov = false;
  bool bias_correction = true;  // Adam/AdamW
};

struct scheduler_config {
  scheduler_type type = scheduler_type::none;
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  std::uint64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";   // "log" or "linear" (WarmupLR, WarmupDecayLR)
  std::uint64_t total_num_steps = 0;  // WarmupDecayLR, WarmupCosineLR
  double warmup_min_ratio = 0.0;      // WarmupCosineLR
  double cos_min_ratio = 1e-4;        // WarmupCosineLR
  // LRRangeTest (DeepSpeed's defaults): lr = min_lr * (1 + step_rate * interval), interval
  // = steps / step_size, floored with staircase.
  double lr_range_test_min_lr = 1e-3;
  std::uint64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
  // OneCycle (DeepSpeed's names and defaults; cycle_min_lr and cycle_max_lr are required):
  // a cycle of first + second steps from min to max lr and back, beta1 the other way
  // between max_mom and min_mom, then lr decaying and beta1 growing every decay_step_size
  // steps (lr_schedule.hpp). DeepSpeed accepts the stair counts but does not use them.
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  std::uint64_t cycle_first_step_size = 2000, cycle_second_step_size = 2000;
  std::uint64_t cycle_first_stair_count = 0, cycle_second_stair_count = 0;
  std::uint64_t decay_step_size = 0;
  bool cycle_momentum = true;  // off when the optimizer has no betas (SGD), as in DeepSpeed
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9, decay_mom_rate = 0.0;
};

struct zero_config {
  int stage = 0;
  offload_device offload_optimizer = offload_device::none;
  bool offload_pin_memory = true;
  // The host step's sub-group (ZeroOptimizer's offload_sub_group_numel): DeepSpeed's
  // sub_group_size. Not given: mpzero's default, 2^24 elements.
  std::optional<std::uint64_t> sub_group_size;
  std::uint64_t reduce_bucket_size = 500'000'000;
  // Every stage places parameters of at most this many elements last in the flat buffers
  // (zero_options::param_persistence_threshold); stage 3 keeps them whole on every rank.
  std::uint64_t stage3_param_persistence_threshold = 100'000;
  // engine.save_16bit_model at stage 3 gathers the partitioned parameters (one at a time)
  // only when this is true, as in DeepSpeed; otherwise it refuses.
  bool stage3_gather_16bit_weights_on_model_save = false;
  // Stage 3: the most elements of partitioned parameters used outside every
  // gathered_forward unit that are gathered at once (more only while one operation needs
  // more); the oldest gathered are released first. DeepSpeed's default.
  std::uint64_t stage3_max_live_parameters = 1'000'000'000;
  // Read and kept so that DeepSpeed configs parse, but NOT USED by mpzero: they tune how
  // DeepSpeed schedules its collectives or its stage 3 and cannot change the result
  // (docs/config.md says what mpzero does instead). overlap_comm's default is DeepSpeed's
  // for the default stage 0 (true only at stage 3).
  std::uint64_t allgather_bucket_size = 500'000'000;
  bool overlap_comm = false;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  std::uint64_t stage3_prefetch_bucket_size = 50'000'000;
  std::vector<std::string> leaf_module_classes, leaf_module_names, leaf_module_name_suffixes;
};

struct autocast_config {
  bool enabled = false;
  dtype dtype_ = dtype::bf16;  // "dtype": "bfloat16" | "float16" (also "bf16", "fp16")
  // Class names as the engine matches them: a DeepSpeed name under "torch.nn." keeps the
  // part after its last dot ("torch.nn.modules.linear.Linear" -> "Linear").
  std::vector<std::string> lower_precision_safe_modules = {"Linear", "Conv1d", "Conv2d", "Conv3d"};
  // True when the config gave the list (even one equal to the default): only then may an
  // entry that matches no module be the user's mistake rather than an absent default layer.
  bool lower_precision_safe_modules_given = false;
};

// A parameter group (torch's param_groups, which DeepSpeed takes from the client's
// optimizer): the trainable parameters whose names (as model->named_parameters() gives
// them) match one of `patterns`, trained with their own lr and weight decay. The first
// group with a match takes a parameter; those no group matches form the default group,
// with the optimizer's hyperparameters. Given in code (config::param_groups) or as the
// top-level "param_groups" key (an mpzero extension).
struct param_group {
  std::string name;                   // names the group in messages, engine.get_lr(name) and checkpoints
  std::vector<std::string> patterns;  // ECMAScript regular expressions, searched anywhere in the name
  // The group's lr where the schedule gives optimizer.params.lr: every schedule moves it
  // in proportion. Absent: the optimizer's lr.
  std::optional<double> lr;
  std::optional<double> weight_decay;  // absent: the optimizer's
  friend bool operator==(const param_group&, const param_group&) = default;
};

// Throws config_error naming the group and the fix for a group without a name or a
// pattern, two groups of one name (or one named "default", the ungrouped parameters'),
// a pattern that is not a regular expression, or an lr or weight_decay that is negative
// or not finite. parse_config and initialize call it.
void check_param_groups(const std::vector<param_group>& groups);

// The whole configuration after parsing, defaulting and validation.
struct config {
  // One line each for what the config spells in a way DeepSpeed has deprecated and still
  // reads (read with DeepSpeed's meaning); initialize prints them once, on rank 0.
  std::vector<std::string> notices;
  // Whether an optimizer was named (the "optimizer" section, or initialize's optimizer
  // argument). Without one, `optimizer` holds mpzero's default (AdamW, lr 1e-3) and
  // `notices` says so.
  bool optimizer_given = false;

  // Batch sizes: all three resolved (train = micro * gas * world).
  std::uint64_t train_batch_size = 0;
  std::uint64_t train_micro_batch_size_per_gpu = 0;
  std::uint64_t gradient_accumulation_steps = 1;
  // DeepSpeed's managed_gradient_accumulation: true, the engine steps at every
  // gradient_accumulation_steps-th step() call; false, the caller owns the boundary and
  // every step() applies one update (backward still divides by gradient_accumulation_steps
  // unless engine.backward(loss, ..., scale_wrt_gas = false)).
  bool managed_gradient_accumulation = true;

  bool bf16 = false;
  bool bf16_master_weights_and_grads = false;
  bool bf16_optimizer_states = false;
  bool check_grad_overflow = true;  // bf16.check_grad_overflow

  bool fp16 = false;
  bool fp16_master_weights_and_grads = false;
  double loss_scale = 0.0;  // 0: dynamic
  loss_scale_options loss_scaler;  // the dynamic/static scaler options derived from "fp16"

  autocast_config torch_autocast;
  zero_config zero;
  optimizer_config optimizer;
  scheduler_config scheduler;
  double gradient_clipping = 1.0;  // DeepSpeed's default; 0 disables
  std::optional<dtype> communication_data_type;
  std::uint64_t seed = 0;  // "seed": stochastic rounding key (mpzero extension)
  std::string rounding = "nearest";  // "rounding": "nearest" | "stochastic" (mpzero extension)
  // "data_types.grad_accum_dtype" (DeepSpeed's key): the dtype gradients are accumulated
  // in; unset means the model's dtype, as in DeepSpeed. mpzero honours it at every stage.
  std::optional<dtype> grad_accum_dtype;
  // Parameter groups, in order of precedence (param_group).
  std::vector<param_group> param_groups;
  // DeepSpeed's AutoTP training section (autotp.hpp).
  tensor_parallel_config tensor_parallel;

  // The storage dtypes the configuration selects (DeepSpeed's rules; see config.cpp).
  dtype param_dtype() const;
  dtype master_dtype() const;
  dtype grad_dtype() const;
  dtype state_dtype() const;
  // The dtype gradients are reduced in: communication_data_type, else the dtype they are
  // accumulated in (grad_dtype(): the model's dtype, as DeepSpeed's engine resolves it,
  // unless data_types.grad_accum_dtype makes it fp32). With torch_autocast enabled the
  // parameters of lower_precision_safe_modules are reduced in the autocast dtype instead.
  dtype comm_dtype() const;
  bool stochastic_rounding() const { return rounding == "stochastic"; }
  // Loss scaling with loss_scaler's options (the "fp16" section's keys): fp16 weights, or
  // torch_autocast in fp16, whose fp16 activations' gradients underflow just the same.
  bool loss_scaling() const { return fp16 || (torch_autocast.enabled && torch_autocast.dtype_ == dtype::fp16); }
};

// The names the config uses ("AdamW", "WarmupCosineLR", "cpu"; "" for scheduler_type::none).
std::string_view optimizer_name(optimizer_type t);
std::string_view scheduler_name(scheduler_type t);
std::string_view offload_device_name(offload_device d);

// Parses and validates. `world_size` resolves the batch-size triangle. Throws config_error.
config parse_config(const nlohmann::json& j, int world_size);
config parse_config_text(const std::string& json_text, int world_size);
// Reads a file; errors name the path. JSON comments are allowed and duplicate keys are
// an error (as DeepSpeed, which reads files with hjson and refuses duplicates).
config load_config_file(const std::string& path, int world_size);
// DeepSpeed's client optimizer: `j` (which must have no "optimizer" section) parsed with
// `optimizer` as its section, by the same rules and with the same defaults it implies
// (WarmupLR's peak is its lr).
config parse_config_with_optimizer(const nlohmann::json& j, const optimizer_config& optimizer, int world_size);
// A path to a JSON file, or JSON text (its first non-blank character is '{'), as JSON.
nlohmann::json read_config_json(const std::string& path_or_json);
// Whether initialize's string argument is JSON text (its first non-blank character is
// '{') rather than a path.
bool is_config_text(std::string_view path_or_json);

// The resolved configuration as JSON: every key spelled out, defaults included. Parsing
// it again (with the same world size) gives the same configuration.
nlohmann::json to_json(const config& c);

}  // namespace mpzero::torch

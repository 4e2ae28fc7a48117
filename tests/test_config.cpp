// The DeepSpeed-style JSON config: every key, the defaults, the validation rules, the
// batch-size triangle, the dtype selection, files and round trips.
//
// Expected values are written out from DeepSpeed's documented defaults and rules (see
// docs/config.md), not taken from the parser.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <mpzero/torch/config.hpp>

using namespace mpzero;
using namespace mpzero::torch;
using nlohmann::json;

namespace {

// The config error's message, or "" if parsing succeeded.
std::string error_of(const std::string& text, int world = 1) {
  try {
    parse_config_text(text, world);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

// Every field of two configs, compared one by one.
void require_same(const config& a, const config& b) {
  CHECK(a.param_groups == b.param_groups);
  CHECK(a.train_batch_size == b.train_batch_size);
  CHECK(a.train_micro_batch_size_per_gpu == b.train_micro_batch_size_per_gpu);
  CHECK(a.gradient_accumulation_steps == b.gradient_accumulation_steps);
  CHECK(a.bf16 == b.bf16);
  CHECK(a.bf16_master_weights_and_grads == b.bf16_master_weights_and_grads);
  CHECK(a.bf16_optimizer_states == b.bf16_optimizer_states);
  CHECK(a.check_grad_overflow == b.check_grad_overflow);
  CHECK(a.fp16 == b.fp16);
  CHECK(a.fp16_master_weights_and_grads == b.fp16_master_weights_and_grads);
  CHECK(a.loss_scale == b.loss_scale);
  CHECK(a.loss_scaler.dynamic == b.loss_scaler.dynamic);
  CHECK(a.loss_scaler.static_scale == b.loss_scaler.static_scale);
  CHECK(a.loss_scaler.initial_scale_power == b.loss_scaler.initial_scale_power);
  CHECK(a.loss_scaler.loss_scale_window == b.loss_scaler.loss_scale_window);
  CHECK(a.loss_scaler.hysteresis == b.loss_scaler.hysteresis);
  CHECK(a.loss_scaler.consecutive_hysteresis == b.loss_scaler.consecutive_hysteresis);
  CHECK(a.loss_scaler.min_loss_scale == b.loss_scaler.min_loss_scale);
  CHECK(a.torch_autocast.enabled == b.torch_autocast.enabled);
  CHECK(a.torch_autocast.dtype_ == b.torch_autocast.dtype_);
  CHECK(a.torch_autocast.lower_precision_safe_modules == b.torch_autocast.lower_precision_safe_modules);
  CHECK(a.torch_autocast.lower_precision_safe_modules_given == b.torch_autocast.lower_precision_safe_modules_given);
  CHECK(a.zero.stage == b.zero.stage);
  CHECK(a.zero.offload_optimizer == b.zero.offload_optimizer);
  CHECK(a.zero.offload_pin_memory == b.zero.offload_pin_memory);
  CHECK(a.zero.reduce_bucket_size == b.zero.reduce_bucket_size);
  CHECK(a.zero.sub_group_size == b.zero.sub_group_size);
  CHECK(a.zero.allgather_bucket_size == b.zero.allgather_bucket_size);
  CHECK(a.zero.overlap_comm == b.zero.overlap_comm);
  CHECK(a.zero.contiguous_gradients == b.zero.contiguous_gradients);
  CHECK(a.zero.reduce_scatter == b.zero.reduce_scatter);
  CHECK(a.zero.stage3_param_persistence_threshold == b.zero.stage3_param_persistence_threshold);
  CHECK(a.zero.stage3_prefetch_bucket_size == b.zero.stage3_prefetch_bucket_size);
  CHECK(a.zero.stage3_max_live_parameters == b.zero.stage3_max_live_parameters);
  CHECK(a.zero.leaf_module_classes == b.zero.leaf_module_classes);
  CHECK(a.zero.leaf_module_names == b.zero.leaf_module_names);
  CHECK(a.zero.leaf_module_name_suffixes == b.zero.leaf_module_name_suffixes);
  CHECK(a.optimizer.type == b.optimizer.type);
  CHECK(a.optimizer.lr == b.optimizer.lr);
  CHECK(a.optimizer.beta1 == b.optimizer.beta1);
  CHECK(a.optimizer.beta2 == b.optimizer.beta2);
  CHECK(a.optimizer.eps == b.optimizer.eps);
  CHECK(a.optimizer.weight_decay == b.optimizer.weight_decay);
  CHECK(a.optimizer.momentum == b.optimizer.momentum);
  CHECK(a.optimizer.dampening == b.optimizer.dampening);
  CHECK(a.optimizer.nesterov == b.optimizer.nesterov);
  CHECK(a.optimizer.bias_correction == b.optimizer.bias_correction);
  CHECK(a.scheduler.type == b.scheduler.type);
  CHECK(a.scheduler.warmup_min_lr == b.scheduler.warmup_min_lr);
  CHECK(a.scheduler.warmup_max_lr == b.scheduler.warmup_max_lr);
  CHECK(a.scheduler.warmup_num_steps == b.scheduler.warmup_num_steps);
  CHECK(a.scheduler.warmup_type == b.scheduler.warmup_type);
  CHECK(a.scheduler.total_num_steps == b.scheduler.total_num_steps);
  CHECK(a.scheduler.warmup_min_ratio == b.scheduler.warmup_min_ratio);
  CHECK(a.scheduler.cos_min_ratio == b.scheduler.cos_min_ratio);
  CHECK(a.gradient_clipping == b.gradient_clipping);
  CHECK(a.communication_data_type == b.communication_data_type);
  CHECK(a.grad_accum_dtype == b.grad_accum_dtype);
  CHECK(a.seed == b.seed);
  CHECK(a.rounding == b.rounding);
}

// A scratch file removed at scope exit.
struct temp_file {
  std::filesystem::path path;
  explicit temp_file(const std::string& name, const std::string& text)
      : path(std::filesystem::temp_directory_path() / ("mpzero_test_config_" + name)) {
    std::ofstream(path) << text;
  }
  ~temp_file() { std::filesystem::remove(path); }
};

}  // namespace

TEST_CASE("config: every documented key is read", "[config]") {
  const char* text = R"({
    "train_batch_size": 48,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 3,
    "bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true,
             "check_grad_overflow": false},
    "fp16": {"enabled": false, "loss_scale": 128, "initial_scale_power": 12, "loss_scale_window": 200,
             "hysteresis": 3, "consecutive_hysteresis": true, "min_loss_scale": 0.5},
    "torch_autocast": {"enabled": true,
                       "lower_precision_safe_modules": ["torch.nn.Linear", "torch::nn::Conv2d", "MyBlock"]},
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "cpu", "pin_memory": false},
      "reduce_bucket_size": 2e7, "allgather_bucket_size": 3e7, "sub_group_size": 1e6,
      "overlap_comm": false, "contiguous_gradients": false, "reduce_scatter": false,
      "stage3_param_persistence_threshold": 1234, "stage3_prefetch_bucket_size": 5678,
      "stage3_max_live_parameters": 4321,
      "leaf_module": {"classes": ["MoEBlock", "MoEBlock"], "names": "layers.0.mlp", "name_suffixes": [".experts"]}
    },
    "gradient_clipping": 0.5,
    "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                  "weight_decay": 0.1, "bias_correction": false}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 50,
                  "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}},
    "communication_data_type": "FP32",
    "data_types": {"grad_accum_dtype": "bf16"},
    "seed": 18446744073709551615,
    "rounding": "stochastic"
  })";
  const config c = parse_config_text(text, 4);
  CHECK(c.train_batch_size == 48);
  CHECK(c.train_micro_batch_size_per_gpu == 4);
  CHECK(c.gradient_accumulation_steps == 3);
  CHECK(c.bf16);
  CHECK(c.bf16_master_weights_and_grads);
  CHECK(c.bf16_optimizer_states);
  CHECK_FALSE(c.check_grad_overflow);
  CHECK_FALSE(c.fp16);
  CHECK(c.loss_scale == 128);
  CHECK_FALSE(c.loss_scaler.dynamic);
  CHECK(c.loss_scaler.static_scale == 128);
  CHECK(c.loss_scaler.initial_scale_power == 12);
  CHECK(c.loss_scaler.loss_scale_window == 200);
  CHECK(c.loss_scaler.hysteresis == 3);
  CHECK(c.loss_scaler.consecutive_hysteresis);
  CHECK(c.loss_scaler.min_loss_scale == 0.5);  // DeepSpeed would want an integer; any positive number works
  CHECK(c.torch_autocast.enabled);
  // torch's prefixes are dropped (LibTorch matches class names); other names stay.
  CHECK(c.torch_autocast.lower_precision_safe_modules == std::vector<std::string>{"Linear", "Conv2d", "MyBlock"});
  CHECK(c.torch_autocast.lower_precision_safe_modules_given);
  CHECK(c.zero.stage == 3);
  CHECK(c.zero.offload_optimizer == offload_device::cpu);
  CHECK_FALSE(c.zero.offload_pin_memory);
  CHECK(c.zero.reduce_bucket_size == 20'000'000);
  CHECK(c.zero.sub_group_size == 1'000'000);
  CHECK(c.zero.allgather_bucket_size == 30'000'000);
  CHECK_FALSE(c.zero.overlap_comm);
  CHECK_FALSE(c.zero.contiguous_gradients);
  CHECK_FALSE(c.zero.reduce_scatter);
  CHECK(c.zero.stage3_param_persistence_threshold == 1234);
  CHECK(c.zero.stage3_prefetch_bucket_size == 5678);
  CHECK(c.zero.stage3_max_live_parameters == 4321);
  CHECK(c.zero.leaf_module_classes == std::vector<std::string>{"MoEBlock"});  // deduplicated, as DeepSpeed
  CHECK(c.zero.leaf_module_names == std::vector<std::string>{"layers.0.mlp"});  // one string is a list of one
  CHECK(c.zero.leaf_module_name_suffixes == std::vector<std::string>{".experts"});
  CHECK(c.gradient_clipping == 0.5);
  CHECK(c.optimizer.type == optimizer_type::adamw);
  CHECK(c.optimizer.lr == 3e-4);
  CHECK(c.optimizer.beta1 == 0.8);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.eps == 1e-6);
  CHECK(c.optimizer.weight_decay == 0.1);
  CHECK_FALSE(c.optimizer.bias_correction);
  CHECK(c.scheduler.type == scheduler_type::warmup_cosine_lr);
  CHECK(c.scheduler.total_num_steps == 1000);
  CHECK(c.scheduler.warmup_num_steps == 50);
  CHECK(c.scheduler.warmup_min_ratio == 0.1);
  CHECK(c.scheduler.cos_min_ratio == 0.01);
  CHECK(c.scheduler.warmup_type == "linear");
  CHECK(c.communication_data_type == dtype::fp32);  // DeepSpeed lower-cases it
  CHECK(c.comm_dtype() == dtype::fp32);
  CHECK(c.grad_accum_dtype == dtype::bf16);
  CHECK(c.seed == 18446744073709551615ull);
  CHECK(c.rounding == "stochastic");
  CHECK(c.stochastic_rounding());
}

TEST_CASE("config: the remaining keys (fp16 section, SGD, WarmupDecayLR, stage-3 aliases)", "[config]") {
  const config c = parse_config_text(R"({
    "train_micro_batch_size_per_gpu": 2,
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 50,
             "hysteresis": 1, "min_loss_scale": 2, "fp16_master_weights_and_grads": true},
    "torch_autocast": {"enabled": true, "dtype": "float16"},
    "zero_optimization": {"stage": 2, "param_persistence_threshold": 7, "prefetch_bucket_size": 9,
                          "max_live_parameters": 11},
    "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 1e-4,
                                            "nesterov": true}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_min_lr": 0.01,
                  "warmup_max_lr": 0.2, "warmup_num_steps": 10, "warmup_type": "linear"}},
    "data_types": {"grad_accum_dtype": "half"}
  })",
                                     3);
  CHECK(c.train_batch_size == 6);
  CHECK(c.gradient_accumulation_steps == 1);
  CHECK(c.fp16);
  CHECK(c.loss_scaler.dynamic);
  CHECK(c.loss_scaler.initial_scale_power == 8);
  CHECK(c.loss_scaler.loss_scale_window == 50);
  CHECK(c.loss_scaler.hysteresis == 1);
  CHECK(c.loss_scaler.min_loss_scale == 2);
  CHECK(c.fp16_master_weights_and_grads);
  CHECK(c.torch_autocast.enabled);
  CHECK(c.torch_autocast.dtype_ == dtype::fp16);
  CHECK_FALSE(c.torch_autocast.lower_precision_safe_modules_given);
  CHECK(c.zero.stage3_param_persistence_threshold == 7);  // pydantic field names work too
  CHECK(c.zero.stage3_prefetch_bucket_size == 9);
  CHECK(c.zero.stage3_max_live_parameters == 11);
  CHECK(c.optimizer.type == optimizer_type::sgd);
  CHECK(c.optimizer.lr == 0.1);
  CHECK(c.optimizer.momentum == 0.9);
  CHECK(c.optimizer.weight_decay == 1e-4);
  CHECK(c.optimizer.nesterov);
  CHECK(c.scheduler.type == scheduler_type::warmup_decay_lr);
  CHECK(c.scheduler.total_num_steps == 100);
  CHECK(c.scheduler.warmup_min_lr == 0.01);
  CHECK(c.scheduler.warmup_max_lr == 0.2);
  CHECK(c.scheduler.warmup_num_steps == 10);
  CHECK(c.scheduler.warmup_type == "linear");
  CHECK(c.grad_accum_dtype == dtype::fp16);  // DeepSpeed's DtypeEnum spelling "half"
  CHECK(c.grad_dtype() == dtype::fp16);
  CHECK(c.param_dtype() == dtype::fp16);
  CHECK(c.master_dtype() == dtype::fp16);
  CHECK(c.comm_dtype() == dtype::fp16);  // the model's dtype, as DeepSpeed

  const config lion = parse_config_text(
      R"({"train_batch_size": 8, "optimizer": {"type": "LION", "params": {"lr": 1e-4, "betas": [0.95, 0.98],
          "weight_decay": 0.5}}})",
      2);
  CHECK(lion.optimizer.type == optimizer_type::lion);
  CHECK(lion.optimizer.lr == 1e-4);
  CHECK(lion.optimizer.beta1 == 0.95);
  CHECK(lion.optimizer.beta2 == 0.98);
  CHECK(lion.optimizer.weight_decay == 0.5);

  // dampening (torch's SGD allows it only without nesterov).
  const config sgd = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"momentum": 0.5,
          "dampening": 0.25}}})",
      1);
  CHECK(sgd.optimizer.dampening == 0.25);
  CHECK_FALSE(sgd.optimizer.nesterov);
}

TEST_CASE("config: defaults are DeepSpeed's", "[config]") {
  const config c = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1})", 1);
  CHECK(c.train_batch_size == 1);
  CHECK(c.gradient_accumulation_steps == 1);
  CHECK_FALSE(c.bf16);
  CHECK_FALSE(c.bf16_master_weights_and_grads);
  CHECK_FALSE(c.bf16_optimizer_states);
  CHECK(c.check_grad_overflow);
  CHECK_FALSE(c.fp16);
  CHECK_FALSE(c.fp16_master_weights_and_grads);
  CHECK(c.loss_scale == 0);
  CHECK(c.loss_scaler.dynamic);
  CHECK(c.loss_scaler.initial_scale_power == 16);
  CHECK(c.loss_scaler.loss_scale_window == 1000);
  CHECK(c.loss_scaler.hysteresis == 2);
  CHECK_FALSE(c.loss_scaler.consecutive_hysteresis);
  CHECK(c.loss_scaler.min_loss_scale == 1);
  CHECK_FALSE(c.torch_autocast.enabled);
  CHECK(c.torch_autocast.dtype_ == dtype::bf16);
  CHECK(c.torch_autocast.lower_precision_safe_modules ==
        std::vector<std::string>{"Linear", "Conv1d", "Conv2d", "Conv3d"});
  CHECK(c.zero.stage == 0);
  CHECK(c.zero.offload_optimizer == offload_device::none);
  CHECK(c.zero.offload_pin_memory);
  CHECK(c.zero.reduce_bucket_size == 500'000'000);
  CHECK(c.zero.allgather_bucket_size == 500'000'000);
  CHECK_FALSE(c.zero.overlap_comm);  // DeepSpeed: true only for stage 3
  CHECK(c.zero.contiguous_gradients);
  CHECK(c.zero.reduce_scatter);
  CHECK(c.zero.stage3_param_persistence_threshold == 100'000);
  CHECK(c.zero.stage3_prefetch_bucket_size == 50'000'000);
  CHECK(c.zero.stage3_max_live_parameters == 1'000'000'000);
  CHECK(c.zero.leaf_module_classes.empty());
  CHECK(c.gradient_clipping == 1.0);
  CHECK(c.optimizer.type == optimizer_type::adamw);
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.optimizer.beta1 == 0.9);
  CHECK(c.optimizer.beta2 == 0.999);
  CHECK(c.optimizer.eps == 1e-8);
  CHECK(c.optimizer.weight_decay == 0);
  CHECK(c.optimizer.bias_correction);
  CHECK(c.scheduler.type == scheduler_type::none);
  CHECK_FALSE(c.communication_data_type.has_value());
  CHECK_FALSE(c.grad_accum_dtype.has_value());
  CHECK(c.seed == 0);
  CHECK(c.rounding == "nearest");
  CHECK_FALSE(c.zero.sub_group_size.has_value());
  CHECK_FALSE(c.torch_autocast.lower_precision_safe_modules_given);

  // A default-constructed config is the parsed one (the batch sizes aside: they have no
  // default), field by field and through to_json.
  config d0;
  d0.train_batch_size = 1;
  d0.train_micro_batch_size_per_gpu = 1;
  require_same(d0, c);
  CHECK(to_json(d0) == to_json(c));

  // overlap_comm defaults on in stage 3 only.
  for (int stage = 0; stage <= 3; ++stage) {
    const config z = parse_config_text(
        R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": )" + std::to_string(stage) + "}}", 1);
    CHECK(z.zero.overlap_comm == (stage == 3));
  }
  // Section defaults inside a present section; the scheduler's defaults.
  const config s = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
          "scheduler": {"type": "WarmupLR"}})",
      1);
  CHECK(s.scheduler.warmup_min_lr == 0);
  CHECK(s.scheduler.warmup_max_lr == 0.02);  // WarmupLR peaks at the optimizer's lr
  CHECK(s.scheduler.warmup_num_steps == 1000);
  CHECK(s.scheduler.warmup_type == "log");
  const config d = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}})",
      1);
  CHECK(d.scheduler.warmup_max_lr == 1e-3);  // WarmupDecayLR's own default
  const config cos = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": "WarmupCosineLR",
          "params": {"total_num_steps": 10}}})",
      1);
  CHECK(cos.scheduler.warmup_min_ratio == 0);
  CHECK(cos.scheduler.cos_min_ratio == 1e-4);
  CHECK(cos.scheduler.warmup_num_steps == 1000);
  // null reads as absent, for mpzero's keys and for DeepSpeed's keys it does not implement.
  const config n = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "train_batch_size": null, "communication_data_type": null,
          "prescale_gradients": null, "amp": null, "bfloat16": null,
          "torch_autocast": {"lower_precision_safe_modules": null},
          "zero_optimization": {"stage": 1, "offload_optimizer": null, "sub_group_size": null,
                                "legacy_stage1": null, "offload_param": null}})",
      2);
  CHECK(n.train_batch_size == 2);
  CHECK_FALSE(n.communication_data_type.has_value());
  CHECK(n.zero.offload_optimizer == offload_device::none);
  CHECK_FALSE(n.zero.sub_group_size.has_value());
  CHECK_FALSE(n.torch_autocast.lower_precision_safe_modules_given);
}

TEST_CASE("config: sub_group_size round-trips; null is absent", "[config]") {
  const config given = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "sub_group_size": 4096}})", 1);
  REQUIRE(given.zero.sub_group_size.has_value());
  CHECK(*given.zero.sub_group_size == 4096);
  const json jg = to_json(given);
  CHECK(jg["zero_optimization"]["sub_group_size"] == 4096);
  CHECK(parse_config(jg, 1).zero.sub_group_size == std::optional<std::uint64_t>(4096));

  const config null = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "sub_group_size": null}})", 1);
  CHECK_FALSE(null.zero.sub_group_size.has_value());
  const json jn = to_json(null);
  CHECK_FALSE(jn["zero_optimization"].contains("sub_group_size"));
  CHECK_FALSE(parse_config(jn, 1).zero.sub_group_size.has_value());
}

TEST_CASE("config: lower_precision_safe_modules takes DeepSpeed's full names and the short forms", "[config]") {
  auto modules = [](const std::string& list) {
    const config c = parse_config_text(
        R"({"train_micro_batch_size_per_gpu": 1, "torch_autocast": {"enabled": true, "lower_precision_safe_modules": )" +
            list + "}}",
        1);
    CHECK(c.torch_autocast.lower_precision_safe_modules_given);
    return c.torch_autocast.lower_precision_safe_modules;
  };
  using names = std::vector<std::string>;
  // DeepSpeed's documented spelling (module path) and torch's public alias: the class name,
  // which is what the engine matches against a LibTorch module's class.
  CHECK(modules(R"(["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv2d"])") == names{"Linear", "Conv2d"});
  CHECK(modules(R"(["torch.nn.Linear", "torch.nn.Conv1d"])") == names{"Linear", "Conv1d"});
  // The short forms, kept as the engine matches them.
  CHECK(modules(R"(["Linear", "LinearImpl", "torch::nn::Conv3d", "torch::nn::LinearImpl"])") ==
        names{"Linear", "LinearImpl", "Conv3d", "LinearImpl"});
  // Names outside torch.nn are the user's own classes: kept as written.
  CHECK(modules(R"(["MyBlock", "my::Block", "mypkg.MyBlock"])") == names{"MyBlock", "my::Block", "mypkg.MyBlock"});
  // A list equal to the default still counts as given; to_json keeps the difference.
  const config dflt = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1})", 1);
  CHECK_FALSE(dflt.torch_autocast.lower_precision_safe_modules_given);
  CHECK_FALSE(to_json(dflt)["torch_autocast"].contains("lower_precision_safe_modules"));
  CHECK_FALSE(parse_config(to_json(dflt), 1).torch_autocast.lower_precision_safe_modules_given);
  const config same = parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "torch_autocast": {"lower_precision_safe_modules":
          ["torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d"]}})",
      1);
  CHECK(same.torch_autocast.lower_precision_safe_modules == dflt.torch_autocast.lower_precision_safe_modules);
  CHECK(same.torch_autocast.lower_precision_safe_modules_given);
  CHECK(parse_config(to_json(same), 1).torch_autocast.lower_precision_safe_modules_given);
}

TEST_CASE("config: torch_adam gives torch's AdamW its weight_decay default, 0.01", "[config]") {
  struct row {
    const char* type;
    const char* params;  // JSON object text
    optimizer_type expected_type;
    double expected_weight_decay;
  };
  // DeepSpeed (engine._configure_basic_optimizer): torch_adam builds torch.optim.AdamW when
  // adam_w_mode is in effect (weight_decay default 0.01), else torch.optim.Adam (0);
  // without torch_adam FusedAdam / DeepSpeedCPUAdam (0).
  const row rows[] = {
      {"AdamW", R"({"torch_adam": true})", optimizer_type::adamw, 0.01},
      {"Adam", R"({"torch_adam": true})", optimizer_type::adamw, 0.01},  // "Adam" is AdamW by default
      {"Adam", R"({"torch_adam": true, "adam_w_mode": false})", optimizer_type::adam, 0.0},
      {"AdamW", R"({"torch_adam": true, "weight_decay": 0})", optimizer_type::adamw, 0.0},
      {"AdamW", R"({"torch_adam": true, "weight_decay": 0.25})", optimizer_type::adamw, 0.25},
      {"AdamW", R"({"torch_adam": false})", optimizer_type::adamw, 0.0},
      {"AdamW", R"({"torch_adam": null})", optimizer_type::adamw, 0.0},
      {"AdamW", R"({})", optimizer_type::adamw, 0.0},
  };
  for (const auto& r : rows) {
    const std::string text = std::string(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": ")") +
                             r.type + R"(", "params": )" + r.params + "}}";
    INFO(text);
    const config c = parse_config_text(text, 1);
    CHECK(c.optimizer.type == r.expected_type);
    CHECK(c.optimizer.weight_decay == r.expected_weight_decay);
    // The resolved weight decay is written out, so the round trip needs no torch_adam.
    CHECK(parse_config(to_json(c), 1).optimizer.weight_decay == r.expected_weight_decay);
  }
}

TEST_CASE("config: DeepSpeed's Adam is AdamW unless adam_w_mode is false", "[config]") {
  struct row {
    const char* type;
    const char* adam_w_mode;  // JSON text or nullptr for absent
    optimizer_type expected;
  };
  // DeepSpeed's engine: effective_adam_w_mode = (name == "adamw") or adam_w_mode (default true).
  const row rows[] = {
      {"Adam", nullptr, optimizer_type::adamw},   {"Adam", "true", optimizer_type::adamw},
      {"Adam", "false", optimizer_type::adam},    {"adam", "false", optimizer_type::adam},
      {"AdamW", nullptr, optimizer_type::adamw},  {"AdamW", "false", optimizer_type::adamw},
      {"ADAMW", "true", optimizer_type::adamw},
  };
  for (const auto& r : rows) {
    std::string params = r.adam_w_mode ? std::string(R"({"adam_w_mode": )") + r.adam_w_mode + "}" : "{}";
    const std::string text = std::string(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": ")") +
                             r.type + R"(", "params": )" + params + "}}";
    INFO(text);
    CHECK(parse_config_text(text, 1).optimizer.type == r.expected);
  }
}

TEST_CASE("config: the batch-size triangle follows DeepSpeed's rules", "[config]") {
  struct row {
    std::optional<int> train, micro, gas;
    int world;
    std::uint64_t train_out, micro_out, gas_out;
  };
  const row rows[] = {
      // all three, consistent
      {32, 4, 2, 4, 32, 4, 2},
      // two given: the third derived
      {32, 4, {}, 4, 32, 4, 2},
      {32, {}, 2, 4, 32, 4, 2},
      {{}, 4, 2, 4, 32, 4, 2},
      {{}, 3, 5, 1, 15, 3, 5},
      // train alone: GAS = 1, micro = train / world
      {12, {}, {}, 3, 12, 4, 1},
      // micro alone: GAS = 1, train = micro x world
      {{}, 5, {}, 2, 10, 5, 1},
      {{}, 1, {}, 1, 1, 1, 1},
  };
  for (const auto& r : rows) {
    json j = json::object();
    if (r.train) j["train_batch_size"] = *r.train;
    if (r.micro) j["train_micro_batch_size_per_gpu"] = *r.micro;
    if (r.gas) j["gradient_accumulation_steps"] = *r.gas;
    INFO(j.dump() << " world " << r.world);
    const config c = parse_config(j, r.world);
    CHECK(c.train_batch_size == r.train_out);
    CHECK(c.train_micro_batch_size_per_gpu == r.micro_out);
    CHECK(c.gradient_accumulation_steps == r.gas_out);
    CHECK(c.train_batch_size == c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * r.world);
  }
}

TEST_CASE("config: bad configurations are refused with a message that names the key and the fix", "[config]") {
  struct row {
    const char* text;
    int world;
    std::vector<std::string> expect;  // substrings of the message
  };
  // M: the smallest valid batch setting, so each row fails for its own reason.
#define M R"("train_micro_batch_size_per_gpu": 1)"
  const std::vector<row> rows = {
      // unknown keys, top level and nested, with suggestions and the valid list
      {"{" M R"(, "zero_optimisation": {}})", 1,
       {"unknown key 'zero_optimisation'", "did you mean 'zero_optimization'?", "Valid top-level keys:",
        "train_batch_size"}},
      {"{" M R"(, "zero_optimization": {"stag": 2}})", 1,
       {"unknown key 'zero_optimization.stag'", "did you mean 'stage'?", "Valid keys in 'zero_optimization':",
        "reduce_bucket_size"}},
      {"{" M R"(, "zero_optimization": {"stage": 1, "offload_optimizer": {"devcie": "cpu"}}})", 1,
       {"'zero_optimization.offload_optimizer.devcie'", "did you mean 'device'?", "device, pin_memory"}},
      {"{" M R"(, "bf16": {"enabled": true, "bf16_master_weights_and_grad": true}})", 1,
       {"'bf16.bf16_master_weights_and_grad'", "did you mean 'bf16_master_weights_and_grads'?"}},
      {"{" M R"(, "zero_optimization": {"leaf_module": {"class": ["A"]}}})", 1,
       {"'zero_optimization.leaf_module.class'", "did you mean 'classes'?"}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}})", 1,
       {"'scheduler.params.warmup_steps'", "did you mean 'warmup_num_steps'?"}},
      {"{" M R"(, "optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})", 1,
       {"unknown key 'optimizer.params.eps'", "Valid keys in 'optimizer.params': lr, betas, weight_decay"}},
      {"{" M R"(, "Seed": 3})", 1, {"unknown key 'Seed'", "did you mean 'seed'?"}},
      // DeepSpeed keys mpzero does not implement
      {"{" M R"(, "amp": {"enabled": true}})", 1, {"'amp' is a DeepSpeed setting that mpzero does not implement"}},
      {"{" M R"(, "bfloat16": {"enabled": true, "enable": true}})", 1,
       {"unknown key 'bfloat16.enable'", "did you mean 'enabled'?"}},
      {"{" M R"(, "gradient_predivide_factor": 0})", 1,
       {"'gradient_predivide_factor' = 0 is invalid", "a finite number > 0"}},
      {"{" M R"(, "prescale_gradients": 1})", 1, {"'prescale_gradients'"}},
      {"{" M R"(, "fp16": {"enabled": true, "auto_cast": true}})", 1,
       {"'fp16.auto_cast' = true is not supported", "only false is accepted"}},
      {"{" M R"(, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})", 1,
       {"'zero_optimization.offload_param' is a DeepSpeed setting",
        "(or set 'zero_optimization.offload_param.device' to \"none\")"}},
      // a switchable DeepSpeed section is refused only when switched on, and says how to switch it off
      {"{" M R"(, "tensorboard": {"enabled": true, "output_path": "runs"}})", 1,
       {"'tensorboard' is a DeepSpeed setting that mpzero does not implement: no monitors",
        "(or set 'tensorboard.enabled' to false)"}},
      {"{" M R"(, "compile": {"deepcompile": true}})", 1, {"'compile'", "no DeepCompile", "'compile.deepcompile' to false"}},
      {"{" M R"(, "activation_checkpointing": {"partition_activations": false}})", 1,
       {"'activation_checkpointing' is a DeepSpeed setting", "checkpoint activations in the model"}},
      {"{" M R"(, "zero_optimization": {"stage": 1, "cpu_offload": "yes"}})", 1, {"'zero_optimization.cpu_offload'"}},
      // a nested "enabled" switches a part on even when the section's own flag is off
      {"{" M R"(, "data_efficiency": {"enabled": false, "data_routing": {"random_ltd": {"enabled": true}}}})", 1,
       {"'data_efficiency' is a DeepSpeed setting that mpzero does not implement"}},
      {"{" M R"(, "zero_optimization": {"stage": 2, "cpu_offload": false, "offload_optimizer": {"device": "cpu"}}})",
       1, {"'zero_optimization.cpu_offload' is DeepSpeed's deprecated form of 'zero_optimization.offload_optimizer'",
           "remove cpu_offload"}},
      {"{" M R"(, "zero_optimization": {"stage": 3, "cpu_offload_param": false, "offload_param": {"device": "none"}}})",
       1, {"'zero_optimization.cpu_offload_param' is DeepSpeed's deprecated form"}},
      {"{" M R"(, "managed_gradient_accumulation": "false"})", 1,
       {"'managed_gradient_accumulation' must be a boolean", "without quotes"}},
      // the seed blog's spelling of the fp16 flag
      {"{" M R"(, "fp16": {"enabled": true, "fp16_master_weights_and_gradients": true}})", 1,
       {"unknown key 'fp16.fp16_master_weights_and_gradients'", "did you mean 'fp16_master_weights_and_grads'?"}},
      {"{" M R"(, "bf16": {"enabled": true, "bf16_master_weights_and_gradients": true}})", 1,
       {"did you mean 'bf16_master_weights_and_grads'?"}},
      {"{" M R"(, "data_types": {"param_dtype": "bf16"}})", 1,
       {"'data_types.param_dtype' is a DeepSpeed setting", "from \"bf16\" / \"fp16\""}},
      {"{" M R"(, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}})", 1,
       {"'optimizer.params.max_grad_norm'", "use the top-level \"gradient_clipping\""}},
      {"{" M R"(, "optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", 1,
       {"'optimizer.params.amsgrad' = true is not supported"}},
      {"{" M R"(, "zero_optimization": {"legacy_stage1": true}})", 1,
       {"'zero_optimization.legacy_stage1' = true is not supported", "DeepSpeed >= 0.5.9 refuses true too",
        "set it to false"}},
      {"{" M R"(, "optimizer": {"type": "AdamW", "params": {"torch_adam": true, "bias_correction": false}}})", 1,
       {"'optimizer.params.bias_correction' = false with 'optimizer.params.torch_adam' = true",
        "torch.optim.AdamW", "remove torch_adam"}},
      {"{" M R"(, "optimizer": {"type": "AdamW", "params": {"torch_adam": "true"}}})", 1,
       {"'optimizer.params.torch_adam' must be a boolean", "without quotes"}},
      // wrong types: key, expected type, what was given
      {"{" M R"(, "fp16": {"enabled": "true"}})", 1,
       {"'fp16.enabled' must be a boolean", "got string \"true\"", "without quotes"}},
      {"{" M R"(, "zero_optimization": {"stage": "2"}})", 1,
       {"'zero_optimization.stage' must be an integer", "got string \"2\"", "without quotes"}},
      {"{" M R"(, "zero_optimization": {"stage": 1.5}})", 1, {"'zero_optimization.stage' must be an integer",
                                                             "got number 1.5"}},
      {"{" M R"(, "gradient_clipping": [1]})", 1, {"'gradient_clipping' must be a number", "got array [1]"}},
      {"{" M R"(, "optimizer": {"type": "Adam", "params": {"betas": 0.9}}})", 1,
       {"'optimizer.params.betas' must be a list of two numbers", "got number 0.9"}},
      {"{" M R"(, "bf16": true})", 1, {"'bf16' must be an object", "got boolean true"}},
      {"{" M R"(, "zero_optimization": true})", 1, {"'zero_optimization' must be an object", "{\"stage\": 1}"}},
      // "auto" (Hugging Face's placeholder) is named as such wherever it is, string keys included
      {R"({"train_batch_size": "auto"})", 1, {"'train_batch_size' = \"auto\"", "Hugging Face", "write the value"}},
      {"{" M R"(, "communication_data_type": "auto"})", 1, {"'communication_data_type' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "torch_autocast": {"dtype": "auto"}})", 1, {"'torch_autocast.dtype' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "data_types": {"grad_accum_dtype": "auto"}})", 1,
       {"'data_types.grad_accum_dtype' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "rounding": "auto"})", 1, {"'rounding' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "auto"}}})", 1,
       {"'scheduler.params.warmup_type' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "auto"}}})", 1,
       {"'zero_optimization.offload_optimizer.device' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})", 1,
       {"'optimizer.params.lr' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "gradient_predivide_factor": "auto"})", 1,
       {"'gradient_predivide_factor' = \"auto\"", "Hugging Face"}},
      {"{" M R"(, "zero_optimization": {"leaf_module": {"classes": [1]}}})", 1,
       {"'zero_optimization.leaf_module.classes' must be a list of strings", "an element is integer 1"}},
      {"{" M R"(, "torch_autocast": {"lower_precision_safe_modules": "Linear"}})", 1,
       {"'torch_autocast.lower_precision_safe_modules' must be a list of strings", "got string"}},
      {"{" M R"(, "torch_autocast": {"lower_precision_safe_modules": ["Linear", "torch.nn."]}})", 1,
       {"'torch_autocast.lower_precision_safe_modules' has an entry without a class name", "\"torch.nn.Linear\""}},
      {"[1, 2]", 1, {"must be a JSON object", "got array"}},
      // ranges
      {"{" M R"(, "zero_optimization": {"stage": 4}})", 1, {"'zero_optimization.stage' = 4 is out of range", "[0, 3]"}},
      {"{" M R"(, "gradient_clipping": -1})", 1, {"'gradient_clipping' = -1 is invalid", ">= 0"}},
      {"{" M R"(, "zero_optimization": {"reduce_bucket_size": 0}})", 1,
       {"'zero_optimization.reduce_bucket_size' = 0 is out of range", ">= 1"}},
      {"{" M R"(, "zero_optimization": {"sub_group_size": 0}})", 1,
       {"'zero_optimization.sub_group_size' = 0 is out of range", ">= 1"}},
      {"{" M R"(, "seed": -1})", 1, {"'seed' = -1 is out of range", ">= 0"}},
      {"{" M R"(, "seed": 1e20})", 1, {"'seed' = ", "is out of range", "in [0, 18446744073709551615]"}},
      {"{" M R"(, "zero_optimization": {"reduce_bucket_size": 2e19}})", 1,
       {"'zero_optimization.reduce_bucket_size' = ", "in [1, 18446744073709551615]"}},
      // precision rules
      {"{" M R"(, "bf16": {"enabled": true}, "fp16": {"enabled": true}})", 1,
       {"'bf16.enabled' and 'fp16.enabled' are both true"}},
      {"{" M R"(, "bf16": {"enabled": true, "bf16_master_weights_and_grads": true}})", 1,
       {"'bf16.bf16_master_weights_and_grads' needs ZeRO stage 1, 2 or 3", "stage is 0"}},
      {"{" M R"(, "bf16": {"enabled": true, "bf16_optimizer_states": true}})", 1,
       {"'bf16.bf16_optimizer_states' needs ZeRO stage 1, 2 or 3"}},
      {"{" M R"(, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}})", 1,
       {"'fp16.fp16_master_weights_and_grads' needs ZeRO stage 1, 2 or 3"}},
      {"{" M R"(, "bf16": {"enabled": true, "bf16_optimizer_states": true}, "zero_optimization": {"stage": 2}})", 1,
       {"'bf16.bf16_optimizer_states' needs 'bf16.bf16_master_weights_and_grads' = true"}},
      {"{" M R"(, "bf16": {"bf16_master_weights_and_grads": true}, "zero_optimization": {"stage": 1}})", 1,
       {"'bf16.bf16_master_weights_and_grads' is true but 'bf16.enabled' is not",
        "keeps a bf16 model's master weights and gradients in bf16"}},
      {"{" M R"(, "bf16": {"bf16_optimizer_states": true}, "zero_optimization": {"stage": 1}})", 1,
       {"'bf16.bf16_optimizer_states' is true but 'bf16.enabled' is not",
        "keeps a bf16 model's optimizer states in bf16", "or drop the flag"}},
      {"{" M R"(, "bf16": {"enabled": true}, "fp16": {"fp16_master_weights_and_grads": true},
            "zero_optimization": {"stage": 1}})",
       1, {"'fp16.fp16_master_weights_and_grads' is true but 'fp16.enabled' is not"}},
      {"{" M R"(, "fp16": {"enabled": true, "fp16_optimizer_states": true}, "zero_optimization": {"stage": 1}})", 1,
       {"'fp16.fp16_optimizer_states' = true is not supported", "fp16 optimizer states are refused"}},
      {"{" M R"(, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})", 1,
       {"'zero_optimization.offload_optimizer.device' = \"cpu\" needs ZeRO stage 1, 2 or 3"}},
      {"{" M R"(, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})", 1,
       {"\"nvme\" is not supported", "\"cpu\" or \"none\""}},
      {"{" M R"(, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}})", 1,
       {"'zero_optimization.offload_optimizer.device' = \"gpu\" is invalid"}},
      {"{" M R"(, "communication_data_type": "fp8"})", 1,
       {"'communication_data_type' = \"fp8\" is invalid", "\"fp32\", \"bf16\", \"fp16\""}},
      {"{" M R"(, "bf16": {"enabled": true}, "communication_data_type": "fp16"})", 1,
       {"'communication_data_type' = \"fp16\" mixes bf16 and fp16"}},
      {"{" M R"(, "fp16": {"enabled": true}, "communication_data_type": "BF16"})", 1,
       {"'communication_data_type' = \"bf16\" mixes bf16 and fp16 with a fp16 model", "\"fp32\""}},
      {"{" M R"(, "communication_data_type": 16})", 1, {"'communication_data_type' must be a string", "got integer 16"}},
      {"{" M R"(, "torch_autocast": {"dtype": 16}})", 1, {"'torch_autocast.dtype' must be a string"}},
      {"{" M R"(, "data_types": {"grad_accum_dtype": "int8"}})", 1,
       {"'data_types.grad_accum_dtype' = \"int8\" is invalid", "\"fp32\", \"bf16\" or \"fp16\""}},
      {"{" M R"(, "fp16": {"enabled": true, "fp16_master_weights_and_grads": true}, "zero_optimization": {"stage": 2},
            "data_types": {"grad_accum_dtype": "fp32"}})",
       1, {"'data_types.grad_accum_dtype' = \"fp32\" contradicts 'fp16.fp16_master_weights_and_grads'"}},
      {"{" M R"(, "torch_autocast": {"enabled": true, "dtype": "float32"}})", 1,
       {"'torch_autocast.dtype' = \"float32\" is invalid", "16-bit"}},
      {"{" M R"(, "bf16": {"enabled": true}, "torch_autocast": {"enabled": true, "dtype": "half"}})", 1,
       {"'torch_autocast.dtype' = \"fp16\" mixes bf16 and fp16 with a bf16 model", "{\"dtype\": \"bfloat16\"}"}},
      // the default dtype (bf16) with an fp16 model: the message says it is the default
      {"{" M R"(, "fp16": {"enabled": true}, "torch_autocast": {"enabled": true}})", 1,
       {"'torch_autocast.dtype' = \"bf16\" (the default) mixes bf16 and fp16 with a fp16 model",
        "{\"dtype\": \"float16\"}"}},
      {"{" M R"(, "bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp16"}})", 1,
       {"'data_types.grad_accum_dtype' = \"fp16\" with a bf16 model is not supported"}},
      {"{" M R"(, "bf16": {"enabled": true, "bf16_master_weights_and_grads": true}, "zero_optimization": {"stage": 1},
            "data_types": {"grad_accum_dtype": "fp32"}})",
       1, {"'data_types.grad_accum_dtype' = \"fp32\" contradicts 'bf16.bf16_master_weights_and_grads'"}},
      {"{" M R"(, "rounding": "stochastc"})", 1, {"'rounding' = \"stochastc\" is invalid", "did you mean 'stochastic'?"}},
      {"{" M R"(, "bf16": {"enabled": true}, "rounding": "stochastic"})", 1,
       {"'rounding' = \"stochastic\"", "keeps both in fp32"}},
      // loss scaling: the loss scaler's own validation
      {"{" M R"(, "fp16": {"enabled": true, "hysteresis": 0}})", 1,
       {"'fp16.hysteresis' = 0 is out of range; it must be an integer >= 1"}},
      {"{" M R"(, "fp16": {"enabled": true, "loss_scale_window": 0}})", 1,
       {"'fp16.loss_scale_window' = 0 is out of range; it must be an integer >= 1"}},
      {"{" M R"(, "fp16": {"enabled": true, "initial_scale_power": 100}})", 1,
       {"'fp16.initial_scale_power' = 100 is out of range; it must be an integer in [-64, 64]"}},
      {"{" M R"(, "fp16": {"enabled": true, "initial_scale_power": -65}})", 1,
       {"'fp16.initial_scale_power' = -65 is out of range; it must be an integer in [-64, 64]"}},
      {"{" M R"(, "fp16": {"enabled": true, "hysteresis": 3e9}})", 1,
       {"'fp16.hysteresis' = 3000000000.0 is more overflows than mpzero's loss scaler counts", "write 2147483647"}},
      {"{" M R"(, "fp16": {"enabled": true, "loss_scale_window": 3000000000}})", 1,
       {"'fp16.loss_scale_window' = 3000000000 is more steps than mpzero's loss scaler counts", "write 2147483647"}},
      {"{" M R"(, "fp16": {"enabled": true, "hysteresis": 1.5}})", 1, {"'fp16.hysteresis' must be an integer"}},
      {"{" M R"(, "fp16": {"enabled": true, "initial_scale_power": 2, "min_loss_scale": 8}})", 1,
       {"is below fp16.min_loss_scale = 8"}},
      {"{" M R"(, "fp16": {"enabled": true, "loss_scale": -2}})", 1, {"'fp16.loss_scale' = -2 is invalid"}},
      {"{" M R"(, "fp16": {"enabled": true, "min_loss_scale": 0}})", 1,
       {"fp16.min_loss_scale = 0 is invalid", "a finite number > 0"}},
      {"{" M R"(, "fp16": {"enabled": true, "min_loss_scale": -0.5}})", 1, {"fp16.min_loss_scale = -0.5 is invalid"}},
      // optimizer
      {"{" M R"(, "optimizer": {"type": "Lamb"}})", 1,
       {"'optimizer.type' = \"Lamb\" is not supported", "Adam, AdamW, SGD, Lion"}},
      {"{" M R"(, "optimizer": {"type": "Lino"}})", 1, {"did you mean 'Lion'?"}},
      {"{" M R"(, "optimizer": {"params": {"lr": 0.1}}})", 1, {"'optimizer.type' is missing"}},
      {"{" M R"(, "optimizer": {"type": "AdamW", "params": {"lr": -0.1}}})", 1,
       {"optimizer.params: AdamW: lr", "out of range"}},
      {"{" M R"(, "optimizer": {"type": "Adam", "params": {"betas": [1.0, 0.999]}}})", 1,
       {"optimizer.params: AdamW: beta1", "out of range"}},
      {"{" M R"(, "optimizer": {"type": "SGD", "params": {"nesterov": true}}})", 1,
       {"optimizer.params: SGD: nesterov = true needs momentum > 0"}},
      {"{" M R"(, "optimizer": {"type": "sgd", "params": {"momentum": 1.5}}})", 1,
       {"optimizer.params: SGD: momentum", "out of range"}},
      {"{" M R"(, "optimizer": {"type": "Lion", "params": {"betas": [0.9, 1.5]}}})", 1,
       {"optimizer.params: Lion: beta2", "out of range"}},
      {"{" M R"(, "optimizer": {"type": "AdamW", "params": {"eps": 0}}})", 1,
       {"optimizer.params: AdamW: eps", "out of range"}},
      {"{" M R"(, "optimizer": {"type": 3}})", 1, {"'optimizer.type' must be a string", "got integer 3"}},
      // scheduler
      {"{" M R"(, "scheduler": {"type": "StepLR", "params": {}}})", 1,
       {"'scheduler.type' = \"StepLR\" is not supported", "WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest, OneCycle"}},
      {"{" M R"(, "scheduler": {"type": "OneCycle", "params": {}}})", 1,
       {"'scheduler.params.cycle_min_lr' is missing", "DeepSpeed requires them too"}},
      {"{" M R"(, "scheduler": {"type": "warmuplr"}})", 1, {"did you mean 'WarmupLR'?"}},
      {"{" M R"(, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}})", 1,
       {"'scheduler.params.total_num_steps' is missing"}},
      {"{" M R"(, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 0.1}}})", 1,
       {"'scheduler.params.warmup_max_lr'", "WarmupCosineLR scales the optimizer's lr"}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})", 1,
       {"'scheduler.params.warmup_type' = \"cosine\" is invalid", "\"log\" or \"linear\""}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})", 1,
       {"'scheduler.params.warmup_num_steps' = 0 is out of range"}},
      {"{" M R"(, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}}})", 1,
       {"'scheduler.params.cos_min_ratio' = 2 is out of range", "[0, 1]"}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}})", 1,
       {"'scheduler.params.last_batch_iteration' = 5 is not supported"}},
      {"{" M R"(, "scheduler": {"params": {}}})", 1, {"'scheduler.type' is missing", "WarmupLR, WarmupDecayLR"}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": -0.1}}})", 1,
       {"'scheduler.params.warmup_min_lr' = -0.1 is out of range", "[0, 1000000]"}},
      {"{" M R"(, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_max_lr": 2e6}}})", 1,
       {"'scheduler.params.warmup_max_lr' = 2000000 is out of range"}},
      {"{" M R"(, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}})", 1,
       {"'scheduler.params.total_num_steps' = 0 is out of range", ">= 1"}},
      {"{" M R"(, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_min_ratio": -0.5}}})", 1,
       {"'scheduler.params.warmup_min_ratio' = -0.5 is out of range", "[0, 1]", "warmup_min_ratio x optimizer lr"}},
      {"{" M R"(, "scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 100}}})", 1,
       {"'scheduler.params.total_num_steps'", "use WarmupDecayLR to decay"}},
      // batch sizes
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})", 2,
       {"train_batch_size (32)", "train_micro_batch_size_per_gpu (4)", "gradient_accumulation_steps (2)",
        "world size (2) = 16", "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"}},
      {R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3})", 1,
       {"train_batch_size (10) is not a positive multiple of train_micro_batch_size_per_gpu (3) x world size (1)"}},
      {R"({"train_batch_size": 10, "gradient_accumulation_steps": 4})", 1,
       {"train_batch_size (10) is not a positive multiple of gradient_accumulation_steps (4)"}},
      {R"({"train_batch_size": 2})", 4, {"train_batch_size (2) is not a positive multiple of world size (4)"}},
      {R"({"gradient_accumulation_steps": 4})", 1, {"no batch size", "train_micro_batch_size_per_gpu"}},
      {R"({})", 1, {"no batch size"}},
      {R"({"train_micro_batch_size_per_gpu": 0})", 1, {"'train_micro_batch_size_per_gpu' = 0 is out of range", ">= 1"}},
      {R"({"train_batch_size": 0})", 1, {"'train_batch_size' = 0 is out of range", ">= 1"}},
      {R"({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 0})", 1,
       {"'gradient_accumulation_steps' = 0 is out of range", ">= 1"}},
      {R"({"train_batch_size": 4.5})", 1, {"'train_batch_size' must be an integer", "got number 4.5"}},
      {R"({"train_micro_batch_size_per_gpu": 1e19, "gradient_accumulation_steps": 4})", 1,
       {"batch sizes overflow 64 bits"}},
      {R"({"train_micro_batch_size_per_gpu": 1})", 0, {"world_size = 0 is invalid"}},
      // text-level
      {"{" M R"(, "gradient_clipping": 1e400})", 1, {"JSON number out of range", "'1e400'", "write a finite number"}},
      {"{" M R"(, "optimizer": {"type": "Adam", "params": {"lr": -2e308}}})", 1, {"JSON number out of range", "'-2e308'"}},
      {"{" M R"(, "zero_optimization": {"stage": 1, "stage": 2}})", 1, {"duplicate key 'zero_optimization.stage'"}},
      {"{" M R"(, "zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})", 1,
       {"'zero_optimization.stage3_prefetch_bucket_size' and its alias", "keep one"}},
      {"{" M R"(, "zero_optimization": {"param_persistence_threshold": 1, "stage3_param_persistence_threshold": 2}})",
       1, {"'zero_optimization.stage3_param_persistence_threshold' and its alias 'zero_optimization.param_persistence_threshold'"}},
  };
  // Each row fails for its own reason: the base it extends is valid.
  REQUIRE(error_of("{" M "}").empty());
#undef M
  for (const auto& r : rows) {
    INFO("config: " << r.text << " (world size " << r.world << ")");
    const std::string msg = error_of(r.text, r.world);
    INFO("message: " << msg);
    REQUIRE_FALSE(msg.empty());
    CHECK(msg.rfind("mpzero: config: ", 0) == 0);
    for (const auto& s : r.expect) CHECK(msg.find(s) != std::string::npos);
    // No message quotes int32 limits the user never wrote.
    CHECK(msg.find("-2147483648") == std::string::npos);
    // "(the default)" only when the user did not write the value.
    if (std::string(r.text).find("\"dtype\"") != std::string::npos) CHECK(msg.find("(the default)") == std::string::npos);
  }
  // No suggestion when nothing is close.
  const std::string far = error_of(R"({"train_micro_batch_size_per_gpu": 1, "completely_unrelated": 1})");
  CHECK(far.find("unknown key 'completely_unrelated'") != std::string::npos);
  CHECK(far.find("did you mean") == std::string::npos);
  // The error type is both config_error and the core's invalid_argument.
  CHECK_THROWS_AS(parse_config_text("{}", 1), mpzero::invalid_argument);
}

TEST_CASE("config: DeepSpeed keys accepted because they cannot change the result", "[config]") {
  const config c = parse_config_text(R"({
    "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10, "wall_clock_breakdown": true,
    "zero_allow_untested_optimizer": true, "prescale_gradients": false, "gradient_predivide_factor": 1,
    "fp16": {"auto_cast": false},
    "bf16": {"immediate_grad_update": false},
    "zero_optimization": {"stage": 3, "allgather_partitions": true, "sub_group_size": 1e9,
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": true, "round_robin_gradients": true,
                          "offload_optimizer": {"device": "cpu", "ratio": 1.0, "buffer_count": 4},
                          "stage3_module_granularity_threshold": 100, "stage3_use_all_reduce_for_fetch_params": true,
                          "stage3_allgather_sequential": true, "legacy_stage1": false,
                          "mics_hierarchical_params_gather": true, "override_module_apply": false,
                          "pipeline_loading_checkpoint": true, "log_trace_cache_warnings": true,
                          "enable_sanity_checks": true, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
                          "save_muon_momentum_buffer_in_memory": true,
                          "stage3_model_persistence_threshold": "auto"},
    "optimizer": {"type": "Adam", "params": {"amsgrad": false}},
    "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}}
  })",
                                     1);
  CHECK(c.zero.stage == 3);
  CHECK(c.zero.offload_optimizer == offload_device::cpu);
  CHECK(c.optimizer.type == optimizer_type::adamw);
  CHECK(c.optimizer.weight_decay == 0);
}

TEST_CASE("config: DeepSpeed sections that are switched off, or cannot act, are accepted and change nothing",
          "[config]") {
  // Each section below is what a DeepSpeed config commonly carries: switched off with
  // "enabled": false (or without "enabled", which DeepSpeed defaults to false), or
  // "device": "none", or a key that only logging or DeepSpeed's own data loader reads.
  const std::string base = R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 2)";
  const config plain = parse_config_text(base + "}}", 1);
  const config with = parse_config_text(base + R"(, "offload_param": {"device": "none", "pin_memory": true},
          "cpu_offload": false, "cpu_offload_use_pin_memory": true},
      "tensorboard": {"enabled": false, "output_path": "runs", "job_name": "x"},
      "wandb": {"project": "p"}, "csv_monitor": {"enabled": false}, "comet": {"enabled": false},
      "amp": {"enabled": false, "opt_level": "O1"}, "flops_profiler": {"enabled": false, "profile_step": 1},
      "comms_logger": {"enabled": true, "verbose": true}, "elasticity": {"enabled": false},
      "autotuning": {"enabled": false}, "eigenvalue": {"enabled": false}, "progressive_layer_drop": {"enabled": false},
      "curriculum_learning": {"enabled": false},
      "data_efficiency": {"enabled": false, "seed": 1234, "data_sampling": {"enabled": false, "num_workers": 0}},
      "hybrid_engine": {"enabled": false}, "nebula": {"enabled": false}, "compile": {"deepcompile": false},
      "aio": {"block_size": 1048576, "queue_depth": 8}, "dataloader_drop_last": true, "log_level": "info",
      "dump_state": false, "timers": {"throughput": {"enabled": true}}, "disable_allgather": false,
      "graph_harvesting": true, "managed_gradient_accumulation": true, "use_data_before_expert_parallelism": false})",
                                          1);
  require_same(with, plain);
  // The deprecated form alone, without the key that replaced it.
  require_same(parse_config_text(base + R"(, "cpu_offload_param": false}})", 1), plain);
  // A switch written as null is absent too, so the section is off.
  CHECK_NOTHROW(parse_config_text(base + R"(}, "tensorboard": {"enabled": null}})", 1));
  // The off switch must be the off value exactly: "enabled": "false" is a string, so on.
  CHECK(error_of(base + R"(}, "wandb": {"enabled": "false"}})").find("'wandb' is a DeepSpeed setting") !=
        std::string::npos);
}

TEST_CASE("config: DeepSpeed's deprecated spellings read with DeepSpeed's meaning, each with a notice", "[config]") {
  const config modern = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
      "bf16": {"enabled": true, "bf16_master_weights_and_grads": true},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})",
                                          2);
  CHECK(modern.notices.empty());
  const config old = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
      "bfloat16": {"enabled": true, "bf16_master_weights_and_grads": true},
      "zero_optimization": {"stage": 2, "cpu_offload": true}})",
                                       2);
  CHECK(to_json(old) == to_json(modern));
  REQUIRE(old.notices.size() == 2);
  CHECK_THAT(old.notices[0], Catch::Contains("'bfloat16' is DeepSpeed's deprecated name") &&
                                 Catch::Contains("rename it"));
  CHECK_THAT(old.notices[1], Catch::Contains("'zero_optimization.cpu_offload' is deprecated") &&
                                 Catch::Contains("\"offload_optimizer\": {\"device\": \"cpu\"}"));
  // false offloads nothing, and says nothing.
  const config off = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
      "zero_optimization": {"stage": 2, "cpu_offload": false}})",
                                       1);
  CHECK(off.zero.offload_optimizer == offload_device::none);
  CHECK(off.notices.empty());
  // Both sections: DeepSpeed reads "bf16" and ignores "bfloat16".
  const config both = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
      "bf16": {"enabled": false}, "bfloat16": {"enabled": true}})",
                                        1);
  CHECK_FALSE(both.bf16);
  REQUIRE(both.notices.size() == 1);
  CHECK_THAT(both.notices[0], Catch::Contains("'bfloat16' is ignored"));
  // Where DeepSpeed divides by the world size (before or after the sum) leaves the average.
  CHECK_NOTHROW(parse_config_text(
      R"({"train_micro_batch_size_per_gpu": 1, "prescale_gradients": true, "gradient_predivide_factor": 8})", 4));
}

TEST_CASE("config: without an optimizer the default is said aloud; one given in code reads as the section",
          "[config]") {
  const config none = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1})", 1);
  CHECK_FALSE(none.optimizer_given);
  CHECK(none.optimizer.type == optimizer_type::adamw);
  REQUIRE(none.notices.size() == 1);
  CHECK_THAT(none.notices[0], Catch::Contains("no \"optimizer\" section") && Catch::Contains("AdamW (lr 0.001") &&
                                  Catch::Contains("pass one to initialize"));
  const config in_config = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1,
      "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})",
                                             2);
  CHECK(in_config.optimizer_given);
  CHECK(in_config.notices.empty());
  optimizer_config sgd;
  sgd.type = optimizer_type::sgd;
  sgd.lr = 0.5;
  sgd.momentum = 0.9;
  const json no_section = json::parse(R"({"train_micro_batch_size_per_gpu": 1,
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})");
  const config in_code = parse_config_with_optimizer(no_section, sgd, 2);
  CHECK(to_json(in_code) == to_json(in_config));  // WarmupLR's peak is the code optimizer's lr too
  CHECK(in_code.optimizer_given);
  CHECK(in_code.notices.empty());
  // Both: refused. A bad value: the section's rule and message.
  CHECK_THROWS_WITH(parse_config_with_optimizer(json::parse(R"({"train_micro_batch_size_per_gpu": 1,
                                                   "optimizer": {"type": "AdamW"}})"),
                                                sgd, 1),
                    Catch::Contains("initialize was given an optimizer in code too; keep one"));
  sgd.lr = -1;
  CHECK_THROWS_WITH(parse_config_with_optimizer(no_section, sgd, 1), Catch::Contains("lr = -1 is out of range"));
}

TEST_CASE("config: DeepSpeed's field names of its stage-3 keys are accepted too", "[config]") {
  // DeepSpeedZeroConfig is a pydantic model with populate_by_name: each stage3_* key is
  // also read under its field name.
  CHECK_NOTHROW(parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
      "max_live_parameters": 1, "max_reuse_distance": 2, "model_persistence_threshold": 3,
      "gather_16bit_weights_on_model_save": true, "module_granularity_threshold": 4,
      "use_all_reduce_for_fetch_params": true, "allgather_sequential": true}})",
                                  1));
}

TEST_CASE("config: keys no engine uses take DeepSpeed's ranges", "[config]") {
  // docs/config.md says what mpzero does instead of each.
  const config unused = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
      "stage": 2, "allgather_bucket_size": 0, "stage3_prefetch_bucket_size": 0, "overlap_comm": true,
      "contiguous_gradients": false, "reduce_scatter": false, "leaf_module": {"classes": ["Block"]}}})",
                                          1);
  CHECK(unused.zero.allgather_bucket_size == 0);
  CHECK(unused.zero.stage3_prefetch_bucket_size == 0);
}

TEST_CASE("config: the loss-scale options are range-checked only when dynamic fp16 scaling uses them", "[config]") {
  const config off = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": false,
      "initial_scale_power": 2000, "loss_scale_window": 0, "hysteresis": 3e9, "min_loss_scale": -1}})",
                                       1);
  CHECK(off.loss_scaler.initial_scale_power == 2000);
  CHECK(off.loss_scaler.loss_scale_window == 0);
  CHECK(off.loss_scaler.hysteresis == 2147483647);  // unused, stored clamped to the scaler's int
  const config static_scale = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true,
      "loss_scale": 128, "initial_scale_power": 100, "hysteresis": 0}})",
                                                1);
  CHECK_FALSE(static_scale.loss_scaler.dynamic);
  CHECK(static_scale.loss_scaler.static_scale == 128);
  // ... and dynamic fp16 takes the whole 32-bit range the scaler counts.
  const config big = parse_config_text(R"({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true,
      "initial_scale_power": -64, "min_loss_scale": 1e-30, "hysteresis": 2147483647, "loss_scale_window": 2147483647}})",
                                       1);
  CHECK(big.loss_scaler.initial_scale_power == -64);
  CHECK(big.loss_scaler.hysteresis == 2147483647);
  CHECK(big.loss_scaler.loss_scale_window == 2147483647);
}

TEST_CASE("config: dtype selection", "[config]") {
  struct row {
    const char* sections;  // JSON members after the batch size
    dtype param, master, grad, state, comm;
  };
  using enum dtype;
  const row rows[] = {
      // neither: everything fp32
      {R"("zero_optimization": {"stage": 2})", fp32, fp32, fp32, fp32, fp32},
      // bf16 with an fp32 master: gradients stay bf16, as DeepSpeed accumulates and reduces them
      {R"("bf16": {"enabled": true}, "zero_optimization": {"stage": 1})", bf16, fp32, bf16, fp32, bf16},
      // ... unless data_types.grad_accum_dtype asks for fp32; they are then reduced in fp32
      // too (DeepSpeed would reduce them in bf16: write communication_data_type for that)
      {R"("bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"})", bf16, fp32, fp32, fp32, fp32},
      // bf16 master, fp32 states (allowed on the GPU: mpzero extension)
      {R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true}, "zero_optimization": {"stage": 2})", bf16,
       bf16, bf16, fp32, bf16},
      // all bf16
      {R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true},
          "zero_optimization": {"stage": 3})",
       bf16, bf16, bf16, bf16, bf16},
      // fp16 with an fp32 master
      {R"("fp16": {"enabled": true})", fp16, fp32, fp16, fp32, fp16},
      // fp16 master (states never fp16)
      {R"("fp16": {"enabled": true, "fp16_master_weights_and_grads": true}, "zero_optimization": {"stage": 1})", fp16,
       fp16, fp16, fp32, fp16},
      // communication_data_type overrides only the reduction dtype
      {R"("bf16": {"enabled": true}, "communication_data_type": "fp32")", bf16, fp32, bf16, fp32, fp32},
      {R"("bf16": {"enabled": true}, "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "bf16")",
       bf16, fp32, fp32, fp32, bf16},
      {R"("communication_data_type": "bf16")", fp32, fp32, fp32, fp32, bf16},
      // autocast changes no storage dtype
      {R"("torch_autocast": {"enabled": true}, "zero_optimization": {"stage": 3})", fp32, fp32, fp32, fp32, fp32},
  };
  for (const auto& r : rows) {
    const std::string text = std::string(R"({"train_micro_batch_size_per_gpu": 1, )") + r.sections + "}";
    INFO(text);
    const config c = parse_config_text(text, 2);
    CHECK(c.param_dtype() == r.param);
    CHECK(c.master_dtype() == r.master);
    CHECK(c.grad_dtype() == r.grad);
    CHECK(c.state_dtype() == r.state);
    CHECK(c.comm_dtype() == r.comm);
  }
}

TEST_CASE("config: to_json round-trips", "[config]") {
  const std::vector<std::pair<std::string, int>> cases = {
      {R"({"train_micro_batch_size_per_gpu": 1})", 1},
      {R"({"train_batch_size": 64, "gradient_accumulation_steps": 4, "seed": 7, "rounding": "stochastic",
          "bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true,
                   "check_grad_overflow": false},
          "torch_autocast": {"enabled": true, "lower_precision_safe_modules": ["Linear", "Embedding"]},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": false},
                                "reduce_bucket_size": 12345, "leaf_module": {"classes": "Block", "names": ["a", "b"]}},
          "gradient_clipping": 0, "communication_data_type": "fp32",
          "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.5, 0.6], "eps": 1e-7, "adam_w_mode": false}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_num_steps": 20,
                                                             "warmup_min_ratio": 0.25, "cos_min_ratio": 0.125}}})",
       4},
      {R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
          "fp16": {"enabled": true, "loss_scale": 1024, "fp16_master_weights_and_grads": true},
          "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp16"},
          "optimizer": {"type": "SGD", "params": {"lr": 0.3, "momentum": 0.5, "dampening": 0.25}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 77, "warmup_type": "linear",
                                                            "warmup_min_lr": 0.001, "warmup_max_lr": 0.01}}})",
       2},
      {R"({"train_batch_size": 3, "fp16": {"enabled": true, "initial_scale_power": 5, "hysteresis": 4,
          "loss_scale_window": 9, "min_loss_scale": 0.25, "consecutive_hysteresis": true},
          "optimizer": {"type": "lion", "params": {"betas": [0.9, 0.99]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}, "zero_optimization": {"stage": 2}})",
       3},
      {R"({"train_batch_size": 2, "fp16": {"initial_scale_power": 900, "hysteresis": 3e9, "loss_scale_window": -5},
          "torch_autocast": {"lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]},
          "zero_optimization": {"stage": 2, "sub_group_size": 4096, "allgather_bucket_size": 0},
          "optimizer": {"type": "AdamW", "params": {"torch_adam": true}}})",
       1},
      {R"({"train_batch_size": 2, "param_groups": [{"name": "no_decay", "patterns": ["bias$", "norm"],
          "weight_decay": 0}, {"name": "head", "patterns": "^lm_head\\.", "lr": 2.5e-4}]})",
       1},
  };
  for (const auto& [text, world] : cases) {
    INFO(text);
    const config a = parse_config_text(text, world);
    const json ja = to_json(a);
    const config b = parse_config(ja, world);
    require_same(a, b);
    CHECK(to_json(b) == ja);
    // The dump is itself valid input text.
    require_same(a, parse_config_text(ja.dump(2), world));
  }
}

TEST_CASE("config: files: errors name the path; comments allowed", "[config]") {
  SECTION("a good file, with comments") {
    temp_file f("good.json", "// DeepSpeed reads hjson; comments are fine\n{\n  \"train_batch_size\": 8, /* x */\n"
                             "  \"zero_optimization\": {\"stage\": 2}\n}\n");
    const config c = load_config_file(f.path.string(), 2);
    CHECK(c.zero.stage == 2);
    CHECK(c.train_micro_batch_size_per_gpu == 4);
  }
  SECTION("a missing file") {
    const std::string path = (std::filesystem::temp_directory_path() / "mpzero_no_such_config.json").string();
    try {
      load_config_file(path, 1);
      FAIL("no error");
    } catch (const config_error& e) {
      const std::string m = e.what();
      CHECK(m.find("'" + path + "'") != std::string::npos);
      CHECK(m.find("cannot be opened") != std::string::npos);
    }
  }
  SECTION("a syntax error names the line and column") {
    temp_file f("syntax.json", "{\n  \"train_batch_size\": 8,\n  \"zero_optimization\": {\"stage\" 2}\n}\n");
    try {
      load_config_file(f.path.string(), 1);
      FAIL("no error");
    } catch (const config_error& e) {
      const std::string m = e.what();
      INFO(m);
      CHECK(m.find("'" + f.path.string() + "'") != std::string::npos);
      CHECK(m.find("JSON syntax error") != std::string::npos);
      CHECK(m.find("line 3, column 33") != std::string::npos);
    }
  }
  SECTION("a validation error names the file and the key") {
    temp_file f("bad.json", R"({"train_batch_size": 8, "zero_optimization": {"stage": 9}})");
    try {
      load_config_file(f.path.string(), 1);
      FAIL("no error");
    } catch (const config_error& e) {
      const std::string m = e.what();
      INFO(m);
      CHECK(m.rfind("mpzero: config file '" + f.path.string() + "': ", 0) == 0);
      CHECK(m.find("'zero_optimization.stage' = 9 is out of range") != std::string::npos);
    }
  }
  SECTION("duplicate keys") {
    temp_file f("dup.json", R"({"train_batch_size": 8, "train_batch_size": 16})");
    CHECK_THROWS_WITH(load_config_file(f.path.string(), 1), Catch::Contains("duplicate key 'train_batch_size'"));
  }
}

TEST_CASE("config: param_groups are read from JSON and checked, naming the group", "[config]") {
  const config c = parse_config_text(R"({"train_batch_size": 1, "param_groups": [
      {"name": "no_decay", "patterns": ["bias$", "LayerNorm\\.weight"], "weight_decay": 0.0},
      {"name": "embeddings", "patterns": "^embed", "lr": 1e-4}]})", 1);
  REQUIRE(c.param_groups.size() == 2);
  CHECK(c.param_groups[0].name == "no_decay");
  CHECK(c.param_groups[0].patterns == std::vector<std::string>{"bias$", "LayerNorm\\.weight"});
  CHECK_FALSE(c.param_groups[0].lr);
  CHECK(c.param_groups[0].weight_decay == 0.0);
  CHECK(c.param_groups[1].patterns == std::vector<std::string>{"^embed"});
  CHECK(c.param_groups[1].lr == 1e-4);
  CHECK_FALSE(c.param_groups[1].weight_decay);
  const auto bad = [](const std::string& groups) {
    return parse_config_text(R"({"train_batch_size": 1, "param_groups": )" + groups + "}", 1);
  };
  CHECK_THROWS_WITH(bad(R"({"name": "a"})"), Catch::Contains("'param_groups' must be an array"));
  CHECK_THROWS_WITH(bad(R"([{"patterns": ["x"]}])"), Catch::Contains("param_groups[0] has no name"));
  CHECK_THROWS_WITH(bad(R"([{"name": "a"}])"), Catch::Contains("param_groups[0] ('a') has no patterns"));
  CHECK_THROWS_WITH(bad(R"([{"name": "a", "patterns": ["x"]}, {"name": "a", "patterns": ["y"]}])"),
                    Catch::Contains("param_groups[1] ('a'): another group has this name"));
  CHECK_THROWS_WITH(bad(R"([{"name": "default", "patterns": ["x"]}])"),
                    Catch::Contains("\"default\" names the parameters no group matches"));
  CHECK_THROWS_WITH(bad(R"([{"name": "a", "patterns": ["bias("]}])"),
                    Catch::Contains("pattern \"bias(\" is not a regular expression"));
  CHECK_THROWS_WITH(bad(R"([{"name": "a", "patterns": ["x"], "lr": -1}])"),
                    Catch::Contains("('a'): lr = -1 is invalid"));
  CHECK_THROWS_WITH(bad(R"([{"name": "a", "patterns": ["x"], "weight_decay": "0.1"}])"),
                    Catch::Contains("weight_decay' must be a number"));
  CHECK_THROWS_WITH(bad(R"([{"name": "a", "patterns": ["x"], "weight_dacay": 0.1}])"),
                    Catch::Contains("weight_decay"));
}

TEST_CASE("config: names of enums", "[config]") {
  CHECK(optimizer_name(optimizer_type::adam) == "Adam");
  CHECK(optimizer_name(optimizer_type::adamw) == "AdamW");
  CHECK(optimizer_name(optimizer_type::sgd) == "SGD");
  CHECK(optimizer_name(optimizer_type::lion) == "Lion");
  CHECK(scheduler_name(scheduler_type::none).empty());
  CHECK(scheduler_name(scheduler_type::warmup_lr) == "WarmupLR");
  CHECK(scheduler_name(scheduler_type::warmup_decay_lr) == "WarmupDecayLR");
  CHECK(scheduler_name(scheduler_type::warmup_cosine_lr) == "WarmupCosineLR");
  CHECK(offload_device_name(offload_device::cpu) == "cpu");
  CHECK(offload_device_name(offload_device::none) == "none");
}

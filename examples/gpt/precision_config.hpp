// The main job's precision configurations by name (fp32, bf16, bf16-master, bf16-all,
// bf16-all-sr, fp16: docs/perf.md and README), as the DeepSpeed config keys that select
// them. Shared by examples/gpt/train_gpt.cpp and tests/test_torch_gpu.cpp, so a test
// of "bf16-all-sr" runs what the main job calls bf16-all-sr.
#pragma once

#include <string_view>

#include <nlohmann/json.hpp>

namespace mpzero_gpt {

// Sets the bf16 / fp16 / rounding keys of `config` for the precision `name` ("fp32"
// sets none). fp16 gets the section `fp16` (its loss-scaling keys are the caller's).
inline void set_precision(nlohmann::json& config, std::string_view name,
                          const nlohmann::json& fp16 = {{"enabled", true}}) {
  if (name == "bf16") config["bf16"] = {{"enabled", true}};
  if (name == "bf16-master") config["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}};
  if (name == "bf16-all" || name == "bf16-all-sr")
    config["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}};
  if (name == "bf16-all-sr") config["rounding"] = "stochastic";
  if (name == "fp16") config["fp16"] = fp16;
}

}  // namespace mpzero_gpt

// The GPT comparison's precision configurations by name (fp32, bf16, bf16-master,
// bf16-all, bf16-all-sr, fp16, fp16-master; fp32-ac, bf16-all-ac, bf16-all-sr-ac with
// autocast: docs/gpt_example.md), as the DeepSpeed config keys that select them. Shared by
// examples/gpt/train_gpt.cpp and tests/test_torch_gpu.cpp, so a test of "bf16-all-sr"
// runs what the comparison calls bf16-all-sr.
#pragma once

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace mpzero_gpt {

// The precisions set_precision knows, each also with "-ac" (below).
inline constexpr std::array<std::string_view, 7> base_precisions = {
    "fp32", "bf16", "bf16-master", "bf16-all", "bf16-all-sr", "fp16", "fp16-master"};

// Sets the bf16 / fp16 / rounding keys of `config` for the precision `name` ("fp32"
// sets none). fp16 and fp16-master get the section `fp16` (its loss-scaling keys are the
// caller's); fp16-master adds fp16_master_weights_and_grads.
// A name ending in "-ac" is the precision before it with `torch_autocast` in bf16 (the
// forward under LibTorch autocast): "bf16-all-ac" is the DeepSpeed blog's low-precision
// configuration (bf16 master, gradients and states + autocast), "fp32-ac" PyTorch AMP.
// An unknown name throws std::invalid_argument and leaves `config` as it was.
inline void set_precision(nlohmann::json& config, std::string_view name,
                          const nlohmann::json& fp16 = {{"enabled", true}}) {
  constexpr std::string_view ac = "-ac";
  const bool autocast = name.size() > ac.size() && name.ends_with(ac);
  const std::string_view base = autocast ? name.substr(0, name.size() - ac.size()) : name;
  if (std::find(base_precisions.begin(), base_precisions.end(), base) == base_precisions.end()) {
    std::string known;
    for (const std::string_view p : base_precisions) (known += known.empty() ? "" : ", ") += p;
    throw std::invalid_argument("precision '" + std::string(name) + "' is unknown; use one of " + known +
                                ", each optionally with -ac (autocast in bf16)");
  }
  if (autocast) config["torch_autocast"] = {{"enabled", true}, {"dtype", "bfloat16"}};
  if (base == "bf16") config["bf16"] = {{"enabled", true}};
  if (base == "bf16-master") config["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}};
  if (base == "bf16-all" || base == "bf16-all-sr")
    config["bf16"] = {{"enabled", true}, {"bf16_master_weights_and_grads", true}, {"bf16_optimizer_states", true}};
  if (base == "bf16-all-sr") config["rounding"] = "stochastic";
  if (base == "fp16" || base == "fp16-master") config["fp16"] = fp16;
  if (base == "fp16-master") config["fp16"]["fp16_master_weights_and_grads"] = true;
}

}  // namespace mpzero_gpt

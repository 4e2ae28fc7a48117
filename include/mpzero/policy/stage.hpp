// mpzero: ZeRO stage and offload as types.
#pragma once

#include <string_view>

#include "../config.hpp"
#include "rules.hpp"

namespace mpzero {

// ZeRO stage: 0 replicates everything; 1 partitions master weights and optimizer
// states; 2 also gradients; 3 also the model parameters.
template <int N>
struct stage {
  static_assert(N >= 0 && N <= 3, MPZERO_RULE_STAGE);
  static constexpr int value = N;
};

enum class offload_kind { none, cpu };

constexpr std::string_view name_of(offload_kind o) noexcept { return o == offload_kind::none ? "none" : "cpu"; }

// Where master weights and optimizer states live, and where the step runs.
struct offload_none {
  static constexpr offload_kind value = offload_kind::none;
};
struct offload_cpu {
  static constexpr offload_kind value = offload_kind::cpu;
};

}  // namespace mpzero

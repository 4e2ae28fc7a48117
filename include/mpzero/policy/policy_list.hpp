// mpzero: the named precision policies (policies::*), listed once. Everything that
// enumerates them (the LibTorch engine's step kernels and its config names, the tests'
// tables) expands this list.
#pragma once

#include <cstddef>
#include <string_view>

#include "../zero/spec.hpp"
#include "precision.hpp"

// X(name) for every policy in namespace mpzero::policies.
#define MPZERO_POLICIES(X) \
  X(fp32)                  \
  X(bf16_fp32_grads)       \
  X(bf16_fp32_master)      \
  X(bf16_master_fp32_states) \
  X(bf16_all)              \
  X(bf16_all_sr)           \
  X(fp16_fp32_master)      \
  X(fp16_master_fp32_states)

namespace mpzero {

struct named_policy {
  std::string_view name;  // the policies:: type's name
  precision_spec spec;
};

#define MPZERO_NAMED_POLICY(P) named_policy{#P, precision_spec_of<policies::P>()},
inline constexpr named_policy named_policies[] = {MPZERO_POLICIES(MPZERO_NAMED_POLICY)};
#undef MPZERO_NAMED_POLICY

static_assert(
    [] {
      for (std::size_t a = 0; a < std::size(named_policies); ++a)
        for (std::size_t b = a + 1; b < std::size(named_policies); ++b)
          if (named_policies[a].spec == named_policies[b].spec) return false;
      return true;
    }(),
    "two named policies have the same dtypes and rounding: list each once");

// The named policy with these dtypes and rounding, or null.
constexpr const named_policy* find_policy(const precision_spec& p) noexcept {
  for (const named_policy& n : named_policies)
    if (n.spec == p) return &n;
  return nullptr;
}

}  // namespace mpzero

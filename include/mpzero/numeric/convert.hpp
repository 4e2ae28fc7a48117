// mpzero: rounding modes and the generic float -> storage conversions used by the
// fused step.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>

#include "dtype.hpp"

namespace mpzero {

// Rounding of low-precision writes (master weights, optimizer states, parameters).
struct round_nearest {
  static constexpr bool stochastic = false;
  static constexpr std::string_view name = "nearest";
};
struct round_stochastic {
  static constexpr bool stochastic = true;
  static constexpr std::string_view name = "stochastic";
};

template <class R>
concept rounding_mode = std::same_as<R, round_nearest> || std::same_as<R, round_stochastic>;

// Nearest-even conversion from float to a storage type.
template <storage_type T>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr T from_float(float x) noexcept {
  if constexpr (std::same_as<T, float>) {
    return x;
  } else if constexpr (std::same_as<T, bf16>) {
    return bf16_from_float_rn(x);
  } else {
    return fp16_from_float_rn(x);
  }
}

// Stochastic conversion with 16 random bits; identity for float.
template <storage_type T>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr T from_float_sr(float x, std::uint16_t rand16) noexcept {
  if constexpr (std::same_as<T, float>) {
    (void)rand16;
    return x;
  } else if constexpr (std::same_as<T, bf16>) {
    return bf16_from_float_sr(x, rand16);
  } else {
    return fp16_from_float_sr(x, rand16);
  }
}

template <storage_type T, rounding_mode R>
MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr T round_as(float x, std::uint16_t rand16) noexcept {
  if constexpr (R::stochastic) {
    return from_float_sr<T>(x, rand16);
  } else {
    (void)rand16;
    return from_float<T>(x);
  }
}

}  // namespace mpzero

// mpzero: the three storage dtypes of model states, as types and as values.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "bf16.hpp"
#include "fp16.hpp"

namespace mpzero {

using fp32 = float;

enum class dtype : std::uint8_t { fp32, bf16, fp16 };

template <class T>
struct dtype_of {
  static_assert(dependent_false<T>, "mpzero: model states are stored as mpzero::fp32 (float), mpzero::bf16 or mpzero::fp16");
};
template <>
struct dtype_of<float> {
  static constexpr dtype value = dtype::fp32;
};
template <>
struct dtype_of<bf16> {
  static constexpr dtype value = dtype::bf16;
};
template <>
struct dtype_of<fp16> {
  static constexpr dtype value = dtype::fp16;
};
template <class T>
inline constexpr dtype dtype_of_v = dtype_of<T>::value;

template <class T>
concept storage_type = std::same_as<T, float> || std::same_as<T, bf16> || std::same_as<T, fp16>;

constexpr std::size_t size_of(dtype d) noexcept { return d == dtype::fp32 ? 4 : 2; }

// Calls f(static_cast<T*>(nullptr)) with T the storage type of d (float, bf16, fp16):
// the one switch from a dtype value to its type.
template <class F>
constexpr decltype(auto) visit_dtype(dtype d, F&& f) {
  switch (d) {
    case dtype::bf16: return f(static_cast<bf16*>(nullptr));
    case dtype::fp16: return f(static_cast<fp16*>(nullptr));
    case dtype::fp32: break;
  }
  return f(static_cast<float*>(nullptr));  // fp32 (callers validate values from outside)
}

constexpr std::string_view name_of(dtype d) noexcept {
  switch (d) {
    case dtype::fp32: return "fp32";
    case dtype::bf16: return "bf16";
    case dtype::fp16: return "fp16";
  }
  return "?";
}

MPZERO_HOST_DEVICE MPZERO_FORCEINLINE constexpr float to_float(float x) noexcept { return x; }

}  // namespace mpzero

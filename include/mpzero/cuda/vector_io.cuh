// mpzero: 16-byte vector loads and stores of N contiguous elements.
#pragma once

#include <cstdint>

#include "../config.hpp"

namespace mpzero::cuda::detail {

// Loads N elements of T starting at p (16-byte aligned, N * sizeof(T) a multiple of 16).
template <class T, int N>
__device__ MPZERO_FORCEINLINE void load_vec(const T* p, T (&out)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "vector loads move whole 16-byte words");
  constexpr int words = static_cast<int>(N * sizeof(T) / 16);
  uint4 tmp[words];
#pragma unroll
  for (int k = 0; k < words; ++k) tmp[k] = reinterpret_cast<const uint4*>(p)[k];
  __builtin_memcpy(out, tmp, sizeof(tmp));
}

template <class T, int N>
__device__ MPZERO_FORCEINLINE void store_vec(T* p, const T (&in)[N]) {
  static_assert((N * sizeof(T)) % 16 == 0, "vector stores move whole 16-byte words");
  constexpr int words = static_cast<int>(N * sizeof(T) / 16);
  uint4 tmp[words];
  __builtin_memcpy(tmp, in, sizeof(tmp));
#pragma unroll
  for (int k = 0; k < words; ++k) reinterpret_cast<uint4*>(p)[k] = tmp[k];
}

__device__ MPZERO_FORCEINLINE bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace mpzero::cuda::detail

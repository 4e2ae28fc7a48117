// mpzero: compile-time configuration shared by every header.
#pragma once

#define MPZERO_VERSION_MAJOR 0
#define MPZERO_VERSION_MINOR 1
#define MPZERO_VERSION_PATCH 0

// Functions that run on host and device. With plain g++ these are ordinary
// inline functions; under nvcc they become __host__ __device__.
#if defined(__CUDACC__)
#define MPZERO_HOST_DEVICE __host__ __device__
#define MPZERO_DEVICE __device__
#define MPZERO_FORCEINLINE __forceinline__
#else
#define MPZERO_HOST_DEVICE
#define MPZERO_DEVICE
#define MPZERO_FORCEINLINE inline __attribute__((always_inline))
#endif

// Asks nvcc's device pass to unroll the loop that follows (a loop over a compile-time
// count in code shared with the host, cuda/thread_work.hpp); nothing in host code,
// where g++ (nvcc's host pass included) would warn about an unknown pragma.
#if defined(__CUDA_ARCH__)
#define MPZERO_UNROLL _Pragma("unroll")
#else
#define MPZERO_UNROLL
#endif

// True while compiling device code (nvcc's device pass).
#if defined(__CUDA_ARCH__)
#define MPZERO_IS_DEVICE_CODE 1
#else
#define MPZERO_IS_DEVICE_CODE 0
#endif

// A lambda inlined into its caller (the host loops' element bodies), so that the loop
// around the call vectorizes as if the body were written there.
#if defined(__GNUC__) || defined(__clang__)
#define MPZERO_FORCEINLINE_LAMBDA __attribute__((always_inline))
#else
#define MPZERO_FORCEINLINE_LAMBDA
#endif

#if defined(__GNUC__) || defined(__clang__)
#define MPZERO_RESTRICT __restrict__
#else
#define MPZERO_RESTRICT
#endif

namespace mpzero {

// Used in static_assert inside templates that must only fail when instantiated.
template <class...>
inline constexpr bool dependent_false = false;

}  // namespace mpzero

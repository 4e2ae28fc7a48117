// mpzero: inputs and results of the fused gradient check (global L2 norm for
// clipping, non-finite detection for loss scaling), shared by the backends.
#pragma once

#include <cstdint>

#include "../numeric/dtype.hpp"

namespace mpzero {

// A read-only view of one gradient tensor.
template <storage_type G>
struct grad_view {
  const G* data = nullptr;
  std::uint64_t numel = 0;
};

struct grad_stats {
  double norm_squared = 0;  // sum of squares in fp64 (host: chunk partials in plan order; CUDA: CUB trees)
  bool nonfinite = false;   // some element is NaN or infinite
};

}  // namespace mpzero

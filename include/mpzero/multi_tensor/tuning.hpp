// mpzero: launch tuning of the CUDA kernels, as plain constexpr data that host tests
// can check against the planner's defaults.
#pragma once

#include <cstdint>

#include "plan.hpp"

namespace mpzero {

struct cuda_tuning {
  static constexpr int threads = 512;  // per block; one block per chunk
  static constexpr int ilp = 8;        // elements per thread per iteration (16-byte vectors of 16-bit types)
  static constexpr int reduce_threads = 256;
};

// A chunk that is a whole number of block iterations keeps every chunk but a
// tensor's last one on the vector path.
static_assert(plan_options{}.chunk_size % (cuda_tuning::threads * cuda_tuning::ilp) == 0);

}  // namespace mpzero

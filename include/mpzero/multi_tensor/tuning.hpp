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

// The fused step's launch shape, by rounding mode: the best of a sweep of shapes on an
// H200 and an H100 (docs/perf.md, "CUDA launch shapes"). Nearest rounding moves bytes,
// and more, shorter blocks (chunks of 16K elements, 4 block iterations) keep more of
// them in flight; stochastic rounding computes Philox draws, and 1024 threads per block
// hide more of that arithmetic. The shape changes no result: each element's update and
// rounding bits depend on its global index alone.
template <bool Stochastic>
struct cuda_step_tuning {
  static constexpr int threads = Stochastic ? 1024 : 512;
  static constexpr int ilp = 8;
  static constexpr std::uint32_t chunk = Stochastic ? 65536u : 16384u;
  static_assert(chunk % (threads * ilp) == 0, "a chunk is a whole number of block iterations");
};

// The plan options for a launch shape: its chunk size, the rest the defaults.
template <class Tuning>
constexpr plan_options plan_for() noexcept {
  plan_options o;
  o.chunk_size = Tuning::chunk;
  return o;
}

// The plan options for a step over `tensors` (anything with a .numel) on a GPU of
// `multiprocessors` SMs: the shape's chunk, halved while the step would have fewer chunks
// than SMs (a chunk is one block, so some SMs would get none) and a chunk is more than one
// block iteration (threads x ilp elements). A small step then reaches every SM: a million
// elements are 64 chunks of 16K, or 16 of 64K with stochastic rounding, for the 132 SMs
// of an H100, and a ZeRO partition shrinks as ranks are added. A step that already gives
// every SM a block keeps the shape's chunk, as its sweep chose it (docs/perf.md, "CUDA
// launch shapes"). The chunk changes no result (see cuda_step_tuning).
template <class Tuning, class Tensors>
constexpr plan_options plan_for(const Tensors& tensors, int multiprocessors) noexcept {
  plan_options o = plan_for<Tuning>();
  constexpr std::uint32_t iteration = static_cast<std::uint32_t>(Tuning::threads) * Tuning::ilp;
  const std::uint64_t wanted = static_cast<std::uint64_t>(multiprocessors > 0 ? multiprocessors : 1);
  const auto chunks = [&](std::uint32_t size) {
    std::uint64_t n = 0;
    for (const auto& t : tensors) n += (t.numel + size - 1) / size;
    return n;
  };
  while (o.chunk_size > iteration && chunks(o.chunk_size) < wanted) {
    const std::uint32_t half = o.chunk_size / 2 / iteration * iteration;
    o.chunk_size = half > iteration ? half : iteration;
  }
  return o;
}

}  // namespace mpzero

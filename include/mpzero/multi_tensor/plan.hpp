// mpzero: the multi-tensor planner. Splits many tensors into fixed-size chunks and
// groups the chunks into launches. Pure host logic: the CUDA backend uploads the
// plan once and reuses it every step; the host backend spreads its chunks over
// threads. Chunk boundaries are fixed by the plan, never by the thread count, so
// per-chunk partial results (norms) are summed in the same order everywhere.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"

namespace mpzero {

// Tuning as plain constexpr data (CUB's habit): host tests can check it.
struct plan_options {
  std::uint32_t chunk_size = 65536;             // elements per chunk (one CUDA block), 1 .. 2^31
  std::uint32_t max_chunks_per_launch = 1u << 20;  // bounds one launch's grid
  std::uint32_t max_tensors_per_launch = 1u << 16;  // bounds one launch's tensor table
};

struct chunk {
  std::uint32_t tensor;  // index into the tensor list
  std::uint32_t size;    // elements in this chunk (1..chunk_size)
  std::uint64_t begin;   // first element within the tensor
};

struct launch_range {
  std::uint32_t first_chunk, num_chunks;
  std::uint32_t first_tensor, num_tensors;  // tensors referenced by these chunks
};

class multi_tensor_plan {
 public:
  multi_tensor_plan() = default;

  multi_tensor_plan(std::span<const std::uint64_t> numels, plan_options opt = {}) : options_(opt) {
    if (opt.chunk_size == 0) detail::throw_invalid("plan_options: chunk_size = 0; use a positive chunk size (65536 is the default)");
    // The host and CUDA loops index a chunk with 32 bits and step past its end by up to a
    // block of elements: past 2^31 the index could wrap and the loop never end.
    if (opt.chunk_size > 0x80000000u) {
      detail::throw_invalid("plan_options: chunk_size = " + std::to_string(opt.chunk_size) +
                            " is above 2^31; use at most 2147483648 (the default is 65536)");
    }
    if (opt.max_chunks_per_launch == 0) detail::throw_invalid("plan_options: max_chunks_per_launch = 0; it must be at least 1");
    // One launch is one grid of num_chunks blocks in x: CUDA allows at most 2^31 - 1.
    if (opt.max_chunks_per_launch > 0x7fffffffu) {
      detail::throw_invalid("plan_options: max_chunks_per_launch = " + std::to_string(opt.max_chunks_per_launch) +
                            " exceeds CUDA's grid limit; use at most 2147483647 (the default is 1048576)");
    }
    if (opt.max_tensors_per_launch == 0) detail::throw_invalid("plan_options: max_tensors_per_launch = 0; it must be at least 1");
    if (numels.size() > UINT32_MAX) detail::throw_invalid("multi_tensor_plan: more than 2^32-1 tensors");
    // Count first: chunk indices are 32-bit, and nothing is allocated for a plan that cannot exist.
    std::uint64_t n_chunks = 0;
    for (const std::uint64_t n : numels) n_chunks += (n + opt.chunk_size - 1) / opt.chunk_size;
    if (n_chunks > UINT32_MAX) {
      detail::throw_invalid("multi_tensor_plan: " + std::to_string(n_chunks) +
                            " chunks exceed 2^32-1; use a larger plan_options::chunk_size");
    }
    chunks_.reserve(static_cast<std::size_t>(n_chunks));
    launch_range current{0, 0, 0, 0};
    for (std::uint32_t t = 0; t < numels.size(); ++t) {
      total_elements_ += numels[t];
      for (std::uint64_t begin = 0; begin < numels[t]; begin += opt.chunk_size) {
        const bool fits = current.num_chunks < opt.max_chunks_per_launch &&
                          (current.num_chunks == 0 || t - current.first_tensor < opt.max_tensors_per_launch);
        if (!fits) {
          launches_.push_back(current);
          current = launch_range{static_cast<std::uint32_t>(chunks_.size()), 0, 0, 0};
        }
        if (current.num_chunks == 0) current.first_tensor = t;
        current.num_tensors = t - current.first_tensor + 1;
        const std::uint64_t size = std::min<std::uint64_t>(opt.chunk_size, numels[t] - begin);
        chunks_.push_back(chunk{t, static_cast<std::uint32_t>(size), begin});
        ++current.num_chunks;
      }
    }
    if (current.num_chunks > 0) launches_.push_back(current);
  }

  // The views below point into the plan: a temporary plan's would dangle once the
  // statement ends, so they are deleted on rvalues. Keep the plan in a variable.
  std::span<const chunk> chunks() const& noexcept { return chunks_; }
  std::span<const chunk> chunks() const&& = delete;
  std::span<const launch_range> launches() const& noexcept { return launches_; }
  std::span<const launch_range> launches() const&& = delete;
  std::uint64_t total_elements() const noexcept { return total_elements_; }
  const plan_options& options() const& noexcept { return options_; }
  const plan_options& options() const&& = delete;

 private:
  plan_options options_{};
  std::vector<chunk> chunks_;
  std::vector<launch_range> launches_;
  std::uint64_t total_elements_ = 0;
};

}  // namespace mpzero

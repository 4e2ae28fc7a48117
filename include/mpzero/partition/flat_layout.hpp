// mpzero: the flat layout of one parameter group. Parameters are packed in order,
// without gaps, into one flat buffer; the buffer is padded so that it splits into
// world_size equal slices whose size is a multiple of align_elements; rank r owns
// slice r. A parameter may straddle slices, and a rank may own only padding (few,
// small parameters on many ranks). Pure host logic, all sizes 64-bit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../error.hpp"

namespace mpzero {

// Half-open range [begin, end) of flat-buffer elements.
struct flat_range {
  std::uint64_t begin = 0, end = 0;
  constexpr std::uint64_t size() const noexcept { return end - begin; }
  constexpr bool empty() const noexcept { return end == begin; }
  friend constexpr bool operator==(const flat_range&, const flat_range&) noexcept = default;
};

// Intersection of two ranges; empty (at the larger begin) when they do not overlap.
constexpr flat_range intersect(flat_range a, flat_range b) noexcept {
  const std::uint64_t lo = std::max(a.begin, b.begin);
  const std::uint64_t hi = std::min(a.end, b.end);
  return hi > lo ? flat_range{lo, hi} : flat_range{lo, lo};
}

struct flat_layout_options {
  // Each rank's slice size is a multiple of this, so every slice starts aligned
  // (8 elements = 16 bytes of a 16-bit type: vector loads and NCCL's fast paths).
  std::uint64_t align_elements = 8;
};

// One parameter's piece inside a flat range: elements [param_offset, param_offset + count)
// of parameter `param` sit at flat elements [flat_offset, flat_offset + count).
struct segment {
  std::size_t param;
  std::uint64_t param_offset;
  std::uint64_t flat_offset;
  std::uint64_t count;
  friend constexpr bool operator==(const segment&, const segment&) noexcept = default;
};

class flat_layout {
 public:
  flat_layout() = default;

  flat_layout(std::span<const std::uint64_t> numels, int world_size, flat_layout_options opt = {})
      : options_(opt), world_size_(world_size) {
    if (world_size < 1) {
      detail::throw_invalid("flat_layout: world_size = " + std::to_string(world_size) +
                            "; it must be at least 1 (pass the communicator's size)");
    }
    if (opt.align_elements == 0) {
      detail::throw_invalid("flat_layout: align_elements = 0; it must be at least 1 (the default, 8, keeps "
                            "every slice 16-byte aligned for 16-bit types)");
    }
    constexpr std::uint64_t max64 = std::numeric_limits<std::uint64_t>::max();
    prefix_.reserve(numels.size() + 1);
    prefix_.push_back(0);
    for (std::size_t p = 0; p < numels.size(); ++p) {
      if (numels[p] > max64 - total_) {
        detail::throw_invalid("flat_layout: parameter " + std::to_string(p) + " (numel " +
                              std::to_string(numels[p]) + ") makes the total exceed 2^64-1 elements; "
                              "split the parameters into several groups");
      }
      total_ += numels[p];
      prefix_.push_back(total_);
    }
    const auto ws = static_cast<std::uint64_t>(world_size);
    if (opt.align_elements > max64 / ws) {
      detail::throw_invalid("flat_layout: world_size * align_elements (" + std::to_string(world_size) + " * " +
                            std::to_string(opt.align_elements) + ") exceeds 2^64-1; use a smaller align_elements");
    }
    const std::uint64_t unit = ws * opt.align_elements;
    // An empty group stays empty: no rank allocates anything for it.
    const std::uint64_t units = total_ / unit + (total_ % unit != 0 ? 1 : 0);
    if (units > max64 / unit) {
      detail::throw_invalid("flat_layout: " + std::to_string(total_) + " elements padded to a multiple of " +
                            std::to_string(unit) + " exceed 2^64-1; split the parameters into several groups");
    }
    padded_ = units * unit;
    partition_ = padded_ / ws;
  }

  int world_size() const noexcept { return world_size_; }
  // Deleted on rvalues: a temporary layout's options would dangle once the statement ends.
  const flat_layout_options& options() const& noexcept { return options_; }
  const flat_layout_options& options() const&& = delete;
  std::size_t num_params() const noexcept { return prefix_.empty() ? 0 : prefix_.size() - 1; }

  // Start of `param` in the flat buffer.
  std::uint64_t offset(std::size_t param) const {
    check_param(param, "offset");
    return prefix_[param];
  }
  std::uint64_t numel(std::size_t param) const {
    check_param(param, "numel");
    return prefix_[param + 1] - prefix_[param];
  }
  // [offset, offset + numel)
  flat_range param_range(std::size_t param) const {
    check_param(param, "param_range");
    return {prefix_[param], prefix_[param + 1]};
  }

  std::uint64_t total_numel() const noexcept { return total_; }
  // total_numel rounded up to a multiple of world_size * align_elements; 0 when the group is empty.
  std::uint64_t padded_numel() const noexcept { return padded_; }
  std::uint64_t partition_numel() const noexcept { return partition_; }
  // The padding tail [total_numel, padded_numel): part of no parameter, kept zero by its owners.
  flat_range padding() const noexcept { return {total_, padded_}; }

  // [rank * partition_numel, (rank + 1) * partition_numel)
  flat_range partition(int rank) const {
    if (rank < 0 || rank >= world_size_) {
      detail::throw_invalid("flat_layout::partition: rank = " + std::to_string(rank) + " is outside [0, " +
                            std::to_string(world_size_) + "); pass a rank of this layout's world");
    }
    const auto r = static_cast<std::uint64_t>(rank);
    return {r * partition_, (r + 1) * partition_};
  }

  // The rank whose partition holds flat element `flat_index` (padding included).
  int owner(std::uint64_t flat_index) const {
    if (flat_index >= padded_) {
      detail::throw_invalid("flat_layout::owner: flat index " + std::to_string(flat_index) +
                            " is outside the padded buffer [0, " + std::to_string(padded_) + ")");
    }
    return static_cast<int>(flat_index / partition_);
  }

  // Pieces of parameters inside `r`, in flat order. Padding and zero-size parameters
  // have no segment, so the pieces of a partition list exactly what its owner updates.
  std::vector<segment> segments(flat_range r) const {
    check_range(r, "segments");
    std::vector<segment> out;
    if (r.empty() || r.begin >= total_) return out;
    // First parameter ending after r.begin (skips zero-size parameters at that offset).
    const auto first = std::upper_bound(prefix_.begin() + 1, prefix_.end(), r.begin);
    for (auto p = static_cast<std::size_t>(first - (prefix_.begin() + 1));
         p < num_params() && prefix_[p] < r.end; ++p) {
      const flat_range piece = intersect(r, {prefix_[p], prefix_[p + 1]});
      if (!piece.empty()) out.push_back(segment{p, piece.begin - prefix_[p], piece.begin, piece.size()});
    }
    return out;
  }

  // result[k] = |r ∩ partition(k)|: per-rank counts of a reduce-scatter or all-gather over r.
  std::vector<std::uint64_t> rank_counts(flat_range r) const {
    check_range(r, "rank_counts");
    std::vector<std::uint64_t> counts(static_cast<std::size_t>(world_size_), 0);
    if (r.empty()) return counts;
    // Only the ranks from owner(begin) to owner(end - 1) can be non-zero.
    for (int k = owner(r.begin), last = owner(r.end - 1); k <= last; ++k) {
      counts[static_cast<std::size_t>(k)] = intersect(r, partition(k)).size();
    }
    return counts;
  }

 private:
  void check_param(std::size_t param, const char* who) const {
    if (param >= num_params()) {
      detail::throw_invalid(std::string("flat_layout::") + who + ": parameter index " + std::to_string(param) +
                            " is out of range; the layout has " + std::to_string(num_params()) + " parameters");
    }
  }
  void check_range(flat_range r, const char* who) const {
    if (r.begin > r.end || r.end > padded_) {
      detail::throw_invalid(std::string("flat_layout::") + who + ": range [" + std::to_string(r.begin) + ", " +
                            std::to_string(r.end) + ") is not a range inside the padded buffer [0, " +
                            std::to_string(padded_) + ")");
    }
  }

  flat_layout_options options_{};
  int world_size_ = 1;
  std::vector<std::uint64_t> prefix_;  // prefix_[p] = offset(p); prefix_[num_params()] = total_
  std::uint64_t total_ = 0;
  std::uint64_t padded_ = 0;
  std::uint64_t partition_ = 0;
};

}  // namespace mpzero

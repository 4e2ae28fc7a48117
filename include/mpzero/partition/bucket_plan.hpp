// mpzero: gradient buckets. Consecutive parameters are grouped, greedily and in
// parameter order, into buckets of at most bucket_numel elements, so one collective
// moves a whole bucket once all its gradients exist. Pure host logic.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "flat_layout.hpp"

namespace mpzero {

// Parameters [first_param, end_param); `range` is their contiguous span of the flat
// buffer. Padding belongs to no bucket, so the last bucket ends at total_numel.
struct bucket {
  std::size_t first_param, end_param;
  flat_range range;
  constexpr std::size_t num_params() const noexcept { return end_param - first_param; }
  friend constexpr bool operator==(const bucket&, const bucket&) noexcept = default;
};

class bucket_plan {
 public:
  bucket_plan() = default;

  // A parameter larger than bucket_numel gets a bucket of its own, or with `pieces`, is
  // cut into pieces of bucket_numel elements, each a bucket of its own (the last piece
  // may share its bucket with the parameters after it), so that no bucket exceeds
  // bucket_numel; zero-size parameters join the bucket of the parameter before them (or,
  // at the start, the one after). Buckets are listed in parameter order; backward
  // produces gradients roughly in reverse order, so the LAST bucket usually completes
  // first.
  // `split` (a parameter index; none by default) starts a new bucket there: no bucket
  // holds parameters from both sides. launch_order() then reduces the buckets before the
  // split last-first, and those after it last-first after them (the ZeRO core splits at
  // its small parameters, placed last: they fill only when backward reaches the first
  // layers, and reduced first they would hold back every other bucket).
  bucket_plan(const flat_layout& layout, std::uint64_t bucket_numel, std::size_t split = static_cast<std::size_t>(-1),
              bool pieces = false)
      : bucket_numel_(bucket_numel) {
    if (bucket_numel == 0) {
      detail::throw_invalid("bucket_plan: bucket_numel = 0; it must be at least 1 (DeepSpeed's "
                            "reduce_bucket_size default is 5e8 elements)");
    }
    const std::size_t n = layout.num_params();
    if (n == 0) return;
    bucket current{0, 0, {layout.offset(0), layout.offset(0)}};
    for (std::size_t p = 0; p < n; ++p) {
      std::uint64_t size = layout.numel(p);
      // Close the current bucket only when it holds elements, so a bucket has zero size
      // only when every parameter has. The sum cannot overflow: it is at most total_numel.
      const bool crosses_split = p >= split && current.first_param < split;
      if (size > 0 && !current.range.empty() && (current.range.size() + size > bucket_numel || crosses_split)) {
        buckets_.push_back(current);
        current = bucket{p, p, {current.range.end, current.range.end}};
      }
      if (pieces) {
        // Whole pieces of a large parameter, each its own bucket (current is empty here).
        for (; size > bucket_numel; size -= bucket_numel) {
          current.end_param = p + 1;
          current.range.end += bucket_numel;
          buckets_.push_back(current);
          current = bucket{p, p, {current.range.end, current.range.end}};
        }
        if (size == 0 && layout.numel(p) > 0) {
          current.first_param = p + 1;  // the last piece was whole: the next bucket starts after p
          current.end_param = p + 1;
          continue;
        }
      }
      current.end_param = p + 1;
      current.range.end += size;
    }
    if (current.end_param > current.first_param || buckets_.empty()) buckets_.push_back(current);
    std::size_t first_after = buckets_.size();  // the first bucket of the parameters from split on
    while (first_after > 0 && buckets_[first_after - 1].first_param >= split) --first_after;
    for (std::size_t b = first_after; b-- > 0;) launch_order_.push_back(b);
    for (std::size_t b = buckets_.size(); b-- > first_after;) launch_order_.push_back(b);
  }

  // The views below point into the plan: a temporary plan's would dangle once the
  // statement ends (`for (auto& b : bucket_plan(...).buckets())` reads freed memory), so
  // they are deleted on rvalues. Keep the plan in a variable.
  std::span<const bucket> buckets() const& noexcept { return buckets_; }
  std::span<const bucket> buckets() const&& = delete;
  // Bucket indices in the order to reduce them: descending (the order backward usually
  // completes them), with the buckets from `split` on after the others.
  std::span<const std::size_t> launch_order() const& noexcept { return launch_order_; }
  std::span<const std::size_t> launch_order() const&& = delete;
  std::size_t num_buckets() const noexcept { return buckets_.size(); }
  std::uint64_t bucket_numel() const noexcept { return bucket_numel_; }

  // Buckets [first, end) holding `param`: one, or with pieces, one per piece.
  std::pair<std::size_t, std::size_t> buckets_of(std::size_t param) const {
    const std::size_t first = bucket_of(param);
    const auto it = std::upper_bound(buckets_.begin() + static_cast<std::ptrdiff_t>(first), buckets_.end(), param,
                                     [](std::size_t q, const bucket& b) { return q < b.first_param; });
    return {first, static_cast<std::size_t>(it - buckets_.begin())};
  }
  // The most elements of one bucket.
  std::uint64_t max_bucket_numel() const noexcept {
    std::uint64_t m = 0;
    for (const bucket& b : buckets_) m = std::max(m, b.range.size());
    return m;
  }

  // Index of the (first) bucket holding `param`.
  std::size_t bucket_of(std::size_t param) const {
    const std::size_t n = buckets_.empty() ? 0 : buckets_.back().end_param;
    if (param >= n) {
      detail::throw_invalid("bucket_plan::bucket_of: parameter index " + std::to_string(param) +
                            " is out of range; the plan covers " + std::to_string(n) + " parameters");
    }
    // First bucket whose end_param exceeds param.
    const auto it = std::upper_bound(buckets_.begin(), buckets_.end(), param,
                                     [](std::size_t q, const bucket& b) { return q < b.end_param; });
    return static_cast<std::size_t>(it - buckets_.begin());
  }

 private:
  std::vector<bucket> buckets_;
  std::vector<std::size_t> launch_order_;
  std::uint64_t bucket_numel_ = 0;
};

}  // namespace mpzero

// mpzero: the ZeRO core's stage-3 gathers: groups of partitioned parameters all-gathered
// (prefetched without waiting, then gathered) and released, each parameter in one group at
// a time. Private to zero/core.hpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "core_state.hpp"

namespace mpzero::detail {

class param_groups {
 public:
  explicit param_groups(core_state& s) : s_(s) {}
  param_groups(const param_groups&) = delete;
  param_groups& operator=(const param_groups&) = delete;
  // Gathers prefetched and never gathered write into buffers freed here.
  ~param_groups() {
    for (auto& [key, g] : groups_) {
      if (g.request) {
        try {
          g.request->wait();
        } catch (...) {  // timed out or failed: nothing runs on
        }
      }
    }
  }

  // After the layout: one pointer per slot, none gathered.
  void init() {
    if (s_.stage() == 3) gathered_.assign(s_.layout.num_params(), nullptr);
  }
  // Slot sl's gathered copy, or null.
  void* gathered(std::size_t sl) const { return gathered_[sl]; }
  std::uint64_t bytes() const {
    std::uint64_t b = 0;
    for (const auto& [k, g] : groups_) b += g.data.bytes();
    return b;
  }

  // What rewrites the partitions (step, load_param, load_checkpoint) needs every group
  // released: a gathered copy would keep the old values, and a prefetch still in flight
  // reads the partitions while they are written. Groups are gathered collectively, so
  // every rank refuses alike.
  void require_none(const char* who) const {
    if (groups_.empty()) return;
    const auto& [first, end] = groups_.begin()->first;
    throw_invalid("ZeroOptimizer::" + std::string(who) + ": " + std::to_string(groups_.size()) +
                  " parameter group(s) are gathered (e.g. [" + std::to_string(first) + ", " + std::to_string(end) +
                  ")); release() them first: this rewrites the partitions they were gathered from, and a gathered "
                  "copy would keep the old values");
  }

  void prefetch(std::size_t first, std::size_t end) {
    require_stage3("prefetch");
    const auto key = std::make_pair(first, end);
    if (groups_.count(key)) return;
    const flat_range r = gather_range(first, end);
    // A partitioned parameter belongs to one gathered group at a time: its param() points
    // into that group's copy, and releasing either of two groups would drop the other's
    // pointer. (Persistent and empty parameters are never gathered: ranges may share them.)
    for (const auto& [other, g] : groups_) {
      for (std::size_t i = std::max(first, other.first); i < std::min(end, other.second); ++i) {
        const flat_range p = s_.layout.param_range(s_.slot(i));
        if (p.empty() || p.begin >= s_.persistent_begin) continue;
        throw_invalid("ZeroOptimizer::gather/prefetch(" + std::to_string(first) + ", " + std::to_string(end) +
                      "): parameter " + std::to_string(i) + " is already in the gathered group [" +
                      std::to_string(other.first) + ", " + std::to_string(other.second) +
                      "); release() that group first, or gather exactly that range");
      }
    }
    gathered_group g;
    g.range = r;
    // One rank holds every element: its partition is the gathered parameters (no copy).
    if (!r.empty() && s_.world > 1) {
      g.data = s_.be.allocate(s_.param_t(), r.size());
      const std::vector<std::uint64_t> counts = s_.layout.rank_counts(r);
      const flat_range own = intersect(r, s_.shard);
      const void* in = s_.params.at(own.empty() ? 0 : own.begin - s_.shard.begin);
      s_.be.before_comm(s_.comm);
      g.request.emplace(s_.comm.base().iall_gather_v(in, counts[static_cast<std::size_t>(s_.rank)], g.data.data(),
                                                     counts, wire_of(s_.param_t())));
    }
    groups_.emplace(key, std::move(g));
  }

  void gather(std::size_t first, std::size_t end) {
    require_stage3("gather");
    prefetch(first, end);
    const auto it = groups_.find(std::make_pair(first, end));
    gathered_group& g = it->second;
    if (g.request) {
      wait_or_abandon(it);
      g.request.reset();
    }
    for (std::size_t i = first; i < end; ++i) {
      const std::size_t sl = s_.slot(i);
      const std::uint64_t off = s_.layout.offset(sl);
      if (off < s_.persistent_begin) {
        gathered_[sl] = s_.world > 1 ? g.data.at(off - g.range.begin) : s_.params.at(off - s_.shard.begin);
      }
    }
  }

  void release(std::size_t first, std::size_t end) {
    require_stage3("release");
    auto it = groups_.find(std::make_pair(first, end));
    if (it == groups_.end()) {
      throw_invalid("ZeroOptimizer::release(" + std::to_string(first) + ", " + std::to_string(end) +
                    "): that group is not gathered; release exactly the ranges you gathered");
    }
    if (it->second.request) wait_or_abandon(it);
    unbind_group(first, end);
    groups_.erase(it);
  }

 private:
  struct gathered_group {
    flat_range range;
    raw_buffer data;
    std::optional<comm::any_request> request;
  };
  using group_map = std::map<std::pair<std::size_t, std::size_t>, gathered_group>;

  // Waits for a group's all-gather; if that throws, forgets the group (see release()).
  void wait_or_abandon(group_map::iterator it) {
    try {
      it->second.request->wait();
    } catch (...) {
      unbind_group(it->first.first, it->first.second);
      abandoned_groups_.push_back(std::move(it->second));
      groups_.erase(it);
      throw;
    }
  }
  void unbind_group(std::size_t first, std::size_t end) {
    for (std::size_t i = first; i < end; ++i) {
      const std::size_t sl = s_.slot(i);
      if (s_.layout.offset(sl) < s_.persistent_begin) gathered_[sl] = nullptr;
    }
  }

  flat_range gather_range(std::size_t first, std::size_t end) const {
    if (first > end || end > s_.num_params()) {
      throw_invalid("ZeroOptimizer::gather(" + std::to_string(first) + ", " + std::to_string(end) +
                    "): not a range of parameters [first, end) within [0, " + std::to_string(s_.num_params()) + ")");
    }
    flat_range r{0, 0};
    bool any = false;
    for (std::size_t i = first; i < end; ++i) {
      const flat_range p = s_.layout.param_range(s_.slot(i));
      if (p.begin >= s_.persistent_begin || p.empty()) continue;
      r = any ? flat_range{std::min(r.begin, p.begin), std::max(r.end, p.end)} : p;
      any = true;
    }
    return r;
  }

  void require_stage3(const char* who) const {
    if (s_.stage() != 3) {
      throw_invalid("ZeroOptimizer::" + std::string(who) + " gathers ZeRO-3 parameters; this optimizer is stage " +
                    std::to_string(s_.stage()) + ", whose parameters are whole on every rank");
    }
  }

  core_state& s_;
  std::vector<void*> gathered_;
  group_map groups_;
  std::vector<gathered_group> abandoned_groups_;  // whose all-gather failed (see release())
};

}  // namespace mpzero::detail

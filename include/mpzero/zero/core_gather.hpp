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

class gather_groups {
 public:
  explicit gather_groups(core_state& s) : s_(s) {}
  gather_groups(const gather_groups&) = delete;
  gather_groups& operator=(const gather_groups&) = delete;
  // Gathers prefetched and never gathered write into buffers freed here.
  ~gather_groups() {
    for (auto& [key, g] : groups_) {
      for (auto& r : g.requests) {
        try {
          r.wait();
        } catch (...) {  // timed out or failed: nothing runs on
        }
      }
    }
  }

  // After the layout: one pointer per slot, none gathered.
  void init() {
    if (s_.stage() != 3) return;
    gathered_.assign(s_.layout.num_params(), nullptr);
    gathered_type_.assign(s_.layout.num_params(), s_.param_t());
  }
  // Slot sl's gathered copy, or null, and the dtype it holds.
  void* gathered(std::size_t sl) const { return gathered_[sl]; }
  dtype gathered_type(std::size_t sl) const { return gathered_type_[sl]; }
  std::uint64_t bytes() const {
    std::uint64_t b = 0;
    for (const auto& [k, g] : groups_)
      for (const run& r : g.runs) b += r.data.bytes() + r.send.bytes();
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

  // in_param_dtype: every parameter in the parameter dtype, whatever
  // zero_options::gather_dtypes says (what a save reads).
  void prefetch(std::size_t first, std::size_t end, bool in_param_dtype = false) {
    require_stage3("prefetch");
    const auto key = std::make_pair(first, end);
    if (const auto it = groups_.find(key); it != groups_.end()) {
      if (it->second.in_param_dtype != in_param_dtype && !s_.zo.gather_dtypes.empty()) {
        throw_invalid("ZeroOptimizer::gather/prefetch(" + std::to_string(first) + ", " + std::to_string(end) +
                      "): the group is gathered in " +
                      (it->second.in_param_dtype ? "the parameter dtype" : "zero_options::gather_dtypes") +
                      "; release() it before gathering it the other way");
      }
      return;
    }
    (void)gather_range(first, end);  // checks the range
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
    g.in_param_dtype = in_param_dtype;
    g.runs = plan_runs(first, end, in_param_dtype);
    for (run& x : g.runs) {
      const flat_range own = intersect(x.range, s_.shard);
      const void* mine = s_.params.at(own.empty() ? 0 : own.begin - s_.shard.begin);
      if (s_.world == 1) {
        // One rank holds every element: its partition is the gathered parameters (no
        // copy), or their conversion to the gather dtype.
        if (x.type != s_.param_t()) {
          x.data = s_.be.allocate(x.type, x.range.size());
          s_.be.convert(x.data.data(), x.type, mine, s_.param_t(), x.range.size());
        }
        continue;
      }
      x.data = s_.be.allocate(x.type, x.range.size());
      const void* in = mine;
      if (x.type != s_.param_t() && !own.empty()) {
        x.send = s_.be.allocate(x.type, own.size());
        s_.be.convert(x.send.data(), x.type, mine, s_.param_t(), own.size());
        in = x.send.data();
      }
      const std::vector<std::uint64_t> counts = s_.layout.rank_counts(x.range);
      s_.be.before_comm(s_.comm);
      g.requests.emplace_back(s_.comm.base().iall_gather_v(in, counts[static_cast<std::size_t>(s_.rank)], x.data.data(),
                                                        counts, wire_of(x.type)));
    }
    groups_.emplace(key, std::move(g));
  }

  void gather(std::size_t first, std::size_t end, bool in_param_dtype = false) {
    require_stage3("gather");
    prefetch(first, end, in_param_dtype);
    const auto it = groups_.find(std::make_pair(first, end));
    gathered_group& g = it->second;
    if (!g.requests.empty()) {
      wait_or_abandon(it);
      g.requests.clear();
      for (run& x : g.runs) x.send.reset();
    }
    for (std::size_t i = first; i < end; ++i) {
      const std::size_t sl = s_.slot(i);
      const flat_range p = s_.layout.param_range(sl);
      if (p.begin >= s_.persistent_begin || p.empty()) continue;
      const auto x = std::find_if(g.runs.begin(), g.runs.end(),
                                  [&](const run& r) { return r.range.begin <= p.begin && p.end <= r.range.end; });
      gathered_type_[sl] = x->type;
      gathered_[sl] = x->data.allocated() ? x->data.at(p.begin - x->range.begin) : s_.params.at(p.begin - s_.shard.begin);
    }
  }

  void release(std::size_t first, std::size_t end) {
    require_stage3("release");
    auto it = groups_.find(std::make_pair(first, end));
    if (it == groups_.end()) {
      throw_invalid("ZeroOptimizer::release(" + std::to_string(first) + ", " + std::to_string(end) +
                    "): that group is not gathered; release exactly the ranges you gathered");
    }
    if (!it->second.requests.empty()) wait_or_abandon(it);
    unbind_group(first, end);
    groups_.erase(it);
  }

 private:
  // A part of a group gathered in one dtype by one all-gather: its flat range, the
  // gathered copy (absent at world size 1 in the parameter dtype: the partition is it)
  // and this rank's block converted to the gather dtype (while the all-gather runs).
  struct run {
    flat_range range;
    dtype type;
    raw_buffer data, send;
  };
  struct gathered_group {
    bool in_param_dtype = false;
    std::vector<run> runs;
    std::vector<comm::any_request> requests;
  };
  using group_map = std::map<std::pair<std::size_t, std::size_t>, gathered_group>;

  // The partitioned parameters of [first, end) in flat order, in runs of one gather
  // dtype (a run takes the padding up to its next parameter).
  std::vector<run> plan_runs(std::size_t first, std::size_t end, bool in_param_dtype) const {
    std::vector<std::pair<flat_range, dtype>> params;
    for (std::size_t i = first; i < end; ++i) {
      const flat_range p = s_.layout.param_range(s_.slot(i));
      if (p.begin >= s_.persistent_begin || p.empty()) continue;
      const dtype d = in_param_dtype || s_.zo.gather_dtypes.empty() ? s_.param_t() : s_.zo.gather_dtypes[i];
      params.emplace_back(p, d);
    }
    std::sort(params.begin(), params.end(),
              [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
    std::vector<run> runs;
    for (const auto& [p, d] : params) {
      if (!runs.empty() && runs.back().type == d) {
        runs.back().range.end = p.end;
      } else {
        runs.push_back(run{p, d, {}, {}});
      }
    }
    return runs;
  }

  // Waits for a group's all-gathers; if one throws, forgets the group (see release()).
  void wait_or_abandon(group_map::iterator it) {
    try {
      for (auto& r : it->second.requests) r.wait();
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

  // Checks [first, end); returns the flat range its partitioned parameters span.
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
  std::vector<dtype> gathered_type_;
  group_map groups_;
  std::vector<gathered_group> abandoned_groups_;  // whose all-gather failed (see release())
};

}  // namespace mpzero::detail

// mpzero: the ZeRO core's layout: the flat layout and shard, the wire runs, this rank's
// model-state buffers, the step's tensors over them, and what the ranks agree on. Pure
// functions of the core's state at construction. Private to zero/core.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../policy/rules.hpp"
#include "core_state.hpp"
#include "step_kernel.hpp"

namespace mpzero::detail {

// What every rank must have alike (the core's agreement compares it), and how a message
// names this rank's side.
inline std::pair<std::string, std::string> core_identity(const core_state& s, std::string_view optimizer,
                                                         std::span<const std::uint64_t> numels) {
  const zero_options& zo = s.zo;
  const precision_spec& p = s.spec.precision;
  std::uint64_t elements = 0;
  std::string id = std::string(optimizer) + " " + std::to_string(s.stage()) + " " +
                   std::to_string(static_cast<int>(p.param)) + std::to_string(static_cast<int>(p.master)) +
                   std::to_string(static_cast<int>(p.grad)) + std::to_string(static_cast<int>(p.state)) +
                   std::to_string(p.stochastic_rounding) + std::to_string(s.offloaded()) + "\n";
  for (const std::uint64_t n : numels) {
    id += std::to_string(n) + " ";
    elements += n;
  }
  id += "\nbucket " + std::to_string(zo.reduce_bucket_numel) + ", persistence " +
        std::to_string(zo.param_persistence_threshold) + ", sub-group " + std::to_string(zo.offload_sub_group_numel) +
        ", align " + std::to_string(zo.layout.align_elements) + ", clipping " +
        format_double(zo.gradient_clipping) + ", flags " + std::to_string(zo.loss_scaling) +
        std::to_string(zo.check_overflow) + std::to_string(zo.average_gradients) + ", wire " +
        std::to_string(static_cast<int>(s.spec.wire));
  for (const dtype d : zo.wire_dtypes) id += " " + std::to_string(static_cast<int>(d));
  id += "\ngather";
  for (const dtype d : zo.gather_dtypes) id += " " + std::to_string(static_cast<int>(d));
  id += "\ngroups";
  for (const param_group_options& g : zo.param_groups)
    id += " " + format_double(g.lr_scale) + "/" + (g.weight_decay ? format_double(*g.weight_decay) : "-");
  for (const std::uint32_t g : zo.group_of) id += " " + std::to_string(g);
  if (zo.loss_scaling) {
    const loss_scale_options& l = zo.loss_scale;
    id += "\nscaler " + std::to_string(l.dynamic) + " " + format_double(l.static_scale) + " " +
          std::to_string(l.initial_scale_power) + " " + std::to_string(l.loss_scale_window) + " " +
          std::to_string(l.hysteresis) + " " + std::to_string(l.consecutive_hysteresis) + " " +
          format_double(l.min_loss_scale);
  }
  return {std::move(id), std::to_string(numels.size()) + " parameters of " + std::to_string(elements) +
                             " elements, stage " + std::to_string(s.stage()) + ", reduce_bucket_numel " +
                             std::to_string(zo.reduce_bucket_numel) + ", gradient_clipping " +
                             format_double(zo.gradient_clipping)};
}


// Validates zero_options::wire_dtypes and splits [0, padded) into runs of equal wire
// dtype, in flat order. The padding tail travels with the last run (it is zero).
inline void plan_wire_runs(core_state& s, const std::vector<std::size_t>& order) {
  const std::vector<dtype>& wd = s.zo.wire_dtypes;
  const dtype fallback = s.spec.wire;
  if (!wd.empty() && wd.size() != order.size()) {
    throw_invalid("ZeroOptimizer: zero_options::wire_dtypes has " + std::to_string(wd.size()) + " entries for " +
                  std::to_string(order.size()) +
                  " parameters; give one mpzero::dtype per parameter, in the order of numels, or leave it "
                  "empty (every gradient then travels in " + std::string(name_of(fallback)) + ")");
  }
  for (std::size_t i = 0; i < wd.size(); ++i) {
    if (wd[i] != dtype::fp32 && wd[i] != dtype::bf16 && wd[i] != dtype::fp16) {
      throw_invalid("ZeroOptimizer: zero_options::wire_dtypes[" + std::to_string(i) + "] = " +
                    std::to_string(static_cast<int>(wd[i])) +
                    " is not a dtype; use mpzero::dtype::fp32, dtype::bf16 or dtype::fp16");
    }
    // The Wire rule, for the run-time list.
    for (const dtype own : {s.param_t(), s.grad_t()}) {
      if (mixes_16bit(wd[i], own)) {
        throw_invalid("ZeroOptimizer: zero_options::wire_dtypes[" + std::to_string(i) + "] = " +
                      std::string(name_of(wd[i])) + " mixes bf16 and fp16 with this policy's " +
                      std::string(name_of(own)) + " (fp16 overflows above 65504 and nothing scales it); use " +
                      std::string(name_of(own)) + " or fp32");
      }
    }
  }
  auto& runs = s.runs;
  runs.clear();
  const std::uint64_t padded = s.layout.padded_numel();
  for (std::size_t sl = 0; sl < order.size(); ++sl) {
    const flat_range r = s.layout.param_range(sl);
    if (r.empty()) continue;
    const dtype d = wd.empty() ? fallback : wd[order[sl]];
    if (!runs.empty() && runs.back().wire == d) {
      runs.back().range.end = r.end;  // parameters are contiguous in the flat buffer
    } else {
      runs.push_back(wire_run{r, d});
    }
  }
  if (runs.empty()) {
    runs.push_back(wire_run{flat_range{0, padded}, fallback});
  } else {
    runs.front().range.begin = 0;
    runs.back().range.end = padded;
  }
  for (const wire_run& x : runs) {
    std::uint64_t& l = s.longest_run[static_cast<std::size_t>(x.wire)];
    l = std::max(l, x.range.size());
  }
}

// Validates zero_options::gather_dtypes: one storage dtype per parameter that does not
// mix bf16 and fp16 with the parameter dtype.
inline void check_gather_dtypes(const core_state& s, std::size_t n) {
  const std::vector<dtype>& gd = s.zo.gather_dtypes;
  if (gd.empty()) return;
  if (gd.size() != n) {
    throw_invalid("ZeroOptimizer: zero_options::gather_dtypes has " + std::to_string(gd.size()) + " entries for " +
                  std::to_string(n) + " parameters; give one mpzero::dtype per parameter, in the order of numels, "
                  "or leave it empty (every parameter gathered in " + std::string(name_of(s.param_t())) + ")");
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (gd[i] != dtype::fp32 && gd[i] != dtype::bf16 && gd[i] != dtype::fp16) {
      throw_invalid("ZeroOptimizer: zero_options::gather_dtypes[" + std::to_string(i) + "] = " +
                    std::to_string(static_cast<int>(gd[i])) +
                    " is not a dtype; use mpzero::dtype::fp32, dtype::bf16 or dtype::fp16");
    }
    if (mixes_16bit(gd[i], s.param_t())) {
      throw_invalid("ZeroOptimizer: zero_options::gather_dtypes[" + std::to_string(i) + "] = " +
                    std::string(name_of(gd[i])) + " would round " + std::string(name_of(s.param_t())) +
                    " parameters to the other 16-bit format; use " + std::string(name_of(s.param_t())) + " or fp32");
    }
  }
}

// Validates zero_options::param_groups and group_of and splits [0, padded) into runs of
// one group, in flat order. The padding between and after parameters (zero, and kept
// zero by every rule) goes with the run before it.
inline void plan_group_runs(core_state& s, const std::vector<std::size_t>& order) {
  const zero_options& zo = s.zo;
  const std::size_t n_groups = s.num_groups();
  for (std::size_t g = 0; g < zo.param_groups.size(); ++g) {
    const param_group_options& o = zo.param_groups[g];
    if (!(o.lr_scale >= 0) || !std::isfinite(o.lr_scale)) {
      throw_invalid("ZeroOptimizer: zero_options::param_groups[" + std::to_string(g) + "].lr_scale = " +
                    format_double(o.lr_scale) + "; use a finite factor >= 0 (1: the optimizer's lr)");
    }
  }
  if (!zo.group_of.empty() && zo.group_of.size() != order.size()) {
    throw_invalid("ZeroOptimizer: zero_options::group_of has " + std::to_string(zo.group_of.size()) +
                  " entries for " + std::to_string(order.size()) +
                  " parameters; give one group index per parameter, in the order of numels, or leave it empty "
                  "(every parameter in group 0)");
  }
  for (std::size_t i = 0; i < zo.group_of.size(); ++i) {
    if (zo.group_of[i] >= n_groups) {
      throw_invalid("ZeroOptimizer: zero_options::group_of[" + std::to_string(i) + "] = " +
                    std::to_string(zo.group_of[i]) + ", but there " +
                    (n_groups == 1 ? std::string("is 1 group") : "are " + std::to_string(n_groups) + " groups") +
                    " (zero_options::param_groups); use an index below " + std::to_string(n_groups) +
                    " or add the group");
    }
  }
  auto& runs = s.group_runs;
  runs.clear();
  for (std::size_t sl = 0; sl < order.size(); ++sl) {
    const flat_range r = s.layout.param_range(sl);
    if (r.empty()) continue;
    const std::uint32_t g = zo.group_of.empty() ? 0 : zo.group_of[order[sl]];
    if (!runs.empty() && runs.back().group == g) {
      runs.back().range.end = r.end;
    } else {
      if (!runs.empty()) runs.back().range.end = r.begin;  // the padding before r
      runs.push_back(group_run{r, g});
    }
  }
  if (runs.empty()) {
    runs.push_back(group_run{flat_range{0, s.layout.padded_numel()}, 0});
  } else {
    runs.front().range.begin = 0;
    runs.back().range.end = s.layout.padded_numel();
  }
}

// The layout: the slots (large parameters first, in the caller's order, then the small
// ones), the flat layout, the persistent range, this rank's shard and the wire runs.
// Returns how many parameters are large (the reducer's bucket plan splits there).
inline std::size_t build_layout(core_state& s, std::span<const std::uint64_t> numels) {
  const std::size_t n = numels.size();
  std::vector<std::size_t> order;
  order.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    if (numels[i] > s.zo.param_persistence_threshold) order.push_back(i);
  const std::size_t n_large = order.size();
  for (std::size_t i = 0; i < n; ++i)
    if (numels[i] <= s.zo.param_persistence_threshold) order.push_back(i);
  s.slot_of.assign(n, 0);
  std::vector<std::uint64_t> slot_numels(n);
  for (std::size_t sl = 0; sl < n; ++sl) {
    s.slot_of[order[sl]] = sl;
    slot_numels[sl] = numels[order[sl]];
  }
  s.layout = flat_layout(slot_numels, s.world, s.zo.layout);
  s.persistent_begin = n_large < n ? s.layout.offset(n_large) : s.layout.total_numel();
  // Nothing is persistent below stage 3, nor when only empty parameters are small:
  // the padding then stays partitioned with the rest.
  if (s.stage() < 3 || s.persistent_begin == s.layout.total_numel()) s.persistent_begin = s.layout.padded_numel();
  s.shard = s.stage() == 0 ? flat_range{0, s.layout.padded_numel()} : s.layout.partition(s.rank);
  plan_wire_runs(s, order);
  check_gather_dtypes(s, order.size());
  plan_group_runs(s, order);
  return n_large;
}

// This rank's model states, in the backend's memory (and host memory with offload).
inline void allocate(core_state& s) {
  const std::uint64_t padded = s.layout.padded_numel();
  backend_base& be = s.be;
  if (s.stage() < 3) {
    s.params = be.allocate(s.param_t(), padded);
  } else {
    s.params = be.allocate(s.param_t(), intersect(s.shard, flat_range{0, s.persistent_begin}).size());
    s.persistent = be.allocate(s.param_t(), padded - s.persistent_begin);
  }
  const std::uint64_t shard = s.shard.size();
  if (s.offloaded()) {
    // Pinned when the backend can pin (and pin_memory): transfers then run on the copy engines.
    const host_allocator mem = be.host_memory(s.zo.pin_memory);
    s.h_master = allocate_host(s.master_t(), shard, mem);
    for (int k = 0; k < s.n_states; ++k) s.h_states.push_back(allocate_host(s.state_t(), shard, mem));
    s.h_grads = allocate_host(s.grad_t(), shard, mem);
    if (!s.master_is_param()) s.h_params = allocate_host(s.param_t(), shard, mem);
    if (s.stage() == 1) s.grads = be.allocate(s.grad_t(), padded);
  } else {
    if (!s.master_is_param()) s.master = be.allocate(s.master_t(), shard);
    s.grads = be.allocate(s.grad_t(), s.stage() >= 2 ? shard : padded);
    for (int k = 0; k < s.n_states; ++k) s.states.push_back(be.allocate(s.state_t(), shard));
  }
}


// The shard as step tensors: one per shard_pieces() entry (offload: one, the host
// buffers). Global offsets are flat offsets.
inline std::vector<step_buffers> shard_tensors(const core_state& s) {
  std::vector<step_buffers> out;
  const auto states = [&](const std::vector<raw_buffer>& v, std::uint64_t at, step_buffers& t) {
    for (std::size_t k = 0; k < v.size(); ++k) t.states[k] = v[k].at(at);
  };
  if (s.offloaded()) {
    if (s.shard.empty()) return out;
    step_buffers t;
    t.param = s.master_is_param() ? s.h_master.data() : s.h_params.data();
    t.master = s.master_is_param() ? nullptr : s.h_master.data();
    t.grad = s.h_grads.data();
    states(s.h_states, 0, t);
    t.numel = s.shard.size();
    t.global_offset = s.shard.begin;
    out.push_back(t);
    return out;
  }
  for (const flat_range& p : s.shard_pieces()) {
    const std::uint64_t in_shard = p.begin - s.shard.begin;
    step_buffers t;
    t.param = s.param_ptr(p.begin);
    t.master = s.master_is_param() ? nullptr : s.master.at(in_shard);
    t.grad = s.shard_grads(in_shard);
    states(s.states, in_shard, t);
    t.numel = p.size();
    t.global_offset = p.begin;
    out.push_back(t);
  }
  return out;
}

// Elements [off, off + n) of step tensor t.
inline step_buffers piece_of(const core_state& s, const step_buffers& t, std::uint64_t off, std::uint64_t n) {
  const auto skip = [&](const void* p, dtype d) -> void* {
    return p == nullptr ? nullptr : const_cast<unsigned char*>(static_cast<const unsigned char*>(p)) + off * size_of(d);
  };
  step_buffers piece = t;
  piece.param = skip(t.param, s.master_is_param() ? s.master_t() : s.param_t());
  piece.master = skip(t.master, s.master_t());
  piece.grad = skip(t.grad, s.grad_t());
  for (std::size_t k = 0; k < static_cast<std::size_t>(s.n_states); ++k) piece.states[k] = skip(t.states[k], s.state_t());
  piece.numel = n;
  piece.global_offset = t.global_offset + off;
  return piece;
}

// Splits step tensors at the parameter groups' boundaries: entry g holds group g's pieces.
inline std::vector<std::vector<step_buffers>> by_group(const core_state& s, const std::vector<step_buffers>& tensors) {
  std::vector<std::vector<step_buffers>> out(s.num_groups());
  for (const step_buffers& t : tensors) {
    const flat_range whole{t.global_offset, t.global_offset + t.numel};
    for (const group_run& run : s.group_runs) {
      const flat_range r = intersect(whole, run.range);
      if (!r.empty()) out[run.group].push_back(piece_of(s, t, r.begin - whole.begin, r.size()));
    }
  }
  return out;
}

// Splits tensors into pieces of at most offload_sub_group_numel elements.
inline std::vector<step_buffers> sub_groups(const core_state& s, const std::vector<step_buffers>& tensors) {
  std::vector<step_buffers> out;
  const std::uint64_t g = s.zo.offload_sub_group_numel;
  for (const step_buffers& t : tensors)
    for (std::uint64_t off = 0; off < t.numel; off += g) out.push_back(piece_of(s, t, off, std::min(g, t.numel - off)));
  return out;
}

}  // namespace mpzero::detail

// mpzero: what the parts of the ZeRO core share: the run-time configuration, the flat
// layout and this rank's buffers (the model states), plus the pools that communication
// buffers come from and the meters that count their bytes. Private to zero/core.hpp.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../backend/erased.hpp"
#include "../comm/any.hpp"
#include "../error.hpp"
#include "../partition/flat_layout.hpp"
#include "options.hpp"
#include "spec.hpp"

namespace mpzero::detail {

// A flat range whose gradients travel in one dtype.
struct wire_run {
  flat_range range;
  dtype wire;
};

// A flat range of one parameter group.
struct group_run {
  flat_range range;
  std::uint32_t group;
};

// The element type a communicator moves for a storage dtype.
constexpr comm::wire_dtype wire_of(dtype d) noexcept {
  switch (d) {
    case dtype::bf16: return comm::wire_dtype::bf16;
    case dtype::fp16: return comm::wire_dtype::fp16;
    case dtype::fp32: break;
  }
  return comm::wire_dtype::f32;
}

// Bytes of one memory space (the backend's, or host memory) held by communication
// buffers: now, and the most at any time.
struct byte_meter {
  std::uint64_t now = 0, peak = 0;
  void add(std::uint64_t b) noexcept {
    now += b;
    peak = std::max(peak, now);
  }
  void sub(std::uint64_t b) noexcept { now -= b; }
};

// Reusable buffers of one dtype: a buffer is taken for one reduction and given back when
// it completes. A request that no free buffer fits drops the free ones first, so the pool
// never holds more buffers than were busy at once. clear() frees them all.
class buffer_pool {
 public:
  buffer_pool(dtype t, byte_meter& meter) : type_(t), meter_(&meter) {}

  template <class Make>
  int acquire(std::uint64_t n, Make&& make, bool* fresh = nullptr) {
    for (std::size_t i = 0; i < bufs_.size(); ++i) {
      if (!busy_[i] && bufs_[i].size() >= n) {
        busy_[i] = 1;
        if (fresh) *fresh = false;
        return static_cast<int>(i);
      }
    }
    drop_free();
    raw_buffer b = make(type_, std::max<std::uint64_t>(n, 1));
    meter_->add(b.bytes());
    for (std::size_t i = 0; i < bufs_.size(); ++i) {
      if (!bufs_[i].allocated()) {
        bufs_[i] = std::move(b);
        busy_[i] = 1;
        if (fresh) *fresh = true;
        return static_cast<int>(i);
      }
    }
    bufs_.push_back(std::move(b));
    busy_.push_back(1);
    if (fresh) *fresh = true;
    return static_cast<int>(bufs_.size() - 1);
  }
  void* data(int i) const { return bufs_[static_cast<std::size_t>(i)].data(); }
  void release(int i) { busy_[static_cast<std::size_t>(i)] = 0; }
  bool any_busy() const { return std::any_of(busy_.begin(), busy_.end(), [](std::uint8_t b) { return b != 0; }); }
  // Frees every buffer; none may be busy.
  void clear() {
    drop_free();
    bufs_.clear();
    busy_.clear();
  }
  std::uint64_t bytes() const {
    std::uint64_t b = 0;
    for (const auto& x : bufs_) b += x.bytes();
    return b;
  }

 private:
  void drop_free() {
    for (std::size_t i = 0; i < bufs_.size(); ++i) {
      if (!busy_[i] && bufs_[i].allocated()) {
        meter_->sub(bufs_[i].bytes());
        bufs_[i].reset();
      }
    }
  }
  dtype type_;
  byte_meter* meter_;
  std::vector<raw_buffer> bufs_;
  std::vector<std::uint8_t> busy_;
};

// One pool per storage dtype.
struct pools {
  explicit pools(byte_meter& m) : by_dtype{buffer_pool(dtype::fp32, m), buffer_pool(dtype::bf16, m), buffer_pool(dtype::fp16, m)} {}
  buffer_pool& operator[](dtype d) { return by_dtype[static_cast<std::size_t>(d)]; }
  void clear() {
    for (auto& p : by_dtype) p.clear();
  }
  bool any_busy() const {
    return std::any_of(by_dtype.begin(), by_dtype.end(), [](const buffer_pool& p) { return p.any_busy(); });
  }
  std::uint64_t bytes() const {
    std::uint64_t b = 0;
    for (const auto& p : by_dtype) b += p.bytes();
    return b;
  }
  std::array<buffer_pool, 3> by_dtype;
};

struct core_state {
  core_state(comm::any_communicator c, backend_base& b, backend_base& h, const zero_spec& s, const zero_options& o,
             int states)
      : comm(std::move(c)), be(b), host(h), spec(s), zo(o), world(comm.size()), rank(comm.rank()), n_states(states) {}

  comm::any_communicator comm;
  backend_base& be;    // the parameters' backend
  backend_base& host;  // host memory: ZeRO-Offload's partition and step
  zero_spec spec;
  zero_options zo;
  int world, rank, n_states;

  flat_layout layout;
  std::vector<std::size_t> slot_of;  // parameter index -> position in the flat buffers
  std::uint64_t persistent_begin = 0;
  flat_range shard{};
  std::vector<wire_run> runs;  // [0, padded) in runs of equal wire dtype (one run by default)
  std::array<std::uint64_t, 3> longest_run{1, 1, 1};  // per wire dtype: its longest run
  std::vector<group_run> group_runs;  // [0, padded) in runs of one parameter group (one run by default)

  // Model states, in the backend's memory.
  raw_buffer params;      // stages 0-2: all parameters; stage 3: this rank's partitioned ones
  raw_buffer persistent;  // stage 3: the persistent parameters, whole
  raw_buffer master;      // the shard's master weights (absent when the master is the parameter, or offloaded)
  raw_buffer grads;       // stages 0-1: all gradients; stages 2-3: the shard's (absent offloaded at 2-3)
  std::vector<raw_buffer> states;
  // ZeRO-Offload, in host memory.
  raw_buffer h_master, h_grads, h_params;  // h_params: the step's parameter output when the master is wider
  std::vector<raw_buffer> h_states;

  // Communication buffers: bytes now and at most, in the backend's and in host memory.
  byte_meter dev_meter, host_meter;

  int stage() const noexcept { return spec.stage; }
  bool offloaded() const noexcept { return spec.offload; }
  dtype param_t() const noexcept { return spec.precision.param; }
  dtype master_t() const noexcept { return spec.precision.master; }
  dtype grad_t() const noexcept { return spec.precision.grad; }
  dtype state_t() const noexcept { return spec.precision.state; }
  bool master_is_param() const noexcept { return spec.precision.master_is_param(); }

  // Where the parameters of flat range p (inside this rank's storage) live.
  void* param_ptr(std::uint64_t flat) const {
    if (stage() < 3) return params.at(flat);
    return flat < persistent_begin ? params.at(flat - shard.begin) : persistent.at(flat - persistent_begin);
  }
  // The shard's gradients (backend memory).
  void* shard_grads(std::uint64_t in_shard = 0) const {
    return stage() >= 2 ? grads.at(in_shard) : grads.at(shard.begin + in_shard);
  }

  // The shard in pieces of contiguous storage: stage 3 keeps partitioned and persistent
  // parameters in separate buffers.
  std::vector<flat_range> shard_pieces() const {
    std::vector<flat_range> out;
    if (stage() == 3) {
      out.push_back(intersect(shard, flat_range{0, persistent_begin}));
      out.push_back(intersect(shard, flat_range{persistent_begin, layout.padded_numel()}));
    } else {
      out.push_back(shard);
    }
    std::erase_if(out, [](const flat_range& r) { return r.empty(); });
    return out;
  }

  std::size_t slot(std::size_t i) const {
    if (i >= slot_of.size()) {
      throw_invalid("ZeroOptimizer: parameter index " + std::to_string(i) + " is out of range; the optimizer has " +
                    std::to_string(slot_of.size()) + " parameters");
    }
    return slot_of[i];
  }
  std::size_t num_params() const noexcept { return slot_of.size(); }
  std::size_t num_groups() const noexcept { return zo.param_groups.empty() ? 1 : zo.param_groups.size(); }
  const param_group_options& group(std::size_t g) const {
    static const param_group_options kernel_own{};
    return zo.param_groups.empty() ? kernel_own : zo.param_groups[g];
  }
  std::uint64_t numel(std::size_t i) const { return layout.numel(slot(i)); }

  // Memory for communication buffers, counted by the meters.
  raw_buffer device_scratch(dtype t, std::uint64_t n) { return be.allocate(t, n); }
  raw_buffer host_scratch(dtype t, std::uint64_t n) { return allocate_host(t, n, be.host_memory(zo.pin_memory)); }
};

}  // namespace mpzero::detail

// mpzero: the world-size-1 communicator. Every collective over one rank is a copy
// (or nothing, in place), so single-process training needs neither MPI nor NCCL.
// local_communicator's buffers are host memory; basic_local_communicator<Copy> takes the
// copy as a parameter (e.g. a device-to-device copy on a CUDA stream), with the same
// argument checks. Requests are complete when returned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>

#include "communicator.hpp"

namespace mpzero::comm {

// The request of a call that completed before it returned.
struct ready_request {
  void wait() const noexcept {}
  bool test() const noexcept { return true; }
};

// Copies host memory.
struct host_copy {
  void operator()(void* out, const void* in, std::size_t bytes) const noexcept { std::memmove(out, in, bytes); }
};

// Copy: void(void* out, const void* in, std::size_t bytes) const, called only for
// bytes > 0 and in != out (the ranges are then disjoint: checked).
template <class Copy>
class basic_local_communicator {
 public:
  using request_type = ready_request;

  basic_local_communicator() = default;
  explicit basic_local_communicator(Copy c) : copy_(std::move(c)) {}

  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }

  template <wire_type T>
  void all_reduce(const T* in, T* out, std::uint64_t n, reduce_op /*op*/) const {
    detail::check_same_or_disjoint(in, n, out, n, true, "all_reduce", "pass in == out or disjoint buffers");
    copy(in, out, n);
  }

  template <wire_type T>
  void reduce_scatter_v(const T* in, T* out, std::span<const std::uint64_t> counts, reduce_op /*op*/) const {
    const std::uint64_t total = detail::checked_total(counts, 1, "reduce_scatter_v");
    detail::check_same_or_disjoint(in, total, out, counts[0], true, "reduce_scatter_v",
                                   "out may only be in's own block or disjoint from in");
    copy(in, out, counts[0]);
  }

  template <wire_type T>
  void all_gather_v(const T* in, std::uint64_t n_in, T* out, std::span<const std::uint64_t> counts) const {
    const std::uint64_t total = detail::checked_total(counts, 1, "all_gather_v");
    detail::check_count_match(n_in, counts, 0, "all_gather_v");
    detail::check_same_or_disjoint(in, n_in, out, total, true, "all_gather_v",
                                   "in may only be out's own block or disjoint from out");
    copy(in, out, n_in);
  }

  template <wire_type T>
  void broadcast(T* /*data*/, std::uint64_t /*n*/, int root) const {
    detail::check_root(root, 1, "broadcast");
  }

  void broadcast_bytes(void* /*data*/, std::size_t /*bytes*/, int root) const { detail::check_root(root, 1, "broadcast_bytes"); }

  void barrier() const noexcept {}

  template <wire_type T>
  ready_request iall_reduce(const T* in, T* out, std::uint64_t n, reduce_op op) const {
    all_reduce(in, out, n, op);
    return {};
  }
  template <wire_type T>
  ready_request ireduce_scatter_v(const T* in, T* out, std::span<const std::uint64_t> counts, reduce_op op) const {
    reduce_scatter_v(in, out, counts, op);
    return {};
  }
  template <wire_type T>
  ready_request iall_gather_v(const T* in, std::uint64_t n_in, T* out, std::span<const std::uint64_t> counts) const {
    all_gather_v(in, n_in, out, counts);
    return {};
  }
  template <wire_type T>
  ready_request ibroadcast(T* data, std::uint64_t n, int root) const {
    broadcast(data, n, root);
    return {};
  }

 protected:
  const Copy& copier() const noexcept { return copy_; }

 private:
  template <class T>
  void copy(const T* in, T* out, std::uint64_t n) const {
    if (n != 0 && in != out) copy_(out, in, static_cast<std::size_t>(n * sizeof(T)));  // disjoint (checked)
  }
  Copy copy_{};
};

using local_communicator = basic_local_communicator<host_copy>;

static_assert(communicator<local_communicator>);

}  // namespace mpzero::comm

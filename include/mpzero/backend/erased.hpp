// mpzero: a backend as the ZeRO core sees it, with element types as run-time values.
//
// The core (zero/core.hpp) is compiled once, not once per precision policy, optimizer
// and stage: it moves buffers whose dtype is a value, and asks a backend_base to
// allocate, copy, convert, accumulate and reduce them. backend_adapter<Backend>
// (backend/adapter.hpp) puts any typed backend (host_backend, cuda_backend, a test
// double) behind this interface; each call there dispatches once on the dtypes to the
// backend's typed element-wise code. The optimizer step, the one place where the policy
// and the rule are types, goes through zero/step_kernel.hpp instead.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "../comm/any.hpp"
#include "../comm/communicator.hpp"
#include "../numeric/dtype.hpp"
#include "../step/grad_stats.hpp"
#include "host_memory.hpp"

namespace mpzero {

// An owning array of size() elements of type() in some backend's memory (or host
// memory), zero-initialised when allocated. Copies share the array.
class raw_buffer {
 public:
  raw_buffer() = default;
  raw_buffer(std::shared_ptr<void> owner, dtype t, std::uint64_t n) : owner_(std::move(owner)), type_(t), n_(n) {}

  void* data() const noexcept { return owner_.get(); }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(owner_.get());
  }
  // The address of element k.
  void* at(std::uint64_t k) const noexcept {
    return static_cast<unsigned char*>(owner_.get()) + k * size_of(type_);
  }
  dtype type() const noexcept { return type_; }
  std::uint64_t size() const noexcept { return n_; }
  std::uint64_t bytes() const noexcept { return n_ * size_of(type_); }
  bool allocated() const noexcept { return owner_ != nullptr; }
  void reset() noexcept {
    owner_.reset();
    n_ = 0;
  }

 private:
  std::shared_ptr<void> owner_;
  dtype type_ = dtype::fp32;
  std::uint64_t n_ = 0;
};

// A zero-initialised host array of n elements of t from `mem`.
inline raw_buffer allocate_host(dtype t, std::uint64_t n, const host_allocator& mem) {
  return visit_dtype(t, [&]<class T>(T*) {
    auto b = std::make_shared<host_buffer<T>>(n, mem);
    T* p = b->data();
    return raw_buffer(std::shared_ptr<void>(std::move(b), p), t, n);
  });
}

// An asynchronous copy between host and backend memory that may still be running.
// An empty transfer is complete.
class async_transfer {
 public:
  struct impl {
    virtual ~impl() = default;
    virtual bool done() = 0;
    virtual void wait() = 0;
  };
  async_transfer() = default;
  explicit async_transfer(std::unique_ptr<impl> p) : p_(std::move(p)) {}
  bool done() const { return !p_ || p_->done(); }
  void wait() const {
    if (p_) p_->wait();
  }
  impl* get() const noexcept { return p_.get(); }

 private:
  std::unique_ptr<impl> p_;
};

// The backend operations the core needs; counts are elements of the named dtypes,
// byte counts say so. Semantics: host_backend's and cuda_backend's members of the same
// names.
class backend_base {
 public:
  virtual ~backend_base() = default;

  // Whether the buffers are device memory, and whether host code may still address them
  // (a test double's "device" buffers in host memory).
  virtual bool device_memory() const noexcept = 0;
  virtual bool host_addressable() const noexcept = 0;
  // The host step's threads (host::options::threads) where this is the host backend:
  // they apply to the offloaded step too. None for a device backend.
  virtual std::optional<int> host_threads() const { return std::nullopt; }

  virtual raw_buffer allocate(dtype t, std::uint64_t n) = 0;
  virtual void zero(void* p, std::uint64_t bytes) = 0;
  virtual void copy(void* dst, const void* src, std::uint64_t bytes) = 0;
  virtual void upload(void* dst, const void* host_src, std::uint64_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, std::uint64_t bytes) = 0;
  virtual host_allocator host_memory(bool pinned) const = 0;
  virtual async_transfer download_async(void* host_dst, const void* src, std::uint64_t bytes) = 0;
  virtual async_transfer upload_async(void* dst, const void* host_src, std::uint64_t bytes) = 0;
  // The backend's later work starts after `t` (a transfer of this backend).
  virtual void order_after(const async_transfer& t) = 0;

  // dst[i] = round(dst[i] + src[i] * scale); dst[i] = round(src[i]); in fp32.
  virtual void accumulate(void* dst, dtype d, const void* src, dtype s, std::uint64_t n, float scale) = 0;
  virtual void convert(void* dst, dtype d, const void* src, dtype s, std::uint64_t n) = 0;
  virtual grad_stats stats(const void* p, dtype g, std::uint64_t n) = 0;

  virtual void synchronize() = 0;
  // Orders a collective after the backend's work so far.
  virtual void before_comm(comm::any_communicator& c) = 0;
  // Collectives over a few values in host memory (through device scratch on a device backend).
  virtual void all_reduce_host(comm::any_communicator& c, void* values, std::uint64_t n, comm::wire_dtype t,
                               comm::reduce_op op) = 0;
  virtual void broadcast_host(comm::any_communicator& c, void* values, std::uint64_t n, comm::wire_dtype t,
                              int root) = 0;
  // Throws unless the backend's kernels can read p (a device backend checks its
  // pointers; `who` names the call).
  virtual void check_readable(const void* p, const std::string& who) const {
    (void)p;
    (void)who;
  }

  // Typed conveniences.
  template <class T>
  void all_reduce_host(comm::any_communicator& c, T* values, std::uint64_t n, comm::reduce_op op) {
    all_reduce_host(c, values, n, comm::wire_of<T>(), op);
  }
  template <class T>
  void broadcast_host(comm::any_communicator& c, T* values, std::uint64_t n, int root) {
    broadcast_host(c, values, n, comm::wire_of<T>(), root);
  }
};

}  // namespace mpzero

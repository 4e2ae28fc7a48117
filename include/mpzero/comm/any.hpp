// mpzero: a communicator chosen at run time.
//
// The ZeRO core is compiled once, not once per communicator type, so it talks to one
// type, any_communicator, which satisfies communicator and forwards every call through
// a small virtual interface (communicator_base) to a concrete one: local_communicator,
// mpi_communicator, nccl_communicator, the LibTorch adapter's c10d ProcessGroup, or any
// other type that models communicator (communicator_adapter<C>).
//
// Cost: one virtual call and one heap-allocated request per collective. The core
// issues a handful of collectives per bucket and per step, so this is noise next to
// the data they move.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "../error.hpp"
#include "communicator.hpp"
#include "local.hpp"

namespace mpzero::comm {

// The element types that travel, as a value (wire_type as a type).
enum class wire_dtype : std::uint8_t { f32, f64, bf16, fp16, i32, u8 };

template <wire_type T>
constexpr wire_dtype wire_of() noexcept {
  if constexpr (std::is_same_v<T, float>) return wire_dtype::f32;
  else if constexpr (std::is_same_v<T, double>) return wire_dtype::f64;
  else if constexpr (std::is_same_v<T, mpzero::bf16>) return wire_dtype::bf16;
  else if constexpr (std::is_same_v<T, mpzero::fp16>) return wire_dtype::fp16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return wire_dtype::i32;
  else return wire_dtype::u8;
}

constexpr std::size_t wire_size(wire_dtype d) noexcept {
  switch (d) {
    case wire_dtype::f64: return 8;
    case wire_dtype::f32:
    case wire_dtype::i32: return 4;
    case wire_dtype::bf16:
    case wire_dtype::fp16: return 2;
    case wire_dtype::u8: return 1;
  }
  return 1;
}

// A posted operation. wait() blocks (within the backend's deadline); test() polls.
class request_base {
 public:
  virtual ~request_base() = default;
  virtual void wait() = 0;
  virtual bool test() = 0;
};

// The virtual interface: the non-blocking calls of communicator with the element
// type as a value. Semantics, overlap rules and failure behaviour: comm/communicator.hpp.
// `counts` only needs to live for the duration of the call.
class communicator_base {
 public:
  virtual ~communicator_base() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  virtual std::unique_ptr<request_base> iall_reduce(const void* in, void* out, std::uint64_t n, wire_dtype t,
                                                    reduce_op op) = 0;
  virtual std::unique_ptr<request_base> ireduce_scatter_v(const void* in, void* out,
                                                          std::span<const std::uint64_t> counts, wire_dtype t,
                                                          reduce_op op) = 0;
  virtual std::unique_ptr<request_base> iall_gather_v(const void* in, std::uint64_t n_in, void* out,
                                                      std::span<const std::uint64_t> counts, wire_dtype t) = 0;
  virtual std::unique_ptr<request_base> ibroadcast(void* data, std::uint64_t n, wire_dtype t, int root) = 0;
  virtual void barrier() = 0;
  // Orders this communicator's next collectives after the work queued so far on a CUDA
  // stream (`stream` is a cudaStream_t), without blocking the host. Returns false
  // where the communicator cannot (host memory, a c10d group): the caller then
  // synchronizes the stream before the collective instead.
  virtual bool wait_for_stream(void* stream) {
    (void)stream;
    return false;
  }
  // Whether the buffers may be CUDA device memory (NCCL, a c10d group on a CUDA device).
  // An engine on CUDA parameters needs one, except at world size 1 (it copies on the
  // device itself).
  virtual bool reads_device_memory() const { return false; }
  // The CUDA device whose memory the collectives read (NCCL's, a c10d group's), or -1
  // where the communicator is tied to none. An engine checks it against its parameters'.
  virtual int cuda_device() const { return -1; }
};

namespace detail {

// Calls f(T*) with the pointer cast to the element type named by `t`.
template <class F>
decltype(auto) with_wire_type(wire_dtype t, F&& f) {
  switch (t) {
    case wire_dtype::f32: return f(static_cast<float*>(nullptr));
    case wire_dtype::f64: return f(static_cast<double*>(nullptr));
    case wire_dtype::bf16: return f(static_cast<mpzero::bf16*>(nullptr));
    case wire_dtype::fp16: return f(static_cast<mpzero::fp16*>(nullptr));
    case wire_dtype::i32: return f(static_cast<std::int32_t*>(nullptr));
    case wire_dtype::u8: return f(static_cast<std::uint8_t*>(nullptr));
  }
  throw mpzero::invalid_argument("mpzero: unknown wire dtype " + std::to_string(static_cast<int>(t)));
}

template <class R>
class typed_request final : public request_base {
 public:
  explicit typed_request(R r) : r_(std::move(r)) {}
  void wait() override { r_.wait(); }
  bool test() override {
    if constexpr (requires(R& r) { r.test(); }) {
      return r_.test();
    } else {
      r_.wait();
      return true;
    }
  }

 private:
  R r_;
};

template <class R>
std::unique_ptr<request_base> wrap_request(R&& r) {
  return std::make_unique<typed_request<std::decay_t<R>>>(std::forward<R>(r));
}

}  // namespace detail

// Any communicator behind the virtual interface. Holds `c` by reference (the
// caller keeps it alive and, for MPI, calls from MPI's thread while the engine lives),
// or owns it.
template <communicator C>
class communicator_adapter final : public communicator_base {
 public:
  explicit communicator_adapter(C& c, std::string name = "communicator") : c_(c), name_(std::move(name)) {}
  communicator_adapter(std::shared_ptr<C> owned, std::string name)
      : owned_(std::move(owned)), c_(*owned_), name_(std::move(name)) {}
  int rank() const override { return c_.rank(); }
  int size() const override { return c_.size(); }
  std::string name() const override { return name_; }

  std::unique_ptr<request_base> iall_reduce(const void* in, void* out, std::uint64_t n, wire_dtype t,
                                            reduce_op op) override {
    return detail::with_wire_type(t, [&]<class T>(T*) -> std::unique_ptr<request_base> {
      if constexpr (requires { c_.iall_reduce(static_cast<const T*>(in), static_cast<T*>(out), n, op); }) {
        return detail::wrap_request(c_.iall_reduce(static_cast<const T*>(in), static_cast<T*>(out), n, op));
      } else {
        c_.all_reduce(static_cast<const T*>(in), static_cast<T*>(out), n, op);
        return detail::wrap_request(ready_request{});
      }
    });
  }
  std::unique_ptr<request_base> ireduce_scatter_v(const void* in, void* out, std::span<const std::uint64_t> counts,
                                                  wire_dtype t, reduce_op op) override {
    return detail::with_wire_type(t, [&]<class T>(T*) {
      return detail::wrap_request(c_.ireduce_scatter_v(static_cast<const T*>(in), static_cast<T*>(out), counts, op));
    });
  }
  std::unique_ptr<request_base> iall_gather_v(const void* in, std::uint64_t n_in, void* out,
                                              std::span<const std::uint64_t> counts, wire_dtype t) override {
    return detail::with_wire_type(t, [&]<class T>(T*) {
      return detail::wrap_request(c_.iall_gather_v(static_cast<const T*>(in), n_in, static_cast<T*>(out), counts));
    });
  }
  std::unique_ptr<request_base> ibroadcast(void* data, std::uint64_t n, wire_dtype t, int root) override {
    return detail::with_wire_type(t, [&]<class T>(T*) -> std::unique_ptr<request_base> {
      if constexpr (requires { c_.ibroadcast(static_cast<T*>(data), n, root); }) {
        return detail::wrap_request(c_.ibroadcast(static_cast<T*>(data), n, root));
      } else {
        c_.broadcast(static_cast<T*>(data), n, root);
        return detail::wrap_request(ready_request{});
      }
    });
  }
  void barrier() override { c_.barrier(); }
  // reads_device_memory's rule: a communicator that orders itself on CUDA streams
  // (C::wait_for(cudaStream_t), as nccl_communicator and cuda_local_communicator) works on
  // device memory.
  bool reads_device_memory() const override { return comm::reads_device_memory(c_); }
  // C::device() where C has it (mpzero's nccl_communicator).
  int cuda_device() const override {
    if constexpr (requires { { c_.device() } -> std::convertible_to<int>; }) {
      return c_.device();
    } else {
      return -1;
    }
  }
  // Forwarded to C::wait_for(cudaStream_t) where C has it (mpzero's nccl_communicator).
  bool wait_for_stream(void* stream) override {
    if constexpr (stream_ordered<C>) {
      c_.wait_for(static_cast<::CUstream_st*>(stream));
      return true;
    } else {
      (void)stream;
      return false;
    }
  }

 private:
  std::shared_ptr<C> owned_;  // empty when the caller owns c_
  C& c_;
  std::string name_;
};

// The request of any_communicator.
class any_request {
 public:
  any_request() = default;
  explicit any_request(std::unique_ptr<request_base> r) : r_(std::move(r)) {}
  void wait() {
    if (r_) r_->wait();
  }
  bool test() { return r_ ? r_->test() : true; }

 private:
  std::unique_ptr<request_base> r_;
};

// A communicator that forwards to a communicator_base. Copies share the target.
class any_communicator : public blocking_collectives<any_communicator> {
 public:
  using request_type = any_request;

  // World size 1, no MPI or c10d needed. is_default() tells this one from any other, so
  // that a caller can treat "no communicator given" as its own choice (the LibTorch
  // engine joins the launcher's world then); local() is the same world chosen explicitly.
  any_communicator() : any_communicator(own(local_communicator{}, "local")) { default_ = true; }
  static any_communicator local() { return own(local_communicator{}, "local"); }
  explicit any_communicator(std::shared_ptr<communicator_base> impl) : impl_(std::move(impl)) {
    if (!impl_) throw mpzero::invalid_argument("mpzero::any_communicator: got a null communicator");
  }
  // Wraps a communicator the caller owns (and keeps alive).
  template <communicator C>
    requires(!std::is_same_v<std::remove_cvref_t<C>, any_communicator>)
  static any_communicator wrap(C& c, std::string name = "communicator") {
    return any_communicator(std::make_shared<communicator_adapter<C>>(c, std::move(name)));
  }
  // Takes `c` over (copies share it).
  template <communicator C>
    requires(!std::is_same_v<std::remove_cvref_t<C>, any_communicator>)
  static any_communicator own(C c, std::string name) {
    return any_communicator(
        std::make_shared<communicator_adapter<C>>(std::make_shared<C>(std::move(c)), std::move(name)));
  }

  int rank() const { return impl_->rank(); }
  int size() const { return impl_->size(); }
  std::string name() const { return impl_->name(); }
  communicator_base& base() const noexcept { return *impl_; }
  bool is_default() const noexcept { return default_; }

  template <wire_type T>
  any_request iall_reduce(const T* in, T* out, std::uint64_t n, reduce_op op) {
    return any_request(impl_->iall_reduce(in, out, n, wire_of<T>(), op));
  }
  template <wire_type T>
  any_request ireduce_scatter_v(const T* in, T* out, std::span<const std::uint64_t> counts, reduce_op op) {
    return any_request(impl_->ireduce_scatter_v(in, out, counts, wire_of<T>(), op));
  }
  template <wire_type T>
  any_request iall_gather_v(const T* in, std::uint64_t n_in, T* out, std::span<const std::uint64_t> counts) {
    return any_request(impl_->iall_gather_v(in, n_in, out, counts, wire_of<T>()));
  }
  template <wire_type T>
  any_request ibroadcast(T* data, std::uint64_t n, int root) {
    return any_request(impl_->ibroadcast(data, n, wire_of<T>(), root));
  }

  // all_reduce, reduce_scatter_v, all_gather_v and broadcast: from blocking_collectives.
  void barrier() { impl_->barrier(); }
  // See communicator_base::wait_for_stream. The CUDA backend calls it before each
  // collective (cuda_backend::before_comm) and synchronizes the stream when it is false.
  bool wait_for_stream(void* stream) { return impl_->wait_for_stream(stream); }
  // See communicator_base::reads_device_memory; what reads_device_memory asks
  // (ZeroOptimizer checks it against its backend).
  bool reads_device_memory() const { return impl_->reads_device_memory(); }

 private:
  std::shared_ptr<communicator_base> impl_;
  bool default_ = false;
};

static_assert(communicator<any_communicator>);

}  // namespace mpzero::comm

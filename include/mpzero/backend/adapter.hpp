// mpzero: any typed backend (host_backend, cuda_backend, a test double with the same
// members) behind backend_base, the run-time interface of the ZeRO core. Each call
// dispatches once on its dtypes to the backend's typed element-wise code.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "erased.hpp"
#include "host_backend.hpp"

namespace mpzero {

template <class Backend>
class backend_adapter final : public backend_base {
 public:
  explicit backend_adapter(Backend b = {}) : b_(std::move(b)) {}

  Backend& backend() noexcept { return b_; }
  const Backend& backend() const noexcept { return b_; }

  bool device_memory() const noexcept override { return Backend::device_memory; }
  bool host_addressable() const noexcept override {
    if constexpr (requires { requires Backend::host_addressable; }) {
      return true;
    } else {
      return !Backend::device_memory;
    }
  }
  std::optional<int> host_threads() const override {
    if constexpr (std::is_same_v<Backend, host_backend>) {
      return b_.options.threads;
    } else {
      return std::nullopt;
    }
  }

  raw_buffer allocate(dtype t, std::uint64_t n) override {
    return visit_dtype(t, [&]<class T>(T*) {
      auto b = std::make_shared<typename Backend::template buffer<T>>(b_.template allocate<T>(n));
      T* p = b->data();
      return raw_buffer(std::shared_ptr<void>(std::move(b), p), t, n);
    });
  }
  void zero(void* p, std::uint64_t bytes) override { b_.zero(static_cast<unsigned char*>(p), bytes); }
  void copy(void* dst, const void* src, std::uint64_t bytes) override {
    b_.copy(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes);
  }
  void upload(void* dst, const void* host_src, std::uint64_t bytes) override {
    b_.upload(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(host_src), bytes);
  }
  void download(void* host_dst, const void* src, std::uint64_t bytes) override {
    b_.download(static_cast<unsigned char*>(host_dst), static_cast<const unsigned char*>(src), bytes);
  }
  host_allocator host_memory(bool pinned) const override { return b_.host_memory(pinned); }

  async_transfer download_async(void* host_dst, const void* src, std::uint64_t bytes) override {
    return wrap(b_.download_async(static_cast<unsigned char*>(host_dst), static_cast<const unsigned char*>(src), bytes));
  }
  async_transfer upload_async(void* dst, const void* host_src, std::uint64_t bytes) override {
    return wrap(b_.upload_async(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(host_src), bytes));
  }
  void order_after(const async_transfer& t) override {
    if (auto* x = dynamic_cast<typed_transfer*>(t.get())) b_.order_after(x->t);
  }

  void accumulate(void* dst, dtype d, const void* src, dtype s, std::uint64_t n, float scale) override {
    visit_dtype(d, [&]<class D>(D*) {
      visit_dtype(s, [&]<class S>(S*) { b_.accumulate(static_cast<D*>(dst), static_cast<const S*>(src), n, scale); });
    });
  }
  void convert(void* dst, dtype d, const void* src, dtype s, std::uint64_t n) override {
    visit_dtype(d, [&]<class D>(D*) {
      visit_dtype(s, [&]<class S>(S*) { b_.convert(static_cast<D*>(dst), static_cast<const S*>(src), n); });
    });
  }
  grad_stats stats(const void* p, dtype g, std::uint64_t n) override {
    return visit_dtype(g, [&]<class G>(G*) { return b_.stats(static_cast<const G*>(p), n); });
  }

  using backend_base::all_reduce_host;
  using backend_base::broadcast_host;
  void synchronize() override { b_.synchronize(); }
  void before_comm(comm::any_communicator& c) override { b_.before_comm(c); }
  void all_reduce_host(comm::any_communicator& c, void* values, std::uint64_t n, comm::wire_dtype t,
                       comm::reduce_op op) override {
    comm::detail::with_wire_type(t, [&]<class T>(T*) { b_.all_reduce_host(c, static_cast<T*>(values), n, op); });
  }
  void broadcast_host(comm::any_communicator& c, void* values, std::uint64_t n, comm::wire_dtype t,
                      int root) override {
    comm::detail::with_wire_type(t, [&]<class T>(T*) { b_.broadcast_host(c, static_cast<T*>(values), n, root); });
  }
  void check_readable(const void* p, const std::string& who) const override {
    if constexpr (requires { b_.check_readable(p, who); }) b_.check_readable(p, who);
  }

 private:
  using transfer_type = typename Backend::transfer;
  struct typed_transfer final : async_transfer::impl {
    explicit typed_transfer(transfer_type x) : t(std::move(x)) {}
    bool done() override { return t.done(); }
    void wait() override { t.wait(); }
    transfer_type t;
  };
  static async_transfer wrap(transfer_type t) {
    if constexpr (std::is_same_v<transfer_type, host_transfer>) {
      return {};  // complete on return
    } else {
      return async_transfer(std::make_unique<typed_transfer>(std::move(t)));
    }
  }

  Backend b_;
};

}  // namespace mpzero

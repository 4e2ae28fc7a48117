// A host backend that pretends to be a device with a copy engine: its asynchronous
// transfers do not happen when they are queued but later, when the transfer is waited
// on, when the backend's later work is ordered after it, or after it has been polled a
// few times. ZeroOptimizer's overlapped-transfer logic (buffers kept alive and untouched
// until a transfer is done; the host reading a download only after done() or wait())
// thereby runs on the CPU: a buffer reused or read too early gives different numbers,
// which the bit-exact tests against host_backend catch.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>

#include <mpzero/backend/host_backend.hpp>

namespace mpzero::testing {

struct deferred_backend : host_backend {
  static constexpr bool device_memory = true;

  class transfer {
   public:
    transfer() = default;
    explicit transfer(std::function<void()> copy, int polls) : s_(std::make_shared<state>(state{std::move(copy), polls})) {}
    bool done() const {
      if (!s_ || s_->finished) return true;
      if (--s_->polls_left > 0) return false;
      finish();
      return true;
    }
    void wait() const {
      if (s_ && !s_->finished) finish();
    }

   private:
    struct state {
      std::function<void()> copy;
      int polls_left;
      bool finished = false;
    };
    void finish() const {
      s_->copy();
      s_->finished = true;
    }
    std::shared_ptr<state> s_;
  };

  // Polls a transfer answers "not yet" before it completes by itself.
  int polls = 3;
  // Transfers queued so far by every deferred_backend (the tests check that the
  // overlapped path ran).
  static std::uint64_t total_queued() noexcept { return queued(); }

  template <class T>
  transfer download_async(T* host_dst, const T* src, std::uint64_t n) const {
    ++queued();
    return transfer([=] { if (n > 0) std::memcpy(static_cast<void*>(host_dst), src, n * sizeof(T)); }, polls);
  }
  template <class T>
  transfer upload_async(T* dst, const T* host_src, std::uint64_t n) const {
    ++queued();
    return transfer([=] { if (n > 0) std::memcpy(static_cast<void*>(dst), host_src, n * sizeof(T)); }, polls);
  }
  // The "device" runs the caller's later work right away, on the host: the copy must be done first.
  void order_after(const transfer& t) const { t.wait(); }

 private:
  static std::uint64_t& queued() noexcept {
    static std::uint64_t n = 0;
    return n;
  }
};

}  // namespace mpzero::testing

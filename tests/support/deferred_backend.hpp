// A host backend that pretends to be a device with a copy engine: its asynchronous
// transfers do not happen when they are queued but later, when the transfer is waited
// on, when the backend's later work is ordered after it, or after it has been polled a
// few times. ZeroOptimizer's overlapped-transfer logic (buffers kept alive and untouched
// until a transfer is done; the host reading a download only after done() or wait())
// thereby runs on the CPU: a buffer reused or read too early gives different numbers,
// which the bit-exact tests against host_backend catch. Stricter than a GPU on purpose:
//  - a transfer's destination holds 0xFF bytes (NaN in every float format) from the moment
//    it is queued until the copy runs, so reading it early cannot go unnoticed;
//  - its source is compared with what it held when the transfer was queued when the copy
//    runs: a source changed in between (on a GPU, a race with the copy engine) throws.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <mpzero/backend/host_backend.hpp>

namespace mpzero::testing {

struct deferred_backend : host_backend {
  static constexpr bool device_memory = true;
  // Its "device" buffers are host memory: host communicators (MPI) may read them.
  static constexpr bool host_addressable = true;

  class transfer {
   public:
    transfer() = default;
    transfer(void* dst, const void* src, std::size_t bytes, int polls, const char* what)
        : s_(std::make_shared<state>(state{dst, src, bytes, std::vector<unsigned char>(bytes), polls, what})) {
      if (bytes == 0) {
        s_->finished = true;
        return;
      }
      std::memcpy(s_->queued.data(), src, bytes);
      std::memset(dst, 0xFF, bytes);
    }
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
      void* dst;
      const void* src;
      std::size_t bytes;
      std::vector<unsigned char> queued;  // the source when the transfer was queued
      int polls_left;
      const char* what;
      bool finished = false;
    };
    void finish() const {
      s_->finished = true;
      if (std::memcmp(s_->src, s_->queued.data(), s_->bytes) != 0) {
        throw std::logic_error(std::string("deferred_backend: the source of a queued ") + s_->what + " of " +
                               std::to_string(s_->bytes) +
                               " bytes changed before the copy ran (on a GPU: a race with the copy engine)");
      }
      std::memcpy(s_->dst, s_->src, s_->bytes);
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
    return transfer(host_dst, src, n * sizeof(T), polls, "download");
  }
  template <class T>
  transfer upload_async(T* dst, const T* host_src, std::uint64_t n) const {
    ++queued();
    return transfer(dst, host_src, n * sizeof(T), polls, "upload");
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

// A host backend that counts the bytes of every buffer it allocates, live and at most,
// independently of ZeroOptimizer::memory(): what the memory tests measure the core's
// buffers with. Counts are per process (static), like the backend's memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include <mpzero/backend/host_backend.hpp>

namespace mpzero::testing {

struct counting_backend : host_backend {
  struct counts {
    std::uint64_t live = 0, peak = 0;
    std::uint64_t largest = 0;  // the most bytes of one allocation since reset()
    void reset() noexcept {
      peak = live;
      largest = 0;
    }
  };
  static counts& count() noexcept {
    static counts c;
    return c;
  }

  template <class T>
  class buffer {
   public:
    buffer() = default;
    explicit buffer(std::uint64_t n) : b_(n), bytes_(b_.bytes()) {
      counts& c = count();
      c.live += bytes_;
      c.peak = std::max(c.peak, c.live);
      c.largest = std::max(c.largest, bytes_);
    }
    buffer(buffer&& o) noexcept : b_(std::move(o.b_)), bytes_(std::exchange(o.bytes_, 0)) {}
    buffer& operator=(buffer&& o) noexcept {
      if (this != &o) {
        count().live -= bytes_;
        b_ = std::move(o.b_);
        bytes_ = std::exchange(o.bytes_, 0);
      }
      return *this;
    }
    ~buffer() { count().live -= bytes_; }
    T* data() noexcept { return b_.data(); }
    const T* data() const noexcept { return b_.data(); }
    std::uint64_t size() const noexcept { return bytes_ / sizeof(T); }
    std::uint64_t bytes() const noexcept { return bytes_; }

   private:
    host_buffer<T> b_;
    std::uint64_t bytes_ = 0;
  };

  template <class T>
  buffer<T> allocate(std::uint64_t n) const {
    return buffer<T>(n);
  }
};

}  // namespace mpzero::testing

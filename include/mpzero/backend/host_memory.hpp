// mpzero: host memory as the ZeRO optimizer allocates it: owning, zero-initialised,
// 64-byte aligned arrays from an allocator that a backend chooses (pageable, or pinned
// by the CUDA backend for ZeRO-Offload's copies).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>

#include "../error.hpp"

namespace mpzero {

// Where host memory comes from. The default is 64-byte aligned pageable memory; the
// CUDA backend supplies page-locked ("pinned") memory for ZeRO-Offload, which the
// copy engines read and write directly (no bounce buffer) and which lets copies run
// asynchronously. `name` appears in out-of-memory errors.
struct host_allocator {
  void* (*allocate)(std::size_t bytes) = nullptr;  // nullptr on failure
  void (*deallocate)(void* p) noexcept = nullptr;
  const char* name = "pageable";
  bool pinned = false;
};

namespace detail {
inline void* aligned_host_allocate(std::size_t bytes) { return std::aligned_alloc(64, (bytes + 63) / 64 * 64); }
inline void aligned_host_free(void* p) noexcept { std::free(p); }
}  // namespace detail

inline constexpr host_allocator pageable_host_allocator{&detail::aligned_host_allocate, &detail::aligned_host_free,
                                                        "pageable", false};

// An owning, zero-initialised, 64-byte aligned array in host memory.
template <class T>
class host_buffer {
 public:
  host_buffer() = default;
  explicit host_buffer(std::uint64_t n, const host_allocator& alloc = pageable_host_allocator) : n_(n) {
    if (n == 0) return;
    if (n > (std::uint64_t{1} << 62) / sizeof(T)) detail::throw_invalid("host_buffer: " + std::to_string(n) + " elements is too many");
    const std::size_t bytes = (static_cast<std::size_t>(n) * sizeof(T) + 63) / 64 * 64;
    void* p = alloc.allocate(bytes);
    if (p == nullptr) {
      throw error("mpzero: out of " + std::string(alloc.name) + " host memory allocating " + std::to_string(bytes) +
                  " bytes" +
                  (alloc.pinned ? "; pinned memory is limited by the OS (ulimit -l, cgroups): set "
                                  "zero_options::pin_memory = false (offload_optimizer.pin_memory: false) to use "
                                  "pageable memory"
                                : ""));
    }
    std::memset(p, 0, bytes);
    p_ = std::unique_ptr<T, deleter>(static_cast<T*>(p), deleter{alloc.deallocate});
    pinned_ = alloc.pinned;
  }
  T* data() noexcept { return p_.get(); }
  const T* data() const noexcept { return p_.get(); }
  std::uint64_t size() const noexcept { return n_; }
  std::uint64_t bytes() const noexcept { return n_ * sizeof(T); }
  // Page-locked (from a pinned allocator).
  bool pinned() const noexcept { return pinned_; }
  std::span<T> span() noexcept { return {p_.get(), static_cast<std::size_t>(n_)}; }
  std::span<const T> span() const noexcept { return {p_.get(), static_cast<std::size_t>(n_)}; }

 private:
  struct deleter {
    void (*free)(void*) noexcept = nullptr;
    void operator()(T* p) const noexcept {
      if (free != nullptr) free(p);
    }
  };
  std::unique_ptr<T, deleter> p_;
  std::uint64_t n_ = 0;
  bool pinned_ = false;
};

}  // namespace mpzero

// mpzero: the exception type of the host API.
#pragma once

#include <charconv>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace mpzero {

// Every host-side failure throws mpzero::error (or a subclass). Messages name the
// offending value and say how to fix it.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown for arguments that break a documented precondition.
class invalid_argument : public error {
 public:
  using error::error;
};

// ZeroOptimizer::step() when no rank reported a gradient since the last step or
// zero_grad() (thrown on every rank alike): a caller such as the LibTorch engine can
// say it in its own terms.
class no_gradients_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

namespace detail {

[[noreturn]] inline void throw_invalid(const std::string& what) { throw invalid_argument("mpzero: " + what); }

// Shortest round-trip text of a double, for error messages ("65536", "0.25", "1e-31").
inline std::string format_double(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// 30 bits of FNV-1a: enough to tell two descriptions apart, and negatable without
// overflow (the largest over the ranks of h and of -h give the largest and smallest h).
inline std::int32_t hash30(std::string_view text) {
  std::uint32_t h = 2166136261u;
  for (unsigned char c : text) h = (h ^ c) * 16777619u;
  return static_cast<std::int32_t>(h & 0x3fffffffu);
}

// A collective operation whose local part may fail on some ranks only: runs `local`,
// then every rank learns, in one collective, whether any rank failed. This rank's own
// exception is rethrown (also when the collective itself fails: its reason says more);
// a rank whose part succeeded throws mpzero::error naming the rank that failed, so no
// rank goes on into a collective the others skip.
//
// When `local` returns {identity, shown} (a description of what must be alike on every
// rank, compared by hash, and how a message names this rank's side), the same
// collective also checks that the ranks passed the same thing: if every rank succeeded
// but the identities differ, every rank throws invalid_argument "mpzero: <who>: the
// ranks passed different <what> (this rank: <shown>); pass the same on every rank".
//
// all_reduce_max(v, n) replaces the n int32 at v by their largest over the ranks (n is
// 1, or 3 with an identity); it is not called at world size 1.
template <class AllReduceMax, class Local>
void agree_on_failure_and_identity(int rank, int world, AllReduceMax&& all_reduce_max, const std::string& who,
                                   const std::string& consequence, const std::string& what, Local&& local) {
  constexpr bool compares = !std::is_void_v<std::invoke_result_t<Local&>>;
  std::exception_ptr failure;
  std::pair<std::string, std::string> id;
  try {
    if constexpr (compares) {
      id = local();
    } else {
      local();
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (world <= 1) {
    if (failure) std::rethrow_exception(failure);
    return;
  }
  const std::int32_t h = failure ? 0 : hash30(id.first);
  std::int32_t v[3] = {failure ? rank + 1 : 0, h, -h};
  try {
    all_reduce_max(v, compares ? 3 : 1);
  } catch (...) {
    if (failure) std::rethrow_exception(failure);
    throw;
  }
  if (failure) std::rethrow_exception(failure);
  if (v[0] != 0) {
    throw error("mpzero: " + who + ": rank " + std::to_string(v[0] - 1) + " of " + std::to_string(world) +
                " failed (its exception says why); " + consequence);
  }
  if (compares && v[1] != -v[2]) {
    throw_invalid(who + ": the ranks passed different " + what + " (this rank: " + id.second +
                  "); pass the same on every rank");
  }
}

// The same without an identity: `local` returns nothing.
template <class AllReduceMax, class Local>
void agree_on_failure(int rank, int world, AllReduceMax&& all_reduce_max, const std::string& who,
                      const std::string& consequence, Local&& local) {
  agree_on_failure_and_identity(rank, world, all_reduce_max, who, consequence, std::string(), local);
}

}  // namespace detail
}  // namespace mpzero

// mpzero: the exception type of the host API.
#pragma once

#include <charconv>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

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

// A collective operation whose local part may fail on some ranks only: runs `local`,
// then every rank learns whether any rank failed (max_over_ranks(v) returns the largest
// v over the ranks; it is the one collective, called exactly once on every rank). This
// rank's own exception is rethrown; a rank whose part succeeded throws mpzero::error
// naming the rank that failed, so no rank goes on into a collective the others skip.
template <class MaxOverRanks, class Local>
void agree_on_failure(int rank, int world, MaxOverRanks&& max_over_ranks, const std::string& who,
                      const std::string& consequence, Local&& local) {
  std::exception_ptr failure;
  try {
    local();
  } catch (...) {
    failure = std::current_exception();
  }
  const std::int32_t failed = max_over_ranks(static_cast<std::int32_t>(failure ? rank + 1 : 0));
  if (failure) std::rethrow_exception(failure);
  if (failed != 0) {
    throw error("mpzero: " + who + ": rank " + std::to_string(failed - 1) + " of " + std::to_string(world) +
                " failed (its exception says why); " + consequence);
  }
}

}  // namespace detail
}  // namespace mpzero

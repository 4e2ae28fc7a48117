// mpzero: the exception type of the host API.
#pragma once

#include <charconv>
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

namespace detail {

[[noreturn]] inline void throw_invalid(const std::string& what) { throw invalid_argument("mpzero: " + what); }

// Shortest round-trip text of a double, for error messages ("65536", "0.25", "1e-31").
inline std::string format_double(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

}  // namespace detail
}  // namespace mpzero

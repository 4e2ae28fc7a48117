// mpzero: the communicator concept shared by every communication backend.
//
// A communicator runs collective calls over buffers in its backend's memory space
// (host memory for local_communicator and mpi_communicator, device memory for
// nccl_communicator). Counts are numbers of elements, 64-bit. Every rank must make
// the same calls in the same order with the same counts, op and root; the backends
// do not check that across ranks (it would cost a round trip per call).
//
// Semantics of the calls (T is a wire_type):
//   all_reduce(in, out, n, op)             out[i] = op over ranks of in[i]; in == out allowed.
//   reduce_scatter_v(in, out, counts, op)  in holds sum(counts) elements as consecutive
//                                          blocks, block r has counts[r] elements; rank r
//                                          receives block r reduced over ranks in out
//                                          (counts[r] elements). Zeros allowed. out may be
//                                          in's own block (in + offset of block rank): then
//                                          the other blocks of in are unspecified afterwards.
//   all_gather_v(in, n_in, out, counts)    n_in == counts[rank]; out holds sum(counts)
//                                          elements, block r from rank r. in may be out's
//                                          own block (in place).
//   broadcast(data, n, root)               data on every rank becomes root's.
//   barrier()
//   ireduce_scatter_v / iall_gather_v (and iall_reduce / ibroadcast): the same, returning
//                                          a request; buffers must stay alive and untouched
//                                          until its wait() returns.
// Any other overlap between in and out is rejected with invalid_argument.
//
// Failures: a backend error, or a wait that outlasts the communicator's timeout (a peer
// that stopped answering), throws comm_error; the communicator is unusable afterwards
// and the job should be aborted. Waits never block without a deadline.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>

#include "../error.hpp"
#include "../numeric/bf16.hpp"
#include "../numeric/fp16.hpp"

struct CUstream_st;  // what cudaStream_t points to, named without the CUDA headers

namespace mpzero::comm {

enum class reduce_op { sum, max };

constexpr std::string_view name_of(reduce_op op) noexcept { return op == reduce_op::sum ? "sum" : "max"; }

// Thrown when communication fails: a backend error, or a peer that stopped answering.
class comm_error : public mpzero::error {
 public:
  using error::error;
};

// Element types that may travel. Sums of bf16/fp16 are computed in fp32 and rounded
// to nearest: once per pairwise combine in the MPI and NCCL communicators, once at the
// end in the torch adapter's c10d one (see each backend); int32 sums wrap like the
// backend's native integer sum would (do not rely on overflow); uint8 sums wrap mod 256
// on every backend.
template <class T>
concept wire_type = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, mpzero::bf16> ||
                    std::same_as<T, mpzero::fp16> || std::same_as<T, std::int32_t> || std::same_as<T, std::uint8_t>;

template <wire_type T>
constexpr std::string_view wire_name() noexcept {
  if constexpr (std::same_as<T, float>) return "float";
  else if constexpr (std::same_as<T, double>) return "double";
  else if constexpr (std::same_as<T, mpzero::bf16>) return "bf16";
  else if constexpr (std::same_as<T, mpzero::fp16>) return "fp16";
  else if constexpr (std::same_as<T, std::int32_t>) return "int32";
  else return "uint8";
}

// Something that can be waited on. Backends add test() (non-blocking poll).
template <class R>
concept request = requires(R& r) { r.wait(); };

template <class C>
concept communicator = requires(C& c, const float* in, float* out, std::uint64_t n,
                                std::span<const std::uint64_t> counts) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce(in, out, n, reduce_op::sum);
  c.reduce_scatter_v(in, out, counts, reduce_op::sum);
  c.all_gather_v(in, counts[static_cast<std::size_t>(c.rank())], out, counts);
  c.broadcast(out, n, 0);
  c.barrier();
  { c.ireduce_scatter_v(in, out, counts, reduce_op::sum) } -> request;
  { c.iall_gather_v(in, counts[static_cast<std::size_t>(c.rank())], out, counts) } -> request;
};

// A communicator that orders its collectives after the work queued so far on a CUDA
// stream, without a host wait: wait_for(cudaStream_t) (nccl_communicator,
// cuda_local_communicator).
template <class C>
concept stream_ordered = requires(C& c, ::CUstream_st* s) { c.wait_for(s); };

// The type-erased form: `bool wait_for_stream(void* stream)`, true where it did order
// itself (a type-erased communicator forwards to the stream_ordered one it wraps).
template <class C>
concept erased_stream_ordered = requires(C& c, void* s) {
  { c.wait_for_stream(s) } -> std::convertible_to<bool>;
};

// Whether c's collectives take device memory:
//  - what c says, when it answers at run time: `bool reads_device_memory()` (a
//    type-erased communicator; also the opt-in of a CUDA-aware MPI wrapper);
//  - else yes for a stream_ordered one, or one with `bool wait_for_stream(void*)` (the
//    type-erased form of wait_for that cuda_backend::before_comm also accepts);
//  - else no: local_communicator and mpi_communicator move host memory.
// A backend's buffers must live where its communicator reads: ZeroOptimizer refuses a
// mismatch at construction.
template <class C>
bool reads_device_memory(const C& c) {
  auto& m = const_cast<C&>(c);  // a query; some communicators declare it non-const
  if constexpr (requires {
                  { m.reads_device_memory() } -> std::convertible_to<bool>;
                }) {
    return static_cast<bool>(m.reads_device_memory());
  } else {
    return stream_ordered<C> || erased_stream_ordered<C>;
  }
}

// The blocking calls of a communicator whose non-blocking calls return requests:
// post, then wait. Communicators derive from it (CRTP) and keep barrier() their own.
template <class Derived>
class blocking_collectives {
 public:
  template <wire_type T>
  void all_reduce(const T* in, T* out, std::uint64_t n, reduce_op op) {
    self().iall_reduce(in, out, n, op).wait();
  }
  template <wire_type T>
  void reduce_scatter_v(const T* in, T* out, std::span<const std::uint64_t> counts, reduce_op op) {
    self().ireduce_scatter_v(in, out, counts, op).wait();
  }
  template <wire_type T>
  void all_gather_v(const T* in, std::uint64_t n_in, T* out, std::span<const std::uint64_t> counts) {
    self().iall_gather_v(in, n_in, out, counts).wait();
  }
  template <wire_type T>
  void broadcast(T* data, std::uint64_t n, int root) {
    self().ibroadcast(data, n, root).wait();
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

// The default deadline of a wait, in seconds: MPZERO_COMM_TIMEOUT_S when set, else 300.
inline constexpr double default_timeout_s = 300.0;

namespace detail {

inline double timeout_from_env() {
  const char* v = std::getenv("MPZERO_COMM_TIMEOUT_S");
  if (v == nullptr || *v == '\0') return default_timeout_s;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(t > 0.0) || t > 1e9) {
    throw mpzero::invalid_argument(std::string("mpzero: MPZERO_COMM_TIMEOUT_S='") + v +
                                   "' is not a positive number of seconds (at most 1e9); set it to e.g. 300 or unset it");
  }
  return t;
}

inline double checked_timeout(double t) {
  if (!(t > 0.0) || t > 1e9) {
    throw mpzero::invalid_argument("mpzero: communicator timeout " + std::to_string(t) +
                                   " s is not a positive number of seconds (at most 1e9); pass e.g. 300");
  }
  return t;
}

// Validates per-rank counts and returns their sum.
inline std::uint64_t checked_total(std::span<const std::uint64_t> counts, int size, std::string_view op) {
  if (counts.size() != static_cast<std::size_t>(size)) {
    throw mpzero::invalid_argument("mpzero: " + std::string(op) + " got " + std::to_string(counts.size()) +
                                   " counts for a communicator of size " + std::to_string(size) +
                                   "; pass exactly one count per rank");
  }
  std::uint64_t total = 0;
  for (const std::uint64_t c : counts) {
    if (c > std::numeric_limits<std::uint64_t>::max() - total) {
      throw mpzero::invalid_argument("mpzero: " + std::string(op) + ": the counts' sum overflows 64 bits");
    }
    total += c;
  }
  return total;
}

inline std::uint64_t offset_of(std::span<const std::uint64_t> counts, int rank) {
  std::uint64_t off = 0;
  for (int r = 0; r < rank; ++r) off += counts[static_cast<std::size_t>(r)];
  return off;
}

inline void check_root(int root, int size, std::string_view op) {
  if (root < 0 || root >= size) {
    throw mpzero::invalid_argument("mpzero: " + std::string(op) + " root " + std::to_string(root) +
                                   " is not a rank of a communicator of size " + std::to_string(size) +
                                   "; pass a root in [0, size)");
  }
}

inline void check_count_match(std::uint64_t n_in, std::span<const std::uint64_t> counts, int rank,
                              std::string_view op) {
  if (n_in != counts[static_cast<std::size_t>(rank)]) {
    throw mpzero::invalid_argument("mpzero: " + std::string(op) + " on rank " + std::to_string(rank) + " sends " +
                                   std::to_string(n_in) + " elements but counts[" + std::to_string(rank) +
                                   "] is " + std::to_string(counts[static_cast<std::size_t>(rank)]) +
                                   "; they must agree");
  }
}

// Are [a, a + na) and [b, b + nb) (in elements of T) overlapping? Compared as integers:
// the ranges may belong to different allocations.
template <class T>
bool overlaps(const T* a, std::uint64_t na, const T* b, std::uint64_t nb) noexcept {
  if (na == 0 || nb == 0) return false;
  const auto ua = reinterpret_cast<std::uintptr_t>(a);
  const auto ub = reinterpret_cast<std::uintptr_t>(b);
  return ua < ub + nb * sizeof(T) && ub < ua + na * sizeof(T);
}

// Throws unless the two ranges are identical (allowed in-place) or disjoint.
template <class T>
void check_same_or_disjoint(const T* in, std::uint64_t n_in, const T* out, std::uint64_t n_out, bool same_ok,
                            std::string_view op, std::string_view allowed) {
  if (same_ok && static_cast<const void*>(in) == static_cast<const void*>(out)) return;
  if (overlaps(in, n_in, out, n_out)) {
    throw mpzero::invalid_argument("mpzero: " + std::string(op) + ": input and output buffers overlap; " +
                                   std::string(allowed));
  }
}

// Polls without burning a core: the first polls only yield (latency matters for short
// operations), later ones sleep, growing to 200 us, so that oversubscribed ranks (four
// on two cores) let each other progress.
class backoff {
 public:
  void pause() {
    if (polls_ < 64) {
      ++polls_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    if (sleep_us_ < 200) sleep_us_ *= 2;
  }

 private:
  int polls_ = 0;
  int sleep_us_ = 1;
};

using clock = std::chrono::steady_clock;

inline double seconds_since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

inline std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

}  // namespace detail
}  // namespace mpzero::comm

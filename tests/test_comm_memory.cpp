// The host memory MPI allocates for a collective in flight, under mpirun at 2-4 ranks:
// docs/precision.md counts it in the bound on communication buffers (Open MPI's
// non-blocking reduce-scatter and all-reduce allocate scratch of their own; the bound
// states how much, and this program checks it on the MPI the build uses).
//
// Counted at the C library: this program replaces malloc and its family with wrappers
// that call glibc's and add up malloc_usable_size of what is live, and the peak.
#include <catch2/catch.hpp>
#include <malloc.h>
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <mpzero/comm/mpi.hpp>

extern "C" {
void* __libc_malloc(std::size_t);
void __libc_free(void*);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
}

namespace {
std::atomic<long long> live_bytes{0}, peak_bytes{0};
void counted(void* p) {
  if (p == nullptr) return;
  const long long now = live_bytes += static_cast<long long>(malloc_usable_size(p));
  long long peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
}
void uncounted(void* p) {
  if (p != nullptr) live_bytes -= static_cast<long long>(malloc_usable_size(p));
}
}  // namespace

extern "C" {
void* malloc(std::size_t n) {
  void* p = __libc_malloc(n);
  counted(p);
  return p;
}
void free(void* p) {
  uncounted(p);
  __libc_free(p);
}
void* calloc(std::size_t a, std::size_t b) {
  void* p = __libc_calloc(a, b);
  counted(p);
  return p;
}
void* realloc(void* p, std::size_t n) {
  const long long before = p ? static_cast<long long>(malloc_usable_size(p)) : 0;
  void* q = __libc_realloc(p, n);
  if (q != nullptr || n == 0) {
    live_bytes -= before;
    counted(q);
  }
  return q;
}
void* memalign(std::size_t a, std::size_t n) {
  void* p = __libc_memalign(a, n);
  counted(p);
  return p;
}
void* aligned_alloc(std::size_t a, std::size_t n) { return memalign(a, n); }
int posix_memalign(void** out, std::size_t a, std::size_t n) {
  *out = memalign(a, n);
  return *out ? 0 : 12;  // ENOMEM
}
}

using namespace mpzero;
using namespace mpzero::comm;

namespace {

// The most bytes allocated at once, beyond what was live before, while f runs.
template <class F>
long long scratch_of(F&& f) {
  const long long base = live_bytes.load();
  peak_bytes = base;
  f();
  return peak_bytes.load() - base;
}

// A few KiB of requests and schedules, whatever the size.
constexpr long long fixed_slack = 8 * 1024;

template <class T>
void check_scratch(mpi_communicator& c) {
  const auto W = static_cast<std::uint64_t>(c.size());
  for (const std::uint64_t per_rank : {std::uint64_t{1} << 12, std::uint64_t{1} << 18}) {
    const std::uint64_t n = per_rank * W;
    const auto bytes = static_cast<long long>(n * sizeof(T));
    INFO(wire_name<T>() << ", " << per_rank << " elements per rank, world " << W);
    std::vector<T> buf(n, T(1.0f));
    const std::vector<std::uint64_t> counts(W, per_rank);
    T* own = buf.data() + per_rank * static_cast<std::uint64_t>(c.rank());
    c.barrier();
    // docs/precision.md: an all-reduce allocates up to its buffer's bytes, a
    // reduce-scatter twice its whole input's; gathers and broadcasts nothing that grows.
    CHECK(scratch_of([&] { c.iall_reduce(buf.data(), buf.data(), n, reduce_op::sum).wait(); }) <=
          bytes + fixed_slack);
    CHECK(scratch_of([&] {
            c.ireduce_scatter_v(buf.data(), own, std::span<const std::uint64_t>(counts), reduce_op::sum).wait();
          }) <= 2 * bytes + fixed_slack);
    CHECK(scratch_of([&] { c.iall_gather_v(own, per_rank, buf.data(), std::span<const std::uint64_t>(counts)).wait(); }) <=
          fixed_slack);
    CHECK(scratch_of([&] { c.ibroadcast(buf.data(), n, 0).wait(); }) <= fixed_slack);
    // And the bound is not loose: the reduce-scatter does take about twice its input.
    if (W > 1 && per_rank > 4096) {
      CHECK(scratch_of([&] {
              c.ireduce_scatter_v(buf.data(), own, std::span<const std::uint64_t>(counts), reduce_op::sum).wait();
            }) >= 2 * bytes * 9 / 10);
    }
  }
}

}  // namespace

TEST_CASE("comm memory: MPI's scratch for a collective in flight is within the documented bound", "[comm_memory]") {
  mpi_communicator c(MPI_COMM_WORLD, mpi_options{.timeout_s = 60.0});
  check_scratch<float>(c);
  check_scratch<bf16>(c);  // a user-defined MPI operation
  check_scratch<fp16>(c);
}

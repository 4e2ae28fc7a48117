// Communicators on the host: local_communicator, and mpi_communicator under mpirun with
// 1 to 4 ranks (every rank runs every case).
//
// Every rank can compute every rank's input (a hash of rank, index and a salt), so each
// rank checks its own results against references summed in long double (or int64) here,
// independently of the code under test. Float, double and integer inputs are chosen so
// that their sums are exact; bf16/fp16 inputs exercise rounding (see check_half_sum).
//
// Communicators here use a 60 s deadline: if one rank fails a REQUIRE and leaves a case
// early, the others time out with a comm_error instead of hanging the job.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include <mpzero/comm/communicator.hpp>
#include <mpzero/comm/local.hpp>
#include <mpzero/comm/mpi.hpp>

using namespace mpzero;
using namespace mpzero::comm;
using u64 = std::uint64_t;

namespace {

constexpr double test_timeout_s = 60.0;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

mpi_communicator make_comm(u64 max_count = static_cast<u64>(INT_MAX)) {
  mpi_options opt;
  opt.timeout_s = test_timeout_s;
  opt.max_count_per_call = max_count;
  return mpi_communicator(MPI_COMM_WORLD, opt);
}

// ---- inputs: a pure function of (rank, index, salt) --------------------------------

u64 splitmix(u64 x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
u64 key(int rank, u64 i, u64 salt) { return splitmix(splitmix(salt) ^ (static_cast<u64>(rank) << 40) ^ i); }

template <class T>
T make(int rank, u64 i, u64 salt) {
  const u64 k = key(rank, i, salt);
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(static_cast<int>(k % 2001) - 1000) / 8.0f;  // sums of 4 exact in float
  } else if constexpr (std::is_same_v<T, double>) {
    return static_cast<double>(static_cast<long long>(k % 2000001) - 1000000) / 16.0;
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    return static_cast<std::int32_t>(static_cast<long long>(k % 1000000001) - 500000000);  // 4 never overflow
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    return static_cast<std::uint8_t>(k & 0xffu);
  } else if constexpr (std::is_same_v<T, bf16>) {
    // Normal values with exponents in [-6, 4] and random sign and mantissa.
    const auto sign = static_cast<std::uint16_t>((k >> 63) << 15);
    const auto exp = static_cast<std::uint16_t>(121 + (k >> 8) % 11);
    return bf16::from_bits(static_cast<std::uint16_t>(sign | (exp << 7) | (k & 0x7fu)));
  } else {
    const auto sign = static_cast<std::uint16_t>((k >> 63) << 15);
    const auto exp = static_cast<std::uint16_t>(9 + (k >> 8) % 11);  // [-6, 4] too
    return fp16::from_bits(static_cast<std::uint16_t>(sign | (exp << 10) | (k & 0x3ffu)));
  }
}

// Value of an element from its format's definition.
long double value_of(float x) { return x; }
long double value_of(double x) { return x; }
long double value_of(std::int32_t x) { return x; }
long double value_of(std::uint8_t x) { return x; }
long double value_of(bf16 x) {
  const std::uint32_t u = static_cast<std::uint32_t>(x.bits) << 16;  // bf16 is the top half of a float
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
long double value_of(fp16 x) {
  const int e = (x.bits >> 10) & 0x1f;
  const int m = x.bits & 0x3ff;
  long double v;
  if (e == 0x1f) {
    v = m ? std::numeric_limits<long double>::quiet_NaN() : std::numeric_limits<long double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(static_cast<long double>(m), -24);
  } else {
    v = std::ldexp(static_cast<long double>(m + 1024), e - 25);
  }
  return (x.bits & 0x8000) ? -v : v;
}

template <class T>
bool same_bits(const T& a, const T& b) {
  using bytes = std::array<unsigned char, sizeof(T)>;
  return std::bit_cast<bytes>(a) == std::bit_cast<bytes>(b);
}

// Nearest-even rounding of v to a binary format with `man_bits` stored mantissa bits
// whose smallest normal exponent is `min_exp` (no overflow in our ranges).
long double round_ref(long double v, int man_bits, int min_exp) {
  if (v == 0) return 0;
  const int e = std::max(std::ilogb(v), min_exp);
  const long double ulp = std::ldexp(1.0L, e - man_bits);
  return std::nearbyint(v / ulp) * ulp;  // default rounding mode: ties to even
}

template <class T>
constexpr bool is_half = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

// bf16/fp16 sums. Each pairwise combine adds in fp32 and rounds once to nearest. Our
// inputs are multiples of 2^-13 (bf16) / 2^-16 (fp16) below 2^5, so every partial sum
// is such a multiple below 2^7 and the fp32 add is exact: one rounding per combine,
// relative error <= u = 2^-8 (bf16) / 2^-11 (fp16), subnormal fp16 partials are exact.
//   P = 1: the input itself.  P = 2: exactly round(a + b), whatever the order.
//   P > 2: the tree is the backend's, so only the recursive-summation bound holds:
//          |got - s| <= ((1 + u)^(P-1) - 1) * sum |x_i|.
template <class T>
bool check_half_sum(T got, const std::vector<long double>& xs, std::string& why) {
  const bool is_bf16 = std::is_same_v<T, bf16>;
  const int man = is_bf16 ? 7 : 10;
  const int min_exp = is_bf16 ? -126 : -14;
  const long double u = std::ldexp(1.0L, -(man + 1));
  long double s = 0, a = 0;
  for (long double x : xs) {
    s += x;
    a += std::fabs(x);
  }
  const long double g = value_of(got);
  const auto p = xs.size();
  bool ok;
  long double bound = 0;
  if (p == 1) {
    ok = g == xs[0];
  } else if (p == 2) {
    bound = round_ref(s, man, min_exp);
    ok = g == bound;
  } else {
    bound = (std::pow(1 + u, static_cast<long double>(p - 1)) - 1) * a;
    ok = std::fabs(g - s) <= bound;
  }
  if (!ok) {
    why = "got " + std::to_string(static_cast<double>(g)) + ", exact sum " + std::to_string(static_cast<double>(s)) +
          (p == 2 ? ", expected " : ", bound ") + std::to_string(static_cast<double>(bound));
  }
  return ok;
}

// Checks one element reduced over `p` ranks: element `i` of every rank's input.
template <class T>
bool check_reduced(T got, reduce_op op, int p, u64 i, u64 salt, std::string& why) {
  std::vector<long double> xs;
  std::vector<T> raw;
  for (int r = 0; r < p; ++r) {
    raw.push_back(make<T>(r, i, salt));
    xs.push_back(value_of(raw.back()));
  }
  const long double g = value_of(got);
  if (op == reduce_op::max) {
    const long double m = *std::max_element(xs.begin(), xs.end());
    if (g != m) why = "max: got " + std::to_string(static_cast<double>(g)) + ", expected " + std::to_string(static_cast<double>(m));
    return g == m;
  }
  if constexpr (is_half<T>) {
    return check_half_sum(got, xs, why);
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    unsigned s = 0;
    for (T x : raw) s += x;
    if (got != static_cast<std::uint8_t>(s % 256u)) why = "uint8 sum mod 256: got " + std::to_string(got);
    return got == static_cast<std::uint8_t>(s % 256u);
  } else {
    long double s = 0;
    for (long double x : xs) s += x;  // exact for our inputs
    if (g != s) why = "got " + std::to_string(static_cast<double>(g)) + ", exact " + std::to_string(static_cast<double>(s));
    return g == s;
  }
}

// All ranks hold identical bytes in `v`?
template <class T>
bool identical_across_ranks(const std::vector<T>& v) {
  const int p = world_size();
  const std::size_t bytes = v.size() * sizeof(T);
  std::vector<unsigned char> all(bytes * static_cast<std::size_t>(p));
  MPI_Allgather(v.data(), static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes), MPI_BYTE,
                MPI_COMM_WORLD);
  for (int r = 1; r < p; ++r) {
    if (bytes > 0 && std::memcmp(all.data(), all.data() + bytes * static_cast<std::size_t>(r), bytes) != 0) return false;
  }
  return true;
}

// Per-rank counts with zeros in them (rank 1 and, at four ranks, rank 3 own nothing).
std::vector<u64> uneven_counts(int p, u64 scale = 1) {
  static const u64 pattern[] = {13, 0, 6, 0, 21};
  std::vector<u64> c;
  c.reserve(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) c.push_back(pattern[r % 5] * scale);
  return c;
}

template <class T>
void run_all_reduce(mpi_communicator& c, reduce_op op, bool in_place, u64 n, u64 salt) {
  const int rank = c.rank(), p = c.size();
  std::vector<T> in(n), out(n);
  for (u64 i = 0; i < n; ++i) in[i] = make<T>(rank, i, salt);
  std::vector<T>& result = in_place ? in : out;
  if (in_place) {
    c.all_reduce(in.data(), in.data(), n, op);
  } else {
    if (n > 0) std::memset(static_cast<void*>(out.data()), 0xab, n * sizeof(T));
    c.all_reduce(in.data(), out.data(), n, op);
    for (u64 i = 0; i < n; ++i) REQUIRE(same_bits(in[i], make<T>(rank, i, salt)));  // input untouched
  }
  u64 bad = 0;
  std::string first;
  for (u64 i = 0; i < n; ++i) {
    std::string why;
    if (!check_reduced(result[i], op, p, i, salt, why)) {
      if (bad++ == 0) first = "element " + std::to_string(i) + ": " + why;
    }
  }
  INFO(wire_name<T>() << " " << name_of(op) << (in_place ? " in place" : "") << ", " << p << " ranks: " << first);
  CHECK(bad == 0);
  CHECK(identical_across_ranks(result));
}

template <class T>
void run_reduce_scatter(mpi_communicator& c, reduce_op op, bool in_place, const std::vector<u64>& counts, u64 salt) {
  const int rank = c.rank(), p = c.size();
  const u64 total = std::accumulate(counts.begin(), counts.end(), u64{0});
  const u64 own_off = std::accumulate(counts.begin(), counts.begin() + rank, u64{0});
  const u64 own = counts[static_cast<std::size_t>(rank)];
  std::vector<T> in(total + 1), out(own + 1);  // +1: a sentinel past the end
  for (u64 i = 0; i < total; ++i) in[i] = make<T>(rank, i, salt);
  const T sentinel = make<T>(99, 0, salt);
  out[own] = sentinel;
  T* dst = in_place ? in.data() + own_off : out.data();
  if (!in_place) in[total] = sentinel;
  c.reduce_scatter_v(in.data(), dst, counts, op);
  u64 bad = 0;
  std::string first;
  for (u64 j = 0; j < own; ++j) {
    std::string why;
    if (!check_reduced(dst[j], op, p, own_off + j, salt, why) && bad++ == 0) {
      first = "element " + std::to_string(j) + " of block " + std::to_string(rank) + ": " + why;
    }
  }
  INFO(wire_name<T>() << " " << name_of(op) << (in_place ? " in place" : "") << ", " << p
                      << " ranks, max_count_per_call " << c.max_count_per_call() << ": " << first);
  CHECK(bad == 0);
  if (in_place) {
    CHECK(same_bits(out[own], sentinel));
  } else {
    CHECK(same_bits(out[own], sentinel));  // wrote no more than its block
    bool input_kept = true;
    for (u64 i = 0; i < total; ++i) input_kept = input_kept && same_bits(in[i], make<T>(rank, i, salt));
    CHECK(input_kept);
  }
}

template <class T>
void run_all_gather(mpi_communicator& c, bool in_place, const std::vector<u64>& counts, u64 salt) {
  const int rank = c.rank(), p = c.size();
  const u64 total = std::accumulate(counts.begin(), counts.end(), u64{0});
  const u64 own_off = std::accumulate(counts.begin(), counts.begin() + rank, u64{0});
  const u64 own = counts[static_cast<std::size_t>(rank)];
  std::vector<T> out(total + 1);
  std::memset(static_cast<void*>(out.data()), 0x5a, out.size() * sizeof(T));
  const T sentinel = out[total];
  std::vector<T> in(own);
  // Block r, element j, comes from rank r as make(r, j).
  for (u64 j = 0; j < own; ++j) in[j] = make<T>(rank, j, salt);
  if (in_place) {
    std::copy(in.begin(), in.end(), out.begin() + static_cast<std::ptrdiff_t>(own_off));
    c.all_gather_v(out.data() + own_off, own, out.data(), counts);
  } else {
    c.all_gather_v(in.data(), own, out.data(), counts);
  }
  u64 bad = 0, at = 0;
  std::string first;
  for (int r = 0; r < p; ++r) {
    for (u64 j = 0; j < counts[static_cast<std::size_t>(r)]; ++j, ++at) {
      if (!same_bits(out[at], make<T>(r, j, salt)) && bad++ == 0) {
        first = "block " + std::to_string(r) + " element " + std::to_string(j);
      }
    }
  }
  INFO(wire_name<T>() << (in_place ? " in place" : "") << ", " << p << " ranks, max_count_per_call "
                      << c.max_count_per_call() << ": first mismatch at " << first);
  CHECK(bad == 0);
  CHECK(same_bits(out[total], sentinel));
}

}  // namespace

// -----------------------------------------------------------------------------------

TEST_CASE("local_communicator: world size 1 copies and validates", "[comm]") {
  static_assert(communicator<local_communicator>);
  static_assert(communicator<mpi_communicator>);
  local_communicator c;
  CHECK(c.rank() == 0);
  CHECK(c.size() == 1);

  std::vector<float> in(10), out(10, -1.0f);
  for (int i = 0; i < 10; ++i) in[static_cast<std::size_t>(i)] = 0.5f * static_cast<float>(i) - 2.0f;
  c.all_reduce(in.data(), out.data(), 10, reduce_op::sum);
  CHECK(out == in);
  std::vector<float> same = in;
  c.all_reduce(same.data(), same.data(), 10, reduce_op::max);
  CHECK(same == in);

  const std::vector<u64> counts{7};
  std::fill(out.begin(), out.end(), -1.0f);
  c.reduce_scatter_v(in.data(), out.data(), counts, reduce_op::sum);
  CHECK(std::equal(in.begin(), in.begin() + 7, out.begin()));
  CHECK(out[7] == -1.0f);  // counts, not the buffer size, decide

  std::fill(out.begin(), out.end(), -1.0f);
  c.all_gather_v(in.data(), 7, out.data(), counts);
  CHECK(std::equal(in.begin(), in.begin() + 7, out.begin()));
  CHECK(out[7] == -1.0f);
  c.all_gather_v(out.data(), 7, out.data(), counts);  // in place
  CHECK(std::equal(in.begin(), in.begin() + 7, out.begin()));

  auto r1 = c.ireduce_scatter_v(in.data(), out.data(), counts, reduce_op::sum);
  CHECK(r1.test());
  r1.wait();
  auto r2 = c.iall_gather_v(in.data(), 7, out.data(), counts);
  r2.wait();
  static_assert(request<decltype(r2)>);

  std::vector<bf16> h{bf16::from_bits(0x3f80), bf16::from_bits(0xc000)}, hout(2);
  c.all_reduce(h.data(), hout.data(), 2, reduce_op::sum);
  CHECK(hout == h);
  c.broadcast(h.data(), 2, 0);
  c.barrier();

  CHECK_THROWS_AS(c.broadcast(h.data(), 2, 1), mpzero::invalid_argument);
  const std::vector<u64> two{3, 4};
  CHECK_THROWS_AS(c.reduce_scatter_v(in.data(), out.data(), two, reduce_op::sum), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.all_gather_v(in.data(), 6, out.data(), counts), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.all_reduce(in.data(), in.data() + 1, 5, reduce_op::sum), mpzero::invalid_argument);
}

TEST_CASE("basic_local_communicator: its Copy moves the bytes, after the same checks", "[comm]") {
  // What cuda_local_communicator builds on (its Copy is a device-to-device
  // cudaMemcpyAsync): here a Copy that logs each call and copies host memory.
  struct logged_copy {
    std::vector<std::size_t>* bytes;
    void operator()(void* out, const void* in, std::size_t n) const {
      bytes->push_back(n);
      std::memmove(out, in, n);
    }
  };
  std::vector<std::size_t> calls;
  basic_local_communicator<logged_copy> c(logged_copy{&calls});
  static_assert(communicator<basic_local_communicator<logged_copy>>);
  std::vector<float> in{1, 2, 3, 4, 5}, out(5, 0.0f);
  const std::vector<u64> counts{3};
  c.all_reduce(in.data(), out.data(), 5, reduce_op::sum);
  c.all_reduce(in.data(), in.data(), 5, reduce_op::sum);  // in place: no copy
  c.reduce_scatter_v(in.data(), out.data(), counts, reduce_op::sum);
  c.all_gather_v(in.data(), 3, out.data(), counts);
  c.all_gather_v(out.data(), 3, out.data(), counts);  // in place: no copy
  std::vector<bf16> h(4), hout(4);
  c.all_reduce(h.data(), hout.data(), 0, reduce_op::sum);  // empty: no copy
  c.all_reduce(h.data(), hout.data(), 4, reduce_op::sum);
  CHECK(calls == std::vector<std::size_t>{20, 12, 12, 8});
  CHECK(out == in);
  // Bad arguments are refused before any copy.
  CHECK_THROWS_AS(c.all_reduce(in.data(), in.data() + 1, 3, reduce_op::sum), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.all_gather_v(in.data(), 2, out.data(), counts), mpzero::invalid_argument);
  CHECK(calls.size() == 4);
}

TEST_CASE("mpi_communicator: construction, options and rank/size", "[comm]") {
  auto c = make_comm();
  CHECK(c.rank() == world_rank());
  CHECK(c.size() == world_size());
  CHECK(c.timeout_s() == test_timeout_s);
  CHECK(c.usable());
  CHECK(c.native() != MPI_COMM_WORLD);  // a private duplicate
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(c.native(), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);

  // The deadline's environment variable is read when no option is given; a bad value
  // fails on every rank before any communication.
  ::setenv("MPZERO_COMM_TIMEOUT_S", "12.5", 1);
  {
    mpi_communicator e;
    CHECK(e.timeout_s() == 12.5);
  }
  ::setenv("MPZERO_COMM_TIMEOUT_S", "soon", 1);
  CHECK_THROWS_AS(mpi_communicator(), mpzero::invalid_argument);
  ::setenv("MPZERO_COMM_TIMEOUT_S", "2e9", 1);  // positive, but above the limit: the message says which
  CHECK_THROWS_WITH(mpi_communicator(), Catch::Contains("'2e9' is not a positive number of seconds (at most 1e9)"));
  ::unsetenv("MPZERO_COMM_TIMEOUT_S");
  {
    mpi_communicator d;
    CHECK(d.timeout_s() == default_timeout_s);
  }
  mpi_options bad;
  bad.timeout_s = -1.0;
  CHECK_THROWS_AS(mpi_communicator(MPI_COMM_WORLD, bad), mpzero::invalid_argument);
  bad.timeout_s = 1.0;
  bad.max_count_per_call = 0;
  CHECK_THROWS_AS(mpi_communicator(MPI_COMM_WORLD, bad), mpzero::invalid_argument);
  CHECK_THROWS_AS(mpi_communicator(MPI_COMM_NULL), mpzero::invalid_argument);

  // Bad arguments are rejected locally, on every rank alike, before any communication.
  const int p = c.size();
  std::vector<float> buf(64);
  std::vector<u64> wrong(static_cast<std::size_t>(p) + 1, 1);
  CHECK_THROWS_AS(c.reduce_scatter_v(buf.data(), buf.data() + 32, wrong, reduce_op::sum), mpzero::invalid_argument);
  std::vector<u64> ones(static_cast<std::size_t>(p), 2);
  CHECK_THROWS_AS(c.all_gather_v(buf.data() + 40, 3, buf.data(), ones), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.broadcast(buf.data(), 4, p), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.broadcast(buf.data(), 4, -1), mpzero::invalid_argument);
  CHECK_THROWS_AS(c.all_reduce(buf.data(), buf.data() + 2, 8, reduce_op::sum), mpzero::invalid_argument);
  // reduce_scatter_v: out overlapping in anywhere but this rank's own block.
  const u64 own_off = 2 * static_cast<u64>(c.rank());
  CHECK_THROWS_AS(c.reduce_scatter_v(buf.data(), buf.data() + own_off + 1, ones, reduce_op::sum),
                  mpzero::invalid_argument);
  CHECK(c.usable());
  c.barrier();  // still in step after the rejected calls
}

TEMPLATE_TEST_CASE("mpi all_reduce: sum and max, out of place and in place", "[comm]", float, double, bf16, fp16,
                   std::int32_t, std::uint8_t) {
  auto c = make_comm();
  for (const reduce_op op : {reduce_op::sum, reduce_op::max}) {
    for (const bool in_place : {false, true}) {
      run_all_reduce<TestType>(c, op, in_place, 1000, 11 + static_cast<u64>(op) * 2 + (in_place ? 1 : 0));
    }
  }
  run_all_reduce<TestType>(c, reduce_op::sum, false, 0, 1);  // empty: a no-op on every rank
  run_all_reduce<TestType>(c, reduce_op::sum, false, 1, 2);
}

TEST_CASE("mpi all_reduce: bf16/fp16 sums round once per combine (cancellation, ties)", "[comm]") {
  // Adversarial bf16 values: ties at every rank count, and cancellation to a tiny result.
  auto c = make_comm();
  const int p = c.size(), rank = c.rank();
  // rank r contributes 1 + r * 2^-8 (half an ulp of 1 for r = 1: a tie) and, at index 1,
  // +-(1 + 2^-7) alternating so that the exact sum is 0 or 1 + 2^-7.
  std::vector<bf16> v{bf16::from_bits(static_cast<std::uint16_t>(0x3f80 + (rank % 2))),
                      bf16::from_bits(static_cast<std::uint16_t>((rank % 2 ? 0xbf81 : 0x3f81)))};
  std::vector<bf16> out(2);
  c.all_reduce(v.data(), out.data(), 2, reduce_op::sum);
  // Exact sums: index 0: sum over r of (1 + (r%2) * 2^-7).
  long double s0 = 0, s1 = 0;
  for (int r = 0; r < p; ++r) {
    s0 += 1 + (r % 2) * std::ldexp(1.0L, -7);
    s1 += (r % 2 ? -1 : 1) * (1 + std::ldexp(1.0L, -7));
  }
  if (p <= 2) {
    CHECK(value_of(out[0]) == round_ref(s0, 7, -126));  // p = 2: 2 + 2^-7 is a tie, rounds to even 2
    CHECK(value_of(out[1]) == s1);
  } else {
    const long double u = std::ldexp(1.0L, -8);
    CHECK(std::fabs(value_of(out[0]) - s0) <= (std::pow(1 + u, p - 1) - 1) * s0);
    CHECK(std::fabs(value_of(out[1]) - s1) <= (std::pow(1 + u, p - 1) - 1) * p * (1 + std::ldexp(1.0L, -7)));
  }
  CHECK(identical_across_ranks(out));

  // max: +0 beats -0 whatever the order, and a NaN on the last rank wins everywhere.
  std::vector<fp16> m{fp16::from_bits(rank % 2 ? 0x8000 : 0x0000), fp16::from_bits(rank == p - 1 ? 0x7e00 : 0x3c00)};
  std::vector<fp16> mout(2);
  c.all_reduce(m.data(), mout.data(), 2, reduce_op::max);
  CHECK(mout[0].bits == 0x0000);
  CHECK(((mout[1].bits & 0x7c00) == 0x7c00 && (mout[1].bits & 0x03ff) != 0));  // NaN
  std::vector<bf16> z{bf16::from_bits(rank % 2 ? 0x0000 : 0x8000)};
  c.all_reduce(z.data(), z.data(), 1, reduce_op::max);
  CHECK(z[0].bits == (p == 1 ? 0x8000 : 0x0000));
}

TEST_CASE("mpi reduce_scatter_v: uneven counts with zeros, both paths, in place", "[comm]") {
  const int p = world_size();
  const std::vector<u64> counts = uneven_counts(p);
  // max_count_per_call 4: totals above 4 take the per-owner MPI_Ireduce path in chunks of 4.
  for (const u64 max_count : {static_cast<u64>(INT_MAX), u64{4}}) {
    auto c = make_comm(max_count);
    for (const bool in_place : {false, true}) {
      run_reduce_scatter<float>(c, reduce_op::sum, in_place, counts, 21);
      run_reduce_scatter<float>(c, reduce_op::max, in_place, counts, 22);
      run_reduce_scatter<bf16>(c, reduce_op::sum, in_place, counts, 23);
      run_reduce_scatter<fp16>(c, reduce_op::max, in_place, counts, 24);
      run_reduce_scatter<std::int32_t>(c, reduce_op::sum, in_place, counts, 25);
      run_reduce_scatter<double>(c, reduce_op::sum, in_place, counts, 26);
    }
    // Every count zero, and only the last rank owning anything.
    run_reduce_scatter<float>(c, reduce_op::sum, false, std::vector<u64>(static_cast<std::size_t>(p), 0), 27);
    std::vector<u64> last(static_cast<std::size_t>(p), 0);
    last.back() = 9;
    run_reduce_scatter<float>(c, reduce_op::sum, true, last, 28);
  }
}

TEST_CASE("mpi all_gather_v: uneven counts with zeros, both paths, in place", "[comm]") {
  const int p = world_size();
  const std::vector<u64> counts = uneven_counts(p);
  for (const u64 max_count : {static_cast<u64>(INT_MAX), u64{4}}) {
    auto c = make_comm(max_count);
    for (const bool in_place : {false, true}) {
      run_all_gather<float>(c, in_place, counts, 31);
      run_all_gather<bf16>(c, in_place, counts, 32);
      run_all_gather<std::uint8_t>(c, in_place, counts, 33);
      run_all_gather<double>(c, in_place, counts, 34);
    }
    run_all_gather<float>(c, false, std::vector<u64>(static_cast<std::size_t>(p), 0), 35);
  }
}

TEST_CASE("mpi broadcast: every root, chunked, and raw bytes", "[comm]") {
  const int p = world_size(), rank = world_rank();
  for (const u64 max_count : {static_cast<u64>(INT_MAX), u64{7}}) {
    auto c = make_comm(max_count);
    for (int root = 0; root < p; ++root) {
      std::vector<double> v(50);
      for (u64 i = 0; i < v.size(); ++i) v[i] = make<double>(rank, i, 40 + static_cast<u64>(root));
      c.broadcast(v.data(), v.size(), root);
      bool ok = true;
      for (u64 i = 0; i < v.size(); ++i) ok = ok && v[i] == make<double>(root, i, 40 + static_cast<u64>(root));
      INFO("root " << root << ", max_count_per_call " << max_count);
      CHECK(ok);
    }
  }
  auto c = make_comm();
  struct blob {
    char id[128];
    int ok;
  } b{};
  if (rank == p - 1) {
    for (int i = 0; i < 128; ++i) b.id[i] = static_cast<char>(i * 7 + 3);
    b.ok = 1;
  }
  c.broadcast_bytes(&b, sizeof b, p - 1);
  bool same = b.ok == 1;
  for (int i = 0; i < 128; ++i) same = same && b.id[i] == static_cast<char>(i * 7 + 3);
  CHECK(same);
  int answer = rank == 0 ? 42 : -1;
  c.broadcast_object(answer, 0);
  CHECK(answer == 42);
}

TEST_CASE("mpi non-blocking: several outstanding requests, test() and moves", "[comm]") {
  auto c = make_comm();
  const int p = c.size(), rank = c.rank();
  const std::vector<u64> counts = uneven_counts(p);
  const u64 total = std::accumulate(counts.begin(), counts.end(), u64{0});
  const u64 own_off = std::accumulate(counts.begin(), counts.begin() + rank, u64{0});
  const u64 own = counts[static_cast<std::size_t>(rank)];

  std::vector<float> grads(total), shard(own), gathered(total), sums(300);
  for (u64 i = 0; i < total; ++i) grads[i] = make<float>(rank, i, 51);
  std::vector<bf16> params(own);
  for (u64 j = 0; j < own; ++j) params[j] = make<bf16>(rank, j, 52);
  std::vector<bf16> all_params(total);
  for (u64 i = 0; i < sums.size(); ++i) sums[i] = make<float>(rank, i, 53);

  std::vector<mpi_request> pending;
  pending.push_back(c.ireduce_scatter_v(grads.data(), shard.data(), counts, reduce_op::sum));
  pending.push_back(c.iall_gather_v(params.data(), own, all_params.data(), counts));
  pending.push_back(c.iall_reduce(sums.data(), sums.data(), sums.size(), reduce_op::max));
  mpi_request b = c.ibarrier();
  // Poll the last one until it completes; the earlier ones progress meanwhile.
  while (!b.test()) {
  }
  CHECK(b.done());
  for (auto it = pending.rbegin(); it != pending.rend(); ++it) it->wait();
  for (auto& r : pending) CHECK(r.done());

  bool ok = true;
  std::string why;
  for (u64 j = 0; j < own; ++j) ok = ok && check_reduced(shard[j], reduce_op::sum, p, own_off + j, 51, why);
  CHECK(ok);
  u64 at = 0;
  bool gathered_ok = true;
  for (int r = 0; r < p; ++r)
    for (u64 j = 0; j < counts[static_cast<std::size_t>(r)]; ++j, ++at)
      gathered_ok = gathered_ok && same_bits(all_params[at], make<bf16>(r, j, 52));
  CHECK(gathered_ok);
  bool max_ok = true;
  for (u64 i = 0; i < sums.size(); ++i) max_ok = max_ok && check_reduced(sums[i], reduce_op::max, p, i, 53, why);
  CHECK(max_ok);

  // A request dropped without wait() completes in its destructor (no dangling MPI work).
  std::vector<float> x(10, 1.0f), y(10);
  { auto dropped = c.iall_reduce(x.data(), y.data(), 10, reduce_op::sum); }
  CHECK(std::all_of(y.begin(), y.end(), [&](float v) { return v == static_cast<float>(p); }));
  // Move assignment onto a pending request completes the old one first.
  mpi_request m = c.iall_reduce(x.data(), y.data(), 10, reduce_op::max);
  m = c.ibarrier();
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 1.0f; }));
  m.wait();
}

TEST_CASE("mpi large counts: 3e6 elements, whole and split into MPI calls", "[comm]") {
  const u64 n = 3000000;
  const int p = world_size(), rank = world_rank();
  // Chunks of 2^20 force three MPI calls for the all_reduce and the per-owner path for
  // the scatter/gather.
  for (const u64 max_count : {static_cast<u64>(INT_MAX), u64{1} << 20}) {
    auto c = make_comm(max_count);
    std::vector<float> v(n);
    for (u64 i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<u64>(rank) * 13) % 4096) - 2048);
    c.all_reduce(v.data(), v.data(), n, reduce_op::sum);
    u64 bad = 0;
    for (u64 i = 0; i < n; ++i) {
      long double s = 0;
      for (int r = 0; r < p; ++r) s += static_cast<int>((i * 7 + static_cast<u64>(r) * 13) % 4096) - 2048;
      bad += v[i] != s;
    }
    CHECK(bad == 0);

    // Uneven split of n over the ranks (rank 1 owns nothing).
    std::vector<u64> counts(static_cast<std::size_t>(p));
    u64 left = n;
    for (int r = 0; r < p; ++r) {
      counts[static_cast<std::size_t>(r)] = r == p - 1 ? left : (r == 1 ? 0 : n / static_cast<u64>(p) + 1000);
      left -= counts[static_cast<std::size_t>(r)];
    }
    const u64 own_off = std::accumulate(counts.begin(), counts.begin() + rank, u64{0});
    const u64 own = counts[static_cast<std::size_t>(rank)];
    std::vector<float> g(n);
    for (u64 i = 0; i < n; ++i) g[i] = static_cast<float>((i + static_cast<u64>(rank)) % 1000);
    c.reduce_scatter_v(g.data(), g.data() + own_off, counts, reduce_op::sum);  // in place
    bad = 0;
    for (u64 j = 0; j < own; ++j) {
      long double s = 0;
      for (int r = 0; r < p; ++r) s += static_cast<long double>((own_off + j + static_cast<u64>(r)) % 1000);
      bad += g[own_off + j] != s;
    }
    CHECK(bad == 0);
    c.all_gather_v(g.data() + own_off, own, g.data(), counts);  // in place
    bad = 0;
    for (u64 i = 0; i < n; ++i) {
      long double s = 0;
      for (int r = 0; r < p; ++r) s += static_cast<long double>((i + static_cast<u64>(r)) % 1000);
      bad += g[i] != s;
    }
    INFO("max_count_per_call " << max_count);
    CHECK(bad == 0);
  }
}

TEST_CASE("mpi deadline: a request that never completes throws comm_error, not a hang", "[comm]") {
  // A receive that no one will match, adopted under a 0.2 s deadline. Cancelling it
  // afterwards leaves MPI clean (receives, unlike collectives, can be cancelled).
  mpi_options opt;
  opt.timeout_s = 0.2;
  mpi_communicator c(MPI_COMM_WORLD, opt);
  int sink = 0;
  MPI_Request raw = MPI_REQUEST_NULL;
  MPI_Irecv(&sink, 1, MPI_INT, c.rank(), /*tag=*/4242, c.native(), &raw);
  mpi_request r = c.adopt(raw, "test receive");
  int sink2 = 0;  // a second one, pending when the first times out
  MPI_Request raw2 = MPI_REQUEST_NULL;
  MPI_Irecv(&sink2, 1, MPI_INT, c.rank(), /*tag=*/4243, c.native(), &raw2);
  mpi_request r2 = c.adopt(raw2, "second receive");
  const auto start = std::chrono::steady_clock::now();
  std::string msg;
  try {
    r.wait();
  } catch (const comm_error& e) {
    msg = e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO(msg);
  CHECK(msg.find("test receive timed out on rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size())) !=
        std::string::npos);
  CHECK(msg.find("MPZERO_COMM_TIMEOUT_S") != std::string::npos);
  CHECK(waited >= 0.2);
  CHECK_FALSE(c.usable());
  CHECK_THROWS_AS(c.barrier(), comm_error);  // refused locally: nothing is posted
  // Polling another request of the broken communicator says so, instead of reporting
  // whatever MPI says of a call its peers may never match.
  CHECK_THROWS_WITH(r2.test(), Catch::Contains("second receive") && Catch::Contains("unusable"));
  CHECK_FALSE(r.done());
  for (mpi_request* q : {&r, &r2}) {
    MPI_Cancel(&q->native_handles()[0]);
    MPI_Status status;
    MPI_Wait(&q->native_handles()[0], &status);
    int cancelled = 0;
    MPI_Test_cancelled(&status, &cancelled);
    CHECK(cancelled == 1);
  }
}

TEST_CASE("mpi deadline: a collective whose peers come late times out on rank 0", "[comm]") {
  const int p = world_size(), rank = world_rank();
  if (p < 2) return;  // needs a peer
  // Rank 0 waits 0.3 s for peers that post only after being told it has given up; then
  // rank 0 completes the abandoned request by hand, so MPI ends in a clean state.
  MPI_Comm signal;
  MPI_Comm_dup(MPI_COMM_WORLD, &signal);
  mpi_options opt;
  opt.timeout_s = rank == 0 ? 0.3 : test_timeout_s;
  {
    mpi_communicator c(MPI_COMM_WORLD, opt);
    std::vector<float> v(100);
    for (u64 i = 0; i < v.size(); ++i) v[i] = make<float>(rank, i, 61);
    if (rank == 0) {
      mpi_request r = c.iall_reduce(v.data(), v.data(), v.size(), reduce_op::sum);
      std::string msg;
      try {
        r.wait();
      } catch (const comm_error& e) {
        msg = e.what();
      }
      INFO(msg);
      CHECK(msg.find("MPI all_reduce<float, sum> timed out on rank 0 of " + std::to_string(p) + " after waiting") !=
            std::string::npos);
      CHECK_FALSE(c.usable());
      CHECK_THROWS_AS(c.iall_reduce(v.data(), v.data(), v.size(), reduce_op::sum), comm_error);
      int go = 1;
      for (int peer = 1; peer < p; ++peer) MPI_Send(&go, 1, MPI_INT, peer, 0, signal);
      auto h = r.native_handles();
      MPI_Waitall(static_cast<int>(h.size()), h.data(), MPI_STATUSES_IGNORE);
    } else {
      int go = 0;
      MPI_Recv(&go, 1, MPI_INT, 0, 0, signal, MPI_STATUS_IGNORE);
      c.all_reduce(v.data(), v.data(), v.size(), reduce_op::sum);
      CHECK(c.usable());
    }
    bool ok = true;
    std::string why;
    for (u64 i = 0; i < v.size(); ++i) ok = ok && check_reduced(v[i], reduce_op::sum, p, i, 61, why);
    CHECK(ok);
  }
  MPI_Comm_free(&signal);
  MPI_Barrier(MPI_COMM_WORLD);
}

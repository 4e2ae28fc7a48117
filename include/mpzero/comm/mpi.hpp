// mpzero: the MPI communicator (host buffers). Needs <mpi.h> and linking MPI::MPI_CXX.
//
// - It works on a duplicate of the communicator it is given (default MPI_COMM_WORLD),
//   so its traffic never matches the caller's own messages, and MPI errors on it are
//   returned and rethrown as comm_error instead of aborting. Constructing it is
//   therefore collective over that communicator. It does not call MPI_Init or
//   MPI_Finalize: the program owns MPI's lifetime.
// - Every call is posted non-blocking and waited on by polling MPI_Test against a
//   deadline (mpi_options::timeout_s, else MPZERO_COMM_TIMEOUT_S, else 300 s). A wait that
//   outlasts it throws comm_error naming the operation, the rank and the time waited,
//   and leaves the communicator unusable (a collective cannot be cancelled): abort the
//   job. Nothing here blocks without a deadline.
// - bf16 and fp16 reduce with user-defined MPI ops: each pairwise combine converts both
//   operands to float, adds (or takes the max) in fp32 and rounds to nearest-even once,
//   so P ranks cost at most P-1 roundings per element (MPI gives no way to keep an fp32
//   accumulator across the reduction tree without sending fp32). max propagates NaN.
//   uint8 sums use a user-defined op too, wrapping mod 256 like NCCL: Open MPI 4.1's
//   AVX reduction saturates small-integer sums instead (open-mpi/ompi#8045).
//   float/double/int32 sums and every other max use MPI_SUM/MPI_MAX; int32 overflow is
//   not specified (do not rely on it).
// - 64-bit counts: MPI counts are int. Calls are split into pieces of at most
//   mpi_options::max_count_per_call elements (default INT_MAX): all_reduce and broadcast
//   chunk the buffer; reduce_scatter_v and all_gather_v whose total exceeds the limit
//   (their displacements are int too) become one MPI_Ireduce / MPI_Ibcast per owner and
//   chunk. Nothing is rejected for size.
// - Calls must come from the thread MPI was initialised for (MPI_THREAD_FUNNELED: the
//   main thread). A communicator is not safe to use from two threads at once.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../numeric/convert.hpp"
#include "communicator.hpp"

namespace mpzero::comm {

struct mpi_options {
  // Deadline of every wait, in seconds. Unset: MPZERO_COMM_TIMEOUT_S, else 300.
  std::optional<double> timeout_s;
  // Most elements handed to one MPI call; larger calls are split. Lower it only to
  // exercise the split path (tests) or to work around an MPI with 2 GiB message limits.
  std::uint64_t max_count_per_call = static_cast<std::uint64_t>(INT_MAX);
};

namespace detail {

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

inline bool mpi_finalized() noexcept {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// The user-defined reduction for 16-bit floats: inout[i] = in[i] op inout[i], in fp32,
// rounded to nearest-even. Written to be commutative bit for bit (max of +0 and -0 is
// +0 either way; NaN wins), so every rank of a tree or ring gets the same bits.
template <class T, reduce_op Op>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) {
    const float x = to_float(a[i]);
    const float y = to_float(b[i]);
    if constexpr (Op == reduce_op::sum) {
      b[i] = from_float<T>(x + y);
    } else {
      if (x != x || y != y) {
        b[i] = T::from_bits(0x7fffu);
      } else if (x > y) {
        b[i] = a[i];
      } else if (x == y) {
        b[i] = T::from_bits(static_cast<std::uint16_t>(a[i].bits & b[i].bits));  // +0 beats -0
      }
    }
  }
}

// uint8 sum modulo 256, whatever the MPI's own SIMD code would do.
inline void wrapping_u8_sum(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const std::uint8_t*>(in);
  auto* b = static_cast<std::uint8_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<std::uint8_t>(a[i] + b[i]);
}

template <wire_type T>
MPI_Datatype mpi_datatype() noexcept {
  if constexpr (std::same_as<T, float>) return MPI_FLOAT;
  else if constexpr (std::same_as<T, double>) return MPI_DOUBLE;
  else if constexpr (std::same_as<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::same_as<T, std::uint8_t>) return MPI_UINT8_T;
  else return MPI_UINT16_T;  // bf16, fp16: only ever reduced with our own ops
}

// Shared by a communicator and its outstanding requests, so that either may go first.
struct mpi_state {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  double timeout_s = default_timeout_s;
  std::uint64_t max_count = static_cast<std::uint64_t>(INT_MAX);
  MPI_Op half_ops[2][2] = {{MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL}};  // [bf16, fp16][sum, max]
  MPI_Op u8_sum = MPI_OP_NULL;
  std::string broken;  // why the communicator is unusable; empty while it is fine

  mpi_state() = default;
  mpi_state(const mpi_state&) = delete;
  mpi_state& operator=(const mpi_state&) = delete;
  ~mpi_state() {
    if (mpi_finalized()) return;  // MPI already released everything
    for (auto& row : half_ops)
      for (MPI_Op& op : row)
        if (op != MPI_OP_NULL) MPI_Op_free(&op);
    if (u8_sum != MPI_OP_NULL) MPI_Op_free(&u8_sum);
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }

  std::string where() const { return "rank " + std::to_string(rank) + " of " + std::to_string(size); }

  void check(int rc, const char* call, std::string_view op) {
    if (rc == MPI_SUCCESS) return;
    std::string msg = "mpzero: " + std::string(call) + " failed in " + std::string(op) + " on " + where() + ": " +
                      mpi_error_text(rc);
    if (broken.empty()) broken = msg;
    throw comm_error(msg + "; the communicator is unusable now, abort the job");
  }

  void check_usable(std::string_view op) const {
    if (!broken.empty()) {
      throw comm_error("mpzero: MPI " + std::string(op) + " on " + where() +
                       " refused: the communicator failed earlier and is unusable; abort the job. Earlier failure: " +
                       broken);
    }
  }
};

}  // namespace detail

// One posted operation (possibly several MPI requests, for split calls). Move-only.
// wait() returns once it completed on this rank; it throws comm_error at the deadline.
// Destroying a pending request waits for it (within the deadline; a timeout there is
// recorded on the communicator instead of thrown).
class mpi_request {
 public:
  mpi_request() = default;
  mpi_request(const mpi_request&) = delete;
  mpi_request& operator=(const mpi_request&) = delete;
  mpi_request(mpi_request&& o) noexcept { take(o); }
  mpi_request& operator=(mpi_request&& o) noexcept {
    if (this != &o) {
      abandon();
      take(o);
    }
    return *this;
  }
  ~mpi_request() { abandon(); }

  // Polls once; true (and the results are in place) when complete.
  bool test() {
    if (reqs_.empty()) return true;
    st_->check_usable(what_);  // after a timeout elsewhere, "complete" would not mean the results are there
    int flag = 0;
    st_->check(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall",
               what_);
    if (!flag) return false;
    complete();
    return true;
  }

  void wait() {
    if (reqs_.empty()) return;
    st_->check_usable(what_);
    const auto start = detail::clock::now();
    const auto deadline = start + std::chrono::duration_cast<detail::clock::duration>(
                                      std::chrono::duration<double>(st_->timeout_s));
    detail::backoff backoff;
    while (!test()) {
      if (detail::clock::now() >= deadline) {
        std::string msg = "mpzero: MPI " + what_ + " timed out on " + st_->where() + " after waiting " +
                          detail::format_seconds(detail::seconds_since(start)) + " (posted " +
                          detail::format_seconds(detail::seconds_since(posted_)) + " ago; timeout " +
                          detail::format_seconds(st_->timeout_s) +
                          "): a peer rank has stopped or has not reached the matching call. If the peers are "
                          "only slow, raise MPZERO_COMM_TIMEOUT_S or mpi_options::timeout_s; otherwise abort the "
                          "job (MPI_Abort): this communicator is unusable now";
        if (st_->broken.empty()) st_->broken = msg;
        throw comm_error(msg);
      }
      backoff.pause();
    }
  }

  bool done() const noexcept { return reqs_.empty(); }
  const std::string& what() const noexcept { return what_; }
  // The underlying MPI requests (MPI_REQUEST_NULL once complete). For recovery code
  // that knows better than the deadline, e.g. tests that complete a timed-out call.
  std::span<MPI_Request> native_handles() noexcept { return reqs_; }

 private:
  friend class mpi_communicator;

  void take(mpi_request& o) noexcept {
    st_ = std::move(o.st_);
    reqs_ = std::move(o.reqs_);
    ints_ = std::move(o.ints_);
    finish_ = std::move(o.finish_);
    what_ = std::move(o.what_);
    posted_ = o.posted_;
    o.reqs_.clear();
  }

  void complete() {
    reqs_.clear();
    ints_.clear();
    if (finish_) {
      auto f = std::move(finish_);
      finish_ = nullptr;
      f();
    }
  }

  // Requests that cannot complete any more (broken communicator, MPI finalised) are
  // leaked: MPI forbids freeing an active collective request.
  void abandon() noexcept {
    if (reqs_.empty() || !st_) return;
    if (!detail::mpi_finalized() && st_->broken.empty()) {
      try {
        wait();
      } catch (...) {  // recorded in st_->broken by wait()
      }
    }
    reqs_.clear();
    finish_ = nullptr;
  }

  std::shared_ptr<detail::mpi_state> st_;
  std::vector<MPI_Request> reqs_;
  std::vector<int> ints_;          // counts and displacements MPI reads until completion
  std::function<void()> finish_;   // runs once on completion (in-place reduce_scatter_v's move)
  std::string what_;
  detail::clock::time_point posted_{};
};

class mpi_communicator : public blocking_collectives<mpi_communicator> {
 public:
  using request_type = mpi_request;

  // Collective over `comm`: duplicates it. MPI must be initialised.
  explicit mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD, const mpi_options& opt = {}) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized || detail::mpi_finalized()) {
      throw comm_error(
          "mpzero: mpi_communicator needs MPI to be running: call MPI_Init or MPI_Init_thread first (and "
          "MPI_Finalize only after destroying the communicator); mpi_communicator does not own MPI");
    }
    if (comm == MPI_COMM_NULL) {
      throw mpzero::invalid_argument("mpzero: mpi_communicator got MPI_COMM_NULL; pass a valid communicator");
    }
    if (opt.max_count_per_call == 0 || opt.max_count_per_call > static_cast<std::uint64_t>(INT_MAX)) {
      throw mpzero::invalid_argument("mpzero: mpi_options::max_count_per_call = " +
                                     std::to_string(opt.max_count_per_call) +
                                     " is outside [1, INT_MAX]; MPI counts are int");
    }
    // Decided before any communication, so a bad setting fails on every rank alike.
    const double timeout = opt.timeout_s ? detail::checked_timeout(*opt.timeout_s) : detail::timeout_from_env();

    auto st = std::make_shared<detail::mpi_state>();
    st->timeout_s = timeout;
    st->max_count = opt.max_count_per_call;
    MPI_Comm_rank(comm, &st->rank);
    MPI_Comm_size(comm, &st->size);
    // Non-blocking duplicate, so that even construction has a deadline. MPI writes the
    // handle on completion, so on a timeout its target is leaked rather than freed.
    {
      auto* dup = new MPI_Comm(MPI_COMM_NULL);
      mpi_request r = make_request(st, "communicator construction (MPI_Comm_idup)");
      MPI_Request q = MPI_REQUEST_NULL;
      const int rc = MPI_Comm_idup(comm, dup, &q);
      if (rc != MPI_SUCCESS) {
        delete dup;
        st->check(rc, "MPI_Comm_idup", "communicator construction");
      }
      r.reqs_.push_back(q);
      r.wait();  // throws at the deadline, leaking dup
      st->comm = *dup;
      delete dup;
    }
    st->check(MPI_Comm_set_errhandler(st->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", "construction");
    using detail::half_reduce;
    const std::pair<MPI_User_function*, MPI_Op*> ops[] = {
        {&half_reduce<bf16, reduce_op::sum>, &st->half_ops[0][0]},
        {&half_reduce<bf16, reduce_op::max>, &st->half_ops[0][1]},
        {&half_reduce<fp16, reduce_op::sum>, &st->half_ops[1][0]},
        {&half_reduce<fp16, reduce_op::max>, &st->half_ops[1][1]},
        {&detail::wrapping_u8_sum, &st->u8_sum},
    };
    for (const auto& [fn, op] : ops) st->check(MPI_Op_create(fn, /*commute=*/1, op), "MPI_Op_create", "construction");
    st_ = std::move(st);
  }

  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  mpi_communicator(mpi_communicator&&) noexcept = default;
  mpi_communicator& operator=(mpi_communicator&&) noexcept = default;

  int rank() const noexcept { return st_->rank; }
  int size() const noexcept { return st_->size; }
  // The private duplicate this communicator talks on.
  MPI_Comm native() const noexcept { return st_->comm; }
  double timeout_s() const noexcept { return st_->timeout_s; }
  std::uint64_t max_count_per_call() const noexcept { return st_->max_count; }
  // False after a failure (timeout or MPI error); then every call throws comm_error.
  bool usable() const noexcept { return st_->broken.empty(); }

  // ---- non-blocking -------------------------------------------------------------
  template <wire_type T>
  mpi_request iall_reduce(const T* in, T* out, std::uint64_t n, reduce_op op) {
    const std::string what = op_name<T>("all_reduce", op);
    st_->check_usable(what);
    detail::check_same_or_disjoint(in, n, out, n, true, what, "pass in == out or disjoint buffers");
    mpi_request r = make_request(st_, what);
    const bool in_place = static_cast<const void*>(in) == static_cast<const void*>(out);
    for_chunks(n, [&](std::uint64_t off, int c) {
      post(r, "MPI_Iallreduce", [&](MPI_Request* q) {
        return MPI_Iallreduce(in_place ? MPI_IN_PLACE : in + off, out + off, c, detail::mpi_datatype<T>(),
                              mpi_op<T>(op), st_->comm, q);
      });
    });
    return r;
  }

  template <wire_type T>
  mpi_request ireduce_scatter_v(const T* in, T* out, std::span<const std::uint64_t> counts, reduce_op op) {
    const std::string what = op_name<T>("reduce_scatter_v", op);
    st_->check_usable(what);
    const std::uint64_t total = detail::checked_total(counts, size(), what);
    const std::uint64_t own_off = detail::offset_of(counts, rank());
    const std::uint64_t own = counts[static_cast<std::size_t>(rank())];
    const bool in_place = static_cast<const void*>(in + own_off) == static_cast<const void*>(out);
    if (!in_place) {
      detail::check_same_or_disjoint(in, total, out, own, false, what,
                                     "out may only be in's own block (in + offset of this rank) or disjoint from in");
    }
    mpi_request r = make_request(st_, what);
    if (total == 0) return r;
    const MPI_Datatype type = detail::mpi_datatype<T>();
    if (total <= st_->max_count) {
      r.ints_.assign(counts.begin(), counts.end());  // each <= total <= INT_MAX
      if (in_place) {
        // MPI's in-place form reads the whole input from recvbuf and leaves the result at
        // its start; move it to our block afterwards (the other blocks are scratch).
        T* base = const_cast<T*>(in);
        post(r, "MPI_Ireduce_scatter", [&](MPI_Request* q) {
          return MPI_Ireduce_scatter(MPI_IN_PLACE, base, r.ints_.data(), type, mpi_op<T>(op), st_->comm, q);
        });
        if (own_off != 0 && own != 0) {
          r.finish_ = [base, out, own] { std::memmove(out, base, own * sizeof(T)); };
        }
      } else {
        post(r, "MPI_Ireduce_scatter", [&](MPI_Request* q) {
          return MPI_Ireduce_scatter(in, out, r.ints_.data(), type, mpi_op<T>(op), st_->comm, q);
        });
      }
      return r;
    }
    // Too large for int displacements: one reduction to each owner, chunked.
    std::uint64_t block = 0;
    for (int owner = 0; owner < size(); ++owner) {
      const std::uint64_t count = counts[static_cast<std::size_t>(owner)];
      for_chunks(count, [&](std::uint64_t off, int c) {
        post(r, "MPI_Ireduce", [&](MPI_Request* q) {
          if (owner != rank()) {
            return MPI_Ireduce(in + block + off, nullptr, c, type, mpi_op<T>(op), owner, st_->comm, q);
          }
          return MPI_Ireduce(in_place ? MPI_IN_PLACE : in + block + off, out + off, c, type, mpi_op<T>(op), owner,
                             st_->comm, q);
        });
      });
      block += count;
    }
    return r;
  }

  template <wire_type T>
  mpi_request iall_gather_v(const T* in, std::uint64_t n_in, T* out, std::span<const std::uint64_t> counts) {
    const std::string what = "all_gather_v<" + std::string(wire_name<T>()) + ">";
    st_->check_usable(what);
    const std::uint64_t total = detail::checked_total(counts, size(), what);
    detail::check_count_match(n_in, counts, rank(), what);
    const std::uint64_t own_off = detail::offset_of(counts, rank());
    const bool in_place = static_cast<const void*>(in) == static_cast<const void*>(out + own_off);
    if (!in_place) {
      detail::check_same_or_disjoint(in, n_in, out, total, false, what,
                                     "in may only be out's own block (out + offset of this rank) or disjoint");
    }
    mpi_request r = make_request(st_, what);
    if (total == 0) return r;
    const MPI_Datatype type = detail::mpi_datatype<T>();
    if (total <= st_->max_count) {
      const auto p = static_cast<std::size_t>(size());
      r.ints_.resize(2 * p);
      std::uint64_t off = 0;
      for (std::size_t i = 0; i < p; ++i) {
        r.ints_[i] = static_cast<int>(counts[i]);
        r.ints_[p + i] = static_cast<int>(off);
        off += counts[i];
      }
      post(r, "MPI_Iallgatherv", [&](MPI_Request* q) {
        return MPI_Iallgatherv(in_place ? MPI_IN_PLACE : in, static_cast<int>(n_in), type, out, r.ints_.data(),
                               r.ints_.data() + p, type, st_->comm, q);
      });
      return r;
    }
    // Too large for int displacements: each owner broadcasts its block, chunked.
    if (!in_place && n_in != 0) std::memcpy(out + own_off, in, n_in * sizeof(T));
    std::uint64_t block = 0;
    for (int owner = 0; owner < size(); ++owner) {
      const std::uint64_t count = counts[static_cast<std::size_t>(owner)];
      for_chunks(count, [&](std::uint64_t off, int c) {
        post(r, "MPI_Ibcast",
             [&](MPI_Request* q) { return MPI_Ibcast(out + block + off, c, type, owner, st_->comm, q); });
      });
      block += count;
    }
    return r;
  }

  template <wire_type T>
  mpi_request ibroadcast(T* data, std::uint64_t n, int root) {
    const std::string what = "broadcast<" + std::string(wire_name<T>()) + ">";
    st_->check_usable(what);
    detail::check_root(root, size(), what);
    mpi_request r = make_request(st_, what);
    for_chunks(n, [&](std::uint64_t off, int c) {
      post(r, "MPI_Ibcast",
           [&](MPI_Request* q) { return MPI_Ibcast(data + off, c, detail::mpi_datatype<T>(), root, st_->comm, q); });
    });
    return r;
  }

  mpi_request ibarrier() {
    st_->check_usable("barrier");
    mpi_request r = make_request(st_, "barrier");
    post(r, "MPI_Ibarrier", [&](MPI_Request* q) { return MPI_Ibarrier(st_->comm, q); });
    return r;
  }

  // Waits on a request the caller posted itself (say, point-to-point on native())
  // under this communicator's deadline and error reporting.
  mpi_request adopt(MPI_Request request, std::string what) {
    mpi_request r = make_request(st_, std::move(what));
    if (request != MPI_REQUEST_NULL) r.reqs_.push_back(request);
    return r;
  }

  // ---- blocking: post and wait ---------------------------------------------------
  // all_reduce, reduce_scatter_v, all_gather_v and broadcast come from blocking_collectives.
  void barrier() { ibarrier().wait(); }

  // Raw bytes from root to every rank: ships an ncclUniqueId, a config blob, ...
  void broadcast_bytes(void* data, std::size_t bytes, int root) {
    broadcast(static_cast<std::uint8_t*>(data), static_cast<std::uint64_t>(bytes), root);
  }
  // A trivially copyable object from root to every rank.
  template <class T>
    requires std::is_trivially_copyable_v<T>
  void broadcast_object(T& object, int root) {
    broadcast_bytes(&object, sizeof(T), root);
  }

 private:
  static mpi_request make_request(const std::shared_ptr<detail::mpi_state>& st, std::string what) {
    mpi_request r;
    r.st_ = st;
    r.what_ = std::move(what);
    r.posted_ = detail::clock::now();
    return r;
  }

  template <class T>
  static std::string op_name(const char* base, reduce_op op) {
    return std::string(base) + "<" + std::string(wire_name<T>()) + ", " + std::string(name_of(op)) + ">";
  }

  template <wire_type T>
  MPI_Op mpi_op(reduce_op op) const noexcept {
    const int o = op == reduce_op::sum ? 0 : 1;
    if constexpr (std::same_as<T, bf16>) return st_->half_ops[0][o];
    else if constexpr (std::same_as<T, fp16>) return st_->half_ops[1][o];
    else if constexpr (std::same_as<T, std::uint8_t>) return op == reduce_op::sum ? st_->u8_sum : MPI_MAX;
    else return op == reduce_op::sum ? MPI_SUM : MPI_MAX;
  }

  // Calls body(offset, count) for consecutive pieces of n of at most max_count elements.
  template <class Body>
  void for_chunks(std::uint64_t n, Body&& body) const {
    for (std::uint64_t off = 0; off < n; off += st_->max_count) {
      body(off, static_cast<int>(std::min(st_->max_count, n - off)));
    }
  }

  // Posts one MPI call into r; on failure r keeps what was posted (it is then leaked
  // with the broken communicator).
  template <class Post>
  void post(mpi_request& r, const char* call, Post&& p) {
    MPI_Request q = MPI_REQUEST_NULL;
    const int rc = p(&q);
    st_->check(rc, call, r.what_);
    r.reqs_.push_back(q);
  }

  std::shared_ptr<detail::mpi_state> st_;
};

static_assert(communicator<mpi_communicator>);

}  // namespace mpzero::comm

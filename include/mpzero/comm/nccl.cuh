// mpzero: the NCCL communicator (device buffers). Compile with nvcc, or with the CUDA
// include path, and link CUDA::cudart and libnccl.
//
// - Non-blocking NCCL communicator (ncclConfig_t::blocking = 0) with its own CUDA
//   stream. Every call enqueues on that stream and returns a request holding an event
//   recorded after the operation. Nothing waits without a deadline: enqueueing and
//   waiting poll ncclCommGetAsyncError and cudaEventQuery until the timeout
//   (nccl_options::timeout_s, else MPZERO_COMM_TIMEOUT_S, else 300 s), after which the
//   communicator is aborted (ncclCommAbort) and comm_error is thrown; it is unusable
//   afterwards, and the job should end.
// - Data produced on another stream must be ordered first: wait_for(producer) makes the
//   communicator's stream wait for the work already queued on `producer`; a consumer
//   stream can wait on a request without blocking the host via request.enqueue_wait().
//   The blocking calls (all_reduce, ...) enqueue and then wait on the host.
// - reduce_scatter_v is ncclReduceScatter when all counts are equal, else one ncclReduce
//   to each owner in a group; all_gather_v is ncclAllGather when counts are equal, else
//   one ncclBroadcast from each owner in a group. bf16/fp16 sums are NCCL's own (each
//   reduction step works in fp32 and rounds back to the wire type).
// - barrier() is an all_reduce of one int on the device, waited on the host.
// - Creation: from any bootstrap communicator with rank(), size() and
//   broadcast_bytes(void*, size_t, int root) (mpi_communicator, local_communicator), rank 0
//   making the ncclUniqueId; or standalone at world size 1. The communicator uses the
//   device current at construction (or nccl_options::device) and switches to it for
//   every call.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "../cuda/check.cuh"
#include "communicator.hpp"

namespace mpzero::comm {

struct nccl_options {
  // Deadline of every wait, in seconds. Unset: MPZERO_COMM_TIMEOUT_S, else 300.
  std::optional<double> timeout_s;
  // Deadline of construction (every rank arriving, NCCL's topology and buffer setup,
  // which takes seconds at scale), so that a short timeout_s for collectives does not
  // fail the start. Unset: the same as timeout_s.
  std::optional<double> init_timeout_s;
  // CUDA device of this rank; -1: the current device.
  int device = -1;
};

// A communicator that can ship the ncclUniqueId.
template <class B>
concept nccl_bootstrap = requires(B& b, void* p, std::size_t n) {
  { b.rank() } -> std::convertible_to<int>;
  { b.size() } -> std::convertible_to<int>;
  b.broadcast_bytes(p, n, 0);
};

namespace detail {

template <wire_type T>
constexpr ncclDataType_t nccl_datatype() noexcept {
  if constexpr (std::same_as<T, float>) return ncclFloat32;
  else if constexpr (std::same_as<T, double>) return ncclFloat64;
  else if constexpr (std::same_as<T, bf16>) return ncclBfloat16;
  else if constexpr (std::same_as<T, fp16>) return ncclFloat16;
  else if constexpr (std::same_as<T, std::int32_t>) return ncclInt32;
  else return ncclUint8;
}

constexpr ncclRedOp_t nccl_op(reduce_op op) noexcept { return op == reduce_op::sum ? ncclSum : ncclMax; }

// Makes `device` current for a scope and restores the previous one.
class device_guard {
 public:
  explicit device_guard(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) {
      const cudaError_t e = cudaSetDevice(device_);
      if (e != cudaSuccess) {
        throw comm_error("mpzero: cudaSetDevice(" + std::to_string(device_) + ") failed for the NCCL communicator: " +
                         cudaGetErrorString(e));
      }
    }
  }
  ~device_guard() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

struct nccl_state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t producer_event = nullptr;  // wait_for's dependency
  int* scratch = nullptr;                // barrier's one int
  int rank = 0;
  int size = 1;
  int device = 0;
  double timeout_s = default_timeout_s;
  // What sets timeout_s, for the timeout message: what to raise.
  std::string timeout_setting = "MPZERO_COMM_TIMEOUT_S or nccl_options::timeout_s";
  std::string broken;  // why the communicator is unusable; empty while it is fine

  nccl_state() = default;
  nccl_state(const nccl_state&) = delete;
  nccl_state& operator=(const nccl_state&) = delete;

  ~nccl_state() {
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (comm != nullptr) {
      bool destroyed = false;  // the handle is gone after ncclCommDestroy, whatever it returns
      if (broken.empty()) {
        // Finalize flushes outstanding work; bounded by the deadline like everything else.
        ncclResult_t rc = ncclCommFinalize(comm);
        if (rc == ncclSuccess || rc == ncclInProgress) {
          const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                                   std::chrono::duration<double>(timeout_s));
          backoff b;
          ncclResult_t state = ncclInProgress;
          while (ncclCommGetAsyncError(comm, &state) == ncclSuccess && state == ncclInProgress &&
                 clock::now() < deadline) {
            b.pause();
          }
          if (state == ncclSuccess) {
            ncclCommDestroy(comm);
            destroyed = true;
          }
        }
      }
      if (!destroyed) ncclCommAbort(comm);
      comm = nullptr;
    }
    if (scratch != nullptr) cudaFree(scratch);
    if (producer_event != nullptr) cudaEventDestroy(producer_event);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (previous >= 0) cudaSetDevice(previous);
  }

  std::string where() const {
    return "rank " + std::to_string(rank) + " of " + std::to_string(size) + " (device " + std::to_string(device) + ")";
  }

  // Records the failure, aborts the NCCL communicator (so no kernel of it waits forever
  // for a peer) and throws.
  [[noreturn]] void fail(const std::string& msg) {
    if (broken.empty()) broken = msg;
    if (comm != nullptr) {
      ncclCommAbort(comm);
      comm = nullptr;
    }
    throw comm_error(msg + "; the NCCL communicator was aborted and is unusable now, end the job");
  }

  void check_usable(std::string_view op) const {
    if (!broken.empty()) {
      throw comm_error("mpzero: NCCL " + std::string(op) + " on " + where() +
                       " refused: the communicator failed earlier and is unusable; end the job. Earlier failure: " +
                       broken);
    }
  }

  void check_nccl(ncclResult_t rc, const char* call, std::string_view op) {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
    fail("mpzero: " + std::string(call) + " failed in NCCL " + std::string(op) + " on " + where() + ": " +
         ncclGetErrorString(rc) + (last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string()));
  }

  void check_cuda(cudaError_t e, const char* call, std::string_view op) {
    if (e == cudaSuccess) return;
    fail("mpzero: " + std::string(call) + " failed in NCCL " + std::string(op) + " on " + where() + ": " +
         cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }

  clock::time_point deadline_from_now() const {
    return clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  }

  [[noreturn]] void fail_timeout(std::string_view op, clock::time_point start, clock::time_point posted) {
    fail("mpzero: NCCL " + std::string(op) + " timed out on " + where() + " after waiting " +
         format_seconds(seconds_since(start)) + " (posted " + format_seconds(seconds_since(posted)) +
         " ago; timeout " + format_seconds(timeout_s) +
         "): a peer rank has stopped or has not reached the matching call, or the work it depends on never "
         "finished. If the peers are only slow, raise " + timeout_setting);
  }

  // Non-blocking NCCL returns ncclInProgress until a call's work is enqueued (or the
  // communicator is built); nothing else may touch the communicator until then.
  void wait_ready(std::string_view op) {
    const auto start = clock::now();
    const auto deadline = deadline_from_now();
    backoff b;
    for (;;) {
      ncclResult_t state = ncclInProgress;
      check_nccl(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError", op);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) check_nccl(state, "asynchronous NCCL work", op);
      if (clock::now() >= deadline) fail_timeout(op, start, start);
      b.pause();
    }
  }
};

}  // namespace detail

// One enqueued operation: an event recorded after it on the communicator's stream.
// Dropping a request does not wait (the stream keeps its order); buffers must stay
// alive until the work is done.
class nccl_request {
 public:
  nccl_request() = default;
  nccl_request(const nccl_request&) = delete;
  nccl_request& operator=(const nccl_request&) = delete;
  nccl_request(nccl_request&& o) noexcept
      : st_(std::move(o.st_)), event_(std::exchange(o.event_, nullptr)), what_(std::move(o.what_)), posted_(o.posted_) {}
  nccl_request& operator=(nccl_request&& o) noexcept {
    if (this != &o) {
      release();
      st_ = std::move(o.st_);
      event_ = std::exchange(o.event_, nullptr);
      what_ = std::move(o.what_);
      posted_ = o.posted_;
    }
    return *this;
  }
  ~nccl_request() { release(); }

  // True when the operation finished on the device. Throws on an NCCL error.
  bool test() {
    if (event_ == nullptr) return true;
    st_->check_usable(what_);  // an abort elsewhere lets the event fire on incomplete results
    detail::device_guard g(st_->device);
    if (st_->comm != nullptr) {
      ncclResult_t state = ncclSuccess;
      st_->check_nccl(ncclCommGetAsyncError(st_->comm, &state), "ncclCommGetAsyncError", what_);
      if (state != ncclSuccess && state != ncclInProgress) st_->check_nccl(state, "asynchronous NCCL work", what_);
    }
    const cudaError_t e = ::mpzero::detail::query_event(event_);
    if (e == cudaErrorNotReady) return false;
    st_->check_cuda(e, "cudaEventQuery", what_);
    release();
    return true;
  }

  // Blocks the host until the operation finished, or throws comm_error at the deadline
  // (after aborting the communicator).
  void wait() {
    if (event_ == nullptr) return;
    st_->check_usable(what_);
    const auto start = detail::clock::now();
    const auto deadline = st_->deadline_from_now();
    detail::backoff b;
    while (!test()) {
      if (detail::clock::now() >= deadline) st_->fail_timeout(what_, start, posted_);
      b.pause();
    }
  }

  // Makes `consumer` wait for the operation without blocking the host.
  void enqueue_wait(cudaStream_t consumer) {
    if (event_ == nullptr) return;
    detail::device_guard g(st_->device);
    st_->check_cuda(cudaStreamWaitEvent(consumer, event_, 0), "cudaStreamWaitEvent", what_);
  }

  bool done() const noexcept { return event_ == nullptr; }
  const std::string& what() const noexcept { return what_; }

 private:
  friend class nccl_communicator;

  void release() noexcept {
    if (event_ != nullptr) {
      cudaEventDestroy(event_);  // safe while pending: freed once the event completes
      event_ = nullptr;
    }
  }

  std::shared_ptr<detail::nccl_state> st_;
  cudaEvent_t event_ = nullptr;
  std::string what_;
  detail::clock::time_point posted_{};
};

class nccl_communicator : public blocking_collectives<nccl_communicator> {
 public:
  using request_type = nccl_request;

  // Collective over `boot`'s ranks: rank 0 makes the ncclUniqueId and ships it.
  template <nccl_bootstrap Bootstrap>
  explicit nccl_communicator(Bootstrap& boot, const nccl_options& opt = {}) {
    // Rank 0 ships a failure flag with the id so that the others do not wait for an id
    // that will never come.
    struct {
      ncclUniqueId id;
      int ok;
    } msg{};
    std::string why;
    if (static_cast<int>(boot.rank()) == 0) {
      const ncclResult_t rc = ncclGetUniqueId(&msg.id);
      msg.ok = rc == ncclSuccess ? 1 : 0;
      if (rc != ncclSuccess) why = ncclGetErrorString(rc);
    }
    boot.broadcast_bytes(&msg, sizeof msg, 0);
    if (msg.ok == 0) {
      throw comm_error("mpzero: ncclGetUniqueId failed on rank 0" + (why.empty() ? std::string() : ": " + why) +
                       "; no NCCL communicator was created (check that rank 0 has a working GPU and NCCL)");
    }
    init(msg.id, static_cast<int>(boot.rank()), static_cast<int>(boot.size()), opt);
  }

  // World size 1, no bootstrap needed.
  explicit nccl_communicator(const nccl_options& opt = {}) {
    ncclUniqueId id{};
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) {
      throw comm_error(std::string("mpzero: ncclGetUniqueId failed: ") + ncclGetErrorString(rc) +
                       "; no NCCL communicator was created");
    }
    init(id, 0, 1, opt);
  }

  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  nccl_communicator(nccl_communicator&&) noexcept = default;
  nccl_communicator& operator=(nccl_communicator&&) noexcept = default;

  int rank() const noexcept { return st_->rank; }
  int size() const noexcept { return st_->size; }
  int device() const noexcept { return st_->device; }
  double timeout_s() const noexcept { return st_->timeout_s; }
  cudaStream_t stream() const noexcept { return st_->stream; }
  ncclComm_t native() const noexcept { return st_->comm; }
  bool usable() const noexcept { return st_->broken.empty(); }

  // Later operations of this communicator wait for the work queued on `producer` so far.
  void wait_for(cudaStream_t producer) {
    st_->check_usable("wait_for");
    detail::device_guard g(st_->device);
    st_->check_cuda(cudaEventRecord(st_->producer_event, producer), "cudaEventRecord", "wait_for");
    st_->check_cuda(cudaStreamWaitEvent(st_->stream, st_->producer_event, 0), "cudaStreamWaitEvent", "wait_for");
  }

  // ---- non-blocking (enqueued on stream()) -----------------------------------------
  template <wire_type T>
  nccl_request iall_reduce(const T* in, T* out, std::uint64_t n, reduce_op op) {
    const std::string what = op_name<T>("all_reduce", op);
    st_->check_usable(what);
    detail::check_same_or_disjoint(in, n, out, n, true, what, "pass in == out or disjoint buffers");
    return enqueue(what, [&](auto note) {
      if (n == 0) return;
      note(ncclAllReduce(in, out, n, detail::nccl_datatype<T>(), detail::nccl_op(op), st_->comm, st_->stream),
           "ncclAllReduce");
    });
  }

  template <wire_type T>
  nccl_request ireduce_scatter_v(const T* in, T* out, std::span<const std::uint64_t> counts, reduce_op op) {
    const std::string what = op_name<T>("reduce_scatter_v", op);
    st_->check_usable(what);
    const std::uint64_t total = detail::checked_total(counts, size(), what);
    const std::uint64_t own_off = detail::offset_of(counts, rank());
    const std::uint64_t own = counts[static_cast<std::size_t>(rank())];
    if (static_cast<const void*>(in + own_off) != static_cast<const void*>(out)) {
      detail::check_same_or_disjoint(in, total, out, own, false, what,
                                     "out may only be in's own block (in + offset of this rank) or disjoint from in");
    }
    const ncclDataType_t type = detail::nccl_datatype<T>();
    return enqueue(what, [&](auto note) {
      if (total == 0) return;
      if (all_equal(counts)) {
        note(ncclReduceScatter(in, out, own, type, detail::nccl_op(op), st_->comm, st_->stream), "ncclReduceScatter");
        return;
      }
      std::uint64_t block = 0;
      for (int owner = 0; owner < size(); ++owner) {
        const std::uint64_t count = counts[static_cast<std::size_t>(owner)];
        if (count != 0) {
          note(ncclReduce(in + block, owner == rank() ? out : nullptr, count, type, detail::nccl_op(op), owner,
                          st_->comm, st_->stream),
               "ncclReduce");
        }
        block += count;
      }
    });
  }

  template <wire_type T>
  nccl_request iall_gather_v(const T* in, std::uint64_t n_in, T* out, std::span<const std::uint64_t> counts) {
    const std::string what = "all_gather_v<" + std::string(wire_name<T>()) + ">";
    st_->check_usable(what);
    const std::uint64_t total = detail::checked_total(counts, size(), what);
    detail::check_count_match(n_in, counts, rank(), what);
    const std::uint64_t own_off = detail::offset_of(counts, rank());
    if (static_cast<const void*>(in) != static_cast<const void*>(out + own_off)) {
      detail::check_same_or_disjoint(in, n_in, out, total, false, what,
                                     "in may only be out's own block (out + offset of this rank) or disjoint");
    }
    const ncclDataType_t type = detail::nccl_datatype<T>();
    return enqueue(what, [&](auto note) {
      if (total == 0) return;
      if (all_equal(counts)) {
        note(ncclAllGather(in, out, n_in, type, st_->comm, st_->stream), "ncclAllGather");
        return;
      }
      std::uint64_t block = 0;
      for (int owner = 0; owner < size(); ++owner) {
        const std::uint64_t count = counts[static_cast<std::size_t>(owner)];
        if (count != 0) {
          const T* send = owner == rank() ? in : out + block;
          note(ncclBroadcast(send, out + block, count, type, owner, st_->comm, st_->stream), "ncclBroadcast");
        }
        block += count;
      }
    });
  }

  template <wire_type T>
  nccl_request ibroadcast(T* data, std::uint64_t n, int root) {
    const std::string what = "broadcast<" + std::string(wire_name<T>()) + ">";
    st_->check_usable(what);
    detail::check_root(root, size(), what);
    return enqueue(what, [&](auto note) {
      if (n == 0) return;
      note(ncclBroadcast(data, data, n, detail::nccl_datatype<T>(), root, st_->comm, st_->stream), "ncclBroadcast");
    });
  }

  // ---- blocking: enqueue, then wait on the host ------------------------------------
  // all_reduce, reduce_scatter_v, all_gather_v and broadcast come from blocking_collectives.
  void barrier() { iall_reduce(st_->scratch, st_->scratch, 1, reduce_op::sum).wait(); }

 private:
  void init(const ncclUniqueId& id, int rank, int size, const nccl_options& opt) {
    const double timeout = opt.timeout_s ? detail::checked_timeout(*opt.timeout_s) : detail::timeout_from_env();
    int device = opt.device;
    if (device < 0) {
      const cudaError_t e = cudaGetDevice(&device);
      if (e != cudaSuccess) {
        throw comm_error(std::string("mpzero: no CUDA device for the NCCL communicator: ") + cudaGetErrorString(e));
      }
    }
    detail::device_guard g(device);
    auto st = std::make_shared<detail::nccl_state>();
    st->rank = rank;
    st->size = size;
    st->device = device;
    // Construction waits under its own deadline; every later wait under `timeout`.
    st->timeout_s = opt.init_timeout_s ? detail::checked_timeout(*opt.init_timeout_s) : timeout;
    if (opt.init_timeout_s) st->timeout_setting = "nccl_options::init_timeout_s";
    const char* op = "communicator construction";
    st->check_cuda(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", op);
    st->check_cuda(cudaEventCreateWithFlags(&st->producer_event, cudaEventDisableTiming), "cudaEventCreateWithFlags",
                   op);
    st->check_cuda(cudaMalloc(reinterpret_cast<void**>(&st->scratch), sizeof(int)), "cudaMalloc", op);
    st->check_cuda(cudaMemset(st->scratch, 0, sizeof(int)), "cudaMemset", op);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that no NCCL call can block the host without our deadline
    st->check_nccl(ncclCommInitRankConfig(&st->comm, size, id, rank, &config), "ncclCommInitRankConfig", op);
    st->wait_ready(op);
    st->timeout_s = timeout;
    st->timeout_setting = opt.timeout_s ? "nccl_options::timeout_s" : "MPZERO_COMM_TIMEOUT_S or nccl_options::timeout_s";
    st_ = std::move(st);
  }

  template <class T>
  static std::string op_name(const char* base, reduce_op op) {
    return std::string(base) + "<" + std::string(wire_name<T>()) + ", " + std::string(name_of(op)) + ">";
  }

  static bool all_equal(std::span<const std::uint64_t> counts) noexcept {
    for (const std::uint64_t c : counts)
      if (c != counts[0]) return false;
    return true;
  }

  // Runs the NCCL calls of one operation as a group, waits until they are enqueued and
  // records the request's event after them. Calls inside the group report through
  // `note`; the first failure is raised only after ncclGroupEnd, because aborting the
  // communicator with a group still open would leave NCCL holding freed state.
  template <class Calls>
  nccl_request enqueue(const std::string& what, Calls&& calls) {
    detail::device_guard g(st_->device);
    nccl_request r;
    r.st_ = st_;
    r.what_ = what;
    r.posted_ = detail::clock::now();
    st_->check_cuda(cudaEventCreateWithFlags(&r.event_, cudaEventDisableTiming), "cudaEventCreateWithFlags", what);
    st_->check_nccl(ncclGroupStart(), "ncclGroupStart", what);
    ncclResult_t first = ncclSuccess;
    const char* first_call = "";
    calls([&](ncclResult_t rc, const char* call) {
      if (rc != ncclSuccess && rc != ncclInProgress && first == ncclSuccess) {
        first = rc;
        first_call = call;
      }
    });
    const ncclResult_t end = ncclGroupEnd();
    st_->check_nccl(first, first_call, what);
    st_->check_nccl(end, "ncclGroupEnd", what);
    st_->wait_ready(what);
    st_->check_cuda(cudaEventRecord(r.event_, st_->stream), "cudaEventRecord", what);
    return r;
  }

  std::shared_ptr<detail::nccl_state> st_;
};

static_assert(communicator<nccl_communicator>);

}  // namespace mpzero::comm

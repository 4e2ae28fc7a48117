// The c10d ProcessGroup communicator (see process_group.hpp for the emulated calls and
// their cost).
#include <mpzero/torch/process_group.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstring>
#include <optional>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace mpzero::torch {

namespace {

at::ScalarType scalar_type_of(wire_dtype t) {
  switch (t) {
    case wire_dtype::f32: return at::kFloat;
    case wire_dtype::f64: return at::kDouble;
    case wire_dtype::bf16: return at::kBFloat16;
    case wire_dtype::fp16: return at::kHalf;
    case wire_dtype::i32: return at::kInt;
    case wire_dtype::u8: return at::kByte;
  }
  return at::kByte;
}

bool is_half(wire_dtype t) { return t == wire_dtype::bf16 || t == wire_dtype::fp16; }

c10d::ReduceOp to_c10d(comm::reduce_op op) {
  return op == comm::reduce_op::sum ? c10d::ReduceOp(c10d::ReduceOp::SUM) : c10d::ReduceOp(c10d::ReduceOp::MAX);
}

// n elements at p (memory of `device`) as a tensor.
at::Tensor view(const void* p, std::uint64_t n, at::ScalarType t, c10::Device device) {
  return ::torch::from_blob(const_cast<void*>(p), {static_cast<std::int64_t>(n)},
                            ::torch::TensorOptions().dtype(t).device(device));
}

// What a communicator's requests share: the group (to abort it at a deadline), the
// deadline, and why the communicator is unusable (empty while it is fine).
struct pg_state {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  double timeout_s = comm::default_timeout_s;
  std::string broken;
  // The name of the backend that serves the communicator's device ("nccl", "gloo", a
  // custom backend's): in a group of several ("cpu:gloo,cuda:nccl") not necessarily the
  // group's default.
  std::string backend;
  // Whether a timed-out call can be stopped: ProcessGroupNCCL aborts its communicators
  // (Work::abort, ProcessGroup::abort). Other backends cannot (Gloo's abort is a no-op;
  // ProcessGroupMPI's joins the worker stuck in the call, a hang): their all-reduce and
  // broadcast get buffers of their own (pg_communicator::iall_reduce, ::ibroadcast; the
  // other calls have theirs anyway), so that a call abandoned at the deadline and
  // completed later by a late peer writes into nothing mpzero frees.
  bool abortable = false;
  std::string where() const {
    return "rank " + std::to_string(pg->getRank()) + " of " + std::to_string(pg->getSize());
  }
  void check_usable(const std::string& op) const {
    if (!broken.empty()) {
      throw comm::comm_error("mpzero: ProcessGroup " + op + " on " + where() +
                             " refused: the communicator failed earlier and is unusable; end the job. Earlier "
                             "failure: " + broken);
    }
  }
};

// A posted ProcessGroup call plus the copies that finish it.
//
// The wait polls Work::isCompleted() under mpzero's deadline (MPZERO_COMM_TIMEOUT_S, as
// every communicator), not c10d's own timeout: with ProcessGroupNCCL, Work::wait() only
// orders the current stream, and the host would then block in the stream's
// synchronization with no limit. At the deadline an NCCL group is aborted (its kernels
// stop; other backends' calls are abandoned, see pg_state::abortable), the communicator
// becomes unusable and comm_error names the call and the setting to raise. A backend's
// Work must report its completion through isCompleted() without a call to wait(), as
// c10d's NCCL, Gloo and MPI works do.
class pg_request final : public request_base {
 public:
  pg_request(std::shared_ptr<pg_state> st, c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
             std::string what, c10::Device device)
      : st_(std::move(st)),
        work_(std::move(work)),
        finish_(std::move(finish)),
        what_(std::move(what)),
        device_(device),
        posted_(comm::detail::clock::now()) {}
  ~pg_request() override {
    // The backend may still read or write our temporaries: wait, never throw. Not on a
    // broken communicator (its call was aborted or abandoned; it may never complete).
    if (done_ || !work_ || !st_->broken.empty()) return;
    try {
      if (poll_until_deadline()) work_->wait();
    } catch (...) {
    }
  }
  void wait() override {
    if (done_) return;
    if (work_) {
      st_->check_usable(what_);
      if (!poll_until_deadline()) {
        done_ = true;
        throw comm::comm_error(st_->broken);
      }
      try {
        work_->wait();  // completed: returns at once, or throws the backend's error
      } catch (const std::exception& e) {
        done_ = true;
        throw comm::comm_error("mpzero: ProcessGroup " + what_ + " failed on " + st_->where() + ": " + e.what());
      }
    }
    done_ = true;
    if (finish_) finish_();
    // mpzero's contract: after wait() the result is in place. For device tensors c10d's
    // wait() (and the copies above) only order torch's current stream; wait for it.
    if (device_.is_cuda()) {
      const auto* g = c10::impl::getDeviceGuardImpl(c10::kCUDA);
      g->synchronizeStream(g->getStream(device_));
    }
  }
  bool test() override {
    if (done_) return true;
    if (work_) {
      st_->check_usable(what_);
      if (!work_->isCompleted()) return false;
    }
    wait();
    return true;
  }

 private:
  // True once the work completed; false at the deadline, with the communicator marked
  // broken and, for NCCL, the call and the group aborted (other backends' calls are
  // abandoned).
  bool poll_until_deadline() {
    const auto start = comm::detail::clock::now();  // the deadline runs from the wait, as in mpi_request
    const auto until = start + std::chrono::duration_cast<comm::detail::clock::duration>(
                                   std::chrono::duration<double>(st_->timeout_s));
    comm::detail::backoff backoff;
    while (!work_->isCompleted()) {
      if (!st_->broken.empty()) return false;  // another request timed out meanwhile
      if (comm::detail::clock::now() >= until) {
        st_->broken = timeout_message(start);
        if (st_->abortable) {  // each on its own: the group's abort must run even if the work's throws
          try {
            work_->abort();
          } catch (...) {  // the message says to end the job either way
          }
          try {
            st_->pg->abort();
          } catch (...) {
          }
        }
        return false;
      }
      backoff.pause();
    }
    return true;
  }
  std::string timeout_message(comm::detail::clock::time_point start) const {
    return "mpzero: ProcessGroup " + what_ + " timed out on " + st_->where() + " after waiting " +
           comm::detail::format_seconds(comm::detail::seconds_since(start)) + " (posted " +
           comm::detail::format_seconds(comm::detail::seconds_since(posted_)) + " ago; timeout " +
           comm::detail::format_seconds(st_->timeout_s) +
           "): a peer rank has stopped or has not reached the matching call. If the peers are only slow, raise "
           "MPZERO_COMM_TIMEOUT_S; otherwise end the job: " +
           (st_->abortable ? std::string("the group was aborted")
                           : "the call was abandoned (backend '" + st_->backend + "' cannot abort it)") +
           " and this communicator is unusable now";
  }

  std::shared_ptr<pg_state> st_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::string what_;
  c10::Device device_;
  comm::detail::clock::time_point posted_;
  bool done_ = false;
};

class pg_communicator final : public communicator_base {
 public:
  pg_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::optional<c10::Device> device)
      : pg_(std::move(pg)), device_(c10::kCPU) {
    if (!pg_) throw mpzero::invalid_argument("mpzero::torch::process_group_communicator: the ProcessGroup is null");
    st_->pg = pg_;
    st_->timeout_s = comm::detail::timeout_from_env();  // a bad value is refused here, before any call
    if (device) {
      device_ = *device;
    } else if (pg_->getBackendName() == "nccl") {  // NCCL reads device memory: the current CUDA device's
      device_ = c10::Device(c10::kCUDA, c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice().index());
    }
    if (!device_.is_cpu() && !device_.is_cuda()) {
      throw mpzero::invalid_argument("mpzero::torch::process_group_communicator: device " + device_.str() +
                                     " is neither the CPU nor a CUDA device; pass torch::kCPU or a CUDA device");
    }
    try {
      st_->backend = pg_->getBackend(device_.type())->getBackendName();
    } catch (...) {  // no backend for this device: the group's own calls will say so
      st_->backend = pg_->getBackendName();
    }
    st_->abortable = st_->backend == "nccl";
  }
  int rank() const override { return pg_->getRank(); }
  int size() const override { return pg_->getSize(); }
  bool reads_device_memory() const override { return device_.is_cuda(); }
  int cuda_device() const override { return device_.is_cuda() ? device_.index() : -1; }
  std::string name() const override {
    return "c10d::ProcessGroup(" + pg_->getBackendName() + ", " + device_.str() + ")";
  }

  std::unique_ptr<request_base> iall_reduce(const void* in, void* out, std::uint64_t n, wire_dtype t,
                                            comm::reduce_op op) override {
    check_usable("allreduce");
    if (n == 0) return ready();
    const at::ScalarType st = scalar_type_of(t);
    at::Tensor buf;
    std::function<void()> finish;
    const c10::Device dev = device_;
    if (is_half(t)) {
      buf = view(in, n, st, dev).to(at::kFloat);  // a copy: the reduction runs in fp32
      finish = [buf, out, n, st, dev] { view(out, n, st, dev).copy_(buf); };
    } else if (st_->abortable) {
      buf = view(out, n, st, dev);
      if (in != out) buf.copy_(view(in, n, st, dev));  // the core never passes overlapping distinct ranges
    } else {  // a buffer of its own (pg_state::abortable), copied out when the call completes
      buf = view(in, n, st, dev).clone();
      finish = [buf, out, n, st, dev] { view(out, n, st, dev).copy_(buf); };
    }
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    return post(pg_->allreduce(ts, o), std::move(finish), "allreduce");
  }

  std::unique_ptr<request_base> ireduce_scatter_v(const void* in, void* out, std::span<const std::uint64_t> counts,
                                                  wire_dtype t, comm::reduce_op op) override {
    check_usable("reduce_scatter_v (allreduce)");
    const std::uint64_t total = comm::detail::checked_total(counts, size(), "reduce_scatter_v");
    if (total == 0) return ready();
    const at::ScalarType st = scalar_type_of(t);
    const std::uint64_t off = comm::detail::offset_of(counts, rank());
    const std::uint64_t mine = counts[static_cast<std::size_t>(rank())];
    // The whole input, reduced everywhere; this rank keeps its block.
    const c10::Device dev = device_;
    at::Tensor buf = is_half(t) ? view(in, total, st, dev).to(at::kFloat) : view(in, total, st, dev).clone();
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto finish = [buf, out, off, mine, st, dev] {
      if (mine > 0) {
        view(out, mine, st, dev).copy_(buf.narrow(0, static_cast<std::int64_t>(off), static_cast<std::int64_t>(mine)));
      }
    };
    return post(pg_->allreduce(ts, o), std::move(finish), "reduce_scatter_v (allreduce)");
  }

  std::unique_ptr<request_base> iall_gather_v(const void* in, std::uint64_t n_in, void* out,
                                              std::span<const std::uint64_t> counts, wire_dtype t) override {
    check_usable("all_gather_v (allgather)");
    comm::detail::checked_total(counts, size(), "all_gather_v");
    comm::detail::check_count_match(n_in, counts, rank(), "all_gather_v");
    const std::uint64_t maxc = *std::max_element(counts.begin(), counts.end());
    if (maxc == 0) return ready();
    const std::size_t esz = wire_size(t);
    // Bytes travel as they are: exact for every type, and every backend gathers bytes.
    const auto bytes = static_cast<std::int64_t>(maxc * esz);
    const c10::Device dev = device_;
    const auto opts = ::torch::TensorOptions().dtype(at::kByte).device(dev);
    at::Tensor input = ::torch::zeros({bytes}, opts);
    if (n_in > 0) input.narrow(0, 0, static_cast<std::int64_t>(n_in * esz)).copy_(view(in, n_in * esz, at::kByte, dev));
    std::vector<at::Tensor> outs;
    for (int r = 0; r < size(); ++r) outs.push_back(::torch::empty({bytes}, opts));
    std::vector<std::vector<at::Tensor>> outputs{outs};
    std::vector<at::Tensor> inputs{input};
    std::vector<std::uint64_t> cs(counts.begin(), counts.end());
    auto work = pg_->allgather(outputs, inputs);
    auto finish = [outs, cs, out, esz, input, dev] {
      std::uint64_t off = 0;
      for (std::size_t r = 0; r < cs.size(); ++r) {
        if (cs[r] > 0) {
          const auto n = static_cast<std::int64_t>(cs[r] * esz);
          view(static_cast<char*>(out) + off * esz, cs[r] * esz, at::kByte, dev).copy_(outs[r].narrow(0, 0, n));
        }
        off += cs[r];
      }
    };
    return post(std::move(work), std::move(finish), "all_gather_v (allgather)");
  }

  std::unique_ptr<request_base> ibroadcast(void* data, std::uint64_t n, wire_dtype t, int root) override {
    check_usable("broadcast");
    comm::detail::check_root(root, size(), "broadcast");
    if (n == 0) return ready();
    at::Tensor buf = view(data, n * wire_size(t), at::kByte, device_);
    std::function<void()> finish;
    if (!st_->abortable) {  // a buffer of its own (pg_state::abortable), copied back when the call completes
      buf = buf.clone();
      finish = [buf, data, n, t, dev = device_] { view(data, n * wire_size(t), at::kByte, dev).copy_(buf); };
    }
    std::vector<at::Tensor> ts{buf};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return post(pg_->broadcast(ts, o), std::move(finish), "broadcast");
  }

  void barrier() override {
    check_usable("barrier");
    post(pg_->barrier(), {}, "barrier")->wait();
  }

 private:
  std::unique_ptr<request_base> ready() const {
    return std::make_unique<pg_request>(st_, c10::intrusive_ptr<c10d::Work>(), std::function<void()>{}, "",
                                        c10::Device(c10::kCPU));
  }
  std::unique_ptr<request_base> post(c10::intrusive_ptr<c10d::Work> w, std::function<void()> finish,
                                     const char* what) const {
    return std::make_unique<pg_request>(st_, std::move(w), std::move(finish), what, device_);
  }
  // Before anything is posted on a group that an earlier timeout aborted.
  void check_usable(const char* op) const { st_->check_usable(op); }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<pg_state> st_ = std::make_shared<pg_state>();
  c10::Device device_;  // where the buffers the core passes live
};

}  // namespace

std::shared_ptr<communicator_base> make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                                   std::optional<c10::Device> device) {
  return std::make_shared<pg_communicator>(std::move(pg), device);
}

}  // namespace mpzero::torch

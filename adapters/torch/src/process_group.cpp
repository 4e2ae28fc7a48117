// The c10d ProcessGroup communicator (see process_group.hpp for the emulated calls and
// their cost).
#include <mpzero/torch/process_group.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
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

at::Tensor view(const void* p, std::uint64_t n, at::ScalarType t) {
  return ::torch::from_blob(const_cast<void*>(p), {static_cast<std::int64_t>(n)}, ::torch::TensorOptions().dtype(t));
}

// A posted ProcessGroup call plus the copies that finish it.
class pg_request final : public request_base {
 public:
  pg_request(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish, std::string what, int rank, int size)
      : work_(std::move(work)), finish_(std::move(finish)), what_(std::move(what)), rank_(rank), size_(size) {}
  ~pg_request() override {
    // The backend may still read or write our temporaries: wait, never throw.
    if (!done_ && work_) {
      try {
        work_->wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (done_) return;
    try {
      if (work_) work_->wait();
    } catch (const std::exception& e) {
      done_ = true;
      throw comm::comm_error("mpzero: ProcessGroup " + what_ + " failed on rank " + std::to_string(rank_) + " of " +
                             std::to_string(size_) + ": " + e.what());
    }
    done_ = true;
    if (finish_) finish_();
  }
  bool test() override {
    if (done_) return true;
    if (work_ && !work_->isCompleted()) return false;
    wait();
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::string what_;
  int rank_, size_;
  bool done_ = false;
};

class pg_communicator final : public communicator_base {
 public:
  explicit pg_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg) : pg_(std::move(pg)) {
    if (!pg_) throw mpzero::invalid_argument("mpzero::torch::process_group_communicator: the ProcessGroup is null");
  }
  int rank() const override { return pg_->getRank(); }
  int size() const override { return pg_->getSize(); }
  std::string name() const override { return "c10d::ProcessGroup(" + pg_->getBackendName() + ")"; }

  std::unique_ptr<request_base> iall_reduce(const void* in, void* out, std::uint64_t n, wire_dtype t,
                                            comm::reduce_op op) override {
    if (n == 0) return ready();
    const at::ScalarType st = scalar_type_of(t);
    at::Tensor buf;
    std::function<void()> finish;
    if (is_half(t)) {
      buf = view(in, n, st).to(at::kFloat);  // a copy: the reduction runs in fp32
      finish = [buf, out, n, st] { view(out, n, st).copy_(buf); };
    } else {
      if (in != out) std::memmove(out, in, n * wire_size(t));
      buf = view(out, n, st);
    }
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    return post(pg_->allreduce(ts, o), std::move(finish), "allreduce");
  }

  std::unique_ptr<request_base> ireduce_scatter_v(const void* in, void* out, std::span<const std::uint64_t> counts,
                                                  wire_dtype t, comm::reduce_op op) override {
    const std::uint64_t total = comm::detail::checked_total(counts, size(), "reduce_scatter_v");
    if (total == 0) return ready();
    const at::ScalarType st = scalar_type_of(t);
    const std::uint64_t off = comm::detail::offset_of(counts, rank());
    const std::uint64_t mine = counts[static_cast<std::size_t>(rank())];
    // The whole input, reduced everywhere; this rank keeps its block.
    at::Tensor buf = is_half(t) ? view(in, total, st).to(at::kFloat) : view(in, total, st).clone();
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    auto finish = [buf, out, off, mine, st] {
      if (mine > 0) view(out, mine, st).copy_(buf.narrow(0, static_cast<std::int64_t>(off), static_cast<std::int64_t>(mine)));
    };
    return post(pg_->allreduce(ts, o), std::move(finish), "reduce_scatter_v (allreduce)");
  }

  std::unique_ptr<request_base> iall_gather_v(const void* in, std::uint64_t n_in, void* out,
                                              std::span<const std::uint64_t> counts, wire_dtype t) override {
    comm::detail::checked_total(counts, size(), "all_gather_v");
    comm::detail::check_count_match(n_in, counts, rank(), "all_gather_v");
    const std::uint64_t maxc = *std::max_element(counts.begin(), counts.end());
    if (maxc == 0) return ready();
    const std::size_t esz = wire_size(t);
    // Bytes travel as they are: exact for every type, and every backend gathers bytes.
    const auto bytes = static_cast<std::int64_t>(maxc * esz);
    at::Tensor input = ::torch::zeros({bytes}, at::kByte);
    if (n_in > 0) std::memcpy(input.data_ptr(), in, n_in * esz);
    std::vector<at::Tensor> outs;
    for (int r = 0; r < size(); ++r) outs.push_back(::torch::empty({bytes}, at::kByte));
    std::vector<std::vector<at::Tensor>> outputs{outs};
    std::vector<at::Tensor> inputs{input};
    std::vector<std::uint64_t> cs(counts.begin(), counts.end());
    auto work = pg_->allgather(outputs, inputs);
    auto finish = [outs, cs, out, esz, input] {
      std::uint64_t off = 0;
      for (std::size_t r = 0; r < cs.size(); ++r) {
        if (cs[r] > 0) std::memcpy(static_cast<char*>(out) + off * esz, outs[r].data_ptr(), cs[r] * esz);
        off += cs[r];
      }
    };
    return post(std::move(work), std::move(finish), "all_gather_v (allgather)");
  }

  std::unique_ptr<request_base> ibroadcast(void* data, std::uint64_t n, wire_dtype t, int root) override {
    comm::detail::check_root(root, size(), "broadcast");
    if (n == 0) return ready();
    std::vector<at::Tensor> ts{view(data, n * wire_size(t), at::kByte)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return post(pg_->broadcast(ts, o), {}, "broadcast");
  }

  void barrier() override { post(pg_->barrier(), {}, "barrier")->wait(); }

 private:
  std::unique_ptr<request_base> ready() const {
    return std::make_unique<pg_request>(c10::intrusive_ptr<c10d::Work>(), std::function<void()>{}, "", rank(), size());
  }
  std::unique_ptr<request_base> post(c10::intrusive_ptr<c10d::Work> w, std::function<void()> finish,
                                     const char* what) const {
    return std::make_unique<pg_request>(std::move(w), std::move(finish), what, rank(), size());
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
};

}  // namespace

std::shared_ptr<communicator_base> make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  return std::make_shared<pg_communicator>(std::move(pg));
}

}  // namespace mpzero::torch

// A c10d ProcessGroup over an MPI communicator (CPU tensors, synchronous), standing in
// for Gloo, whose headers the PyPI wheel does not ship. Include after torch_mpi.hpp.
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <mpi.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace mpzero::testing {

struct done_work : c10d::Work {
  done_work() { finish(); }
};

inline MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kByte: return MPI_UINT8_T;
    default: throw std::runtime_error("mpi backend: unsupported dtype");
  }
}

inline int comm_rank(MPI_Comm c) {
  int r = 0;
  MPI_Comm_rank(c, &r);
  return r;
}
inline int comm_size(MPI_Comm c) {
  int n = 0;
  MPI_Comm_size(c, &n);
  return n;
}

// The backend over `comm`, which must outlive it.
struct mpi_backend : c10d::Backend {
  explicit mpi_backend(MPI_Comm comm) : Backend(comm_rank(comm), comm_size(comm)), comm_(comm) {}
  const std::string getBackendName() const override { return "test-mpi"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    for (auto& t : ts) {
      MPI_Op op = o.reduceOp == c10d::ReduceOp::SUM ? MPI_SUM : MPI_MAX;
      MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), mpi_type(t.scalar_type()), op, comm_);
    }
    return c10::make_intrusive<done_work>();
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outs, std::vector<at::Tensor>& ins,
                                           const c10d::AllgatherOptions&) override {
    const auto n = static_cast<int>(ins[0].nbytes());
    const int w = comm_size(comm_);
    std::vector<char> all(static_cast<std::size_t>(n) * static_cast<std::size_t>(w));
    MPI_Allgather(ins[0].data_ptr(), n, MPI_BYTE, all.data(), n, MPI_BYTE, comm_);
    for (int r = 0; r < w; ++r) std::memcpy(outs[0][r].data_ptr(), all.data() + static_cast<std::size_t>(r) * n, n);
    return c10::make_intrusive<done_work>();
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts, const c10d::BroadcastOptions& o) override {
    for (auto& t : ts) MPI_Bcast(t.data_ptr(), static_cast<int>(t.nbytes()), MPI_BYTE, static_cast<int>(o.rootRank), comm_);
    return c10::make_intrusive<done_work>();
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    MPI_Barrier(comm_);
    return c10::make_intrusive<done_work>();
  }

 private:
  MPI_Comm comm_;
};

// A ProcessGroup of `comm`'s ranks, served by mpi_backend.
inline c10::intrusive_ptr<c10d::ProcessGroup> mpi_process_group(MPI_Comm comm) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(comm_rank(comm), comm_size(comm));
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, c10::make_intrusive<mpi_backend>(comm));
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return pg;
}

}  // namespace mpzero::testing

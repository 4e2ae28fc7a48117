// mpzero::torch: a c10d ProcessGroup (Gloo, NCCL, MPI, a custom backend) as the
// engine's communicator.
//
//   auto engine = mpzero::torch::initialize(model, cfg, mpzero::torch::process_group_communicator(pg));
//
// It uses only the ProcessGroup calls every backend implements (allreduce, allgather of
// equal sizes, broadcast, barrier), so the core's uneven collectives are emulated:
//  - reduce_scatter_v: an allreduce of the whole input, then a copy of this rank's
//    block: 2 x (W-1)/W x total elements on the wire instead of (W-1)/W x total, and a
//    temporary of the whole input.
//  - all_gather_v: an allgather of blocks padded to the largest count, then compacted:
//    at most W x max(counts) elements instead of sum(counts); exact bits.
//  - bf16/fp16 reductions run in fp32 (converted in and out: twice the bytes) and are
//    rounded to 16 bits once, at the end. The fp32 partial sums follow the backend's
//    order, so from 3 ranks up the bits may differ from mpi_communicator's and
//    nccl_communicator's, which round after every pairwise combine.
//  - when another backend than NCCL serves the communicator's device (in a group of
//    several, "cpu:gloo,cuda:nccl", the device's backend counts, not the group's
//    default), all-reduce and broadcast also run on a copy of their
//    own (one more pass over the data): a call abandoned at the deadline (below) that a
//    late peer completes then writes into nothing the core has freed.
// Operations run asynchronously on the backend; wait() finishes the copies. Waits run
// under mpzero's deadline (MPZERO_COMM_TIMEOUT_S, read when the communicator is made),
// polling Work::isCompleted() (a custom backend's Work must report completion there
// without a call to wait(), as c10d's NCCL, Gloo and MPI works do): at the deadline an
// NCCL group is aborted (Work::abort, ProcessGroup::abort), other backends' calls are
// abandoned, and comm_error is thrown; the communicator is then unusable. Two limits:
// c10d's NCCL watchdog acts first when the group's own timeout is the shorter (and by
// default tears the process down), and a group that connects lazily blocks inside its
// first call, before any deadline runs.
// Buffers: the core's memory, as tensors on `device`: by default the CPU, or, for a
// group whose backend is "nccl", the current CUDA device (an engine on CUDA parameters
// needs a group that takes device tensors: NCCL, or Gloo given the device explicitly).
// With NCCL, c10d orders each collective after torch's current stream and wait() makes
// that stream wait for it: the engine's core runs on that stream (see engine.hpp).
#pragma once

#include <memory>
#include <optional>

#include <c10/core/Device.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <mpzero/torch/communicator.hpp>

namespace mpzero::torch {

// The communicator_base over a ProcessGroup; the group is kept alive.
// device: where the buffers live (default: see above).
std::shared_ptr<communicator_base> make_process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                                   std::optional<c10::Device> device = std::nullopt);

inline any_communicator process_group_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                   std::optional<c10::Device> device = std::nullopt) {
  return any_communicator(make_process_group_communicator(std::move(pg), device));
}

}  // namespace mpzero::torch

// mpzero::torch: a communicator chosen at run time: the core's comm::any_communicator
// (comm/any.hpp) under the adapter's names, and the adapter's device check.
//
// Torch-free: this header needs only the core.
#pragma once

#include <string>

#include <mpzero/comm/any.hpp>
#include <mpzero/error.hpp>

namespace mpzero::torch {

using comm::any_communicator;
using comm::any_request;
using comm::communicator_adapter;
using comm::communicator_base;
using comm::request_base;
using comm::wire_dtype;
using comm::wire_of;
using comm::wire_size;

namespace detail {

// An engine whose parameters are on CUDA device `device` refuses a communicator bound to
// another device: its collectives would read the parameters' memory from the wrong GPU
// (an illegal address, or reads unordered with the engine's stream).
inline void require_communicator_device(const communicator_base& c, int device) {
  const int d = c.cuda_device();
  if (d >= 0 && d != device) {
    throw mpzero::invalid_argument(
        "mpzero::torch: the parameters are on CUDA device " + std::to_string(device) + ", but the communicator '" +
        c.name() + "' works on CUDA device " + std::to_string(d) +
        ". Create it with that device current (cudaSetDevice(" + std::to_string(device) +
        ") or c10::cuda::set_device before nccl_communicator / the ProcessGroup), or move the model to cuda:" +
        std::to_string(d));
  }
}

}  // namespace detail

}  // namespace mpzero::torch

// Shared by the LibTorch engine tests that run under mpirun: LibTorch's headers in the
// order they need, Catch, and the MPI world as the engine's communicator.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>
// LibTorch's logging defines CHECK (glog style); the tests mean Catch's.
#undef CHECK
#include <catch2/catch.hpp>
#include <mpi.h>

#include <mpzero/comm/mpi.hpp>
#include <mpzero/torch/engine.hpp>

namespace mpzero::testing {

// MPI_COMM_WORLD, with a 60 s deadline so that a test that goes wrong ends instead of hanging.
inline mpzero::comm::mpi_communicator& world() {
  static mpzero::comm::mpi_communicator c(MPI_COMM_WORLD, mpzero::comm::mpi_options{60.0});
  return c;
}
inline int W() { return world().size(); }
inline int R() { return world().rank(); }

}  // namespace mpzero::testing

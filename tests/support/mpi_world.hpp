// MPI_COMM_WORLD as an mpzero communicator, for the tests that run under mpirun.
#pragma once

#include <mpi.h>

#include <mpzero/comm/mpi.hpp>

namespace mpzero::testing {

// A 60 s deadline on every wait, so that a test that goes wrong ends instead of hanging.
inline mpzero::comm::mpi_communicator& world() {
  static mpzero::comm::mpi_communicator c(MPI_COMM_WORLD, mpzero::comm::mpi_options{60.0});
  return c;
}
inline int W() { return world().size(); }
inline int R() { return world().rank(); }

}  // namespace mpzero::testing
